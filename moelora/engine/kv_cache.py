"""The paged KV cache: one key and one value buffer per layer, indexed by token slot (pages of one
token), and req_to_token mapping (request row, position) to a slot. Slot 0 is never handed out:
padded rows of a CUDA-graph batch write their keys there."""
from __future__ import annotations

import torch

from moelora.kernels.kv_store import store_kv


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, k_head_dim: int, v_head_dim: int,
                 max_requests: int, max_context: int, dtype: torch.dtype, device: torch.device | str):
        self.num_slots, self.max_context = num_slots, max_context
        self.k = [torch.zeros(num_slots, num_kv_heads, k_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(num_slots, num_kv_heads, v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int32, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, k_head_dim: int, v_head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * num_kv_heads * (k_head_dim + v_head_dim) * dtype.itemsize

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' k [N, heads, k_dim] and v [N, heads, v_dim] to slots `loc` [N] (one Triton
        kernel on CUDA)."""
        store_kv(self.k[layer], self.v[layer], loc, k, v)
