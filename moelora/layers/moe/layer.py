"""The MoE block of a decoder layer (its `mlp`): router, top-k, routed experts with per-expert
LoRA, and the shared experts some families add to every token."""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import ExpertLoRASlots, LoRABatch, TopKConfig
from moelora.kernels.fused_moe import fused_moe
from moelora.layers.linear import Linear
from moelora.layers.mlp import MLP
from moelora.layers.moe.topk import select_experts


class MoE(nn.Module):
    """Experts stacked as w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].

    shared_experts: an MLP every token goes through (Qwen2-MoE, DeepSeek); shared_expert_gate: Qwen2-MoE
    scales it by sigmoid(x . g). correction_bias: DeepSeek-V3's e_score_correction_bias (fp32), which
    shifts the choice of experts but not their weights. `lora` stays None until the LoRA manager sets it.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, topk: TopKConfig, layer_id: int,
                 shared_experts: MLP | None = None, shared_expert_gate: bool = False, correction_bias: bool = False):
        super().__init__()
        self.hidden_size, self.intermediate_size, self.num_experts = hidden_size, intermediate_size, num_experts
        self.topk, self.layer_id = topk, layer_id
        self.gate = Linear(hidden_size, num_experts, lora_names=("mlp.gate",), layer_id=layer_id)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
                                        if correction_bias else None)
        self.shared_experts = shared_experts
        self.shared_expert_gate = (Linear(hidden_size, 1, lora_names=("mlp.shared_expert_gate",), layer_id=layer_id)
                                   if shared_expert_gate else None)
        self.lora: ExpertLoRASlots | None = None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        topk = select_experts(self.gate(x, lora), self.topk, self.e_score_correction_bias)
        with_lora = lora is not None and self.lora is not None
        y = fused_moe(x, self.w13, self.w2, topk, self.lora if with_lora else None, lora.token_slots if with_lora else None)
        if self.shared_experts is not None:
            shared = self.shared_experts(x, lora)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x, lora)) * shared
            y = y + shared
        return y
