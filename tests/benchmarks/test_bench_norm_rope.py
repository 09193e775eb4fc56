"""The per-token kernels' benchmark runs end to end (--tiny: the torch path on a CPU, in seconds), so the GPU run
cannot be the first to find it broken."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_norm_rope_benchmark_reports_each_kernel_and_size():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_norm_rope.py", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines() if line.startswith("| ")]
    cases = [(r[0], int(r[1])) for r in rows if r[1].isdigit()]
    assert cases == [(k, t) for t in (1, 64) for k in ("rms_norm + residual", "q/k norm + rope + kv store")]
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows if r[1].isdigit())
