"""The step profile runs end to end on a tiny model (CPU: aten ops stand in for kernels), decode and prefill, so
the GPU run cannot be the first to find it broken."""
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def profile_rows(*args: str) -> list[list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/profile_step.py", "--tiny", "--top", "5", *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines() if line.startswith("| ")]


def test_tiny_decode_profile_lists_each_case():
    rows = profile_rows("--batch-sizes", "1,2", "--adapters", "0,2", "--decode-tokens", "6")
    cases = [r for r in rows if r[0].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in cases] == [(1, 0), (2, 0), (2, 2)]  # adapters <= batch
    # wall us per step (a difference of two runs' times: on a loaded CPU it may come out at or below 0) and kernels
    # (ops) per step
    assert all(math.isfinite(float(r[2])) and int(r[5]) > 0 for r in cases)
    header = next(r for r in rows if r[0] == "kernel")
    assert header[1:] == ["b1 a0", "b2 a0", "b2 a2"]
    assert len([r for r in rows if r[0].startswith("aten::")]) >= 5


def test_tiny_prefill_profile_lists_each_case():
    rows = profile_rows("--prefill", "2x24", "--adapters", "0,2,4")
    cases = [r for r in rows if r[0].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in cases] == [(2, 0), (2, 2)]  # adapters <= prompts
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and int(r[5]) > 0 for r in cases)
    header = next(r for r in rows if r[0] == "kernel")
    assert header[1:] == ["b2 a0", "b2 a2"]
