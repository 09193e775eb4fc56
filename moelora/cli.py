"""The `moelora` command. One function per subcommand; `main` dispatches on the subcommand name."""
from __future__ import annotations

import argparse
import json
import sys


def inspect(args: argparse.Namespace) -> int:
    from moelora.lora.report import format_report, inspect_adapter

    report = inspect_adapter(args.adapter, args.model, args.max_lora_rank)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelora", description="Serving engine for MoE models with many LoRA adapters.")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("inspect", help="describe and validate a LoRA adapter directory")
    p.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors or .bin)")
    p.add_argument("--model", help="local base model directory (config.json); without it only the file is described")
    p.add_argument("--max-lora-rank", type=int, help="the engine's maximum rank (also the slot rank for memory)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
