"""Regressions for the tool-call and reasoning failures users hit in peer servers (anchors.md, "Where users of the peers
hurt"), on the real Qwen3.6 tokenizer where `<tool_call>` and `</think>` are single tokens."""

import itertools
from pathlib import Path

import pytest

from ninfer.frontend.output import FinishReason, OutputDecoder
from ninfer.frontend.stream import ResponseStream
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.frontend.tool_calls import TextDelta, ToolCallDone, ToolCallStarted, ToolCallParser
from tests.support.qwen_tokenizer import TOKENIZER_CONFIG
from tests.test_tool_calls import WEATHER, call_markup

IM_END, ENDOFTEXT = 248046, 248044
THINKING = "The user asks for weather. A call would look like " + call_markup("get_weather", city="Rome") + " so"
CALLS = [call_markup("get_weather", city="Paris", days="2"), call_markup("get_weather", city="São Paulo")]
CONTENT = "Let me check both cities.\n\n" + CALLS[0] + "\n" + CALLS[1]
ANSWER = THINKING + "\n</think>\n\n" + CONTENT
ROUND_SIZES = [1, 2, 3, 4, 5, 8, 1000]  # 1 = ordinary decoding; larger = speculative rounds (MTP, DFlash)


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_json: Path) -> Tokenizer:
    return Tokenizer(qwen_tokenizer_json.read_bytes(), TOKENIZER_CONFIG.read_bytes())


def run(tokenizer: Tokenizer, text: str, round_size: int, *, stop: bool = True, thinking: bool = True):
    """Stream `text` (plus <|im_end|>) in rounds; returns (reasoning, per-round content events, stream)."""
    counter = itertools.count()
    decoder = OutputDecoder(tokenizer, thinking=thinking, stop_ids={IM_END, ENDOFTEXT})
    response = ResponseStream(decoder, ToolCallParser([WEATHER], new_id=lambda: f"call_{next(counter)}"))
    token_ids = tokenizer.encode(text) + [IM_END] * stop
    reasoning, rounds = "", []
    for start in range(0, len(token_ids), round_size):
        delta, _ = response.push(token_ids[start : start + round_size])
        reasoning += delta.reasoning
        rounds.append(delta.content)
    if decoder.finished is None:
        delta = response.finish(FinishReason.LENGTH)
        reasoning += delta.reasoning
        rounds.append(delta.content)
    return reasoning, rounds, response


def flat(rounds) -> list:
    """All content events, adjacent text merged: the chunking-free view of a stream."""
    merged: list = []
    for event in itertools.chain.from_iterable(rounds):
        if isinstance(event, TextDelta) and merged and isinstance(merged[-1], TextDelta):
            merged[-1] = TextDelta(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


def test_the_tags_the_model_writes_are_single_tokens(tokenizer):
    assert tokenizer.token_id("<tool_call>") in tokenizer.encode(CALLS[0])
    assert tokenizer.token_id("</think>") in tokenizer.encode(ANSWER)


@pytest.mark.parametrize("round_size", ROUND_SIZES)
def test_tool_calls_do_not_leak_into_streamed_content(tokenizer, round_size):
    _, rounds, response = run(tokenizer, ANSWER, round_size)
    texts = [e.text for e in itertools.chain.from_iterable(rounds) if isinstance(e, TextDelta)]
    assert "".join(texts) == "Let me check both cities.\n\n\n"
    assert not any(tag in t for t in texts for tag in ("<tool", "<function", "<parameter", "</"))
    assert [c.arguments for c in response.tool_calls] == [{"city": "Paris", "days": 2}, {"city": "São Paulo"}]


@pytest.mark.parametrize("round_size", ROUND_SIZES)
def test_calls_written_inside_think_stay_reasoning_and_are_not_lost(tokenizer, round_size):
    reasoning, rounds, response = run(tokenizer, ANSWER, round_size)
    assert reasoning == THINKING + "\n"
    assert [c.markup for c in response.tool_calls] == CALLS  # the one in reasoning is not a call


def test_speculative_rounds_of_any_size_give_the_same_stream(tokenizer):
    results = [run(tokenizer, ANSWER, size) for size in ROUND_SIZES]
    assert all(flat(rounds) == flat(results[0][1]) for _, rounds, _ in results)
    assert all(r.decoder.generated_tokens == len(tokenizer.encode(ANSWER)) + 1 for _, _, r in results)
    assert len({r.decoder.reasoning_tokens for _, _, r in results}) == 1


def test_two_calls_in_one_delta_both_come_out(tokenizer):
    _, rounds, response = run(tokenizer, CONTENT, 1000, thinking=False)
    done = [e.index for e in rounds[0] if isinstance(e, ToolCallDone)]
    assert done == [0, 1] and len(response.tool_calls) == 2


def test_tool_use_block_indices_are_stable_and_each_opens_before_it_closes(tokenizer):
    for size in ROUND_SIZES:
        _, rounds, _ = run(tokenizer, ANSWER, size)
        order = [(type(e), e.index) for e in flat(rounds) if not isinstance(e, TextDelta)]
        started = [i for kind, i in order if kind is ToolCallStarted]
        assert started == [0, 1]
        assert order.index((ToolCallStarted, 1)) > order.index((ToolCallDone, 0))


@pytest.mark.parametrize("round_size", ROUND_SIZES)
def test_malformed_markup_streams_back_without_losing_bytes(tokenizer, round_size):
    broken = "Try: <tool_call>\n<function=get_weather>\n<city>Paris</city>\n</function>\n</tool_call> done"
    _, rounds, response = run(tokenizer, broken, round_size, thinking=False)
    assert flat(rounds) == [TextDelta(broken)] and response.tool_calls == []


@pytest.mark.parametrize("round_size", ROUND_SIZES)
def test_a_call_cut_by_the_output_limit_comes_back_as_text(tokenizer, round_size):
    cut = CONTENT[: CONTENT.index("São")]
    _, rounds, response = run(tokenizer, cut, round_size, stop=False, thinking=False)
    assert flat(rounds)[-1] == TextDelta("\n" + CALLS[1][: CALLS[1].index("São")])
    assert len(response.tool_calls) == 1 and response.decoder.finished is FinishReason.LENGTH
