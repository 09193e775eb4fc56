"""The attention benchmark runs end to end (--tiny: the torch path on a CPU, in seconds), so the GPU run
cannot be the first to find it broken."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_attention_benchmark_reports_each_case():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_attention.py", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines() if line.startswith("| tiny")]
    assert [r[0] for r in rows] == ["tiny 2x64", "tiny 1x16 after 32"]
    assert all(float(r[2]) > 0 for r in rows)
    assert float(rows[0][5]) > 0 and rows[1][5] == ""  # torch's causal mask differs after a prefix: no reference


def test_tiny_decode_attention_benchmark_reports_each_case():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_attention.py", "--tiny", "--decode"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines() if line.startswith("| tiny")]
    assert [r[1] for r in rows] == ["2x40", "1x300"]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
