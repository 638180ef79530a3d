"""The HTTP transport on the real app over hypercorn: health and models, API-key auth in both error flavors, CORS,
the body limit before JSON parsing, routing errors; and the small pieces (routing table, SSE framing, error
bodies) on their own."""

from __future__ import annotations

import socket

import httpx
import pytest

from ninfer.server.context import ApiError, Route, SseEvent
from ninfer.server.errors import error_body
from ninfer.server.routing import Router
from ninfer.server.sse import frame
from tests.support.server_harness import ServerThread, build_tiny_artifact

KEY = "local-secret"
BEARER = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    artifact = build_tiny_artifact(tmp_path_factory.mktemp("tiny"))
    running = ServerThread.start(artifact, "--max-context", "512", "--api-key", KEY, "--cors",
                                 "--max-request-mib", "1", "--model-id", "org/alias")
    yield running
    running.stop()


def test_health_is_open_and_carries_cors(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert response.headers["access-control-allow-origin"] == "*"


def test_models_list_and_lookup(server):
    listed = httpx.get(f"{server.url}/v1/models", headers=BEARER).json()
    assert listed["object"] == "list"
    [model] = listed["data"]
    assert model["id"] == "org/alias" and model["object"] == "model" and model["owned_by"] == "ninfer"
    assert isinstance(model["created"], int)
    assert httpx.get(f"{server.url}/v1/models/org/alias", headers=BEARER).json() == model
    missing = httpx.get(f"{server.url}/v1/models/llama-custom", headers=BEARER)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and missing.json()["error"]["param"] == "model"


@pytest.mark.parametrize("headers", [BEARER, {"x-api-key": KEY}, {"authorization": f"bearer {KEY}"}])
def test_either_key_header_is_accepted(server, headers):
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"x-api-key": "local-secreT"},
                                     {"authorization": KEY}])
def test_a_missing_or_wrong_key_is_401_in_the_openai_flavor(server, headers):
    response = httpx.get(f"{server.url}/v1/models", headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["message"]


def test_a_wrong_key_is_401_in_the_anthropic_flavor(server):
    response = httpx.post(f"{server.url}/test/anthropic", headers={"x-api-key": "nope"}, content=b"{}")
    assert response.status_code == 401
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert httpx.post(f"{server.url}/test/anthropic", headers={"x-api-key": KEY}, content=b"{}").status_code == 200


def test_preflight_is_open_and_permissive(server):
    response = httpx.options(f"{server.url}/v1/chat/completions",
                             headers={"origin": "http://example.com", "access-control-request-method": "POST"})
    assert response.status_code == 204
    assert response.headers["access-control-allow-origin"] == "*"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()


def test_unknown_path_is_404_and_wrong_method_405(server):
    assert httpx.get(f"{server.url}/v1/nothing", headers=BEARER).json()["error"]["code"] == "not_found"
    wrong = httpx.post(f"{server.url}/v1/models", headers=BEARER)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_a_declared_oversize_body_is_rejected_before_it_is_read(server):
    """Content-Length says 100 MiB; the 413 arrives after a few bytes of it, without the rest being sent."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"POST /test/anthropic HTTP/1.1\r\nhost: x\r\nx-api-key: {KEY}\r\n"
                     f"content-type: application/json\r\ncontent-length: {100 << 20}\r\n\r\n{{\"a\":".encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413")
    assert b'"type":"request_too_large"' in reply  # the anthropic route's flavor


def test_a_streamed_oversize_body_is_cut_off_at_the_limit(server):
    sent = []

    def body():
        for _ in range(64):  # 4 MiB in 64 KiB chunks, no Content-Length
            sent.append(1)
            yield b" " * 65536

    try:
        response = httpx.post(f"{server.url}/test/generate", headers=BEARER, content=body())
    except httpx.HTTPError:  # the server may close before the client has finished writing
        return
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_a_body_within_the_limit_reaches_the_handler(server):
    response = httpx.post(f"{server.url}/test/anthropic", headers={"x-api-key": KEY}, content=b"x" * 1000)
    assert response.json() == {"type": "message", "bytes": 1000}


def test_a_body_that_is_not_json_is_400(server):
    response = httpx.post(f"{server.url}/test/generate", headers=BEARER, content=b"{nope")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


# ---- the pieces ----


async def _noop(ctx, request):
    return None


def test_router_matches_segments_paths_and_methods():
    router = Router([Route("GET", "/v1/responses/{id}", _noop), Route("DELETE", "/v1/responses/{id}", _noop),
                     Route("GET", "/v1/responses/{id}/input_items", _noop),
                     Route("GET", "/v1/models/{id:path}", _noop),
                     Route("POST", "/v1/messages", _noop, flavor="anthropic")])
    route, params = router.match("GET", "/v1/responses/resp_1/input_items")
    assert route.pattern == "/v1/responses/{id}/input_items" and params == {"id": "resp_1"}
    assert router.match("DELETE", "/v1/responses/resp_1")[0].method == "DELETE"
    assert router.match("GET", "/v1/models/org/name")[1] == {"id": "org/name"}
    with pytest.raises(ApiError) as not_allowed:
        router.match("POST", "/v1/responses/resp_1")
    assert not_allowed.value.status == 405
    with pytest.raises(ApiError) as unknown:
        router.match("GET", "/v1/responses/a/b/c")
    assert unknown.value.status == 404
    assert router.flavor_of("/v1/messages") == "anthropic" and router.flavor_of("/elsewhere") == "openai"
    with pytest.raises(ValueError, match="two routes"):
        Router([Route("GET", "/a", _noop), Route("GET", "/a", _noop)])


def test_sse_frames_name_the_event_and_split_data_lines():
    assert frame(SseEvent('{"a":1}')) == b'data: {"a":1}\n\n'
    assert frame(SseEvent("x\ny\r\nz", "message_delta")) == b"event: message_delta\ndata: x\ndata: y\ndata: z\n\n"


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "request_too_large"),
                                          (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")])
def test_anthropic_error_types_follow_the_status(status, kind):
    error = ApiError(status, "some_code", "message", extra={"prompt_tokens": 3})
    assert error_body(error, "anthropic") == {"type": "error",
                                              "error": {"type": kind, "message": "message", "prompt_tokens": 3}}
    assert error_body(error, "openai") == {"error": {"message": "message", "type": "invalid_request_error",
                                                     "param": None, "code": "some_code", "prompt_tokens": 3}}
