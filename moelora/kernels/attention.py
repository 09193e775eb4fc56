"""Attention of a step's new tokens over the paged KV cache (see engine/forward_batch.py): causal,
grouped-query (Hq a multiple of Hkv), key and value head sizes may differ (MLA stores per-head
keys of qk_nope + qk_rope and values of v_head_dim). The new tokens' keys and values are already
in the cache when it runs, so one function serves prefill, chunked prefill and decode.

`attention_reference` is the plain-torch version and the CPU backend.
"""
from __future__ import annotations

import torch


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                        extend_starts: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, Hq, Dk], k_cache [slots, Hkv, Dk], v_cache [slots, Hkv, Dv] -> [N, Hq, Dv] in q's dtype."""
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    group = q.shape[1] // k_cache.shape[1]
    for row, total, new, start in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_lens.tolist(),
                                      extend_starts.tolist()):
        slots = req_to_token[row, :total].long()
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, Dk]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + new].float(), k) * scale
        query_pos = torch.arange(total - new, total, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(total, device=q.device)[None, :] > query_pos, float("-inf"))
        out[start:start + new] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
              req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
              extend_starts: torch.Tensor, scale: float) -> torch.Tensor:
    """Entry point; the Triton kernels take over on GPUs."""
    return attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens,
                               extend_starts, scale)
