"""`ninfer inspect FILE [--objects] [--json]`: validate an artifact and summarise what it holds."""

from __future__ import annotations

import argparse
import json
import sys

from ninfer.artifact import Artifact, ArtifactError, describe, describe_json


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="validate a .ninfer artifact and summarise its contents",
        description="Open a .ninfer artifact (checking framing, directory and geometry) and describe it.",
    )
    parser.add_argument("file", metavar="FILE", help="the .ninfer artifact")
    parser.add_argument("--objects", action="store_true", help="also list every object")
    parser.add_argument("--json", action="store_true", help="print the summary, with every object, as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        with Artifact.open(args.file) as artifact:
            if args.json:
                text = json.dumps(describe_json(artifact), indent=2, ensure_ascii=False)
            else:
                text = describe(artifact, objects=args.objects)
    except (ArtifactError, OSError) as err:  # a bad artifact, or no readable file at all
        print(f"ninfer inspect: {err}", file=sys.stderr)
        return 1
    print(text)
    return 0
