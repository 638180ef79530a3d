"""ResponseStream: the output decoder's channels with tool calls parsed from content only."""

import itertools

from ninfer.frontend.output import FinishReason, OutputDecoder
from ninfer.frontend.stream import ResponseStream, StreamDelta
from ninfer.frontend.tool_calls import TextDelta, ToolCallDone, ToolCallParser
from tests.test_output_decoder import STOP_ID, ByteTokenizer, ids
from tests.test_tool_calls import call_markup

CALL = call_markup("f", a="1")


def stream(*, tools: bool = True, **kw) -> ResponseStream:
    kw.setdefault("thinking", False)
    decoder = OutputDecoder(ByteTokenizer(), stop_ids={STOP_ID}, **kw)
    counter = itertools.count()
    return ResponseStream(decoder, ToolCallParser(new_id=lambda: f"call_{next(counter)}") if tools else None)


def test_without_tools_content_is_plain_text_events():
    s = stream(tools=False)
    delta, accepted = s.push(ids(b"hi ") + ids(CALL.encode()))
    assert delta == StreamDelta("", [TextDelta("hi " + CALL)]) and accepted == 3 + len(CALL)
    assert s.tool_calls == []


def test_call_in_content_is_parsed_and_reasoning_is_not():
    s = stream(thinking=True)
    delta, _ = s.push(ids(("think " + CALL).encode()) + [1002] + ids(("\n\nok " + CALL).encode()) + [STOP_ID])
    assert delta.reasoning == "think " + CALL
    assert delta.content[0] == TextDelta("ok ") and isinstance(delta.content[-1], ToolCallDone)
    assert delta.finish is FinishReason.STOP_TOKEN and [c.name for c in s.tool_calls] == ["f"]


def test_a_stop_string_cutting_a_call_flushes_it_as_text():
    s = stream(stop_strings=("</function>",))
    delta, accepted = s.push(ids(CALL.encode()))
    assert delta.finish is FinishReason.STOP_STRING and s.tool_calls == []
    assert "".join(e.text for e in delta.content) == CALL[: CALL.index("</function>")]
    assert accepted == CALL.index("</function>") + len("</function>")


def test_the_output_limit_flushes_an_open_call_as_text_and_a_second_finish_is_a_no_op():
    s = stream()
    s.push(ids(CALL[:-3].encode()))
    assert s.finish() == StreamDelta("", [TextDelta(CALL[:-3])], FinishReason.LENGTH)
    assert s.finish() == StreamDelta()
    assert s.decoder.finished is FinishReason.LENGTH
