"""The `moelora` command. One function per subcommand; `main` dispatches on the subcommand name."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import re
import sys
import types
import typing
from pathlib import Path

from moelora.server.reasoning import PARSERS as REASONING_PARSERS
from moelora.server.version import package_version


def inspect(args: argparse.Namespace) -> int:
    from moelora.engine import MAX_LORA_RANK
    from moelora.lora.report import format_report, inspect_adapter

    if args.max_lora_rank is not None and args.max_lora_rank > MAX_LORA_RANK:
        raise ValueError(f"--max-lora-rank must be in 1..{MAX_LORA_RANK} (the engine's largest), got "
                         f"{args.max_lora_rank}")
    report = inspect_adapter(args.adapter, args.model, args.max_lora_rank or MAX_LORA_RANK,
                             slot_rank=args.max_lora_rank)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] else 0


def demo(args: argparse.Namespace) -> int:
    from moelora.demo import ADAPTERS, NO_EXPERTS, PROMPTS, describe, run, verify

    root = Path(args.dir)
    verify(root)
    print(f"moelora demo: the bundled demo from {root} (files checked against its SHA256SUMS)")
    for line in describe(root):
        print("  " + line)
    models = ["base", *[m for name in ADAPTERS for m in (name, name + NO_EXPERTS)]]
    print(f"one batch of {len(PROMPTS) * len(models) * 2} requests on the CPU: {len(PROMPTS)} prompts x "
          f"{len(models)} models ({', '.join(models)}; '{NO_EXPERTS}': the adapter without its expert LoRA, a "
          f"temporary copy) x greedy and sampled (temperature {args.temperature}, seed {args.seed}); "
          "nothing is written\n")
    result = run(root, args.max_tokens, args.temperature, args.seed)
    width = max(map(len, models))
    for prompt in PROMPTS:
        print(repr(prompt))
        for c in (c for c in result.completions if c.prompt == prompt):
            print(f"  {c.model:<{width}}  greedy  | {c.greedy.strip()}")
            print(f"  {'':<{width}}  sampled | {c.sampled.strip()}")
        print()
    print(f"{result.tokens} tokens in {result.seconds:.1f} s: {result.tokens / result.seconds:.0f} tokens/s "
          f"(one batch, CPU, float32)")
    return 0


def serve(args: argparse.Namespace) -> int:
    from moelora.distributed.launch import name_ranks
    from moelora.engine import Engine, node_ranks, serves_engine
    from moelora.server.app import bind_socket, create_app, run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    api_key = args.api_key or _api_key_from_environment()
    fields = _fields_of(args, _engine_config())
    config = _engine_config()(**fields)
    if config.node_rank > 0:  # the Engine below serves node 0's and ends the process once it shut down: no HTTP here
        print(f"moelora serve: node {config.node_rank} of {config.nnodes} runs {name_ranks(node_ranks(config))} of "
              f"node 0's engine at {config.dist_init_addr} (node 0 serves HTTP) until it shuts down", flush=True)
    sock = bind_socket(args.host, args.port) if serves_engine(config) else None  # rank 0 of node 0 serves HTTP
    engine = Engine(**fields)
    # "." is the directory it names; a symlink keeps its own name (not its target's, a snapshot hash)
    name = args.served_model_name or Path(os.path.abspath(args.model_path)).name
    try:
        app = create_app(engine, name, args.max_queued_requests, api_key, args.log_stats_interval,
                         args.max_request_mb << 20, args.watchdog_timeout, args.reasoning_parser,
                         args.grammar_compile_timeout, not args.disable_runtime_lora_updating)
    except BaseException:
        engine.shutdown()
        raise
    # the model's, tokenizer's and kernels' objects live as long as the process: out of the cyclic collector's
    # scans, whose full collections would otherwise walk them all while every thread waits (as vLLM does)
    gc.collect()
    gc.freeze()
    try:
        run_server(app, sock, args.host, args.port, args.uvicorn_log_level or args.log_level, args.shutdown_timeout)
    finally:
        engine.shutdown()  # the other ranks, with tp_size > 1, if the app's shutdown did not (it failed first)
        # collectable again for the interpreter's exit: frozen, Triton's objects outlived it and nanobind printed a
        # report of hundreds of "leaked" instances, types and functions after a clean shutdown (Ctrl-C)
        gc.unfreeze()
    return 0


def generate(args: argparse.Namespace) -> int:
    from moelora.engine import Engine, SamplingParams

    lora_paths = dict([args.lora]) if args.lora else {}
    engine = Engine(**{**_fields_of(args, _engine_config()), "lora_paths": lora_paths})
    params = SamplingParams(**_fields_of(args, SamplingParams))
    try:
        for out in engine.generate(args.prompt, params, lora=args.lora[0] if args.lora else None):
            print(out.text)
    finally:
        engine.shutdown()
    return 0


def _engine_config() -> type:
    from moelora.engine import EngineConfig  # imports torch: only for the commands that run the engine
    return EngineConfig


def _seconds(value: str) -> float:
    """A duration in seconds, 0 or more."""
    seconds = float(value)
    if not seconds >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {value}")
    return seconds


def _port(value: str) -> int:
    """A TCP port number: uvicorn binds only after the model loaded, and a number out of range then ends in a
    traceback of asyncio's."""
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0..65535, got {value}")
    return port


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return number


