"""`moelora serve --tp-size 2 --ep-size 2` on the demo's tiny Qwen3-MoE: the flags parse into an engine that
starts its second rank, and completions (an adapter loaded over HTTP among them) are those of one rank. Over two
"nodes" of this machine, `moelora serve --nnodes 2 --node-rank 1` serves node 0's engine and ends with it, or with
a one-line error when its rank fails, which node 0's error names."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

import moelora.engine.model_runner as model_runner
from moelora.cli import _fields_of, build_parser
from moelora.distributed.launch import free_port
from moelora.engine.config import EngineConfig
from moelora.engine.engine import Engine, RequestFailed
from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, demo_dir  # noqa: F401  (session fixture, shared)

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


def _serve_argv(root, *flags: str) -> list[str]:
    return ["serve", "--model-path", str(root / "model"), "--lora-paths", f"alpha={root / 'alpha'}",
            "--device", "cpu", "--dtype", "float32", "--max-lora-rank", "8", "--max-loras-per-batch", "2", *flags]


def _second_node(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serve_on_a_second_node(demo_dir):  # noqa: F811
    """Node 1's `moelora serve` says what it does, serves no HTTP, and exits with 0 once node 0 shut down."""
    addr = f"127.0.0.1:{free_port()}"
    nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = _second_node(f"import sys\nfrom moelora.cli import main\n"
                         f"sys.exit(main({_serve_argv(demo_dir, *nodes, '--node-rank', '1')!r}))")
    try:
        engine = Engine(**_fields_of(build_parser().parse_args(_serve_argv(demo_dir, *nodes)), EngineConfig))
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
                         f"sys.exit(main({_serve_argv(demo_dir, *nodes, '--node-rank', '1')!r}))")
    try:
        engine = Engine(**_fields_of(build_parser().parse_args(_serve_argv(demo_dir, *nodes)), EngineConfig))
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
