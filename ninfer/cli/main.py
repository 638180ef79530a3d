"""`ninfer [ARTIFACT] [serve options]` serves; `ninfer COMMAND ...` runs one of the other commands, each module
registering its own sub-parser. `--help` is the server's (it lists the other commands)."""

from __future__ import annotations

import argparse
import sys

from ninfer import __version__

COMMANDS = ("generate", "convert", "inspect")


def build_parser() -> argparse.ArgumentParser:
    from ninfer.cli import convert, generate, inspect

    parser = argparse.ArgumentParser(prog="ninfer", description="Serve and run Qwen3.6-family models.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (generate, convert, inspect):
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and (argv[0] in COMMANDS or argv[0] == "--version"):
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    from ninfer.cli import serve

    return serve.main(argv)
