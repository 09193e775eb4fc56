"""moe_align: group the T*k (token, expert) pairs into BLOCK_M-row blocks of one expert.

Blocks are padded per expert, so an expert's weights are read once per block whatever mix of
adapters its tokens use. Inside an expert the pairs are ordered by adapter slot (base tokens
first), so a block's rows hold few distinct slots, each a contiguous run: the LoRA epilogues loop
over the slots present. Expert ids outside [0, E) (-1 marks an expert owned by another rank) are
dropped, never indexed; slots outside [0, S) count as "no adapter". Where asked for, the alignment also
lists each (expert, slot) key's run of rows in pieces of a bounded length (AlignedBlocks.segments), for the LoRA
shrink's programs.

Output sizes depend only on (T*k, E, S, BLOCK_M, segment_rows), never on the routing, so the kernel needs no
host synchronisation and can be captured in a CUDA graph; the GEMMs skip blocks past `num_rows`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel


class AlignedBlocks(NamedTuple):
    sorted_ids: torch.Tensor  # [max_rows] int32: pair index t*k+j, or T*k for a padding row
    block_expert: torch.Tensor  # [max_rows // block_m] int32: expert of each block; -1 past num_rows
    num_rows: torch.Tensor  # [1] int32: rows in use, a multiple of block_m
    block_m: int
    # where asked for (moe_align's segment_rows): the run of rows of each (expert, slot >= 0) key in pieces of at
    # most segment_rows rows, in key order: [3, max_segments(...)] int32 rows (first row, rows,
    # expert * num_slots + slot), the first num_segments[0] in use
    segments: torch.Tensor | None = None
    num_segments: torch.Tensor | None = None


def max_segments(num_pairs: int, num_experts: int, num_slots: int, segment_rows: int) -> int:
    """Upper bound on the segments: each holds a pair at least, and a key's pieces but its last are full."""
    return max(1, min(num_pairs, triton.cdiv(num_pairs, segment_rows) + num_experts * num_slots))


def max_aligned_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on padded rows: each expert with pairs wastes at most block_m - 1."""
    nonempty = min(num_experts, num_pairs)
    return triton.cdiv(num_pairs + nonempty * (block_m - 1), block_m) * block_m


def _pair_slots(topk_ids: torch.Tensor, token_slots: torch.Tensor | None, num_slots: int) -> torch.Tensor:
    top_k = topk_ids.shape[1]
    if token_slots is None:
        return torch.full((topk_ids.numel(),), -1, dtype=torch.int64, device=topk_ids.device)
    slots = token_slots.long().repeat_interleave(top_k)
    return torch.where((slots >= 0) & (slots < num_slots), slots, -1)


def moe_align_reference(
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor | None,
    num_experts: int,
    num_slots: int,
    block_m: int,
    segment_rows: int = 0,
) -> AlignedBlocks:
    """Torch version of `moe_align`; orders pairs stably by (expert, slot, pair index)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    max_rows = max_aligned_rows(num_pairs, num_experts, block_m)
    experts = topk_ids.flatten().long()
    valid = (experts >= 0) & (experts < num_experts)
    key = torch.where(valid, experts * (num_slots + 1) + _pair_slots(topk_ids, token_slots, num_slots) + 1,
                      num_experts * (num_slots + 1))
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, torch.where(valid, experts, num_experts), torch.ones_like(experts))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded
    unpadded_start = torch.cumsum(counts, 0) - counts

    sorted_expert = experts[order]
    is_valid = valid[order]
    e = sorted_expert.clamp(0, num_experts - 1)
    pos = start[e] + torch.arange(num_pairs, device=device) - unpadded_start[e]
    sorted_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[pos[is_valid]] = order[is_valid].to(torch.int32)

    num_rows = padded.sum()
    block_rows = torch.arange(max_rows // block_m, device=device) * block_m
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), block_rows, right=True)
    block_expert = torch.where(block_rows < num_rows, block_expert, -1).to(torch.int32)
    blocks = AlignedBlocks(sorted_ids, block_expert, num_rows.reshape(1).to(torch.int32), block_m)
    if not segment_rows or token_slots is None:
        return blocks
    pair_slots = _pair_slots(topk_ids, token_slots, num_slots)
    key_counts = torch.zeros(num_experts * num_slots + 1, dtype=torch.int64, device=device)
    lora_pair = valid & (pair_slots >= 0)
    key_counts.scatter_add_(0, torch.where(lora_pair, experts * num_slots + pair_slots, num_experts * num_slots),
                            torch.ones_like(experts))
    keys = key_counts[:-1].nonzero().flatten()
    key_e = keys // num_slots
    # a key's rows follow its expert's base rows and the rows of the expert's smaller slots
    per_key = key_counts[:-1].view(num_experts, num_slots)
    before = torch.cumsum(per_key, 1) - per_key
    base = counts - per_key.sum(1)
    first = start[key_e] + base[key_e] + before.flatten()[keys]
    pieces = [(f + j, min(segment_rows, c - j), k) for f, c, k in zip(first.tolist(), key_counts[keys].tolist(),
                                                                       keys.tolist())
              for j in range(0, c, segment_rows)]
    segs = torch.zeros(3, max_segments(num_pairs, num_experts, num_slots, segment_rows), dtype=torch.int32,
                       device=device)
    if pieces:
        segs[:, :len(pieces)] = torch.tensor(pieces, dtype=torch.int32, device=device).T
    return blocks._replace(segments=segs, num_segments=torch.tensor([len(pieces)], dtype=torch.int32, device=device))


