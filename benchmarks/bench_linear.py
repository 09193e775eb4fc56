"""Dense GEMM benchmark (kernels only, not a test): moelora's batch-invariant `linear` against torch's
nn.functional.linear (cuBLAS), at Qwen3-30B-A3B's dense shapes.

For each shape and number of rows M it reports, all measured in one run on one device:
  torch us, ours us   median time of one projection (CUDA-graph replays over several weight copies, so
                      weights come from HBM, not L2), and ours / torch
  % of BW floor       ours against bytes of W + x + y / measured copy bandwidth
  TFLOP/s             ours at M >= 512, and % of the measured bf16 matmul rate
  K splits            S of the shape (`k_splits`), in parallel programs (par) or one after the other

    python3 benchmarks/bench_linear.py                        # all shapes, markdown table to stdout
    python3 benchmarks/bench_linear.py --sweep 1,4096         # also time candidate tiles at M = 1 and 4096
    python3 benchmarks/bench_linear.py --split-sweep 1,8      # also time other split counts at M = 1 and 8
    python3 benchmarks/bench_linear.py --lora --rows 1,8,32   # the dense LoRA's cost instead (lora_linear, rank 16)
    python3 benchmarks/bench_linear.py --lora --lora-rank 64  # ... of adapters of rank 64 (slots of that rank)
    python3 benchmarks/bench_linear.py --lora --sweep 8192    # also time candidate tiles of the GEMM with LoRA
    python3 benchmarks/bench_linear.py --shapes tiny          # CPU-sized smoke run (torch path on CPU)
"""
from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import torch
import triton
from torch import nn

from bench_moe import machine, measure
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora.kernels import linear as linear_module
from moelora.kernels.linear import LinearConfig, default_config, k_splits, linear
from moelora.kernels.lora_linear import LoRALinearConfig, align_tokens_by_slot, lora_linear
from tests.support import assert_rows_close, random_linear_lora, rel_tolerance

SHAPES = {  # in features K, out features N
    "qkv": (2048, 5120),
    "o": (4096, 2048),
    "router": (2048, 128),
    "lm_head": (2048, 151936),
    "tiny": (512, 80),  # 4 K splits in fp32 (the CPU's dtype)
}
LORA_PARTS = {"qkv": (4096, 512, 512), "o": (2048,), "tiny": (48, 32)}  # the parts each LoRA module adapts
LORA_SLOTS = 8
STREAMED_BYTES = 2e8  # weight copies per timed call: at least this much, 4x the L2 of an H100/H200
SPLIT_PROGRAMS = (64, 128, 256, 512, 1024)  # --split-sweep: values of the rule's program target tried


def weight_copies(shape, dtype, device) -> list[torch.Tensor]:
    k, n = shape
    count = 1 if device == "cpu" else max(2, min(256, math.ceil(STREAMED_BYTES / (n * k * dtype.itemsize))))
    return [(torch.randn(n, k, device=device) / k**0.5).to(dtype) for _ in range(count)]


def time_per_copy(fn, x, weights) -> float:
    return measure(lambda: [fn(x, w) for w in weights]) / len(weights)


def check_once(weights, device, dtype):
    """The benchmarked path must agree with torch before its time means anything."""
    x = torch.randn(33, weights[0].shape[1], device=device, dtype=dtype)
    assert_rows_close(linear(x, weights[0]), linear(x, weights[0], impl="torch"), rel_tolerance(dtype, device),
                      "benchmark check")


