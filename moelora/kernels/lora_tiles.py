"""Pieces shared by the LoRA kernels of dense layers (lora_linear) and of experts (fused_moe)."""
from __future__ import annotations

import triton
import triton.language as tl

LORA_RANK_CHUNK = 16  # tl.dot needs >= 16: the smallest rank tile


def rank_tile(max_rank: int) -> int:
    """The kernels' rank tile for adapters of rank <= max_rank."""
    return max(LORA_RANK_CHUNK, triton.next_power_of_2(max_rank))


@triton.jit
def shrink_k_range(x_ptrs, a_ptrs, row_ok, rank, k_lo, k_hi,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """x[:, k_lo:k_hi] @ A[:rank, k_lo:k_hi]^T in fp32, the rows of A past `rank` not read; x_ptrs
    [BLOCK_M, BLOCK_K] and a_ptrs [BLOCK_K, BLOCK_R] point at column 0 of x and A."""
    offs_k = tl.arange(0, BLOCK_K)
    r_ok = (tl.arange(0, BLOCK_R) < rank)[None, :]
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = k0 + offs_k < k_hi
        xt = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        xa += tl.dot(xt, tl.load(a_ptrs + k0, mask=k_ok[:, None] & r_ok, other=0.0))
    return xa
