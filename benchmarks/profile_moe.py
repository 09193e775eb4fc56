"""Per-kernel GPU time of one fused_moe call (torch profiler), with and without LoRA: where the
time goes, to guide kernel work. Not a test.

    python3 benchmarks/profile_moe.py --shape qwen3-30b-a3b --tokens 1,32 --adapters 1,8
    python3 benchmarks/profile_moe.py --tokens 32 --adapters 8 --coverage 0.25   # adapters on a quarter of the experts
    python3 benchmarks/profile_moe.py --shape mixtral-8x7b --tokens 1 --ranks 8,8,16,16,16,32,64,64 --rank-bound 64
    MOELORA_PDL=0 python3 benchmarks/profile_moe.py --tokens 4096 --adapters 1,8   # each kernel's own share
    ncu --clock-control none -k regex:shrink_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        python3 benchmarks/profile_moe.py --tokens 512 --adapters 8 --no-profiler   # the 3rd LoRA shrink, in ncu

With programmatic dependent launch (kernels/pdl.py, on by default on Hopper) a kernel starts while the one before
it finishes, and its recorded time takes in that wait; MOELORA_PDL=0 gives times that add up.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_moe import MAX_RANK, RANK, SHAPES, SLOTS
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora.core import TopKConfig
from moelora.kernels.fused_moe import fused_moe
from moelora.kernels.topk import select_experts
from tests.support import random_expert_lora, random_moe_weights


def kernel_times(fn, reps: int = 20, profiler: bool = True) -> dict[str, float]:
    """Mean microseconds per call of each GPU kernel that fn launches; without the profiler only the calls, and no
    times (for a profiler around the process, as ncu, with no torch profiler beside it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if not profiler:
        return {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            times[evt.name[:60]] += evt.device_time / reps
    return dict(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,32,4096")
    p.add_argument("--adapters", default="1,8")
    p.add_argument("--ranks", default=None, help=f"the {SLOTS} slots' ranks, comma-separated (default: all {RANK})")
    p.add_argument("--rank-bound", type=int, default=None,
                   help="the step's bound on the ranks (ExpertLoRASlots.max_rank_in_use; default: the largest slot rank)")
    p.add_argument("--coverage", type=float, default=1.0, help="share of the experts each adapter covers (0: none)")
    p.add_argument("--per-projection", action="store_true",
                   help="draw --coverage for each projection on its own (default: per expert, all three projections)")
    p.add_argument("--no-profiler", action="store_true",
                   help="only make the calls, e.g. under `ncu -k regex:shrink_kernel --launch-skip 2 --launch-count 1`")
    args = p.parse_args()
    slot_ranks = list(map(int, args.ranks.split(","))) if args.ranks else [RANK] * SLOTS
    if len(slot_ranks) != SLOTS or not all(0 <= r <= MAX_RANK for r in slot_ranks):
        p.error(f"--ranks: {SLOTS} ranks of 0..{MAX_RANK} needed, got {args.ranks}")
    hidden, inter, experts, top_k = SHAPES[args.shape]
    dtype, device = torch.bfloat16, "cuda"
    w13, w2 = random_moe_weights(experts, hidden, inter, dtype, device)
    lora = random_expert_lora(SLOTS, experts, hidden, inter, slot_ranks, dtype, device, coverage=args.coverage,
                              max_rank=MAX_RANK, whole_experts=not args.per_projection)
    if args.rank_bound is not None:
        lora.max_rank_in_use = args.rank_bound
    router = torch.randn(experts, hidden, device=device, dtype=dtype) / hidden**0.5
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        topk = select_experts(x @ router.T, TopKConfig(top_k=top_k))
        print(f"\n## {args.shape} T={tokens}")
        base = kernel_times(lambda: fused_moe(x, w13, w2, topk), profiler=not args.no_profiler)
        if base:
            print("base: " + ", ".join(f"{k} {v:.1f}us" for k, v in base.items()) + f" | total {sum(base.values()):.1f}us")
        for n in map(int, args.adapters.split(",")):
            slots = (torch.arange(tokens, device=device) % n).to(torch.int32)
            t = kernel_times(lambda: fused_moe(x, w13, w2, topk, lora, slots), profiler=not args.no_profiler)
            if t:
                print(f"lora x{n}: " + ", ".join(f"{k} {v:.1f}us" for k, v in t.items())
                      + f" | total {sum(t.values()):.1f}us")


if __name__ == "__main__":
    main()
