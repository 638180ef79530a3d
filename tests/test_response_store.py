"""The local Response store: LRU by records and bytes, conversations as shared segments, deletion that keeps the
descendants' conversations, exact byte accounting, and the refusal of a Response larger than the store."""

from __future__ import annotations

import pytest

from ninfer.protocol.openai_responses import (InputText, Message, OutputText, ReasoningConfig, Response, TextConfig,
                                              TextFormat)
from ninfer.server.response_store import ResponseStore, ResponseStoreFull, json_bytes


def user(text: str, item_id: str) -> Message:
    return Message(role="user", content=(InputText(text=text),), id=item_id)


def response(response_id: str, answer: str = "ok") -> Response:
    output = (Message(role="assistant", content=(OutputText(text=answer),), id=f"msg_{response_id}",
                      status="completed"),)
    return Response(id=response_id, created_at=0, status="completed", model="m", output=output, usage=None,
                    error=None, incomplete_details=None, instructions=None, previous_response_id=None,
                    max_output_tokens=None, temperature=None, top_p=None, metadata={},
                    reasoning=ReasoningConfig(), text=TextConfig(format=TextFormat()), tools=(), tool_choice="auto",
                    store=True)


def put(store: ResponseStore, response_id: str, parent: str | None = None, *, answer: str = "ok",
        preserve_thinking: bool = False):
    return store.put(response(response_id, answer), (user(f"q {response_id}", f"in_{response_id}"),),
                     parent=store.get(parent) if parent else None, preserve_thinking=preserve_thinking)


def texts(items) -> list[str]:
    return [part.text for item in items for part in item.content]


def test_a_chain_replays_every_turn_in_order():
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    put(store, "a", answer="A")
    put(store, "b", "a", answer="B")
    stored = put(store, "c", "b", answer="C", preserve_thinking=True)
    assert texts(stored.conversation) == ["q a", "A", "q b", "B", "q c", "C"]
    assert texts(stored.input_items) == ["q c"] and stored.preserve_thinking
    assert store.get("c").response.output[0].content[0].text == "C"


def test_bytes_count_each_response_and_each_live_segment_once():
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    a, b = put(store, "a"), put(store, "b", "a")
    segment = json_bytes((user("q a", "in_a"),) + a.response.output)
    assert store.nbytes == a.nbytes + b.nbytes + 2 * segment  # b's segment is as large as a's
    assert store.delete("a") and "a" not in store
    assert store.nbytes == b.nbytes + 2 * segment  # a's segment lives on in b's conversation
    assert texts(store.get("b").conversation) == ["q a", "ok", "q b", "ok"]
    assert store.delete("b") and store.nbytes == 0 and len(store) == 0
    assert not store.delete("b")


def test_the_least_recently_used_goes_first_when_records_run_out():
    store = ResponseStore(max_records=2, max_bytes=1 << 20)
    put(store, "a")
    put(store, "b")
    assert store.get("a") is not None  # now b is the least recently used
    put(store, "c")
    assert "b" not in store and "a" in store and "c" in store


def test_the_byte_budget_evicts_until_the_new_response_fits():
    one = json_bytes(response("a")) + json_bytes((user("q a", "in_a"),) + response("a").output)
    store = ResponseStore(max_records=100, max_bytes=3 * one + one // 2)
    for name in "abcd":
        put(store, name)
    assert [name for name in "abcd" if name in store] == ["b", "c", "d"] and store.nbytes <= store.max_bytes


def test_an_evicted_parent_keeps_its_childs_conversation():
    store = ResponseStore(max_records=2, max_bytes=1 << 20)
    put(store, "a", answer="A")
    put(store, "b", "a", answer="B")
    put(store, "x")
    assert "a" not in store
    assert texts(store.get("b").conversation) == ["q a", "A", "q b", "B"]


def test_a_child_of_a_parent_deleted_during_its_generation_still_gets_the_whole_conversation():
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    parent = put(store, "a", answer="A")
    store.delete("a")
    assert store.nbytes == 0
    child = store.put(response("b", "B"), (user("q b", "in_b"),), parent=parent, preserve_thinking=False)
    assert texts(child.conversation) == ["q a", "A", "q b", "B"]
    assert store.nbytes == child.nbytes + json_bytes(child.conversation[:2]) + json_bytes(child.conversation[2:])


def test_a_response_larger_than_the_store_is_refused_and_nothing_changes():
    store = ResponseStore(max_records=10, max_bytes=2000)
    put(store, "a")
    before = store.nbytes
    with pytest.raises(ResponseStoreFull):
        put(store, "big", answer="x" * 2000)
    assert "big" not in store and "a" in store and store.nbytes == before
    with pytest.raises(ResponseStoreFull):
        store.check_fits((user("y" * 2000, "in_y"),), None)
    store.check_fits((user("small", "in_s"),), store.get("a"))


def test_a_long_chain_stays_within_its_budget():
    store = ResponseStore(max_records=10_000, max_bytes=1 << 20)
    parent = None
    for turn in range(2000):  # deeper than Python's recursion limit: holds and releases walk the chain in loops
        put(store, f"r{turn}", parent)
        parent = f"r{turn}"
    assert len(store.get(parent).conversation) == 4000 and store.nbytes <= store.max_bytes
    assert "r0" not in store  # older records were evicted; their segments live on in the chain
    for turn in range(2000):
        store.delete(f"r{turn}")
    assert store.nbytes == 0
