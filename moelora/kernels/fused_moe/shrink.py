"""The gate/up LoRA shrink xa = x A^T, in K-split partials: per aligned block (looping over its slots), or per
(token, expert) pair, either in the alignment's launch or in the first programs of the gate_up launch."""
from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.fused_moe.tiles import lora_rank, row_ranks, row_slots, slot_rank, takes_rank_tile
from moelora.kernels.moe_align import moe_align_program
from moelora.kernels.pdl import wait_for_previous_kernel


@triton.jit
def _shrink_rows(x_ptrs, rows, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, k_lo, k_hi, num_experts,
                 num_splits, stride_ae, stride_ar, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, RANK_TILES: tl.constexpr):
    """xa_g, xa_u = x[rows] @ A[s, e][:, k_lo:k_hi]^T for gate and up (ranks rank_g, rank_u), stored from xa_rows
    (column 0 of each row's gate partial) for `rows`, on the smallest rank tile that holds both ranks
    (tiles.takes_rank_tile)."""
    for c in tl.static_range(RANK_TILES):
        if takes_rank_tile(tl.maximum(rank_g, rank_u), c, RANK_TILES, BLOCK_R):
            _shrink_tile(x_ptrs, rows, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, k_lo, k_hi, num_experts,
                         num_splits, stride_ae, stride_ar, BLOCK_M, BLOCK_K, c, RANK_TILES, BLOCK_R)


@triton.jit
def _shrink_tile(x_ptrs, rows, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, k_lo, k_hi, num_experts, num_splits,
                 stride_ae, stride_ar, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, C: tl.constexpr,
                 RANK_TILES: tl.constexpr, BLOCK_R: tl.constexpr):
    """_shrink_rows on rank tile C (tiles.takes_rank_tile); the partials are laid out BLOCK_R columns a part."""
    R: tl.constexpr = BLOCK_R if C == RANK_TILES - 1 else 16 << C
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, R)
    se = (s * num_experts + e).to(tl.int64)  # LoRA buffers are contiguous [S, E, ...]
    ag_ptrs = ag_ptr + se * stride_ae + offs_r[None, :] * stride_ar + offs_k[:, None]
    au_ptrs = au_ptr + se * stride_ae + offs_r[None, :] * stride_ar + offs_k[:, None]
    xa_g = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    xa_u = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + offs_k < k_hi
        xt = tl.load(x_ptrs + k0, mask=rows[:, None] & k_mask[None, :], other=0.0)
        xa_g += tl.dot(xt, tl.load(ag_ptrs + k0, mask=k_mask[:, None] & (offs_r[None, :] < rank_g), other=0.0))
        xa_u += tl.dot(xt, tl.load(au_ptrs + k0, mask=k_mask[:, None] & (offs_r[None, :] < rank_u), other=0.0))
    xa_ptrs = xa_rows[:, None] + offs_r[None, :]
    tl.store(xa_ptrs, xa_g, mask=rows[:, None])
    tl.store(xa_ptrs + num_splits * BLOCK_R, xa_u, mask=rows[:, None])


@triton.jit(do_not_specialize=["num_pairs"])  # row counts: kernels/__init__.py
def shrink_kernel(
    x_ptr, xa_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, token_slots_ptr, ranks_ptr, ag_ptr, au_ptr,
    num_pairs, top_k, H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    RANK_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    """xa[p, proj, split] = x[p] @ A_proj[slot(p), e][:, split's K range]^T for gate (proj 0) and up
    (proj 1), one program per (block, K split), looping over the slots in the block. The gate_up GEMM
    sums the splits in a fixed order."""
    wait_for_previous_kernel(PDL)
    pid_m, split = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    slot, lo, hi = row_slots(tl.load(token_slots_ptr + pair // top_k, mask=pair < num_pairs, other=-1), num_slots)
    x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + tl.arange(0, BLOCK_K)[None, :]
    xa_rows = xa_ptr + ((pair.to(tl.int64) * 2) * num_splits + split) * BLOCK_R
    row_rank_g = row_ranks(ranks_ptr, slot, e, num_slots, num_experts, 0)
    row_rank_u = row_ranks(ranks_ptr, slot, e, num_slots, num_experts, 1)
    for s in range(lo, hi + 1):
        rows = slot == s
        rank_g, rank_u = slot_rank(row_rank_g, rows), slot_rank(row_rank_u, rows)
        if rank_g + rank_u > 0:  # (0 also when no row has slot s)
            _shrink_rows(x_ptrs, rows, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, split * SPLIT_K,
                         tl.minimum(H, (split + 1) * SPLIT_K), num_experts, num_splits, stride_ae, stride_ar,
                         BLOCK_M, BLOCK_K, BLOCK_R, RANK_TILES)


@triton.jit
def shrink_one_pair(q, topk_ids_ptr, token_slots_ptr, x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr,
                     top_k, H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
                     RANK_TILES: tl.constexpr):
    """Work item q = p * num_splits + split: the gate/up shrink of pair p for one K split. The pair sits in
    row 0 of a BLOCK_M tile so the arithmetic, hence the bits, equal shrink_kernel's for that row.
    Returns whether the pair has an expert here and an adapter (else there is nothing to shrink)."""
    p = q // num_splits
    split = q % num_splits
    e = tl.load(topk_ids_ptr + p)
    s = tl.load(token_slots_ptr + p // top_k)
    lora_pair = (e >= 0) & (e < num_experts) & (s >= 0) & (s < num_slots)
    if lora_pair:
        row0 = tl.arange(0, BLOCK_M) == 0
        pair = p + tl.zeros((BLOCK_M,), dtype=tl.int32)
        x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + tl.arange(0, BLOCK_K)[None, :]
        xa_rows = xa_ptr + ((pair.to(tl.int64) * 2) * num_splits + split) * BLOCK_R
        rank_g = lora_rank(ranks_ptr, 0, s, e, num_slots, num_experts)
        rank_u = lora_rank(ranks_ptr, 1, s, e, num_slots, num_experts)
        _shrink_rows(x_ptrs, row0, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, split * SPLIT_K,
                     tl.minimum(H, (split + 1) * SPLIT_K), num_experts, num_splits, stride_ae, stride_ar,
                     BLOCK_M, BLOCK_K, BLOCK_R, RANK_TILES)
    return lora_pair


@triton.jit(do_not_specialize=["num_pairs"])  # row counts: kernels/__init__.py
def pair_shrink_kernel(
    topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, cursor_ptr,
    x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr,
    num_pairs, top_k, H, num_slots, num_experts, max_rows, num_splits, stride_xt, stride_ae, stride_ar,
    BLOCK_M: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, RANK_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Small aligned batches, one launch: program 0 is `moe_align`, then a program per (pair, K split) of
    the gate/up shrink (it needs only the pair's expert and slot, not the blocks)."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    if pid == 0:
        moe_align_program(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr,
                          cursor_ptr, num_pairs, top_k, num_experts, num_slots, max_rows, True, BLOCK_M, E_P,
                          S1_P, CHUNK)
    else:
        shrink_one_pair(pid - 1, topk_ids_ptr, token_slots_ptr, x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr, top_k,
                         H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar, BLOCK_M, BLOCK_K,
                         BLOCK_R, SPLIT_K, RANK_TILES)
