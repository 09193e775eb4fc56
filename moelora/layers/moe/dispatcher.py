"""The MoE block's second stage, Dispatcher: which (token, expert) pairs this rank's experts run, and how
their results get back to the tokens. On one GPU it is the identity.

The base Dispatcher serves expert parallelism by all-reduce: every rank sees every token (attention is
tensor-parallel, so the hidden states are replicated), keeps the pairs of the experts [first, first + n) it
holds (ids - first) and marks the others -1, which the Runner's kernels skip (their output is 0, and
Combine's all-reduce adds the other ranks' parts). AllToAllDispatcher (all_to_all.py) instead sends each token
to the ranks that hold its experts.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from moelora.core import LoRABatch, TopKOutput


class Dispatched(NamedTuple):
    """What the Runner runs: hidden states, routing with this rank's expert ids (-1: not here), and the LoRA
    slots of its rows; `route` is what Dispatcher.combine needs to bring the results back."""
    x: torch.Tensor
    topk: TopKOutput
    lora: LoRABatch | None
    route: Any = None


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
        """Global expert ids -> this rank's (-1: not here). Same shapes, no host sync (CUDA-graph safe); the
        routing weights are kept as they are."""
        if self.is_identity:
            return topk
        local = topk.ids - self.first_local
        ids = torch.where((local >= 0) & (local < self.num_local), local, torch.full_like(local, -1))
        return TopKOutput(topk.weights, ids)

    def dispatch(self, x: torch.Tensor, topk: TopKOutput, lora: LoRABatch | None) -> Dispatched:
        """x [T, H], topk of global expert ids, the tokens' LoRA slots -> what this rank's Runner runs."""
        return Dispatched(x, self(topk), lora)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The Runner's output on `dispatched` -> this rank's partial sum of the routed experts [T, H]."""
        return y
