"""The prefix caching benchmark runs end to end (--tiny, in seconds), so the GPU run cannot be the first to find it
broken: a row per adapter count, and the cached share is the shared start's share of each prompt."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_prefix_cache_benchmark_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_prefix_cache.py", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 8]
    for r in rows:
        assert float(r[1]) > 0 and float(r[2]) > 0 and float(r[3]) > 0
        assert r[4] == f"{100 * 48 / 56:.0f}%"  # 48 shared of 56 prompt tokens, each timed call
