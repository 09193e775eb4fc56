"""Dense projection y = x @ W^T (+ bias) whose rows do not depend on the batch (Triton).

cuBLAS picks its algorithm by the number of rows M (GEMV at M = 1, split-K, other tiles), so a
row's bits change with what it is batched with: one bf16 ulp in a down_proj is enough to flip a
near-tied greedy token between a request run alone and the same request in a batch. This GEMM is
batch invariant by construction: the order of a row's fp32 sums is a function of (N, K, dtype) only.

- BLOCK_K is the dtype's (64 for bf16/fp16, 32 for fp32, `gemm_block_k`) in every config.
- K is cut into S splits of `split_k` columns (a multiple of BLOCK_K; the last may be shorter),
  `k_splits(N, K, dtype)`: S is the most that keeps cdiv(N, 16) * S <= SPLIT_PROGRAMS (512, about
  four decode programs per SM on 16-column tiles) and every split SPLIT_MIN_BLOCKS (4) BLOCK_K steps
  long or more; so S = 1 for N > 4096 (the tiles alone fill the SMs) and for short K. Qwen3-30B-A3B:
  router (N 128, K 2048) 8 splits, o_proj (2048, 4096) 4, qkv and lm_head 1.
- Each split sums its columns in BLOCK_K steps, `acc += tl.dot(x_tile, w_tile)`, into its own fp32
  accumulator from zero; the result is (((0 + part_0) + part_1) + ...) in split order, plus the bias,
  then the one rounding to the output dtype (as cuBLAS's addmm adds the bias).

Only the tiles (BLOCK_M, BLOCK_N, GROUP_M, warps, stages), where the splits run and how the K loop
loads its tiles (by pointers, or on Hopper by the copy engine, TMA: `LinearConfig.tma`) follow M, and
none of them changes that order. Up to 256 rows (`LinearConfig.parallel_splits`), where reading W bounds
the GEMM, the splits of a tile run in programs of their own, which write fp32 partials; the last of
them to finish (an arrival counter per tile) adds the partials up in split order. On prefill tiles
one program runs its tile's splits one after the other, at no extra traffic (S x M x N fp32 partials
would be). Both give the same bits.

With a `LinearLoRA` (kernels/lora_linear.py) each tile adds its rows' LoRA deltas to the fp32 sum
before the bias and the rounding (`add_linear_lora`), in a fixed order that leaves rows without an
adapter with the plain GEMM's bits. With its `shrink` the launch also computes the xa those deltas
read: its first programs are the shrink's (`shrink_linear_block`), which the hardware dispatches
first, and each tile waits for all of them only in its epilogue (`wait_arrivals`), after its own K
loop; at decode sizes a launch of its own would cost more than the shrink's work.

`linear_reference` (torch's nn.functional.linear, i.e. cuBLAS) is the CPU backend and what the
kernel is checked against.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from moelora.kernels.gemm_tiles import (SMEM_BYTES, arrive, gemm_block_k, gemm_loop, grouped_tile, loads_a_round,
                                       stages_that_fit, sum_loads_in_order, tma_descriptor, wait_arrivals,
                                       zeroed_counters)
from moelora.kernels.lora_tiles import add_linear_lora, linear_lora_rows, load_linear_lora_b, shrink_linear_block
from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel

MIN_PROGRAMS = 120  # about one program per SM of an H100 / H200 (132): below it, a smaller tile is tried
SPLIT_PROGRAMS = 512  # K splits aim at about four decode programs per SM: some load while others wait
ONE_SPLIT_STAGES = 8  # decode tiles (M <= 32) of a shape without K splits: more W tiles in flight per program
# BLOCK_K steps per split at least: each split on prefill tiles refills the pipeline
SPLIT_MIN_BLOCKS = 4
PARALLEL_SPLITS_MAX_M = 256  # up to here the GEMM is bound by reading W: splits run in parallel programs
SPLIT_COUNTERS = 4096  # arrival counters per device: tiles of a parallel-split launch (default tiles: <= 512)
# From rank tile 64 a dot of the LoRA epilogue stacking more rows of B than LORA_DOT_MAX_ROWS, or than
# LORA_DOT_ELEMENTS / BLOCK_N, spilled registers (compiled for sm_90: 320-864 bytes a thread with 8 slots of rank 64
# at 200 and 4096 rows, none in the chunks below these; benchmarks/RESULTS.md, session 49). Smaller rank tiles keep
# the one dot their timings chose.
LORA_DOT_RANK_TILE = 64
LORA_DOT_MAX_ROWS = 512
LORA_DOT_ELEMENTS = 16384


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    # the K splits of a tile (if (N, K) has more than one) in programs of their own, else one after the
    # other in one program: the same bits either way
    parallel_splits: bool = False
    # where the splits run one after the other, the K loop's x and W tiles loaded by the copy engine (TMA) on GPUs
    # that have one and for tensors it can read (gemm_tiles.tma_descriptor), else by pointers: the same bits. The
    # prefill tiles take it (1.1-1.3x faster GEMMs on an H100), and the medium ones (up to 1.2x); on decode tiles
    # and parallel splits it was slower (benchmarks/RESULTS.md, sessions 55 and 56)
    tma: bool = False


# candidate tiles by M, largest first; `default_config` takes the first that gives MIN_PROGRAMS programs
_DECODE = (LinearConfig(16, 64, 8, 4, 5), LinearConfig(16, 32, 8, 4, 5), LinearConfig(16, 16, 8, 4, 5))
_SMALL = (LinearConfig(32, 64, 8, 4, 4), LinearConfig(32, 32, 8, 4, 4), LinearConfig(32, 16, 8, 4, 4))
_MEDIUM = (LinearConfig(64, 128, 8, 4, 4, tma=True), LinearConfig(64, 64, 8, 4, 4, tma=True),
           LinearConfig(64, 32, 8, 4, 4, tma=True))
_LARGE = (LinearConfig(128, 256, 8, 8, 3, tma=True), LinearConfig(128, 128, 8, 8, 4, tma=True),
          LinearConfig(64, 128, 8, 4, 4, tma=True),
          LinearConfig(64, 64, 8, 4, 4, tma=True))  # the last: narrow N (the router's 128 columns at prefill)


class LoRAEpilogue(NamedTuple):
    """The shape of a GEMM's LoRA epilogue (`add_linear_lora`): its dots stack slots' B along K."""
    slots: int      # BLOCK_S: the slot buffers' count, to a power of two
    rank_tile: int  # BLOCK_R
    # the shrink's (BLOCK_M, BLOCK_K) where the launch runs it first (B may then be loaded before the epilogue waits
    # for xa); None: xa is ready
    shrink: tuple[int, int] | None


def default_config(M: int, N: int, splits: int = 1, lora: LoRAEpilogue | None = None) -> LinearConfig:
    """Tiles for M rows and N output columns of a shape with `splits` K splits (`k_splits`; BLOCK_K is
    the dtype's, not the config's); `lora`: the GEMM adds LoRA deltas in its epilogue.

    Up to 256 rows (decode: M <= 16, BLOCK_M 16) the GEMM is bound by reading W, so the tile is the
    widest that still gives about one program per SM (o_proj's N = 2048 at decode: 16 columns) and
    K splits, where N and K have them, run in parallel programs; from BLOCK_M 64 tl.dot is a Hopper
    wgmma. Prefill (M > 256) is bound by the tensor cores: 128 x 256 or 128 x 128 tiles with 8 warps
    and GROUP_M 8 for L2 reuse of W, as Triton's matmul tutorial has them on Hopper, while they still
    fill the SMs. Up to 32 rows a shape without K splits has fewer programs for the same bytes, so each
    keeps ONE_SPLIT_STAGES W tiles in flight (with splits, deeper pipelines measured slower). A prefill
    tile whose K splits run one after the other holds two accumulators (the running sum and the split's);
    on 128 x 256 its registers overflow (with TMA loads, or with a LoRA epilogue besides), so such a GEMM
    starts at 128 x 128.
    A tile on which not even one slot's epilogue fits in shared memory (`lora_epilogue_plan`) is passed over,
    for the next smaller one that does."""
    classes = (_DECODE, _SMALL, _MEDIUM, _LARGE)
    here = 0 if M <= 16 else 1 if M <= 32 else 2 if M <= 256 else 3
    narrow_n = max(16, triton.next_power_of_2(N))  # tl.dot needs 16; a tile wider than N only reads masks
    stages = {"num_stages": ONE_SPLIT_STAGES} if M <= 32 and splits == 1 else {}
    for candidates in classes[here::-1]:
        if splits > 1 and M > PARALLEL_SPLITS_MAX_M and candidates is classes[here]:
            candidates = candidates[1:]
        tiles = [replace(c, block_n=min(c.block_n, narrow_n), parallel_splits=M <= PARALLEL_SPLITS_MAX_M, **stages)
                 for c in candidates]
        tiles = [c for c in tiles if lora is None or lora_epilogue_plan(c, lora) is not None]
        if tiles:
            return next((c for c in tiles if triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n) >= MIN_PROGRAMS),
                        tiles[-1])
    raise ValueError(f"no GEMM tile holds a LoRA epilogue of rank tile {lora.rank_tile} in shared memory: a smaller "
                     "--max-lora-rank")


def lora_epilogue_plan(c: LinearConfig, lora: LoRAEpilogue) -> tuple[int, bool] | None:
    """How tile c runs the LoRA epilogue: (CHUNK_S, B_EARLY), its dots stacking CHUNK_S slots each (a power of two
    dividing BLOCK_S: the tile keeps its size with many slots of a large rank, where one dot of them all would not
    fit in shared memory, or its registers would spill), and whether B is loaded before the shrink's wait (one dot,
    a launch with the shrink). None: not even one slot's dot fits in shared memory."""
    if lora.shrink is not None and _lora_epilogue_fits(c, lora.slots * lora.rank_tile, True) and \
            _lora_dot_holds(c, lora, lora.slots):
        return lora.slots, True
    chunk = lora.slots
    while chunk >= 1 and not _lora_epilogue_fits(c, chunk * lora.rank_tile, False):
        chunk //= 2
    while chunk > 1 and not _lora_dot_holds(c, lora, chunk):
        chunk //= 2
    return (chunk, False) if chunk >= 1 else None


def _lora_dot_holds(c: LinearConfig, lora: LoRAEpilogue, chunk: int) -> bool:
    """Whether a dot of `chunk` slots holds its rows in registers (LORA_DOT_MAX_ROWS)."""
    rows = chunk * lora.rank_tile
    return lora.rank_tile < LORA_DOT_RANK_TILE or rows <= min(LORA_DOT_MAX_ROWS, LORA_DOT_ELEMENTS // c.block_n)


def _lora_epilogue_fits(c: LinearConfig, lora_rows: int, b_early: bool) -> bool:
    """Whether a dot of the LoRA epilogue stacking lora_rows rows of B fits in a Hopper program's shared memory, as
    Triton (3.6 and 3.9) lays it out for sm_90: xa [BLOCK_M, lora_rows] and B [lora_rows, BLOCK_N], 16-bit, in
    buffers of their own beside (not added to) the K loop's; B twice where it is loaded early (the loaded tile, then
    the dot's operand), but on 32-row tiles: so on wgmma tiles (64 rows and more) with both, and on 16-row tiles
    with Triton 3.6 (3.9 holds it once there: 1024 rows of B on the 16 x 64 decode tile took 294912 B with 3.6,
    163840 with 3.9). tests/kernels/test_compile_sm90.py compiles the tiles this lets through and the ones it passes
    over."""
    b_copies = 2 if b_early and c.block_m != 32 else 1
    return lora_rows * 2 * (c.block_m + b_copies * c.block_n) <= SMEM_BYTES


def lora_launch_config(c: LinearConfig, lora: LoRAEpilogue) -> tuple[LinearConfig, int, bool]:
    """Tile c as a launch with a LoRA epilogue runs it, and its epilogue's plan: (config, CHUNK_S, B_EARLY). Where
    the launch runs the shrink, the shrink's programs pipeline their x and A tiles over the launch's stages, in
    shared memory of their own: the stages are capped so those fit (rank tiles of 256 and more at decode's
    ONE_SPLIT_STAGES would not; fewer stages change no sum's order)."""
    if lora.shrink is not None:
        block_m, block_k = lora.shrink
        c = replace(c, num_stages=stages_that_fit(lora.rank_tile + block_m, block_k, c.num_stages))
    plan = lora_epilogue_plan(c, lora)
    if plan is None:
        raise ValueError(f"{c} holds no LoRA epilogue of rank tile {lora.rank_tile} in shared memory")
    return (c, *plan)


def k_splits(N: int, K: int, dtype: torch.dtype) -> tuple[int, int]:
    """(S, split_k): K in S splits of split_k columns (a multiple of BLOCK_K, the last split may be
    shorter), the most splits that keep cdiv(N, 16) * S <= SPLIT_PROGRAMS with SPLIT_MIN_BLOCKS BLOCK_K
    steps a split. A function of N, K and the dtype alone: the order of a row's sums must not follow M."""
    block_k = gemm_block_k(dtype)
    blocks = triton.cdiv(K, block_k)
    splits = max(1, min(SPLIT_PROGRAMS // triton.cdiv(N, 16), blocks // SPLIT_MIN_BLOCKS))
    split_k = max(1, triton.cdiv(blocks, splits)) * block_k
    return max(1, triton.cdiv(K, split_k)), split_k


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def _split_sum(x_ptrs, m_mask, w_ptrs, n_mask, K, SPLIT_K, split,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x @ W^T over columns [split * SPLIT_K, min(K, (split + 1) * SPLIT_K)), from its own zero accumulator."""
    k_lo = split * SPLIT_K
    acc, _ = gemm_loop(x_ptrs + k_lo, m_mask, tl.minimum(K - k_lo, SPLIT_K), w_ptrs + k_lo, w_ptrs + k_lo, n_mask,
                       False, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc


@triton.jit
def _split_sum_tma(x_desc, w_desc, m0, n0, K, SPLIT_K, split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_split_sum with the x and W tiles of rows m0.. and n0.. loaded by the copy engine (past M, N and K: zeros)."""
    k_lo = split * SPLIT_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, tl.minimum(K, k_lo + SPLIT_K), BLOCK_K):
        acc += tl.dot(x_desc.load([m0, k]), w_desc.load([n0, k]).T)
    return acc


@triton.jit
def _store_rows(acc, b_ptr, y_ptr, offs_m, offs_n, out_mask, N, HAS_BIAS: tl.constexpr):
    """y = acc (+ b), rounded once to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M", "num_shrink"])  # row counts: kernels/__init__.py
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, x_desc, w_desc, M, N, K, stride_xm, SPLIT_K,
                   xa_ptr, lora_b_ptr, lora_ranks_ptr, slots_ptr, num_slots, lora_b_rows, stride_lbs, stride_lbr,
                   a_ptr, xa_part_ptr, shrink_count_ptr, sorted_ids_ptr, block_slot_ptr, done_ptr, num_shrink,
                   stride_as, stride_ap, stride_ar,
                   HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, PARALLEL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   HAS_LORA: tl.constexpr, PART_BOUNDS: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, B_EARLY: tl.constexpr,
                   HAS_SHRINK: tl.constexpr, SHRINK_SPLITS: tl.constexpr,
                   SHRINK_SPLIT_K: tl.constexpr, SHRINK_BLOCK_M: tl.constexpr, SHRINK_BLOCK_K: tl.constexpr,
                   TMA: tl.constexpr, PDL: tl.constexpr):
    """y[m-tile, n-tile] = x[m-tile] @ W[n-tile]^T (+ b), the SPLITS K splits summed in order; W and y
    contiguous, offsets in int64 (prefill logits: M * N > 2^31). PARALLEL: program (tile, split) writes
    its split's fp32 partial to part [SPLITS, M, N] and the tile's last program to arrive adds them up;
    else program (tile, 0) runs the splits one after the other, with TMA its tiles loaded through the
    descriptors x_desc [M, K] and w_desc [N, K]. HAS_LORA: each row's LoRA delta is added to the sum before
    the bias and the rounding (`add_linear_lora`; the xa_ptr.. arguments are its).
    HAS_SHRINK: programs (0..num_shrink - 1, 0) are the shrink that writes xa (`shrink_linear_block`; the
    a_ptr.. arguments), the one that finishes each (block, part) counting in at done_ptr, and the tiles'
    programs come after them."""
    wait_for_previous_kernel(PDL)
    tile = tl.program_id(0)
    if HAS_SHRINK:
        if tile < num_shrink:
            if tl.program_id(1) == 0:  # the split axis of parallel tiles: one program per shrink block
                if shrink_linear_block(tile, x_ptr, a_ptr, lora_ranks_ptr, xa_part_ptr, xa_ptr, shrink_count_ptr,
                                       sorted_ids_ptr, block_slot_ptr, M, K, stride_xm, stride_as, stride_ap,
                                       stride_ar, len(PART_BOUNDS) - 1, SHRINK_SPLITS, SHRINK_SPLIT_K,
                                       SHRINK_BLOCK_M, SHRINK_BLOCK_K, BLOCK_R):
                    arrive(done_ptr)  # after its xa stores: one arrival per (block, part)
            return
        tile -= num_shrink
    pid_m, pid_n = grouped_tile(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    rows = offs_m.to(tl.int64)  # of split 0's partial; split s's are M further down
    out_mask = m_mask[:, None] & n_mask[None, :]
    # tiles of 32 rows load their rows' slots before the K loop, where the load's round trip hides behind it (o_proj's
    # LoRA cost 40% less); on tiles of 16 and of 64 rows the early load measured slower (benchmarks/RESULTS.md,
    # sessions 19 and 33)
    SLOTS_FIRST: tl.constexpr = HAS_LORA and BLOCK_M == 32
    if SLOTS_FIRST:
        row_slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    # both paths: (((0 + part_0) + part_1) + ...), each part summed from its own zero accumulator
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PARALLEL:
        part = _split_sum(x_ptrs, m_mask, w_ptrs, n_mask, K, SPLIT_K, tl.program_id(1), BLOCK_M, BLOCK_N, BLOCK_K)
    elif TMA:
        for s in range(SPLITS):
            acc += _split_sum_tma(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, SPLIT_K, s,
                                  BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        for s in range(SPLITS):
            acc += _split_sum(x_ptrs, m_mask, w_ptrs, n_mask, K, SPLIT_K, s, BLOCK_M, BLOCK_N, BLOCK_K)
    last = True  # this program finishes the tile
    if PARALLEL:
        split = tl.program_id(1)
        tl.store(part_ptr + (rows + split * M)[:, None] * N + offs_n[None, :], part, mask=out_mask)
        last = arrive(count_ptr + tile) == SPLITS - 1
        if last:
            tl.store(count_ptr + tile, 0)  # no other program touches it in this launch: zero for the next
            acc = sum_loads_in_order(part_ptr + rows[:, None] * N + offs_n[None, :], M * N, out_mask, SPLITS,
                                     loads_a_round(SPLITS, BLOCK_M * BLOCK_N), ".cg")
    if last:
        if HAS_LORA:
            if not SLOTS_FIRST:  # beside the K splits' partials
                row_slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
            row_slot = tl.where((row_slot >= 0) & (row_slot < num_slots), row_slot, -1)
            lora_bt = None
            if HAS_SHRINK:  # every tile's finishing program counts in, the last puts the counter back to 0
                if B_EARLY:  # B's round trip beside the wait
                    _, lora_used = linear_lora_rows(row_slot, lora_b_rows, 0, BLOCK_R, BLOCK_S)
                    lora_bt = load_linear_lora_b(lora_used, 0, pid_n * BLOCK_N, 0, N, lora_b_ptr, stride_lbs,
                                                 stride_lbr, BLOCK_N, BLOCK_R, BLOCK_S)
                wait_arrivals(done_ptr, num_shrink // SHRINK_SPLITS, tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N))
            acc = add_linear_lora(acc, row_slot, lora_bt, offs_m, pid_n * BLOCK_N, xa_ptr, lora_b_ptr, stride_lbs,
                                  stride_lbr, lora_b_rows, PART_BOUNDS, BLOCK_N, BLOCK_R, BLOCK_S, CHUNK_S)
        _store_rows(acc, b_ptr, y_ptr, offs_m, offs_n, out_mask, N, HAS_BIAS)


_counters: dict[torch.device, torch.Tensor] = {}
_shrink_done: dict[torch.device, torch.Tensor] = {}


class LinearShrink(NamedTuple):
    """What `shrink_linear_block` reads and writes to compute LinearLoRA.xa in the GEMM's launch."""
    a: torch.Tensor            # [slots, P, rank, K]: A of each slot and part
    part: torch.Tensor         # [M, P, splits, block_r] fp32 partials of the K splits (splits > 1; else unread)
    counters: torch.Tensor     # arrival counters, one per (block, part), zero (splits > 1; else unread)
    sorted_ids: torch.Tensor   # align_tokens_by_slot's blocks of block_m tokens of one slot
    block_slot: torch.Tensor
    splits: int
    split_k: int
    block_m: int
    block_k: int


class LinearLoRA(NamedTuple):
    """What `add_linear_lora` reads to add each row's LoRA delta in the GEMM's epilogue; with `shrink`, the
    launch computes xa itself first."""
    xa: torch.Tensor           # [M, P, block_r] in b's dtype: x @ A^T of each row and part (rows of no adapter unread)
    b: torch.Tensor            # [slots, rank, N]: B^T of each slot, the parts side by side
    ranks: torch.Tensor        # [slots, P] int32
    token_slots: torch.Tensor  # [M] int32, -1 (or out of range): no adapter
    part_bounds: tuple[int, ...]  # the parts' first columns, then N
    shrink: LinearShrink | None = None


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: LinearConfig | None = None, lora: LinearLoRA | None = None) -> torch.Tensor:
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    splits, split_k = k_splits(N, K, x.dtype)
    epilogue = None if lora is None else LoRAEpilogue(
        triton.next_power_of_2(lora.b.shape[0]), lora.xa.shape[2],
        None if lora.shrink is None else (lora.shrink.block_m, lora.shrink.block_k))
    cfg = config or default_config(M, N, splits, epilogue)
    cfg, chunk_s, b_early = (cfg, 1, False) if epilogue is None else lora_launch_config(cfg, epilogue)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    parallel = cfg.parallel_splits and splits > 1
    if parallel and tiles > SPLIT_COUNTERS:
        raise ValueError(f"parallel K splits on {tiles} tiles of {cfg}: more than the {SPLIT_COUNTERS} counters")
    block_k = gemm_block_k(x.dtype)
    # x and W through the copy engine where the tile's splits run in series and both tensors allow it
    descriptors = (tma_descriptor(x, (cfg.block_m, block_k)), tma_descriptor(weight, (cfg.block_n, block_k))) \
        if cfg.tma and not parallel else (None, None)
    tma = None not in descriptors
    x_desc, w_desc = descriptors if tma else (None, None)
    # partials only where splits run in parallel; else y and W stand in, never touched
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if parallel else y
    counters = zeroed_counters(_counters, SPLIT_COUNTERS, x.device, "linear parallel K splits") if parallel else weight
    # without LoRA (or its shrink) the pointers are y's and weight's, never read
    xa, lora_b, ranks, slots, bounds, shrink = lora if lora is not None else (y, y, y, y, (0, N), None)
    if shrink is None:
        a, xa_part, shrink_counters, sorted_ids, block_slot, num_shrink, done = y, y, y, y, y, 0, y
        shrink_splits, shrink_split_k, shrink_block_m, shrink_block_k = 1, 1, 16, 16
    else:
        a, xa_part, shrink_counters, sorted_ids, block_slot, shrink_splits, shrink_split_k, shrink_block_m, \
            shrink_block_k = shrink
        num_shrink = block_slot.numel() * (len(bounds) - 1) * shrink_splits
        done = zeroed_counters(_shrink_done, 1, x.device, "linear LoRA shrink in the GEMM launch")
    _linear_kernel[(num_shrink + tiles, splits if parallel else 1)](
        x, weight, weight if bias is None else bias, y, part, counters, x_desc, w_desc, M, N, K, x.stride(0), split_k,
        xa, lora_b, ranks, slots, *((lora_b.shape[0], lora_b.shape[1]) if lora is not None else (0, 0)),
        lora_b.stride(0), lora_b.stride(-2),
        a, xa_part, shrink_counters, sorted_ids, block_slot, done, num_shrink,
        *(a.stride()[:3] if shrink is not None else (0, 0, 0)),
        HAS_BIAS=bias is not None, SPLITS=splits, PARALLEL=parallel,  # HAS_BIAS=False never reads b
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        HAS_LORA=lora is not None, PART_BOUNDS=bounds, BLOCK_R=xa.shape[2] if lora is not None else 16,
        BLOCK_S=epilogue.slots if lora is not None else 1, CHUNK_S=chunk_s, B_EARLY=b_early,
        HAS_SHRINK=shrink is not None, SHRINK_SPLITS=shrink_splits, SHRINK_SPLIT_K=shrink_split_k,
        SHRINK_BLOCK_M=shrink_block_m, SHRINK_BLOCK_K=shrink_block_k, TMA=tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
    )
    return y


# ------------------------------------------------------------------------------------ torch


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's linear (cuBLAS on CUDA): the CPU backend; on a GPU its rows depend on the batch."""
    return nn.functional.linear(x, weight, bias)


# ------------------------------------------------------------------------------ entry point


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           impl: str = "auto", config: LinearConfig | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), a new contiguous tensor in x's dtype with
    fp32 accumulation. x's rows may be strided (last dimension contiguous); weight and bias are
    contiguous. impl: "triton", "torch" or "auto" (triton on CUDA)."""
    check_linear_inputs(x, weight, bias)
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "torch":
        return linear_reference(x, weight, bias)
    if impl == "triton":
        return linear_triton(x, weight, bias, config)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def check_linear_inputs(x, weight, bias) -> None:
    """Shape and dtype checks only: nothing here reads device memory (CUDA-graph safe)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be floating point [M, K] and contiguous in its last dimension, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [N, {x.shape[1]}] for x {tuple(x.shape)}, got shape "
                         f"{tuple(weight.shape)} with strides {weight.stride()}")
    if bias is not None and (bias.shape != weight.shape[:1] or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous of shape ({weight.shape[0]},) for weight {tuple(weight.shape)}, "
                         f"got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must have x's dtype {x.dtype} and device {x.device}, got {t.dtype} on {t.device}")
