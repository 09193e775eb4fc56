"""The MoE kernel benchmark runs end to end (--shapes tiny: the torch path on a CPU, in seconds), its table and its
rank cases, so the GPU run cannot be the first to find it broken."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.support import random_expert_lora

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_moe  # noqa: E402
from bench_moe import MIXED_CASE as MIXED, RANK_CASES  # noqa: E402


def _run(*args: str) -> list[list[str]]:
    """bench_moe's table rows of the tiny shape (of every table), cells stripped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_moe.py", "--shapes", "tiny", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| tiny")]


def test_tiny_moe_benchmark_reports_each_batch_and_adapter_count():
    rows = _run("--tokens", "1,40", "--adapters", "1,8")
    assert [(int(r[1]), int(r[2])) for r in rows] == [(1, 1), (1, 8), (40, 1), (40, 8)]
    assert all(float(r[3]) > 0 and float(r[6]) > 0 for r in rows)  # base time, LoRA floor


def test_tiny_moe_benchmark_reports_every_rank_case():
    rows = _run("--rank-cases", "--tokens", "8,40")
    cases, ratios = [r for r in rows if len(r) == 7], [r for r in rows if len(r) == 5]
    assert [(r[2], r[1]) for r in cases] == [(case, t) for case in RANK_CASES for t in ("8", "40")]
    delta = {(r[2], r[1]): float(r[4]) for r in cases}
    # issue 21's three ratios per T, from the rows above: "a / b = a/b"
    assert [r[1] for r in ratios] == ["8", "40"]
    for _, t, mixed, quarter, rank8 in ratios:
        mean = delta["rank 16", t] + 0.25 * (delta["rank 64", t] - delta["rank 16", t])
        for cell, (a, b) in ((mixed, (delta[MIXED, t], mean)),
                             (quarter, (delta["rank 16 on 25% of experts", t], delta["rank 16", t])),
                             (rank8, (delta["rank-8 tokens, rank 64 resident", t],
                                      delta["rank-8 tokens, rank 8 resident", t]))):
            shown_a, shown_b = map(float, cell.split(" = ")[0].split(" / "))
            assert abs(shown_a - a) <= 0.051 and abs(shown_b - b) <= 0.1, (cell, a, b)  # the rows' rounding
    floors = {r[2]: float(r[5]) for r in cases if r[1] == "40"}
    assert floors["rank 16 on no expert"] == 0 and floors["rank 64"] > floors["rank 16"] > 0
    covered = {r[2]: int(r[6]) for r in cases if r[1] == "40"}  # (pairs with any LoRA: one copy on a CPU)
    assert covered["rank 16 on no expert"] == 0 and covered["rank 16"] == covered["rank 64"] > 0
    assert 0 < covered["rank 16 on 25% of experts"] < covered["rank 16"]
    # a quarter of the experts with all three projections, or a quarter drawn per projection: both well under
    # full coverage
    assert 0 < floors["rank 16 on 25% of experts"] < floors["rank 16"] / 2
    assert 0 < floors["rank 16 on 25% of each projection's experts"] < floors["rank 16"] / 2


def test_each_rank_case_draws_its_coverage_as_it_says(monkeypatch):
    """bench_moe passes each case's draw (per expert or per projection) to random_expert_lora."""
    drawn = []

    def recording(*args, **kwargs):
        if "whole_experts" in kwargs:  # a case's draw (the layers' own first adapters are drawn without)
            drawn.append((kwargs["coverage"], kwargs["whole_experts"]))
        return random_expert_lora(*args, **kwargs)
    monkeypatch.setattr(bench_moe, "random_expert_lora", recording)
    bench_moe.rank_cases_of_shape(argparse.Namespace(tokens="4", pairs=3), "tiny", "cpu", torch.float32, 1e12)
    assert drawn == [(coverage, whole) for _, coverage, whole, _ in RANK_CASES.values()]
    assert drawn[3] == (0.25, True) and drawn[4] == (0.25, False)


def test_whole_experts_cover_all_three_projections_at_once():
    """The rank cases' "25% of experts": an adapter covers an expert with gate, up and down, or not at all."""
    gen = torch.Generator().manual_seed(0)
    whole = random_expert_lora(8, 64, 32, 16, [8] * 8, torch.float32, coverage=0.25, whole_experts=True, generator=gen)
    per_projection = random_expert_lora(8, 64, 32, 16, [8] * 8, torch.float32, coverage=0.25, generator=gen)
    covered, drawn = whole.ranks > 0, per_projection.ranks > 0
    assert (covered == covered[0]).all() and 0.15 < covered[0].float().mean() < 0.35
    assert not (drawn == drawn[0]).all() and 0.15 < drawn.float().mean() < 0.35


def test_measure_pair_times_the_two_in_alternation_and_takes_the_median_difference(monkeypatch):
    """measure_pair's second time is the first's median plus the median of neighbouring differences: a clock that
    drifts between calls moves both of a pair alike, and one slow outlier does not move it."""
    calls = []

    def fake_timer(fn):
        times = iter(fn())
        def once():
            calls.append(fn)
            return next(times)
        return once

    monkeypatch.setattr(bench_moe, "timer", fake_timer)
    a = lambda: [1.0, 2.0, 3.0]  # noqa: E731  the clock drifts up 1 s a pair
    b = lambda: [1.5, 2.5, 9.5]  # noqa: E731  b's last call an outlier
    t_a, t_b = bench_moe.measure_pair(a, b, reps=3)
    assert calls == [a, b, b, a, a, b]
    assert (t_a, t_b) == (2.0, 2.5)


def test_sweep_times_pair_blocks_at_pair_block_sizes_and_aligned_blocks_past_them():
    """--sweep-tokens times the tiles the table could pick at that T: pair blocks up to PAIR_BLOCKS_MAX_TOKENS
    (their gate_up tiles wide enough for the down shrink's parts), aligned blocks past it; every config is valid."""
    limit = bench_moe.PAIR_BLOCKS_MAX_TOKENS
    pairs, aligned = bench_moe.sweep_configs(limit), bench_moe.sweep_configs(limit + 1)
    assert pairs and all(c.pair_blocks and c.block_n_gate_up >= 64 for c in pairs)
    assert {c.max_registers for c in pairs} == {None, 128}
    assert aligned and not any(c.pair_blocks for c in aligned) and {c.tma for c in aligned} == {False, True}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "benchmarks/bench_moe.py", "--shapes", "tiny", "--tokens", "1",
                          "--adapters", "1", "--sweep-tokens", "1"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sum(line.startswith("  sweep T=1 n=1 ") for line in run.stdout.splitlines()) == len(pairs)
