"""`ninfer COMMAND ...`: one module per command, each registering its own sub-parser."""

from __future__ import annotations

import argparse
import sys

from ninfer import __version__


def build_parser() -> argparse.ArgumentParser:
    from ninfer.cli import convert, generate, inspect

    parser = argparse.ArgumentParser(prog="ninfer", description="Serve and run Qwen3.6-family models.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (generate, convert, inspect):
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)