def floor_seconds(m, shape, dtype, bw) -> float:
    k, n = shape
    return (n * k + m * k + m * n) * dtype.itemsize / bw


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,o,router,lm_head")
    p.add_argument("--rows", default="1,8,32,128,512,4096", help="values of M")
    p.add_argument("--sweep", default="", help="M values at which to also time candidate tiles (tuning aid)")
    p.add_argument("--split-sweep", default="", help="M values at which to also time the K-split rule with "
                   f"its program target at {SPLIT_PROGRAMS} (tuning aid)")
    p.add_argument("--lora", action="store_true", help="time the projection with LoRA of 1 and of 8 adapters "
                   "(tokens round-robin) against without, as the engine runs it (lora_linear)")
    p.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank, and the slots' (--lora)")
    args = p.parse_args()
    device, dtype, name, mm, bw = machine()
    torch.manual_seed(0)
    if args.lora:
        return lora_table(args, device, dtype, name, bw)
    print(f"# moelora dense GEMM benchmark, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}")
    print(f"measured copy bandwidth {bw / 1e12:.2f} TB/s (read+write), {dtype} matmul {mm / 1e12:.0f} TFLOP/s\n")
    print("| shape | M | torch us | ours us | ours/torch | BW floor us | ours % of floor | ours TFLOP/s (% matmul) "
          "| K splits |")
    print("|---|---|---|---|---|---|---|---|---|")
    sweep_rows = [int(m) for m in args.sweep.split(",") if m]
    split_rows = [int(m) for m in args.split_sweep.split(",") if m]
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        weights = weight_copies(shape, dtype, device)
        check_once(weights, device, dtype)
        label = f"{shape_name} {shape[0]}->{shape[1]}"
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, shape[0], device=device, dtype=dtype)
            t_torch = time_per_copy(nn.functional.linear, x, weights)
            t_ours = time_per_copy(linear, x, weights)
            floor = floor_seconds(m, shape, dtype, bw)
            flops = 2 * m * shape[0] * shape[1]
            tf = f"{flops / t_ours / 1e12:.0f} ({100 * flops / t_ours / mm:.0f}%)" if m >= 512 else ""
            print(f"| {label} | {m} | {t_torch * 1e6:.1f} | {t_ours * 1e6:.1f} | {t_ours / t_torch:.2f} "
                  f"| {floor * 1e6:.1f} | {100 * floor / t_ours:.0f}% | {tf} | {splits_label(m, shape, dtype)} |",
                  flush=True)
        for m in sweep_rows:
            sweep(weights, m, shape, device, dtype, bw)
        for m in split_rows:
            split_sweep(weights, m, shape, device, dtype, bw)
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()


def lora_table(args, device, dtype, name, bw) -> None:
    """The dense LoRA's cost per projection: lora_linear (the shrink in the GEMM's launch up to 256 rows, the
    expand in its epilogue) with every token on one adapter, and round-robin over 8, against the plain GEMM;
    slot buffers of LORA_SLOTS adapters of rank --lora-rank per weight copy, the tokens' slot blocks aligned once
    (the engine aligns them once per step)."""
    print(f"# moelora dense LoRA cost, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}")
    print(f"measured copy bandwidth {bw / 1e12:.2f} TB/s; {LORA_SLOTS} slots of rank {args.lora_rank} per weight "
          "copy\n")
    print("| shape | M | no LoRA us | 1 adapter us | delta us | 8 adapters us | delta us |")
    print("|---|---|---|---|---|---|---|")
    for shape_name in args.shapes.split(","):
        if shape_name not in LORA_PARTS:
            continue
        lora_rows(args, shape_name, device, dtype)
        if device == "cuda":
            torch.cuda.empty_cache()  # the shape's weights went with lora_rows' frame


def lora_rows(args, shape_name: str, device, dtype) -> None:
    """lora_table's rows of one shape."""
    shape, parts = SHAPES[shape_name], LORA_PARTS[shape_name]
    weights = weight_copies(shape, dtype, device)
    loras = [random_linear_lora(shape[0], parts, [[args.lora_rank] * len(parts)] * LORA_SLOTS, dtype, device)
             for _ in weights]
    for m in map(int, args.rows.split(",")):
        x = torch.randn(m, shape[0], device=device, dtype=dtype)
        times = [time_per_copy(linear, x, weights)]
        for adapters in (1, LORA_SLOTS):
            slots = (torch.arange(m, device=device) % adapters).to(torch.int32)
            blocks = align_tokens_by_slot(slots, LORA_SLOTS) if device == "cuda" else None  # CPU: torch path
            assert_rows_close(lora_linear(x, weights[0], None, loras[0], parts, slots, blocks=blocks),
                              lora_linear(x, weights[0], None, loras[0], parts, slots, impl="torch"),
                              rel_tolerance(dtype, device), "benchmark check")
            times.append(measure(lambda: [lora_linear(x, w, None, lora, parts, slots, blocks=blocks)
                                          for w, lora in zip(weights, loras)]) / len(weights))
        base, one, many = (t * 1e6 for t in times)
        print(f"| {shape_name} {shape[0]}->{shape[1]} | {m} | {base:.1f} | {one:.1f} | {one - base:.1f} "
              f"| {many:.1f} | {many - base:.1f} |", flush=True)
        if str(m) in args.sweep.split(",") and device == "cuda":  # 8 adapters (slots, blocks as last timed)
            timed = []
            for cfg in (c for c in candidates(m, shape[1]) if c.block_m >= 64 and c.num_stages in (3, 4)):
                config = LoRALinearConfig(linear=cfg)
                try:
                    timed.append((measure(lambda: [lora_linear(x, w, None, lora, parts, slots, blocks=blocks,
                                                               config=config) for w, lora in zip(weights, loras)])
                                  / len(weights), cfg))
                except Exception as exc:  # out of shared memory etc.
                    print(f"  lora sweep M={m} {cfg}: failed {type(exc).__name__}")
            for t, cfg in sorted(timed, key=lambda c: c[0])[:5]:
                print(f"  lora sweep M={m} {shape_name}: {cfg} {t * 1e6:.1f} us (8 adapters)", flush=True)


