"""The MoE block of a decoder layer (its `mlp`), in the four stages every MoE engine has:

    TopK (router + expert selection) -> Dispatcher (global -> this rank's expert ids)
      -> Runner (grouped expert GEMMs with per-expert LoRA, weighted top-k sum) -> Combine (shared experts)

Parameter names: `gate.weight` and `gate.e_score_correction_bias` (the checkpoints' own), `experts.w13`,
`experts.w2` (the routed experts, stacked), and the shared experts' Linears under `combine`.
"""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import LoRABatch, TopKConfig
from moelora.layers.mlp import MLP
from moelora.layers.moe.combine import Combine
from moelora.layers.moe.dispatcher import Dispatcher
from moelora.layers.moe.runner import Runner
from moelora.layers.moe.topk import TopK


class MoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, topk: TopKConfig, layer_id: int,
                 shared_experts: MLP | None = None, shared_expert_gate: bool = False, correction_bias: bool = False,
                 backend: str = "auto"):
        super().__init__()
        self.layer_id = layer_id
        self.gate = TopK(hidden_size, num_experts, topk, layer_id, correction_bias)
        self.dispatcher = Dispatcher(num_experts)
        self.experts = Runner(hidden_size, intermediate_size, self.dispatcher.num_local, layer_id, backend)
        self.combine = Combine(hidden_size, layer_id, shared_experts, shared_expert_gate)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        routed = self.experts(x, self.dispatcher(self.gate(x, lora)), lora)
        return self.combine(x, routed, lora)
