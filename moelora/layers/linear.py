"""Linear layer with the LoRA deltas of every token's adapter slot.

The base projection is `moelora.kernels.linear`, whose rows do not depend on the batch on CUDA
(cuBLAS's do). The output may be made of parts (fused q/k/v: three). `part_names` are the checkpoint's
module names of the parts relative to the decoder layer ("self_attn.q_proj", ...): the loader fills each
part from the checkpoint tensor of that name, and adapters, which name modules as checkpoints do, target
the same names, so the LoRA manager can fill the layer's slot buffers from any adapter. A Linear without
part names has no LoRA. `lora` stays None until the manager sets it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moelora.core import LinearLoRASlots, LoRABatch
from moelora.kernels.linear import linear
from moelora.kernels.lora_linear import align_tokens_by_slot, lora_linear


class Linear(nn.Module):
    def __init__(self, in_features: int, out_sizes: int | Sequence[int], bias: bool = False,
                 part_names: Sequence[str] = (), layer_id: int | None = None):
        super().__init__()
        self.out_sizes = (out_sizes,) if isinstance(out_sizes, int) else tuple(out_sizes)
        if part_names and len(part_names) != len(self.out_sizes):
            raise ValueError(f"{len(part_names)} part names for {len(self.out_sizes)} output parts")
        self.in_features, self.out_features = in_features, sum(self.out_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.part_names, self.layer_id = tuple(part_names), layer_id
        self.lora: LinearLoRASlots | None = None

    def forward(self, x: torch.Tensor, lora_batch: LoRABatch | None = None) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if self.lora is not None and lora_batch is not None:
            # in place: adapter rows get y + delta summed in fp32; other rows keep the base bits
            n = self.lora.num_slots  # the Triton path groups the tokens by slot, once for all layers of the step
            blocks = lora_batch.derived(("slot_blocks", n), lambda s: align_tokens_by_slot(s, n)) if x.is_cuda else None
            lora_linear(x, self.lora, self.out_sizes, lora_batch.token_slots, out=y, blocks=blocks)
        return y
