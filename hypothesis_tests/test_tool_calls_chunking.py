"""The tool-call parser is exact under any chunking: the same calls and the same text whatever the cuts, no byte lost or
duplicated, and well-formed calls come back with the arguments they were written from."""

import itertools
import json

from hypothesis import given, settings, strategies as st

from hypothesis_tests.test_output_chunking import STOP_ID, THINK_CLOSE, TableTokenizer, cut
from ninfer.frontend.output import OutputDecoder
from ninfer.frontend.stream import ResponseStream
from ninfer.frontend.tool_calls import TextDelta, ToolCallArgumentsDelta, ToolCallDone, ToolCallParser, ToolCallStarted

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)
# String values may hold anything the format allows: tags, whitespace at the edges, even `</tool_call>`.
# A long piece makes regions outgrow the parser's working buffer, so its compaction is exercised too.
LONG = "long value " * 120
string_values = st.lists(st.sampled_from(["a", " ", "\n", "<", "é", "<tool_call>", "</tool_call>", "</function>",
                                          "42", "<parameter=x>", LONG]), max_size=6).map("".join)
names = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
keys = st.sampled_from(["s1", "s2", "v1", "v2", "free"])


@st.composite
def calls(draw):
    """(name, arguments, markup as the template renders it): `s*` keys are strings, `v*`/`free` any JSON."""
    arguments = {}
    for key in draw(st.lists(keys, max_size=4, unique=True)):
        arguments[key] = draw(string_values if key.startswith("s") else json_values)
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) and k.startswith('s') else json.dumps(v)}\n"
                   "</parameter>\n" for k, v in arguments.items())
    name = draw(names)
    return name, arguments, f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def tools_for(call_list) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
        k: {"type": "string"} if k.startswith("s") else {} for k in ("s1", "s2", "v1", "v2", "free")}}}}
        for name in {name for name, _, _ in call_list}]


fragments = st.sampled_from([
    "a", " ", "\n", "<", "é", "☃", "<tool_call>", "</tool_call>", "<function=f>", "<function=bad name>",
    "<parameter=x>", "</parameter>", "</function>", "1", '{"k": [1]}', "<tool_", "call>", "<tool_call>\n<function=f>\n",
    "\n</parameter>\n", "<parameter=x>\n1\n</parameter>\n", "</function>\n</tool_call>", LONG])
texts = st.lists(fragments | calls().map(lambda c: c[2]), max_size=25).map("".join)


def parse(text: str, cuts: list[int], tools=None):
    """Feed `text` in pieces; returns the merged event list (deterministic ids) and the parser."""
    counter = itertools.count()
    parser = ToolCallParser(tools, new_id=lambda: f"call_{next(counter)}")
    events = [e for piece in cut(text, cuts) for e in parser.feed(piece)] + parser.finish()
    return merge_text(events), parser


def merge_text(events) -> list:
    merged: list = []
    for event in events:
        if isinstance(event, TextDelta) and merged and isinstance(merged[-1], TextDelta):
            merged[-1] = TextDelta(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


def reassemble(events) -> str:
    return "".join(e.text if isinstance(e, TextDelta) else e.call.markup for e in events
                   if isinstance(e, TextDelta | ToolCallDone))


@settings(max_examples=500, deadline=None)
@given(text=texts, data=st.data())
def test_events_do_not_depend_on_chunking_and_no_byte_is_lost(text, data):
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=len(text)))
    events, parser = parse(text, cuts)
    assert events == parse(text, [])[0]
    assert reassemble(events) == text
    for done in (e for e in events if isinstance(e, ToolCallDone)):
        deltas = [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == done.index]
        assert "".join(deltas) == done.call.arguments_json
        assert json.loads(done.call.arguments_json) == done.call.arguments
    assert [e.index for e in events if isinstance(e, ToolCallStarted)] == list(range(len(parser.calls)))


plain_text = st.lists(st.sampled_from(["a", " ", "\n", "<", "<tool", "<tool_", "é", "</tool_call>", "<function=f>"]),
                      max_size=5).map("".join)


@settings(max_examples=300, deadline=None)
@given(segments=st.lists(st.tuples(plain_text, calls()), max_size=4), tail=plain_text, data=st.data())
def test_well_formed_calls_come_back_exactly(segments, tail, data):
    text = "".join(before + markup for before, (_, _, markup) in segments) + tail
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=len(text)))
    events, parser = parse(text, cuts, tools_for([c for _, c in segments]))
    assert [(c.name, c.arguments, c.markup) for c in parser.calls] == [c for _, c in segments]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "".join(b for b, _ in segments) + tail


answer_pieces = fragments | st.sampled_from([THINK_CLOSE, "\n\n"]) | calls().map(lambda c: c[2])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(answer_pieces, max_size=20), thinking=st.booleans(), data=st.data())
def test_token_rounds_through_the_response_stream_match_the_one_shot_answer(pieces, thinking, data):
    text = "".join(pieces)
    raw = text.encode()
    tokens = cut(raw, data.draw(st.lists(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw))))
    token_ids = list(range(1, len(tokens) + 1)) + [STOP_ID]
    rounds = cut(token_ids, data.draw(st.lists(st.integers(1, len(token_ids)), max_size=len(token_ids))))
    counter = itertools.count()
    response = ResponseStream(OutputDecoder(TableTokenizer(tokens), thinking=thinking, stop_ids={STOP_ID}),
                              ToolCallParser(new_id=lambda: f"call_{next(counter)}"))
    reasoning, events = "", []
    for round_ids in rounds:
        delta, _ = response.push(round_ids)
        reasoning, events = reasoning + delta.reasoning, events + delta.content

    expected_reasoning, content = "", text
    if thinking:
        expected_reasoning, _, content = text.partition(THINK_CLOSE)
        content = content.lstrip()
    assert reasoning == expected_reasoning
    assert merge_text(events) == parse(content, [])[0]
