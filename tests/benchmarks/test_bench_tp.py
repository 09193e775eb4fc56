"""The scaling benchmark runs end to end (--tiny, one rank and two, on the CPU), so the multi-GPU run cannot be
the first to find it broken."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_scaling_benchmark_runs_every_layout():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "benchmarks/bench_tp.py", "--tiny", "--layouts", "1x1,2x2", "--adapters", "0,1",
                          "--batch-sizes", "1", "--dispatch", "all_to_all"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines() if line.startswith("| ")]
    measured = {(r[0], r[1], r[2], r[3], r[4]) for r in rows if r[2] in ("decode", "prefill")}
    assert measured == {(tp, ep, phase, batch, n) for tp, ep in (("1", "1"), ("2", "2"))
                        for phase, batch in (("decode", "1"), ("prefill", "8")) for n in ("0", "1")}
