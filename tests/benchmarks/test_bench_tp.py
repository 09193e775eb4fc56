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
                          "--batch-sizes", "1", "--dispatch", "all_to_all", "--profile", "3", "--profile-batch", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    table, rest = run.stdout.split("| tp | ep | phase | batch | LoRA off tokens/s")
    summary_table, *profiles = rest.split("\nProfile of ")
    profiles[-1], starts_table = profiles[-1].split("Engine starts")
    rows, summary_rows, start_rows = ([[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
                                       if line.startswith("| ") and "---" not in line]
                                      for text in (table, summary_table, starts_table))
    # each layout's LoRA-off prefill, and its decode steps at the profiled batch with each adapter count, profiled
    # on every rank (Engine.start_profile; CPU: host ops): all its time, then the busiest 3 of each rank
    titles = {text.split(", ms (launches)")[0]: text for text in profiles}
    assert set(titles) == {f"{what} at {layout}" for layout in ("1x1", "2x2") for what in (
        "the LoRA-off prefill call", "the decode steps at batch 1, LoRA off", "the decode steps at batch 1, 1 adapter")}
    for title, text in titles.items():
        ranks = 2 if title.endswith("2x2") else 1
        profile_rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
                        if line.startswith("| ") and "---" not in line]
        assert profile_rows[0] == ["kernel", *(f"rank {r}" for r in range(ranks))], profile_rows
        assert profile_rows[1][0] == "all" and 3 <= len(profile_rows) - 2 <= 3 * ranks, profile_rows
        assert all(float(cell.split(" (")[0]) > 0 for cell in profile_rows[1][1:]), profile_rows[1]
        for row in profile_rows[2:]:
            assert all(float(cell.split(" (")[0]) >= 0 for cell in row[1:]), row
    # each layout's start in phases (no graphs on the CPU); over several ranks, rank 0's waits for the others
    loads = ["model loaded", "LoRA slots allocated, 1 adapter loaded"]
    assert [r[2] for r in start_rows if r[:2] == ["1", "1"]] == [*loads, "KV cache allocated"]
    assert [r[2] for r in start_rows if r[:2] == ["2", "2"]] == ["ranks started", *loads,
                                                                 "the other ranks' loads waited for",
                                                                 "KV cache allocated",
                                                                 "the other ranks' starts waited for"]
    measured = {(r[0], r[1], r[2], r[3], r[4]) for r in rows if r[2] in ("decode", "prefill")}
    assert measured == {(tp, ep, phase, batch, n) for tp, ep in (("1", "1"), ("2", "2"))
                        for phase, batch in (("decode", "1"), ("prefill", "8")) for n in ("0", "1")}
    tokens = {key: float(r[7]) for r in rows if (key := (r[0], r[1], r[2], r[3], r[4])) in measured}
    summary = {(r[0], r[1], r[2], r[3]): r[4:] for r in summary_rows}
    assert set(summary) == {key[:4] for key in measured}
    for (tp, ep, phase, batch), (off, of_one, lora) in summary.items():
        assert float(off) == tokens[tp, ep, phase, batch, "0"]
        _assert_ratio(of_one, tokens[tp, ep, phase, batch, "0"], tokens["1", "1", phase, batch, "0"])
        _assert_ratio(lora, tokens[tp, ep, phase, batch, "1"], tokens[tp, ep, phase, batch, "0"])


def _assert_ratio(printed: str, a: float, b: float) -> None:
    """printed (2 decimals) is a / b of the true values that a and b (tokens/s printed to units) were rounded from."""
    low, high = (a - 0.5) / (b + 0.5), (a + 0.5) / (b - 0.5)
    assert low - 0.005 <= float(printed) <= high + 0.005, (printed, a, b)
