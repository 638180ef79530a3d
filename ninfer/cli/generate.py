"""`ninfer generate [ARTIFACT] (--prompt TEXT | --messages FILE) [options]`: one request, then exit.

Content streams to stdout; reasoning, diagnostics and timings go to stderr (the original `ninfer` CLI's split).
Without ARTIFACT the bundled demo model is used (converted into the cache on first use).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.engine.sampler import Purpose, Sampler, SamplingParams, SamplingParamsError

MESSAGE_KEYS = {"role", "content", "reasoning_content", "tool_calls", "tool_call_id"}
MEDIA_PARTS = ("image", "image_url", "video", "video_url")


class UsageError(ValueError):
    """Bad command-line input: printed with the usage line, exit status 1."""


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="run one prompt and print the answer",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", nargs="?", type=Path, help="a .ninfer artifact (default: the bundled demo model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a single user message")
    src.add_argument("--messages", type=Path, metavar="FILE",
                     help='JSON: an array of messages, or {"messages": [...], "tools": [...]}')
    p.add_argument("--max-context", type=int, default=2048, metavar="N", help="prompt + output tokens (default 2048)")
    p.add_argument("--prefill-chunk", type=int, default=1024, metavar="N",
                   help="prompt tokens per prefill step, a multiple of 128 (default 1024)")
    p.add_argument("--max-new", type=int, default=128, metavar="N", help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.6, metavar="F", help="0..2 (default 0.6); 0 is greedy")
    p.add_argument("--top-p", type=float, default=0.95, metavar="F", help="default 0.95")
    p.add_argument("--top-k", type=int, default=20, metavar="N", help="default 20 (capped at 20; 0 means 20)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="F", help="default 0")
    p.add_argument("--presence-penalty", type=float, default=1.0, metavar="F", help="default 1.0")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F", help="default 0")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="RNG seed, unsigned 64-bit (default 0)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (resets every sampling flag)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], metavar="N",
                   help="extra stop token id (repeatable; the model's own stop ids always apply)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string in content (repeatable)")
    p.add_argument("--reasoning-stop", action="append", default=[], metavar="TEXT",
                   help="stop string in reasoning (repeatable)")
    p.add_argument("--no-thinking", action="store_true", help="render the prompt with thinking disabled")
    p.add_argument("--reasoning-effort", metavar="LEVEL",
                   help="a reasoning effort the model's chat template exposes (e.g. low, medium, xhigh), or none")
    p.add_argument("--raw-output", action="store_true",
                   help="print everything generated: no reasoning split, special and stop tokens included")
    p.add_argument("--print-token-ids", action="store_true", help="print the prompt and generated ids to stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except (UsageError, SamplingParamsError) as exc:
        print(f"ninfer generate: {exc}", file=sys.stderr)
        print("usage: ninfer generate [ARTIFACT] (--prompt TEXT | --messages FILE) [options]; see --help",
              file=sys.stderr)
        return 1
    except (OSError, ValueError, LookupError) as exc:  # artifact, tokenizer, template and target errors
        print(f"ninfer generate: {exc}", file=sys.stderr)
        return 1


def _check_options(args: argparse.Namespace) -> None:
    if not 1 <= args.max_context <= 262144:
        raise UsageError("--max-context must be in 1..262144")
    if args.prefill_chunk <= 0 or args.prefill_chunk % 128:
        raise UsageError("--prefill-chunk must be a positive multiple of 128")
    if args.max_new < 1:
        raise UsageError("--max-new must be at least 1")
    if any(s == "" for s in args.stop + args.reasoning_stop):
        raise UsageError("stop strings must not be empty")


def read_messages(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Parse a --messages file: text-only messages with the CLI's keys (media needs a vision build)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--messages {path}: {exc}") from exc
    tools = None
    if isinstance(doc, dict):
        unknown = set(doc) - {"messages", "tools"}
        if unknown:
            raise UsageError(f"--messages: unknown top-level keys {sorted(unknown)}")
        tools = doc.get("tools")
        doc = doc.get("messages")
        if tools is not None and not isinstance(tools, list):
            raise UsageError("--messages: tools must be an array")
    if not isinstance(doc, list) or not doc:
        raise UsageError("--messages: expected a non-empty array of messages")
    for i, msg in enumerate(doc):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise UsageError(f"--messages: message {i} must be an object with a string role")
        unknown = set(msg) - MESSAGE_KEYS
        if unknown:
            raise UsageError(f"--messages: message {i} has unknown keys {sorted(unknown)}")
        parts = msg.get("content")
        media = [p.get("type") for p in parts if isinstance(p, dict) and p.get("type") in MEDIA_PARTS] \
            if isinstance(parts, list) else []
        if media:
            raise UsageError(f"--messages: message {i} has a {media[0]} part; media input needs vision support")
    return doc, tools


def _sampling(args: argparse.Namespace) -> SamplingParams:
    if args.greedy:
        return SamplingParams.greedy()
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed)


def _generate(args: argparse.Namespace) -> int:
    _check_options(args)
    sampling = _sampling(args)
    if args.messages is not None:
        messages, tools = read_messages(args.messages)
    else:
        messages, tools = [{"role": "user", "content": args.prompt}], None

    from ninfer.artifact.reader import Artifact
    from ninfer.frontend.generation_config import model_stop_ids
    from ninfer.frontend.output import FinishReason, OutputDecoder
    from ninfer.frontend.prompt import PromptBuilder, resolve_options
    from ninfer.models.loader import build_model

    path = args.artifact
    if path is None:
        from ninfer.convert.demo import ensure_demo_artifact

        path = ensure_demo_artifact()
    t_load = time.perf_counter()
    artifact = Artifact.open(path)
    model = build_model(artifact)
    builder = PromptBuilder.from_artifact(artifact)
    options = resolve_options(builder.capabilities, reasoning_effort=args.reasoning_effort,
                              enable_thinking=False if args.no_thinking else None,
                              effort_param="--reasoning-effort", thinking_param="--no-thinking")
    prompt = builder.build(messages, options, tools=tools)
    prompt_ids = list(prompt.ids)
    if len(prompt_ids) > args.max_context:
        raise UsageError(f"prompt has {len(prompt_ids)} tokens, more than --max-context {args.max_context}")
    print(f"loaded {artifact.model_id} from {path} in {time.perf_counter() - t_load:.2f} s", file=sys.stderr)
    if args.print_token_ids:
        print(f"prompt ids ({len(prompt_ids)}): {prompt_ids}", file=sys.stderr)

    decoder = OutputDecoder(builder.tokenizer, thinking=prompt.thinking,
                            stop_ids=model_stop_ids(artifact) | set(args.stop_token_id), stop_strings=tuple(args.stop),
                            reasoning_stop_strings=tuple(args.reasoning_stop),
                            raw=args.raw_output)
    sampler = Sampler(sampling, model.dims.vocab_ids)
    # The last token sampled is never fed back, so it needs no cache slot: hence the + 1.
    budget = min(args.max_new, args.max_context - len(prompt_ids) + 1)

    state = model.new_state()
    t0 = time.perf_counter()
    for start in range(0, len(prompt_ids), args.prefill_chunk):
        result = model.forward(state, np.asarray(prompt_ids[start : start + args.prefill_chunk]))
    token = sampler.sample(result.logits[-1], len(prompt_ids), Purpose.PREFILL)
    t1 = time.perf_counter()
    generated = [token]
    reasoning_open = False
    while True:
        delta = decoder.push(token)
        reasoning_open = _publish(delta, reasoning_open)
        if decoder.finished is not None:
            break
        if len(generated) >= budget:
            reasoning_open = _publish(decoder.finish(FinishReason.LENGTH), reasoning_open)
            break
        result = model.forward(state, np.asarray([token]))
        token = sampler.sample(result.logits[-1], len(prompt_ids) + len(generated) - 1, Purpose.DECODE)
        generated.append(token)
    t2 = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if reasoning_open:
        sys.stderr.write("\n")
    if args.print_token_ids:
        print(f"generated ids ({len(generated)}): {generated}", file=sys.stderr)
    decode_tps = (len(generated) - 1) / (t2 - t1) if len(generated) > 1 and t2 > t1 else 0.0
    print(f"finish={decoder.finished.value} prompt_tokens={len(prompt_ids)} completion_tokens={len(generated)} "
          f"reasoning_tokens={decoder.reasoning_tokens} prefill={len(prompt_ids) / (t1 - t0):.1f} tok/s "
          f"decode={decode_tps:.1f} tok/s", file=sys.stderr)
    return 0


def _publish(delta, reasoning_open: bool) -> bool:
    """Write a delta: reasoning to stderr, content to stdout. Returns whether reasoning output is mid-line."""
    if delta.reasoning:
        sys.stderr.write(delta.reasoning)
        sys.stderr.flush()
        reasoning_open = True
    if delta.content:
        if reasoning_open:
            sys.stderr.write("\n")
            reasoning_open = False
        sys.stdout.write(delta.content)
        sys.stdout.flush()
    return reasoning_open
