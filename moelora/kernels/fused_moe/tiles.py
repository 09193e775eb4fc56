"""Triton helpers shared by the shrink and the grouped GEMM kernels: which block and n-tile a program
owns, its rows and their adapter slots, and the LoRA tiles and partial sums its epilogues read."""
from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.gemm_tiles import grouped_tile, sum_loads_in_order


@triton.jit
def block_info(pid, num_programs, block_expert_ptr, num_rows_ptr, num_experts, N, BLOCK_M: tl.constexpr,
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
def block_rows(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                PAIR_BLOCKS: tl.constexpr):
    """The pairs in the first ROWS rows of block pid_m (num_pairs: padding) and which rows hold one.
    With PAIR_BLOCKS block p is pair p, in row 0."""
    if PAIR_BLOCKS:
        pair = tl.where(tl.arange(0, ROWS) == 0, pid_m, num_pairs)
    else:
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, ROWS))
    return pair, pair < num_pairs


@triton.jit
def at_most_half_full(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Whether block pid_m holds at most BLOCK_M / 2 pairs: an expert's pairs fill its blocks from the
    start and padding ends them, so row BLOCK_M / 2 tells."""
    return tl.load(sorted_ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_pairs


@triton.jit
def adapter_slots(token_slot, num_slots):
    """Adapter slot of each row from the rows' token slots (-1: none, also for a token slot out of range)."""
    return tl.where((token_slot >= 0) & (token_slot < num_slots), token_slot, -1)


@triton.jit
def row_slots(token_slot, num_slots):
    """Adapter slot of each row (adapter_slots), and the range [lo, hi] of the slots in the block (lo > hi: none).
    Rows are slot-ordered, so a loop over that range meets each slot's run once. The GEMM kernels load the token
    slots before their main loop, so the load is long done here."""
    slot = adapter_slots(token_slot, num_slots)
    lo = tl.min(tl.where(slot >= 0, slot, num_slots), axis=0)
    return slot, lo, tl.max(slot, axis=0)


@triton.jit
def previous_row_slots(sorted_ids_ptr, token_slots_ptr, pid_m, num_pairs, top_k, num_slots, BLOCK_M: tl.constexpr,
                       ROWS: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """The slot of the row before each of block pid_m's first ROWS rows (adapter_slots; -2 before row 0, so that a
    block's first row always starts a run: slot_runs). The GEMM kernels load these with the rows' own token slots,
    before their main loop."""
    offs = tl.arange(0, ROWS)
    if PAIR_BLOCKS:
        return tl.full((ROWS,), -2, tl.int32)
    prev_pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + offs - 1, mask=offs > 0, other=num_pairs)
    prev = tl.load(token_slots_ptr + prev_pair // top_k, mask=prev_pair < num_pairs, other=-1)
    return tl.where(offs == 0, -2, adapter_slots(prev, num_slots))


@triton.jit
def slot_runs(slot, prev_slot, row_rank, num_slots):
    """The runs of rows whose slot has LoRA on this expert (row_rank > 0): whether each row starts one, the first
    run's slot (num_slots: no run) and how many runs there are. Rows are slot-ordered, so each such slot is one
    run, and the LoRA loops visit these runs only (next_run_slot): a slot with no rows in the block, or no LoRA on
    its expert, costs nothing, and every iteration has work, so its loads need no branch (a loop whose loads sit in
    a branch is not pipelined)."""
    start = (row_rank > 0) & (slot != prev_slot)
    return start, tl.min(tl.where(start, slot, num_slots), axis=0), tl.sum(start.to(tl.int32), axis=0)


@triton.jit
def next_run_slot(slot, start, s, num_slots):
    """The slot of the run after slot s's (slot_runs' `start`; num_slots past the last run)."""
    return tl.min(tl.where(start & (slot > s), slot, num_slots), axis=0)


@triton.jit
def run_chunk_steps(row_rank, start, RC: tl.constexpr):
    """How many steps a LoRA loop over a block's runs in rank chunks of RC takes (slot_runs' `start`; row_rank: each
    row's rank): cdiv(rank, RC) steps a run, at least one, so a block's LoRA work follows the ranks of its runs, not
    the largest one in the block or the slot buffers."""
    return tl.sum(tl.where(start, tl.maximum(tl.cdiv(row_rank, RC), 1), 0), axis=0)


@triton.jit
def next_chunk_step(s, c, rank, slot, start, num_slots, RC: tl.constexpr):
    """The (run slot, rank chunk) after chunk c of slot s's run, whose rank is `rank` (run_chunk_steps)."""
    last = (c + 1) * RC >= rank
    return tl.where(last, next_run_slot(slot, start, s, num_slots), s), tl.where(last, 0, c + 1)


@triton.jit
def one_part(part_ptr, pair, rows, row_stride, R: tl.constexpr):
    """part[pair, 0, :R] for the rows in `rows` (0 elsewhere): partials of one part (reduce_partials' sums), in a
    load, where sum_partials is a loop (a loop inside the LoRA steps' loop would keep that from pipelining)."""
    offs_r = tl.arange(0, R)
    return tl.load(part_ptr + (pair.to(tl.int64) * row_stride)[:, None] + offs_r[None, :], mask=rows[:, None],
                   other=0.0)


@triton.jit
def lora_rank(ranks_ptr, proj, s, e, num_slots, num_experts):
    """Real rank of projection `proj` (0 gate, 1 up, 2 down) for slot s and expert e, both in range (0: not
    covered)."""
    return tl.load(ranks_ptr + (proj * num_slots + s) * num_experts + e)


@triton.jit
def row_ranks(ranks_ptr, slot, e, num_slots, num_experts, PROJ: tl.constexpr):
    """Real rank of projection PROJ of expert e for each row's slot (0: no slot, or not covered). One gather,
    in flight with the others: the LoRA loops over a block's slots then read each slot's rank from these
    (slot_rank) instead of a round trip to memory per slot, and the largest picks the block's rank tile
    (takes_rank_tile)."""
    return tl.load(ranks_ptr + (PROJ * num_slots + slot) * num_experts + e, mask=slot >= 0, other=0)


@triton.jit
def slot_rank(row_rank, rows):
    """The rank of the slot whose rows are `rows` (row_ranks' values there; 0 when there are none)."""
    return tl.max(tl.where(rows, row_rank, 0), axis=0)


@triton.jit
def takes_rank_tile(r, C: tl.constexpr, RANK_TILES: tl.constexpr, BLOCK_R: tl.constexpr):
    """Whether a block whose largest rank is r runs its LoRA on rank tile C of RANK_TILES: the smallest that
    holds r; r = 0 runs none. Tile C is 16 << C columns (16: LORA_RANK_CHUNK), the last one BLOCK_R (the slot
    buffers' tile, which also sets the partials' layout). A row's sums do not depend on the tile (the columns
    past its rank add exact zeros after its own), so each block picks its own at run time from the rank
    table: no host sync, and CUDA graphs bake in nothing."""
    R: tl.constexpr = BLOCK_R if C == RANK_TILES - 1 else 16 << C
    LOWER: tl.constexpr = 0 if C == 0 else 16 << (C - 1)
    return (r > LOWER) & (r <= R)


@triton.jit
def lora_tile(w_ptr, s, e, num_experts, stride_e, stride_r, offs, offs_ok, rank, BLOCK_R: tl.constexpr):
    """Rows :rank of the LoRA weight of (slot s, expert e) at columns offs, as a [BLOCK_R, len(offs)] tile;
    rows past the rank are 0 and never read (buffers are [S, E, R, ...])."""
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = w_ptr + (s * num_experts + e).to(tl.int64) * stride_e + offs_r[:, None] * stride_r + offs[None, :]
    return tl.load(ptrs, mask=(offs_r[:, None] < rank) & offs_ok[None, :], other=0.0)


@triton.jit
def lora_expand(acc, xa, rows, rank, bt):
    """acc += xa @ bt for the `rows` of one slot and a B^T tile bt of its rank (xa rounded to the weights' dtype,
    as PEFT does). Other rows get exactly +0; xa past the rank (never written) is not read."""
    keep = rows[:, None] & (tl.arange(0, xa.shape[1]) < rank)[None, :]
    return acc + tl.dot(tl.where(keep, xa, 0.0).to(bt.dtype), bt)


@triton.jit
def sum_partials(part_ptr, pair, rows, cols, row_stride, num_parts, R: tl.constexpr, STRIDE_R: tl.constexpr,
                  PARTS: tl.constexpr, CACHE: tl.constexpr):
    """sum over i < num_parts of part[pair, i, :R] (parts STRIDE_R apart) for the rows in `rows`, in the columns
    below `cols` (R, or each row's rank as a [rows, 1] tensor: the others are neither read nor 0), added one part
    after the other, PARTS loads a round (gemm_tiles.sum_loads_in_order)."""
    offs_r = tl.arange(0, R)
    base = part_ptr + (pair.to(tl.int64) * row_stride)[:, None] + offs_r[None, :]
    return sum_loads_in_order(base, STRIDE_R, rows[:, None] & (offs_r[None, :] < cols), num_parts, PARTS, CACHE)
