"""Linear layer with the LoRA deltas of every token's adapter slot, whole or split over tensor-parallel ranks.

The base projection is `moelora.kernels.linear`, whose rows do not depend on the batch on CUDA
(cuBLAS's do). The output may be made of parts (fused q/k/v: three). `part_names` are the checkpoint's
module names of the parts relative to the decoder layer ("self_attn.q_proj", ...): the loader fills each
part from the checkpoint tensor of that name, and adapters, which name modules as checkpoints do, target
the same names, so the LoRA manager can fill the layer's slot buffers from any adapter. A Linear without
part names has no LoRA. `lora` stays None until the manager sets it.

Tensor parallel (the current `moelora.distributed` state): a "column" layer holds rows out_shards[p] of each
part p (by default its even share; attention passes the heads it holds) and outputs its shard; a "row" layer
holds its share of the input columns and outputs a partial sum, all-reduced here, or by the caller with other
partial sums (reduce_output=False). LoRA follows the weight: column layers hold the shard of each part's B
(A whole), row layers their share of A's columns (B whole), so a row layer's partial delta goes into the same
all-reduce as its partial projection. The bias of a row layer is added on rank 0 alone. At one rank every
shard is the whole and the all-reduce the identity.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from moelora.core import LinearLoRASlots, LoRABatch
from moelora.distributed.sharding import even_shard, size_of
from moelora.distributed.state import get_parallel
from moelora.kernels.linear import linear
from moelora.kernels.lora_linear import align_tokens_by_slot, lora_linear
from moelora.layers.collectives import all_reduce

Parallel = Literal["replicated", "column", "row"]


class Linear(nn.Module):
    def __init__(self, in_features: int, out_sizes: int | Sequence[int], bias: bool = False,
                 part_names: Sequence[str] = (), layer_id: int | None = None, parallel: Parallel = "replicated",
                 out_shards: Sequence[slice] | None = None, reduce_output: bool = True):
        """in_features and out_sizes: the whole layer's (the checkpoint's)."""
        super().__init__()
        full_sizes = (out_sizes,) if isinstance(out_sizes, int) else tuple(out_sizes)
        if part_names and len(part_names) != len(full_sizes):
            raise ValueError(f"{len(part_names)} part names for {len(full_sizes)} output parts")
        state, what = get_parallel(), ", ".join(part_names) or "a linear layer"
        self.full_in_features, self.full_out_sizes = in_features, full_sizes
        self.parallel, self.reduce_output = parallel, reduce_output
        self.in_shard = (even_shard(in_features, state.tp_size, state.rank, f"the input of {what}")
                         if parallel == "row" else slice(0, in_features))
        if parallel == "column":
            out_shards = out_shards or [even_shard(n, state.tp_size, state.rank, f"the output of {what}")
                                        for n in full_sizes]
        else:
            out_shards = [slice(0, n) for n in full_sizes]
        self.out_shards = tuple(out_shards)  # rows of each whole part this rank holds
        self.out_sizes = tuple(size_of(s) for s in self.out_shards)
        self.in_features, self.out_features = size_of(self.in_shard), sum(self.out_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self._adds_bias = parallel != "row" or state.rank == 0  # a row layer's partial sums get it once
        self.dist_state = state  # its collectives' ranks, whatever state is current when it runs
        self.part_names, self.layer_id = tuple(part_names), layer_id
        self.lora: LinearLoRASlots | None = None

    def forward(self, x: torch.Tensor, lora_batch: LoRABatch | None = None) -> torch.Tensor:
        bias = self.bias if self._adds_bias else None
        if self.lora is not None and lora_batch is not None:
            # adapter rows get their delta summed in fp32; other rows keep the base bits
            n = self.lora.num_slots  # the Triton path groups the tokens by slot, once for all layers of the step
            blocks = lora_batch.derived(("slot_blocks", n), lambda: align_tokens_by_slot(lora_batch.token_slots, n)) \
                if x.is_cuda else None
            y = lora_linear(x, self.weight, bias, self.lora, self.out_sizes, lora_batch.token_slots, blocks=blocks)
        else:
            y = linear(x, self.weight, bias)
        if self.parallel == "row" and self.reduce_output:
            all_reduce(self.dist_state, y)
        return y