def _non_empty(value: str) -> str:
    """A name or key: an empty one (an unset variable's "$KEY") would mean none at all."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _api_key(value: str) -> str:
    problem = _api_key_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def _api_key_problem(key: str) -> str | None:
    """Why no request could ever present `key` in its Authorization header, if so."""
    if not key.strip():
        return "must not be empty"
    if key != key.strip():
        return "must not begin or end with whitespace (HTTP drops it from a header, so no request could match)"
    if not key.isascii() or not key.isprintable():
        return "must be printable ASCII (what an HTTP header carries)"
    return None


def _api_key_from_environment() -> str | None:
    key = os.environ.get("MOELORA_API_KEY")
    if not key:  # unset or empty: no authentication
        return None
    problem = _api_key_problem(key)
    if problem:
        raise ValueError(f"$MOELORA_API_KEY (the default of --api-key) {problem}")
    return key


def _name_path(value: str) -> tuple[str, str]:
    """NAME=PATH, or PATH named after itself (as SGLang's --lora-paths), or vLLM's --lora-modules JSON
    '{"name": NAME, "path": PATH}'."""
    if value.lstrip().startswith("{"):
        try:
            module = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value}") from e
        if not (isinstance(module, dict) and isinstance(module.get("name"), str)
                and isinstance(module.get("path"), str)):
            raise argparse.ArgumentTypeError(f'a JSON adapter needs string "name" and "path" fields, got {value}')
        return module["name"], module["path"]
    name, sep, path = value.partition("=")
    return (name, path) if sep else (value, value)


def _add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One --flag per field of the dataclass (SGLang's spelling: --max-lora-rank for max_lora_rank, and
    the aliases in the field's metadata), described by the field's metadata help, so the command line
    cannot drift from the config. Unset flags keep the dataclass's defaults."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags, kind = ["--" + f.name.replace("_", "-"), *f.metadata["aliases"]], hints[f.name]
        options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "" if default is None or default is False or "default:" in f.metadata["help"] else f" (default: {default})"
        common = dict(default=argparse.SUPPRESS, help=f.metadata["help"] + shown)
        if kind is bool:
            parser.add_argument(*flags, action="store_true" if not default else argparse.BooleanOptionalAction,
                                **common)
        elif (seq := next((o for o in options if typing.get_origin(o) in (list, tuple)), None)) is not None:
            parser.add_argument(*flags, nargs="+", type=typing.get_args(seq)[0], **common)
        elif (scalar := next((o for o in options if o in (int, float, str)), None)) is not None:
            parser.add_argument(*flags, type=scalar, **common)


def engine_kwargs(serve_argv: list[str]) -> dict:
    """The Engine keyword arguments a `moelora serve` command line (the arguments after "serve") makes: what a
    benchmark gives an offline engine to compare it with the server on the same settings."""
    return _fields_of(build_parser().parse_args(["serve", *serve_argv]), _engine_config())


def _fields_of(args: argparse.Namespace, cls: type) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelora", description="Serving engine for MoE models with many LoRA adapters.")
    parser.add_argument("--version", action="version", version=f"moelora {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("inspect", help="describe and validate a LoRA adapter directory")
    p.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors or .bin)")
    p.add_argument("--model", help="local base model directory (config.json); without it only the file is described")
    p.add_argument("--max-lora-rank", type=_positive_int,
                   help="the engine's maximum rank (also the slot rank for memory)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=inspect)

    from moelora.demo import ASSETS

    p = commands.add_parser("demo", help="the bundled demo model (trained on CPU) with two adapters, served in one batch")
    p.add_argument("--dir", default=str(ASSETS), help=f"the demo's files (default: the bundled ones, {ASSETS})")
    p.add_argument("--max-tokens", type=int, default=20, help="tokens per completion (default: 20)")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled completions (default: 0.7)")
    p.add_argument("--seed", type=int, default=0, help="of the sampled completions (default: 0)")
    p.set_defaults(run=demo)

    engine_config = _engine_config()
    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server with adapter management and metrics")
    p.add_argument("--model-path", required=True, help="local Hugging Face model directory")
    p.add_argument("--lora-paths", "--lora-modules", nargs="+", type=_name_path, default={}, action=_DictAction,
                   metavar="NAME=PATH", help="adapters loaded at start: NAME=PATH, PATH (named PATH), or vLLM's "
                                             '\'{"name": NAME, "path": PATH}\'')
    _add_dataclass_args(p, engine_config, skip=("model_path", "lora_paths"))
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=30000, help="port to listen on (default: 30000)")
    p.add_argument("--served-model-name", type=_non_empty,
                   help="the base model's name in the API (default: the model directory's name)")
    p.add_argument("--max-queued-requests", type=_positive_int,
                   help="refuse requests (503) while this many wait, for the engine or for their grammars' compile "
                        "(default: no limit)")
    p.add_argument("--max-request-mb", type=_positive_int, default=100,
                   help="refuse (413) a request whose body has more MiB: by its Content-Length before reading it, a chunked "
                        "body once that much has come (default: 100)")
    p.add_argument("--api-key", type=_api_key,
                   help="every route but /health, /metrics and /version needs 'Authorization: Bearer KEY', and "
                        "FastAPI's /docs is off (default: $MOELORA_API_KEY; unset: no authentication)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's log: info has what it serves at start and the stats line (default: info)")
    p.add_argument("--log-stats-interval", type=_seconds, default=10.0,
                   help="seconds between the log lines of running/waiting requests, tokens/s, KV cache and LoRA "
                        "slot use; 0 turns them off (default: 10)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=0.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, seconds the requests in flight get to finish (new ones refused, "
                        "/health 503) before they are ended: a stream with an error event, others with a 500; 0 ends "
                        "them at once (vLLM's flag; default: 0)")
    p.add_argument("--watchdog-timeout", type=_seconds, default=300.0, metavar="SECONDS",
                   help="seconds one engine step may take: past it the device is taken to hang, the server ends every "
                        "request with an error, logs where the engine is and exits with status 1, for whatever runs "
                        "it to start it again; 0: never (SGLang's flag; default: 300)")
    p.add_argument("--grammar-compile-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                   help="seconds a request's grammar (response_format, guided_*, a forced tool call) may take to "
                        "compile: each new grammar is compiled first in a worker process, killed past this limit or "
                        "when its client leaves, and the request gets a 400; 0: no limit and no worker processes "
                        "(default: 10)")
    p.add_argument("--disable-runtime-lora-updating", action="store_true",
                   help="serve only the adapters of --lora-paths: the load_lora_adapter and unload_lora_adapter routes "
                        "are off (404), so no client can load a path of this machine or unload an adapter (vLLM's "
                        "routes are off unless VLLM_ALLOW_RUNTIME_LORA_UPDATING; default: on)")
    p.add_argument("--tool-call-parser", choices=["hermes"],
                   help="vLLM's flag, accepted: moelora parses tool calls in the hermes format (Qwen2.5, Qwen3) "
                        "whenever a chat request has tools, and only that one")
    # vLLM's flags that ask for what moelora always does: accepted, so that vLLM's command lines run
    for flag, why in (("--enable-lora", "adapters are always served"),
                      ("--enable-auto-tool-choice", "tool_choice auto is always served"),
                      ("--enable-chunked-prefill", "prompts are always prefilled in pieces (--chunked-prefill-size)"),
                      ("--disable-log-requests", "moelora logs no request's prompt or parameters"),
                      ("--trust-remote-code", "no code of the model directory runs: the architectures are moelora's")):
        p.add_argument(flag, action="store_true", help=f"vLLM's flag, accepted: {why}")
    p.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log (its access lines among them), as vLLM's flag (default: --log-level)")
    p.add_argument("--disable-log-stats", action="store_const", const=0.0, dest="log_stats_interval",
                   help="vLLM's flag: --log-stats-interval 0")
    p.add_argument("--disable-radix-cache", action="store_const", const=False, dest="enable_prefix_caching",
                   default=argparse.SUPPRESS, help="SGLang's flag: --no-enable-prefix-caching")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, type=lambda name: name.replace("-", "_"),
                   help="send a reasoning model's thinking (<think>...</think>) as the chat message's "
                        "reasoning_content, and apply structured output to the answer after it: qwen3 (Qwen3: it "
                        "thinks when its output starts with <think>), deepseek_r1 (DeepSeek-R1, QwQ: the output "
                        "starts thinking) or deepseek_v3 (DeepSeek-V3.1: it thinks when the prompt opens the "
                        "thinking); a prompt that opens or closes the thinking decides for all; SGLang's spellings "
                        "(deepseek-r1) too (default: none, the text as the model wrote it)")
    p.set_defaults(run=serve)

    from moelora.engine import SamplingParams

    p = commands.add_parser("generate", help="one completion of a prompt, printed (n of them with --n)")
    p.add_argument("--model-path", required=True, help="local Hugging Face model directory")
    p.add_argument("--lora", type=_name_path, metavar="NAME=PATH", help="generate with this adapter")
    p.add_argument("--prompt", required=True, help="the text to complete")
    _add_dataclass_args(p, engine_config, skip=("model_path", "lora_paths"))
    _add_dataclass_args(p, SamplingParams, skip=("logprobs", "prompt_logprobs"))
    p.set_defaults(run=generate)
    return parser


class _DictAction(argparse.Action):
    """NAME=PATH pairs into one dict, over every use of the flag: a name given twice is an error, since a dict
    would keep only the last of its paths and serve the other adapter under no name at all."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        adapters = dict(getattr(namespace, self.dest) or {})  # a copy: the parser's default dict is shared
        for name, path in values:
            if name in adapters:
                raise argparse.ArgumentError(self, f"adapter name {name!r} is given twice ({adapters[name]} and "
                                                   f"{path})")
            adapters[name] = path
        setattr(namespace, self.dest, adapters)


INTERRUPTED = 130  # the shell's status of a command that SIGINT ended (128 + 2)


def main(argv: list[str] | None = None) -> int:
    """Exit status 0, 1 for an error of the input or of a rank (one line on stderr, no traceback), 2 for a usage
    error, 130 for Ctrl-C before a server takes over its SIGINT (loading, generating)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from moelora.engine import EngineDead, RequestFailed, WorkerFailure  # imports torch: after --help and --version
        try:
            return args.run(args)
        except (ValueError, OSError, RequestFailed, EngineDead, WorkerFailure) as e:  # AdapterError is a ValueError
            message = _ranks_in_a_line_each(str(e)) if isinstance(e, WorkerFailure) else str(e)
            print(f"moelora {args.command}: error: {_with_flags(message, parser, args.command)}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print(f"moelora {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _ranks_in_a_line_each(message: str) -> str:
    """A rank failure's message with each rank's traceback ("rank N failed:\n<traceback>") cut to its exception
    line ("rank N raised <exception>"), as its other ranks' fates read: a message, not the tracebacks."""
    head, *ranks = re.split(r"(?:; |\n)(?=rank \d+ )", message)
    cut = [f"{r.split(' failed:', 1)[0]} raised {r.strip().splitlines()[-1]}" if re.match(r"rank \d+ failed:\n", r)
           else r for r in ranks]
    return "; ".join([head, *cut])


def _with_flags(message: str, parser: argparse.ArgumentParser, command: str) -> str:
    """The message with the command's flags beside the config fields it names (EngineConfig.context_length
    (--context-length, --max-model-len)), for a user who typed one of them; a field the command has no flag for
    (a generation_config.json's value) stays as it is."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {a.dest: a.option_strings for a in commands.choices[command]._actions if a.option_strings}

    def named(m: re.Match) -> str:
        if m.group(2) not in flags or m.string.startswith(" (--", m.end()):  # no flag, or named already
            return m.group(0)
        return f"{m.group(0)} ({', '.join(flags[m.group(2)])})"
    return re.sub(r"\b(EngineConfig|SamplingParams)\.(\w+)", named, message)


if __name__ == "__main__":
    sys.exit(main())
