"""The artifact's tokenizer: HF `tokenizers` over `frontend/tokenizer.json`, plus tokenizer_config's extra tokens.

Upstream Qwen3.5/3.6 ship added tokens 248044..248069 in tokenizer.json and define 248070..248076 only in
tokenizer_config.json's `added_tokens_decoder`; both join here at their stated ids. Added-token text (`<|im_start|>`,
`<think>`, ...) always encodes to its single id. Normalization is tokenizer.json's own normalizer (NFC for Qwen),
applied to the text between added tokens, as the original tokenizer does.

Decoding goes through raw bytes per token (not `Tokenizer.decode`) so output decoding can hold back incomplete UTF-8
sequences exactly, whatever the chunking.
"""

from __future__ import annotations

import json
from functools import cached_property

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders

TOKENIZER_JSON = "frontend/tokenizer.json"
TOKENIZER_CONFIG = "frontend/tokenizer_config.json"


class TokenizerError(ValueError):
    """The artifact's tokenizer resources are missing or inconsistent."""


def _byte_decoder() -> dict[str, int]:
    """Inverse of byte-level BPE's byte -> printable-character map (printable bytes map to themselves)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: b for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


class Tokenizer:
    def __init__(self, tokenizer_json: bytes | str, tokenizer_config: bytes | str | None = None) -> None:
        try:
            self._hf = HFTokenizer.from_str(tokenizer_json.decode() if isinstance(tokenizer_json, bytes) else tokenizer_json)
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{TOKENIZER_JSON}: cannot load ({exc})") from exc
        self.config: dict = json.loads(tokenizer_config) if tokenizer_config else {}
        self._add_config_tokens()
        self._byte_level = isinstance(self._hf.decoder, decoders.ByteLevel)

    @classmethod
    def from_artifact(cls, artifact) -> "Tokenizer":
        if TOKENIZER_JSON not in artifact:
            raise TokenizerError(f"artifact has no {TOKENIZER_JSON}")
        config = artifact.resource(TOKENIZER_CONFIG) if TOKENIZER_CONFIG in artifact else None
        return cls(artifact.resource(TOKENIZER_JSON), config)

    def _add_config_tokens(self) -> None:
        """Tokens defined only in tokenizer_config.json (Qwen's 248070..248076) join at their stated ids."""
        decoder = self.config.get("added_tokens_decoder") or {}
        for key in sorted(decoder, key=int):
            entry = decoder[key]
            token_id = int(key)
            existing = self._hf.token_to_id(entry["content"])
            if existing is not None:
                if existing != token_id:
                    raise TokenizerError(f"{entry['content']!r} is id {existing} in tokenizer.json, {token_id} in config")
                continue
            if self._hf.get_vocab_size(with_added_tokens=True) != token_id:
                raise TokenizerError(f"added token {entry['content']!r} would not land at id {token_id}")
            special = bool(entry.get("special", False))
            token = AddedToken(entry["content"], special=special, normalized=bool(entry.get("normalized", False)),
                               lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                               single_word=bool(entry.get("single_word", False)))
            if special:
                self._hf.add_special_tokens([token])
            else:
                self._hf.add_tokens([token])

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token text (e.g. `<|im_start|>`) becomes its single id. No BOS is added."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def token_id(self, content: str) -> int | None:
        return self._hf.token_to_id(content)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(t_id for t_id, tok in self._hf.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        decoder = _byte_decoder()
        added = {t_id: tok.content for t_id, tok in self._hf.get_added_tokens_decoder().items()}
        table: list[bytes] = []
        for t_id in range(self.vocab_size):
            if t_id in added:
                table.append(added[t_id].encode())
                continue
            piece = self._hf.id_to_token(t_id)
            if piece is None:
                table.append(b"")
            elif self._byte_level:
                table.append(bytes(decoder[c] for c in piece))
            else:
                table.append(self._hf.decode([t_id], skip_special_tokens=False).encode())
        return table

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (possibly part of a UTF-8 sequence)."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        return self._token_bytes[token_id]

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        data = b"".join(self.token_bytes(i) for i in ids if not (skip_special and i in self.special_ids))
        return data.decode("utf-8", errors="replace")
