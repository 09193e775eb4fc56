"""The serving benchmark runs end to end (--tiny: a tiny model, both implementations, in seconds),
so the GPU run cannot be the first to find it broken."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_serving_benchmark_runs_both_implementations():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_serving.py", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| ")]
    measured = {(r[0].strip(), r[1].strip(), int(r[2]), int(r[3])) for r in rows if r[1].strip() in ("decode", "prefill")}
    # tiny: decode at batch 1 (LoRA off, 1 adapter) and 8 (off, 1, 8 adapters), prefill of 8 prompts (off, 1, 8)
    expected = {("decode", 1, 0), ("decode", 1, 1), ("decode", 8, 0), ("decode", 8, 1), ("decode", 8, 8),
                ("prefill", 8, 0), ("prefill", 8, 1), ("prefill", 8, 8)}
    assert measured == {(impl, *w) for impl in ("ours", "hf") for w in expected}
    summary = [r for r in rows if r[0].strip() in ("decode", "prefill")]
    assert len(summary) == len(expected)
    [float(r[5]) for r in summary]  # ours / HF is a number (its sign: timing noise of a loaded CPU)
