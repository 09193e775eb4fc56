"""Prefix caching benchmark (not a test): requests that share a system prompt, on a dummy-weight model of
Qwen3-30B-A3B's sizes with rank-16 adapters, with --enable-prefix-caching off and on, in one run.

P requests, each the shared start of S tokens and U tokens of its own, make T tokens each (greedy, ignore_eos),
with LoRA off, one adapter, or 8 (request i gets adapter i % 8: each adapter caches its own keys). Each engine
first serves one request per adapter (with the cache on, the shared start is then cached), then the batch is
timed: the least of REPEATS calls, each with tokens of its own never seen before, so that a call finds the shared
start cached and nothing more. The ratio off / on is the time the cache saves; "cached" is the share of the timed
calls' prompt tokens found in the cache.

    python3 benchmarks/bench_prefix_cache.py                 # about 3 minutes on an H200
    python3 benchmarks/bench_prefix_cache.py --tiny          # a tiny model of the same kind in seconds (CPU test)
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_moe import machine
from bench_serving import RANK, Ours, free_memory, synchronize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora import SamplingParams  # noqa: E402
from tests.support import qwen3_30b_a3b_config, write_dummy_checkpoint, write_random_peft_adapter  # noqa: E402

REPEATS = 3


def requests(batch: int, shared: int, own: int, vocab: int, call: int) -> list[list[int]]:
    """The batch's prompts: one shared start, then tokens of each request's own (new ones for each call number)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (shared,), generator=gen).tolist()
    gen.manual_seed(1 + call)
    return [start + torch.randint(0, vocab, (own,), generator=gen).tolist() for _ in range(batch)]


def seconds(ours: Ours, batch: int, shared: int, own: int, tokens: int, adapters: int, vocab: int,
            device: str) -> tuple[float, float]:
    """The least of REPEATS timed calls of the batch (each with prompts of its own after the shared start), and the
    share of their prompt tokens found cached (0 without the cache)."""
    names = [None if not adapters else f"a{i % adapters}" for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    calls = 1 + (REPEATS + 1) * adapters  # call numbers of this adapter count's own
    warm = requests(max(adapters, 1), shared, own, vocab, calls)  # one per adapter: the shared start cached
    ours.engine.generate(warm, params, lora=[None if not adapters else f"a{i}" for i in range(len(warm))])
    before = ours.engine.prefix_cache_counts()
    best = float("inf")
    for call in range(calls + 1, calls + REPEATS + 1):
        prompts = requests(batch, shared, own, vocab, call)
        synchronize(device)
        t0 = time.perf_counter()
        outs = ours.engine.generate(prompts, params, lora=names)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
        assert all(len(o.token_ids) == tokens for o in outs)
    after = ours.engine.prefix_cache_counts()
    hit = (after["hit_tokens"] - before["hit_tokens"]) / (after["query_tokens"] - before["query_tokens"]) if after else 0
    return best, hit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same kind and a small workload")
    p.add_argument("--batch", type=int, default=None, help="requests per call (default 32; tiny 4)")
    p.add_argument("--shared", type=int, default=None, help="tokens of the shared start (default 2048; tiny 48)")
    p.add_argument("--own", type=int, default=None, help="tokens of each request's own (default 128; tiny 8)")
    p.add_argument("--tokens", type=int, default=None, help="tokens each request makes (default 16; tiny 2)")
    p.add_argument("--adapters", default="0,1,8", help="distinct adapters per batch (0: LoRA off; at most 8)")
    args = p.parse_args()
    defaults = (4, 48, 8, 2) if args.tiny else (32, 2048, 128, 16)
    for name, value in zip(("batch", "shared", "own", "tokens"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    counts = [int(a) for a in args.adapters.split(",")]
    device, dtype, name, _, _ = machine()
    config = qwen3_30b_a3b_config(tiny=args.tiny)
    print(f"# moelora prefix caching benchmark, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}")
    print(f"{'tiny Qwen3-MoE' if args.tiny else 'Qwen3-30B-A3B'} sizes, dummy weights, adapters rank {RANK}; "
          f"{args.batch} requests of {args.shared} shared + {args.own} own tokens, {args.tokens} tokens each\n")
    print("| adapters | caching off s | caching on s | off / on | cached |")
    print("|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_dummy_checkpoint(config, Path(tmp) / "model")
        adapters = {f"a{i}": write_random_peft_adapter(config, Path(tmp) / f"a{i}", RANK, seed=i, device=device)
                    for i in range(max(counts))}
        rows = {}
        for caching in (False, True):
            ours = Ours(model_dir, adapters, device, dtype, args.batch, enable_prefix_caching=caching)
            for n in counts:
                rows[caching, n] = seconds(ours, args.batch, args.shared, args.own, args.tokens, n, config.vocab_size,
                                           device)
            del ours
            free_memory(device)
        for n in counts:
            (off, _), (on, hit) = rows[False, n], rows[True, n]
            print(f"| {n} | {off:.3f} | {on:.3f} | {off / on:.2f} | {100 * hit:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
