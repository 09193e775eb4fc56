"""Serving more adapters than GPU slots (not a test): what moving adapters between host memory and the slots costs
the requests running beside them, on a dummy-weight model of Qwen3-30B-A3B's sizes with rank-16 adapters on
q/k/v/o and every routed expert (about 1.7 GB each in bf16).

A closed loop through Engine.step: --concurrency requests in flight, a new one as soon as one finishes, --requests in
all (--prompt-len random tokens, --decode-tokens greedy tokens, ignore_eos), request i naming adapter i % N. Three
engines of --slots GPU slots, one after the other in one run:
  resident    N = --slots: every adapter stays in its slot (the baseline)
  swapped     N = --adapters: adapters move in and out of the slots, their copies queued between two steps
  overlapped  the same with --enable-lora-overlap-loading: the copies on a stream of their own beside the steps
  disk        overlapped with host memory for --slots adapters (--max-cpu-loras): adapters are read back from disk,
              in a thread of their own beside the steps
Each engine runs the loop once to warm up (kernels, graphs, adapters in host memory), then once timed: seconds,
tokens/s, slot loads, steps and decode rows per step (how full the batches were: where requests wait for a slot, the
batch thins), and tokens/s against resident's. Last, one adapter's move into a slot timed alone on the
overlapped engine: the host's seconds (from its staged host copy, and from a pageable copy of it) and the device's,
and its bytes over the host-to-device bandwidth measured from page-locked memory.

    python3 benchmarks/bench_lora_swap.py            # three engine starts and loops; minutes on an H200
    python3 benchmarks/bench_lora_swap.py --tiny     # a tiny model of the same kind in seconds (CPU test)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import torch
import triton
from bench_moe import machine
from bench_serving import RANK, free_memory, synchronize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora import Engine, SamplingParams  # noqa: E402
from moelora.engine.lora_slots import RankShare, write_share_to_slot  # noqa: E402
from tests.support import qwen3_30b_a3b_config, write_dummy_checkpoint, write_random_peft_adapter  # noqa: E402

MODES = ("resident", "swapped", "overlapped", "disk")


def serve(engine: Engine, names: list[str], args, requests: int, vocab: int) -> tuple[float, int]:
    """The closed loop (see the module docstring): its seconds and the tokens it made."""
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(requests)
    queue = deque(range(requests))
    live = tokens = 0
    synchronize(engine.config.device)
    t0 = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and live < args.concurrency:
            i = queue.popleft()
            engine.add_request(torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist(), params,
                               lora=names[i % len(names)], detokenize=False)
            live += 1
        for out in engine.step():
            tokens += len(out.token_ids)
            live -= out.finished
    synchronize(engine.config.device)
    return time.perf_counter() - t0, tokens


def h2d_bandwidth(device: str) -> float:
    """Bytes/s of a 1 GiB copy from page-locked host memory to the device (the least time of 5)."""
    if device != "cuda":
        return float("nan")
    src, dst = torch.empty(2**30, dtype=torch.uint8, pin_memory=True), torch.empty(2**30, dtype=torch.uint8,
                                                                                  device=device)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2**30 / best


def pageable(share: RankShare) -> RankShare:
    """The share in ordinary (pageable) host memory, as the host copies were before they were staged."""
    def copy(lora):
        return dataclasses.replace(lora, **{f: getattr(lora, f).clone() for f in ("a", "b")})
    return dataclasses.replace(share, layers={i: dataclasses.replace(
        layer, experts={n: copy(e) for n, e in layer.experts.items()},
        modules={n: copy(m) for n, m in layer.modules.items()}) for i, layer in share.layers.items()})


def time_one_move(engine: Engine, name: str, bandwidth: float) -> None:
    """One adapter into a slot no running request uses, with the device idle: host and device seconds."""
    lora, device = engine.runner.lora, engine.config.device
    slot = lora.pool.peek(name) if lora.pool.peek(name) is not None else lora.prepare([name], in_use=set())[0]
    share = lora._host_copy(name)
    for what, host_copy in (("staged", share), ("pageable", pageable(share))):
        synchronize(device)
        t0 = time.perf_counter()
        write_share_to_slot(engine.runner.model, host_copy, slot)
        host = time.perf_counter() - t0
        synchronize(device)
        total = time.perf_counter() - t0
        print(f"| one move, {what} host copy | {share.num_bytes() / 2**30:.2f} GiB | host {1e3 * host:.1f} ms | "
              f"done after {1e3 * total:.1f} ms | floor {1e3 * share.num_bytes() / bandwidth:.1f} ms |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same kind and a small workload")
    p.add_argument("--adapters", type=int, default=8, help="adapters the requests name in swapped and overlapped")
    p.add_argument("--slots", type=int, default=4, help="GPU slots (max_loras_per_batch); resident's adapters")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=None, help="requests in the timed loop (default 128; tiny 16)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128; tiny 8")
    p.add_argument("--decode-tokens", type=int, default=None, help="default 64; tiny 4")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workdir", type=Path, default=None, help="where the config and adapters go (default: a temp dir)")
    args = p.parse_args()
    for name, (tiny, full) in dict(requests=(16, 128), prompt_len=(8, 128), decode_tokens=(4, 64)).items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if not 1 <= args.slots < args.adapters:
        p.error("--slots must be at least 1 and fewer than --adapters")
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--modes: of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        bench(args, modes, args.workdir or Path(tmp))


def bench(args, modes: list[str], workdir: Path) -> None:
    device, dtype, name, _, _ = machine()
    config = qwen3_30b_a3b_config(tiny=args.tiny)
    model_dir = write_dummy_checkpoint(config, workdir / "model")
    adapters = {f"a{i}": write_random_peft_adapter(config, workdir / f"a{i}", RANK, seed=i, device=device)
                for i in range(args.adapters)}
    bandwidth = h2d_bandwidth(device)
    print(f"# moelora adapter swap benchmark, {name}, {datetime.date.today()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, {dtype}; {'tiny Qwen3-MoE' if args.tiny else 'Qwen3-30B-A3B'} sizes, dummy weights, "
          f"rank-{RANK} adapters on q/k/v/o and every routed expert; host-to-device {bandwidth / 1e9:.1f} GB/s "
          f"(page-locked)")
    print(f"{args.slots} slots, {args.concurrency} requests in flight, {args.requests} requests of {args.prompt_len} "
          f"prompt tokens and {args.decode_tokens} greedy tokens\n")
    print("| engine | adapters | s | tokens/s | slot loads | disk reads | steps | decode rows / step | tokens/s / "
          "resident's |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    resident = None
    for mode in modes:
        names = list(adapters)[:args.slots if mode == "resident" else args.adapters]
        engine = Engine(str(model_dir), lora_paths={n: str(adapters[n]) for n in names}, load_format="dummy",
                        device=device, dtype=str(dtype).removeprefix("torch."), max_loras_per_batch=args.slots,
                        max_lora_rank=RANK, cuda_graph_max_bs=args.concurrency, enable_prefix_caching=False,
                        enable_lora_overlap_loading=mode in ("overlapped", "disk"),
                        max_cpu_loras=args.slots if mode == "disk" else None)
        serve(engine, names, args, args.requests, config.vocab_size)  # warm-up
        lora_stats, stats = engine.runner.lora.stats, engine.step_stats
        loads, reads = lora_stats.slot_loads, lora_stats.disk_loads
        steps, rows, decode_steps = stats.steps, stats.decode_rows, stats.decode_steps + stats.mixed_steps
        seconds, tokens = serve(engine, names, args, args.requests, config.vocab_size)
        rate = tokens / seconds
        resident = rate if mode == "resident" else resident
        ratio = f"{rate / resident:.2f}" if resident else ""
        rows_per_step = (stats.decode_rows - rows) / max(stats.decode_steps + stats.mixed_steps - decode_steps, 1)
        print(f"| {mode} | {len(names)} | {seconds:.2f} | {rate:.0f} | {lora_stats.slot_loads - loads} | "
              f"{lora_stats.disk_loads - reads} | {stats.steps - steps} | {rows_per_step:.1f} | {ratio} |", flush=True)
        if mode == modes[-1]:
            print()
            time_one_move(engine, names[-1], bandwidth)
        engine.shutdown()
        del engine
        gc.collect()
        free_memory(device)


if __name__ == "__main__":
    main()
