"""Random JSON bodies and random junk bytes posted to every endpoint of the live server (the tiny llama of
server_harness) never produce a 5xx or a hung connection: each request has a timeout, and the examples are bounded.

The JSON bodies are built from each API's own vocabulary (model, messages, input, tools, stream...) with arbitrary
values, so that they get past the first checks and reach the schema, the prompt preparation and, now and then, a
short generation (--default-max-tokens 4, a small --max-context)."""

from __future__ import annotations

import json
import os
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.server.app import default_routes
from tests.support.server_harness import ServerThread, build_tiny_artifact

MODEL = "llama-custom"
TIMEOUT = httpx.Timeout(30.0)
ROUTES = sorted({(route.method, route.pattern) for route in default_routes()})
FIELDS = ["model", "messages", "input", "instructions", "max_tokens", "max_output_tokens", "max_completion_tokens",
          "stream", "stream_options", "tools", "tool_choice", "temperature", "top_p", "top_k", "seed", "stop",
          "system", "role", "content", "type", "text", "previous_response_id", "store", "metadata", "reasoning",
          "reasoning_effort", "thinking", "chat_template_kwargs", "n", "include_usage", "name", "arguments",
          "call_id", "tool_call_id", "output", "function", "parameters", "input_schema", "image_url", "source",
          "truncation", "include", "background", "response_format", "logprobs", "presence_penalty"]
SMALL_INTS = st.integers(-3, 40) | st.sampled_from([0, 1, 16, 2**31, -(2**63), 10**30])
scalars = (st.none() | st.booleans() | SMALL_INTS | st.floats(allow_nan=False, width=32)
           | st.text(max_size=12) | st.sampled_from([MODEL, "user", "assistant", "system", "tool", "developer",
                                                    "text", "input_text", "function", "auto", "none", "image"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), inner, max_size=4),
                           max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(
    lambda body: {**body, "model": body.get("model", MODEL)}) | json_values
path_ids = st.text(string.ascii_letters + string.digits + "_-.%", min_size=1, max_size=16)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = ServerThread.start(build_tiny_artifact(tmp_path_factory.mktemp("tiny")), "--max-context", "256",
                                 "--default-max-tokens", "4", "--pending-timeout-ms", "20000")
    yield running
    running.stop()


def url_of(server, pattern: str, ident: str) -> str:
    return server.url + pattern.replace("{id:path}", ident).replace("{id}", ident)


STATUSES: dict[int, int] = {}


def check(response: httpx.Response) -> None:
    STATUSES[response.status_code] = STATUSES.get(response.status_code, 0) + 1
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.headers.get("content-type", "").startswith("application/json"):
        response.json()


def send(server, method: str, pattern: str, ident: str, content: bytes) -> None:
    with httpx.Client(timeout=TIMEOUT) as client:
        response = client.request(method, url_of(server, pattern, ident), content=content,
                                  headers={"content-type": "application/json"})
    check(response)


# NINFER_FUZZ_EXAMPLES=1500 for a longer hunt (about two minutes)
FUZZ = settings(max_examples=int(os.environ.get("NINFER_FUZZ_EXAMPLES", "60")), deadline=None,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(route=st.sampled_from(ROUTES), body=bodies, ident=path_ids)
def test_random_json_never_fails_the_server(server, route, body, ident):
    body = _bounded(body)
    send(server, route[0], route[1], ident, json.dumps(body).encode())


@FUZZ
@given(route=st.sampled_from(ROUTES), junk=st.binary(max_size=200), ident=path_ids)
def test_junk_bytes_never_fail_the_server(server, route, junk, ident):
    send(server, route[0], route[1], ident, junk)


def _bounded(body):
    """Generation limits stay small so that a valid request finishes fast."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 32:
                body[key] = 32
    return body


def test_the_server_is_still_healthy_and_idle_after_the_fuzz(server):
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    assert server.runtime.gate.outstanding == 0
