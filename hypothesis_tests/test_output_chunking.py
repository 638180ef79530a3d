"""Whatever the text, however it is cut into tokens and the tokens into speculative rounds, the output decoder's deltas
concatenate to the one-shot answer of §4.9, and its usage counts match the accepted tokens."""

from bisect import bisect_left

from hypothesis import given, settings, strategies as st

from ninfer.frontend.output import FinishReason, OutputDecoder

THINK_CLOSE = "</think>"
STOP_ID = 0


class TableTokenizer:
    """Token i stands for pieces[i]: arbitrary byte strings, so tokens split characters and tags anywhere."""

    special_ids = frozenset({STOP_ID})

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = [b"<|im_end|>"] + pieces

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]


def cut(data, cuts: list[int]) -> list:
    bounds = [0] + sorted(c for c in set(cuts) if 0 < c < len(data)) + [len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def one_shot(text: str, token_ends: list[int], thinking: bool, stops: list[str], stop_token: bool):
    """(reasoning, content, finish, accepted tokens, reasoning tokens) computed from the whole text at once."""

    def completing_token(char_end: int) -> int:  # index of the token holding the match's last byte
        return bisect_left(token_ends, len(text[:char_end].encode()))

    accepted = len(token_ends) + stop_token
    finish = FinishReason.STOP_TOKEN if stop_token else FinishReason.LENGTH
    reasoning, content_from, reasoning_tokens = "", 0, 0
    if thinking:
        close = text.find(THINK_CLOSE)
        if close < 0:
            return text, "", finish, accepted, accepted
        reasoning, content_from = text[:close], close + len(THINK_CLOSE)
        reasoning_tokens = completing_token(content_from) + 1
        content_from += len(text[content_from:]) - len(text[content_from:].lstrip())
    content = text[content_from:]
    # §4.9: the earliest match by (token completing it, byte offset, declaration order).
    matches = [(completing_token(content_from + at + len(s)), at, i)
               for i, s in enumerate(stops) if (at := content.find(s)) >= 0]
    if matches:
        token, at, _ = min(matches)
        content, finish, accepted = content[:at], FinishReason.STOP_STRING, token + 1
    return reasoning, content, finish, accepted, min(reasoning_tokens, accepted)


alphabet = st.sampled_from(["a", "b", "E", "N", "D", "END", " ", "\n", "☃", "é", THINK_CLOSE])
# Overlapping stops ("END" starts before "N" but completes after it) exercise the §4.9 tie-break.
stop_sets = st.lists(st.sampled_from(["END", "N", "ND", "a b", "☃é", "\n\n", "b☃"]), max_size=3, unique=True)


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(alphabet, max_size=30), thinking=st.booleans(), stops=stop_sets, stop_token=st.booleans(),
       data=st.data())
def test_streamed_rounds_equal_the_one_shot_split(pieces, thinking, stops, stop_token, data):
    text = "".join(pieces)
    raw = text.encode()
    tokens = cut(raw, data.draw(st.lists(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw))))
    token_ids = list(range(1, len(tokens) + 1)) + [STOP_ID] * stop_token
    rounds = cut(token_ids, data.draw(st.lists(st.integers(1, max(1, len(token_ids) - 1)), max_size=len(token_ids))))
    decoder = OutputDecoder(TableTokenizer(tokens), thinking=thinking, stop_ids={STOP_ID}, stop_strings=tuple(stops))

    reasoning, content, accepted = "", "", 0
    for round_ids in rounds:
        delta, taken = decoder.push_many(round_ids)
        reasoning, content, accepted = reasoning + delta.reasoning, content + delta.content, accepted + taken
        if decoder.finished:
            break
    tail = decoder.finish()
    reasoning, content = reasoning + tail.reasoning, content + tail.content

    token_ends = [len(b"".join(tokens[: i + 1])) for i in range(len(tokens))]
    expected = one_shot(text, token_ends, thinking, stops, stop_token)
    assert (reasoning, content, decoder.finished, accepted, decoder.reasoning_tokens) == expected
    assert decoder.generated_tokens == accepted
