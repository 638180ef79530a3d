"""/v1/messages and /v1/messages/count_tokens through the real app over HTTP (the tiny llama server of
server_harness, its process seed fixed since Anthropic requests carry none): event names on the wire, the error
flavor, and stream == message."""

from __future__ import annotations

import httpx
import pytest

from ninfer.server.context import SseEvent
from ninfer.server.sse import frame
from tests.support.server_harness import ServerThread, build_tiny_artifact
from tests.test_api_anthropic import accumulate, without_ids

REQUEST = {"model": "claude-sonnet-4-5", "max_tokens": 12, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = ServerThread.start(build_tiny_artifact(tmp_path_factory.mktemp("tiny")), "--max-context", "512",
                                 "--seed", "7", "--temperature", "1.0")
    yield running
    running.stop()


def post(server, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def parse(text: str) -> list[SseEvent]:
    events = []
    for block in text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        events.append(SseEvent(data.removeprefix("data: "), name.removeprefix("event: ")))
    return events


def test_the_stream_names_every_event_by_its_type_and_matches_the_message(server):
    response = post(server, {**REQUEST, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = parse(response.text)
    assert b"".join(frame(e) for e in events) == response.content
    assert [e.event for e in events][:2] == ["message_start", "content_block_start"]
    assert [e.event for e in events][-2:] == ["message_delta", "message_stop"]
    message = post(server, REQUEST).json()
    streamed = accumulate(events)  # checks every event name against its type
    assert without_ids(streamed)["content"] == without_ids(message)["content"]
    assert streamed["stop_reason"] == message["stop_reason"] == "max_tokens"


def test_count_tokens_counts_the_prompt_a_message_uses(server):
    counted = post(server, {k: v for k, v in REQUEST.items() if k != "max_tokens"}, "/v1/messages/count_tokens")
    usage = post(server, REQUEST).json()["usage"]
    assert counted.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}


def test_refusals_are_anthropic_error_bodies(server):
    response = post(server, {**REQUEST, "output_config": {"effort": "high"}})
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "output_config.effort" in body["error"]["message"]
