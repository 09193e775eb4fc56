"""Where a step's time goes (a profile, not a test): the engine of bench_serving.py (dummy Qwen3-30B-A3B,
rank-16 adapters on q/k/v/o and every expert) decodes or prefills with the torch profiler on, and the kernels of
the steps are summed by name: kernels per step, GPU-busy microseconds per step against the step's wall time, and
the kernels that take the most time, for each (batch, adapters) case side by side.

Decode steps = profile(generate N tokens) - profile(generate 1 token), so the prefill cancels as in bench_serving.py.
Steps run as they serve: from the decode CUDA graphs (the profiler sees the kernels inside a graph replay), or
eagerly with --eager. With --prefill PxL the step is one call that prefills P prompts of L tokens and samples one
token each (bench_serving.py's prefill), and --batch-sizes is not used.

    python3 benchmarks/profile_step.py --batch-sizes 1,32 --adapters 0,1
    python3 benchmarks/profile_step.py --prefill 8x1024 --adapters 0,8
    python3 benchmarks/profile_step.py --tiny          # a tiny model of the same kind (CPU)
"""
from __future__ import annotations

import argparse
import collections
import datetime
import re
import tempfile
from pathlib import Path

import torch
from bench_moe import machine
from bench_serving import RANK, Ours, Workload, synchronize, timed
from torch.profiler import ProfilerActivity, profile

from tests.support import qwen3_30b_a3b_config, write_dummy_checkpoint, write_random_peft_adapter


def kernel_times(fn, device: str) -> tuple[collections.Counter, collections.Counter]:
    """(count, device us) of the kernels `fn` ran, each a Counter keyed by the short kernel name (CPU: aten ops)."""
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        synchronize(device)
    counts, micros = collections.Counter(), collections.Counter()
    for e in prof.events():
        if device == "cuda" and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device == "cpu" and not e.name.startswith("aten::"):
            continue
        name = short(e.name)
        counts[name] += 1
        micros[name] += e.device_time if device == "cuda" else e.cpu_time
    return counts, micros


def short(name: str) -> str:
    """A kernel's name without template arguments and parameter lists, so one kernel is one row."""
    name = re.sub(r"<.*>", "", name.split("(")[0]).strip()
    return name.removeprefix("void ")[:70]


def profile_case(ours: Ours, w: Workload, vocab: int, device: str) -> dict:
    prompts, names = w.prompts(vocab), w.names()
    ours.generate(prompts, names, 2)  # warm-up
    steps = w.new_tokens - 1
    # best of three for each, so a busy host's stall in one run does not make the difference meaningless
    first = min(timed(lambda: ours.generate(prompts, names, 1), device) for _ in range(3))
    if w.phase == "prefill":
        counts, micros = kernel_times(lambda: ours.generate(prompts, names, 1), device)
        return dict(wall_us=first * 1e6, counts=dict(counts), micros=dict(micros))
    full = min(timed(lambda: ours.generate(prompts, names, w.new_tokens), device) for _ in range(3))
    wall_us = (full - first) * 1e6 / steps
    one_count, one_us = kernel_times(lambda: ours.generate(prompts, names, 1), device)
    all_count, all_us = kernel_times(lambda: ours.generate(prompts, names, w.new_tokens), device)
    counts = {k: (all_count[k] - one_count[k]) / steps for k in all_count}
    micros = {k: (all_us[k] - one_us[k]) / steps for k in all_us}
    return dict(wall_us=wall_us, counts=counts, micros=micros)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--adapters", default="0,1", help="distinct adapters per batch (0: LoRA off)")
    p.add_argument("--decode-tokens", type=int, default=17)
    p.add_argument("--prefill", default=None, help="PxL: profile the prefill of P prompts of L tokens instead")
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--top", type=int, default=25, help="kernels listed per case")
    args = p.parse_args()
    device, dtype, name, _, _ = machine()
    config = qwen3_30b_a3b_config(tiny=args.tiny)
    batches, adapter_counts = [list(map(int, s.split(","))) for s in (args.batch_sizes, args.adapters)]
    if args.prefill:
        prompt_count, prompt_len = map(int, args.prefill.split("x"))
        workloads = {(prompt_count, n): Workload("prefill", prompt_count, n, prompt_len, 1) for n in adapter_counts}
        batches = [prompt_count]
    else:
        workloads = {(b, n): Workload("decode", b, n, 128, args.decode_tokens) for b in batches for n in adapter_counts}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_dummy_checkpoint(config, Path(tmp) / "model")
        adapters = {f"a{i}": write_random_peft_adapter(config, Path(tmp) / f"a{i}", RANK, seed=i, device=device)
                    for i in range(max(adapter_counts))}
        # no start-time prompt steps: profile_case warms each case up (and compiles its kernels) itself
        ours = Ours(model_dir, adapters, device, dtype, max(batches), disable_cuda_graph=args.eager,
                    skip_server_warmup=True)
        cases = {key: profile_case(ours, w, config.vocab_size, device)
                 for key, w in workloads.items() if w.adapters <= w.batch}
    phase = f"prefill {args.prefill}" if args.prefill else "decode"
    print(f"# {phase} step profile, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}, "
          f"{'eager' if args.eager else 'CUDA graphs'}, {'tiny' if args.tiny else 'Qwen3-30B-A3B'} dummy, rank {RANK}\n")
    print("| batch | adapters | wall us/step | GPU-busy us/step | busy / wall | kernels/step |")
    print("|---|---|---|---|---|---|")
    for (b, n), c in cases.items():
        busy = sum(c["micros"].values())
        print(f"| {b} | {n} | {c['wall_us']:.0f} | {busy:.0f} | {busy / c['wall_us']:.2f} | "
              f"{sum(c['counts'].values()):.0f} |")
    keys = list(cases)
    top = sorted({k for c in cases.values() for k in sorted(c["micros"], key=c["micros"].get, reverse=True)[:args.top]},
                 key=lambda k: -max(c["micros"].get(k, 0) for c in cases.values()))
    print("\nus per step (kernels per step) by kernel:\n")
    print("| kernel | " + " | ".join(f"b{b} a{n}" for b, n in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for k in top:
        cells = [f"{cases[key]['micros'].get(k, 0):.1f} ({cases[key]['counts'].get(k, 0):.0f})" for key in keys]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
