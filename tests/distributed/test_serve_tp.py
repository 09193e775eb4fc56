"""`moelora serve --tp-size 2 --ep-size 2` on the demo's tiny Qwen3-MoE: the flags parse into an engine that
starts its second rank, and completions (an adapter loaded over HTTP among them) are those of one rank; the real
command, a process of its own, serves them over HTTP and stops with its rank on SIGTERM or SIGINT. Over two
"nodes" of this machine, `moelora serve --nnodes 2 --node-rank 1` serves node 0's engine and ends with it, or with
a one-line error when its rank fails, which node 0's error names."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

import moelora.engine.model_runner as model_runner
from moelora.cli import _fields_of, build_parser
from moelora.distributed.launch import START_TIMEOUT, free_port
from moelora.engine.config import EngineConfig
from moelora.engine.engine import Engine, RequestFailed
from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from tests.server.conftest import (ENGINE_OPTIONS, assert_clean_shutdown, children, demo_dir, env,  # noqa: F401
                                   reference, running, serve_argv, start_serve, stop_all, wait_ended)

PROMPT = "the quick brown fox"


def test_serve_over_two_ranks(demo_dir):  # noqa: F811
    argv = ["serve", "--model-path", str(demo_dir / "model"), "--lora-paths", f"alpha={demo_dir / 'alpha'}",
            "--tp-size", "2", "--ep-size", "2", "--device", "cpu", "--dtype", "float32", "--max-lora-rank", "8",
            "--max-loras-per-batch", "2"]
    args = build_parser().parse_args(argv)
    engine = Engine(**_fields_of(args, EngineConfig))
    assert (engine.config.tp_size, engine.config.ep_size) == (2, 2)
    one = Engine(str(demo_dir / "model"), lora_paths={n: str(demo_dir / n) for n in ("alpha", "gamma")},
                 **ENGINE_OPTIONS)
    try:
        with TestClient(create_app(engine, "tiny-moe")) as client:
            loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")})
            assert loaded.status_code == 200, loaded.text
            for model in ("alpha", "gamma", "tiny-moe"):
                reply = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                              "temperature": 0})
                assert reply.status_code == 200, reply.text
                lora = None if model == "tiny-moe" else model
                want = one.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), lora=lora)[0].text
                assert reply.json()["choices"][0]["text"] == want, model
    finally:
        engine.shutdown()


def _greedy(engine: Engine, model: str) -> str:
    """One rank's greedy completion of PROMPT by `model` (the base model's served name, or an adapter's)."""
    lora = None if model == "tiny-moe" else model
    return engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), lora=lora)[0].text


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_moelora_serve_process(demo_dir, reference, tmp_path, stop):  # noqa: F811
    """`moelora serve --tp-size 2 --ep-size 2` run as the command it is, over HTTP: completions (streamed too) of the
    base model, of an adapter given at start and of one loaded over HTTP are one rank's, and the log names the layout.
    `stop` (what a process manager sends, or Ctrl-C) ends it at once with its rank, which it stops itself: none runs
    once it exited, and its log ends with uvicorn's shutdown, no traceback or warning after it."""
    port, log = free_port(), tmp_path / "serve.log"
    command = [sys.executable, "-m", "moelora.cli",
               *serve_argv(demo_dir, "--tp-size", "2", "--ep-size", "2", "--served-model-name", "tiny-moe",
                            "--port", str(port))]
    proc = start_serve(command, port, log, timeout=START_TIMEOUT + 60)  # the rank's imports may take that long
    started: dict[int, str] = {}  # what the server started: its rank, multiprocessing's resource tracker
    try:
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for model in ("tiny-moe", "alpha"):
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
            assert out.choices[0].text == _greedy(reference, model), model
        stream = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == _greedy(reference, "alpha")
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "gamma",
                                                                 "lora_path": str(demo_dir / "gamma")})
        assert loaded.status_code == 200, loaded.text
        out = client.completions.create(model="gamma", prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == _greedy(reference, "gamma")
        unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert unloaded.status_code == 200, unloaded.text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
        assert [m.id for m in client.models.list().data] == ["tiny-moe", "alpha"]
        assert "moelora.server.app: parallel: 2 ranks, tensor parallel with the experts over 2 groups " \
               "(all_reduce dispatch); per rank: weights " in log.read_text()

        started.update(children(proc.pid))
        ranks = [pid for pid, cmdline in started.items() if "spawn_main" in cmdline]  # multiprocessing's spawned
        assert len(ranks) == 1, started  # rank 1 (rank 0 is the server's own process)
        proc.send_signal(stop)
        assert proc.wait(timeout=60) in (0, -stop)  # uvicorn raises SIGTERM again once it shut down: -SIGTERM
        # its shutdown joined the rank: none outlives it (one orphaned, or hanging, would still run here)
        assert not [pid for pid in ranks if running(pid)], started
        wait_ended(started, 10)  # multiprocessing's resource tracker ends once every process holding it did
        assert_clean_shutdown(log)  # the resource tracker's last words included
    finally:  # after a failed check: nothing left running
        stop_all(proc, started)


def _second_node(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_serve_on_a_second_node(demo_dir):  # noqa: F811
    """Node 1's `moelora serve` says what it does, serves no HTTP, and exits with 0 once node 0 shut down."""
    addr = f"127.0.0.1:{free_port()}"
    nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = _second_node(f"import sys\nfrom moelora.cli import main\n"
                         f"sys.exit(main({serve_argv(demo_dir, *nodes, '--node-rank', '1')!r}))")
    try:
        engine = Engine(**_fields_of(build_parser().parse_args(serve_argv(demo_dir, *nodes)), EngineConfig))
        with TestClient(create_app(engine, "tiny-moe")) as client:
            reply = client.post("/v1/completions", json={"model": "alpha", "prompt": PROMPT, "max_tokens": 8,
                                                          "temperature": 0})
        engine.shutdown()
        out, err = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node1.returncode == 0, err[-3000:]
    assert out == f"moelora serve: node 1 of 2 runs rank 1 of node 0's engine at {addr} (node 0 serves HTTP) until " \
                  "it shuts down\n"
    one = Engine(str(demo_dir / "model"), lora_paths={"alpha": str(demo_dir / "alpha")}, **ENGINE_OPTIONS)
    want = one.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), lora="alpha")[0].text
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want


