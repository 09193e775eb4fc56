"""Benchmark of the per-token, memory-bound kernels of a decoder layer (kernels only, not a test): the RMSNorm
with the residual add (kernels/rms_norm.py) at the hidden size, and the fused q/k norm + RoPE + KV store
(kernels/rope_kv_store.py) at the attention's heads, Qwen3-30B-A3B's sizes.

For each number of tokens it reports, in one run on one device: ours us, % of the copy-bandwidth floor (bytes
read and written / measured copy bandwidth), the torch path's us (rms_norm_reference, rope_store_kv_reference) and
ours / torch; with --sweep, the rope's time at each number of head tiles a program loops over, the default
marked (the norm runs a row a program: looping over rows measured no faster).

    python3 benchmarks/bench_norm_rope.py                 # tokens 1,128,8192
    python3 benchmarks/bench_norm_rope.py --sweep
    python3 benchmarks/bench_norm_rope.py --tiny          # CPU-sized smoke run (the torch path)
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import triton
from bench_moe import machine, measure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora.kernels.rms_norm import launch_config, rms_norm
from moelora.kernels.rope_kv_store import head_blocks_per_program, rope_store_kv, rope_store_kv_triton
from moelora.layers.rotary import rope_frequencies

SIZES = {"qwen3-30b-a3b": (2048, 32, 4, 128), "tiny": (256, 4, 2, 32)}  # hidden, q heads, kv heads, head_dim


def norm_case(tokens: int, hidden: int, dtype, device):
    """(ours(per_program), torch, bytes, default per_program: None, one row a program) of the add-then-norm of
    `tokens` rows."""
    x, residual = (torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(2))
    weight = torch.randn(hidden, dtype=dtype, device=device)

    def torch_path():
        return rms_norm(x, weight, 1e-6, residual, impl="torch")

    def ours(per_program: int | None = None):  # one row a program; off the GPU the torch path (a smoke run)
        return (lambda: rms_norm(x, weight, 1e-6, residual, impl="triton")) if device == "cuda" else torch_path
    return ours, torch_path, 4 * x.numel() * x.itemsize, None


def rope_case(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype, device):
    """The same for Qwen3's attention: q, k, v column slices of a fused qkv output, q/k norms, a KV cache."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = (t.view(tokens, -1, head_dim) for t in
               qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    caches = [torch.empty(tokens + 64, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
    loc = torch.randperm(tokens + 64, device=device)[:tokens]
    positions = torch.arange(tokens, device=device)
    inv_freq, scale = rope_frequencies(head_dim, dict(rope_type="default", rope_theta=1e6), 4096)
    norms = [(torch.randn(head_dim, dtype=dtype, device=device), 1e-6) for _ in range(2)]
    args = (positions, q, k, v, *caches, loc, inv_freq.to(device), scale, False, *norms)

    def torch_path():
        return rope_store_kv(*args, impl="torch")

    def ours(per_program: int | None = None):
        if device != "cuda":
            return torch_path
        return lambda: rope_store_kv_triton(*args, head_blocks=per_program)
    block_h = launch_config(head_dim)[0]
    q_tiles = triton.cdiv(q_heads, block_h)
    default = min(head_blocks_per_program(tokens * (q_tiles + triton.cdiv(kv_heads, block_h))), q_tiles)
    moved = 2 * qkv.numel() * qkv.itemsize  # q, k, v read; q, k, v written (q out, the caches)
    return ours, torch_path, moved, default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--tokens", default=None, help="default 1,128,8192 (tiny: 1,64)")
    p.add_argument("--sweep", action="store_true", help="the rope at 1, 2, 4 and 8 head tiles a program as well")
    args = p.parse_args()
    device, dtype, name, _, bw = machine()
    hidden, q_heads, kv_heads, head_dim = SIZES["tiny" if args.tiny else "qwen3-30b-a3b"]
    tokens_list = [int(t) for t in (args.tokens or ("1,64" if args.tiny else "1,128,8192")).split(",")]
    print(f"# per-token kernels, {name}, {datetime.date.today()}, torch {torch.__version__}, {dtype}; copy "
          f"bandwidth {bw / 1e12:.2f} TB/s\n")
    print("| kernel | tokens | tiles a program | ours us | % of BW floor | torch us | ours / torch |")
    print("|---|---|---|---|---|---|---|")
    for tokens in tokens_list:
        cases = {"rms_norm + residual": norm_case(tokens, hidden, dtype, device),
                 "q/k norm + rope + kv store": rope_case(tokens, q_heads, kv_heads, head_dim, dtype, device)}
        for kernel, (ours, reference, moved, default) in cases.items():
            t_ref = measure(reference)
            sweep = (1, 2, 4, 8) if args.sweep and device == "cuda" and default else (default,)
            for per_program in sweep:
                t = measure(ours(per_program))
                mark = " (default)" if per_program == default and len(sweep) > 1 else ""
                print(f"| {kernel} | {tokens} | {per_program or 1}{mark} | {t * 1e6:.1f} | {100 * moved / bw / t:.0f}% "
                      f"| {t_ref * 1e6:.1f} | {t / t_ref:.2f} |", flush=True)


if __name__ == "__main__":
    main()
