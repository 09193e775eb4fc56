"""The MoE block's third stage, Runner: the routed experts' grouped GEMMs with the per-expert LoRA of every
token's adapter, on the backend the config names. The weighted top-k sum is fused into the kernels' last
step (a separate pass would read every expert output again), so the Runner returns y [T, H] per token.

Backends: "triton" (moelora/kernels/fused_moe, CUDA), "torch" (its reference, any device), "auto" (triton on
CUDA, torch elsewhere). Quantized backends would be further names here.
"""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import ExpertLoRASlots, LoRABatch, TopKOutput
from moelora.distributed.sharding import size_of
from moelora.kernels.fused_moe import fused_moe

BACKENDS = ("auto", "triton", "torch")


class Runner(nn.Module):
    """The experts this rank holds, stacked as w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]:
    experts `experts` of the layer's num_experts (by default all) and rows `inter` of each one's
    intermediate_size (by default all; a share under expert-group tensor parallelism, when the output is a
    partial sum). `lora` (the experts' LoRA slot buffers, of the same experts and rows) stays None until the
    LoRA manager allocates it."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, layer_id: int,
                 backend: str = "auto", experts: slice | None = None, inter: slice | None = None):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"MoE backend must be one of {BACKENDS}, got {backend!r}")
        self.experts = experts or slice(0, num_experts)
        self.inter = inter or slice(0, intermediate_size)
        self.total_experts, self.full_intermediate_size = num_experts, intermediate_size
        # what the kernels and slot buffers see: this rank's experts and rows
        self.hidden_size, self.intermediate_size = hidden_size, size_of(self.inter)
        self.num_experts = size_of(self.experts)
        self.layer_id, self.backend = layer_id, backend
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden_size, self.intermediate_size), requires_grad=False)
        self.lora: ExpertLoRASlots | None = None

    def forward(self, x: torch.Tensor, topk: TopKOutput, lora: LoRABatch | None) -> torch.Tensor:
        """x [T, H], topk with local expert ids (-1: not here) -> sum_j w[t, j] * expert_j(x[t]) [T, H]."""
        if lora is None or self.lora is None:
            return fused_moe(x, self.w13, self.w2, topk, impl=self.backend)
        return fused_moe(x, self.w13, self.w2, topk, self.lora, lora.token_slots, impl=self.backend)