def candidates(m: int, n: int) -> list[LinearConfig]:
    """Tiles worth trying for M rows and N columns, K splits run as the default runs them; BLOCK_K is not
    among them (with the K splits it sets the order of a row's sums: changing it with M would make results
    depend on the batch)."""
    m_p, n_p = max(16, triton.next_power_of_2(m)), max(16, triton.next_power_of_2(n))
    default, out = default_config(m, n), []
    for bm in (bm for bm in (16, 32, 64, 128) if min(64, m_p) // 2 <= bm <= m_p):
        for bn in (bn for bn in (16, 32, 64, 128, 256) if bn <= n_p):
            for warps in (4, 8) if bm * bn >= 128 * 128 else (4,):
                out += [LinearConfig(bm, bn, 8, warps, stages, default.parallel_splits, tma)
                        for stages in (3, 4, 5, 6, 8) for tma in sorted({default.tma, False})]
    return out


def sweep(weights, m, shape, device, dtype, bw):
    x = torch.randn(m, shape[0], device=device, dtype=dtype)
    floor, results = floor_seconds(m, shape, dtype, bw), []
    default = default_config(m, shape[1], k_splits(shape[1], shape[0], dtype)[0])
    for cfg in candidates(m, shape[1]):
        try:
            t = time_per_copy(lambda x, w: linear(x, w, config=cfg), x, weights)
        except Exception as exc:  # out of shared memory etc.
            print(f"  sweep M={m} {cfg}: failed {type(exc).__name__}")
            continue
        results.append((t, cfg))
        print(f"  sweep M={m} {cfg}: {t * 1e6:.1f} us ({100 * floor / t:.0f}% of floor)"
              f"{' (default)' if cfg == default else ''}", flush=True)
    t, cfg = min(results, key=lambda r: r[0])
    print(f"  best at M={m} N={shape[1]}: {cfg} {t * 1e6:.1f} us; default {default}")


def splits_label(m, shape, dtype) -> str:
    splits = k_splits(shape[1], shape[0], dtype)[0]
    return f"{splits}{' par' if splits > 1 and default_config(m, shape[1]).parallel_splits else ''}"


def split_sweep(weights, m, shape, device, dtype, bw):
    """The default tiles with the split rule's program target at each of SPLIT_PROGRAMS (S changes the bits:
    a new rule must stay a function of N, K and the dtype)."""
    x, floor, rule = torch.randn(m, shape[0], device=device, dtype=dtype), floor_seconds(m, shape, dtype, bw), \
        linear_module.SPLIT_PROGRAMS
    try:
        for target in SPLIT_PROGRAMS:
            linear_module.SPLIT_PROGRAMS = target
            t = time_per_copy(linear, x, weights)
            print(f"  split sweep M={m} SPLIT_PROGRAMS={target}: K splits {splits_label(m, shape, dtype)}, "
                  f"{t * 1e6:.1f} us ({100 * floor / t:.0f}% of floor){' (default)' if target == rule else ''}",
                  flush=True)
    finally:
        linear_module.SPLIT_PROGRAMS = rule


if __name__ == "__main__":
    main()
