"""The grouped expert GEMMs with the LoRA of many adapters in their epilogues: gate_up (SiLU * up, and the
down shrink's parts, or at prefill tiles none: shrink.down_shrink_kernel) and down (the routing weight, and with
pair blocks the top-k sum)."""
from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.fused_moe.config import SUM_PARTS
from moelora.kernels.fused_moe.reduction import prepare_topk_sum, sum_topk_if_last, token_experts
from moelora.kernels.fused_moe.shrink import shrink_one_pair
from moelora.kernels.fused_moe.tiles import (adapter_slots, at_most_half_full, block_info, block_rows, lora_expand,
                                             lora_tile, next_chunk_step, next_run_slot, one_part, previous_row_slots,
                                             row_ranks, row_slots, run_chunk_steps, slot_rank, slot_runs,
                                             sum_partials, takes_rank_tile)
from moelora.kernels.lora_tiles import LORA_RANK_CHUNK
from moelora.kernels.gemm_tiles import arrive, gemm_loop, gemm_loop_tma, wait_arrivals
from moelora.kernels.pdl import launch_next_kernel, wait_for_previous_kernel

RC = tl.constexpr(LORA_RANK_CHUNK)  # the ranks of a step of the LoRA epilogues' loops with CHUNKS
SP = tl.constexpr(SUM_PARTS)


