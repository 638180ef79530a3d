"""Throughput of the streaming tool-call parser (ninfer/frontend/tool_calls.py) in MB/s of content text.

Streams are fed in token-sized pieces (1-8 characters, as ordinary decoding delivers them), in 64-character pieces
(speculative rounds) and in one piece. Workloads: prose only (with stray `<` and HTML tags to exercise the holdback),
an agent-style mix of prose and calls, and calls carrying large file contents. Best of several repeats.

    python bench/tool_parser_throughput.py [--mb 4] [--out bench/results/tool_parser_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from ninfer.frontend.tool_calls import ToolCallParser

WORDS = ("the of and to in is that for it with as was on be by this are from or have an they which one you were her "
         "all she there would their we him been has when who will more no if out so said what up its about into than "
         "them can only other new some could time these two may then do first any my now such like our over man me "
         "even most made after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us great old year off "
         "come since against go came right used take three a<b x>y <div> </div> <b>bold</b> é naïve 東京 🙂"
         ).split()
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "overwrite": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}, "filters": {"type": "object"}}}}}]


def prose(rng: random.Random, n_words: int) -> str:
    lines = []
    while n_words > 0:
        take = min(n_words, rng.randint(8, 30))
        lines.append(" ".join(rng.choice(WORDS) for _ in range(take)) + ".")
        n_words -= take
    return "\n\n".join(lines)


def code(rng: random.Random, n_lines: int) -> str:
    body = [f"    value_{i} = compute({rng.randint(0, 999)}, '{rng.choice(WORDS)}')  # step {i}"
            for i in range(n_lines)]
    return "def generated():\n" + "\n".join(body) + "\n    return value_0\n"


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def search_call(rng: random.Random) -> str:
    return call("search", query=prose(rng, 6), limit=str(rng.randint(1, 50)), filters='{"lang": "en", "recent": true}')


def workload(kind: str, target_bytes: int, rng: random.Random) -> str:
    parts, size = [], 0
    while size < target_bytes:
        if kind == "prose":
            part = prose(rng, 200) + "\n\n"
        elif kind == "agent_mix":
            part = prose(rng, 120) + "\n\n" + search_call(rng) + "\n" + call(
                "write_file", path="src/module.py", content=code(rng, 20), overwrite="true") + "\n\n"
        else:  # large_file_calls
            part = call("write_file", path="src/big.py", content=code(rng, 400), overwrite="false") + "\n"
        parts.append(part)
        size += len(part.encode())
    return "".join(parts)


def pieces(text: str, sizing: str, rng: random.Random) -> list[str]:
    if sizing == "one_piece":
        return [text]
    out, at = [], 0
    while at < len(text):
        step = rng.randint(1, 8) if sizing == "token_pieces" else 64
        out.append(text[at : at + step])
        at += step
    return out


def measure(chunks: list[str], repeats: int) -> tuple[float, int]:
    best, calls = float("inf"), 0
    for _ in range(repeats):
        parser = ToolCallParser(TOOLS)
        t0 = time.perf_counter()
        for chunk in chunks:
            parser.feed(chunk)
        parser.finish()
        best = min(best, time.perf_counter() - t0)
        calls = len(parser.calls)
    return best, calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=4.0, help="content size per workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tool_parser_throughput.json")
    args = ap.parse_args()
    rows = []
    for kind in ("prose", "agent_mix", "large_file_calls"):
        text = workload(kind, int(args.mb * 1e6), random.Random(kind))
        size = len(text.encode())
        for sizing in ("token_pieces", "64_char_pieces", "one_piece"):
            chunks = pieces(text, sizing, random.Random(sizing))
            seconds, calls = measure(chunks, args.repeats)
            rows.append({"workload": kind, "feeding": sizing, "bytes": size, "feeds": len(chunks), "calls": calls,
                         "seconds": round(seconds, 4), "mb_per_s": round(size / seconds / 1e6, 1)})
            print(f"{kind:17s} {sizing:15s} {len(chunks):8d} feeds {calls:6d} calls {rows[-1]['mb_per_s']:8.1f} MB/s")
    result = {"benchmark": "tool_parser_throughput", "date": time.strftime("%Y-%m-%d"),
              "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
              "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
