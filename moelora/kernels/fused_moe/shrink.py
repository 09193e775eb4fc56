"""The LoRA shrinks. Gate/up: xa = x A^T, in K-split partials, per (expert, slot) segment of the aligned rows, or per
(token, expert) pair, either in the alignment's launch or in the first programs of the gate_up launch. Down, at
prefill tiles: hd = h A_d^T per segment after the gate_up launch (down_shrink_kernel), where other tiles compute it
in the gate_up epilogue, a part per DOWN_SHRINK_PART columns of h."""
from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.fused_moe.tiles import lora_rank, lora_tile, takes_rank_tile
from moelora.kernels.lora_tiles import end_of_split
from moelora.kernels.moe_align import moe_align_program
from moelora.kernels.pdl import wait_for_previous_kernel


@triton.jit
def _shrink_rows(x_ptrs, rows, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, k_lo, k_hi, num_experts,
                 num_splits, stride_ae, stride_ar, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, RANK_TILES: tl.constexpr, A_ALIGNED: tl.constexpr, TILE: tl.constexpr = -1,
                 SERIAL_SPLIT_K: tl.constexpr = 0):
    """xa_g, xa_u = x[rows] @ A[s, e][:, k_lo:k_hi]^T for gate and up (ranks rank_g, rank_u), stored from xa_rows
    (column 0 of each row's gate partial) for `rows`, on the smallest rank tile that holds both ranks
    (tiles.takes_rank_tile); with TILE >= 0 only if that is tile TILE (the others are not compiled).
    SERIAL_SPLIT_K > 0: [k_lo, k_hi) is several K splits of that many columns, each summed from its own zero and
    added to the total in order, as tiles.sum_partials adds the partials of a program per split (the same bits)."""
    for c in tl.static_range(RANK_TILES):
        if (TILE < 0 or TILE == c) and takes_rank_tile(tl.maximum(rank_g, rank_u), c, RANK_TILES, BLOCK_R):
            _shrink_tile(x_ptrs, rows, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, k_lo, k_hi, num_experts,
                         num_splits, stride_ae, stride_ar, BLOCK_M, BLOCK_K, c, RANK_TILES, BLOCK_R, A_ALIGNED,
                         SERIAL_SPLIT_K)


