"""Scaling benchmark (not a test): decode and prefill tokens/s of our engine over tp ranks with the experts in
ep groups, LoRA off, one adapter, or 8 (rank 16 on attention and every routed expert), on dummy weights of
Qwen3-30B-A3B's sizes or DeepSeek-V3's with fewer layers. Workloads as bench_serving.py's. Prefill: the whole call
after a warm-up, the least of 3. Decode: the least of 3 medians of a step of decode rows only, the requests run
through Engine.step (bench_serving's run). Layouts that need more GPUs than the machine has are skipped; on a
CPU (--tiny) every layout runs, as CPU processes with gloo.

    python3 benchmarks/bench_tp.py                                   # Qwen3-30B-A3B, tp 1/2/4 x ep 1/2/4
    python3 benchmarks/bench_tp.py --model deepseek-v3 --layers 4    # DeepSeek-V3-shaped, 4 layers
    python3 benchmarks/bench_tp.py --dispatch all_to_all             # experts reached by all-to-all
    python3 benchmarks/bench_tp.py --tiny --layouts 1x1,2x2          # tiny model on the CPU, in seconds
"""
from __future__ import annotations

import argparse
import datetime
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_moe import machine
from bench_serving import RANK, Ours, run, workloads

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora.engine.profiler import rank_of, read_summary
from tests.support import deepseek_v3_config, qwen3_30b_a3b_config, write_dummy_checkpoint, write_random_peft_adapter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["qwen3-30b-a3b", "deepseek-v3"], default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4, help="DeepSeek-V3's decoder layers (default 4, the first dense)")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3-MoE and a small workload")
    p.add_argument("--layouts", default="1x1,2x1,2x2,4x1,4x2,4x4", help="TPxEP pairs")
    p.add_argument("--dispatch", default="all_reduce", choices=["all_reduce", "all_to_all"])
    p.add_argument("--batch-sizes", default=None, help="decode batch sizes (default 1,32,128; tiny 1,8)")
    p.add_argument("--adapters", default="0,1,8", help="distinct adapters per batch (0: LoRA off)")
    p.add_argument("--prompt-len", type=int, default=None, help="decode prompts' length (default 128; tiny 16)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens each request makes (default 16; tiny 4)")
    p.add_argument("--prefill", default=None, help="PxL: P prompts of L tokens (default 8x1024; tiny 8x32)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="each layout's LoRA-off prefill call, and its decode steps at --profile-batch with each "
                        "adapter count, profiled on every rank (Engine.start_profile): the N kernels that take the "
                        "most time, collectives included")
    p.add_argument("--profile-batch", type=int, default=None, help="the decode batch profiled (default 32; tiny 8)")
    p.add_argument("--profile-dir", default=None, help="where the profiles' traces stay, a folder per layout "
                   "(default: the run's temporary folder, removed at its end)")
    args = p.parse_args()
    defaults = ("1,8", 16, 4, "8x32", 8) if args.tiny else ("1,32,128", 128, 16, "8x1024", 32)
    for name, value in zip(("batch_sizes", "prompt_len", "decode_tokens", "prefill", "profile_batch"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.profile and str(args.profile_batch) not in args.batch_sizes.split(","):
        p.error(f"--profile-batch {args.profile_batch} is not among --batch-sizes {args.batch_sizes}")
    with tempfile.TemporaryDirectory() as tmp:
        bench(args, Path(tmp))


def bench(args: argparse.Namespace, workdir: Path) -> None:
    device, dtype, name, matmul, bandwidth = machine()
    config = qwen3_30b_a3b_config(tiny=True) if args.tiny else \
        qwen3_30b_a3b_config() if args.model == "qwen3-30b-a3b" else deepseek_v3_config(args.layers)
    model_dir = write_dummy_checkpoint(config, workdir / "model")
    adapters = {f"a{i}": write_random_peft_adapter(config, workdir / f"a{i}", RANK, seed=i, device=device)
                for i in range(max(map(int, args.adapters.split(","))))}
    layouts = [tuple(map(int, layout.split("x"))) for layout in args.layouts.split(",")]
    gpus = torch.cuda.device_count() if device == "cuda" else None
    model = "tiny Qwen3-MoE" if args.tiny else args.model + (f" ({args.layers} layers)" if args.model == "deepseek-v3" else "")
    print(f"# moelora scaling benchmark, {name} x {gpus or 'CPU processes'}, {datetime.date.today()}, torch "
          f"{torch.__version__}, {dtype}; {model}, dummy weights; adapters rank {RANK}; {args.dispatch} dispatch")
    # machines of one kind differ (clocks, power caps): the first GPU's rates say what one rank ran at
    print(f"measured on the first {device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write), {dtype} matmul "
          f"{matmul / 1e12:.0f} TFLOP/s\n")
    print("| tp | ep | phase | batch | adapters | tokens | s | tokens/s | ms/step |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    measured: dict[tuple, float] = {}  # (tp, ep, phase, batch, adapters) -> tokens/s
    # (tp, ep, what ran) -> rank -> {kernel: [launches, us]}
    profiles: dict[tuple[int, int, str], dict[int, dict]] = {}
    starts: dict[tuple[int, int], dict[str, float]] = {}  # (tp, ep) -> seconds of each phase of rank 0's start
    for tp, ep in layouts:
        if gpus is not None and tp > gpus:
            print(f"| {tp} | {ep} | skipped: {gpus} GPUs | | | | | | |", flush=True)
            continue
        t0 = time.perf_counter()
        # no start-time prompt steps: `run` warms each workload up (and compiles its kernels) before timing it
        ours = Ours(model_dir, adapters, device, dtype, max(map(int, args.batch_sizes.split(","))), tp_size=tp,
                    ep_size=ep, moe_dispatch=args.dispatch, skip_server_warmup=True)
        print(f"| {tp} | {ep} | start | | | | {time.perf_counter() - t0:.1f} | | |", flush=True)
        starts[tp, ep] = ours.engine.start_seconds
        try:
            for w in workloads(args):
                r = run(ours.generate, w, config.vocab_size, device, ours)
                measured[tp, ep, w.phase, w.batch, w.adapters] = r.tokens / r.seconds
                print(f"| {tp} | {ep} | {w.phase} | {w.batch} | {w.adapters} | {r.tokens} | {r.seconds:.3f} "
                      f"| {r.tokens / r.seconds:.0f} | {1e3 * r.seconds / r.steps:.2f} |", flush=True)
                # after the workload's runs: its kernels are compiled by now
                prompts, names = w.prompts(config.vocab_size), w.names()
                where = str(Path(args.profile_dir or workdir) / f"profile-{tp}x{ep}")
                traces = None
                if args.profile and w.phase == "prefill" and w.adapters == 0:
                    what = "the LoRA-off prefill call"
                    ours.engine.start_profile(where)
                    ours.generate(prompts, names, 1)
                    traces = ours.engine.stop_profile()
                elif args.profile and w.phase == "decode" and w.batch == args.profile_batch:
                    lora = f"{w.adapters} adapter{'s' * (w.adapters > 1)}" if w.adapters else "LoRA off"
                    what = f"the decode steps at batch {w.batch}, {lora}"
                    traces = ours.profile_decode_steps(prompts, names, w.new_tokens, where)
                if traces:
                    profiles[tp, ep, what] = {rank_of(trace): read_summary(trace)["kernels"] for trace in traces}
        finally:
            ours.engine.shutdown()
        del ours
        if device == "cuda":
            gc.collect()  # reference cycles would keep this layout's engine, and its GPU memory, for the next one
            torch.cuda.empty_cache()
    print_summary(measured)
    if profiles:
        print_profiles(profiles, args.profile)
    print("\nEngine starts, rank 0 (on a cold Triton cache mostly compiles):\n\n| tp | ep | phase | s |\n|---|---|---|---|")
    for (tp, ep), phases in starts.items():
        for phase, seconds in phases.items():
            print(f"| {tp} | {ep} | {phase} | {seconds:.1f} |")


def print_summary(measured: dict[tuple, float]) -> None:
    """Per layout and workload: tokens/s with each adapter count over LoRA off (measured in this run), and LoRA
    off's tokens/s over one rank's (1x1, when it ran)."""
    counts = sorted({key[4] for key in measured if key[4]})
    print("\n| tp | ep | phase | batch | LoRA off tokens/s | x of 1x1 | "
          + " | ".join(f"{n} / off" for n in counts) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(counts))
    for tp, ep, phase, batch in sorted({key[:4] for key in measured}):
        off = measured.get((tp, ep, phase, batch, 0))
        one = measured.get((1, 1, phase, batch, 0))
        ratios = [measured.get((tp, ep, phase, batch, n)) for n in counts]
        print(f"| {tp} | {ep} | {phase} | {batch} | {f'{off:.0f}' if off else ''} | "
              f"{f'{off / one:.2f}' if off and one else ''} | "
              + " | ".join(f"{r / off:.2f}" if r and off else "" for r in ratios) + " |", flush=True)


def print_profiles(profiles: dict[tuple[int, int, str], dict[int, dict]], top: int) -> None:
    """Each rank's device time of each profiled run, per layout: in all and by kernel, the `top` busiest of any rank.
    A collective's kernel also holds its wait for the slowest rank; on the CPU the rows are host ops."""
    for (tp, ep, what), ranks in profiles.items():
        busiest = sorted({k for kernels in ranks.values() for k in list(kernels)[:top]},
                         key=lambda k: -max(kernels.get(k, [0, 0])[1] for kernels in ranks.values()))
        print(f"\nProfile of {what} at {tp}x{ep}, ms (launches) by kernel:\n")
        print("| kernel | " + " | ".join(f"rank {r}" for r in ranks) + " |")
        print("|---|" + "---|" * len(ranks))
        print("| all | " + " | ".join(f"{sum(us for _, us in kernels.values()) / 1e3:.1f} "
                                      f"({sum(n for n, _ in kernels.values()):.0f})" for kernels in ranks.values())
              + " |")
        for k in busiest:
            cells = [kernels.get(k, [0, 0]) for kernels in ranks.values()]
            print(f"| {k[:70]} | " + " | ".join(f"{us / 1e3:.1f} ({n:.0f})" for n, us in cells) + " |")

if __name__ == "__main__":
    main()
