"""HTTP serving benchmark (not a test): `moelora serve` in its own process on a dummy-weight model of
Qwen3-30B-A3B's sizes with N adapters of rank 16 (--adapters, 8 by default: on an 80 GB GPU 8 slots of them leave
no memory for the KV cache, so fewer), on q/k/v/o and every routed expert, driven by C concurrent clients of the
official `openai` client, streaming, in processes of --clients-per-process (benchmarks/http_clients.py). Client i
uses adapter i % N; each sends --requests completions of --prompt-len token ids and gets --max-tokens greedy tokens
(ignore_eos).

Reported per concurrency: time to first token (p50, p90), inter-token latency (the median over
requests of (last token - first token) / (tokens - 1)), and aggregate generated tokens/s over the
wall time of the whole run. Then, in the same run, the offline engine on the same settings (the serve
flags parsed by the CLI) on the same work: --requests waves of C prompts through `Engine.generate`,
tokens/s over the waves' wall time; served / offline is the share of the engine the server delivers. One wave
more through Engine.step gives the offline decode step (the median of its steps of decode rows only), which the
served inter-token latency is read against.
Last, how the steps of each measured run formed and where their host time went (the engine's StepStats,
from the server's /metrics and from the offline engine; moelora/engine/step_stats.py says what each
counts), and where the server's threads spent the run.

    python3 benchmarks/bench_server.py                    # on a GPU, concurrency 1 and 32
    python3 benchmarks/bench_server.py --tiny             # a tiny model on the CPU in seconds (CPU test)
    python3 benchmarks/bench_server.py --server-args="--disable-overlap-schedule --enable-mixed-chunk"
    python3 benchmarks/bench_server.py --step-trace /tmp/steps   # and every step of both, one JSON line each
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from http_clients import client_prompt

from tests.support import qwen3_30b_a3b_config, write_dummy_checkpoint, write_random_peft_adapter

RANK = 16
CLIENTS = Path(__file__).with_name("http_clients.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_argv(model_dir: Path, adapters: dict[str, Path], device: str, extra: list[str]) -> list[str]:
    """The `moelora serve` engine flags of both the server and the offline engine: a slot for every adapter."""
    return ["--model-path", str(model_dir), "--load-format", "dummy",
            "--lora-paths", *[f"{n}={p}" for n, p in adapters.items()], "--max-loras-per-batch", str(len(adapters)),
            "--max-lora-rank", str(RANK), "--device", device, "--dtype", "bfloat16" if device == "cuda" else "float32",
            *extra]


def start_server(argv: list[str], port: int, log: Path, trace: Path | None) -> subprocess.Popen:
    """trace: where the server's engine writes its step trace (MOELORA_STEP_TRACE), if anywhere."""
    cmd = [sys.executable, "-m", "moelora.cli", "serve", *argv, "--port", str(port), "--served-model-name", "base"]
    env = os.environ | ({"MOELORA_STEP_TRACE": str(trace)} if trace is not None else {})
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def offline_run(argv: list[str], concurrencies: list[int], requests: int, prompt_len: int, max_tokens: int, vocab: int,
                num_adapters: int) -> tuple[dict[int, float], dict[int, dict[str, float]], dict[int, float]]:
    """Tokens/s of the offline engine on the clients' work, and its step counters over it: per concurrency C,
    `requests` waves of the C clients' prompts (client i with adapter i % num_adapters), each wave one generate
    call. Then one more wave through Engine.step: the median seconds of its steps of decode rows only (NaN where
    there were not two in a row), against which the served inter-token latency is read."""
    from bench_serving import decode_step_seconds

    from moelora.cli import engine_kwargs
    from moelora.engine.engine import Engine
    from moelora.engine.sampling_params import SamplingParams

    engine = Engine(**engine_kwargs(argv))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rates, stats, steps = {}, {}, {}
    for c in concurrencies:
        adapters = [f"a{i % num_adapters}" for i in range(c)]
        # warm-up on prompts the timed waves do not send, as the clients' (a prefix cache would serve them again)
        engine.generate([client_prompt(i, requests, prompt_len, vocab) for i in range(c)], params, lora=adapters)
        before = engine.step_stats.as_dict()
        t0 = time.perf_counter()
        tokens = 0
        for r in range(requests):
            outs = engine.generate([client_prompt(i, r, prompt_len, vocab) for i in range(c)], params, lora=adapters)
            tokens += sum(len(o.token_ids) for o in outs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rates[c] = tokens / (time.perf_counter() - t0)
        stats[c] = difference(engine.step_stats.as_dict(), before)
        intervals = decode_step_seconds(engine, [client_prompt(i, requests + 1, prompt_len, vocab) for i in range(c)],
                                        adapters, max_tokens)
        steps[c] = statistics.median(intervals) if intervals else math.nan
    engine.shutdown()
    return rates, stats, steps


def server_counters(url: str) -> dict[str, float]:
    """The server's step and thread counters (moelora:engine_* and moelora:server_* in /metrics) by their names in
    StepStats.as_dict and the engine loop's thread counters, and its TTFT histogram's ttft_sum and ttft_count."""
    counters = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for prefix in ("moelora:engine_", "moelora:server_"):
            if family.name.startswith(prefix):
                counters |= {sample.name.removeprefix(prefix).removesuffix("_total"): sample.value
                             for sample in family.samples if sample.name.endswith("_total")}
        if family.name == "moelora:time_to_first_token_seconds":
            counters |= {f"ttft{sample.name.removeprefix(family.name)}": sample.value for sample in family.samples
                         if sample.name.endswith(("_sum", "_count"))}
    return counters


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0) for name, value in after.items()}


