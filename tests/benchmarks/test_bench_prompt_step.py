"""The prompt-step benchmark runs end to end on the CPU (--tiny: eager steps only, no graphs there), so the GPU run
cannot be the first to find it broken."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_prompt_step_benchmark_reports_each_step():
    run = subprocess.run([sys.executable, "benchmarks/bench_prompt_step.py", "--tiny", "--steps", "1x8,2x16"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines() if line.startswith("| ")][1:]
    assert [(r[0], r[1]) for r in rows] == [("1 x 8", "no"), ("1 x 8", "yes"), ("2 x 16", "no"), ("2 x 16", "yes")]
    for row in rows:
        host, wall = float(row[2]), float(row[3])
        assert 0 < host <= wall * 1.01 and row[4] == "eager"
