"""The fused MoE's kernel config and the tile table that picks it by batch shape.

Why each threshold and tile is what it is (the measurements behind them): benchmarks/RESULTS.md,
"Fused MoE: where its thresholds and tiles come from".
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from moelora.kernels.gemm_tiles import gemm_block_k, loads_a_round, stages_that_fit
from moelora.kernels.lora_tiles import LORA_RANK_CHUNK

# A row's result must not depend on what it is batched with, so everything that sets the order of
# its fp32 sums is fixed here, never by the config: the gate/up shrink's K split (SHRINK_SPLIT_K columns
# of H per partial) and the parts of I the down shrink is summed over, in order (DOWN_SHRINK_PART columns
# each: a gate_up n tile, with LoRA 64 or 128 columns wide, computes one or two, or with down_shrink_launch a
# program per segment all of them). BLOCK_K is fixed per dtype (gemm_block_k). The tiles follow the batch.
DOWN_SHRINK_PART = 64
SHRINK_SPLIT_K = 512
SUM_PARTS = 8  # partial sums (shrink splits, down-shrink parts) read a round in the LoRA epilogues (tiles.sum_partials)
REDUCE_PROGRAMS = 512  # about this many programs sum the partials once per row (reduction.reduce_partials)
# Up to this many tokens every (token, expert) pair is its own block (pair_blocks): no alignment launch, but
# an expert picked by several tokens is read once per pair.
PAIR_BLOCKS_MAX_TOKENS = 2
# on blocks of 64 rows the down shrink's launch (a program per piece of 64 rows, each over all of I) has programs
# enough where the experts are many: with Qwen3's 128 it beat the gate_up epilogue's parts, with Mixtral's 8 it lost
# (benchmarks/RESULTS.md, session 38)
DOWN_SHRINK_LAUNCH_MIN_EXPERTS = 128
# Hopper's shared memory per program (gemm_tiles.SMEM_BYTES) holds the GEMMs' slot-loop pipeline (SLOT_STAGES B
# tiles of the rank tile) up to this many stages x rank-tile rows: the tile table's 4 stages at rank tile 64, in
# every row; the prefill row asked 294912 B at 4 x 128 and 2 x 256 (compiled for sm_90, session 48)
SLOT_PIPELINE_ROWS = 256
MAX_RANK_TILE = SLOT_PIPELINE_ROWS  # a larger tile's one slot-loop stage alone would not fit in the prefill row
# From rank tile 128 the gate/up segment shrink's fp32 tiles [SHRINK_ROWS, 2 x rank tile] spill on the tile table's
# 2-4 warps (compiled for sm_90: 752 to 6968 bytes a thread at rank tiles 128 and 256); the shrinks (gate/up and down)
# then run on 8 warps and at most LARGE_RANK_SHRINK_ELEMENTS / rank tile rows a pass: 0-312 bytes
# (benchmarks/RESULTS.md, session 49)
LARGE_RANK_TILE = 128
LARGE_RANK_SHRINK_WARPS = 8
LARGE_RANK_SHRINK_ELEMENTS = 8192


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tiles and launch choices of one fused MoE call. None of them changes a row's bits."""
    block_m: int
    block_n_gate_up: int
    block_n_down: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    pair_blocks: bool = False  # each (token, expert) pair is its own block (row 0 of BLOCK_M): no alignment
    half_tiles: bool = False  # blocks with at most block_m / 2 pairs run as tiles of block_m / 2 rows
    # aligned blocks with LoRA: up to this many pairs the gate/up shrink runs per pair, in the alignment's
    # launch; past it, per (expert, slot) segment after the alignment
    pair_shrink_max_pairs: int = 256
    # from this many pairs on, one launch sums the LoRA partials per row before the GEMMs read them, instead
    # of every (block, n-tile) program summing its rows' partials itself
    reduce_partials_min_pairs: int = 512
    # from this many pairs on (and past pair_shrink_max_pairs, on the smallest rank tile) a segment shrink program
    # adds its K splits up itself (serial_shrink): no partials to write, read and sum. Below it there are too few
    # segments to fill the SMs with one program each (benchmarks/RESULTS.md, session 51)
    serial_shrink_min_pairs: int = 16384
    # registers per thread the GEMM kernels may use when they hold LoRA epilogues of more than one rank tile
    # (None: the compiler's choice). The kernels hold an epilogue per rank tile up to the slot buffers'
    # (tiles.takes_rank_tile); the largest one's registers would set the occupancy of every program, also of
    # blocks whose ranks take a small tile. Without LoRA, or with the smallest tile alone, the cap slowed the
    # kernels at decode; in blocks of 16 rows a cap of 128 gained nothing (benchmarks/RESULTS.md)
    max_registers: int | None = None
    # software-pipeline stages of the LoRA epilogues' loops over a block's slots (1: none): the next slot's B
    # and A_d tiles load while this one's dots run. In blocks of 16 rows, a few rows of one or two slots at
    # decode, it gained at some shapes and lost at others (benchmarks/RESULTS.md)
    slot_stages: int = 1
    # warps and pipeline stages of the segment shrink (shrink.shrink_kernel, aligned blocks past
    # pair_shrink_max_pairs): the 16-row tiles of the decode rows take 2 warps and 4 stages, which beat 4 and 3 on
    # 16-row tiles of its predecessor, a program per block; the 64- and 128-row tiles take these defaults
    # (benchmarks/RESULTS.md)
    shrink_num_warps: int = 4
    shrink_num_stages: int = 3
    # the segment shrink as a launch per rank tile, each compiled for its tile alone: with one launch the largest
    # tile's registers set how many programs an SM holds for every tile. Mixed ranks at 32-row blocks gained; at
    # 16-row blocks the extra launches cost more than that (benchmarks/RESULTS.md, sessions 34 and 35)
    shrink_per_rank_tile: bool = False
    # rows of the gate/up shrink's tile, the same on every path of this config (per segment, per pair, pair
    # blocks), so that the paths' arithmetic for a row is one by construction (the tiles of different rows of
    # the table are checked bit for bit on the GPU: test_fused_moe_gpu's row_does_not_depend_on_batch).
    # The segment shrink takes an (expert, slot) key's rows in pieces of at most segment_rows (moe_align), a
    # program each, shrink_rows at a time: a key of many rows is then several programs. At decode tiles of 16
    # rows in pieces of 64 won; at prefill a tile and a piece of block_m rows (one load of A for many rows), where
    # tiles of 16 cost a fifth more with one adapter (benchmarks/RESULTS.md, session 35)
    shrink_rows: int = 16
    segment_rows: int = 64
    # aligned blocks with the segment shrink: the down shrink per segment in a launch of its own after gate_up
    # (shrink.down_shrink_kernel), summed over I's parts at once, instead of a part per gate_up tile in its
    # epilogue and their sum. On prefill tiles (one program an SM) the epilogue's parts cost more than the launch,
    # and on blocks of 64 rows where the experts are many (benchmarks/RESULTS.md, sessions 37 and 38)
    down_shrink_launch: bool = False
    # the GEMMs load the experts' weights through the copy engine (TMA) where the GPU has one and the weights are
    # 16-byte aligned (gemm_tiles.tma_descriptor), else by pointers: the same bits (the input rows, gathered, by
    # pointers either way). Pair blocks (one or two tokens) keep pointers: Mixtral's base at one token ran 4% slower
    # through TMA, aligned blocks 1.0-1.1x faster, their LoRA delta up to 4x smaller (benchmarks/RESULTS.md, session 56)
    tma: bool = True

    def __post_init__(self):
        """A config is a public knob (fused_moe's config=): a bad field is named here, not in a Triton compile error
        or a launch that reads out of bounds."""
        def fail(name: str, rule: str):
            raise ValueError(f"MoEKernelConfig.{name} must be {rule}, got {getattr(self, name)!r}")
        for name in ("block_m", "block_n_gate_up", "block_n_down", "block_k", "shrink_rows"):
            value = getattr(self, name)  # tensor-core tiles: 16 rows or columns at least
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                fail(name, "a power of two of at least 16")
        for name in ("num_warps", "shrink_num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 32 or value & (value - 1):
                fail(name, "a power of two from 1 to 32")
        for name in ("group_m", "num_stages", "slot_stages", "shrink_num_stages", "segment_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                fail(name, "an int of at least 1")
        for name in ("pair_shrink_max_pairs", "reduce_partials_min_pairs", "serial_shrink_min_pairs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                fail(name, "an int of at least 0")
        if self.max_registers is not None and not (isinstance(self.max_registers, int) and
                                                   32 <= self.max_registers <= 255):
            fail("max_registers", "None or an int from 32 to 255")


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype, *,
                   lora: bool) -> MoEKernelConfig:
    """Tile sizes by rows per expert. Without LoRA the aligned blocks are wider: at these sizes the GEMMs stream
    the expert weights, and a block that holds all of an expert's rows (the busiest expert gets well over the
    mean) reads them once; with LoRA every block's epilogue loops over the slots of its rows, so narrower
    blocks cost less in all."""
    block_k = gemm_block_k(dtype)
    if num_tokens <= PAIR_BLOCKS_MAX_TOKENS:
        return MoEKernelConfig(16, 64, 64, block_k, 8, 4, 4, pair_blocks=True, max_registers=128, tma=False)
    num_pairs = num_tokens * top_k
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 16:
        return MoEKernelConfig(16, 64, 128, block_k, 8, 4, 4, shrink_num_warps=2, shrink_num_stages=4)
    if not lora and rows_per_expert <= 48:
        return MoEKernelConfig(64, 64, 128, block_k, 8, 4, 4)
    if not lora and rows_per_expert < 256:
        return MoEKernelConfig(128, 128, 128, block_k, 8, 8, 4, half_tiles=True)
    if rows_per_expert <= 96:
        return MoEKernelConfig(32, 64, 128, block_k, 8, 4, 4, slot_stages=4, max_registers=168,
                               shrink_per_rank_tile=True, shrink_num_warps=2, shrink_num_stages=4)
    if rows_per_expert < 256:
        return MoEKernelConfig(64, 64, 128, block_k, 8, 4, 4, slot_stages=4, shrink_rows=64, segment_rows=64,
                               down_shrink_launch=num_experts >= DOWN_SHRINK_LAUNCH_MIN_EXPERTS)
    # prefill: wide n tiles, 8 warps
    return MoEKernelConfig(128, 128, 256, block_k, 8, 8, 4, half_tiles=True, slot_stages=4, shrink_rows=128,
                           segment_rows=128, down_shrink_launch=True)


def for_rank_tile(cfg: MoEKernelConfig, block_r: int) -> MoEKernelConfig:
    """`cfg` as a launch with LoRA of rank tile block_r runs it: the GEMMs' slot-loop pipeline and the segment
    shrink's stages cut where their tiles of a large rank tile would not fit in shared memory (the shrink: a buffer
    per stage of its x and gate and up A tiles, SHRINK_ROWS + 2 x block_r rows of BLOCK_K; the prefill row's 3 stages
    took 245760 B at rank tile 256); past rank tile 64 the segment shrink on more warps and fewer rows a pass, where
    its registers would spill. Neither pipelining nor the shrink's warps and rows set the order of a sum: the bits
    stay."""
    if block_r > MAX_RANK_TILE:
        raise ValueError(f"the experts' LoRA kernels hold rank tiles up to {MAX_RANK_TILE} in shared memory, got "
                         f"{block_r}: a --max-lora-rank of at most {MAX_RANK_TILE}")
    if block_r >= LARGE_RANK_TILE:
        cfg = replace(cfg, shrink_num_warps=max(cfg.shrink_num_warps, LARGE_RANK_SHRINK_WARPS),
                      shrink_rows=min(cfg.shrink_rows, LARGE_RANK_SHRINK_ELEMENTS // block_r))
    return replace(cfg, slot_stages=max(1, min(cfg.slot_stages, SLOT_PIPELINE_ROWS // block_r)),
                   shrink_num_stages=stages_that_fit(cfg.shrink_rows + 2 * block_r, cfg.block_k,
                                                     cfg.shrink_num_stages))


def down_sum_parts(block_m: int, num_hd_parts: int) -> int:
    """The down-shrink parts the down epilogue loads per round at rank tile 16 (gemm._down_lora halves it per
    doubling of the tile, down to SUM_PARTS): gemm_tiles.loads_a_round of a block's rows (Mixtral's 14336 columns
    of I are 224 parts). The parts are added one after the other whatever the number per round: the bits stay."""
    return max(SUM_PARTS, loads_a_round(triton.next_power_of_2(num_hd_parts), block_m * LORA_RANK_CHUNK))


def serial_shrink(cfg: MoEKernelConfig, num_pairs: int, block_r: int) -> bool:
    """Whether the segment shrink's programs add their K splits up themselves (shrink_kernel's SERIAL): aligned
    blocks past pair_shrink_max_pairs, from serial_shrink_min_pairs on, on the smallest rank tile only (past it a
    program's two accumulators spill, compiled for sm_90)."""
    return block_r == LORA_RANK_CHUNK and not cfg.pair_blocks and cfg.pair_shrink_max_pairs < num_pairs and \
        num_pairs >= cfg.serial_shrink_min_pairs
