"""Attention over the paged KV cache for one decoder layer: the new tokens' keys and values go into
the cache first, then every new query attends to its sequence's cached tokens (itself included).

Two ways in, so that nothing is stored twice: `rotate_and_store` (grouped-query attention) applies
RoPE, and the per-head q/k norm where the family has one, and stores k and v in the same kernel
launch; `store` stores keys and values made otherwise (MLA). `forward` then attends."""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import ForwardBatch
from moelora.kernels.attention import attention, extend_blocks
from moelora.kernels.kv_store import store_kv
from moelora.kernels.rope_kv_store import rope_store_kv
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, k_head_dim: int, v_head_dim: int, scale: float, layer_id: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.scale, self.layer_id = scale, layer_id

    def kv_buffers(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's key and value caches [slots, Hkv, Dk] and [slots, Hkv, Dv]."""
        return batch.kv.k[self.layer_id], batch.kv.v[self.layer_id]

    def store(self, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
        """k [N, Hkv, Dk] and v [N, Hkv, Dv] into the cache at the step's slots: one kernel on CUDA."""
        store_kv(*self.kv_buffers(batch), batch.out_cache_loc, k, v)

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         rotary: RotaryEmbedding, batch: ForwardBatch, q_norm: RMSNorm | None = None,
                         k_norm: RMSNorm | None = None) -> torch.Tensor:
        """q [N, Hq, D], k and v [N, Hkv, D] (views of the qkv projection's output will do): k, normalised
        per head by k_norm if given and rotated, and v go into the cache; returns q, normalised by q_norm
        and rotated (contiguous). One kernel on CUDA."""
        norms = {} if q_norm is None else dict(q_norm=(q_norm.weight, q_norm.eps), k_norm=(k_norm.weight, k_norm.eps))
        return rope_store_kv(positions, q, k, v, *self.kv_buffers(batch), batch.out_cache_loc, rotary.inv_freq,
                             rotary.scale, rotary.interleaved, **norms)

    def forward(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [N, Hq, Dk] of the step's tokens, whose keys and values are in the cache already -> [N, Hq * Dv]."""
        q, caches = q.contiguous(), (*self.kv_buffers(batch), batch.kv.req_to_token)
        if batch.is_decode:  # no device read: graph-safe
            out = attention(q, *caches, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, batch.extend_starts,
                            self.scale, is_decode=True)
            return out.flatten(1)
        out = q.new_empty(q.shape[0], q.shape[1], self.v_head_dim)
        if batch.num_decode:  # a mixed step: decode rows through the decode kernels, as in a decode step (same bits)
            attention(q, *caches, *batch.decode_rows, self.scale, is_decode=True, out=out)
        rows, seq_lens, extend_lens, starts = batch.extend_rows
        # every layer's heads alike: one table a step (the key names them, should a model's layers differ); the
        # torch path (CPU) reads none
        blocks = batch.derived(("extend_blocks", q.shape[1:], q.dtype),
                               lambda: extend_blocks(q, caches[0], extend_lens)) if q.is_cuda else None
        attention(q, *caches, rows, seq_lens, extend_lens, starts, self.scale, blocks=blocks, out=out)
        return out.flatten(1)
