"""`moelora serve` and `moelora generate`: flags built from EngineConfig and SamplingParams, a real
server process answering the OpenAI client, one-shot generation printed."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from moelora.cli import build_parser, main
from moelora.engine.config import EngineConfig
from moelora.engine.sampling_params import SamplingParams
from tests.server.conftest import free_port

CPU = ["--device", "cpu", "--dtype", "float32"]


def help_of(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return capsys.readouterr().out


def test_flags_follow_the_config_fields(capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "--model-path", "m", "--lora-paths", "a=/x", "/y", "--max-lora-rank", "8",
                              "--disable-cuda-graph", "--mem-fraction-static", "0.5", "--port", "1234"])
    assert args.lora_paths == {"a": "/x", "/y": "/y"} and args.max_lora_rank == 8 and args.disable_cuda_graph is True
    assert args.mem_fraction_static == 0.5 and args.port == 1234 and not hasattr(args, "max_total_tokens")  # unset
    serve_help = help_of("serve", capsys)
    assert all("--" + f.name.replace("_", "-") in serve_help for f in dataclasses.fields(EngineConfig))
    gen = parser.parse_args(["generate", "--model-path", "m", "--prompt", "p", "--stop", "a", "b", "--top-k", "5",
                             "--no-skip-special-tokens", "--lora", "x=/x"])
    assert gen.stop == ["a", "b"] and gen.top_k == 5 and gen.skip_special_tokens is False and gen.lora == ("x", "/x")
    generate_help = help_of("generate", capsys)
    # not flags: what `generate` does not print, and the options that are no scalar or list
    assert all("--" + f.name.replace("_", "-") in generate_help for f in dataclasses.fields(SamplingParams)
               if f.name not in ("logprobs", "prompt_logprobs", "logit_bias", "structured_output"))


def test_generate_prints_the_completion(demo_dir, reference, capsys):
    argv = ["generate", "--model-path", str(demo_dir / "model"), "--lora", f"beta={demo_dir / 'beta'}",
            "--prompt", "Hello world", "--max-tokens", "6", "--temperature", "0", *CPU]
    assert main(argv) == 0
    want = reference.generate("Hello world", SamplingParams(max_tokens=6, temperature=0.0), lora="beta")[0].text
    assert capsys.readouterr().out == want + "\n"


def env() -> dict[str, str]:
    """This process's import path for a child python (this worktree's moelora first)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_the_engine_and_the_cli_need_no_server_packages():
    """The GPU machine has none of them: only `moelora serve` may import them."""
    code = ("import sys\n"
            "for m in ('fastapi', 'uvicorn', 'pydantic', 'prometheus_client', 'starlette', 'openai', 'httpx'):\n"
            "    sys.modules[m] = None\n"
            "from moelora.cli import build_parser\n"
            "build_parser().parse_args(['serve', '--model-path', 'm'])\n"
            "import moelora.engine.engine, moelora.demo\n")
    subprocess.run([sys.executable, "-c", code], env=env(), check=True)


def test_serve_starts_a_server(demo_dir, reference):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moelora.cli", "serve", "--model-path", str(demo_dir / "model"),
                             "--lora-paths", f"alpha={demo_dir / 'alpha'}", "--served-model-name", "base",
                             "--port", str(port), "--log-level", "warning", *CPU], env=env())
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["base", "alpha"]
        out = client.completions.create(model="alpha", prompt="Hello world", max_tokens=5, temperature=0)
        want = reference.generate("Hello world", SamplingParams(max_tokens=5, temperature=0.0), lora="alpha")[0]
        assert out.choices[0].text == want.text
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after shutting down


def test_version_and_errors_without_traceback(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("moelora ")
    assert main(["generate", "--model-path", str(tmp_path / "nope"), "--prompt", "x"] + CPU) == 1
    err = capsys.readouterr().err
    assert err.startswith("moelora generate: error: EngineConfig.model_path") and "not a local model directory" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
