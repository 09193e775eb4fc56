"""Sampler benchmark (not a test): one `sample` call over a batch at Qwen3's vocabulary, plain and with
each logits-processing step of issue 19 on every row (penalties, logit_bias + min_tokens, a grammar's
token mask), so the cost of each is its difference to the plain row. On a GPU each call is captured in
a CUDA graph and replayed (bench_moe.measure): the capture itself shows the step holds no host sync.

    python3 benchmarks/bench_sampler.py              # B = 1, 32, 256 at V = 151936, markdown to stdout
    python3 benchmarks/bench_sampler.py --tiny       # CPU-sized smoke run
"""
from __future__ import annotations

import argparse
import datetime
import random

import torch

from bench_moe import measure
from moelora.engine.sampler import PenaltyState, SamplingBatch, TokenMask, pack_bitmask, sample
from moelora.engine.sampling_params import SamplingParams

CASES = {  # name -> SamplingParams of every row (random rows: temperature 0.8, top_p 0.9)
    "greedy": dict(temperature=0.0),
    "random top-p": dict(temperature=0.8, top_p=0.9),
    "+ penalties": dict(temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "+ logit_bias, min_tokens": dict(temperature=0.8, top_p=0.9, logit_bias={i: 1.0 for i in range(10)}, min_tokens=64),
    "+ token mask": dict(temperature=0.8, top_p=0.9),
}


def batch_for(case: str, rows: int, vocab: int, device: str) -> SamplingBatch:
    rng = random.Random(0)
    params = [SamplingParams(max_tokens=128, **CASES[case])] * rows
    batch = SamplingBatch.build(params, [rng.getrandbits(63) for _ in range(rows)], [10] * rows, device,
                                [(0, 1)] * rows)
    if case == "+ penalties":
        state = PenaltyState(rows, vocab, device)
        for r in range(rows):
            state.reset(r, [rng.randrange(vocab) for _ in range(512)], [rng.randrange(vocab) for _ in range(10)])
        batch.penalties = state.gather(list(range(rows)), list(range(rows)), params)
    if case == "+ token mask":
        allowed = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(0)) < 0.5
        batch.token_mask = TokenMask(torch.arange(rows, device=device), pack_bitmask(allowed).to(device))
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="V = 1000, B = 1 and 8 (a CPU smoke run)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab, batch_sizes = (1000, [1, 8]) if args.tiny else (151936, [1, 32, 256])
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# sampler, {name}, V={vocab}, {datetime.date.today()}\n")
    print("| case | " + " | ".join(f"B={b} us" for b in batch_sizes) + " |")
    print("| --- |" + " --- |" * len(batch_sizes))
    for case in CASES:
        times = []
        for rows in batch_sizes:
            logits = torch.randn(rows, vocab, device=device)
            batch = batch_for(case, rows, vocab, device)
            times.append(measure(lambda: sample(logits, batch)) * 1e6)
        print(f"| {case} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


if __name__ == "__main__":
    main()