@triton.jit
def _shrink_tile(x_ptrs, rows, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, k_lo, k_hi, num_experts, num_splits,
                 stride_ae, stride_ar, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, C: tl.constexpr,
                 RANK_TILES: tl.constexpr, BLOCK_R: tl.constexpr, A_ALIGNED: tl.constexpr,
                 SERIAL_SPLIT_K: tl.constexpr):
    """_shrink_rows on rank tile C (tiles.takes_rank_tile); the partials are laid out BLOCK_R columns a part. Gate
    and up in one dot, A_g's R rows then A_u's as its 2R columns: each x tile goes through the MMAs once, not once a
    projection (a column's sum does not depend on the dot's other columns, so the bits are those of a dot each).
    A_ALIGNED: every row of A_g and A_u starts on 16 bytes (launcher.rows_start_on_16_bytes), which the compiler
    cannot see through the choice between the two pointers; told, it loads A in 16-byte vectors, asynchronously
    (else one element a thread, through registers)."""
    R: tl.constexpr = BLOCK_R if C == RANK_TILES - 1 else 16 << C
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, 2 * R)
    up = offs_c >= R
    r = tl.where(up, offs_c - R, offs_c)  # the column's row of A_g or A_u
    se = (s * num_experts + e).to(tl.int64)  # LoRA buffers are contiguous [S, E, ...]
    col_ptrs = tl.where(up, au_ptr, ag_ptr) + se * stride_ae + r * stride_ar
    if A_ALIGNED:
        col_ptrs = tl.multiple_of(col_ptrs, 16)
    a_ptrs = col_ptrs[None, :] + offs_k[:, None]
    in_rank = (r < tl.where(up, rank_u, rank_g))[None, :]
    xa = tl.zeros((BLOCK_M, 2 * R), dtype=tl.float32)
    split = tl.zeros((BLOCK_M, 2 * R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + offs_k < k_hi
        xt = tl.load(x_ptrs + k0, mask=rows[:, None] & k_mask[None, :], other=0.0)
        if SERIAL_SPLIT_K > 0:
            split += tl.dot(xt, tl.load(a_ptrs + k0, mask=k_mask[:, None] & in_rank, other=0.0))
            xa, split = end_of_split(xa, split, k0, k_hi, SERIAL_SPLIT_K, BLOCK_K)
        else:
            xa += tl.dot(xt, tl.load(a_ptrs + k0, mask=k_mask[:, None] & in_rank, other=0.0))
    tl.store(xa_rows[:, None] + tl.where(up, num_splits * BLOCK_R + r, r)[None, :], xa, mask=rows[:, None])


@triton.jit
def _segment(seg, segments_ptr, max_segs, num_slots):
    """Segment seg's rows [first, end) of the sorted ids, and its key's expert and slot (AlignedBlocks.segments)."""
    first = tl.load(segments_ptr + seg)
    end = first + tl.load(segments_ptr + max_segs + seg)
    key = tl.load(segments_ptr + 2 * max_segs + seg)
    return first, end, key // num_slots, key % num_slots


@triton.jit(do_not_specialize=["num_pairs", "max_segs"])  # row counts: kernels/__init__.py
def shrink_kernel(
    x_ptr, xa_ptr, sorted_ids_ptr, segments_ptr, num_segments_ptr, ranks_ptr, ag_ptr, au_ptr,
    num_pairs, top_k, H, num_slots, num_experts, num_splits, max_segs, stride_xt, stride_ae, stride_ar,
    SHRINK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    RANK_TILES: tl.constexpr, A_ALIGNED: tl.constexpr, TILE: tl.constexpr, SERIAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """xa[p, proj, split] = x[p] @ A_proj[slot(p), e][:, split's K range]^T for gate (proj 0) and up
    (proj 1), one program per (segment, K split): a segment is a piece of the rows of one (expert, slot) key
    (AlignedBlocks.segments), taken SHRINK_ROWS (MoEKernelConfig.shrink_rows) at a time. Each program runs one
    chain of loads, where a program per block walked the block's slots one after the other. The gate_up GEMM sums
    the splits in a fixed order. SERIAL (num_splits 1): a program per segment adds its splits up itself, in that
    order (_shrink_rows' SERIAL_SPLIT_K), so xa holds their sum, with no partials to write, read and sum again.
    TILE >= 0: only the segments whose ranks take rank tile TILE, the launch compiled for that tile alone (a launch
    per tile: the registers of the largest tile's loop would set how many programs of the smaller tiles an SM
    holds)."""
    wait_for_previous_kernel(PDL)
    seg, split = tl.program_id(0), tl.program_id(1)
    if seg >= tl.load(num_segments_ptr):
        return
    first, end, e, s = _segment(seg, segments_ptr, max_segs, num_slots)
    rank_g = lora_rank(ranks_ptr, 0, s, e, num_slots, num_experts)
    rank_u = lora_rank(ranks_ptr, 1, s, e, num_slots, num_experts)
    if rank_g + rank_u > 0:
        for row0 in range(first, end, SHRINK_ROWS):
            offs = row0 + tl.arange(0, SHRINK_ROWS)
            pair = tl.load(sorted_ids_ptr + offs, mask=offs < end, other=num_pairs)
            rows = pair < num_pairs
            x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + tl.arange(0, BLOCK_K)[None, :]
            xa_rows = xa_ptr + ((pair.to(tl.int64) * 2) * num_splits + split) * BLOCK_R
            k_lo, k_hi = (0, H) if SERIAL else (split * SPLIT_K, tl.minimum(H, (split + 1) * SPLIT_K))
            _shrink_rows(x_ptrs, rows, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, k_lo, k_hi, num_experts,
                         num_splits, stride_ae, stride_ar, SHRINK_ROWS, BLOCK_K, BLOCK_R, RANK_TILES, A_ALIGNED, TILE,
                         SPLIT_K if SERIAL else 0)


@triton.jit(do_not_specialize=["num_pairs", "max_segs"])  # row counts: kernels/__init__.py
def down_shrink_kernel(
    h_ptr, hd_ptr, sorted_ids_ptr, segments_ptr, num_segments_ptr, ranks_ptr, ad_ptr,
    num_pairs, I, num_slots, num_experts, max_segs, stride_ht, stride_ade, stride_adr,
    SHRINK_ROWS: tl.constexpr, PART_N: tl.constexpr, BLOCK_R: tl.constexpr, RANK_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    """hd[p, :rank] = sum over the parts of I, in order, of h[p, part] @ A_d[slot(p), e][:, part]^T, one program per
    segment (as shrink_kernel's), SHRINK_ROWS rows at a time: the down shrink of the gate_up epilogue's parts
    (gemm._down_shrink_part) summed as reduce_partials sums them, so the same bits, with neither the parts'
    round trip through memory nor their dots in the gate_up epilogue, which at prefill tiles cost more there
    than this launch (benchmarks/RESULTS.md, session 37). Rows whose key has no down LoRA are not written."""
    wait_for_previous_kernel(PDL)
    seg = tl.program_id(0)
    if seg >= tl.load(num_segments_ptr):
        return
    first, end, e, s = _segment(seg, segments_ptr, max_segs, num_slots)
    rank_d = lora_rank(ranks_ptr, 2, s, e, num_slots, num_experts)
    for c in tl.static_range(RANK_TILES):
        if takes_rank_tile(rank_d, c, RANK_TILES, BLOCK_R):
            for row0 in range(first, end, SHRINK_ROWS):
                offs = row0 + tl.arange(0, SHRINK_ROWS)
                pair = tl.load(sorted_ids_ptr + offs, mask=offs < end, other=num_pairs)
                _down_shrink_tile(h_ptr, hd_ptr, pair, pair < num_pairs, ad_ptr, rank_d, s, e, I, num_experts,
                                  stride_ht, stride_ade, stride_adr, SHRINK_ROWS, PART_N, c, RANK_TILES, BLOCK_R)


@triton.jit
def _down_shrink_tile(h_ptr, hd_ptr, pair, rows, ad_ptr, rank_d, s, e, I, num_experts, stride_ht, stride_ade,
                      stride_adr, ROWS: tl.constexpr, PART_N: tl.constexpr, C: tl.constexpr,
                      RANK_TILES: tl.constexpr, BLOCK_R: tl.constexpr):
    """down_shrink_kernel's rows `rows` of one (expert e, slot s) on rank tile C, stored BLOCK_R columns a row.
    Each part is a dot of its own from zero, added to the sum through a select: an add of the dot itself would fuse
    into its MMA as the accumulator, another order of the adds."""
    R: tl.constexpr = BLOCK_R if C == RANK_TILES - 1 else 16 << C
    offs_n, offs_r = tl.arange(0, PART_N), tl.arange(0, R)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + offs_n[None, :]
    hd = tl.zeros((ROWS, R), dtype=tl.float32)
    for n0 in range(0, I, PART_N):
        h = tl.load(h_ptrs + n0, mask=rows[:, None] & (n0 + offs_n < I)[None, :], other=0.0)
        ad = lora_tile(ad_ptr, s, e, num_experts, stride_ade, stride_adr, n0 + offs_n, n0 + offs_n < I, rank_d, R)
        hd += tl.where(rows[:, None], tl.dot(h, tl.trans(ad)), 0.0)
    hd_ptrs = hd_ptr + pair.to(tl.int64)[:, None] * BLOCK_R + offs_r[None, :]
    tl.store(hd_ptrs, hd, mask=rows[:, None] & (offs_r < rank_d)[None, :])


@triton.jit
def shrink_one_pair(q, topk_ids_ptr, token_slots_ptr, x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr,
                     top_k, H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar,
                     SHRINK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
                     RANK_TILES: tl.constexpr, A_ALIGNED: tl.constexpr):
    """Work item q = p * num_splits + split: the gate/up shrink of pair p for one K split. The pair sits in
    row 0 of a SHRINK_ROWS tile (MoEKernelConfig.shrink_rows) so the arithmetic, hence the bits, equal
    shrink_kernel's for that row.
    Returns whether the pair has an expert here and an adapter (else there is nothing to shrink)."""
    p = q // num_splits
    split = q % num_splits
    e = tl.load(topk_ids_ptr + p)
    s = tl.load(token_slots_ptr + p // top_k)
    lora_pair = (e >= 0) & (e < num_experts) & (s >= 0) & (s < num_slots)
    if lora_pair:
        row0 = tl.arange(0, SHRINK_ROWS) == 0
        pair = p + tl.zeros((SHRINK_ROWS,), dtype=tl.int32)
        x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + tl.arange(0, BLOCK_K)[None, :]
        xa_rows = xa_ptr + ((pair.to(tl.int64) * 2) * num_splits + split) * BLOCK_R
        rank_g = lora_rank(ranks_ptr, 0, s, e, num_slots, num_experts)
        rank_u = lora_rank(ranks_ptr, 1, s, e, num_slots, num_experts)
        _shrink_rows(x_ptrs, row0, xa_rows, ag_ptr, au_ptr, rank_g, rank_u, s, e, split * SPLIT_K,
                     tl.minimum(H, (split + 1) * SPLIT_K), num_experts, num_splits, stride_ae, stride_ar,
                     SHRINK_ROWS, BLOCK_K, BLOCK_R, RANK_TILES, A_ALIGNED)
    return lora_pair


@triton.jit(do_not_specialize=["num_pairs"])  # row counts: kernels/__init__.py
def pair_shrink_kernel(
    topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, cursor_ptr,
    x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr,
    num_pairs, top_k, H, num_slots, num_experts, max_rows, num_splits, stride_xt, stride_ae, stride_ar,
    BLOCK_M: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr, CHUNK: tl.constexpr,
    SHRINK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    RANK_TILES: tl.constexpr, A_ALIGNED: tl.constexpr, PDL: tl.constexpr,
):
    """Small aligned batches, one launch: program 0 is `moe_align`, then a program per (pair, K split) of
    the gate/up shrink (it needs only the pair's expert and slot, not the blocks)."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    if pid == 0:
        moe_align_program(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr,
                          cursor_ptr, cursor_ptr, cursor_ptr, num_pairs, top_k, num_experts, num_slots, max_rows, 1,
                          True, BLOCK_M, E_P, S1_P, CHUNK, 0)
    else:
        shrink_one_pair(pid - 1, topk_ids_ptr, token_slots_ptr, x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr, top_k,
                         H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar, SHRINK_ROWS, BLOCK_K,
                         BLOCK_R, SPLIT_K, RANK_TILES, A_ALIGNED)
