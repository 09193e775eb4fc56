"""`moelora serve` and `moelora generate`: flags built from EngineConfig and SamplingParams, a real
server process answering the OpenAI client, one-shot generation printed."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version

import httpx
import openai
import pytest
import torch

from moelora.cli import build_parser, engine_kwargs, main
from moelora.distributed.launch import free_port
from moelora.engine.config import EngineConfig
from moelora.engine.sampling_params import SamplingParams
from tests.server.conftest import env, start_serve
from tests.support import out_of_gpu_memory_in, tiny_config, write_random_peft_adapter

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
    for targets in (["q_proj", "gate_up_proj"], ["all"]):
        assert engine_kwargs(["--model-path", "m", "--lora-target-modules", *targets])["lora_target_modules"] == targets
    assert engine_kwargs(["--model-path", "m", "--skip-server-warmup"])["skip_server_warmup"] is True  # SGLang's flag
    assert "skip_server_warmup" not in engine_kwargs(["--model-path", "m"])  # the config's default, False
    assert "enable_prefix_caching" not in engine_kwargs(["--model-path", "m"])  # the config's default, True
    for off in ("--no-enable-prefix-caching", "--disable-radix-cache"):  # vLLM's, SGLang's
        assert engine_kwargs(["--model-path", "m", off])["enable_prefix_caching"] is False
    serve_help = help_of("serve", capsys)
    assert all("--" + f.name.replace("_", "-") in serve_help for f in dataclasses.fields(EngineConfig))
    gen = parser.parse_args(["generate", "--model-path", "m", "--prompt", "p", "--stop", "a", "b", "--top-k", "5",
                             "--no-skip-special-tokens", "--lora", "x=/x"])
    assert gen.stop == ["a", "b"] and gen.top_k == 5 and gen.skip_special_tokens is False and gen.lora == ("x", "/x")
    generate_help = help_of("generate", capsys)
    # not flags: what `generate` does not print, and the options that are no scalar or list
    assert all("--" + f.name.replace("_", "-") in generate_help for f in dataclasses.fields(SamplingParams)
               if f.name not in ("logprobs", "prompt_logprobs", "logit_bias", "structured_output"))


def test_every_flag_has_a_description():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("serve", "generate", "inspect", "demo"):
        for action in commands[name]._actions:
            assert action.help and not action.help.startswith("default:"), (name, action.option_strings)
    assert all(f.metadata["help"] for cls in (EngineConfig, SamplingParams) for f in dataclasses.fields(cls))


def test_vllm_flag_names(capsys):
    sql = json.dumps({"name": "sql", "path": "/s", "base_model_name": "m"})
    args = build_parser().parse_args([
        "serve", "--model-path", "m", "--lora-modules", sql, "chat=/c", "--max-loras", "3", "--max-lora-rank", "16",
        "--max-model-len", "100", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "7",
        "--tensor-parallel-size", "1", "--chat-template", "t.jinja", "--served-model-name", "x",
        "--max-num-batched-tokens", "2048", "--shutdown-timeout", "30", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek-r1", "--enable-lora", "--enforce-eager",
        "--disable-log-stats", "--disable-log-requests", "--trust-remote-code", "--enable-chunked-prefill",
        "--uvicorn-log-level", "warning"])
    assert args.lora_paths == {"sql": "/s", "chat": "/c"} and args.max_loras_per_batch == 3
    assert args.max_lora_rank == 16 and args.context_length == 100 and args.mem_fraction_static == 0.5
    assert args.max_running_requests == 7 and args.tp_size == 1 and args.chat_template == "t.jinja"
    assert args.chunked_prefill_size == 2048 and args.shutdown_timeout == 30
    assert args.reasoning_parser == "deepseek_r1"  # (SGLang's spelling)
    assert args.disable_cuda_graph and args.log_stats_interval == 0
    assert args.log_level == "info" and args.uvicorn_log_level == "warning"  # (uvicorn's log only)
    assert "argument --tool-call-parser: invalid choice: 'mistral'" in usage_error(
        ["serve", "--model-path", "m", "--tool-call-parser", "mistral"], capsys)
    for bad in ['{"name": "sql"', '{"name": "sql"}']:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "--model-path", "m", "--lora-modules", bad])
        assert e.value.code == 2 and "--lora-modules" in capsys.readouterr().err
    for bad in ["-1", "nan"]:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "--model-path", "m", "--shutdown-timeout", bad])
        assert e.value.code == 2 and "--shutdown-timeout: must be 0 or more seconds" in capsys.readouterr().err


def usage_error(argv: list[str], capsys) -> str:
    """Exit status 2 and argparse's one-line error, before anything is loaded."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_port_out_of_range_is_a_usage_error(capsys):
    for bad in ["65536", "-1"]:
        assert "argument --port: must be a port number in 0..65535" in usage_error(
            ["serve", "--model-path", "m", "--port", bad], capsys)


