"""The serving.md details that are easy to miss, checked over HTTP where the existing tests check them only at the
handler level or not at all: the advertised model without --model-id, error status/code pairs in both error shapes,
capacity that covers preparation (and the pending deadline that starts before it), a full set of eight active
requests, Responses limits and tool (non-)inheritance, the request-log lifecycle, and every option default against
the table."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import trio

from ninfer.cli.serve import parse_serve_args
from ninfer.engine.request import PreparedPrompt, RequestOptions
from ninfer.frontend.prompt import PromptOptions
from ninfer.server.context import JsonResponse, Route
from tests.support import server_harness
from tests.support.server_harness import ServerThread, SlowPolicy, build_tiny_artifact
from tests.support.waiting import wait_until

MODEL = "llama-custom"  # the tiny artifact's model_id
SPEC = Path("/work/shared/spec/serving.md")
SLOW = {"text": "hello", "max_tokens": 25, "round_delay_ms": 40}  # about a second in the engine
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
MESSAGE = {"model": "any-label", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
IMAGE_URL = "data:image/png;base64,iVBORw0KGgo="


async def _slow_preparation(ctx, request):
    """POST {"prepare_ms", "max_tokens"}: preparation that takes a while (on the trio thread, as media
    acquisition would), then a short generation."""
    body = request.json()
    ctx.begin_preparation(api="test", shape={})
    await trio.sleep(body.get("prepare_ms", 0) / 1000)
    built = ctx.prompt_builder.build([{"role": "user", "content": "hi"}], PromptOptions(thinking=False))
    events = ctx.generate(PreparedPrompt(token_ids=built.ids), RequestOptions(max_tokens=body.get("max_tokens", 2)),
                          SlowPolicy(0), api="test")
    async for event in events:
        finish = event.finish
    return JsonResponse({"finish": finish.value})


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return build_tiny_artifact(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def start(artifact, monkeypatch):
    """A server with the harness routes plus /test/slow_prepare; stopped after the test."""
    routes = server_harness.harness_routes
    monkeypatch.setattr(server_harness, "harness_routes",
                        lambda: routes() + [Route("POST", "/test/slow_prepare", _slow_preparation)])
    with server_harness.server_starter(artifact, "--max-context", "512") as started:
        yield started


@pytest.fixture(scope="module")
def server(artifact):
    running = ServerThread.start(artifact, "--max-context", "512", "--default-max-tokens", "16")
    yield running
    running.stop()


def post(server, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


def openai_error(response: httpx.Response) -> tuple[int, str, str | None]:
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    return response.status_code, error["code"], error["param"]


def anthropic_error(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) >= {"type", "message"} and body["error"]["message"]
    return response.status_code, body["error"]["type"]


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- the model id ----

def test_without_model_id_the_artifact_model_id_is_advertised_and_accepted(server):
    assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == [MODEL]
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").status_code == 200
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200
    assert post(server, "/v1/responses", {"model": MODEL, "input": "hi"}).status_code == 200
    for path, body in [("/v1/chat/completions", {**CHAT, "model": "qwen3.6-27b"}),
                       ("/v1/responses", {"model": "qwen3.6-27b", "input": "hi"}),
                       ("/v1/responses/input_tokens", {"model": "org/llama-custom", "input": "hi"})]:
        assert openai_error(post(server, path, body)) == (404, "model_not_found", "model")
    message = post(server, "/v1/messages", {**MESSAGE, "model": "claude-whatever"})
    assert message.status_code == 200 and message.json()["model"] == "claude-whatever"
    assert post(server, "/v1/messages/count_tokens", {"model": "x", "messages": MESSAGE["messages"]}).status_code == 200


# ---- error status/code pairs in both shapes ----

def test_validation_errors_in_the_openai_shape(server):
    assert openai_error(post(server, "/v1/chat/completions", {**CHAT, "reasoning_effort": "high"})) == (
        400, "reasoning_effort_not_supported", "reasoning_effort")
    assert openai_error(post(server, "/v1/chat/completions", {**CHAT, "reasoning_effort": "none",
                                                              "enable_thinking": True}))[:2] == (
        400, "conflicting_template_option")
    assert openai_error(post(server, "/v1/responses", {"model": MODEL, "input": "q", "frob": 1})) == (
        400, "unknown_parameter", "frob")
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE_URL}]}]
    assert openai_error(post(server, "/v1/responses/input_tokens", {"model": MODEL, "input": image}))[:2] == (
        400, "vision_disabled")
    chat_image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}}]}]
    assert openai_error(post(server, "/v1/chat/completions", {**CHAT, "messages": chat_image}))[:2] == (
        400, "vision_disabled")
    assert openai_error(post(server, "/v1/responses", {"model": MODEL, "input": "word " * 600}))[:2] == (
        400, "context_length_exceeded")
    assert openai_error(httpx.get(f"{server.url}/v1/responses/resp_missing"))[:2] == (404, "response_not_found")
    assert openai_error(httpx.delete(f"{server.url}/v1/responses/resp_missing"))[:2] == (404, "response_not_found")
    assert openai_error(post(server, "/v1/responses/compact", {"model": MODEL, "input": "x"}))[:2] == (
        400, "compaction_not_supported")


def test_validation_errors_in_the_anthropic_shape(server):
    assert anthropic_error(post(server, "/v1/messages", {**MESSAGE, "frob": 1})) == (400, "invalid_request_error")
    assert anthropic_error(post(server, "/v1/messages", {**MESSAGE, "output_config": {"effort": "high"}})) == (
        400, "invalid_request_error")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    history = [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
    for path, body in [("/v1/messages", {**MESSAGE, "messages": history}),
                       ("/v1/messages/count_tokens", {"model": "m", "messages": history})]:
        refused = post(server, path, body)
        assert anthropic_error(refused) == (400, "invalid_request_error")
        assert "vision" in refused.json()["error"]["message"].lower()
    too_long = post(server, "/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": "word " * 600}]})
    assert anthropic_error(too_long) == (400, "invalid_request_error")


def test_a_large_prompt_under_the_body_limit_is_never_413(server):
    """413 is only for the raw body: a prompt that is too long for the context is 400 in every flavor."""
    big = "word " * 20000
    assert post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": big}]},
                ).status_code == 400
    assert post(server, "/v1/messages/count_tokens", {"model": "m", "messages": [
        {"role": "user", "content": big}]}).status_code == 200


# ---- Responses details ----

def test_tools_are_not_inherited_through_previous_response_id(server):
    first = post(server, "/v1/responses", {"model": MODEL, "input": "weather?", "tools": [WEATHER]}).json()
    assert first["tools"] == [WEATHER] or first["tools"][0]["name"] == "get_weather"
    without = post(server, "/v1/responses", {"model": MODEL, "input": "more", "previous_response_id": first["id"]})
    again = post(server, "/v1/responses", {"model": MODEL, "input": "more", "previous_response_id": first["id"],
                                           "tools": [WEATHER]})
    assert without.status_code == again.status_code == 200
    assert without.json()["tools"] == [] and again.json()["tools"] != []



def test_max_output_tokens_is_at_least_16(server):
    assert openai_error(post(server, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 15})) == (
        400, "invalid_value", "max_output_tokens")
    assert post(server, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 16}).json()[
        "usage"]["output_tokens"] <= 16


@pytest.mark.parametrize("metadata, ok", [
    ({f"{i:064d}": "v" * 512 for i in range(16)}, True),
    ({f"k{i}": "v" for i in range(17)}, False),
    ({"k" * 65: "v"}, False),
    ({"k": "v" * 513}, False),
    ({"k": 1}, False),
])
def test_metadata_limits(server, metadata, ok):
    response = post(server, "/v1/responses", {"model": MODEL, "input": "x", "metadata": metadata, "store": False})
    if ok:
        assert response.status_code == 200 and response.json()["metadata"] == metadata
    else:
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("metadata")


def test_input_tokens_accepts_exactly_model_and_input(server):
    counted = post(server, "/v1/responses/input_tokens", {"model": MODEL, "input": "hi"})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    for extra in ({"tools": [WEATHER]}, {"previous_response_id": "resp_x"}, {"max_output_tokens": 16},
                  {"stream": False}, {"instructions": "x"}):
        name = next(iter(extra))
        assert openai_error(post(server, "/v1/responses/input_tokens", {"model": MODEL, "input": "hi", **extra})) == (
            400, "unknown_parameter", name)
    assert post(server, "/v1/responses/input_tokens", {"model": MODEL}).status_code == 400
    assert post(server, "/v1/responses/input_tokens", {"input": "hi"}).status_code == 400


def test_delete_leaves_descendants_usable(server):
    first = post(server, "/v1/responses", {"model": MODEL, "input": "one"}).json()
    second = post(server, "/v1/responses", {"model": MODEL, "input": "two", "previous_response_id": first["id"]})
    assert httpx.delete(f"{server.url}/v1/responses/{first['id']}").json()["deleted"] is True
    third = post(server, "/v1/responses", {"model": MODEL, "input": "three",
                                           "previous_response_id": second.json()["id"]})
    assert third.status_code == 200
    assert third.json()["usage"]["input_tokens"] > second.json()["usage"]["input_tokens"]
    assert openai_error(post(server, "/v1/responses", {"model": MODEL, "input": "x",
                                                       "previous_response_id": first["id"]}))[:2] == (
        404, "response_not_found")


# ---- capacity ----

def test_capacity_covers_preparation_in_both_shapes(start):
    server = start("--max-concurrency", "1", "--max-pending-requests", "1")
    with ThreadPoolExecutor(2) as pool:
        preparing = [pool.submit(post, server, "/test/slow_prepare", {"prepare_ms": 1500}) for _ in range(2)]
        wait_until(lambda: server.runtime.gate.outstanding == 2)
        assert server.engine.snapshot().running == 0  # neither has reached the engine
        assert openai_error(post(server, "/v1/chat/completions", CHAT))[:2] == (429, "server_overloaded")
        assert anthropic_error(post(server, "/v1/messages", MESSAGE)) == (429, "rate_limit_error")
        # token counting is not a generation request: it needs no capacity
        assert post(server, "/v1/messages/count_tokens", {"model": "m", "messages": MESSAGE["messages"]}
                    ).status_code == 200
        assert [f.result().status_code for f in preparing] == [200, 200]
    wait_until(lambda: server.runtime.gate.outstanding == 0)


def test_the_pending_deadline_starts_before_preparation(start):
    server = start("--pending-timeout-ms", "300")
    late = post(server, "/test/slow_prepare", {"prepare_ms": 500})  # the engine is idle: only preparation was slow
    assert openai_error(late)[:2] == (503, "request_queue_timeout")
    assert post(server, "/test/slow_prepare", {"prepare_ms": 0}).status_code == 200
    wait_until(lambda: server.runtime.gate.outstanding == 0)


def test_a_slow_queue_is_503_in_the_anthropic_shape(start):
    server = start("--max-concurrency", "1", "--pending-timeout-ms", "300", "--seed", "1")
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(post, server, "/test/generate", SLOW)
        wait_until(lambda: server.engine.snapshot().running == 1)
        assert anthropic_error(post(server, "/v1/messages", MESSAGE)) == (503, "overloaded_error")
        assert busy.result().status_code == 200


def test_eight_active_plus_pending_then_overflow_is_429(start):
    server = start("--max-concurrency", "8", "--max-pending-requests", "2")
    with ThreadPoolExecutor(10) as pool:
        # each request's policy sleeps on the engine thread: 8 rows x 10 ms a round, 20 rounds
        busy = {"text": "hello", "max_tokens": 20, "round_delay_ms": 10}
        running = [pool.submit(post, server, "/test/generate", busy) for _ in range(10)]
        wait_until(lambda: server.runtime.gate.outstanding == 10)
        wait_until(lambda: server.engine.snapshot().running == 8)
        assert openai_error(post(server, "/test/generate", SLOW))[:2] == (429, "server_overloaded")
        assert [f.result().json()["finish"] for f in running] == ["output_limit"] * 10
    wait_until(lambda: server.runtime.gate.outstanding == 0)
    # the snapshot is taken at round boundaries: the round that finished the last request ends after its response
    wait_until(lambda: server.engine.snapshot().running == 0)


# ---- the request log ----

def test_request_log_lifecycle(start, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    server = start(request_log=log_path)
    # validation rejections and token counts: no id, no record
    assert post(server, "/v1/chat/completions", {**CHAT, "frob": 1}).status_code == 400
    assert post(server, "/v1/chat/completions", {**CHAT, "model": "other"}).status_code == 404
    assert post(server, "/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}).status_code == 400
    assert post(server, "/v1/responses/input_tokens", {"model": MODEL, "input": "hi"}).status_code == 200
    assert post(server, "/v1/messages/count_tokens", {"model": "m", "messages": MESSAGE["messages"]}
                ).status_code == 200
    assert [r["event"] for r in read_log(log_path) if r["event"].startswith("request_")] == []
    # a preparation failure: an id, request_rejected (phase prepare), no start
    assert post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 600}]}
                ).status_code == 400
    [rejected] = [r for r in read_log(log_path) if r["event"].startswith("request_")]
    assert rejected["event"] == "request_rejected" and rejected["request_id"] == 1
    assert (rejected["phase"], rejected["status"], rejected["code"]) == ("prepare", 400, "context_length_exceeded")
    assert rejected["protocol"] == "chat"
    # successful generations: start then done, ids counting on
    for path, body in [("/v1/chat/completions", CHAT), ("/v1/chat/completions", CHAT),
                       ("/v1/messages", MESSAGE), ("/v1/responses", {"model": MODEL, "input": "hello",
                                                                     "max_output_tokens": 16})]:
        assert post(server, path, body).status_code == 200
    records = [r for r in read_log(log_path) if r["event"].startswith("request_")]
    starts = [r for r in records if r["event"] == "request_start"]
    done = [r for r in records if r["event"] == "request_done"]
    assert [r["request_id"] for r in starts] == [r["request_id"] for r in done] == [2, 3, 4, 5]
    assert [r["protocol"] for r in starts] == ["chat", "chat", "messages", "responses"]
    assert all(r["request_id"] != 1 for r in starts)
    for record in done:
        assert record["prefix_reuse_path"] is not None
        assert record["computed_prefill_tokens"] + record["cached_tokens"] == record["prompt_tokens"]
    assert done[1]["cached_tokens"] > 0  # the repeated chat prompt reused the first one's prefix
    assert done[1]["computed_prefill_tokens"] < done[1]["prompt_tokens"]


# ---- options ----

# Each option of serving.md's "Server options" table: its Default column, and the parsed default it means.
TABLE_DEFAULTS = {
    "--host": ("127.0.0.1", "host", "127.0.0.1"), "--port": ("8080", "port", 8080),
    "--api-key": ("unset", "api_key", None), "--model-id": ("artifact identity.model_id", "model_id", None),
    "--max-context": ("8192", "max_context", 8192), "--kv-capacity": ("8192", "kv_capacity", None),
    "--max-concurrency": ("1", "max_concurrency", 1), "--max-pending-requests": ("16", "max_pending_requests", 16),
    "--pending-timeout-ms": ("30000", "pending_timeout_ms", 30000), "--prefill-chunk": ("1024", "prefill_chunk", 1024),
    "--log-stats-interval-ms": ("5000", "log_stats_interval_ms", 5000), "--device": ("0", "device", 0),
    "--max-request-mib": ("384", "max_request_mib", 384), "--media-cache-mib": ("1024", "media_cache_mib", 1024),
    "--media-live-mib": ("2048", "media_live_mib", 2048),
    "--media-preprocess-threads": ("0", "media_preprocess_threads", 0),
    "--request-log-jsonl": ("disabled", "request_log_jsonl", None),
    "--response-store-max-records": ("1024", "response_store_max_records", 1024),
    "--response-store-max-mib": ("256", "response_store_max_mib", 256), "--kv-dtype": ("bf16", "kv_dtype", "bf16"),
    "--spec": ("off", "spec", None), "--draft-tokens": ("unset", "draft_tokens", None),
    "--lm-head-draft": ("off", "lm_head_draft", False),
    "--default-max-tokens": ("8192", "default_max_tokens", 8192), "--vision": ("off", "vision", False),
    "--no-cuda-graph": ("on", "no_cuda_graph", False), "--no-prefix-reuse": ("prefix reuse on", "no_prefix_reuse",
                                                                             False),
    "--cold-tier-device": ("-1", "cold_tier_device", -1),
    "--cold-tier-capacity-mib": ("0", "cold_tier_capacity_mib", 0),
    "--cold-tier-staging-mib": ("64", "cold_tier_staging_mib", 64),
    "--no-cold-tier": ("cold tier on", "no_cold_tier", False), "--no-thinking": ("thinking on", "no_thinking", False),
    "--preserve-thinking": ("off", "preserve_thinking", False), "--cors": ("off", "cors", False),
    "--temperature": ("unset", "temperature", None), "--top-p": ("unset", "top_p", None),
    "--top-k": ("unset", "top_k", None), "--min-p": ("unset", "min_p", None),
    "--presence-penalty": ("unset", "presence_penalty", None),
    "--frequency-penalty": ("unset", "frequency_penalty", None),
    "--seed": ("fresh random seed per request", "seed", None), "--greedy": ("off", "greedy", False),
}


def test_every_option_default_follows_the_table():
    options = parse_serve_args([])
    for option, (_, attribute, value) in TABLE_DEFAULTS.items():
        assert getattr(options, attribute) == value, option
    if not SPEC.exists():
        pytest.skip("serving.md is not in this checkout")
    text = SPEC.read_text()
    table = text[text.index("Option Meaning Default"):].split("\n\n", 1)[0].splitlines()[1:]
    rows = {re.match(r"(--[a-z0-9-]+)", line).group(1): line for line in table}
    assert set(rows) == set(TABLE_DEFAULTS)
    for option, (documented, _, _) in TABLE_DEFAULTS.items():
        assert rows[option].endswith(f" {documented}"), rows[option]


def test_without_seed_each_request_gets_a_fresh_seed(start, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    server = start(request_log=log_path)
    for _ in range(3):
        assert post(server, "/v1/chat/completions", {**CHAT, "temperature": 1.0}).status_code == 200
    seeds = [r["seed"] for r in read_log(log_path) if r["event"] == "request_start"]
    assert len(seeds) == 3 and None not in seeds and len(set(seeds)) == 3
