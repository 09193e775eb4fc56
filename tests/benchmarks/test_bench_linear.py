"""The dense GEMM benchmark runs end to end (--shapes tiny: the torch path on a CPU, in seconds), with its
tile and K-split sweeps, so the GPU run cannot be the first to find it broken."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_linear_benchmark_reports_each_batch_size_and_sweeps():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_linear.py", "--shapes", "tiny", "--rows", "1,512",
                          "--sweep", "1", "--split-sweep", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| tiny")]
    assert [int(r[1]) for r in rows] == [1, 512]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows) and rows[0][7].strip() == "" and rows[1][7].strip()
    assert [r[8].strip() for r in rows] == ["4 par", "4"]  # K splits in parallel at M = 1, serial at 512
    assert "best at M=1 N=80" in run.stdout
    assert "split sweep M=1 SPLIT_PROGRAMS=256: K splits 4 par" in run.stdout


def test_tiny_lora_benchmark_reports_each_batch_size_at_the_rank_asked():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_linear.py", "--lora", "--lora-rank", "64", "--shapes",
                          "tiny", "--rows", "1,40"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "8 slots of rank 64 per weight copy" in run.stdout
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| tiny")]
    assert [int(r[1]) for r in rows] == [1, 40] and all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
