"""The HTTP serving benchmark runs end to end (--tiny: `moelora serve` on a tiny model with 3 adapters,
streamed clients in client processes of 3 (the 4 clients in 2); scheduling ahead, a small step budget; then the offline engine on the same flags), and
summarises the steps of both and the server's threads, so the GPU run cannot be the first to find it broken."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_server_benchmark_reports_each_concurrency():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_server.py", "--tiny", "--concurrency", "1,4", "--clients-per-process", "3",
                          "--adapters", "3",
                          "--server-args=--disable-overlap-schedule --enable-mixed-chunk --max-num-batched-tokens 16"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "3 adapters of rank 16 (client i uses adapter i % 3)" in run.stdout
    blocks = run.stdout.split("\n\n")
    tables = [[[float(v) for v in line.split("|")[1:-1]] for line in block.splitlines()[2:]]
              for block in blocks if block.startswith("| concurrent clients")]
    served, offline = tables
    assert [r[0] for r in served] == [1, 4] and [r[1] for r in served] == [2, 8]
    for clients, _, ttft50, ttft90, itl, tps in served:
        assert 0 < ttft50 <= ttft90 and itl > 0 and tps > 0
    assert [r[0] for r in offline] == [1, 4]
    for (clients, offline_tps, ratio, step_ms, itl_ratio), served_row in zip(offline, served):
        # the table's tokens/s are rounded to integers: on a loaded CPU the offline rate may be 1-2 tokens/s
        rounding = 0.5 / offline_tps + 0.5 / served_row[-1]
        assert offline_tps > 0 and ratio == pytest.approx(served_row[-1] / offline_tps, rel=0.1 + rounding, abs=0.01)
        # the offline decode step (4 tokens a request: two decode steps in a row at least), and the served
        # inter-token latency against it (both printed to 2 decimals)
        assert step_ms > 0 and itl_ratio == pytest.approx(served_row[4] / step_ms, rel=0.05, abs=0.01)

    steps = next(block for block in blocks if block.startswith("| run |")).splitlines()[2:]
    rows = {(cells[0], int(cells[1])): [float(v) for v in cells[2:9]] + [float(v) for v in cells[10].split(" / ")]
            for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in steps)}
    assert set(rows) == {(run, c) for run in ("server", "offline") for c in (1, 4)}
    for (_, clients), (admitted, prompt, mixed, decode, prompts_per_step, batch, stalled, *host_ms) in rows.items():
        assert admitted == 2 * clients  # the measured requests only: the warm-ups are not counted
        # each of the 2 waves' prompts (8 tokens) runs in pieces of the 16-token budget beside the decode rows
        assert prompt + mixed >= 2 and decode > 0 and 0 < prompts_per_step <= clients and 0 < batch <= clients
        assert stalled == 0 and len(host_ms) == 4 and all(ms >= 0 for ms in host_ms) and host_ms[1] > 0
    threads = next(block for block in blocks if block.startswith("| clients |")).splitlines()[2:]
    for line, clients in zip(threads, (1, 4), strict=True):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        add_ms, ttft_ms, idle, commands, stepping = map(float, cells[1:6])
        text, tokenize = map(float, cells[6].split(" / "))
        cpu, wall = [float(v) for v in cells[7].split(" / ")], float(cells[9])
        gc_s, compiles = cells[8].split(" / ")
        assert float(gc_s) >= 0 and int(compiles.split(" (")[0]) >= 0
        # both printed to 0.01 s: a short run's stepping time can round to its wall time
        assert int(cells[0]) == clients and 0 < add_ms < ttft_ms and 0 < stepping <= wall
        assert min(idle, commands, text, tokenize) >= 0 and len(cpu) == 4 and cpu[1] > 0
