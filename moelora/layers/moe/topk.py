"""The MoE block's first stage, TopK: the router (a LoRA-able Linear) and the top-k expert selection of
every MoE family we serve.

Selection (moelora/kernels/topk.py's `select_experts`) runs on CUDA as one Triton kernel where it covers the
config, otherwise as plain torch ops; both keep fixed shapes and never synchronise with the host, so they run
inside CUDA graphs.
"""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import LoRABatch, TopKConfig, TopKOutput
from moelora.kernels.topk import select_experts
from moelora.layers.linear import Linear


class TopK(Linear):
    """x [T, H] -> TopKOutput (weights float32 [T, k], ids int32 [T, k] of global experts, best first).

    Its parameters carry the checkpoints' names under `mlp.gate`: `weight` (the router [E, H], LoRA-able as
    "mlp.gate") and, for DeepSeek-V3, `e_score_correction_bias` [E] (fp32), which shifts the choice of
    experts but not their weights."""

    def __init__(self, hidden_size: int, num_experts: int, config: TopKConfig, layer_id: int,
                 correction_bias: bool = False):
        super().__init__(hidden_size, num_experts, part_names=("mlp.gate",), layer_id=layer_id)
        self.config = config
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
                                        if correction_bias else None)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> TopKOutput:
        return select_experts(super().forward(x, lora), self.config, self.e_score_correction_bias)
