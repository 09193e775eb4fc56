"""The MoE block's second stage, Dispatcher: the routing's global expert ids -> the ids of this rank's
experts. The seam where expert parallelism plugs in: a rank holding experts [first, first + n) keeps
those pairs (ids - first) and marks the others -1, which the Runner's kernels skip (their output is 0,
and Combine's reduction over the ranks adds the other ranks' parts). On one GPU it is the identity.
"""
from __future__ import annotations

import torch

from moelora.core import TopKOutput


class Dispatcher:
    def __init__(self, num_experts: int, first_local: int = 0, num_local: int | None = None):
        num_local = num_experts - first_local if num_local is None else num_local
        if not (0 <= first_local and 0 < num_local and first_local + num_local <= num_experts):
            raise ValueError(f"local experts [{first_local}, {first_local + num_local}) are not within the "
                             f"{num_experts} experts")
        self.num_experts, self.first_local, self.num_local = num_experts, first_local, num_local

    @property
    def is_identity(self) -> bool:
        return self.num_local == self.num_experts

    def __call__(self, topk: TopKOutput) -> TopKOutput:
        """Same shapes, no host sync (CUDA-graph safe); the routing weights are kept as they are."""
        if self.is_identity:
            return topk
        local = topk.ids - self.first_local
        ids = torch.where((local >= 0) & (local < self.num_local), local, torch.full_like(local, -1))
        return TopKOutput(topk.weights, ids)
