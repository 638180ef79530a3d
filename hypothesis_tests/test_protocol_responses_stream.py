"""Responses streaming from any generation: whatever the mix of reasoning, answer text and function calls and however
it is cut into deltas, the events are numbered 0, 1, 2, ...; every Item is added, streamed and done in order with
stable ids and indices; and the concatenated deltas are exactly the Items of the response."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from ninfer.frontend.tool_calls import TextDelta, ToolCall, ToolCallArgumentsDelta, ToolCallDone, ToolCallStarted
from ninfer.protocol.openai_responses import CONVERTER, FunctionCallItem, StreamEvent
from ninfer.server.generation import ReasoningDelta
from ninfer.server.openai_responses import OutputBuilder

pieces = st.text(min_size=1, max_size=6)


@st.composite
def segments(draw):
    """(kind, pieces) runs of one output: "reasoning", "text" or "call" (a call's argument pieces)."""
    kinds = draw(st.lists(st.sampled_from(["reasoning", "text", "call"]), max_size=6))
    return [(kind, draw(st.lists(pieces, min_size=1, max_size=4))) for kind in kinds]


def generation_events(runs):
    events, calls = [], 0
    for kind, parts in runs:
        if kind == "reasoning":
            events += [ReasoningDelta(part) for part in parts]
        elif kind == "text":
            events += [TextDelta(part) for part in parts]
        else:
            call = ToolCall(id=f"call_{calls}", name="f", arguments={}, arguments_json="".join(parts), markup="")
            events += [ToolCallStarted(calls, call.id, "f"), *(ToolCallArgumentsDelta(calls, p) for p in parts),
                       ToolCallDone(calls, call)]
            calls += 1
    return events


def expected_items(runs):
    """(type, text) of each Item: adjacent runs of one text kind are one Item, each call is its own."""
    items = []
    for kind, parts in runs:
        kind = {"reasoning": "reasoning", "text": "message", "call": "function_call"}[kind]
        if items and kind != "function_call" and items[-1][0] == kind:
            items[-1] = (kind, items[-1][1] + "".join(parts))
        else:
            items.append((kind, "".join(parts)))
    return items or [("message", "")]  # an empty output is one empty message


def item_text(item: dict) -> str:
    return item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]


@settings(max_examples=300, deadline=None)
@given(runs=segments(), status=st.sampled_from(["completed", "incomplete"]))
def test_concatenated_deltas_are_the_items(runs, status):
    builder = OutputBuilder()
    events: list[StreamEvent] = []
    for event in generation_events(runs):
        events += builder.feed(event)
    events += builder.finish(status)
    wire = [json.loads(json.dumps(CONVERTER.unstructure(e))) for e in events]
    assert [e["sequence_number"] for e in wire] == list(range(len(wire)))

    added, streamed, done = {}, {}, {}
    for event in wire:
        kind = event["type"]
        if kind == "response.output_item.added":
            index = event["output_index"]
            assert index == len(added) == len(done) and event["item"]["status"] == "in_progress"
            added[index], streamed[index] = event["item"], ""
        elif kind == "response.output_item.done":
            index = event["output_index"]
            assert index not in done and event["item"]["id"] == added[index]["id"]
            done[index] = event["item"]
        else:
            index = event["output_index"]
            assert index in added and index not in done and event["item_id"] == added[index]["id"]
            if kind.endswith(".delta"):
                streamed[index] += event["delta"]
            elif kind.endswith("text.done"):
                assert event["text"] == streamed[index]
            elif kind == "response.function_call_arguments.done":
                assert event["arguments"] == streamed[index] and event["name"] == added[index]["name"]

    items = [CONVERTER.unstructure(item) for item in builder.items]
    assert [done[i] for i in range(len(done))] == items
    assert [(item["type"], item_text(item)) for item in items] == expected_items(runs)
    assert all(streamed[i] == item_text(items[i]) for i in range(len(items)))
    assert len({item["id"] for item in items}) == len(items)
    # Only the Item still open at the end takes the response's ending; a finished call is complete.
    last = "completed" if items[-1]["type"] == "function_call" else status
    assert [item["status"] for item in items] == ["completed"] * (len(items) - 1) + [last]
    calls = [item for item in builder.items if isinstance(item, FunctionCallItem)]
    assert [call.call_id for call in calls] == [f"call_{i}" for i in range(len(calls))]
    assert all(call.id.startswith("fc_") for call in calls)
