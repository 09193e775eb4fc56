"""The MoE block's last stage, Combine: the routed experts' output plus the shared experts some families
send every token through (Qwen2-MoE scales theirs by sigmoid(x . g)). Under tensor or expert parallelism
this is also where the ranks' partial sums are reduced."""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import LoRABatch
from moelora.layers.linear import Linear
from moelora.layers.mlp import MLP


class Combine(nn.Module):
    def __init__(self, hidden_size: int, layer_id: int, shared_experts: MLP | None = None,
                 shared_expert_gate: bool = False):
        super().__init__()
        if shared_expert_gate and shared_experts is None:
            raise ValueError("a shared_expert_gate needs shared_experts")
        self.shared_experts = shared_experts
        self.shared_expert_gate = (Linear(hidden_size, 1, part_names=("mlp.shared_expert_gate",), layer_id=layer_id)
                                   if shared_expert_gate else None)

    def forward(self, x: torch.Tensor, routed: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """x [T, H] the block's input, routed [T, H] the Runner's output -> the block's output [T, H]."""
        if self.shared_experts is None:
            return routed
        shared = self.shared_experts(x, lora)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x, lora)) * shared
        return routed + shared