def test_health_says_503_once_a_rank_died(demo_dir):  # noqa: F811
    """Rank 1 killed while the server is idle: /health says 503 within moments (no request had to fail first), and
    the next request is refused at once, a 503 naming the rank; the engine has left the ranks' world."""
    engine = Engine(str(demo_dir / "model"), lora_paths={"alpha": str(demo_dir / "alpha")}, tp_size=2,
                    **ENGINE_OPTIONS)
    try:
        with TestClient(create_app(engine, "tiny-moe")) as client:
            assert client.get("/health").status_code == 200
            os.kill(engine.workers.ranks.procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            while (health := client.get("/health").status_code) == 200 and time.monotonic() < killed + 5:
                time.sleep(0.05)
            assert health == 503
            reply = client.post("/v1/completions", json={"model": "alpha", "prompt": PROMPT, "max_tokens": 4})
            assert reply.status_code == 503, reply.text
            message = reply.json()["error"]["message"]
            assert message.startswith("the engine cannot run any more: ") and \
                "rank 1 exited with code -9 (signal 9)" in message, message
            assert engine.fatal is not None and not torch.distributed.is_initialized()
            assert client.get("/health").status_code == 503
    finally:
        engine.shutdown()


def _dies_at_its_second_step(rank: int, config: EngineConfig, init_method: str) -> None:
    """serve_rank, killed (SIGKILL) as it runs its second step."""
    execute, steps = model_runner.ModelRunner.execute, []

    def dying(self, inputs, fill=None):
        steps.append(inputs)
        if len(steps) == 2:
            os.kill(os.getpid(), 9)
        return execute(self, inputs, fill)
    model_runner.ModelRunner.execute = dying
    model_runner.serve_rank(rank, config, init_method)


def test_a_rank_of_the_second_node_that_dies(demo_dir):  # noqa: F811
    """Node 0's engine fails naming rank 1 of the other node; node 1's `moelora serve` ends with status 1 and a
    line saying which of its ranks failed and how."""
    addr = f"127.0.0.1:{free_port()}"
    nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = _second_node("import sys\nimport moelora.engine.engine\nfrom moelora.cli import main\n"
                         "from tests.distributed.test_serve_tp import _dies_at_its_second_step\n"
                         "moelora.engine.engine.serve_rank = _dies_at_its_second_step\n"
                         f"sys.exit(main({serve_argv(demo_dir, *nodes, '--node-rank', '1')!r}))")
    try:
        engine = Engine(**_fields_of(build_parser().parse_args(serve_argv(demo_dir, *nodes)), EngineConfig))
        with pytest.raises(RequestFailed) as failed:
            engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
        engine.shutdown()
        _, err = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert "a step failed on the tensor-parallel ranks" in str(failed.value)
    assert "rank 1 exited with code -9 (signal 9) (on another node: its node's output says why)" in str(failed.value)
    assert node1.returncode == 1
    # (then, maybe, the resource tracker's word on the semaphore the killed rank held)
    assert f"moelora serve: error: node 1 of the engine at {addr}: rank 1 exited with code -9 (signal 9)" in \
        err.splitlines(), err
