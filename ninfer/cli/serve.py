"""`python -m ninfer [ARTIFACT] [options]`: serve one artifact over HTTP (serving.md's option table).

Without ARTIFACT the bundled demo model is served (converted into the cache on first use). Options are validated
here, before anything is loaded; an option the build or the artifact cannot honour (a GPU device, the Vision runtime,
--spec dflash without a 35B-A3B artifact carrying the drafter or on the CUDA backend, a pinned cold-tier device) is
accepted by the parser and then fails at startup with a message naming what is missing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

from ninfer.engine.config import DRAFT_RANGES, MAX_CONTEXT_LIMIT, MAX_LANES, PREFILL_CHUNK_QUANTUM
from ninfer.nursery.options import ServeOptions

MAX_SEED = (1 << 64) - 1

EPILOG = """\
other commands: `python -m ninfer generate|convert|inspect --help` (one-shot generation, checkpoint conversion,
artifact inspection).

SIGTERM or SIGINT stops admitting requests, lets in-flight ones finish for up to --drain-timeout-ms, then exits;
a second signal exits at once."""


def _integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"in {low}..{high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def _number(low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a finite number in [{low}, {high}], got {text}")
        return value

    return parse


def _non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _prefill_chunk(text: str) -> int:
    value = _integer(1)(text)
    if value % PREFILL_CHUNK_QUANTUM:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of {PREFILL_CHUNK_QUANTUM}, got {value}")
    return value


def _kv_capacity(text: str) -> int | str:
    return "auto" if text == "auto" else _integer(1)(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ninfer", usage="%(prog)s [ARTIFACT] [options]",
                                description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", nargs="?", type=Path, metavar="ARTIFACT",
                   help="a .ninfer artifact (default: the bundled demo model)")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", metavar="H", help="listen address (default 127.0.0.1)")
    net.add_argument("--port", type=_integer(1, 65535), default=8080, metavar="N", help="listen port (default 8080)")
    net.add_argument("--api-key", type=_non_empty, metavar="KEY",
                     help="require this value as a bearer token or x-api-key (default: no authentication)")
    net.add_argument("--model-id", type=_non_empty, metavar="ID",
                     help="public OpenAI model alias (default: the artifact's identity.model_id)")
    net.add_argument("--cors", action="store_true", help="permissive browser CORS headers (default off)")
    net.add_argument("--max-request-mib", type=_integer(1), default=384, metavar="N",
                     help="request body limit before JSON parsing (default 384)")

    eng = p.add_argument_group("engine")
    eng.add_argument("--max-context", type=_integer(1, MAX_CONTEXT_LIMIT), default=8192, metavar="N",
                     help="logical context ceiling of each sequence (default 8192)")
    eng.add_argument("--kv-capacity", type=_kv_capacity, metavar="N|auto",
                     help="shared KV capacity in tokens, or auto: the most that fits memory (default: --max-context)")
    eng.add_argument("--max-concurrency", type=_integer(1, MAX_LANES), default=1, metavar="N",
                     help=f"maximum admitted requests, 1..{MAX_LANES} (default 1)")
    eng.add_argument("--max-pending-requests", type=_integer(0), default=16, metavar="N",
                     help="additional requests allowed to wait for admission (default 16)")
    eng.add_argument("--pending-timeout-ms", type=_integer(1), default=30000, metavar="N",
                     help="maximum preparation-plus-admission wait (default 30000)")
    eng.add_argument("--prefill-chunk", type=_prefill_chunk, default=1024, metavar="N",
                     help=f"text-prefill chunk, a multiple of {PREFILL_CHUNK_QUANTUM} (default 1024)")
    eng.add_argument("--default-max-tokens", type=_integer(1), default=8192, metavar="N",
                     help="output limit when a request gives none (default 8192)")
    eng.add_argument("--kv-dtype", choices=("bf16", "int8"), default="bf16", help="KV-cache storage (default bf16)")
    eng.add_argument("--spec", choices=("mtp", "dflash"), help="speculative backend (default off)")
    eng.add_argument("--draft-tokens", type=_integer(1), metavar="N", help="draft window: MTP 1..5, DFlash 1..15")
    eng.add_argument("--lm-head-draft", action="store_true", help="optimized proposal head (needs --spec)")
    eng.add_argument("--no-prefix-reuse", action="store_true", help="disable compatible-prefix caching")
    eng.add_argument("--device", type=_integer(0), default=0, metavar="N", help="CUDA device index (default 0)")
    eng.add_argument("--no-cuda-graph", action="store_true",
                     help="run without CUDA graphs (decode steps and full-size prefill chunks): slower, same tokens")

    media = p.add_argument_group("media")
    media.add_argument("--vision", action="store_true", help="enable image and video input (default off)")
    media.add_argument("--media-cache-mib", type=_integer(0), default=1024, metavar="N",
                       help="LRU-retained prepared media payloads; 0 disables retention (default 1024)")
    media.add_argument("--media-live-mib", type=_integer(1), default=2048, metavar="N",
                       help="all live prepared media payloads (default 2048)")
    media.add_argument("--media-preprocess-threads", type=_integer(0), default=0, metavar="N",
                       help="media preprocessing workers; 0 picks at most 16 from the host (default 0)")

    cold = p.add_argument_group("cross-GPU cold tier")
    cold.add_argument("--cold-tier-device", type=_integer(-1), default=-1, metavar="N",
                      help="pin the cold tier to one secondary device; -1 spans every non-primary device (default)")
    cold.add_argument("--cold-tier-capacity-mib", type=_integer(0), default=0, metavar="N",
                      help="per-device arena size; 0 sizes it from free memory minus 256 MiB (default 0)")
    cold.add_argument("--cold-tier-staging-mib", type=_integer(1), default=64, metavar="N",
                      help="pinned host staging buffer (default 64)")
    cold.add_argument("--no-cold-tier", action="store_true", help="disable the cross-GPU cold tier")

    gen = p.add_argument_group("generation defaults")
    gen.add_argument("--no-thinking", action="store_true", help="disable thinking by default")
    gen.add_argument("--preserve-thinking", action="store_true",
                     help="keep closed-turn assistant reasoning in prompts by default")
    gen.add_argument("--temperature", type=_number(0.0, 2.0), metavar="F", help="process-level temperature override")
    gen.add_argument("--top-p", type=_number(0.0, 1.0), metavar="F", help="process-level top-p override")
    gen.add_argument("--top-k", type=_integer(0), metavar="N", help="process-level top-k override (capped at 20)")
    gen.add_argument("--min-p", type=_number(0.0, 1.0), metavar="F", help="process-level min-p override")
    gen.add_argument("--presence-penalty", type=_number(-2.0, 2.0), metavar="F",
                     help="process-level presence-penalty override")
    gen.add_argument("--frequency-penalty", type=_number(-2.0, 2.0), metavar="F",
                     help="process-level frequency-penalty override")
    gen.add_argument("--seed", type=_integer(0, MAX_SEED), metavar="N",
                     help="seed for requests that give none (default: a fresh random seed per request)")
    gen.add_argument("--greedy", action="store_true", help="force exact argmax for all requests")

    ops = p.add_argument_group("operations")
    ops.add_argument("--log-stats-interval-ms", type=_integer(0), default=5000, metavar="N",
                     help="aggregate throughput report interval; 0 disables it (default 5000)")
    ops.add_argument("--request-log-jsonl", type=Path, metavar="FILE",
                     help="append full-precision server/request records to FILE (default off)")
    ops.add_argument("--response-store-max-records", type=_integer(1), default=1024, metavar="N",
                     help="maximum locally retained Responses objects (default 1024)")
    ops.add_argument("--response-store-max-mib", type=_integer(1), default=256, metavar="N",
                     help="total local Responses store budget (default 256)")
    ops.add_argument("--drain-timeout-ms", type=_integer(0), default=30000, metavar="N",
                     help="on SIGTERM/SIGINT, how long in-flight requests may finish (default 30000)")
    return p


def _check_combinations(args: argparse.Namespace) -> str | None:
    """Options that are valid alone but not together; the message, or None."""
    if args.spec is None:
        if args.draft_tokens is not None or args.lm_head_draft:
            return "--draft-tokens and --lm-head-draft need --spec"
    else:
        window = DRAFT_RANGES[args.spec]
        if args.draft_tokens not in window:
            return f"--spec {args.spec} needs --draft-tokens in {window.start}..{window.stop - 1}"
    if args.spec == "dflash" and args.vision:
        return "--spec dflash cannot be combined with --vision (DFlash is text-only)"
    if args.media_cache_mib > args.media_live_mib:
        return "--media-cache-mib cannot exceed --media-live-mib (retained payloads are live payloads)"
    if isinstance(args.kv_capacity, int) and args.kv_capacity < args.max_context:
        return f"--kv-capacity {args.kv_capacity} is smaller than one --max-context {args.max_context} sequence"
    return None


def parse_serve_args(argv: Sequence[str]) -> ServeOptions:
    """Parse and validate; a bad option exits with status 2 and the usage line (argparse's convention)."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    problem = _check_combinations(args)
    if problem is not None:
        parser.error(problem)
    return ServeOptions(**vars(args), argv=tuple(argv))


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_serve_args(sys.argv[1:] if argv is None else argv)
    from ninfer.server.service import serve

    return serve(options)
