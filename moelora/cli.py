"""The `moelora` command. One function per subcommand; `main` dispatches on the subcommand name."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def inspect(args: argparse.Namespace) -> int:
    from moelora.lora.report import format_report, inspect_adapter

    report = inspect_adapter(args.adapter, args.model, args.max_lora_rank)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] else 0


def demo(args: argparse.Namespace) -> int:
    from moelora.demo import run

    rows = run(Path(args.dir), args.max_tokens)
    for adapter, prompt, text in rows:
        print(f"{adapter:>6} | {prompt!r:24} -> {text!r}")
    models = {adapter for adapter, _, _ in rows}
    texts: dict[str, set[str]] = {}
    for _, prompt, text in rows:
        texts.setdefault(prompt, set()).add(text)
    differ = sum(len(t) == len(models) for t in texts.values())
    print(f"one batch of {len(rows)} requests over {len(models)} models (base + adapters); "
          f"all {len(models)} completions differ on {differ} of {len(texts)} prompts")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelora", description="Serving engine for MoE models with many LoRA adapters.")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("inspect", help="describe and validate a LoRA adapter directory")
    p.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors or .bin)")
    p.add_argument("--model", help="local base model directory (config.json); without it only the file is described")
    p.add_argument("--max-lora-rank", type=int, help="the engine's maximum rank (also the slot rank for memory)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=inspect)

    from moelora.demo import DEFAULT_DIR

    p = commands.add_parser("demo", help="build a tiny MoE model with two adapters (cached) and serve them in one batch")
    p.add_argument("--dir", default=str(DEFAULT_DIR), help=f"where the demo model and adapters live (default {DEFAULT_DIR})")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens per completion")
    p.set_defaults(run=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
