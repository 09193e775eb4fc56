"""The HTTP serving benchmark runs end to end (--tiny: `moelora serve` on a tiny model with 8 adapters,
streamed clients; scheduling ahead, a small step budget), so the GPU run cannot be the first to find it
broken."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_server_benchmark_reports_each_concurrency():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_server.py", "--tiny", "--concurrency", "1,4",
                          "--server-args", "--enable-overlap-schedule --max-num-batched-tokens 16"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    data = [[float(v) for v in r] for r in rows[1:]]
    assert [r[0] for r in data] == [1, 4] and [r[1] for r in data] == [2, 8]
    for clients, _, ttft50, ttft90, itl, tps in data:
        assert 0 < ttft50 <= ttft90 and itl > 0 and tps > 0