@triton.jit
def _pair_keys(topk_ids_ptr, token_slots_ptr, start, num_pairs, top_k, num_experts, num_slots,
               HAS_SLOTS: tl.constexpr, S1_P: tl.constexpr, CHUNK: tl.constexpr):
    """For pairs [start, start+CHUNK): their index, (expert, slot+1) key and whether they count."""
    pair = start + tl.arange(0, CHUNK)
    in_range = pair < num_pairs
    expert = tl.load(topk_ids_ptr + pair, mask=in_range, other=-1)
    valid = in_range & (expert >= 0) & (expert < num_experts)
    slot = tl.full((CHUNK,), -1, tl.int32)
    if HAS_SLOTS:
        slot = tl.load(token_slots_ptr + pair // top_k, mask=in_range, other=-1)
        slot = tl.where((slot >= 0) & (slot < num_slots), slot, -1)
    return pair, expert * S1_P + slot + 1, valid


@triton.jit
def _count_pairs(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, cursor_ptr, first, step, num_pairs, top_k,
                 num_experts, num_slots, max_rows, HAS_SLOTS: tl.constexpr, S1_P: tl.constexpr, CHUNK: tl.constexpr):
    """Count the pairs of each (expert, slot) key into cursor, and mark every row as padding, over
    the chunks first, first + step, ... (one program: all of them)."""
    for start in range(first, num_pairs, step):
        pair, key, valid = _pair_keys(topk_ids_ptr, token_slots_ptr, start, num_pairs, top_k, num_experts, num_slots,
                                      HAS_SLOTS, S1_P, CHUNK)
        tl.atomic_add(cursor_ptr + key, 1, mask=valid)
    offs = tl.arange(0, CHUNK)
    for row0 in range(first, max_rows, step):
        tl.store(sorted_ids_ptr + row0 + offs, num_pairs, mask=row0 + offs < max_rows)


@triton.jit
def _lay_out_blocks(block_expert_ptr, num_rows_ptr, cursor_ptr, segments_ptr, num_segments_ptr, max_rows, num_slots,
                    max_segs, BLOCK_M: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr, CHUNK: tl.constexpr,
                    SEGMENT_ROWS: tl.constexpr, copies, MAX_COPIES: tl.constexpr):
    """From the counts (in copies <= MAX_COPIES copies of the E_P * S1_P keys' counters, each counted by its own
    programs; copies a run-time value, so that the number of tokens picks no compiled variant): each
    expert's first row (padded to BLOCK_M), each key's first row (slots unpadded inside an expert), and in each
    copy the first row of that copy's share of the key's run, into cursor; the blocks' experts and the rows in
    use; with SEGMENT_ROWS > 0 the (first row, rows, expert * num_slots + slot) of each piece of at most
    SEGMENT_ROWS rows of each key with a slot and pairs (AlignedBlocks.segments)."""
    offs_e = tl.arange(0, E_P)
    offs_s1 = tl.arange(0, S1_P)
    keys_2d = offs_e[:, None] * S1_P + offs_s1[None, :]
    counts = tl.load(cursor_ptr + keys_2d)
    for c in tl.static_range(1, MAX_COPIES):  # unrolled: the copies' loads in flight together
        counts += tl.load(cursor_ptr + c * E_P * S1_P + keys_2d, mask=(keys_2d * 0 + c) < copies, other=0)
    per_expert = tl.sum(counts, axis=1)
    padded = (per_expert + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    expert_start = tl.cumsum(padded, axis=0) - padded
    key_start = expert_start[:, None] + tl.cumsum(counts, axis=1) - counts
    if MAX_COPIES == 1:  # (the one-program alignment of decode steps: no reload, no barrier on its chain)
        tl.store(cursor_ptr + keys_2d, key_start)
    else:
        tl.debug_barrier()  # every thread's loads of the counts before any store over them
        copy_start = key_start
        for c in tl.static_range(MAX_COPIES):  # a copy's counts are loaded before its starts overwrite them
            in_use = (keys_2d * 0 + c) < copies
            copy_counts = tl.load(cursor_ptr + c * E_P * S1_P + keys_2d, mask=in_use, other=0)
            tl.store(cursor_ptr + c * E_P * S1_P + keys_2d, copy_start, mask=in_use)
            copy_start += copy_counts
    tl.store(num_rows_ptr, tl.sum(padded, axis=0))
    if SEGMENT_ROWS > 0:  # (slot -1 is column 0: the base rows)
        count = tl.reshape(tl.where((offs_s1 > 0)[None, :], counts, 0), (E_P * S1_P,))
        pieces = (count + SEGMENT_ROWS - 1) // SEGMENT_ROWS
        first_piece = tl.cumsum(pieces, axis=0) - pieces
        first_row = tl.reshape(key_start, (E_P * S1_P,))
        key = tl.reshape(offs_e[:, None] * num_slots + offs_s1[None, :] - 1, (E_P * S1_P,))
        for j in range(0, tl.max(pieces, axis=0)):
            piece = pieces > j
            tl.store(segments_ptr + first_piece + j, first_row + j * SEGMENT_ROWS, mask=piece)
            tl.store(segments_ptr + max_segs + first_piece + j, tl.minimum(count - j * SEGMENT_ROWS, SEGMENT_ROWS),
                     mask=piece)
            tl.store(segments_ptr + 2 * max_segs + first_piece + j, key, mask=piece)
        tl.store(num_segments_ptr, tl.sum(pieces, axis=0))
    offs = tl.arange(0, CHUNK)
    for block0 in range(0, max_rows // BLOCK_M, CHUNK):
        tl.store(block_expert_ptr + block0 + offs, -1, mask=block0 + offs < max_rows // BLOCK_M)
    tl.debug_barrier()
    first_block = expert_start // BLOCK_M
    num_blocks = padded // BLOCK_M
    for j in range(0, tl.max(num_blocks, axis=0)):
        tl.store(block_expert_ptr + first_block + j, offs_e, mask=j < num_blocks)


@triton.jit
def _place_pairs(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, cursor_ptr, first, step, num_pairs, top_k,
                 num_experts, num_slots, HAS_SLOTS: tl.constexpr, S1_P: tl.constexpr, CHUNK: tl.constexpr):
    """Write each pair's index at the next free row of its key."""
    for start in range(first, num_pairs, step):
        pair, key, valid = _pair_keys(topk_ids_ptr, token_slots_ptr, start, num_pairs, top_k, num_experts, num_slots,
                                      HAS_SLOTS, S1_P, CHUNK)
        row = tl.atomic_add(cursor_ptr + key, 1, mask=valid)
        tl.store(sorted_ids_ptr + row, pair, mask=valid)


@triton.jit
def moe_align_program(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, cursor_ptr,
                      segments_ptr, num_segments_ptr, num_pairs, top_k, num_experts, num_slots, max_rows, max_segs,
                      HAS_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr,
                      CHUNK: tl.constexpr, SEGMENT_ROWS: tl.constexpr):
    """Small batches: the three phases in one program, separated by barriers. `cursor` holds, per
    (expert, slot) key, first the pair count, then the next free row. Also called by other kernels
    that run the alignment as one program of a larger launch."""
    keys = tl.arange(0, E_P)[:, None] * S1_P + tl.arange(0, S1_P)[None, :]
    tl.store(cursor_ptr + keys, tl.zeros((E_P, S1_P), tl.int32))
    tl.debug_barrier()
    _count_pairs(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, cursor_ptr, 0, CHUNK, num_pairs, top_k, num_experts,
                 num_slots, max_rows, HAS_SLOTS, S1_P, CHUNK)
    tl.debug_barrier()
    _lay_out_blocks(block_expert_ptr, num_rows_ptr, cursor_ptr, segments_ptr, num_segments_ptr, max_rows, num_slots,
                    max_segs, BLOCK_M, E_P, S1_P, CHUNK, SEGMENT_ROWS, 1, 1)
    tl.debug_barrier()
    _place_pairs(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, cursor_ptr, 0, CHUNK, num_pairs, top_k, num_experts,
                 num_slots, HAS_SLOTS, S1_P, CHUNK)


@triton.jit(do_not_specialize=["num_pairs", "max_segs"])  # row counts: kernels/__init__.py
def _moe_align_kernel(
    topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, cursor_ptr, segments_ptr,
    num_segments_ptr, num_pairs, top_k, num_experts, num_slots, max_rows, max_segs,
    HAS_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr,
    CHUNK: tl.constexpr, SEGMENT_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    moe_align_program(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, cursor_ptr,
                      segments_ptr, num_segments_ptr, num_pairs, top_k, num_experts, num_slots, max_rows, max_segs,
                      HAS_SLOTS, BLOCK_M, E_P, S1_P, CHUNK, SEGMENT_ROWS)


@triton.jit(do_not_specialize=["num_pairs", "copies"])  # row counts and what follows them: kernels/__init__.py
def _count_kernel(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, top_k, num_experts,
                  num_slots, max_rows, copies, HAS_SLOTS: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr,
                  CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    cursor_ptr += tl.program_id(0) % copies * (E_P * S1_P)  # this program's copy of the counters
    _count_pairs(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, cursor_ptr, tl.program_id(0) * CHUNK,
                 tl.num_programs(0) * CHUNK, num_pairs, top_k, num_experts, num_slots, max_rows, HAS_SLOTS, S1_P, CHUNK)


@triton.jit(do_not_specialize=["max_segs", "copies"])  # a row count and what follows it: kernels/__init__.py
def _lay_out_kernel(block_expert_ptr, num_rows_ptr, cursor_ptr, segments_ptr, num_segments_ptr, max_rows, num_slots,
                    max_segs, copies, BLOCK_M: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr,
                    CHUNK: tl.constexpr, SEGMENT_ROWS: tl.constexpr, MAX_COPIES: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    _lay_out_blocks(block_expert_ptr, num_rows_ptr, cursor_ptr, segments_ptr, num_segments_ptr, max_rows, num_slots,
                    max_segs, BLOCK_M, E_P, S1_P, CHUNK, SEGMENT_ROWS, copies, MAX_COPIES)


@triton.jit(do_not_specialize=["num_pairs", "copies"])  # row counts and what follows them: kernels/__init__.py
def _place_kernel(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, top_k, num_experts, num_slots,
                  copies, HAS_SLOTS: tl.constexpr, E_P: tl.constexpr, S1_P: tl.constexpr, CHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    cursor_ptr += tl.program_id(0) % copies * (E_P * S1_P)  # the copy this program counted in (same grid, same chunks)
    _place_pairs(topk_ids_ptr, token_slots_ptr, sorted_ids_ptr, cursor_ptr, tl.program_id(0) * CHUNK,
                 tl.num_programs(0) * CHUNK, num_pairs, top_k, num_experts, num_slots, HAS_SLOTS, S1_P, CHUNK)


# above this, count / lay out / place run as three grid-wide kernels: one program's time grows with the pairs, the
# three launches' stays about 7 us (benchmarks/RESULTS.md, session 34)
SINGLE_PROGRAM_MAX_PAIRS = 256
CHUNK = 256  # pairs per vector in the align kernels
# the grid's programs count and place in up to this many copies of the keys' counters (program p in copy p % copies),
# so that the atomics on one key's counter queue a copies-th as long: with one adapter every pair of an expert has one
# key. The one lay-out program reads and writes every copy, so a copy is added only where it brings at least
# PAIRS_PER_COUNTER pairs a counter, and the copies stop at CURSOR_COPY_KEYS counters in all. The kernels take the
# copies at run time, their bound (which the keys alone set) as a constexpr: a number of tokens that the start's
# warm-up steps never ran picks no kernel variant of its own, so none compiles while serving.
CURSOR_COPIES = 8
CURSOR_COPY_KEYS = 16384
PAIRS_PER_COUNTER = 4


def max_cursor_copies(num_experts: int, num_slots: int) -> int:
    """The most copies of the (expert, slot) counters the grid-wide align kernels count in, for any pairs."""
    e_p, s1_p = key_tile(num_experts, num_slots)
    return max(1, min(CURSOR_COPIES, CURSOR_COPY_KEYS // (e_p * s1_p)))


def cursor_copies(num_pairs: int, num_experts: int, num_slots: int) -> int:
    """Copies of the (expert, slot) counters the grid-wide align kernels count in."""
    e_p, s1_p = key_tile(num_experts, num_slots)
    return max(1, min(max_cursor_copies(num_experts, num_slots), num_pairs // (PAIRS_PER_COUNTER * e_p * s1_p)))


def key_tile(num_experts: int, num_slots: int) -> tuple[int, int]:
    """(E_P, S1_P): the power-of-two tile of (expert, slot + 1) keys the kernels count in."""
    return triton.next_power_of_2(num_experts), triton.next_power_of_2(num_slots + 1)


def align_num_warps(num_experts: int, num_slots: int) -> int:
    e_p, s1_p = key_tile(num_experts, num_slots)
    return 8 if e_p * s1_p >= 4096 else 4


def alloc_aligned(num_pairs: int, num_experts: int, num_slots: int, block_m: int, device: torch.device,
                  segment_rows: int = 0, cursor_copies: int = 1) -> tuple[AlignedBlocks, torch.Tensor]:
    """Uninitialised outputs of moe_align at their fixed sizes, and its per-key cursor scratch (cursor_copies
    copies)."""
    max_rows = max_aligned_rows(num_pairs, num_experts, block_m)
    e_p, s1_p = key_tile(num_experts, num_slots)
    blocks = AlignedBlocks(torch.empty(max_rows, dtype=torch.int32, device=device),
                           torch.empty(max_rows // block_m, dtype=torch.int32, device=device),
                           torch.empty(1, dtype=torch.int32, device=device), block_m)
    if segment_rows:
        blocks = blocks._replace(
            segments=torch.empty(3, max_segments(num_pairs, num_experts, num_slots, segment_rows), dtype=torch.int32,
                                 device=device),
            num_segments=torch.empty(1, dtype=torch.int32, device=device))
    return blocks, torch.empty(cursor_copies * e_p * s1_p, dtype=torch.int32, device=device)


def moe_align(
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor | None,
    num_experts: int,
    num_slots: int,
    block_m: int,
    segment_rows: int = 0,
) -> AlignedBlocks:
    """Triton version. topk_ids [T, k] int32; token_slots [T] int32 (-1: no adapter) or None; segment_rows > 0
    (with token_slots): also AlignedBlocks.segments, in pieces of at most that many rows."""
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32, got {topk_ids.dtype}")
    if token_slots is not None and (token_slots.dtype != torch.int32 or token_slots.shape != topk_ids.shape[:1]):
        raise ValueError(
            f"token_slots must be int32 of shape ({topk_ids.shape[0]},), got {token_slots.dtype} {tuple(token_slots.shape)}"
        )
    num_pairs = topk_ids.numel()
    segment_rows = segment_rows if token_slots is not None else 0
    single = num_pairs <= SINGLE_PROGRAM_MAX_PAIRS
    copies = 1 if single else cursor_copies(num_pairs, num_experts, num_slots)
    blocks, cursor = alloc_aligned(num_pairs, num_experts, num_slots, block_m, topk_ids.device, segment_rows, copies)
    sorted_ids, block_expert, num_rows = blocks.sorted_ids, blocks.block_expert, blocks.num_rows
    segs = (blocks.segments, blocks.num_segments) if segment_rows else (cursor, cursor)  # (never written without)
    max_rows, (e_p, s1_p) = sorted_ids.numel(), key_tile(num_experts, num_slots)
    max_segs = segs[0].shape[-1] if segment_rows else 1
    slots = token_slots if token_slots is not None else topk_ids
    keys = dict(HAS_SLOTS=token_slots is not None, S1_P=s1_p, CHUNK=CHUNK)
    warps, pdl = align_num_warps(num_experts, num_slots), pdl_launch(topk_ids.device)
    if single:
        _moe_align_kernel[(1,)](topk_ids, slots, sorted_ids, block_expert, num_rows, cursor, *segs, num_pairs,
                                topk_ids.shape[1], num_experts, num_slots, max_rows, max_segs, BLOCK_M=block_m,
                                E_P=e_p, SEGMENT_ROWS=segment_rows, **keys, num_warps=warps, **pdl)
    else:
        cursor.zero_()
        grid = (triton.cdiv(max_rows, CHUNK),)
        _count_kernel[grid](topk_ids, slots, sorted_ids, cursor, num_pairs, topk_ids.shape[1], num_experts, num_slots,
                            max_rows, copies, E_P=e_p, **keys, **pdl)
        _lay_out_kernel[(1,)](block_expert, num_rows, cursor, *segs, max_rows, num_slots, max_segs, copies,
                              BLOCK_M=block_m, E_P=e_p, S1_P=s1_p, CHUNK=CHUNK, SEGMENT_ROWS=segment_rows,
                              MAX_COPIES=max_cursor_copies(num_experts, num_slots), num_warps=warps, **pdl)
        _place_kernel[grid](topk_ids, slots, sorted_ids, cursor, num_pairs, topk_ids.shape[1], num_experts, num_slots,
                            copies, E_P=e_p, **keys, **pdl)
    return blocks
