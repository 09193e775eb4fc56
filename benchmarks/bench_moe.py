"""MoE + multi-adapter expert-LoRA benchmark (kernels only, not a test).

For each model shape, token count T and number of distinct adapters (rank 16, tokens assigned
round-robin) it reports, all measured in one run on one device:
  base      time of fused_moe without LoRA, and % of its floor: bytes of the expert weights it must
            read (distinct experts touched) / measured copy bandwidth
  lora      extra time with LoRA on (each on its own tile table: what turning LoRA on costs), and % of
            its floor: bytes of A and B of every touched (adapter, expert) pair / measured copy bandwidth
            (--rank-cases times both on the LoRA table: the LoRA work alone, every case on the same tokens
            and routing, drawn from one seed in every run)
  block     (router GEMM + top-k + fused_moe) with LoRA over without, both under a CUDA graph
  TFLOP/s   of the base MoE at T >= 512 against the measured bf16 matmul rate
Timings are CUDA-graph replays over several layer copies, so weights come from HBM, not L2; the two sides of a
delta alternate, replay by replay, and the delta is the median of neighbouring differences (measure_pair).

    python3 benchmarks/bench_moe.py                       # all shapes, markdown table to stdout
    python3 benchmarks/bench_moe.py --shapes tiny         # CPU-sized demo (torch path on CPU)
    python3 benchmarks/bench_moe.py --tokens 1,4096 --adapters 1 --sweep-tokens 1,4096   # also other tiles there
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time
import sys
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora.core import TopKConfig
from moelora.kernels.fused_moe import MoEKernelConfig, default_config, fused_moe
from moelora.kernels.fused_moe.config import PAIR_BLOCKS_MAX_TOKENS
from moelora.kernels.lora_tiles import step_rank_bound
from moelora.kernels.topk import select_experts
from tests.support import assert_rows_close, random_expert_lora, random_moe_weights, rel_tolerance

SHAPES = {  # hidden, intermediate, experts, top_k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "tiny": (256, 128, 16, 4),
}
RANK, MAX_RANK, SLOTS = 16, 64, 8  # adapters of rank 16 in slot buffers sized for rank 64


def timer(fn) -> Callable[[], float]:
    """A function that runs fn once and returns its seconds: a CUDA-graph replay of fn timed with events, or wall
    clock on CPU (fn runs once here first: compiles, allocates)."""
    fn()
    if not torch.cuda.is_available():
        def wall() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return wall
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay() -> float:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return replay


def measure(fn, reps: int = 20) -> float:
    """Median seconds per call of fn (timer's)."""
    once = timer(fn)
    return statistics.median(once() for _ in range(reps if torch.cuda.is_available() else max(3, reps // 5)))


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device copy, counting bytes read plus bytes written: the best of torch's
    copy and a plain Triton copy over 0.5 and 2 GiB."""
    return max(_copy_rate(n, device) for n in ((1 << 29, 1 << 31) if device == "cuda" else (1 << 26,)))


def _copy_rate(n: int, device) -> float:
    """copy_bandwidth over n bytes (its buffers freed on return, before the next size's)."""
    src, dst = torch.randn(n // 4, device=device), torch.empty(n // 4, device=device)
    best = 2 * n / measure(lambda: dst.copy_(src), reps=50)
    if device == "cuda":
        grid = (triton.cdiv(n // 4, 4096),)
        best = max(best, 2 * n / measure(lambda: _copy_kernel[grid](src, dst, n // 4, BLOCK=4096), reps=50))
    return best


def matmul_rate(device, dtype) -> float:
    n = 8192 if device == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / measure(lambda: a @ b, reps=10)


def machine() -> tuple[str, torch.dtype, str, float, float]:
    """(device, dtype, device name, matmul FLOP/s, copy bytes/s): bf16 on a GPU, else fp32 on the CPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (torch path)"
    mm = matmul_rate(device, dtype)  # first: it also brings the clocks up before the copy is timed
    return device, dtype, name, mm, copy_bandwidth(device)


def layer_copies(shape, dtype, device) -> int:
    """Copies of a layer to cycle through: about 4 GB of expert weights, so they come from HBM, not L2 (one on CPU)."""
    per_layer = 3 * shape[0] * shape[1] * shape[2] * dtype.itemsize
    return 1 if device == "cpu" else max(2, min(4, int(4e9 // per_layer)))


class Layers:
    """Several copies of one MoE layer (router, experts, LoRA slots) so that timed loops stream
    weights from memory as a real model does."""

    def __init__(self, shape, copies, dtype, device):
        hidden, inter, experts, top_k = shape
        self.hidden, self.inter, self.experts, self.top_k = shape
        self.router = [torch.randn(experts, hidden, device=device, dtype=dtype) / hidden**0.5 for _ in range(copies)]
        self.w = [random_moe_weights(experts, hidden, inter, dtype, device) for _ in range(copies)]
        self.lora = [random_expert_lora(SLOTS, experts, hidden, inter, [RANK] * SLOTS, dtype, device, max_rank=MAX_RANK)
                     for _ in range(copies)]
        self.topk_config = TopKConfig(top_k=top_k, renormalize=True)

    def moe(self, x, topk, slots, with_lora, config=None):
        for (w13, w2), lora in zip(self.w, self.lora):
            fused_moe(x, w13, w2, topk, lora if with_lora else None, slots, config=config)

    def block(self, x, slots, with_lora):
        for router, (w13, w2), lora in zip(self.router, self.w, self.lora):
            topk = select_experts(x @ router.T, self.topk_config)
            fused_moe(x, w13, w2, topk, lora if with_lora else None, slots)


def measure_pair(fn_a, fn_b, reps: int = 20) -> tuple[float, float]:
    """Seconds per call of fn_a, and of fn_b as fn_a's plus the median difference of the two, timed in
    alternation (a, b, b, a, a, b, ...): the GPU's clocks drift over a run, by several % under a large layer's power
    draw, which moves two medians timed one after the other by more than a small difference, but a pair of
    neighbouring calls alike."""
    once_a, once_b = timer(fn_a), timer(fn_b)
    pairs = []
    for i in range(reps if torch.cuda.is_available() else max(3, reps // 5)):
        if i % 2:  # b first every other pair: whatever the order does cancels
            t_b = once_b()
            pairs.append((once_a(), t_b))
        else:
            pairs.append((once_a(), once_b()))
    t_a = statistics.median(a for a, _ in pairs)
    return t_a, t_a + statistics.median(b - a for a, b in pairs)


def bench_point(layers: Layers, tokens, n_adapters, device, dtype, bw, config=None):
    x = torch.randn(tokens, layers.hidden, device=device, dtype=dtype)
    topk = select_experts(x @ layers.router[0].T, layers.topk_config)
    slots = (torch.arange(tokens, device=device) % n_adapters).to(torch.int32)
    copies = len(layers.w)
    t_base, t_lora = (t / copies for t in measure_pair(lambda: layers.moe(x, topk, slots, False, config),
                                                       lambda: layers.moe(x, topk, slots, True, config)))
    h, i = layers.hidden, layers.inter
    experts_touched = topk.ids.unique().numel()
    pairs = torch.unique(slots.long().repeat_interleave(layers.top_k) * layers.experts + topk.ids.flatten().long()).numel()
    base_floor = experts_touched * 3 * h * i * dtype.itemsize / bw
    lora_floor = pairs * 3 * RANK * (h + i) * dtype.itemsize / bw  # A and B of gate, up, down at the real rank
    return dict(x=x, topk=topk, slots=slots, t_base=t_base, t_lora=t_lora, base_floor=base_floor,
                lora_floor=lora_floor, pairs=pairs)


def check_once(layers: Layers, device, dtype):
    """The benchmarked path must agree with the torch reference before its time means anything."""
    x = torch.randn(33, layers.hidden, device=device, dtype=dtype)
    topk = select_experts(x @ layers.router[0].T, layers.topk_config)
    slots = (torch.arange(33, device=device) % (SLOTS + 1) - 1).to(torch.int32)
    (w13, w2), lora = layers.w[0], layers.lora[0]
    got = fused_moe(x, w13, w2, topk, lora, slots)
    ref = fused_moe(x, w13, w2, topk, lora, slots, impl="torch")
    assert_rows_close(got, ref, rel_tolerance(dtype, device), "benchmark check")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v2-lite")
    p.add_argument("--tokens", default="1,8,32,128,512,4096")
    p.add_argument("--adapters", default="1,4,8")
    p.add_argument("--sweep-tokens", default="", help="T values at which to also time other tile configs (tuning aid)")
    p.add_argument("--rank-cases", action="store_true",
                   help="instead: the LoRA delta of 8 adapters of mixed ranks and coverage in rank-64 slot buffers")
    p.add_argument("--pairs", type=int, default=20,
                   help="--rank-cases: alternating (base, LoRA) replays per delta; more narrows its spread")
    args = p.parse_args()
    device, dtype, name, mm, bw = machine()
    torch.manual_seed(0)
    if args.rank_cases:
        return rank_cases(args, device, dtype, name, bw)
    print(f"# moelora MoE kernel benchmark, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}")
    print(f"measured copy bandwidth {bw / 1e12:.2f} TB/s (read+write), {dtype} matmul {mm / 1e12:.0f} TFLOP/s, "
          f"rank {RANK}, tokens assigned to adapters round-robin\n")
    print("| shape | T | adapters | base us | base % of BW floor | LoRA delta us | LoRA floor us | LoRA % of floor "
          "| block LoRA/base | base TFLOP/s (% matmul) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape_name in args.shapes.split(","):
        bench_shape(args, shape_name, device, dtype, mm, bw)
        if device == "cuda":
            torch.cuda.empty_cache()  # the shape's layers went with bench_shape's frame


def bench_shape(args, shape_name: str, device, dtype, mm: float, bw: float) -> None:
    """main's table rows of one shape."""
    shape = SHAPES[shape_name]
    copies = layer_copies(shape, dtype, device)
    layers = Layers(shape, copies, dtype, device)
    check_once(layers, device, dtype)
    for tokens in map(int, args.tokens.split(",")):
        for n in map(int, args.adapters.split(",")):
            r = bench_point(layers, tokens, n, device, dtype, bw)
            t_block_base, t_block_lora = measure_pair(lambda: layers.block(r["x"], r["slots"], False),
                                                      lambda: layers.block(r["x"], r["slots"], True))
            delta = r["t_lora"] - r["t_base"]
            share = f"{100 * r['lora_floor'] / delta:.0f}%" if delta > 0 else "n/a (below noise)"
            flops = 2 * 3 * shape[0] * shape[1] * int(((r["topk"].ids >= 0)).sum())
            tf = f"{flops / r['t_base'] / 1e12:.0f} ({100 * flops / r['t_base'] / mm:.0f}%)" if tokens >= 512 else ""
            print(f"| {shape_name} | {tokens} | {n} | {r['t_base'] * 1e6:.1f} | {100 * r['base_floor'] / r['t_base']:.0f}% "
                  f"| {delta * 1e6:.1f} | {r['lora_floor'] * 1e6:.1f} | {share} "
                  f"| {t_block_lora / t_block_base:.3f} | {tf} |", flush=True)
            if str(tokens) in args.sweep_tokens.split(",") and n == max(map(int, args.adapters.split(","))):
                sweep(layers, tokens, n, device, dtype, bw)


MIXED_CASE = "ranks 8,8,16,16,16,32,64,64"
# name -> (rank of each of the 8 slots, share of experts each adapter covers, whether the share is drawn per expert
# (all three projections) rather than per projection, whether every token uses slot 0)
RANK_CASES = {
    "rank 16": ([16] * SLOTS, 1.0, True, False),
    "rank 64": ([64] * SLOTS, 1.0, True, False),
    MIXED_CASE: ([8, 8, 16, 16, 16, 32, 64, 64], 1.0, True, False),
    "rank 16 on 25% of experts": ([16] * SLOTS, 0.25, True, False),
    # each projection's 25% drawn on its own: 44% of the (slot, expert) pairs have gate or up LoRA
    "rank 16 on 25% of each projection's experts": ([16] * SLOTS, 0.25, False, False),
    # attention-only adapters (PEFT's default targets): what the experts' LoRA path costs with no LoRA work
    "rank 16 on no expert": ([16] * SLOTS, 0.0, True, False),
    "rank-8 tokens, rank 64 resident": ([8] + [64] * (SLOTS - 1), 1.0, True, True),
    "rank-8 tokens, rank 8 resident": ([8] * SLOTS, 1.0, True, True),
}


def rank_cases(args, device, dtype, name, bw) -> None:
    """The LoRA delta (layer with LoRA minus without) when the adapters' real ranks and coverage differ from
    the slot buffers' rank (64, the kernels' rank tile): the cost should follow the ranks the tokens use."""
    print(f"# moelora MoE LoRA cost by rank, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}")
    print(f"measured copy bandwidth {bw / 1e12:.2f} TB/s; {SLOTS} adapters in slot buffers of rank {MAX_RANK}, "
          "tokens round-robin over them unless the case says otherwise\n")
    print("| shape | T | case | base us (LoRA tiles) | LoRA delta us | LoRA floor us | covered pairs, each copy |")
    print("|---|---|---|---|---|---|---|")
    deltas = {}
    for shape_name in args.shapes.split(","):
        deltas[shape_name] = rank_cases_of_shape(args, shape_name, device, dtype, bw)
        if device == "cuda":
            torch.cuda.empty_cache()  # the shape's layers went with the call's frame
    mixed = RANK_CASES[MIXED_CASE][0]
    weight = (statistics.mean(mixed) - 16) / (64 - 16)
    print(f"\nIssue 21's ratios (rank-weighted mean: rank 16 + {weight:.2f} x (rank 64 - rank 16), the mixed pool's "
          f"mean rank being {statistics.mean(mixed):g})\n")
    print("| shape | T | mixed / rank-weighted mean (<= 1.15) | 25% / full (<= 0.40) "
          "| rank-8 tokens beside rank 64 / rank-8 pool (within 10%) |")
    print("|---|---|---|---|---|")
    for shape_name, by_case in deltas.items():
        for tokens in map(int, args.tokens.split(",")):
            d = {case: by_case[case, tokens] for case in RANK_CASES}
            mean = d["rank 16"] + weight * (d["rank 64"] - d["rank 16"])
            print(f"| {shape_name} | {tokens} | {_ratio(d[MIXED_CASE], mean)} "
                  f"| {_ratio(d['rank 16 on 25% of experts'], d['rank 16'])} "
                  f"| {_ratio(d['rank-8 tokens, rank 64 resident'], d['rank-8 tokens, rank 8 resident'])} |")


def _ratio(a: float, b: float) -> str:
    return f"{a:.1f} / {b:.1f} = {a / b:.2f}" if b > 0 else f"{a:.1f} / {b:.1f}"


def rank_cases_of_shape(args, shape_name: str, device, dtype, bw: float) -> dict[tuple[str, int], float]:
    """rank_cases' rows of one shape; returns the LoRA delta in us by (case, T)."""
    hidden, inter, experts, _ = shape = SHAPES[shape_name]
    torch.manual_seed(0)  # the same weights, tokens and coverage in every run: runs (and A/Bs) differ by timing alone
    copies = layer_copies(shape, dtype, device)
    layers = Layers(shape, copies, dtype, device)
    # the same tokens, so the same routing, in every case: the cases' ratios compare their LoRA work alone
    inputs = {tokens: torch.randn(tokens, hidden, device=device, dtype=dtype)
              for tokens in map(int, args.tokens.split(","))}
    deltas = {}
    for case, (slot_ranks, coverage, whole_experts, first_slot_only) in RANK_CASES.items():
        layers.lora = [random_expert_lora(SLOTS, experts, hidden, inter, slot_ranks, dtype, device,
                                          coverage=coverage, max_rank=MAX_RANK, whole_experts=whole_experts)
                       for _ in range(copies)]
        # the bound the engine runs such a step with (LoRAManager.prepare): from the ranks of the slots it uses
        batch_rank = slot_ranks[0] if first_slot_only else max(slot_ranks)
        for lora in layers.lora:
            lora.max_rank_in_use = step_rank_bound(batch_rank, MAX_RANK)
        for tokens, x in inputs.items():
            topk = select_experts(x @ layers.router[0].T, layers.topk_config)
            slots = torch.zeros(tokens, dtype=torch.int32, device=device) if first_slot_only else \
                (torch.arange(tokens, device=device) % SLOTS).to(torch.int32)
            # both on the LoRA tile table: the delta is the LoRA work, not also the base table's other tiles
            cfg = default_config(tokens, layers.top_k, experts, dtype, lora=True)
            t_base, t_lora = (t / copies for t in measure_pair(lambda: layers.moe(x, topk, slots, False, cfg),
                                                               lambda: layers.moe(x, topk, slots, True, cfg),
                                                               args.pairs))
            pairs = torch.unique(slots.long().repeat_interleave(layers.top_k) * experts + topk.ids.flatten().long())
            # each copy draws its own coverage, as a model's layers do: the floor is the copies' mean. At a few
            # tokens a covered pair's LoRA is a chain of round trips, whether one pair of a token is covered or all:
            # the delta then follows the copies with any covered pair
            touched = [lora.ranks.long()[:, pairs // experts, pairs % experts] for lora in layers.lora]  # [3, pairs]
            floor = statistics.mean(r.sum().item() for r in touched) * (hidden + inter) * dtype.itemsize / bw
            covered = ", ".join(str(int((r.amax(0) > 0).sum())) for r in touched)
            deltas[case, tokens] = (t_lora - t_base) * 1e6
            print(f"| {shape_name} | {tokens} | {case} | {t_base * 1e6:.1f} | {deltas[case, tokens]:.1f} "
                  f"| {floor * 1e6:.1f} | {covered} |", flush=True)
    return deltas


def sweep_configs(tokens: int) -> list[MoEKernelConfig]:
    """The tiles sweep times at T tokens: pair blocks (a block per (token, expert) pair) up to
    PAIR_BLOCKS_MAX_TOKENS, with and without the register cap; else aligned blocks (block 128 with half tiles),
    with and without the copy engine. block_k stays fixed: it sets the order of a row's sums, so changing it would
    make results depend on the batch size."""
    k = 64
    if tokens <= PAIR_BLOCKS_MAX_TOKENS:  # gate_up tiles of 64 or 128 columns hold the down shrink's parts
        return [MoEKernelConfig(16, bn1, bn2, k, 8, w, s, pair_blocks=True, max_registers=cap, tma=False)
                for bn1 in (64, 128) for bn2 in (32, 64, 128) for w in (2, 4) for s in (4, 6) for cap in (None, 128)]
    return [MoEKernelConfig(bm, bn1, bn2, k, g, w, s, half_tiles=bm == 128, tma=tma)
            for bm in (32, 64, 128) for bn1 in (64, 128) for bn2 in (128, 256)
            for g, w, s in ((8, 4, 3), (8, 4, 4), (8, 8, 3), (8, 8, 4)) for tma in (False, True)]


def sweep(layers, tokens, n, device, dtype, bw):
    """Other tiles at one batch size (sweep_configs), base and with LoRA."""
    for cfg in sweep_configs(tokens):
        try:
            r = bench_point(layers, tokens, n, device, dtype, bw, cfg)
        except Exception as exc:  # out of shared memory etc.
            print(f"  sweep T={tokens} {cfg}: failed {type(exc).__name__}")
            continue
        print(f"  sweep T={tokens} n={n} {cfg}: base {r['t_base'] * 1e6:.1f} us ({100 * r['base_floor'] / r['t_base']:.0f}%), "
              f"lora {r['t_lora'] * 1e6:.1f} us", flush=True)


if __name__ == "__main__":
    main()
