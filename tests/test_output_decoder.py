"""Incremental output decoding: channels, stops and UTF-8 holdback (ninfer-facts §4.9)."""

import pytest

from ninfer.frontend.output import Delta, FinishReason, OutputDecoder

STOP_ID, SPECIAL_ID = 1000, 1001


class ByteTokenizer:
    """Token i < 256 is the single byte i; a few ids stand for multi-byte pieces and specials."""

    special_ids = frozenset({STOP_ID, SPECIAL_ID})
    pieces = {STOP_ID: b"<|im_end|>", SPECIAL_ID: b"<|special|>", 1002: "</think>".encode()}

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces.get(token_id, bytes([token_id]) if token_id < 256 else b"")


def ids(data: bytes) -> list[int]:
    return list(data)


def run(decoder: OutputDecoder, tokens: list[int]):
    reasoning, content = "", ""
    for t in tokens:
        d = decoder.push(t)
        reasoning += d.reasoning
        content += d.content
        if decoder.finished:
            break
    if not decoder.finished:
        d = decoder.finish()
        reasoning += d.reasoning
        content += d.content
    return reasoning, content, decoder.finished


def make(**kw):
    kw.setdefault("thinking", False)
    kw.setdefault("stop_ids", {STOP_ID})
    return OutputDecoder(ByteTokenizer(), **kw)


def test_reasoning_then_content_with_leading_whitespace_stripped():
    toks = ids(b"let me think") + [1002] + ids(b"\n\nParis.") + [STOP_ID]
    assert run(make(thinking=True), toks) == ("let me think", "Paris.", FinishReason.STOP_TOKEN)


def test_think_close_split_across_tokens_is_held_back_then_switches():
    dec = make(thinking=True)
    out = [dec.push(t) for t in ids(b"abc</thi")]
    assert "".join(d.reasoning for d in out) == "abc"
    rest = [dec.push(t) for t in ids(b"nk>ok")]
    assert "".join(d.content for d in rest) == "ok"


def test_non_thinking_output_keeps_leading_whitespace():
    assert run(make(), ids(b"  hi") + [STOP_ID]) == ("", "  hi", FinishReason.STOP_TOKEN)


def test_stop_token_counts_but_is_not_published_and_specials_are_skipped():
    dec = make()
    reasoning, content, finish = run(dec, ids(b"a") + [SPECIAL_ID] + ids(b"b") + [STOP_ID])
    assert content == "ab" and finish is FinishReason.STOP_TOKEN and dec.generated_tokens == 4


def test_raw_output_publishes_everything_and_does_not_split_reasoning():
    toks = ids(b"x") + [1002, SPECIAL_ID, STOP_ID]
    assert run(make(thinking=True, raw=True), toks) == ("", "x</think><|special|><|im_end|>", FinishReason.STOP_TOKEN)


def test_stop_string_across_token_boundaries_cuts_before_the_match():
    dec = make(stop_strings=("END",))
    deltas = [dec.push(t) for t in ids(b"abcE")]
    assert "".join(d.content for d in deltas) == "abc"  # "E" may start the stop string: held
    d = dec.push(ord("N"))
    assert d.content == "" and dec.finished is None
    d = dec.push(ord("D"))
    assert d.finish is FinishReason.STOP_STRING and d.content == ""


def test_held_prefix_is_released_when_it_stops_matching():
    dec = make(stop_strings=("END",))
    text = "".join(dec.push(t).content for t in ids(b"aEN"))
    assert text == "a"
    assert dec.push(ord("x")).content == "ENx"


def test_earliest_stop_string_wins_then_declaration_order():
    assert run(make(stop_strings=("cd", "b")), ids(b"abcd"))[1] == "a"
    assert run(make(stop_strings=("bc", "b")), ids(b"abcd"))[1] == "a"


def test_reasoning_stop_strings_apply_to_reasoning_only():
    toks = ids(b"think STOP more")
    assert run(make(thinking=True, reasoning_stop_strings=("STOP",)), toks) == ("think ", "", FinishReason.STOP_STRING)
    assert run(make(stop_strings=("zzz",), reasoning_stop_strings=("a",)), ids(b"banana"))[1] == "banana"


def test_incomplete_utf8_is_held_and_a_dangling_tail_becomes_replacement_at_the_end():
    snow = "☃".encode()  # three bytes
    dec = make()
    assert dec.push(snow[0]).content == "" and dec.push(snow[1]).content == ""
    assert dec.push(snow[2]).content == "☃"
    dec2 = make()
    dec2.push(snow[0])
    assert dec2.finish().content == "\ufffd"


def test_length_finish_flushes_held_text():
    dec = make(stop_strings=("END",))
    for t in ids(b"aE"):
        dec.push(t)
    assert dec.finish().content == "E" and dec.finished is FinishReason.LENGTH


def test_empty_stop_strings_are_rejected():
    with pytest.raises(ValueError):
        make(stop_strings=("",))


def test_reasoning_tokens_count_the_reasoning_channel():
    dec = make(thinking=True)
    run(dec, ids(b"ab") + [1002] + ids(b"c") + [STOP_ID])
    assert dec.reasoning_tokens == 3 and dec.generated_tokens == 5


def test_speculative_round_ending_on_a_stop_string_accepts_only_up_to_the_completing_token():
    dec = make(stop_strings=("END",))
    delta, accepted = dec.push_many(ids(b"abEND") + ids(b"zz"))
    assert (delta.content, delta.finish, accepted) == ("ab", FinishReason.STOP_STRING, 5)
    assert dec.generated_tokens == 5


def test_speculative_round_with_a_stop_token_counts_it_withholds_it_and_drops_the_rest():
    dec = make()
    delta, accepted = dec.push_many(ids(b"hi") + [STOP_ID] + ids(b"never"))
    assert (delta.content, delta.finish, accepted, dec.generated_tokens) == ("hi", FinishReason.STOP_TOKEN, 3, 3)


def test_speculative_round_crossing_think_close_counts_reasoning_per_token():
    dec = make(thinking=True)
    delta, accepted = dec.push_many(ids(b"hm") + [1002] + ids(b"\nok"))
    assert (delta.reasoning, delta.content, accepted) == ("hm", "ok", 6)
    assert dec.reasoning_tokens == 3 and dec.finished is None


def test_speculative_round_without_a_stop_takes_every_token():
    dec = make()
    assert dec.push_many([]) == (Delta(), 0)
    assert dec.push_many(ids(b"abc")) == (Delta(content="abc"), 3)


def test_tokens_after_the_finish_are_an_error():
    dec = make()
    dec.push_many([STOP_ID])
    with pytest.raises(RuntimeError):
        dec.push_many(ids(b"x"))


def test_stop_string_completed_first_wins_over_one_that_started_earlier():
    # §4.9: earliest by (token that completes the match, byte offset, declaration order).
    assert run(make(stop_strings=("END", "N")), ids(b"xEND")) == ("", "xE", FinishReason.STOP_STRING)


def test_stop_string_never_matches_across_the_think_boundary():
    toks = ids(b"abc</think>") + ids(b"def")
    assert run(make(thinking=True, stop_strings=("cd",)), toks) == ("abc", "def", FinishReason.LENGTH)
