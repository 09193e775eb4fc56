"""Attention benchmark (kernels only, not a test). Prefill: moelora's paged extend kernel against torch's
scaled_dot_product_attention (FlashAttention on a GPU) on the same queries, keys and values laid out contiguously.
Decode (--decode): the split kernel and its reduce for one new token a sequence, against the bytes floor (the
sequences' keys and values read once at the measured copy bandwidth).

For each case (sequences x new tokens after a cached prefix, the heads of a model) it reports, in one run on one
device: ours us, TFLOP/s and % of the measured bf16 matmul rate (causal FLOPs: 2 (Dk + Dv) Hq per visible
(query, key) pair), torch us and ours / torch where torch computes the same thing (no prefix: torch's causal mask
is aligned top-left). Cache slots are a random permutation, as tests/support.py's random_paged_attention makes them.

    python3 benchmarks/bench_attention.py                     # default cases
    python3 benchmarks/bench_attention.py --sweep             # also time candidate tiles per case
    python3 benchmarks/bench_attention.py --tiny              # CPU-sized smoke run (the torch path)
    python3 benchmarks/bench_attention.py --decode            # decode instead (with --tiny: CPU-sized)
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_moe import machine, measure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora.kernels.attention import AttentionConfig, attention, default_config, extend_blocks
from tests.support import random_paged_attention

DECODE_REPEATS = 16
HEADS = {  # q heads, kv heads, key head size, value head size
    "qwen3-30b-a3b": (32, 4, 128, 128),
    "deepseek-v2-lite-mla": (16, 16, 192, 128),
    "tiny": (4, 2, 32, 32),
}


@dataclass(frozen=True)
class Case:
    heads: str
    seqs: int
    prefix: int
    extend: int

    def label(self) -> str:
        return f"{self.heads} {self.seqs}x{self.extend}" + (f" after {self.prefix}" if self.prefix else "")

    def flops(self) -> float:
        hq, _, dk, dv = HEADS[self.heads]
        visible = self.extend * self.prefix + self.extend * (self.extend + 1) / 2  # keys each query sees, summed
        return 2 * (dk + dv) * hq * visible * self.seqs


def torch_sdpa(case: Case, q, k_cache, v_cache, req_to_token, rows, seq_lens):
    """SDPA on contiguous [seqs, heads, len, D] copies of the case's tensors, or None where it differs (a prefix)."""
    if case.prefix:
        return None
    slots = req_to_token[rows.long(), :case.extend].long()  # [seqs, len]
    q4 = q.view(case.seqs, case.extend, *q.shape[1:]).transpose(1, 2).contiguous()
    k4, v4 = (c[slots].transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    scale = q.shape[-1] ** -0.5
    return lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)


def decode_table(cases: list[tuple[str, int, int]], device: str, dtype: torch.dtype, bw: float) -> None:
    """One decode step's attention per case (heads, sequences, keys a sequence attends to, the new one included)."""
    print("| heads | sequences x keys | ours us | bytes floor us | % of floor |")
    print("|---|---|---|---|---|")
    for heads, seqs, keys in cases:
        hq, hkv, dk, dv = HEADS[heads]
        gen = torch.Generator().manual_seed(0)
        q, k, v, req_to_token, rows, lens, ext, starts, scale = random_paged_attention(
            [keys - 1] * seqs, [1] * seqs, hq, hkv, dk, dv, dtype, device, generator=gen)
        impl = "triton" if device == "cuda" else "torch"
        # a step's attention, timed DECODE_REPEATS times back to back in one graph: one such launch pair alone
        # measured 11-17 us between runs of the same tree (a GPU that idles between replays)
        t = measure(lambda: [attention(q, k, v, req_to_token, rows, lens, ext, starts, scale, is_decode=True,
                                       impl=impl) for _ in range(DECODE_REPEATS)]) / DECODE_REPEATS
        floor = seqs * keys * hkv * (dk + dv) * dtype.itemsize / bw
        print(f"| {heads} | {seqs}x{keys} | {t * 1e6:.1f} | {floor * 1e6:.2f} | {100 * floor / t:.0f}% |", flush=True)


