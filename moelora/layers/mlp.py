"""The SiLU-gated MLP of dense decoder layers and of shared experts; gate and up run as one
Linear of two parts, each with its own LoRA name. Under tensor parallelism gate/up is column-parallel
(each rank its share of the intermediate dimension) and down row-parallel."""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import LoRABatch
from moelora.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str, layer_id: int, reduce_output: bool = True):
        """prefix: the module's name in the decoder layer ('mlp', 'mlp.shared_expert', 'mlp.shared_experts').
        reduce_output=False: return this rank's partial sum, for a caller that reduces it with others (the MoE
        block's Combine, with the routed experts' partial sums)."""
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, (intermediate_size, intermediate_size), parallel="column",
                                   part_names=(f"{prefix}.gate_proj", f"{prefix}.up_proj"), layer_id=layer_id)
        self.down_proj = Linear(intermediate_size, hidden_size, part_names=(f"{prefix}.down_proj",), layer_id=layer_id,
                                parallel="row", reduce_output=reduce_output)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up, lora)
