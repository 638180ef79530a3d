"""/v1/chat/completions through the real app over HTTP (hypercorn, the tiny llama server of server_harness): SSE
framing on the wire, the error flavor, and stream == non-stream for one seed."""

from __future__ import annotations

import json

import httpx
import pytest

from ninfer.server.context import SseEvent
from tests.support.server_harness import ServerThread, build_tiny_artifact
from tests.test_api_chat import accumulate

MODEL = "llama-custom"
REQUEST = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "seed": 99,
           "temperature": 1.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = ServerThread.start(build_tiny_artifact(tmp_path_factory.mktemp("tiny")), "--max-context", "512")
    yield running
    running.stop()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_the_stream_is_data_lines_ending_in_done(server):
    response = post(server, {**REQUEST, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert all(f.startswith("data: {") and "\n" not in f for f in frames[:-2])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}


def test_stream_and_completion_agree_for_one_seed(server):
    streamed = post(server, {**REQUEST, "stream": True, "stream_options": {"include_usage": True}}).text
    events = [SseEvent(f.removeprefix("data: ")) for f in streamed.split("\n\n")[:-1]]
    completion = post(server, REQUEST).json()
    rebuilt = accumulate(events)
    assert rebuilt["message"] == completion["choices"][0]["message"]
    assert rebuilt["finish_reason"] == completion["choices"][0]["finish_reason"]
    assert rebuilt["usage"]["completion_tokens"] == completion["usage"]["completion_tokens"]


def test_refusals_are_openai_error_bodies(server):
    unknown = post(server, {**REQUEST, "foo": 1})
    assert unknown.status_code == 400
    assert unknown.json() == {"error": {"message": "unknown parameter 'foo'", "type": "invalid_request_error",
                                        "param": "foo", "code": "unknown_parameter"}}
    wrong_model = post(server, {**REQUEST, "model": "gpt-4o"})
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    too_long = post(server, {**REQUEST, "messages": [{"role": "user", "content": "word " * 600}], "stream": True})
    error = too_long.json()["error"]
    assert too_long.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["max_context"] == 512 and error["prompt_tokens"] > 512
