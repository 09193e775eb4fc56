"""Prompt-step benchmark (not a test): one prompt step of S prompts of L tokens on the engine of bench_serving.py
(dummy Qwen3-30B-A3B, rank-16 adapters on q/k/v/o and every expert), run eagerly and replayed from the prompt CUDA
graphs (moelora/engine/cuda_graph.py), without and with an adapter: the host time to queue it, its wall time, and
whether both give the same logits bits. Medians of 10 runs after 3 warm-up runs.

    python3 benchmarks/bench_prompt_step.py                          # on a GPU
    python3 benchmarks/bench_prompt_step.py --steps 1x128,32x128     # S x L
    python3 benchmarks/bench_prompt_step.py --tiny                   # a tiny model on the CPU, eager only
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_moe import machine
from bench_serving import RANK, Ours, synchronize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora.core import ForwardBatch
from tests.support import qwen3_30b_a3b_config, write_dummy_checkpoint, write_random_peft_adapter


def timed(fn: Callable[[], torch.Tensor], device: str) -> tuple[float, float, torch.Tensor]:
    """Median (host ms, wall ms) of fn, and its last output."""
    for _ in range(3):
        fn()
    synchronize(device)
    hosts, walls = [], []
    for _ in range(10):
        start = time.perf_counter()
        out = fn()
        queued = time.perf_counter()
        synchronize(device)
        hosts.append(queued - start)
        walls.append(time.perf_counter() - start)
    return 1e3 * statistics.median(hosts), 1e3 * statistics.median(walls), out.clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3-MoE on the CPU (eager only)")
    p.add_argument("--steps", default=None, help="SxL prompt steps (default 1x128,4x128,1x512,8x128,1x1024,16x128,"
                                                   "32x128,4x1024,8x1024; tiny 1x8,2x16)")
    args = p.parse_args()
    device, dtype, name, _, _ = machine()
    if args.tiny:
        device, dtype, name = "cpu", torch.float32, "CPU"
    steps = [tuple(map(int, s.split("x"))) for s in (args.steps or ("1x8,2x16" if args.tiny else
             "1x128,4x128,1x512,8x128,1x1024,16x128,32x128,4x1024,8x1024")).split(",")]
    config = qwen3_30b_a3b_config(tiny=args.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_dummy_checkpoint(config, Path(tmp) / "model")
        adapter = {"a0": write_random_peft_adapter(config, Path(tmp) / "a0", RANK, seed=0, device=device)}
        # prompt graphs up to the largest step measured, whatever the engine's default
        runner = Ours(model_dir, adapter, device, dtype, 32,
                      cuda_graph_max_prefill_tokens=max(seqs * each for seqs, each in steps)).engine.runner
        graphs = runner.prompt_graphs
        print(f"# prompt-step benchmark, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}; "
              f"{'tiny Qwen3-MoE' if args.tiny else 'Qwen3-30B-A3B'} dummy weights, adapter rank {RANK}; prompt graphs "
              f"{graphs.sizes if graphs is not None else 'off'}\n")
        print("| prompts x tokens | adapter | eager host ms | eager wall ms | graph (padded to) | graph host ms "
              "| graph wall ms | bitwise |")
        print("|---|---|---|---|---|---|---|---|", flush=True)
        for seqs, each in steps:
            tokens = seqs * each
            for slot in (-1, 0):
                def build(seqs: int = seqs, each: int = each, tokens: int = tokens, slot: int = slot) -> ForwardBatch:
                    return ForwardBatch.build(runner.kv, list(range(1, seqs + 1)), [[1] * each] * seqs, [0] * seqs,
                                              torch.arange(1, tokens + 1), [each * (i + 1) - 1 for i in range(seqs)],
                                              [slot] * tokens, 0)
                with torch.inference_mode():
                    eager_host, eager_wall, eager = timed(lambda: runner.logits(build()), device)
                    size = graphs.size(build()) if graphs is not None else None
                    row = f"| {seqs} x {each} | {'yes' if slot >= 0 else 'no'} | {eager_host:.1f} | {eager_wall:.1f} "
                    if size is None:
                        print(row + "| eager | | | |", flush=True)
                        continue
                    host, wall, graphed = timed(lambda: graphs.replay(build(), size), device)
                print(row + f"| {size} | {host:.2f} | {wall:.1f} | {torch.equal(eager, graphed)} |", flush=True)


if __name__ == "__main__":
    main()
