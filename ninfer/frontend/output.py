"""Incremental output decoding of one request (ninfer-facts §4.9).

Tokens go in one at a time (`push`) or a speculative round at a time (`push_many`); what comes out is reasoning and
content text that is final: incomplete UTF-8, a partial `</think>` and a partial stop string are held back until
resolved, so the concatenated deltas are the same whatever the chunking and never need to be taken back.

Usage counts come from accepted tokens, not from re-tokenizing text: `generated_tokens` includes a withheld stop token,
`reasoning_tokens` counts tokens accepted while the reasoning channel was open (the one completing `</think>` too).
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Sequence

import attrs

from ninfer.frontend.tokenizer import Tokenizer

THINK_CLOSE = "</think>"


class FinishReason(enum.Enum):
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    LENGTH = "length"


@attrs.define
class Delta:
    reasoning: str = ""
    content: str = ""
    finish: FinishReason | None = None


def _held_suffix(text: str, needles: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `needles`."""
    best = 0
    for needle in needles:
        for n in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:n]):
                best = n
                break
    return best


def _earliest(text: str, needles: list[str]) -> tuple[int, str] | None:
    """Earliest match in `text`; ties at one offset go to the needle declared first."""
    found = [(text.find(n), i, n) for i, n in enumerate(needles) if n and n in text]
    if not found:
        return None
    at, _, needle = min(found)
    return at, needle


class OutputDecoder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        thinking: bool,
        stop_ids: frozenset[int] | set[int] = frozenset(),
        stop_strings: tuple[str, ...] = (),
        reasoning_stop_strings: tuple[str, ...] = (),
        raw: bool = False,
    ) -> None:
        if any(s == "" for s in stop_strings + reasoning_stop_strings):
            raise ValueError("stop strings must not be empty")
        self._tok = tokenizer
        self._stop_ids = frozenset(stop_ids)
        self._stops = list(stop_strings)
        self._reasoning_stops = list(reasoning_stop_strings)
        self._raw = raw
        self._in_reasoning = thinking and not raw
        # Leading whitespace of content is dropped only after a </think> closes the reasoning channel.
        self._content_started = not self._in_reasoning
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded text not yet published (held back)
        self.finished: FinishReason | None = None
        self.generated_tokens = 0
        self.reasoning_tokens = 0

    def push(self, token_id: int) -> Delta:
        """Consume one generated token. After a finish, further tokens are an error."""
        if self.finished is not None:
            raise RuntimeError("output already finished")
        self.generated_tokens += 1
        if self._in_reasoning:
            self.reasoning_tokens += 1
        if token_id in self._stop_ids:
            delta = Delta()
            if self._raw:
                self._pending += self._utf8.decode(self._tok.token_bytes(token_id))
            self._pending += self._utf8.decode(b"", final=True)
            self._drain(delta, final=True)
            self.finished = delta.finish = delta.finish or FinishReason.STOP_TOKEN
            return delta
        if self._raw or token_id not in self._tok.special_ids:
            self._pending += self._utf8.decode(self._tok.token_bytes(token_id))
        delta = Delta()
        self._drain(delta, final=False)
        if delta.finish is not None:
            self.finished = delta.finish
        return delta

    def push_many(self, token_ids: Sequence[int]) -> tuple[Delta, int]:
        """Consume the tokens of one (speculative) round in order, stopping at the one that finishes the output.

        Returns the merged delta and how many tokens were accepted: the engine commits exactly that prefix, so
        tokens after a stop token or after the token that completed a stop string are neither counted nor decoded.
        """
        merged = Delta()
        accepted = 0
        for token_id in token_ids:
            delta = self.push(token_id)
            merged.reasoning += delta.reasoning
            merged.content += delta.content
            merged.finish = delta.finish
            accepted += 1
            if self.finished is not None:
                break
        return merged, accepted

    def finish(self, reason: FinishReason = FinishReason.LENGTH) -> Delta:
        """End the output (length limit): flush everything held, a dangling partial code point as U+FFFD."""
        delta = Delta()
        if self.finished is None:
            self._pending += self._utf8.decode(b"", final=True)
            self._drain(delta, final=True)
            self.finished = delta.finish = delta.finish or reason
        return delta

    def _drain(self, delta: Delta, *, final: bool) -> None:
        while self._pending and delta.finish is None:
            if self._in_reasoning:
                if not self._drain_reasoning(delta, final):
                    return
            elif not self._drain_content(delta, final):
                return

    def _drain_reasoning(self, delta: Delta, final: bool) -> bool:
        """Publish reasoning; returns True when the channel switched and more text may be pending."""
        text = self._pending
        stop = _earliest(text, self._reasoning_stops)
        close = text.find(THINK_CLOSE)
        if stop is not None and (close < 0 or stop[0] < close):
            delta.reasoning += text[: stop[0]]
            self._pending = ""
            delta.finish = FinishReason.STOP_STRING
            return False
        if close >= 0:
            delta.reasoning += text[:close]
            self._pending = text[close + len(THINK_CLOSE) :]
            self._in_reasoning = False
            return True
        keep = 0 if final else _held_suffix(text, [THINK_CLOSE] + self._reasoning_stops)
        delta.reasoning += text[: len(text) - keep]
        self._pending = text[len(text) - keep :]
        return False

    def _drain_content(self, delta: Delta, final: bool) -> bool:
        text = self._pending
        if not self._content_started:
            text = text.lstrip()
            if not text:
                self._pending = ""
                return False
            self._content_started = True
        stop = _earliest(text, self._stops)
        if stop is not None:
            delta.content += text[: stop[0]]
            self._pending = ""
            delta.finish = FinishReason.STOP_STRING
            return False
        keep = 0 if final else _held_suffix(text, self._stops)
        delta.content += text[: len(text) - keep]
        self._pending = text[len(text) - keep :]
        return False