def test_an_adapter_name_given_twice_is_a_usage_error(capsys):
    args = build_parser().parse_args(["serve", "--model-path", "m", "--lora-paths", "a=/x", "--lora-modules", "b=/y"])
    assert args.lora_paths == {"a": "/x", "b": "/y"}  # every use of the flag counts
    for argv in (["--lora-paths", "a=/x", "a=/y"], ["--lora-paths", "a=/x", "--lora-modules", "a=/y"]):
        assert "adapter name 'a' is given twice (/x and /y)" in usage_error(["serve", "--model-path", "m", *argv],
                                                                            capsys)


def test_errors_name_the_flags_of_the_fields(demo_dir):
    """A config field's error names its flags too: the user typed one of them, perhaps vLLM's."""
    one_error(moelora("generate", "--model-path", str(demo_dir / "model"), "--prompt", "x", "--max-model-len", "1",
                      *CPU), "generate", "EngineConfig.context_length (--context-length, --max-model-len) must be > 1")
    one_error(moelora("generate", "--model-path", str(demo_dir / "model"), "--prompt", "x", "--max-tokens", "0",
                      *CPU), "generate", "SamplingParams.max_tokens (--max-tokens) must be")


def test_server_flags_that_would_mean_nothing_are_usage_errors(capsys):
    """An empty API key (an unset variable's "--api-key $KEY") would turn authentication off; an empty served name
    names no model; a queue of 0 refuses every request, as a body cap of 0 MiB would; a negative stats interval logs at every step."""
    for flag, value, message in [("--api-key", "", "must not be empty"), ("--served-model-name", " ", "must not be empty"),
                                 # HTTP drops a header's surrounding whitespace: no request could match these
                                 ("--api-key", "abc ", "must not begin or end with whitespace"),
                                 ("--api-key", "clé", "must be printable ASCII"),
                                 ("--max-queued-requests", "0", "must be 1 or more"),
                                 ("--max-queued-requests", "-1", "must be 1 or more"),
                                 ("--max-request-mb", "0", "must be 1 or more"),
                                 ("--log-stats-interval", "-1", "must be 0 or more seconds"),
                                 ("--log-stats-interval", "nan", "must be 0 or more seconds")]:
        assert f"argument {flag}: {message}" in usage_error(["serve", "--model-path", "m", flag, value], capsys)


@pytest.mark.parametrize("key, message", [("   ", "must not be empty"),
                                          ("abc\n", "must not begin or end with whitespace")])
def test_an_api_key_from_the_environment_that_no_request_could_match_is_one_error_naming_it(monkeypatch, capsys, key,
                                                                                           message):
    monkeypatch.setenv("MOELORA_API_KEY", key)
    assert main(["serve", "--model-path", "m"]) == 1
    assert capsys.readouterr().err.startswith(f"moelora serve: error: $MOELORA_API_KEY (the default of --api-key) "
                                              f"{message}")


def test_inspect_max_lora_rank_below_1_is_a_usage_error(capsys):
    for bad in ["0", "-4"]:
        assert "argument --max-lora-rank: must be 1 or more" in usage_error(
            ["inspect", "adapter", "--max-lora-rank", bad], capsys)


