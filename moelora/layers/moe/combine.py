"""The MoE block's last stage, Combine: the routed experts' output plus the shared experts some families
send every token through (Qwen2-MoE scales theirs by sigmoid(x . g)). Under tensor or expert parallelism
this is also where the ranks' partial sums are reduced: the routed experts' and the shared experts' (whose
down projection leaves its partial sum here) in one all-reduce."""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import LoRABatch
from moelora.distributed.state import get_parallel
from moelora.layers.collectives import all_reduce
from moelora.layers.linear import Linear
from moelora.layers.mlp import MLP


class Combine(nn.Module):
    def __init__(self, hidden_size: int, layer_id: int, shared_experts: MLP | None = None,
                 shared_expert_gate: bool = False):
        super().__init__()
        if shared_expert_gate and shared_experts is None:
            raise ValueError("a shared_expert_gate needs shared_experts")
        if shared_experts is not None and shared_experts.down_proj.reduce_output:
            raise ValueError("shared experts must leave their partial sums to Combine (MLP(..., reduce_output=False))")
        self.shared_experts = shared_experts
        self.dist_state = get_parallel()
        self.shared_expert_gate = (Linear(hidden_size, 1, part_names=("mlp.shared_expert_gate",), layer_id=layer_id)
                                   if shared_expert_gate else None)

    def forward(self, x: torch.Tensor, routed: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """x [T, H] the block's input, routed [T, H] the routed experts' output (this rank's partial sum) -> the
        block's output [T, H]."""
        if self.shared_experts is None:
            return all_reduce(self.dist_state, routed)
        shared = self.shared_experts(x, lora)
        if self.shared_expert_gate is not None:  # replicated: scales each rank's partial sum alike
            shared = torch.sigmoid(self.shared_expert_gate(x, lora)) * shared
        return all_reduce(self.dist_state, routed + shared)