@triton.jit(do_not_specialize=["num_pairs", "num_tokens", "tokens_per_program"])  # row counts: kernels/__init__.py
def gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, token_slots_ptr,
    ranks_ptr, xa_ptr, ag_ptr, au_ptr, bg_ptr, bu_ptr, ad_ptr, hd_ptr, ready_ptr, topk_ids_ptr, counter_ptr, y_ptr,
    num_pairs, num_tokens, top_k, H, I, num_slots, num_experts, num_splits, num_n_down, tokens_per_program,
    stride_xt, stride_we, stride_wn, stride_ht, stride_ae, stride_ar, stride_be, stride_br, stride_ade, stride_adr,
    stride_yt,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    HALF_TILES: tl.constexpr, TOP_K_P: tl.constexpr, SPLIT_K: tl.constexpr, PART_N: tl.constexpr,
    RANK_TILES: tl.constexpr, CHUNKS: tl.constexpr, SLOT_STAGES: tl.constexpr, A_ALIGNED: tl.constexpr,
    SHRINK_ROWS: tl.constexpr, DOWN_SHRINK: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):
    """h[p] = silu(x Wg^T + LoRA_g) * (x Wu^T + LoRA_u) for the pairs p of one block (TMA: w_ptr is the copy engine's
    descriptor of W [E, 2I, H], tiles [1, BLOCK_N, BLOCK_K]); with LoRA and DOWN_SHRINK
    also this n-tile's parts of the down shrink (_down_shrink_part). With pair blocks and
    LoRA the first num_pairs * num_splits programs are the gate/up shrink (a launch of its own costs a
    decode step more than the shrink's work); the GEMM programs wait for it only in the epilogue. CHUNKS (aligned
    blocks whose partials are one part): each run's LoRA in steps of LORA_RANK_CHUNK ranks (_gate_up_lora_chunks),
    else each block's on one rank tile. Holding the epilogues of more than one rank tile, its programs let the next
    launch start only when their work is done: launched earlier, that kernel's waiting programs crowded these
    (benchmarks/RESULTS.md, sessions 32-33)."""
    wait_for_previous_kernel(PDL, RANK_TILES == 1 or CHUNKS)
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    if PAIR_BLOCKS and HAS_LORA:
        num_shrink = num_pairs * num_splits
        if pid < num_shrink:
            if shrink_one_pair(pid, topk_ids_ptr, token_slots_ptr, x_ptr, xa_ptr, ranks_ptr, ag_ptr, au_ptr, top_k,
                                H, num_slots, num_experts, num_splits, stride_xt, stride_ae, stride_ar, SHRINK_ROWS,
                                BLOCK_K, BLOCK_R, SPLIT_K, RANK_TILES, A_ALIGNED):
                arrive(ready_ptr + pid // num_splits)  # release the pair's xa to its GEMM programs
            return
        pid, num_programs = pid - num_shrink, num_programs - num_shrink
    if PAIR_BLOCKS:
        prepare_topk_sum(pid, topk_ids_ptr, counter_ptr, y_ptr, num_tokens, top_k, num_experts, num_n_down, H,
                          stride_yt, tokens_per_program, TOP_K_P)
    in_use, e, pid_m, pid_n = block_info(pid, num_programs, block_expert_ptr, num_rows_ptr, num_experts, I, BLOCK_M,
                                          BLOCK_N, GROUP_M, PAIR_BLOCKS)
    if not in_use:
        return
    half = False  # HALF_TILES: a block of at most BLOCK_M / 2 pairs (on average an expert's last block is
    if HALF_TILES:  # half empty) runs as a half tile; a tensor-core tile costs the same for 1 or BLOCK_M rows
        half = at_most_half_full(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    if half:
        _gate_up_block(x_ptr, w_ptr, h_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, xa_ptr, bg_ptr, bu_ptr,
                       ad_ptr, hd_ptr, ready_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots, num_experts,
                       num_splits, stride_xt, stride_we, stride_wn, stride_ht, stride_be, stride_br, stride_ade,
                       stride_adr,
                       HAS_LORA, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, BLOCK_R, PARTS, PAIR_BLOCKS, PART_N,
                       RANK_TILES, CHUNKS, SLOT_STAGES, DOWN_SHRINK, TMA)
    else:
        _gate_up_block(x_ptr, w_ptr, h_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, xa_ptr, bg_ptr, bu_ptr,
                       ad_ptr, hd_ptr, ready_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots, num_experts,
                       num_splits, stride_xt, stride_we, stride_wn, stride_ht, stride_be, stride_br, stride_ade,
                       stride_adr,
                       HAS_LORA, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, PARTS, PAIR_BLOCKS, PART_N, RANK_TILES,
                       CHUNKS, SLOT_STAGES, DOWN_SHRINK, TMA)
    if RANK_TILES > 1 and not CHUNKS:
        launch_next_kernel(PDL)


@triton.jit
def _gate_up_block(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, xa_ptr, bg_ptr, bu_ptr, ad_ptr, hd_ptr, ready_ptr,
    e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots, num_experts, num_splits, stride_xt, stride_we, stride_wn,
    stride_ht, stride_be, stride_br, stride_ade, stride_adr,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr, PART_N: tl.constexpr,
    RANK_TILES: tl.constexpr, CHUNKS: tl.constexpr, SLOT_STAGES: tl.constexpr, DOWN_SHRINK: tl.constexpr,
    TMA: tl.constexpr,
):
    """The work of one (block, n-tile) program of gate_up_kernel on a tile of ROWS rows."""
    pair, row_ok = block_rows(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M, ROWS, PAIR_BLOCKS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    if HAS_LORA:  # constexpr: without it the LoRA path is not compiled at all
        token_slot = tl.load(token_slots_ptr + pair // top_k, mask=row_ok, other=-1)  # in flight during the GEMM
        prev_slot = previous_row_slots(sorted_ids_ptr, token_slots_ptr, pid_m, num_pairs, top_k, num_slots, BLOCK_M,
                                       ROWS, PAIR_BLOCKS)
    # TMA: a last tile past I reads up rows as its gate rows there (the descriptor spans 2I) and zeros as their up
    # rows (past 2I), so h is 0 in those columns, which are never stored
    if TMA:
        acc_g, acc_u = gemm_loop_tma(x_ptrs, row_ok, H, w_ptr, e, pid_n * BLOCK_N, I + pid_n * BLOCK_N, True,
                                     ROWS, BLOCK_N, BLOCK_K)
    else:
        wg_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc_g, acc_u = gemm_loop(x_ptrs, row_ok, H, wg_ptrs, wg_ptrs + I * stride_wn, n_mask, True,
                                 ROWS, BLOCK_N, BLOCK_K)
    if HAS_LORA:
        slot, _, hi = row_slots(token_slot, num_slots)
        rank_g = row_ranks(ranks_ptr, slot, e, num_slots, num_experts, 0)
        rank_u = row_ranks(ranks_ptr, slot, e, num_slots, num_experts, 1)
        rank_d = tl.zeros_like(rank_g)  # without the down shrink here, runs and rank tile follow gate and up alone
        if DOWN_SHRINK:
            rank_d = row_ranks(ranks_ptr, slot, e, num_slots, num_experts, 2)
        start, s0, num_runs = slot_runs(slot, prev_slot, rank_g + rank_u + rank_d, num_slots)
        if CHUNKS:
            _gate_up_lora_chunks(acc_g, acc_u, h_ptr, pair, row_ok, slot, start, s0, e, pid_n, offs_n, n_mask,
                                 rank_g, rank_u, rank_d, xa_ptr, bg_ptr, bu_ptr, ad_ptr, hd_ptr, I, num_slots,
                                 num_experts, stride_ht, stride_be, stride_br, stride_ade, stride_adr, ROWS, BLOCK_N,
                                 BLOCK_R, PART_N, SLOT_STAGES, DOWN_SHRINK)
        else:
            r = tl.max(tl.maximum(tl.maximum(rank_g, rank_u), rank_d), axis=0)
            for c in tl.static_range(RANK_TILES):
                if takes_rank_tile(r, c, RANK_TILES, BLOCK_R):  # (returning the accumulators ends their old values)
                    acc_g, acc_u = _gate_up_lora(
                        acc_g, acc_u, h_ptr, pair, row_ok, slot, start, s0, num_runs, hi, e, pid_n, offs_n, n_mask,
                        rank_g, rank_u, rank_d, xa_ptr, bg_ptr, bu_ptr, ad_ptr, hd_ptr, ready_ptr, I, num_slots,
                        num_experts, num_splits, stride_ht, stride_be, stride_br, stride_ade, stride_adr, ROWS, BLOCK_N,
                        c, RANK_TILES, BLOCK_R, PARTS, PAIR_BLOCKS, PART_N, SLOT_STAGES, DOWN_SHRINK)
            if r == 0:  # no adapter in the block covers expert e: the plain result, no LoRA work
                if PAIR_BLOCKS:
                    if hi >= 0:  # row 0 has an adapter, so its pair's shrink programs signal: count in
                        wait_arrivals(ready_ptr + tl.min(pair, axis=0), num_splits, tl.cdiv(I, BLOCK_N))
                _store_h(acc_g, acc_u, h_ptr, pair, row_ok, offs_n, n_mask, stride_ht)
    else:
        _store_h(acc_g, acc_u, h_ptr, pair, row_ok, offs_n, n_mask, stride_ht)


@triton.jit
def _store_h(acc_g, acc_u, h_ptr, pair, row_ok, offs_n, n_mask, stride_ht):
    """h = silu(gate) * up for the block's rows, stored; returned in h's dtype."""
    h = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(h_ptr.dtype.element_ty)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + offs_n[None, :]
    tl.store(h_ptrs, h, mask=row_ok[:, None] & n_mask[None, :])
    return h


@triton.jit
def _gate_up_lora(
    acc_g, acc_u, h_ptr, pair, row_ok, slot, start, s0, num_runs, hi, e, pid_n, offs_n, n_mask, row_rank_g,
    row_rank_u, row_rank_d, xa_ptr, bg_ptr, bu_ptr, ad_ptr, hd_ptr, ready_ptr, I, num_slots, num_experts, num_splits,
    stride_ht, stride_be, stride_br, stride_ade, stride_adr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr, RANK_TILES: tl.constexpr, BLOCK_R: tl.constexpr,
    PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr, PART_N: tl.constexpr, SLOT_STAGES: tl.constexpr,
    DOWN_SHRINK: tl.constexpr,
):
    """The epilogue of a gate_up program whose block's LoRA takes rank tile C (tiles.takes_rank_tile): the
    gate/up deltas, h stored, and with DOWN_SHRINK this tile's parts of the down shrink (_down_shrink_part). The
    partials are laid out BLOCK_R columns a part; each row's down-shrink parts are written below its rank
    (row_rank_d) only. Returns the accumulators with the deltas."""
    R: tl.constexpr = BLOCK_R if C == RANK_TILES - 1 else 16 << C
    # the first run's ranks and B and A_d tiles first (start, s0, num_runs: the block's runs of rows whose slot has
    # LoRA on expert e, tiles.slot_runs): their loads overlap the xa loads and, with pair blocks (one slot), the
    # wait for the shrink. A decode step's LoRA cost is mostly such chains of round trips.
    first = slot == s0
    rank_g, rank_u, rank_d = slot_rank(row_rank_g, first), slot_rank(row_rank_u, first), slot_rank(row_rank_d, first)
    bg = lora_tile(bg_ptr, s0, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_g, R)
    bu = lora_tile(bu_ptr, s0, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_u, R)
    if DOWN_SHRINK:
        offs_p0 = pid_n * BLOCK_N + tl.arange(0, PART_N)  # the tile's down-shrink parts: 1 or 2 (column halves)
        offs_p1 = offs_p0 + PART_N
        ad0 = lora_tile(ad_ptr, s0, e, num_experts, stride_ade, stride_adr, offs_p0, offs_p0 < I, rank_d, R)
        ad1 = ad0  # the second part's tile; a one-part tile never reads it
        if BLOCK_N != PART_N:
            tl.static_assert(BLOCK_N == 2 * PART_N)
            ad1 = lora_tile(ad_ptr, s0, e, num_experts, stride_ade, stride_adr, offs_p1, offs_p1 < I, rank_d, R)
    # the shrink x @ A^T, summed once for all rows; each slot's loop picks its rows
    if PAIR_BLOCKS:
        if hi >= 0:  # row 0 has an adapter: exactly then its pair's shrink programs signal
            wait_arrivals(ready_ptr + tl.min(pair, axis=0), num_splits, tl.cdiv(I, BLOCK_N))  # row 0's pair
    stride = 2 * num_splits * BLOCK_R
    cache: tl.constexpr = ".cg" if PAIR_BLOCKS else ""
    # all R columns of every row with a slot: masking by each row's rank would put the rank gather before
    # these loads (a round trip more at small batches); lora_expand drops what is past a row's rank
    xa_g = sum_partials(xa_ptr, pair, slot >= 0, R, stride, num_splits, R, BLOCK_R, PARTS, cache)
    xa_u = sum_partials(xa_ptr + num_splits * BLOCK_R, pair, slot >= 0, R, stride, num_splits, R, BLOCK_R, PARTS,
                        cache)
    if num_runs > 0:  # the first run, on the tiles loaded above
        acc_g = lora_expand(acc_g, xa_g, first, rank_g, bg)
        acc_u = lora_expand(acc_u, xa_u, first, rank_u, bu)
    # the other runs. Pipelined (SLOT_STAGES > 1, MoEKernelConfig.slot_stages), the next run's tiles load while
    # this one's dots run
    if num_runs > 1:
        s = s0
        for _ in tl.range(1, num_runs, num_stages=SLOT_STAGES):
            s = next_run_slot(slot, start, s, num_slots)
            rows = slot == s
            rank_g, rank_u = slot_rank(row_rank_g, rows), slot_rank(row_rank_u, rows)
            bg = lora_tile(bg_ptr, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_g, R)
            bu = lora_tile(bu_ptr, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_u, R)
            acc_g = lora_expand(acc_g, xa_g, rows, rank_g, bg)
            acc_u = lora_expand(acc_u, xa_u, rows, rank_u, bu)
    h = _store_h(acc_g, acc_u, h_ptr, pair, row_ok, offs_n, n_mask, stride_ht)
    # this tile's parts of the down shrink, one per PART_N (DOWN_SHRINK_PART) columns of I
    if DOWN_SHRINK:
        if BLOCK_N == PART_N:
            _down_shrink_part(h, pid_n, offs_p0, pair, slot, start, s0, num_runs, e, row_rank_d, ad0, ad_ptr,
                              hd_ptr, I, num_slots, num_experts, stride_ade, stride_adr, ROWS, R, BLOCK_R, PART_N,
                              SLOT_STAGES)
        else:  # two parts: the tile's column halves
            h0, h1 = tl.split(tl.permute(tl.reshape(h, (ROWS, 2, PART_N)), (0, 2, 1)))
            _down_shrink_part(h0, 2 * pid_n, offs_p0, pair, slot, start, s0, num_runs, e, row_rank_d, ad0,
                              ad_ptr, hd_ptr, I, num_slots, num_experts, stride_ade, stride_adr, ROWS, R, BLOCK_R,
                              PART_N, SLOT_STAGES)
            _down_shrink_part(h1, 2 * pid_n + 1, offs_p1, pair, slot, start, s0, num_runs, e, row_rank_d, ad1,
                              ad_ptr, hd_ptr, I, num_slots, num_experts, stride_ade, stride_adr, ROWS, R, BLOCK_R,
                              PART_N, SLOT_STAGES)
    return acc_g, acc_u


@triton.jit
def _gate_up_lora_chunks(
    acc_g, acc_u, h_ptr, pair, row_ok, slot, start, s0, e, pid_n, offs_n, n_mask, row_rank_g, row_rank_u, row_rank_d,
    xa_ptr, bg_ptr, bu_ptr, ad_ptr, hd_ptr, I, num_slots, num_experts, stride_ht, stride_be, stride_br, stride_ade,
    stride_adr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PART_N: tl.constexpr, SLOT_STAGES: tl.constexpr,
    DOWN_SHRINK: tl.constexpr,
):
    """_gate_up_lora for an aligned block whose xa is one part (reduce_partials' sums): each run (start, s0:
    tiles.slot_runs) in steps of LORA_RANK_CHUNK ranks, as many as its rank takes (tiles.run_chunk_steps), so the
    block's LoRA work follows its runs' ranks, not its largest. A step's dot adds its ranks' products to the sum of
    the steps before it, as a dot over a wider rank tile does on the tensor cores (16 ranks an MMA, in order, into
    the accumulator): the bits of the rank-tile path. Pipelined (SLOT_STAGES > 1), the next steps' tiles load while
    this one's dots run. Stores h, and with DOWN_SHRINK this tile's parts of the down shrink."""
    stride = 2 * BLOCK_R
    s, c = s0, s0 * 0
    for _ in tl.range(0, run_chunk_steps(tl.maximum(row_rank_g, row_rank_u), start, RC), num_stages=SLOT_STAGES):
        rows = slot == s
        rank_g, rank_u = slot_rank(row_rank_g, rows), slot_rank(row_rank_u, rows)
        k0 = c * RC
        bg = lora_tile(bg_ptr + k0 * stride_br, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_g - k0,
                       RC)
        bu = lora_tile(bu_ptr + k0 * stride_br, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_u - k0,
                       RC)
        acc_g = lora_expand(acc_g, one_part(xa_ptr + k0, pair, rows, stride, RC), rows, rank_g - k0, bg)
        acc_u = lora_expand(acc_u, one_part(xa_ptr + BLOCK_R + k0, pair, rows, stride, RC), rows, rank_u - k0, bu)
        s, c = next_chunk_step(s, c, tl.maximum(rank_g, rank_u), slot, start, num_slots, RC)
    h = _store_h(acc_g, acc_u, h_ptr, pair, row_ok, offs_n, n_mask, stride_ht)
    if DOWN_SHRINK:
        offs_p0 = pid_n * BLOCK_N + tl.arange(0, PART_N)
        if BLOCK_N == PART_N:
            _down_shrink_part_chunks(h, pid_n, offs_p0, pair, slot, start, s0, e, row_rank_d, ad_ptr, hd_ptr, I,
                                     num_slots, num_experts, stride_ade, stride_adr, BLOCK_R, PART_N, SLOT_STAGES)
        else:  # two parts: the tile's column halves
            tl.static_assert(BLOCK_N == 2 * PART_N)
            h0, h1 = tl.split(tl.permute(tl.reshape(h, (ROWS, 2, PART_N)), (0, 2, 1)))
            _down_shrink_part_chunks(h0, 2 * pid_n, offs_p0, pair, slot, start, s0, e, row_rank_d, ad_ptr, hd_ptr, I,
                                     num_slots, num_experts, stride_ade, stride_adr, BLOCK_R, PART_N, SLOT_STAGES)
            _down_shrink_part_chunks(h1, 2 * pid_n + 1, offs_p0 + PART_N, pair, slot, start, s0, e, row_rank_d,
                                     ad_ptr, hd_ptr, I, num_slots, num_experts, stride_ade, stride_adr, BLOCK_R,
                                     PART_N, SLOT_STAGES)


@triton.jit
def _down_shrink_part_chunks(h, part, offs_n, pair, slot, start, s0, e, row_rank_d, ad_ptr, hd_ptr, I, num_slots,
                             num_experts, stride_ade, stride_adr, BLOCK_R: tl.constexpr, PART_N: tl.constexpr,
                             SLOT_STAGES: tl.constexpr):
    """_down_shrink_part over the block's runs in steps of LORA_RANK_CHUNK ranks (as _gate_up_lora_chunks): each step
    stores its run's rows' columns of its chunk, below each row's rank (a column's sum runs over h's columns, so
    the chunks of the ranks do not change it)."""
    offs_r = tl.arange(0, RC)
    num_parts = tl.cdiv(I, PART_N)
    hd_rows = hd_ptr + (pair.to(tl.int64) * num_parts + part)[:, None] * BLOCK_R + offs_r[None, :]
    in_part = tl.zeros_like(slot) + part < num_parts
    s, c = s0, s0 * 0
    for _ in tl.range(0, run_chunk_steps(row_rank_d, start, RC), num_stages=SLOT_STAGES):
        rows = slot == s
        rank_d = slot_rank(row_rank_d, rows)
        k0 = c * RC
        ad = lora_tile(ad_ptr + k0 * stride_adr, s, e, num_experts, stride_ade, stride_adr, offs_n, offs_n < I,
                       rank_d - k0, RC)
        hd = tl.dot(tl.where(rows[:, None], h, 0.0), tl.trans(ad))
        tl.store(hd_rows + k0, hd, mask=(rows & in_part)[:, None] & (k0 + offs_r[None, :] < row_rank_d[:, None]))
        s, c = next_chunk_step(s, c, rank_d, slot, start, num_slots, RC)


@triton.jit
def _down_shrink_part(h, part, offs_n, pair, slot, start, s0, num_runs, e, row_rank_d, ad, ad_ptr, hd_ptr, I,
                      num_slots, num_experts, stride_ade, stride_adr, ROWS: tl.constexpr, R: tl.constexpr,
                      BLOCK_R: tl.constexpr, PART_N: tl.constexpr, SLOT_STAGES: tl.constexpr):
    """hd[p, part, :rank] = h[p, offs_n] @ A_d[:, offs_n]^T over the PART_N columns of this part, for each row's
    slot and its rank (row_rank_d), over the block's runs (start, s0, num_runs: tiles.slot_runs; the first run's A_d
    tile `ad` comes loaded): the down kernel adds the parts up in order, so a part's columns never follow the tile.
    Parts are BLOCK_R columns apart."""
    offs_r = tl.arange(0, R)
    hd = tl.zeros((ROWS, R), dtype=tl.float32)
    if num_runs > 0:
        hd += tl.dot(tl.where((slot == s0)[:, None], h, 0.0), tl.trans(ad))
    if num_runs > 1:
        s = s0
        for _ in tl.range(1, num_runs, num_stages=SLOT_STAGES):  # as in _gate_up_lora
            s = next_run_slot(slot, start, s, num_slots)
            rows = slot == s
            ad = lora_tile(ad_ptr, s, e, num_experts, stride_ade, stride_adr, offs_n, offs_n < I,
                           slot_rank(row_rank_d, rows), R)
            hd += tl.dot(tl.where(rows[:, None], h, 0.0), tl.trans(ad))
    num_parts = tl.cdiv(I, PART_N)
    hd_ptrs = hd_ptr + (pair.to(tl.int64) * num_parts + part)[:, None] * BLOCK_R + offs_r[None, :]
    in_part = tl.zeros_like(slot) + part < num_parts
    tl.store(hd_ptrs, hd, mask=in_part[:, None] & (offs_r[None, :] < row_rank_d[:, None]))


@triton.jit(do_not_specialize=["num_pairs"])  # row counts: kernels/__init__.py
def down_kernel(
    h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, token_slots_ptr,
    ranks_ptr, hd_ptr, b_ptr, topk_ids_ptr, counter_ptr, y_ptr,
    num_pairs, top_k, H, I, num_slots, num_experts, num_hd_parts,
    stride_ht, stride_we, stride_wn, stride_ot, stride_be, stride_br, stride_yt,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    HALF_TILES: tl.constexpr, TOP_K_P: tl.constexpr, RANK_TILES: tl.constexpr, CHUNKS: tl.constexpr,
    SLOT_STAGES: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):
    """out[p] = w[p] * (h[p] Wd^T + LoRA_d) for the pairs p of one block (TMA: w_ptr is the copy engine's descriptor
    of Wd [E, H, I], tiles [1, BLOCK_N, BLOCK_K]; the down shrink is the sum
    of the gate_up kernel's per-tile parts, or down_shrink_kernel's sum of them), then y for the tokens whose
    last pair this was. CHUNKS and the next launch's start: as gate_up_kernel's."""
    wait_for_previous_kernel(PDL, RANK_TILES == 1 or CHUNKS)
    in_use, e, pid_m, pid_n = block_info(tl.program_id(0), tl.num_programs(0), block_expert_ptr, num_rows_ptr,
                                          num_experts, H, BLOCK_M, BLOCK_N, GROUP_M, PAIR_BLOCKS)
    if not in_use:
        return
    half = False
    if HALF_TILES:
        half = at_most_half_full(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    if half:
        _down_block(h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, hd_ptr,
                    b_ptr, topk_ids_ptr, counter_ptr, y_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots,
                    num_experts, num_hd_parts, stride_ht, stride_we, stride_wn, stride_ot, stride_be, stride_br,
                    stride_yt,
                    HAS_LORA, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, BLOCK_R, PARTS, PAIR_BLOCKS, TOP_K_P, RANK_TILES,
                    CHUNKS, SLOT_STAGES, TMA)
    else:
        _down_block(h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, hd_ptr,
                    b_ptr, topk_ids_ptr, counter_ptr, y_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots,
                    num_experts, num_hd_parts, stride_ht, stride_we, stride_wn, stride_ot, stride_be, stride_br,
                    stride_yt,
                    HAS_LORA, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, PARTS, PAIR_BLOCKS, TOP_K_P, RANK_TILES,
                    CHUNKS, SLOT_STAGES, TMA)
    if RANK_TILES > 1 and not CHUNKS:
        launch_next_kernel(PDL)


@triton.jit
def _down_block(
    h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, token_slots_ptr, ranks_ptr, hd_ptr, b_ptr, topk_ids_ptr,
    counter_ptr, y_ptr, e, pid_m, pid_n, num_pairs, top_k, H, I, num_slots, num_experts, num_hd_parts, stride_ht,
    stride_we, stride_wn, stride_ot, stride_be, stride_br, stride_yt,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PAIR_BLOCKS: tl.constexpr, TOP_K_P: tl.constexpr,
    RANK_TILES: tl.constexpr, CHUNKS: tl.constexpr, SLOT_STAGES: tl.constexpr, TMA: tl.constexpr,
):
    """The work of one (block, n-tile) program of down_kernel on a tile of ROWS rows."""
    pair, row_ok = block_rows(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M, ROWS, PAIR_BLOCKS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + offs_k[None, :]
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)  # loads in flight during the GEMM
    if PAIR_BLOCKS:  # the top-k sum's expert ids (sum_topk_if_last)
        ids = token_experts(topk_ids_ptr, pair // top_k, row_ok, top_k, TOP_K_P)
    if HAS_LORA:
        token_slot = tl.load(token_slots_ptr + pair // top_k, mask=row_ok, other=-1)
        prev_slot = previous_row_slots(sorted_ids_ptr, token_slots_ptr, pid_m, num_pairs, top_k, num_slots, BLOCK_M,
                                       ROWS, PAIR_BLOCKS)
    if TMA:
        acc, _ = gemm_loop_tma(h_ptrs, row_ok, I, w_ptr, e, pid_n * BLOCK_N, 0, False, ROWS, BLOCK_N, BLOCK_K)
    else:
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc, _ = gemm_loop(h_ptrs, row_ok, I, w_ptrs, w_ptrs, n_mask, False, ROWS, BLOCK_N, BLOCK_K)
    if HAS_LORA:
        slot = adapter_slots(token_slot, num_slots)
        rank_d = row_ranks(ranks_ptr, slot, e, num_slots, num_experts, 2)
        start, s0, num_runs = slot_runs(slot, prev_slot, rank_d, num_slots)
        if CHUNKS:
            acc = _down_lora_chunks(acc, pair, slot, start, s0, e, offs_n, n_mask, rank_d, hd_ptr, b_ptr, num_slots,
                                    num_experts, stride_be, stride_br, BLOCK_R, SLOT_STAGES)
        else:
            for c in tl.static_range(RANK_TILES):
                if takes_rank_tile(tl.max(rank_d, axis=0), c, RANK_TILES, BLOCK_R):
                    acc = _down_lora(acc, pair, slot, start, s0, num_runs, e, offs_n, n_mask, rank_d, hd_ptr, b_ptr,
                                     num_slots, num_experts, num_hd_parts, stride_be, stride_br, c, RANK_TILES, BLOCK_R,
                                     PARTS, SLOT_STAGES)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_mask[None, :])
    if PAIR_BLOCKS:
        sum_topk_if_last(out_ptr, y_ptr, counter_ptr, ids, pair, row_ok, pid_n, tl.cdiv(H, BLOCK_N), offs_n, n_mask,
                         top_k, num_experts, stride_ot, stride_yt, TOP_K_P)


@triton.jit
def _down_lora(acc, pair, slot, start, s0, num_runs, e, offs_n, n_mask, row_rank_d, hd_ptr, b_ptr, num_slots,
               num_experts, num_hd_parts, stride_be, stride_br, C: tl.constexpr, RANK_TILES: tl.constexpr,
               BLOCK_R: tl.constexpr, PARTS: tl.constexpr, SLOT_STAGES: tl.constexpr):
    """acc + the down delta (the sum of the down-shrink parts) @ B_d^T of each row's slot (row_rank_d: each row's
    rank), on rank tile C (tiles.takes_rank_tile), over the block's runs with down LoRA (start, s0, num_runs:
    tiles.slot_runs); the parts are BLOCK_R columns apart, PARTS a round at rank tile 16 (config.down_sum_parts),
    as many elements a round on larger tiles."""
    R: tl.constexpr = BLOCK_R if C == RANK_TILES - 1 else 16 << C
    P: tl.constexpr = PARTS * 16 // R if PARTS * 16 // R > SP else SP
    first = slot == s0
    rank_d = slot_rank(row_rank_d, first)
    bd = lora_tile(b_ptr, s0, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_d, R)  # overlaps hd's loads
    hd = sum_partials(hd_ptr, pair, slot >= 0, R, num_hd_parts * BLOCK_R, num_hd_parts, R, BLOCK_R, P, "")
    if num_runs > 0:
        acc = lora_expand(acc, hd, first, rank_d, bd)
    if num_runs > 1:
        s = s0
        for _ in tl.range(1, num_runs, num_stages=SLOT_STAGES):  # as in _gate_up_lora
            s = next_run_slot(slot, start, s, num_slots)
            rows = slot == s
            rank_d = slot_rank(row_rank_d, rows)
            bd = lora_tile(b_ptr, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_d, R)
            acc = lora_expand(acc, hd, rows, rank_d, bd)
    return acc


@triton.jit
def _down_lora_chunks(acc, pair, slot, start, s0, e, offs_n, n_mask, row_rank_d, hd_ptr, b_ptr, num_slots,
                      num_experts, stride_be, stride_br, BLOCK_R: tl.constexpr, SLOT_STAGES: tl.constexpr):
    """_down_lora for an aligned block whose down shrink is one part: over its runs with down LoRA in steps of
    LORA_RANK_CHUNK ranks, as many as each run's rank takes (as _gate_up_lora_chunks)."""
    s, c = s0, s0 * 0
    for _ in tl.range(0, run_chunk_steps(row_rank_d, start, RC), num_stages=SLOT_STAGES):
        rows = slot == s
        rank_d = slot_rank(row_rank_d, rows)
        k0 = c * RC
        bd = lora_tile(b_ptr + k0 * stride_br, s, e, num_experts, stride_be, stride_br, offs_n, n_mask, rank_d - k0,
                       RC)
        acc = lora_expand(acc, one_part(hd_ptr + k0, pair, rows, BLOCK_R, RC), rows, rank_d - k0, bd)
        s, c = next_chunk_step(s, c, rank_d, slot, start, num_slots, RC)
    return acc
