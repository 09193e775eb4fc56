"""Fused MoE with per-expert LoRA of many adapters in one batch.

    y[t] = sum_j w[t,j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),  e = ids[t, j]
    gate_e(x) = x Wg_e^T + (x Ag_se^T) Bg_se^T,  s = slot of token t (likewise up, down)

Grouped GEMMs over blocks from `moe_align` (one expert per block, rows ordered by adapter slot), or,
for a few pairs, over one block per (token, expert) pair, which needs no alignment launch:

    _shrink_kernel:  xa[p]    = x A_g^T, x A_u^T          K-split partials, rows with an adapter only; for a
                     few pairs a program per (pair, split) in the alignment's launch, or with a block per pair
                     in the first programs of the gate_up launch, whose epilogues wait on a ready count per pair
    _gate_up_kernel: h[p]     = silu(x Wg^T + xa_g Bg^T) * (x Wu^T + xa_u Bu^T)
                     hd[p, n] = h[p, part n] Ad[:, part n]^T   down shrink, one part per 64 columns of I
    _down_kernel:    o[p]     = w[p] * (h Wd^T + (sum_n hd[p, n]) Bd^T); with a block per pair also
                     y[t] = sum_j o[t*k+j] by the program that finishes t's last pair (fresh in L2)
    _moe_sum_kernel: the same y[t] (same order, same bits) for aligned blocks: a sum in the down kernel's
                     tail would stall its SM on rows long gone from L2 (Qwen3 T=4096, H100: down 288 -> 406 us)
    _reduce_partials_kernel: at large batches, the partials of xa and hd summed once per row before
                     the GEMMs read them (same order as the GEMMs' own sum, so the same bits)

An expert's weights are read once per block whatever adapters its rows use; the LoRA epilogues
loop over the few slots present in the block. LoRA deltas are added to the fp32 accumulators
(before SiLU for gate/up, before the routing weight for down). (slot, expert) pairs of rank 0
(adapter does not cover the expert) read nothing, and the rank tile follows the largest rank in
use. Rows without an adapter get the plain GEMM plus exactly zero, so they are bit-identical to a
run without LoRA, and every partial sum is in a fixed order, so a row's result does not depend on
what it is batched with.

`fused_moe_reference` is the plain-torch version of the whole thing and the CPU backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.kernels.gemm_tiles import arrive, gemm_block_k, gemm_loop, grouped_tile, zeroed_counters
from moelora.kernels.lora_tiles import LORA_RANK_CHUNK, rank_tile
from moelora.kernels.moe_align import (CHUNK, AlignedBlocks, align_num_warps, alloc_aligned, key_tile, moe_align,
                                       moe_align_program)
from moelora.core import ExpertLoRASlots, TopKOutput


@dataclass(frozen=True)
class MoEKernelConfig:
    block_m: int
    block_n_gate_up: int
    block_n_down: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    pair_blocks: bool = False  # each (token, expert) pair is its own block (row 0 of BLOCK_M): no alignment
    half_tiles: bool = False  # blocks with at most block_m / 2 pairs run as tiles of block_m / 2 rows


# A row's result must not depend on what it is batched with, so everything that sets the order of
# its fp32 sums is fixed: BLOCK_K of the GEMMs, the gate/up shrink's K split, and the parts of I the down
# shrink is summed over, in order (DOWN_SHRINK_PART columns each: a gate_up n tile, with LoRA 64 or 128
# columns wide, computes one or two). The tiles follow the batch.
DOWN_SHRINK_PART = 64
# H100 2026-11-22, LoRA delta per layer, K splits of 256 -> 512 columns (x1 / x8): Qwen3 T=4096 155 -> 137 /
# 451 -> 422 us, T=32 19.9 -> 18.8 / 30.8 -> 28.6, T=1 equal; DSV2-Lite T=4096 146 -> 134 / 347 -> 334;
# Mixtral T=512 52.5 -> 49.9 / 154 -> 163 (the one loss). 1024 lost at T=512 x8.
SHRINK_SPLIT_K = 512
# Up to this many tokens every (token, expert) pair is its own block: no alignment launch, but an expert
# picked by several tokens is read once per pair. H100 2026-11-22, base MoE, aligned -> pair blocks:
# Qwen3 T=1 41.9 -> 38.0 us, T=2 65.5 -> 62.3, T=4 113.6 -> 113.3, T=8 197 -> 213; Mixtral T=8 874 -> 1307.
PAIR_BLOCKS_MAX_TOKENS = 2
PAIR_SHRINK_MAX_PAIRS = 256  # up to here the gate/up shrink runs per pair, in the alignment's launch
SUM_PARTS = 8  # partial sums (shrink splits, down-shrink parts) read per load in the LoRA epilogues
# Every (block, n-tile) program of gate_up (down) sums its rows' shrink K-split (down-shrink part) partials
# itself. From this many pairs on, one launch (about REDUCE_PROGRAMS programs) sums them first (same order,
# same bits) and the programs read one part. H100 2026-11-22, LoRA delta x8 per layer, per program -> once:
# Mixtral T=256 137 -> 97 us, T=512 334 -> 154 us, DSV2-Lite T=512 158 -> 148 us; equal at 256 pairs and below.
REDUCE_PARTIALS_MIN_PAIRS = 512
REDUCE_PROGRAMS = 512
# Pair blocks with LoRA: a ready counter per pair (the gate/up shrink done), in a per-device buffer zeroed once
# and put back to 0 by each launch's last reader of each counter; default configs use at most 2 * top_k.
READY_COUNTERS = 4096
_ready: dict[torch.device, torch.Tensor] = {}


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoEKernelConfig:
    """Tile sizes by rows per expert, with LoRA and without."""
    block_k = gemm_block_k(dtype)
    if num_tokens <= PAIR_BLOCKS_MAX_TOKENS:
        return MoEKernelConfig(16, 64, 64, block_k, 8, 4, 4, pair_blocks=True)
    num_pairs = num_tokens * top_k
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 16:
        return MoEKernelConfig(16, 64, 128, block_k, 8, 4, 4)
    if rows_per_expert <= 96:
        return MoEKernelConfig(32, 64, 128, block_k, 8, 4, 4)
    if rows_per_expert < 256:
        return MoEKernelConfig(64, 64, 128, block_k, 8, 4, 4)
    # prefill, from `bench_moe.py --sweep-tokens 4096`: without LoRA (H100, 2026-11-22) wide n tiles and 8
    # warps: Qwen3 T=4096 876 -> 808 us, Mixtral 5865 -> 5503 us. With LoRA too, once the LoRA epilogues load
    # their first slot's tiles early (H100, 2026-11-22, LoRA delta, 128 x 64 on 4 warps -> these, x1 / x8):
    # Qwen3 T=4096 214 -> 153 / 462 -> 448 us, DSV2-Lite 247 -> 169 / 397 -> 372, Mixtral T=2048 281 -> 63 / 609 -> 270
    return MoEKernelConfig(128, 128, 256, block_k, 8, 8, 4, half_tiles=True)


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def _block_info(pid, num_programs, block_expert_ptr, num_rows_ptr, num_experts, N, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """Map program `pid` of `num_programs` GEMM programs to (block, n-tile): (in use, expert, block, n-tile).
    GROUP_M consecutive blocks walk the n-tiles together so blocks of one expert share its weight tiles
    through L2. With PAIR_BLOCKS block p is pair p alone and block_expert_ptr points at the flat topk ids."""
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_programs // num_n, num_n, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if PAIR_BLOCKS:
        in_use = (e >= 0) & (e < num_experts)
    else:
        in_use = pid_m * BLOCK_M < tl.load(num_rows_ptr)
    return in_use, e, pid_m, pid_n


@triton.jit
def _block_rows(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                PAIR_BLOCKS: tl.constexpr):
    """The pairs in the first ROWS rows of block pid_m (num_pairs: padding) and which rows hold one.
    With PAIR_BLOCKS block p is pair p, in row 0."""
    if PAIR_BLOCKS:
        pair = tl.where(tl.arange(0, ROWS) == 0, pid_m, num_pairs)
    else:
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, ROWS))
    return pair, pair < num_pairs


@triton.jit
def _at_most_half_full(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Whether block pid_m holds at most BLOCK_M / 2 pairs: an expert's pairs fill its blocks from the
    start and padding ends them, so row BLOCK_M / 2 tells."""
    return tl.load(sorted_ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_pairs


@triton.jit
def _row_slots(token_slot, num_slots):
    """Adapter slot of each row (-1: none) from the rows' token slots, and the range [lo, hi] of the slots in
    the block (lo > hi: none). Rows are slot-ordered, so the LoRA loops over that range meet each slot's run
    once. The GEMM kernels load the token slots before their main loop, so the load is long done here."""
    slot = tl.where((token_slot >= 0) & (token_slot < num_slots), token_slot, -1)
    lo = tl.min(tl.where(slot >= 0, slot, num_slots), axis=0)
    return slot, lo, tl.max(slot, axis=0)


@triton.jit
def _lora_rank(ranks_ptr, proj, s, e, hi, num_slots, num_experts):
    """Real rank of projection `proj` (0 gate, 1 up, 2 down) for (slot s, expert e); 0 = not covered, or s
    past hi, the block's last slot (none in the block: s = num_slots, hi = -1)."""
    return tl.load(ranks_ptr + (proj * num_slots + s) * num_experts + e, mask=s <= hi, other=0)


@triton.jit
def _lora_tile(w_ptr, s, e, num_experts, stride_e, stride_r, offs, offs_ok, rank, BLOCK_R: tl.constexpr):
    """Rows :rank of the LoRA weight of (slot s, expert e) at columns offs, as a [BLOCK_R, len(offs)] tile;
    rows past the rank are 0 and never read (buffers are [S, E, R, ...])."""
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = w_ptr + (s * num_experts + e).to(tl.int64) * stride_e + offs_r[:, None] * stride_r + offs[None, :]
    return tl.load(ptrs, mask=(offs_r[:, None] < rank) & offs_ok[None, :], other=0.0)


@triton.jit
def _lora_expand(acc, xa, rows, rank, bt):
    """acc += xa @ bt for the `rows` of one slot and a B^T tile bt of its rank (xa rounded to the weights' dtype,
    as PEFT does). Other rows get exactly +0; xa past the rank (never written) is not read."""
    keep = rows[:, None] & (tl.arange(0, xa.shape[1]) < rank)[None, :]
    return acc + tl.dot(tl.where(keep, xa, 0.0).to(bt.dtype), bt)


@triton.jit
def _sum_partials(part_ptr, pair, rows, row_stride, num_parts, BLOCK_R: tl.constexpr, PARTS: tl.constexpr,
                  CACHE: tl.constexpr):
    """sum over i < num_parts of part[pair, i, :] for the rows in `rows`, added one part after the other
    (an order no layout can change, so every kernel that sums the same parts gets the same bits); the
    loads go PARTS at a time, so their latencies overlap instead of forming a chain. CACHE ".cg": parts
    written by other programs of this launch, read from L2 (never a stale L1 line)."""
    offs_r = tl.arange(0, BLOCK_R)
    base = part_ptr + (pair.to(tl.int64) * row_stride)[:, None] + offs_r[None, :]
    acc = tl.zeros((pair.shape[0], BLOCK_R), dtype=tl.float32)
    for i0 in range(0, num_parts, PARTS):
        for i in tl.static_range(PARTS):
            part_ok = rows & (tl.zeros_like(pair) + (i0 + i) < num_parts)
            acc += tl.load(base + (i0 + i) * BLOCK_R, mask=part_ok[:, None], other=0.0, cache_modifier=CACHE)
    return acc


@triton.jit
def _reduce_partials_kernel(part_ptr, out_ptr, token_slots_ptr, num_rows, rows_per_token, num_parts, num_slots,
                            BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, PARTS: tl.constexpr):
    """out[row] = _sum_partials of part[row, :num_parts] for the rows of tokens with an adapter: the
    epilogues then read one part instead of every (block, n-tile) program summing them all again."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    slot = tl.load(token_slots_ptr + rows // rows_per_token, mask=rows < num_rows, other=-1)
    has = (rows < num_rows) & (slot >= 0) & (slot < num_slots)
    total = _sum_partials(part_ptr, rows, has, num_parts * BLOCK_R, num_parts, BLOCK_R, PARTS, "")
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
    tl.store(out_ptrs, total, mask=has[:, None])


@triton.jit
def _shrink_rows(x_ptrs, rows, xa_ptrs, ag_ptr, au_ptr, ranks_ptr, s, e, k_lo, k_hi, num_slots, num_experts,
                 num_splits, stride_ae, stride_ar, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """xa_g, xa_u = x[rows] @ A[s, e][:, k_lo:k_hi]^T for gate and up, stored at xa_ptrs for `rows`."""
    rank_g = _lora_rank(ranks_ptr, 0, s, e, s, num_slots, num_experts)
    rank_u = _lora_rank(ranks_ptr, 1, s, e, s, num_slots, num_experts)
    if rank_g + rank_u > 0:
        offs_k = tl.arange(0, BLOCK_K)
        offs_r = tl.arange(0, BLOCK_R)
        se = (s * num_experts + e).to(tl.int64)  # LoRA buffers are contiguous [S, E, ...]
        ag_ptrs = ag_ptr + se * stride_ae + offs_r[None, :] * stride_ar + offs_k[:, None]
        au_ptrs = au_ptr + se * stride_ae + offs_r[None, :] * stride_ar + offs_k[:, None]
        xa_g = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        xa_u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_mask = k0 + offs_k < k_hi
            xt = tl.load(x_ptrs + k0, mask=rows[:, None] & k_mask[None, :], other=0.0)
            xa_g += tl.dot(xt, tl.load(ag_ptrs + k0, mask=k_mask[:, None] & (offs_r[None, :] < rank_g), other=0.0))
            xa_u += tl.dot(xt, tl.load(au_ptrs + k0, mask=k_mask[:, None] & (offs_r[None, :] < rank_u), other=0.0))
        tl.store(xa_ptrs, xa_g, mask=rows[:, None])
        tl.store(xa_ptrs + num_splits * BLOCK_R, xa_u, mask=rows[:, None])


@triton.jit
def _shrink_kernel(
    x_ptr, xa_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, token_slots_ptr, ranks_ptr, ag_ptr, au_ptr,
    num_pairs, top_k, H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """xa[p, proj, split] = x[p] @ A_proj[slot(p), e][:, split's K range]^T for gate (proj 0) and up
    (proj 1), one program per (block, K split), looping over the slots in the block. The gate_up GEMM
    sums the splits in a fixed order."""
    pid_m, split = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    slot, lo, hi = _row_slots(tl.load(token_slots_ptr + pair // top_k, mask=pair < num_pairs, other=-1), num_slots)
    x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + tl.arange(0, BLOCK_K)[None, :]
    xa_ptrs = xa_ptr + ((pair.to(tl.int64) * 2) * num_splits + split)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
    for s in range(lo, hi + 1):
        rows = slot == s
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            _shrink_rows(x_ptrs, rows, xa_ptrs, ag_ptr, au_ptr, ranks_ptr, s, e, split * SPLIT_K,
                         tl.minimum(H, (split + 1) * SPLIT_K), num_slots, num_experts, num_splits, stride_ae,
                         stride_ar, BLOCK_M, BLOCK_K, BLOCK_R)


@triton.jit
def _shrink_one_pair(q, topk_ids_ptr, token_slots_ptr, x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr,
                     top_k, H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr):
    """Work item q = p * num_splits + split: the gate/up shrink of pair p for one K split. The pair sits in
    row 0 of a BLOCK_M tile so the arithmetic, hence the bits, equal _shrink_kernel's for that row.
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
        xa_ptrs = xa_ptr + ((pair.to(tl.int64) * 2) * num_splits + split)[:, None] * BLOCK_R \
            + tl.arange(0, BLOCK_R)[None, :]
        _shrink_rows(x_ptrs, row0, xa_ptrs, ag_ptr, au_ptr, ranks_ptr, s, e, split * SPLIT_K,
                     tl.minimum(H, (split + 1) * SPLIT_K), num_slots, num_experts, num_splits, stride_ae,
                     stride_ar, BLOCK_M, BLOCK_K, BLOCK_R)
    return lora_pair


@triton.jit
def _pair_shrink_kernel(
    topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, cursor_ptr,
    x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr,
    num_pairs, top_k, H, num_slots, num_experts, max_rows, num_splits, stride_xt, stride_ae, stride_ar,
    BLOCK_M: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """Small aligned batches, one launch: program 0 is `moe_align`, then a program per (pair, K split) of
    the gate/up shrink (it needs only the pair's expert and slot, not the blocks)."""
    pid = tl.program_id(0)
    if pid == 0:
        moe_align_program(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr,
                          cursor_ptr, num_pairs, top_k, num_experts, num_slots, max_rows, True, BLOCK_M, E_P,
                          S1_P, CHUNK)
    else:
        _shrink_one_pair(pid - 1, topk_ids_ptr, token_slots_ptr, x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr, top_k,
                         H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar, BLOCK_M, BLOCK_K,
                         BLOCK_R, SPLIT_K)


@triton.jit
def _wait_shrunk(ready_ptr, p, num_splits, num_readers):
    """Wait until the num_splits shrink programs of pair p have signalled (acquire; the barrier puts every
    thread's xa loads after it, and they read L2). The shrink programs have the lowest program ids, so the
    hardware dispatched them first and they never wait on anything: they finish whatever this program does.
    Then each of the pair's num_readers gate_up programs counts itself in; the last one, after which no
    program of this launch touches the counter, puts it back to 0 for the next launch (no memset launch)."""
    while tl.atomic_add(ready_ptr + p, 0, sem="acquire", scope="gpu") < num_splits:
        pass
    if tl.atomic_add(ready_ptr + p, 1, sem="relaxed", scope="gpu") == num_splits + num_readers - 1:
        tl.atomic_xchg(ready_ptr + p, 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _num_valid_experts(topk_ids_ptr, tok, tok_ok, top_k, num_experts, TOP_K_P: tl.constexpr):
    """How many of each token's top-k experts are in [0, E) (the others live on other ranks)."""
    j = tl.arange(0, TOP_K_P)
    ids = tl.load(topk_ids_ptr + tok[:, None] * top_k + j[None, :], mask=tok_ok[:, None] & (j < top_k)[None, :],
                  other=-1)
    return tl.sum(((ids >= 0) & (ids < num_experts)).to(tl.int32), axis=1)


@triton.jit
def _prepare_topk_sum(pid, topk_ids_ptr, counter_ptr, y_ptr, num_tokens, top_k, num_experts, num_n_down, H,
                      stride_yt, tokens_per_program, TOP_K_P: tl.constexpr):
    """Run by every gate_up GEMM program `pid` for its share of the tokens, before the down kernel: zero the
    tokens' arrival counters, and write y = 0 for tokens with no valid expert (no down program sees them)."""
    BLOCK_T: tl.constexpr = 16
    BLOCK: tl.constexpr = 128
    t_lo = pid * tokens_per_program
    t_hi = tl.minimum(t_lo + tokens_per_program, num_tokens)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        tok_ok = tok < t_hi
        for n0 in range(0, num_n_down, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            tl.store(counter_ptr + tok[:, None] * num_n_down + offs[None, :], tl.zeros((BLOCK_T, BLOCK), tl.int32),
                     mask=tok_ok[:, None] & (offs < num_n_down)[None, :])
        empty = tok_ok & (_num_valid_experts(topk_ids_ptr, tok, tok_ok, top_k, num_experts, TOP_K_P) == 0)
        if tl.max(empty.to(tl.int32), axis=0) > 0:
            for h0 in range(0, H, BLOCK):
                offs = h0 + tl.arange(0, BLOCK)
                tl.store(y_ptr + tok.to(tl.int64)[:, None] * stride_yt + offs[None, :],
                         tl.zeros((BLOCK_T, BLOCK), y_ptr.dtype.element_ty), mask=empty[:, None] & (offs < H)[None, :])


@triton.jit
def _sum_topk(out_ptr, topk_ids_ptr, tok, tok_ok, offs_n, n_mask, top_k, num_experts, stride_ot,
              TOP_K_P: tl.constexpr, CACHE: tl.constexpr):
    """sum_j o[t*k+j, offs_n] over each token's valid experts, in j order from an fp32 zero: the one top-k
    sum of both paths (_sum_topk_if_last, _moe_sum_kernel), so they give the same bits. Unrolled: the k
    loads are in flight together."""
    total = tl.zeros((tok.shape[0], offs_n.shape[0]), dtype=tl.float32)
    for j in tl.static_range(TOP_K_P):
        e = tl.load(topk_ids_ptr + tok * top_k + j, mask=tok_ok & (tl.zeros_like(tok) + j < top_k), other=-1)
        ok = tok_ok & (e >= 0) & (e < num_experts)
        o_ptrs = out_ptr + (tok * top_k + j).to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
        total += tl.load(o_ptrs, mask=ok[:, None] & n_mask[None, :], other=0.0, cache_modifier=CACHE).to(tl.float32)
    return total


@triton.jit
def _sum_topk_if_last(out_ptr, y_ptr, counter_ptr, topk_ids_ptr, pair, row_ok, pid_n, num_n, offs_n, n_mask,
                      top_k, num_experts, stride_ot, stride_yt, TOP_K_P: tl.constexpr):
    """After this program stored its rows of o: y[t, n-tile] = the top-k sum, for the tokens t whose last
    pair on this n-tile this program finished (a counter per (token, n-tile) counts the pairs done)."""
    tok = pair // top_k
    num_valid = _num_valid_experts(topk_ids_ptr, tok, row_ok, top_k, num_experts, TOP_K_P)
    last = row_ok & (arrive(counter_ptr + tok * num_n + pid_n, row_ok) == num_valid - 1)
    if tl.max(last.to(tl.int32), axis=0) > 0:
        total = _sum_topk(out_ptr, topk_ids_ptr, tok, last, offs_n, n_mask, top_k, num_experts, stride_ot, TOP_K_P,
                          ".cg")
        y_ptrs = y_ptr + tok.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=last[:, None] & n_mask[None, :])


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, token_slots_ptr,
    ranks_ptr, xa_ptr, ag_ptr, au_ptr, bg_ptr, bu_ptr, ad_ptr, hd_ptr, ready_ptr, topk_ids_ptr, counter_ptr, y_ptr,
    num_pairs, num_tokens, top_k, H, I, num_slots, num_experts, num_splits, num_n_down, tokens_per_program,
    stride_xt, stride_we, stride_wn, stride_ht, stride_ae, stride_ar, stride_be, stride_br, stride_ade, stride_adr,
    stride_yt,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    HALF_TILES: tl.constexpr, TOP_K_P: tl.constexpr, SPLIT_K: tl.constexpr, PART_N: tl.constexpr,
):
    """h[p] = silu(x Wg^T + LoRA_g) * (x Wu^T + LoRA_u) for the pairs p of one block; with LoRA also
    this n-tile's parts of the down shrink (_down_shrink_part). With pair blocks and
    LoRA the first num_pairs * num_splits programs are the gate/up shrink (as a launch of its own it took
    4 us of Qwen3's 47.5 us LoRA layer at T=1, H100); the GEMM programs wait for it only in the epilogue."""
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    if PAIR_BLOCKS and HAS_LORA:
        num_shrink = num_pairs * num_splits
        if pid < num_shrink:
            if _shrink_one_pair(pid, topk_ids_ptr, token_slots_ptr, x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr, top_k,
                                H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar, BLOCK_M,
                                BLOCK_K, BLOCK_R, SPLIT_K):
                arrive(ready_ptr + pid // num_splits)  # release the pair's xa to its GEMM programs
            return
        pid, num_programs = pid - num_shrink, num_programs - num_shrink
    if PAIR_BLOCKS:
        _prepare_topk_sum(pid, topk_ids_ptr, counter_ptr, y_ptr, num_tokens, top_k, num_experts, num_n_down, H,
                          stride_yt, tokens_per_program, TOP_K_P)
    in_use, e, pid_m, pid_n = _block_info(pid, num_programs, block_expert_ptr, num_rows_ptr, num_experts, I, BLOCK_M,
                                          BLOCK_N, GROUP_M, PAIR_BLOCKS)
    if not in_use:
        return
    half = False  # HALF_TILES: a block of at most BLOCK_M / 2 pairs (on average an expert's last block is
    if HALF_TILES:  # half empty) runs as a half tile; a tensor-core tile costs the same for 1 or BLOCK_M rows
        half = _at_most_half_full(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    if half:
        _gate_up_block(x_ptr, w_ptr, h_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, xa_ptr, bg_ptr, bu_ptr,
                       ad_ptr, hd_ptr, ready_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots, num_experts,
                       num_splits, stride_xt, stride_we, stride_wn, stride_ht, stride_be, stride_br, stride_ade,
                       stride_adr,
                       HAS_LORA, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, BLOCK_R, PARTS, PAIR_BLOCKS, PART_N)
    else:
        _gate_up_block(x_ptr, w_ptr, h_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, xa_ptr, bg_ptr, bu_ptr,
                       ad_ptr, hd_ptr, ready_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots, num_experts,
                       num_splits, stride_xt, stride_we, stride_wn, stride_ht, stride_be, stride_br, stride_ade,
                       stride_adr,
                       HAS_LORA, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, PARTS, PAIR_BLOCKS, PART_N)


@triton.jit
def _gate_up_block(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, xa_ptr, bg_ptr, bu_ptr, ad_ptr, hd_ptr, ready_ptr,
    e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots, num_experts, num_splits, stride_xt, stride_we, stride_wn,
    stride_ht, stride_be, stride_br, stride_ade, stride_adr,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr, PART_N: tl.constexpr,
):
    """The work of one (block, n-tile) program of _gate_up_kernel on a tile of ROWS rows."""
    pair, row_ok = _block_rows(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M, ROWS, PAIR_BLOCKS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    wg_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    if HAS_LORA:  # constexpr: without it the LoRA path is not compiled at all
        token_slot = tl.load(token_slots_ptr + pair // top_k, mask=row_ok, other=-1)  # in flight during the GEMM
    acc_g, acc_u = gemm_loop(x_ptrs, row_ok, H, wg_ptrs, wg_ptrs + I * stride_wn, n_mask, True,
                             ROWS, BLOCK_N, BLOCK_K)
    if HAS_LORA:
        slot, lo, hi = _row_slots(token_slot, num_slots)
        # slot lo's ranks and B and A_d tiles first: their loads overlap the xa loads and, with pair blocks (one
        # slot), the wait for the shrink. A decode step's LoRA cost is mostly such chains of round trips.
        rank_g = _lora_rank(ranks_ptr, 0, lo, e, hi, num_slots, num_experts)
        rank_u = _lora_rank(ranks_ptr, 1, lo, e, hi, num_slots, num_experts)
        rank_d = _lora_rank(ranks_ptr, 2, lo, e, hi, num_slots, num_experts)
        bg = _lora_tile(bg_ptr, lo, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_g, BLOCK_R)
        bu = _lora_tile(bu_ptr, lo, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_u, BLOCK_R)
        offs_p0 = pid_n * BLOCK_N + tl.arange(0, PART_N)  # the tile's down-shrink parts: 1 or 2 (column halves)
        offs_p1 = offs_p0 + PART_N
        ad0 = _lora_tile(ad_ptr, lo, e, num_experts, stride_ade, stride_adr, offs_p0, offs_p0 < I, rank_d, BLOCK_R)
        ad1 = ad0  # the second part's tile; a one-part tile never reads it
        if BLOCK_N != PART_N:
            tl.static_assert(BLOCK_N == 2 * PART_N)
            ad1 = _lora_tile(ad_ptr, lo, e, num_experts, stride_ade, stride_adr, offs_p1, offs_p1 < I, rank_d,
                             BLOCK_R)
        # the shrink x @ A^T, summed once for all rows; each slot's loop picks its rows
        if PAIR_BLOCKS:
            if hi >= 0:  # row 0 has an adapter: exactly then its pair's shrink programs signal
                _wait_shrunk(ready_ptr, tl.min(pair, axis=0), num_splits, tl.cdiv(I, BLOCK_N))  # row 0's pair
        stride = 2 * num_splits * BLOCK_R
        cache: tl.constexpr = ".cg" if PAIR_BLOCKS else ""
        xa_g = _sum_partials(xa_ptr, pair, slot >= 0, stride, num_splits, BLOCK_R, PARTS, cache)
        xa_u = _sum_partials(xa_ptr + num_splits * BLOCK_R, pair, slot >= 0, stride, num_splits, BLOCK_R, PARTS,
                             cache)
        if rank_g + rank_u > 0:  # slot lo (if any), on the tiles loaded above
            acc_g = _lora_expand(acc_g, xa_g, slot == lo, rank_g, bg)
            acc_u = _lora_expand(acc_u, xa_u, slot == lo, rank_u, bu)
        for s in range(lo + 1, hi + 1):  # the block's other slots
            rows = slot == s
            rank_g = _lora_rank(ranks_ptr, 0, s, e, hi, num_slots, num_experts)
            rank_u = _lora_rank(ranks_ptr, 1, s, e, hi, num_slots, num_experts)
            if (rank_g + rank_u > 0) & (tl.max(rows.to(tl.int32), axis=0) > 0):  # else xa was never written
                bg = _lora_tile(bg_ptr, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_g, BLOCK_R)
                bu = _lora_tile(bu_ptr, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_u, BLOCK_R)
                acc_g = _lora_expand(acc_g, xa_g, rows, rank_g, bg)
                acc_u = _lora_expand(acc_u, xa_u, rows, rank_u, bu)
    h = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(h_ptr.dtype.element_ty)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + offs_n[None, :]
    tl.store(h_ptrs, h, mask=row_ok[:, None] & n_mask[None, :])
    if HAS_LORA:  # this tile's parts of the down shrink, one per PART_N (DOWN_SHRINK_PART) columns of I
        if BLOCK_N == PART_N:
            _down_shrink_part(h, pid_n, offs_p0, pair, slot, lo, hi, e, rank_d, ad0, ranks_ptr, ad_ptr, hd_ptr, I,
                              num_slots, num_experts, stride_ade, stride_adr, ROWS, BLOCK_R, PART_N)
        else:  # two parts: the tile's column halves
            h0, h1 = tl.split(tl.permute(tl.reshape(h, (ROWS, 2, PART_N)), (0, 2, 1)))
            _down_shrink_part(h0, 2 * pid_n, offs_p0, pair, slot, lo, hi, e, rank_d, ad0, ranks_ptr, ad_ptr,
                              hd_ptr, I, num_slots, num_experts, stride_ade, stride_adr, ROWS, BLOCK_R, PART_N)
            _down_shrink_part(h1, 2 * pid_n + 1, offs_p1, pair, slot, lo, hi, e, rank_d, ad1, ranks_ptr, ad_ptr,
                              hd_ptr, I, num_slots, num_experts, stride_ade, stride_adr, ROWS, BLOCK_R, PART_N)


@triton.jit
def _down_shrink_part(h, part, offs_n, pair, slot, lo, hi, e, rank_d, ad, ranks_ptr, ad_ptr, hd_ptr, I, num_slots,
                      num_experts, stride_ade, stride_adr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                      PART_N: tl.constexpr):
    """hd[p, part] = h[p, offs_n] @ A_d[:, offs_n]^T over the PART_N columns of this part, for each row's
    slot (slot lo's rank_d and A_d tile `ad` come loaded): the down kernel adds the parts up in order, so a
    part's columns never follow the tile."""
    offs_r = tl.arange(0, BLOCK_R)
    hd = tl.zeros((ROWS, BLOCK_R), dtype=tl.float32)
    if rank_d > 0:
        hd += tl.dot(tl.where((slot == lo)[:, None], h, 0.0), tl.trans(ad))
    for s in range(lo + 1, hi + 1):
        rows = slot == s
        rank_d = _lora_rank(ranks_ptr, 2, s, e, hi, num_slots, num_experts)
        if (rank_d > 0) & (tl.max(rows.to(tl.int32), axis=0) > 0):
            ad = _lora_tile(ad_ptr, s, e, num_experts, stride_ade, stride_adr, offs_n, offs_n < I, rank_d, BLOCK_R)
            hd += tl.dot(tl.where(rows[:, None], h, 0.0), tl.trans(ad))
    num_parts = tl.cdiv(I, PART_N)
    hd_ptrs = hd_ptr + (pair.to(tl.int64) * num_parts + part)[:, None] * BLOCK_R + offs_r[None, :]
    tl.store(hd_ptrs, hd, mask=((slot >= 0) & (tl.zeros_like(slot) + part < num_parts))[:, None])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, token_slots_ptr,
    ranks_ptr, hd_ptr, b_ptr, topk_ids_ptr, counter_ptr, y_ptr,
    num_pairs, top_k, H, I, num_slots, num_experts, num_hd_parts,
    stride_ht, stride_we, stride_wn, stride_ot, stride_be, stride_br, stride_yt,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    HALF_TILES: tl.constexpr, TOP_K_P: tl.constexpr,
):
    """out[p] = w[p] * (h[p] Wd^T + LoRA_d) for the pairs p of one block (the down shrink is the sum
    of the gate_up kernel's per-tile parts), then y for the tokens whose last pair this was."""
    in_use, e, pid_m, pid_n = _block_info(tl.program_id(0), tl.num_programs(0), block_expert_ptr, num_rows_ptr,
                                          num_experts, H, BLOCK_M, BLOCK_N, GROUP_M, PAIR_BLOCKS)
    if not in_use:
        return
    half = False
    if HALF_TILES:
        half = _at_most_half_full(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    if half:
        _down_block(h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, hd_ptr,
                    b_ptr, topk_ids_ptr, counter_ptr, y_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots,
                    num_experts, num_hd_parts, stride_ht, stride_we, stride_wn, stride_ot, stride_be, stride_br,
                    stride_yt,
                    HAS_LORA, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, BLOCK_R, PARTS, PAIR_BLOCKS, TOP_K_P)
    else:
        _down_block(h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, hd_ptr,
                    b_ptr, topk_ids_ptr, counter_ptr, y_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots,
                    num_experts, num_hd_parts, stride_ht, stride_we, stride_wn, stride_ot, stride_be, stride_br,
                    stride_yt,
                    HAS_LORA, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, PARTS, PAIR_BLOCKS, TOP_K_P)


@triton.jit
def _down_block(
    h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, hd_ptr, b_ptr, topk_ids_ptr,
    counter_ptr, y_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots, num_experts, num_hd_parts, stride_ht,
    stride_we, stride_wn, stride_ot, stride_be, stride_br, stride_yt,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr, TOP_K_P: tl.constexpr,
):
    """The work of one (block, n-tile) program of _down_kernel on a tile of ROWS rows."""
    pair, row_ok = _block_rows(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M, ROWS, PAIR_BLOCKS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + offs_k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)  # loads in flight during the GEMM
    if HAS_LORA:
        token_slot = tl.load(token_slots_ptr + pair // top_k, mask=row_ok, other=-1)
    acc, _ = gemm_loop(h_ptrs, row_ok, I, w_ptrs, w_ptrs, n_mask, False, ROWS, BLOCK_N, BLOCK_K)
    if HAS_LORA:
        slot, lo, hi = _row_slots(token_slot, num_slots)
        rank_d = _lora_rank(ranks_ptr, 2, lo, e, hi, num_slots, num_experts)  # slot lo's B: loads overlap hd's
        bd = _lora_tile(b_ptr, lo, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_d, BLOCK_R)
        hd = _sum_partials(hd_ptr, pair, slot >= 0, num_hd_parts * BLOCK_R, num_hd_parts, BLOCK_R, PARTS, "")
        if rank_d > 0:
            acc = _lora_expand(acc, hd, slot == lo, rank_d, bd)
        for s in range(lo + 1, hi + 1):
            rows = slot == s
            rank_d = _lora_rank(ranks_ptr, 2, s, e, hi, num_slots, num_experts)
            if (rank_d > 0) & (tl.max(rows.to(tl.int32), axis=0) > 0):
                bd = _lora_tile(b_ptr, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_d, BLOCK_R)
                acc = _lora_expand(acc, hd, rows, rank_d, bd)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_mask[None, :])
    if PAIR_BLOCKS:
        _sum_topk_if_last(out_ptr, y_ptr, counter_ptr, topk_ids_ptr, pair, row_ok, pid_n, tl.cdiv(H, BLOCK_N),
                          offs_n, n_mask, top_k, num_experts, stride_ot, stride_yt, TOP_K_P)


@triton.jit
def _moe_sum_kernel(out_ptr, topk_ids_ptr, y_ptr, H, top_k, num_experts, stride_ot, stride_yt,
                    TOP_K_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """y[t] = the top-k sum of o (_sum_topk), one token and BLOCK_H columns a program."""
    tok = tl.program_id(0) + tl.zeros((1,), dtype=tl.int32)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    total = _sum_topk(out_ptr, topk_ids_ptr, tok, tok >= 0, offs, mask, top_k, num_experts, stride_ot, TOP_K_P, "")
    tl.store(y_ptr + tok.to(tl.int64)[:, None] * stride_yt + offs[None, :], total.to(y_ptr.dtype.element_ty),
             mask=mask[None, :])


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRASlots | None = None,
    token_slots: torch.Tensor | None = None,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk.ids.shape[1]
    num_pairs = num_tokens * top_k
    cfg = config or default_config(num_tokens, top_k, num_experts, x.dtype)
    if lora is not None and cfg.block_n_gate_up not in (DOWN_SHRINK_PART, 2 * DOWN_SHRINK_PART):
        raise ValueError(f"with LoRA the gate_up n tile must be {DOWN_SHRINK_PART} or {2 * DOWN_SHRINK_PART} "
                         f"columns (one or two down-shrink parts), got {cfg.block_n_gate_up}")
    num_slots = lora.num_slots if lora is not None else 0
    num_n_gate_up = triton.cdiv(inter, cfg.block_n_gate_up)
    num_hd_parts = triton.cdiv(inter, DOWN_SHRINK_PART)
    num_n_down = triton.cdiv(hidden, cfg.block_n_down)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    y = torch.empty_like(x)
    # with pair blocks the down kernel sums the top-k itself: arrival counters, zeroed by gate_up
    counters = torch.empty(num_tokens * num_n_down if cfg.pair_blocks else 1, dtype=torch.int32, device=x.device)
    common = dict(HAS_LORA=lora is not None, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  PARTS=SUM_PARTS, PAIR_BLOCKS=cfg.pair_blocks, HALF_TILES=cfg.half_tiles,
                  TOP_K_P=triton.next_power_of_2(top_k), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.pair_blocks:  # block p = pair p: its expert is topk.ids[p]; no sorted ids or row count to read
        blocks = AlignedBlocks(topk.ids, topk.ids.view(-1), topk.ids, cfg.block_m)
    num_shrink, ready = 0, topk.ids  # gate/up shrink programs in the gate_up launch (then it reads `ready`)
    if lora is None:  # HAS_LORA=False never reads these
        if not cfg.pair_blocks:
            blocks = moe_align(topk.ids, None, num_experts, 0, cfg.block_m)
        slots = ranks = topk.ids
        xa = hd = ag = au = bg = bu = ad = bd = w13
        num_splits, block_r = 1, LORA_RANK_CHUNK
        a_strides = b_strides = ad_strides = bd_strides = (0, 0)
    else:
        slots, ranks = token_slots, lora.ranks
        ag, au, bg, bu, ad, bd = lora.a_gate, lora.a_up, lora.b_gate, lora.b_up, lora.a_down, lora.b_down
        block_r = rank_tile(lora.max_rank_in_use or lora.a_gate.shape[2])
        a_strides, b_strides = ag.stride()[1:3], bg.stride()[1:3]
        ad_strides, bd_strides = ad.stride()[1:3], bd.stride()[1:3]
        num_splits = triton.cdiv(hidden, SHRINK_SPLIT_K)
        xa = torch.empty(num_pairs, 2, num_splits, block_r, dtype=torch.float32, device=x.device)
        hd = torch.empty(num_pairs, num_hd_parts, block_r, dtype=torch.float32, device=x.device)
        if cfg.pair_blocks:  # the shrink runs in the gate_up launch, its GEMM programs wait on a counter per pair
            if num_pairs > READY_COUNTERS:
                raise ValueError(f"pair blocks with LoRA on {num_pairs} pairs: more than the {READY_COUNTERS} counters")
            ready = zeroed_counters(_ready, READY_COUNTERS, x.device, "fused_moe pair blocks with LoRA")
            num_shrink = num_pairs * num_splits
        elif num_pairs <= PAIR_SHRINK_MAX_PAIRS:  # one launch: the alignment and a shrink per pair
            blocks, cursor = alloc_aligned(num_pairs, num_experts, num_slots, cfg.block_m, x.device)
            e_p, s1_p = key_tile(num_experts, num_slots)
            _pair_shrink_kernel[(1 + num_pairs * num_splits,)](
                topk.ids, slots, blocks.sorted_ids, blocks.block_expert, blocks.num_rows, cursor,
                x, xa, ranks, ag, au,
                num_pairs, top_k, hidden, num_slots, num_experts, blocks.sorted_ids.numel(), num_splits,
                x.stride(0), *a_strides,
                BLOCK_M=cfg.block_m, E_P=e_p, S1_P=s1_p, CHUNK=CHUNK, BLOCK_K=cfg.block_k,
                BLOCK_R=block_r, SPLIT_K=SHRINK_SPLIT_K, num_warps=align_num_warps(num_experts, num_slots),
            )
        else:
            blocks = moe_align(topk.ids, token_slots, num_experts, num_slots, cfg.block_m)
            _shrink_kernel[(blocks.block_expert.numel(), num_splits)](
                x, xa, blocks.sorted_ids, blocks.block_expert, blocks.num_rows, slots, ranks,
                ag, au, num_pairs, top_k, hidden, num_slots, num_experts, num_splits,
                x.stride(0), *a_strides,
                BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=block_r, SPLIT_K=SHRINK_SPLIT_K, num_warps=4,
            )
        if not cfg.pair_blocks:  # (with pair blocks xa is written in the gate_up launch that reads it)
            xa, num_splits = _reduce_partials(xa.view(num_pairs * 2, num_splits, block_r), 2 * top_k, slots,
                                              num_slots, num_pairs)
    num_m = blocks.block_expert.numel()
    grid_gate_up = num_m * num_n_gate_up
    _gate_up_kernel[(num_shrink + grid_gate_up,)](
        x, w13, h, blocks.sorted_ids, blocks.block_expert, blocks.num_rows, slots,
        ranks, xa, ag, au, bg, bu, ad, hd, ready, topk.ids, counters, y,
        num_pairs, num_tokens, top_k, hidden, inter, num_slots, num_experts, num_splits, num_n_down,
        triton.cdiv(num_tokens, grid_gate_up),
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), *a_strides, *b_strides, *ad_strides, y.stride(0),
        BLOCK_N=cfg.block_n_gate_up, BLOCK_R=block_r, SPLIT_K=SHRINK_SPLIT_K, PART_N=DOWN_SHRINK_PART, **common,
    )
    if lora is not None:
        hd, num_hd_parts = _reduce_partials(hd, top_k, slots, num_slots, num_pairs)
    _down_kernel[(num_m * num_n_down,)](
        h, w2, out, topk.weights, blocks.sorted_ids, blocks.block_expert, blocks.num_rows, slots,
        ranks, hd, bd, topk.ids, counters, y,
        num_pairs, top_k, hidden, inter, num_slots, num_experts, num_hd_parts,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *bd_strides, y.stride(0),
        BLOCK_N=cfg.block_n_down, BLOCK_R=block_r, **common,
    )
    if not cfg.pair_blocks:
        block_h = min(1024, triton.next_power_of_2(hidden))
        _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            out, topk.ids, y, hidden, top_k, num_experts, out.stride(0), y.stride(0),
            TOP_K_P=triton.next_power_of_2(top_k), BLOCK_H=block_h,
        )
    return y


def _reduce_partials(parts: torch.Tensor, rows_per_token: int, token_slots: torch.Tensor, num_slots: int,
                     num_pairs: int) -> tuple[torch.Tensor, int]:
    """parts [rows, P, R] (the rows of token t at t * rows_per_token ...) summed per row into [rows, 1, R]
    for batches of REDUCE_PARTIALS_MIN_PAIRS pairs or more; returns the buffer to read and its parts."""
    rows, num_parts, block_r = parts.shape
    if num_parts == 1 or num_pairs < REDUCE_PARTIALS_MIN_PAIRS:
        return parts, num_parts
    out = torch.empty(rows, 1, block_r, dtype=torch.float32, device=parts.device)
    # each row's sum is a chain of dependent adds, so: many programs (about REDUCE_PROGRAMS), each with
    # few rows and many loads in flight (the sum's order, hence its bits, does not depend on either)
    block_rows = min(64, triton.next_power_of_2(triton.cdiv(rows, REDUCE_PROGRAMS)))
    _reduce_partials_kernel[(triton.cdiv(rows, block_rows),)](
        parts, out, token_slots, rows, rows_per_token, num_parts, num_slots,
        BLOCK_ROWS=block_rows, BLOCK_R=block_r, PARTS=min(32, triton.next_power_of_2(num_parts)),
        num_warps=max(1, min(4, block_rows * block_r // 128)))
    return out, 1


# ------------------------------------------------------------------------------------ torch


def _lora_delta_reference(inp: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """(inp A^T) B^T in fp32 for A [r, in] and B^T [r, out], rounding the shrink to the weights'
    dtype as the kernel does."""
    return (inp @ a.float().T).to(a.dtype).float() @ b_t.float()


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRASlots | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: loop over the experts (and slots) present; fp32 math, dtype at the same points
    as the kernels (h, the shrink result, and each weighted expert output)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk.ids.shape[1]
    experts = topk.ids.flatten().long()
    weights = topk.weights.flatten().float()
    tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    valid = (experts >= 0) & (experts < num_experts)
    slots = None
    if lora is not None:
        slots = token_slots.long()[tokens]
        slots = torch.where((slots >= 0) & (slots < lora.num_slots), slots, -1)

    pair_out = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    for e in experts[valid].unique().tolist():
        pairs = torch.nonzero(valid & (experts == e)).flatten()
        xe = x[tokens[pairs]].float()
        gate = xe @ w13[e, :inter].float().T
        up = xe @ w13[e, inter:].float().T
        lora_rows = []
        if lora is not None:
            for s in slots[pairs].unique().tolist():
                if s >= 0:
                    lora_rows.append((s, torch.nonzero(slots[pairs] == s).flatten()))
        for s, rows in lora_rows:
            rg, ru = int(lora.ranks[0, s, e]), int(lora.ranks[1, s, e])
            gate[rows] += _lora_delta_reference(xe[rows], lora.a_gate[s, e, :rg], lora.b_gate[s, e, :rg])
            up[rows] += _lora_delta_reference(xe[rows], lora.a_up[s, e, :ru], lora.b_up[s, e, :ru])
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
        out = h @ w2[e].float().T
        for s, rows in lora_rows:
            rd = int(lora.ranks[2, s, e])
            out[rows] += _lora_delta_reference(h[rows], lora.a_down[s, e, :rd], lora.b_down[s, e, :rd])
        pair_out[pairs] = (out * weights[pairs, None]).to(x.dtype).float()
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


# ------------------------------------------------------------------------------ entry point


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRASlots | None = None,
    token_slots: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """MoE block output y [T, H] for x [T, H], w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I], routing `topk`, and optionally the per-expert LoRA of the slots named by
    token_slots [T] int32 (-1: no adapter). impl: "triton", "torch" or "auto" (triton on CUDA)."""
    _check_inputs(x, w13, w2, topk, lora, token_slots)
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "torch":
        return fused_moe_reference(x, w13, w2, topk, lora, token_slots)
    if impl == "triton":
        return fused_moe_triton(x, w13, w2, topk, lora, token_slots, config)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check_inputs(x, w13, w2, topk, lora, token_slots) -> None:
    """Shape and dtype checks only: nothing here reads device memory (CUDA-graph safe)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [tokens, hidden] tensor, got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    num_experts, hidden2, inter = w2.shape
    if tuple(w13.shape) != (num_experts, 2 * inter, hidden) or hidden2 != hidden:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         f"expected w13 ({num_experts}, {2 * inter}, {hidden}) and w2 ({num_experts}, {hidden}, {inter})")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype or w.stride(-1) != 1:
            raise ValueError(f"{name} must have x's dtype {x.dtype} and be contiguous in its last dimension")
    weights, ids = topk
    if ids.dim() != 2 or ids.shape[0] != num_tokens or ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"topk ids must be contiguous int32 [{num_tokens}, k], got {ids.dtype} {tuple(ids.shape)}")
    if weights.shape != ids.shape or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"topk weights must be contiguous float32 {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    if lora is not None:
        lora.validate(num_experts, hidden, inter, x.dtype)
        if token_slots is None or token_slots.shape != (num_tokens,) or token_slots.dtype != torch.int32:
            got = None if token_slots is None else (token_slots.dtype, tuple(token_slots.shape))
            raise ValueError(f"with lora, token_slots must be int32 of shape ({num_tokens},), got {got}")
