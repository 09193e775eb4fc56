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


@triton.jit
def add_linear_lora(acc, offs_m, m_mask, n0, xa_ptr, b_ptr, ranks_ptr, slots_ptr, num_slots, stride_bs, stride_br,
                    PART_BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (rows offs_m, columns n0..) plus each row's LoRA delta, the epilogue of a dense
    GEMM: for row m of slot s = slots[m] and each part p whose columns meet the tile,
    xa[m, p] @ B[s, :ranks[s, p], part p's columns], where xa [M, P, BLOCK_R] is the shrink's output in B's
    dtype.

    One tl.dot per part for all the tile's slots together: the slots' B tiles stacked along K (BLOCK_S slots
    of BLOCK_R rows, BLOCK_S >= num_slots) and each row's xa placed in its own slot's BLOCK_R columns, zero in
    the others. The zero columns add exactly 0 to a row, so its bits follow from its own slot and xa alone,
    whatever shares its tile, and a row without an adapter (slot < 0 or >= num_slots) keeps the bits it had.
    Nothing is read for slots no row of the tile uses, past a slot's rank, or of rows without an adapter."""
    P: tl.constexpr = len(PART_BOUNDS) - 1
    row_slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    row_slot = tl.where((row_slot >= 0) & (row_slot < num_slots), row_slot, -1)
    if tl.max(row_slot) >= 0:
        cols = tl.arange(0, BLOCK_S * BLOCK_R)
        col_slot, col_r = cols // BLOCK_R, cols % BLOCK_R
        mine = row_slot[:, None] == col_slot[None, :]  # [BLOCK_M, BLOCK_S * BLOCK_R]
        used = tl.max(mine.to(tl.int32), axis=0) > 0  # the column's slot has rows in the tile
        offs_n = n0 + tl.arange(0, BLOCK_N)
        for p in tl.static_range(P):
            lo, hi = PART_BOUNDS[p], PART_BOUNDS[p + 1]
            if (n0 < hi) & (n0 + BLOCK_N > lo):
                use = used & (col_r < tl.load(ranks_ptr + col_slot * P + p, mask=used, other=0))
                xa_ptrs = xa_ptr + (offs_m.to(tl.int64) * P + p)[:, None] * BLOCK_R + col_r[None, :]
                xa = tl.load(xa_ptrs, mask=mine & use[None, :], other=0.0)
                b_ptrs = b_ptr + col_slot[:, None] * stride_bs + col_r[:, None] * stride_br + offs_n[None, :]
                in_part = (offs_n >= lo) & (offs_n < hi)
                bt = tl.load(b_ptrs, mask=use[:, None] & in_part[None, :], other=0.0)
                acc = tl.dot(xa, bt, acc)
    return acc