def candidates(dk: int) -> list[AttentionConfig]:
    base = default_config(dk, torch.bfloat16)
    tiles = [AttentionConfig(m, n, base.decode_block_n, w, s)
             for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))]
    return [base] + [t for t in tiles if t != base]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--sweep", action="store_true", help="time every candidate tile, best five listed per case")
    p.add_argument("--decode", action="store_true", help="decode steps instead of prefill")
    args = p.parse_args()
    device, dtype, name, mm, bw = machine()
    if args.decode:
        print(f"# decode attention, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}; copy "
              f"{bw / 1e12:.2f} TB/s\n")
        decode_table([("tiny", 2, 40), ("tiny", 1, 300)] if args.tiny else
                     [("qwen3-30b-a3b", 1, 256), ("qwen3-30b-a3b", 1, 4096), ("qwen3-30b-a3b", 32, 1024),
                      ("qwen3-30b-a3b", 128, 1024), ("deepseek-v2-lite-mla", 32, 1024)], device, dtype, bw)
        return
    if args.tiny:
        cases = [Case("tiny", 2, 0, 64), Case("tiny", 1, 32, 16)]
    else:
        cases = [Case("qwen3-30b-a3b", 8, 0, 1024), Case("qwen3-30b-a3b", 1, 0, 8192),
                 Case("qwen3-30b-a3b", 4, 3072, 1024), Case("deepseek-v2-lite-mla", 8, 0, 1024)]
    print(f"# prefill attention, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}; "
          f"matmul {mm / 1e12:.0f} TFLOP/s\n")
    print("| case | config (m, n, warps, stages) | ours us | TFLOP/s | % of matmul | torch us | ours / torch |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        gen = torch.Generator().manual_seed(0)
        q, k, v, req_to_token, rows, lens, ext, starts, scale = random_paged_attention(
            [case.prefix] * case.seqs, [case.extend] * case.seqs, *HEADS[case.heads], dtype, device, generator=gen)
        impl = "triton" if device == "cuda" else "torch"

        def ours(cfg: AttentionConfig | None = None):
            blocks = extend_blocks(q, k, ext, cfg)  # once a step in the engine, for every layer: not timed
            return lambda: attention(q, k, v, req_to_token, rows, lens, ext, starts, scale, blocks=blocks,
                                     impl=impl, config=cfg)

        cfg = default_config(HEADS[case.heads][2], dtype)
        t = measure(ours())
        ref = torch_sdpa(case, q, k, v, req_to_token, rows, lens)
        t_ref = measure(ref) if ref else None
        ref_cells = f"{t_ref * 1e6:.1f} | {t / t_ref:.2f}" if t_ref else " | "
        print(f"| {case.label()} | {cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages} | {t * 1e6:.1f} "
              f"| {case.flops() / t / 1e12:.0f} | {100 * case.flops() / t / mm:.0f}% | {ref_cells} |", flush=True)
        if args.sweep and device == "cuda":
            timed = []
            for c in candidates(HEADS[case.heads][2]):
                try:
                    timed.append((measure(ours(c)), c))
                except Exception as e:  # a tile over the shared-memory limit: reported, not fatal
                    print(f"|   {case.label()} | {c.block_m}, {c.block_n}, {c.num_warps}, {c.num_stages} | "
                          f"{type(e).__name__} | | | | |")
            for t_c, c in sorted(timed, key=lambda x: x[0])[:5]:
                print(f"|   sweep {case.label()} | {c.block_m}, {c.block_n}, {c.num_warps}, {c.num_stages} | "
                      f"{t_c * 1e6:.1f} | {case.flops() / t_c / 1e12:.0f} | {100 * case.flops() / t_c / mm:.0f}% | | |",
                      flush=True)


if __name__ == "__main__":
    main()
