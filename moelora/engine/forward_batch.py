"""What one model step sees: the new tokens of B sequences, where their keys and values go in the
paged KV cache, and which LoRA slot each token uses.

Sequence i owns the new tokens input_ids[extend_starts[i] : extend_starts[i] + extend_lens[i]];
they sit at positions seq_lens[i] - extend_lens[i] ... seq_lens[i] - 1 of that sequence, whose
earlier tokens are already in the cache. Prefill, chunked prefill and decode (extend_lens == 1)
are the same thing to the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moelora.engine.kv_cache import KVCache
from moelora.kernels.lora_linear import align_tokens_by_slot
from moelora.kernels.moe_align import AlignedBlocks


@dataclass
class LoRABatch:
    """Per-token adapter slots of a step (-1 = base model), shared by every LoRA layer of the model."""
    token_slots: torch.Tensor  # [N] int32
    _slot_blocks: dict[int, AlignedBlocks] = field(default_factory=dict, repr=False)

    @property
    def any(self) -> bool:
        return self.token_slots.numel() > 0

    def slot_blocks(self, num_slots: int) -> AlignedBlocks:
        """The tokens grouped by slot for the dense-layer LoRA kernels: the same for every layer of the
        step, so aligned once (token_slots must not change while this batch is in use)."""
        if num_slots not in self._slot_blocks:
            self._slot_blocks[num_slots] = align_tokens_by_slot(self.token_slots, num_slots)
        return self._slot_blocks[num_slots]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor         # [N] int64
    positions: torch.Tensor         # [N] int64, position of each new token in its sequence
    req_pool_indices: torch.Tensor  # [B] int32, row of kv.req_to_token holding each sequence's cache slots
    seq_lens: torch.Tensor          # [B] int32, tokens in the cache after this step (prefix + new)
    extend_lens: torch.Tensor       # [B] int32, new tokens per sequence
    extend_starts: torch.Tensor     # [B] int32, offset of each sequence's first new token in input_ids
    out_cache_loc: torch.Tensor     # [N] int64, cache slot each new token's key and value are written to
    logits_indices: torch.Tensor    # [M] int64, rows of the last hidden states that become logits
    kv: KVCache
    lora: LoRABatch | None = None   # None: no adapter in the batch
    is_decode: bool = False         # every extend_len is 1: decode kernels, CUDA-graph replay
    max_extend_len: int = 0         # host-side bounds for kernel grids (no device sync in the step)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]
