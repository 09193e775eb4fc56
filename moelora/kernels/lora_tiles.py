"""Pieces of the LoRA kernels of dense layers (lora_linear, and linear's GEMM, which runs their shrink in its
first programs and their expand in its epilogue) and of experts (fused_moe)."""
from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.gemm_tiles import arrive, loads_a_round, sum_loads_in_order

LORA_RANK_CHUNK = 16  # tl.dot needs >= 16: the smallest rank tile


def rank_tile(max_rank: int) -> int:
    """The kernels' rank tile for adapters of rank <= max_rank."""
    return max(LORA_RANK_CHUNK, triton.next_power_of_2(max_rank))


def rank_tile_count(block_r: int) -> int:
    """How many rank tiles 16, 32, ..., block_r the experts' kernels choose among (RANK_TILES)."""
    return (block_r // LORA_RANK_CHUNK).bit_length()


def step_rank_bound(batch_rank: int, slots_rank: int) -> int:
    """The bound on the experts' ranks (ExpertLoRASlots.max_rank_in_use) a step runs fused_moe with, for a step
    whose adapters' experts have ranks <= batch_rank in slots of rank slots_rank: the smallest rank tile's when
    they fit it, else the slots'. The kernels' registers follow the largest tile they are compiled for, which
    slows every program of a small-rank step beside large-rank adapters; two classes, not one per tile, since
    each is a compiled variant of every kernel and a CUDA graph of every captured size."""
    return LORA_RANK_CHUNK if batch_rank <= LORA_RANK_CHUNK < slots_rank else slots_rank


def step_rank_bounds(slots_rank: int) -> list[int]:
    """Every step_rank_bound for slots of rank slots_rank, smallest first."""
    return sorted({step_rank_bound(1, slots_rank), slots_rank})


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
def end_of_split(total, split, k0, k_hi, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """A serial shrink's step k0 done: where it ends a K split of SPLIT_K columns (or the range, at k_hi), the
    split's sum added to the total and the split started again from zero, so the total is each split summed from
    its own zero and added in order, the bits of a program per split whose partials are then summed in order.
    Returns (total, split). A where at each step, not a loop per split: one flat K loop keeps its software
    pipeline, which a loop per split would refill."""
    ends = ((k0 + BLOCK_K) % SPLIT_K == 0) | (k0 + BLOCK_K >= k_hi)
    return tl.where(ends, total + split, total), tl.where(ends, 0.0, split)


@triton.jit
def shrink_linear_block(pid, x_ptr, a_ptr, ranks_ptr, part_ptr, xa_ptr, count_ptr, sorted_ids_ptr, block_slot_ptr,
                        num_tokens, K, stride_xt, stride_as, stride_ap, stride_ar,
                        P: tl.constexpr, SPLITS: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program pid = (block, part, split) of a dense layer's shrink: xa[n, part, :] = round(x[n] @ A[slot, part,
    :rank]^T) for the BLOCK_M tokens of one block of `align_tokens_by_slot`, K in SPLITS splits of SPLIT_K. With
    more than one split each program writes its fp32 partial to part [n, part, split, :] and the last of the
    (block, part)'s programs to arrive adds them up in split order and rounds once to xa's dtype; xa is zero past
    the rank. Blocks of no slot (-1) read and write nothing; a part of rank 0 reads nothing and its split 0
    writes xa's zeros (the GEMM's epilogue reads them). Returns whether this program finished its (block,
    part): the one that stored its xa, or split 0 of one with nothing to do."""
    block, part, split = pid // (P * SPLITS), pid // SPLITS % P, pid % SPLITS
    finished = split == 0
    slot = tl.load(block_slot_ptr + block)
    tokens = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # beside the slot's: one round trip
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot * P + part)
        row_ok = tokens < num_tokens
        offs_k, offs_r = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_R)
        out_ptrs = xa_ptr + (tokens.to(tl.int64) * P + part)[:, None] * BLOCK_R + offs_r[None, :]
        if (rank == 0) & finished:  # the epilogue reads every part's xa of a row with an adapter
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_R), dtype=xa_ptr.dtype.element_ty), mask=row_ok[:, None])
        if rank > 0:
            x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
            a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as + part * stride_ap + offs_r[None, :] * stride_ar
                      + offs_k[:, None])
            k_lo = split * SPLIT_K
            xa = shrink_k_range(x_ptrs, a_ptrs, row_ok, rank, k_lo, tl.minimum(K, k_lo + SPLIT_K),
                                BLOCK_M, BLOCK_K, BLOCK_R)
            if SPLITS == 1:
                tl.store(out_ptrs, xa.to(xa_ptr.dtype.element_ty), mask=row_ok[:, None])
            else:
                part_ptrs = (part_ptr + ((tokens.to(tl.int64) * P + part) * SPLITS)[:, None] * BLOCK_R
                             + offs_r[None, :])
                tl.store(part_ptrs + split * BLOCK_R, xa, mask=row_ok[:, None])
                counter = count_ptr + block * P + part
                finished = arrive(counter) == SPLITS - 1
                if finished:
                    tl.store(counter, 0)  # no other program touches it in this launch: zero for the next
                    xa = sum_loads_in_order(part_ptrs, BLOCK_R, row_ok[:, None], SPLITS,
                                            loads_a_round(SPLITS, BLOCK_M * BLOCK_R), ".cg")
                    tl.store(out_ptrs, xa.to(xa_ptr.dtype.element_ty), mask=row_ok[:, None])
    return finished


@triton.jit
def linear_lora_rows(row_slot, b_rows, first_slot, BLOCK_R: tl.constexpr, CHUNK_S: tl.constexpr):
    """The rows' side of one dot of a dense GEMM's LoRA epilogue (`add_linear_lora`), no memory read: `mine`
    [BLOCK_M, CHUNK_S * BLOCK_R], the stacked columns of slots first_slot.. (CHUNK_S of them) that are each row's
    (row_slot: -1 for rows without an adapter), and `used` [CHUNK_S * BLOCK_R], the columns of those slots the
    tile's rows use, up to the buffers' b_rows."""
    cols = tl.arange(0, CHUNK_S * BLOCK_R)
    mine = row_slot[:, None] == (first_slot + cols // BLOCK_R)[None, :]
    used = (tl.max(mine.to(tl.int32), axis=0) > 0) & (cols % BLOCK_R < b_rows)
    return mine, used


@triton.jit
def load_linear_lora_b(used, first_slot, n0, lo, hi, b_ptr, stride_bs, stride_br, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr, CHUNK_S: tl.constexpr):
    """[CHUNK_S * BLOCK_R, BLOCK_N]: the B rows of slots first_slot.. in the `used` columns (`linear_lora_rows`) at
    output columns n0.., those in [lo, hi) alone, zero elsewhere. B past a part's rank is read: the slot buffers
    hold zeros there (LinearLoRASlots), as xa does."""
    cols = tl.arange(0, CHUNK_S * BLOCK_R)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    b_ptrs = (b_ptr + (first_slot + cols // BLOCK_R)[:, None] * stride_bs + (cols % BLOCK_R)[:, None] * stride_br
              + offs_n[None, :])
    return tl.load(b_ptrs, mask=used[:, None] & ((offs_n >= lo) & (offs_n < hi))[None, :], other=0.0)


@triton.jit
def add_linear_lora(acc, row_slot, bt, offs_m, n0, xa_ptr, b_ptr, stride_bs, stride_br, b_rows,
                    PART_BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                    CHUNK_S: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (rows offs_m, columns n0..) plus each row's LoRA delta, the epilogue of a dense
    GEMM: for row m of slot s = row_slot[m] (-1: none) and each part p whose columns meet the tile,
    xa[m, p] @ B[s, :, part p's columns], where xa [M, P, BLOCK_R] is the shrink's output in B's dtype, zero
    past each rank (`shrink_linear_block`), read from L2 (.cg: the shrink may have written it in this launch).
    bt is the tile's B of all BLOCK_S slots (`load_linear_lora_b` over all columns; CHUNK_S == BLOCK_S), where the
    plan loads B before the GEMM's wait for the shrink (B_EARLY), or None: each part's B loaded here.

    One tl.dot per part for CHUNK_S slots together: their B tiles stacked along K (CHUNK_S slots of BLOCK_R
    rows) and each row's xa placed in its own slot's BLOCK_R columns, zero in the others; BLOCK_S / CHUNK_S such
    dots (`linear.lora_epilogue_plan`: one, unless many slots of a large rank would not fit in shared memory),
    those of slots no row of the tile uses skipped. The zero columns add exactly 0 to a row, and so do the other
    chunks' dots, so its bits follow from its own slot and xa alone, whatever shares its tile and however the
    slots are chunked, and a row without an adapter keeps the bits it had. xa is not read for rows without an
    adapter, nor B for slots no row of the tile uses."""
    if tl.max(row_slot) >= 0:
        for c in tl.static_range(BLOCK_S // CHUNK_S):
            mine, used = linear_lora_rows(row_slot, b_rows, c * CHUNK_S, BLOCK_R, CHUNK_S)
            if CHUNK_S == BLOCK_S:
                acc = _add_parts(acc, mine, used, bt, c * CHUNK_S, offs_m, n0, xa_ptr, b_ptr, stride_bs, stride_br,
                                 PART_BOUNDS, BLOCK_N, BLOCK_R, CHUNK_S)
            elif tl.max(used.to(tl.int32)) > 0:
                acc = _add_parts(acc, mine, used, None, c * CHUNK_S, offs_m, n0, xa_ptr, b_ptr, stride_bs,
                                 stride_br, PART_BOUNDS, BLOCK_N, BLOCK_R, CHUNK_S)
    return acc


@triton.jit
def _add_parts(acc, mine, used, bt, first_slot, offs_m, n0, xa_ptr, b_ptr, stride_bs, stride_br,
               PART_BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK_S: tl.constexpr):
    """add_linear_lora's dots of one chunk of slots (first_slot..), a dot per part that meets the tile."""
    P: tl.constexpr = len(PART_BOUNDS) - 1
    col_r = tl.arange(0, CHUNK_S * BLOCK_R) % BLOCK_R
    offs_n = n0 + tl.arange(0, BLOCK_N)
    for p in tl.static_range(P):
        lo, hi = PART_BOUNDS[p], PART_BOUNDS[p + 1]
        if (n0 < hi) & (n0 + BLOCK_N > lo):
            xa_ptrs = xa_ptr + (offs_m.to(tl.int64) * P + p)[:, None] * BLOCK_R + col_r[None, :]
            xa = tl.load(xa_ptrs, mask=mine, other=0.0, cache_modifier=".cg")
            if bt is None:
                acc = tl.dot(xa, load_linear_lora_b(used, first_slot, n0, lo, hi, b_ptr, stride_bs, stride_br,
                                                    BLOCK_N, BLOCK_R, CHUNK_S), acc)
            elif (n0 >= lo) & (n0 + BLOCK_N <= hi):  # the tile within the part: all of bt
                acc = tl.dot(xa, bt, acc)
            else:
                acc = tl.dot(xa, tl.where(((offs_n >= lo) & (offs_n < hi))[None, :], bt, 0.0), acc)
    return acc
