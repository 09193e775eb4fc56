"""The adapter swap benchmark runs end to end (--tiny, in seconds), so the GPU run cannot be the first to find it
broken: a row per engine, adapters moving in all but the resident one and read back from disk in the disk one, and
the single move timed both ways."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_adapter_swap_benchmark_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_lora_swap.py", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines() if line.startswith("| ")]
    engines = [r for r in rows if r[0] in ("resident", "swapped", "overlapped", "disk")]
    assert [(r[0], r[1]) for r in engines] == [("resident", "4"), ("swapped", "8"), ("overlapped", "8"), ("disk", "8")]
    assert engines[0][4] == "0" and all(int(r[4]) > 0 for r in engines[1:])  # slot loads
    assert [r[5] == "0" for r in engines] == [True, True, True, False]  # reads from disk: only in the disk engine
    assert all(float(r[3]) > 0 and int(r[6]) > 0 and float(r[7]) > 0 and float(r[8]) > 0 for r in engines)
    assert [r[0] for r in rows if r[0].startswith("one move")] == ["one move, staged host copy",
                                                                    "one move, pageable host copy"]
