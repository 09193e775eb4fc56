"""The sampler benchmark runs end to end (--tiny: on a CPU, in seconds), so the GPU run cannot be the
first to find it broken."""
import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tiny_sampler_benchmark_times_every_case(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports bench_moe as a sibling
    monkeypatch.setattr(sys, "argv", ["bench_sampler.py", "--tiny"])
    importlib.import_module("bench_sampler").main()
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows[1:]] == ["greedy", "random top-p", "+ penalties", "+ logit_bias, min_tokens",
                                                "+ token mask"]
    assert all(float(v) > 0 for r in rows[1:] for v in r[1:])