def test_a_cuda_device_the_machine_lacks_is_one_error(demo_dir, monkeypatch, capsys):
    """Named before the model loads, not torch's AssertionError or invalid-ordinal RuntimeError from inside it."""
    argv = ["generate", "--model-path", str(demo_dir / "model"), "--prompt", "x"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*argv, "--device", "cuda"]) == 1
    assert capsys.readouterr().err == ("moelora generate: error: EngineConfig.device (--device) 'cuda': no CUDA device is "
                                       "available here; use 'cpu'\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main([*argv, "--device", "cuda:2"]) == 1
    assert capsys.readouterr().err == ("moelora generate: error: EngineConfig.device (--device) 'cuda:2': this machine has 2 "
                                       "CUDA device(s), from cuda:0\n")
    assert main([*argv, "--device", "cuda:1", "--tp-size", "2"]) == 1  # its rank 1 would be on cuda:2
    assert capsys.readouterr().err == ("moelora generate: error: EngineConfig.device (--device) 'cuda:1' with tp_size 2: the "
                                       "ranks on this node take cuda:1..cuda:2, and this machine has 2 CUDA "
                                       "device(s)\n")


def test_a_start_out_of_gpu_memory_is_one_error_naming_the_flags(demo_dir, monkeypatch, capsys):
    out_of_gpu_memory_in("prompt graphs", monkeypatch)
    argv = ["generate", "--model-path", str(demo_dir / "model"), "--prompt", "x", *CPU]
    assert main([*argv, "--cuda-graph-max-prefill-tokens", "16", "--max-total-tokens", "64"]) == 1
    assert capsys.readouterr().err == (
        "moelora generate: error: the GPU ran out of memory capturing the prompt CUDA graphs to 16 tokens: lower "
        "EngineConfig.cuda_graph_max_prefill_tokens (--cuda-graph-max-prefill-tokens) (0: prompt steps run eagerly), "
        "or leave it more memory with a smaller EngineConfig.max_total_tokens (--max-total-tokens) (KV cache slots, "
        "64 now)\n")


def test_a_reasoning_parser_for_a_model_that_does_not_think_is_one_error(demo_dir, capsys):
    argv = ["serve", "--model-path", str(demo_dir / "model"), *CPU, "--port", str(free_port())]
    assert main([*argv, "--reasoning-parser", "qwen3"]) == 1
    assert capsys.readouterr().err == ("moelora serve: error: --reasoning-parser qwen3: the tokenizer has no token "
                                       "<think> or </think>, which the model's thinking starts and ends with: is this a "
                                       "reasoning model?\n")


def test_an_unreadable_checkpoint_is_one_error_naming_its_file(demo_dir, tmp_path, capsys):
    """A truncated safetensors file (an interrupted download, a Git LFS pointer) or a broken shard index."""
    model = tmp_path / "model"
    shutil.copytree(demo_dir / "model", model)
    with open(model / "model.safetensors", "r+b") as f:
        f.truncate(100)
    argv = ["generate", "--model-path", str(model), "--prompt", "x", *CPU]
    assert main(argv) == 1
    assert capsys.readouterr().err.startswith(f"moelora generate: error: {model / 'model.safetensors'}: cannot be "
                                              "read as safetensors: ")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text('{"metadata": {}}')
    assert main(argv) == 1
    assert capsys.readouterr().err == (f"moelora generate: error: {model / 'model.safetensors.index.json'}: not a "
                                       "safetensors index (KeyError: 'weight_map')\n")


@pytest.mark.parametrize("edit, message", [
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be an int >= 1, got 0"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be an int >= 1, got 0"),
    ({"hidden_size": -128}, "hidden_size must be an int >= 1, got -128"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be an int >= 2, got 0"),
    ({"dtype": "int8"}, "dtype (torch_dtype) must name a floating-point torch dtype, got torch.int8"),
    # transformers' error: "module 'torch' has no attribute 'foo'"
    ({"dtype": "foo"}, "dtype (torch_dtype) must name a floating-point torch dtype, got 'foo'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be in [1, 8] (the routed experts), got 9"),
    # every logit NaN, the command's exit status 0
    ({"rope_parameters": {"rope_theta": 0, "rope_type": "default"}},
     "rope_parameters.rope_theta must be a finite number > 0, got 0"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a finite number > 0, got -1.0"),
    # a traceback
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": "2"}},
     "rope_parameters.factor must be a finite number > 0, got '2'"),
    # fp8 weights cast without their scales
    ({"quantization_config": {"quant_method": "fp8"}},
     "quantization_config (quant_method 'fp8'): quantized checkpoints are not served"),
    ({"architectures": "Qwen3MoeForCausalLM"},
     "architectures must be a list of class names, got 'Qwen3MoeForCausalLM'"),
])
def test_a_config_json_that_cannot_be_a_model_is_one_error_naming_its_field(demo_dir, tmp_path, capsys, edit,
                                                                            message):
    """Values that once divided by zero, sized a tensor below zero, or failed every request at its first step."""
    model = tmp_path / "model"
    shutil.copytree(demo_dir / "model", model)
    config = json.loads((model / "config.json").read_text())
    config.update(edit)
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    assert main(["generate", "--model-path", str(model), "--prompt", "x", *CPU]) == 1
    assert capsys.readouterr().err == f"moelora generate: error: {model / 'config.json'}: {message}\n"


def test_a_rank_failure_is_a_line_per_rank():
    from moelora.cli import _ranks_in_a_line_each
    message = ("loading the model failed on the tensor-parallel ranks (ValueError: x); rank 1 failed:\nTraceback (most "
               "recent call last):\n  File \"a.py\", line 1\nValueError: the vocabulary does not split\nrank 2 exited "
               "with code -9 (signal 9)\nrank 3 failed:\nTraceback (most recent call last):\nOSError: gone")
    assert _ranks_in_a_line_each(message) == (
        "loading the model failed on the tensor-parallel ranks (ValueError: x); rank 1 raised ValueError: the "
        "vocabulary does not split; rank 2 exited with code -9 (signal 9); rank 3 raised OSError: gone")
    assert _ranks_in_a_line_each("rank 1 is still running: it did not answer in time") == \
        "rank 1 is still running: it did not answer in time"


def test_ctrl_c_while_loading_is_one_line_and_status_130(demo_dir, monkeypatch, capsys):
    import moelora.engine.model_runner as model_runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(model_runner, "load_model", interrupted)
    assert main(["generate", "--model-path", str(demo_dir / "model"), "--prompt", "x", *CPU]) == 130
    assert capsys.readouterr().err == "moelora generate: interrupted\n"


def test_an_unreadable_tokenizer_is_one_error_naming_its_directory(demo_dir, tmp_path, capsys):
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(demo_dir / "model", tokenizer, ignore=shutil.ignore_patterns("*.safetensors"))
    argv = ["generate", "--model-path", str(demo_dir / "model"), "--tokenizer-path", str(tokenizer), "--prompt", "x",
            *CPU]
    for broken, error in [("{x", "JSONDecodeError"), ('{"version": "1.0"}', "KeyError")]:  # not JSON; no tokenizer
        (tokenizer / "tokenizer.json").write_text(broken)
        assert main(argv) == 1
        assert capsys.readouterr().err.startswith(f"moelora generate: error: EngineConfig.tokenizer_path "
                                                  f"(--tokenizer-path) '{tokenizer}': its tokenizer files cannot be "
                                                  f"read: {error}: ")


def test_generate_prints_the_completion(demo_dir, reference, capsys):
    argv = ["generate", "--model-path", str(demo_dir / "model"), "--lora", f"beta={demo_dir / 'beta'}",
            "--prompt", "Hello world", "--max-tokens", "6", "--temperature", "0", *CPU]
    assert main(argv) == 0
    want = reference.generate("Hello world", SamplingParams(max_tokens=6, temperature=0.0), lora="beta")[0].text
    assert capsys.readouterr().out == want + "\n"


def moelora(*argv: str) -> subprocess.CompletedProcess:
    """The installed `moelora` command, run on this worktree's package."""
    command = shutil.which("moelora")
    assert command is not None, "the moelora command is not installed (pip install -e .)"
    return subprocess.run([command, *argv], env=env(), capture_output=True, text=True, timeout=120)


def one_error(run: subprocess.CompletedProcess, command: str, *parts: str) -> str:
    """Exit status 1 and a single error line (after the command's name) holding every part."""
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith(f"moelora {command}: error: ") and all(p in run.stderr for p in parts), run.stderr
    return run.stderr


@pytest.fixture(scope="module")
def other_model_adapter(tmp_path_factory):
    """A PEFT adapter of another Qwen3-MoE (hidden size 16, not the demo's 64)."""
    return write_random_peft_adapter(tiny_config("qwen3_moe"), tmp_path_factory.mktemp("other-adapter"), 4, 1)


def test_cli_errors_are_one_message_and_exit_status_1(demo_dir, other_model_adapter, tmp_path):
    model = ["--model-path", str(demo_dir / "model")]
    bare = tmp_path / "bare"  # the model without its tokenizer
    shutil.copytree(demo_dir / "model", bare, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    with socket.socket() as taken:  # another process's port; a host that is nowhere: found before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [  # (argv, parts of the one error line)
            (("generate", "--model-path", str(tmp_path / "nope"), "--prompt", "x", *CPU),
             ("not a local model directory",)),
            (("generate", "--model-path", "Qwen/Qwen3-30B-A3B", "--prompt", "x", *CPU),
             ("EngineConfig.model_path (--model-path) 'Qwen/Qwen3-30B-A3B'", "not Hub ids")),
            (("generate", *model, "--tokenizer-path", "Qwen/Qwen3-8B", "--prompt", "x", *CPU),
             ("EngineConfig.tokenizer_path (--tokenizer-path) 'Qwen/Qwen3-8B' is not a local directory",)),
            (("serve", *model, "--lora-paths", f"x={tmp_path / 'nope'}", *CPU),
             ("nope: does not exist (an adapter directory expected)",)),
            (("serve", *model, "--lora-paths", f"x={demo_dir / 'model' / 'config.json'}", *CPU),
             ("config.json: is a file, not an adapter directory",)),
            (("serve", *model, "--lora-target-modules", "q_proj", "w1", *CPU),
             ("EngineConfig.lora_target_modules (--lora-target-modules): the model has no module 'w1'",)),
            (("serve", *model, "--tensor-parallel-size", "3", "--ep-size", "2", *CPU),
             ("EngineConfig.ep_size (--ep-size, --expert-parallel-size, --ep) must be a divisor of tp_size (3)",)),
            # the ranks raise while loading: each in a line of the message, not its traceback
            (("generate", *model, "--prompt", "x", "--tp-size", "3", *CPU),
             ("loading the model failed on the tensor-parallel ranks (ValueError: the vocabulary (",
              "does not split evenly over 3 ranks); rank 1 raised ValueError: the vocabulary (",
              "; rank 2 raised ValueError: the vocabulary (")),
            (("serve", *model, "--chat-template", "nope.jinja", *CPU),
             ("EngineConfig.chat_template (--chat-template) 'nope.jinja' is neither a readable file",)),
            (("serve", *model, "--port", str(port), *CPU),
             (f"cannot listen on 127.0.0.1:{port} (--host, --port): Address already in use",)),
            (("serve", *model, "--host", "999.1.1.1", *CPU), ("cannot listen on 999.1.1.1:30000",)),
            (("serve", *model, "--context-length", "100000", *CPU),
             ("EngineConfig.context_length (--context-length, --max-model-len) 100000 is longer than the model's "
              "positions, 512 by its config.json (max_position_embeddings, rope_scaling)",
              "set MOELORA_ALLOW_LONG_CONTEXT_LENGTH=1 to serve it all the same")),
            (("generate", *model, "--prompt", "x", "--device", "cuda:x", "--dtype", "float32"),
             ("EngineConfig.device (--device) must be 'cuda', 'cuda:N' or 'cpu', got 'cuda:x'",)),
            (("generate", "--model-path", str(bare), "--prompt", "x", *CPU),
             ("a text prompt needs a tokenizer", "has no tokenizer files (none of tokenizer.json")),
        ]
        with ThreadPoolExecutor(4) as pool:  # (each run is mostly its imports: side by side)
            runs = list(pool.map(lambda case: moelora(*case[0]), cases))
    for (argv, parts), run in zip(cases, runs):
        one_error(run, argv[0], *parts)


def test_an_adapter_of_another_model_lists_its_problems(demo_dir, other_model_adapter):
    run = moelora("generate", "--model-path", str(demo_dir / "model"), "--lora", f"x={other_model_adapter}",
                  "--prompt", "x", *CPU)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    head, *problems = run.stderr.strip().splitlines()
    assert head == f"moelora generate: error: adapter {other_model_adapter}: {len(problems)} problem(s):"
    assert len(problems) > 4 and all(p.startswith("  - ") and "do not fit" in p for p in problems)


def test_the_engine_and_the_cli_need_no_server_packages():
    """The GPU machine has none of them: only `moelora serve` may import them."""
    code = ("import sys\n"
            "for m in ('fastapi', 'uvicorn', 'pydantic', 'prometheus_client', 'starlette', 'openai', 'httpx'):\n"
            "    sys.modules[m] = None\n"
            "from moelora.cli import build_parser\n"
            "build_parser().parse_args(['serve', '--model-path', 'm'])\n"
            "import moelora.engine.engine, moelora.demo\n")
    subprocess.run([sys.executable, "-c", code], env=env(), check=True)


def test_serve_starts_a_server(demo_dir, reference, tmp_path):
    """With vLLM's flag names; the log says what it serves. With --disable-runtime-lora-updating no adapter can be
    loaded or unloaded."""
    port, log = free_port(), tmp_path / "serve.log"
    alpha = json.dumps({"name": "alpha", "path": str(demo_dir / "alpha")})
    proc = start_serve([shutil.which("moelora"), "serve", "--model-path", str(demo_dir / "model"), "--lora-modules",
                        alpha, "--served-model-name", "base", "--max-loras", "1", "--max-model-len", "64",
                        "--max-num-seqs", "4", "--disable-runtime-lora-updating", "--port", str(port), *CPU], port, log)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["base", "alpha"]
        out = client.completions.create(model="alpha", prompt="Hello world", max_tokens=5, temperature=0)
        want = reference.generate("Hello world", SamplingParams(max_tokens=5, temperature=0.0), lora="alpha")[0]
        assert out.choices[0].text == want.text
        with pytest.raises(openai.BadRequestError, match="the context holds 64"):
            client.completions.create(model="alpha", prompt="Hello world", max_tokens=63)
        with pytest.raises(openai.BadRequestError, match="max_running_requests \\(4\\)"):
            client.completions.create(model="alpha", prompt="Hello world", n=5)
        for route, body in (("load_lora_adapter", {"lora_name": "g", "lora_path": str(demo_dir / "gamma")}),
                            ("unload_lora_adapter", {"lora_name": "alpha"})):
            for prefix in ("/v1", ""):
                r = httpx.post(f"http://127.0.0.1:{port}{prefix}/{route}", json=body, timeout=30)
                assert r.status_code == 404, (route, r.text)
        assert [m.id for m in client.models.list().data] == ["base", "alpha"]
        logged = log.read_text()
        for line in ["as 'base', its adapters fixed (load and unload routes off)",
                     f"moelora.server.app: model {demo_dir / 'model'}: Qwen3MoeForCausalLM, float32 on cpu",
                     "context 64 tokens; up to 4 running requests", "LoRA: 1 GPU slots of rank 8",
                     "LoRA slots on self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, "
                     "mlp.experts.gate_proj, mlp.experts.up_proj, mlp.experts.down_proj; none on mlp.gate",
                     f"adapter alpha: {demo_dir / 'alpha'} (rank 8, "]:
            assert line in logged, logged
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after shutting down


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"moelora {version('moelora')}\n"


def test_a_source_tree_never_installed_runs_with_an_unknown_version(capsys, monkeypatch):
    """Run from a checkout on PYTHONPATH (as the GPU scripts do) the distribution has no metadata: the CLI starts
    all the same, its version unknown, where building its parser raised PackageNotFoundError."""
    from moelora.server import version as package

    def not_installed(name):
        raise PackageNotFoundError(name)
    monkeypatch.setattr(package, "version", not_installed)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == "moelora unknown\n"
