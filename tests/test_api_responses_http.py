"""/v1/responses through the real app over HTTP (a tiny random llama with a ChatML template): the JSON body, the SSE
wire format (event names, sequence numbers, one terminal event, no [DONE]), the resources, a Codex-style second
turn, and errors in the OpenAI error shape."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.server_harness import ServerThread, build_tiny_artifact

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    artifact = build_tiny_artifact(tmp_path_factory.mktemp("tiny"))
    running = ServerThread.start(artifact, "--max-context", "512", "--model-id", MODEL, "--greedy",
                                 "--response-store-max-records", "4")
    yield running
    running.stop()


def create(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "max_output_tokens": 16, **body},
                      timeout=60)


def sse_frames(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each frame; every frame has exactly one event line and one data line."""
    frames = response.text.split("\n\n")
    assert frames[-1] == ""
    parsed = []
    for frame in frames[:-1]:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        parsed.append((event_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return parsed


def test_create_retrieve_list_and_delete(server):
    created = create(server, input="hello there", instructions="Be brief.")
    assert created.status_code == 200 and created.headers["content-type"] == "application/json"
    response = created.json()
    assert response["status"] == "incomplete" and response["model"] == MODEL  # 16 random tokens: the limit
    [message] = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert response["usage"]["output_tokens"] == 16 and response["usage"]["input_tokens"] > 0
    url = f"{server.url}/v1/responses/{response['id']}"
    assert httpx.get(url).json() == response
    items = httpx.get(f"{url}/input_items").json()
    assert [(i["role"], i["content"]) for i in items["data"]] == [
        ("user", [{"type": "input_text", "text": "hello there"}])]
    assert httpx.delete(url).json() == {"id": response["id"], "deleted": True, "object": "response.deleted"}
    missing = httpx.get(url)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "response_not_found"
    assert missing.json()["error"]["type"] == "invalid_request_error"


def test_the_stream_on_the_wire_is_what_the_json_body_is(server):
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60,
                      json={"model": MODEL, "input": "hello there", "max_output_tokens": 16, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        r.read()
    assert "[DONE]" not in r.text
    frames = sse_frames(r)
    assert all(name == data["type"] for name, data in frames)
    assert [data["sequence_number"] for _, data in frames] == list(range(len(frames)))
    names = [name for name, _ in frames]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    terminal = frames[-1][1]["response"]
    text = "".join(data["delta"] for name, data in frames if name == "response.output_text.delta")
    assert terminal["output"][0]["content"][0]["text"] == text
    # --greedy: the same request answered as one JSON body says the same.
    answer = create(server, input="hello there").json()
    assert answer["output"][0]["content"] == terminal["output"][0]["content"]
    assert httpx.get(f"{server.url}/v1/responses/{terminal['id']}").json() == terminal


def test_a_second_turn_by_id_and_by_replaying_the_items(server):
    first = create(server, input="hello").json()
    by_id = create(server, input="and then?", previous_response_id=first["id"])
    assert by_id.status_code == 200 and by_id.json()["previous_response_id"] == first["id"]
    assert by_id.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    replayed = create(server, input=[{"role": "user", "content": "hello"}, *first["output"],
                                     {"role": "user", "content": "and then?"}], store=False)
    assert replayed.status_code == 200
    assert replayed.json()["usage"]["input_tokens"] == by_id.json()["usage"]["input_tokens"]
    assert replayed.json()["output"][0]["content"] == by_id.json()["output"][0]["content"]  # --greedy


def test_input_tokens_and_errors_in_the_openai_shape(server):
    counted = httpx.post(f"{server.url}/v1/responses/input_tokens", json={"model": MODEL, "input": "hello"})
    assert counted.json()["object"] == "response.input_tokens" and counted.json()["input_tokens"] > 0
    unknown = create(server, input="x", frobnicate=True)
    assert unknown.status_code == 400
    assert unknown.json() == {"error": {"message": "unknown parameter 'frobnicate'", "type": "invalid_request_error",
                                        "param": "frobnicate", "code": "unknown_parameter"}}
    streamed_error = create(server, input="x", stream=True, background=True)
    assert streamed_error.status_code == 400 and streamed_error.json()["error"]["code"] == "background_not_supported"
    assert httpx.post(f"{server.url}/v1/responses/resp_x/cancel").json()["error"]["code"] == \
        "background_not_supported"
    assert httpx.post(f"{server.url}/v1/responses/compact", json={}).json()["error"]["code"] == \
        "compaction_not_supported"
    too_long = create(server, input="word " * 600)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
