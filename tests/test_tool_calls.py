"""The streaming Qwen XML tool-call parser: holdback, calls, typing by schema, malformed markup (ninfer-facts §5.4)."""

import itertools
import json
import re
from pathlib import Path

import pytest

from ninfer.frontend.chat import ChatTemplate
from ninfer.frontend.tool_calls import (
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallDone,
    ToolCallParser,
    ToolCallStarted,
    new_call_id,
    parse_tool_calls,
)

TEMPLATE = Path(__file__).parent / "fixtures" / "qwen" / "Qwen3.6-27B" / "chat_template.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "where": {"type": "object"}, "hours": {"type": "array"}, "scale": {"type": "number"},
    "note": {"type": ["string", "null"]}, "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}}


def call_markup(name: str, **params: str) -> str:
    """What the model writes: the template's own layout (§5.2), values given already as text."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parser(tools=None, **kw) -> ToolCallParser:
    counter = itertools.count()
    return ToolCallParser(tools, new_id=lambda: f"call_{next(counter)}", **kw)


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def arguments(text: str, tools=None) -> dict:
    content, calls = parse_tool_calls(text, tools)
    assert len(calls) == 1, (content, calls)
    return calls[0].arguments


# --- text outside calls --------------------------------------------------------------------------------------------


def test_plain_text_streams_at_once():
    p = parser()
    assert p.feed("Hello, ") == [TextDelta("Hello, ")]
    assert p.feed("a < b and <b>bold</b>") == [TextDelta("a < b and <b>bold</b>")]
    assert p.finish() == []


def test_only_a_possible_tool_call_prefix_is_held_and_released_once_it_cannot_be_one():
    p = parser()
    assert p.feed("see <tool") == [TextDelta("see ")]
    assert p.feed("_c") == []
    assert p.feed("alls") == [TextDelta("<tool_calls")]


def test_a_held_prefix_comes_back_at_the_end():
    p = parser()
    assert p.feed("x <tool_ca") == [TextDelta("x ")]
    assert p.finish() == [TextDelta("<tool_ca")]


def test_last_angle_bracket_decides_the_holdback():
    p = parser()
    assert p.feed("<<<") == [TextDelta("<<")]
    assert p.feed("tool_call>") == []  # now inside a region


# --- calls ---------------------------------------------------------------------------------------------------------


def test_one_call_gives_started_arguments_done_with_the_exact_markup():
    markup = call_markup("get_weather", city="Paris", days="3")
    p = parser([WEATHER])
    events = p.feed("Checking.\n\n" + markup) + p.finish()
    call = p.calls[0]
    assert events == [TextDelta("Checking.\n\n"), ToolCallStarted(0, "call_0", "get_weather"),
                      ToolCallArgumentsDelta(0, '{"city":"Paris","days":3}'), ToolCallDone(0, call)]
    assert call.arguments == {"city": "Paris", "days": 3} and call.markup == markup
    assert json.loads(call.arguments_json) == call.arguments


def test_nothing_of_a_call_comes_out_before_its_closing_tag():
    markup = call_markup("f", a="1")
    p = parser()
    assert p.feed(markup[:-1]) == []
    assert [type(e) for e in p.feed(markup[-1])] == [ToolCallStarted, ToolCallArgumentsDelta, ToolCallDone]


def test_several_calls_and_text_between_them_in_one_chunk():
    text = "a" + call_markup("f", x="1") + "\n" + call_markup("g") + call_markup("h", y="z") + "b"
    p = parser()
    events = p.feed(text) + p.finish()
    assert [(type(e).__name__, getattr(e, "index", None)) for e in events if not isinstance(e, TextDelta)] == [
        (kind, i) for i in range(3) for kind in ("ToolCallStarted", "ToolCallArgumentsDelta", "ToolCallDone")]
    assert text_of(events) == "a\nb"
    assert [c.name for c in p.calls] == ["f", "g", "h"] and [c.arguments for c in p.calls] == [{"x": 1}, {}, {"y": "z"}]


def test_whitespace_between_tags_is_flexible():
    text = "<tool_call><function=f>  <parameter=a>1</parameter>\t\r\n</function> </tool_call>"
    assert parse_tool_calls(text)[1][0].arguments == {"a": 1}


def test_values_lose_exactly_the_renderer_newlines():
    text = call_markup("f", a="\n  indented\n", b="", c="line one\nline two")
    assert arguments(text) == {"a": "\n  indented\n", "b": "", "c": "line one\nline two"}
    assert arguments("<tool_call><function=f><parameter=a>no newlines</parameter></function></tool_call>") == {
        "a": "no newlines"}


def test_a_value_may_hold_tags_even_tool_call_markup():
    inner = "<tool_call>\n<function=x>\n</function>\n</tool_call> and <b>"
    assert arguments(call_markup("write", content=inner)) == {"content": inner}


def test_duplicate_parameter_keeps_the_last_value():
    twice = call_markup("f", a="1").replace("</function>", "<parameter=a>\n2\n</parameter>\n</function>")
    assert arguments(twice) == {"a": 2}


def test_name_length_limit_is_64_by_default_and_configurable():
    long_name = "n" * 65
    assert parse_tool_calls(call_markup(long_name))[1] == []
    assert parse_tool_calls(call_markup(long_name), max_name_length=128)[1][0].name == long_name
    assert parse_tool_calls(call_markup("n" * 64))[1][0].name == "n" * 64


def test_default_ids_follow_the_reference_form():
    _, calls = parse_tool_calls(call_markup("f") + call_markup("f"))
    assert all(re.fullmatch(r"call_[0-9a-f]{16}", c.id) for c in calls) and calls[0].id != calls[1].id
    assert re.fullmatch(r"call_[0-9a-f]{16}", new_call_id())


def test_round_trip_through_the_official_template():
    args = {"city": "  Paris\n", "days": 3, "where": {"lat": 1.5, "tags": ["a", "é"]}, "metric": False, "note": None}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": args}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "42"}}}]}]
    prompt = ChatTemplate(TEMPLATE.read_text()).render(messages, add_generation_prompt=False)
    answer = prompt.split("</think>\n\n")[-1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(answer, [WEATHER])
    assert content.strip() == "Sure."
    assert [c.arguments for c in calls] == [args, {"city": "42"}]


# --- typing by schema ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "text", "value"), [
    ("city", "42", "42"),  # a string parameter keeps the text verbatim, even when it looks like JSON
    ("city", '"quoted"', '"quoted"'),
    ("days", "7", 7),
    ("days", "seven", "seven"),  # does not parse: the text
    ("metric", "true", True),
    ("where", '{"lat": 1}', {"lat": 1}),
    ("hours", "[1, 2]", [1, 2]),
    ("scale", "2.5", 2.5),
    ("scale", "NaN", "NaN"),  # not JSON, though Python's json would take it
    ("scale", "1e999", "1e999"),
    ("note", "null", None),
    ("note", "hello", "hello"),
    ("note", "3", "3"),  # a string-or-null parameter: 3 is neither a null nor wanted as a number
    ("mode", "3", 3),
    ("mode", "fast", "fast"),
    ("unknown", '{"a": [true]}', {"a": [True]}),  # not in the schema: JSON if valid
    ("unknown", "plain words", "plain words"),
])
def test_values_are_typed_by_the_tool_schema(key, text, value):
    assert arguments(call_markup("get_weather", **{key: text}), [WEATHER]) == {key: value}


def test_unknown_tool_or_no_tools_is_json_if_valid():
    assert arguments(call_markup("other", a="12", b="x", c="[1]"), [WEATHER]) == {"a": 12, "b": "x", "c": [1]}
    assert arguments(call_markup("get_weather", city="12")) == {"city": 12}


def test_tools_without_a_usable_schema_leave_values_untyped():
    tools = ["junk", {"function": "junk"}, {"type": "function", "function": {"name": "f", "parameters": True}}]
    assert arguments(call_markup("f", a="1"), tools) == {"a": 1}


def test_responses_and_anthropic_tool_shapes_are_understood():
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    responses_tool = {"type": "function", "name": "search", "parameters": schema}
    for tool in (responses_tool, {"name": "search", "input_schema": schema}):
        assert arguments(call_markup("search", q="1"), [tool]) == {"q": "1"}


# --- malformed markup: flushed back as text, nothing lost ----------------------------------------------------------


MALFORMED = {
    "text_after_open_tag": "<tool_call>hello</tool_call>",
    "json_body_of_other_formats": '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "unknown_tag_inside": "<tool_call>\n<function=f>\n<param=a>\n1\n</param>\n</function>\n</tool_call>",
    "missing_function_close": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
    "text_between_parameters": "<tool_call>\n<function=f>\nsay\n<parameter=a>\n1\n</parameter>\n</function>\n"
                               "</tool_call>",
    "text_before_close": "<tool_call>\n<function=f>\n</function>\nmore</tool_call>",
    "bad_function_name": "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
    "empty_function_name": "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "empty_parameter_key": "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",
    "never_closed": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n",
    "eof_inside_value": "<tool_call>\n<function=f>\n<parameter=a>\npartial val",
    "eof_after_open_tag": "text <tool_call>",
    "value_holding_parameter_close": call_markup("f", a="x</parameter>y"),
}


@pytest.mark.parametrize("text", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_markup_is_text_with_no_byte_lost(text):
    for chunk in (len(text), 1, 3):
        p = parser()
        events = [e for i in range(0, len(text), chunk) for e in p.feed(text[i : i + chunk])] + p.finish()
        assert text_of(events) == text and p.calls == []


def test_a_failed_region_is_rescanned_for_a_call_right_after_its_open_tag():
    good = call_markup("f", a="1")
    content, calls = parse_tool_calls("<tool_call>oops " + good)
    assert content == "<tool_call>oops " and calls[0].markup == good
    content, calls = parse_tool_calls("<tool_call>" + good)
    assert content == "<tool_call>" and [c.name for c in calls] == ["f"]


def test_a_call_quoted_inside_an_unfinished_one_is_found_at_the_end():
    # The outer region never closes, so its open tag is text; the complete call written inside it still counts.
    inner = call_markup("f")
    content, calls = parse_tool_calls("<tool_call>\n<function=write>\n<parameter=c>\n" + inner)
    assert content == "<tool_call>\n<function=write>\n<parameter=c>\n" and calls[0].markup == inner


def test_malformed_markup_is_released_as_soon_as_it_is_malformed():
    p = parser()
    assert p.feed("<tool_call>\n<function=f>\n<x") == [TextDelta("<tool_call>\n<function=f>\n<x")]
    assert p.feed("<tool_call>\n<function=") == []
    assert p.feed("a b") == [TextDelta("<tool_call>\n<function=a b")]


# --- long regions: the working buffer moves consumed text out as the region grows -----------------------------------

LONG_VALUE = "".join(f"line {i}: <b>{'x' * (i % 50)}</b>\n" for i in range(300))


def feed_in_pieces(text: str, sizes=(1, 7, 3, 64, 2)) -> tuple[list, ToolCallParser]:
    p, events, at = parser(), [], 0
    for size in itertools.cycle(sizes):
        if at >= len(text):
            return events + p.finish(), p
        events += p.feed(text[at : at + size])
        at += size


def test_a_long_call_fed_in_small_pieces_is_exact():
    markup = call_markup("write", path="a.py", content=LONG_VALUE)
    events, p = feed_in_pieces("before " + markup + " after")
    assert text_of(events) == "before  after"
    assert p.calls[0].arguments == {"path": "a.py", "content": LONG_VALUE} and p.calls[0].markup == markup


@pytest.mark.parametrize("ending", ["", "\n</parameter>\n<oops>", "\n</parameter>\n</function>\n</tool_call"])
def test_a_long_region_that_fails_comes_back_whole(ending):
    text = "<tool_call>\n<function=write>\n<parameter=content>\n" + LONG_VALUE + ending
    events, p = feed_in_pieces(text)
    assert text_of(events) == text and p.calls == []


def test_a_region_opened_in_a_big_chunk_continues_in_small_ones():
    markup = call_markup("write", content=LONG_VALUE)
    p = parser()
    events = p.feed("x" * 5000 + markup[:3000])
    for ch in markup[3000:]:
        events += p.feed(ch)
    assert text_of(events) == "x" * 5000 and p.calls[0].markup == markup
