"""Attention over the paged KV cache for one decoder layer: the new tokens' keys and values go into
the cache first, then every new query attends to its sequence's cached tokens (itself included)."""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import ForwardBatch
from moelora.kernels.attention import attention
from moelora.kernels.kv_store import store_kv


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, k_head_dim: int, v_head_dim: int, scale: float, layer_id: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.scale, self.layer_id = scale, layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [N, Hq, Dk], k [N, Hkv, Dk], v [N, Hkv, Dv] -> [N, Hq * Dv]."""
        kv = batch.kv
        store_kv(kv.k[self.layer_id], kv.v[self.layer_id], batch.out_cache_loc, k, v)  # one kernel on CUDA
        q, caches = q.contiguous(), (kv.k[self.layer_id], kv.v[self.layer_id], kv.req_to_token)
        if batch.is_decode or batch.num_decode == 0:  # no device read: graph-safe
            out = attention(q, *caches, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, batch.extend_starts,
                            self.scale, is_decode=batch.is_decode, max_extend_len=batch.max_extend_len)
        else:  # a mixed step: decode rows through the decode kernels, as in a decode step (same bits)
            out = q.new_empty(q.shape[0], q.shape[1], self.v_head_dim)
            decode, extend = batch.decode_rows, batch.extend_rows
            attention(q, *caches, *decode, self.scale, is_decode=True, max_extend_len=1, out=out)
            attention(q, *caches, *extend, self.scale, max_extend_len=batch.max_extend_len, out=out)
        return out.flatten(1)