def step_row(run: str, clients: int, d: dict[str, float]) -> str:
    """One run's steps: how many of each kind, how full, what a prompt step stalls, the wait for admission,
    and host ms per step by phase."""
    steps = d["prefill_steps"] + d["decode_steps"] + d["mixed_steps"]
    prompt_steps, decode_steps = d["prefill_steps"] + d["mixed_steps"], d["decode_steps"] + d["mixed_steps"]
    per_step = " / ".join(f"{1e3 * d[f'{phase}_seconds'] / max(steps, 1):.2f}"
                          for phase in ("schedule", "launch", "wait", "postprocess"))
    return (f"| {run} | {clients} | {d['admitted']:.0f} | {d['prefill_steps']:.0f} | {d['mixed_steps']:.0f} "
            f"| {d['decode_steps']:.0f} "
            f"| {d['prompt_pieces'] / max(prompt_steps, 1):.1f} | {d['decode_rows'] / max(decode_steps, 1):.1f} "
            f"| {d['stalled_rows'] / max(d['prefill_steps'], 1):.1f} "
            f"| {1e3 * d['admission_wait_seconds'] / max(d['admitted'], 1):.1f} | {per_step} |")


def print_step_tables(served: dict[int, dict[str, float]], offline: dict[int, dict[str, float]], walls: dict[int, float]
                      ) -> None:
    print("\n| run | clients | requests admitted | prompt steps | mixed steps | decode steps | prompts per prompt step "
          "| decode batch (mean) | running requests stalled per prompt step | arrival to admission ms (mean) "
          "| host ms per step: schedule / launch / wait / postprocess |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in served:
        print(step_row("server", c, served[c]))
        print(step_row("offline", c, offline[c]))
    print("\n| clients | HTTP arrival to engine add ms (mean) | server's TTFT ms (mean) | engine thread idle s "
          "| engine commands s | engine steps s | text / tokenize thread s | CPU s: event loop / engine / text / "
          "tokenize thread "
          "| GC s / kernel compiles (s) | run wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c, d in served.items():
        cpu = " / ".join(f"{d.get(f'{thread}_cpu_seconds', math.nan):.2f}"
                         for thread in ("event_loop", "engine", "text", "tokenize"))
        print(f"| {c} | {1e3 * d['add_delay_seconds'] / max(d['added'], 1):.1f} "
              f"| {1e3 * d['ttft_sum'] / max(d['ttft_count'], 1):.1f} | {d['idle_seconds']:.2f} "
              f"| {d['commands_seconds']:.2f} | {d['steps_seconds']:.2f} | {d['text_seconds']:.2f} / "
              f"{d['tokenize_seconds']:.2f} | {cpu} "
              f"| {d['gc_seconds']:.2f} / {d['kernel_compiles']:.0f} ({d['compile_seconds']:.2f}) | {walls[c]:.2f} |")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")


def run_clients(url: str, concurrency: int, requests: int, prompt_len: int, max_tokens: int, vocab: int,
                num_adapters: int, processes: int, when_warm: Callable[[], None]) -> dict:
    """The clients in `processes` groups (benchmarks/http_clients.py, one process each): every client's warm-up
    request (which also compiles the kernels of this batch's shapes), `when_warm()`, then the measured requests,
    started together; TTFT, inter-token latency and tokens over the wall time from the first group's start to the
    last one's end."""
    groups = [list(range(p, concurrency, processes)) for p in range(min(processes, concurrency))]
    work = [str(v) for v in (requests, prompt_len, max_tokens, vocab, num_adapters)]
    procs = [subprocess.Popen([sys.executable, str(CLIENTS), url, ",".join(map(str, g)), *work], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for g in groups]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client process failed to start or warm up (exit code {proc.wait()})")
        when_warm()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"a client process failed (exit code {proc.returncode})")
            outs.append(json.loads(out))
    finally:
        for proc in procs:
            proc.kill()
    results = [r for out in outs for r in out["results"]]
    wall = max(out["end"] for out in outs) - min(out["start"] for out in outs)
    ttft = sorted(t for t, _ in results)
    itl = [(a[-1] - a[0]) / (len(a) - 1) for _, a in results if len(a) > 1]
    tokens = sum(len(a) for _, a in results)
    return dict(ttft_p50=statistics.median(ttft), ttft_p90=ttft[math.ceil(0.9 * len(ttft)) - 1],
                itl=statistics.median(itl) if itl else float("nan"), tokens=tokens, wall=wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same kind, few tokens (CPU test)")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--adapters", type=int, default=8, help="adapters, a slot each, client i using adapter i %% N "
                                                           "(default 8)")
    p.add_argument("--requests", type=int, default=None, help="requests per client (default 4; tiny 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128; tiny 8")
    p.add_argument("--max-tokens", type=int, default=None, help="default 64; tiny 4")
    p.add_argument("--clients-per-process", type=int, default=8,
                   help="clients one client process runs (benchmarks/http_clients.py; default 8)")
    p.add_argument("--server-args", default="", help="more `moelora serve` flags, one string")
    p.add_argument("--step-trace", type=Path, default=None,
                   help="a folder for the step traces of the server (server.jsonl) and the offline engine (offline.jsonl), "
                        "warm-ups included: one JSON line per step (moelora/engine/step_stats.py)")
    args = p.parse_args()
    if args.adapters < 1:
        p.error(f"--adapters must be at least 1, got {args.adapters}")
    requests = args.requests or (2 if args.tiny else 4)
    prompt_len, max_tokens = args.prompt_len or (8 if args.tiny else 128), args.max_tokens or (4 if args.tiny else 64)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"

    def processes(clients: int) -> int:
        return math.ceil(clients / args.clients_per_process)

    config = qwen3_30b_a3b_config(tiny=args.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = write_dummy_checkpoint(config, work / "model")
        adapters = {f"a{i}": write_random_peft_adapter(config, work / f"a{i}", RANK, seed=i, device=device)
                    for i in range(args.adapters)}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = engine_argv(model_dir, adapters, device, shlex.split(args.server_args))
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        served, served_stats, walls, itl = {}, {}, {}, {}
        if args.step_trace is not None:
            args.step_trace.mkdir(parents=True, exist_ok=True)
        proc = start_server(argv, port, work / "server.log", args.step_trace and args.step_trace / "server.jsonl")
        try:
            t0 = time.perf_counter()
            wait_healthy(url, proc, timeout=900)
            name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
            print(f"# moelora HTTP serving benchmark, {name}, {datetime.date.today()}, torch {torch.__version__}, "
                  f"openai {openai.__version__}")
            print(f"model: {'tiny Qwen3-MoE' if args.tiny else 'Qwen3-30B-A3B'} sizes, dummy weights, {args.adapters} "
                  f"adapters of rank {RANK} (client i uses adapter i % {args.adapters}); server up in {time.perf_counter() - t0:.0f} s; "
                  f"prompts of {prompt_len} tokens, {max_tokens} greedy tokens each (ignore_eos), streamed; clients in processes "
                  f"of {args.clients_per_process}; server flags: "
                  f"{args.server_args or 'defaults'}\n")
            print("| concurrent clients | requests | TTFT p50 ms | TTFT p90 ms | inter-token ms (median) "
                  "| aggregate tokens/s |")
            print("|---|---|---|---|---|---|", flush=True)
            for c in concurrencies:
                before = {}
                r = run_clients(url, c, requests, prompt_len, max_tokens, config.vocab_size, args.adapters,
                                processes(c), when_warm=lambda: before.update(server_counters(url)))
                served_stats[c] = difference(server_counters(url), before)
                assert r["tokens"] == c * requests * max_tokens, f"got {r['tokens']} tokens"
                served[c], walls[c], itl[c] = r["tokens"] / r["wall"], r["wall"], r["itl"]
                print(f"| {c} | {c * requests} | {1e3 * r['ttft_p50']:.1f} | {1e3 * r['ttft_p90']:.1f} "
                      f"| {1e3 * r['itl']:.2f} | {served[c]:.0f} |", flush=True)
        except Exception:
            print((work / "server.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        if args.step_trace is not None:  # read when the offline engine is constructed
            os.environ["MOELORA_STEP_TRACE"] = str(args.step_trace / "offline.jsonl")
        offline, offline_stats, offline_step = offline_run(argv, concurrencies, requests, prompt_len, max_tokens,
                                                           config.vocab_size, args.adapters)
        print("\n| concurrent clients | offline engine tokens/s (same waves) | served / offline "
              "| offline decode step ms (median) | served inter-token / offline decode step |")
        print("|---|---|---|---|---|")
        for c in concurrencies:
            print(f"| {c} | {offline[c]:.0f} | {served[c] / offline[c]:.2f} | {1e3 * offline_step[c]:.2f} "
                  f"| {itl[c] / offline_step[c]:.2f} |")
        print_step_tables(served_stats, offline_stats, walls)


if __name__ == "__main__":
    main()
