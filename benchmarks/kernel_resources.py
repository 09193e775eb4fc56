"""Registers, spilled bytes and shared memory of the fused MoE's kernels as Triton builds them for Hopper (sm_90a),
and how many programs of each an SM holds at once, on any machine: Triton compiles for a target without a GPU, and
its bundled cuobjdump reads the cubin's resource usage. An occupancy question answered without device time (the
numbers are this machine's Triton's; the GPU's Triton may allocate differently). Not a test.

    python3 benchmarks/kernel_resources.py                          # Qwen3-30B-A3B's tile rows, LoRA off and on
    python3 benchmarks/kernel_resources.py --tokens 512 --maxnreg 168   # with a register cap on the LoRA GEMMs
    python3 benchmarks/kernel_resources.py --rank-tiles 128,256         # slots of large ranks
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/

from bench_moe import SHAPES
from moelora.kernels.fused_moe import config as fm_config
from moelora.kernels.fused_moe import gemm as fm_gemm
from moelora.kernels.fused_moe import shrink as fm_shrink
from moelora.kernels.lora_tiles import LORA_RANK_CHUNK, rank_tile_count
from tests.kernels.test_compile_sm90 import compile_sm90, moe_gemm_constexprs, moe_weight_types

REGISTERS_PER_SM, SHARED_PER_SM, WARPS_PER_SM, PROGRAMS_PER_SM = 65536, 228 * 1024, 64, 32  # Hopper
SUB_PARTITIONS = 4  # an SM's register file is four, a warp's registers all in one (CUDA's occupancy calculator)
SHARED_RESERVED, SHARED_UNIT = 1024, 128  # per program, by the driver; shared memory is given in units of this
REGISTER_UNIT = 256  # registers are given to a warp in units of this many


@dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    spilled: int  # bytes of local memory per thread (spills and stack)
    shared: int  # bytes per program
    warps: int

    def programs_per_sm(self) -> dict[str, int]:
        """How many programs an SM holds by each limit (the least one holds)."""
        per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        warps_by_registers = REGISTERS_PER_SM // SUB_PARTITIONS // per_warp * SUB_PARTITIONS
        shared = -(-(self.shared + SHARED_RESERVED) // SHARED_UNIT) * SHARED_UNIT
        return {"registers": warps_by_registers // self.warps, "shared": SHARED_PER_SM // shared,
                "warps": min(PROGRAMS_PER_SM, WARPS_PER_SM // self.warps)}


def resources(kernel, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None = None,
              types: dict | None = None) -> Resources:
    """The kernel compiled for sm_90a in bf16 with the constexprs it takes (others are dropped, so one table serves
    kernels of different signatures); types: argument types other than compile_sm90's defaults."""
    own = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    compiled = compile_sm90(kernel, own, "bf16", num_warps, num_stages, types, maxnreg=maxnreg)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{usage}")
    registers, stack, static_shared, local = map(int, found.groups())
    return Resources(registers, max(stack, local), static_shared + compiled.metadata.shared, num_warps)


def rows(tokens: int, shape: tuple[int, int, int, int], lora: bool, maxnreg: int | None,
         largest_rank_tiles: tuple[int, ...] = (16, 64)):
    """(kernel name, rank tiles, Resources) of each kernel a fused_moe call of `tokens` tokens launches on the
    default tile table: without LoRA, or with LoRA on tiles up to each of `largest_rank_tiles` (16: the rank-16 tile
    alone; the segment shrink then, where the config says so, a launch per tile), as the launcher runs that tile
    (`for_rank_tile`: its pipelines cut to shared memory)."""
    _, inter, experts, top_k = shape
    table_cfg = fm_config.default_config(tokens, top_k, experts, torch.bfloat16, lora=lora)
    segment_shrink = lora and not table_cfg.pair_blocks and tokens * top_k > table_cfg.pair_shrink_max_pairs
    for block_r in largest_rank_tiles if lora else (LORA_RANK_CHUNK,):
        cfg = fm_config.for_rank_tile(table_cfg, block_r) if lora else table_cfg
        rank_tiles = rank_tile_count(block_r)
        cap = (maxnreg or cfg.max_registers) if rank_tiles > 1 else None  # as the launcher applies max_registers
        def constexprs(block_n: int) -> dict:  # (A_ALIGNED: on branches whose shrink takes it)
            return {**moe_gemm_constexprs(cfg, lora, block_n, block_r, rank_tiles, triton.next_power_of_2(top_k)),
                    "SPLIT_K": fm_config.SHRINK_SPLIT_K, "PART_N": fm_config.DOWN_SHRINK_PART, "A_ALIGNED": True,
                    "SHRINK_ROWS": cfg.shrink_rows, "DOWN_SHRINK": not (segment_shrink and cfg.down_shrink_launch)}
        yield "gate_up_kernel", rank_tiles, resources(fm_gemm.gate_up_kernel, constexprs(cfg.block_n_gate_up),
                                                      cfg.num_warps, cfg.num_stages, cap,
                                                      moe_weight_types(cfg, cfg.block_n_gate_up, "bf16"))
        down_parts = fm_config.down_sum_parts(cfg.block_m, triton.cdiv(inter, fm_config.DOWN_SHRINK_PART))
        yield "down_kernel", rank_tiles, resources(fm_gemm.down_kernel, {**constexprs(cfg.block_n_down),
                                                                         "PARTS": down_parts},
                                                   cfg.num_warps, cfg.num_stages, cap,
                                                   moe_weight_types(cfg, cfg.block_n_down, "bf16"))
        for tile in (range(rank_tiles) if cfg.shrink_per_rank_tile else (-1,)) if segment_shrink else ():
            name = f"shrink_kernel (tile {LORA_RANK_CHUNK << tile})" if tile >= 0 else "shrink_kernel"
            serial = fm_config.serial_shrink(cfg, tokens * top_k, block_r)
            yield name, rank_tiles, resources(fm_shrink.shrink_kernel, {**constexprs(0), "TILE": tile, "SERIAL": serial},
                                              cfg.shrink_num_warps, cfg.shrink_num_stages)
        if segment_shrink and cfg.down_shrink_launch:
            yield "down_shrink_kernel", rank_tiles, resources(fm_shrink.down_shrink_kernel, constexprs(0),
                                                              cfg.shrink_num_warps, cfg.shrink_num_stages)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--tokens", default="1,128,512,2048,4096")
    p.add_argument("--maxnreg", type=int, default=None,
                   help="register cap of the LoRA GEMMs with more than one rank tile (MoEKernelConfig.max_registers)")
    p.add_argument("--rank-tiles", default="16,64",
                   help="with LoRA, the largest rank tile of each set of kernels (the slots' rank, to a power of two)")
    args = p.parse_args()
    largest = tuple(map(int, args.rank_tiles.split(",")))
    print(f"# fused MoE kernel resources on sm_90a, {args.shape}, Triton {triton.__version__}\n")
    print("| T | LoRA | kernel | rank tiles | registers | spilled bytes | shared KiB | programs an SM (registers, "
          "shared, warps) |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        for lora in (False, True):
            for name, rank_tiles, r in rows(tokens, SHAPES[args.shape], lora, args.maxnreg, largest):
                held = r.programs_per_sm()
                print(f"| {tokens} | {'on' if lora else 'off'} | {name} | {rank_tiles if lora else ''} | {r.registers} "
                      f"| {r.spilled} | {r.shared / 1024:.1f} | **{min(held.values())}** ({held['registers']}, "
                      f"{held['shared']}, {held['warps']}) |", flush=True)


if __name__ == "__main__":
    main()
