"""The Responses handlers over a real Engine (the scripted runner of test_generation_adapter decides what the
"model" writes; the tiny random Qwen3.6 runs the sampled path): response objects and usage, exact stream event
sequences whose deltas add up to the response, function calls, the local state (previous_response_id, store:false,
deletion, input_items, capacity), preserve_thinking inheritance, and the field-specific refusals."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio

from ninfer.engine.engine import Engine
from ninfer.frontend.prompt import PromptBuilder
from ninfer.server.context import ApiError, HttpRequest, JsonResponse, StreamResponse
from ninfer.server.openai_responses import ResponsesApi
from ninfer.server.response_store import ResponseStore
from ninfer.server.routing import Router
from ninfer.targets.registry import QWEN_27B_PRESETS
from ninfer.backends.cpu.runner import build_cpu_runner
from tests.test_generation_adapter import (CALL, IM_END, MAX_CONTEXT, QWEN_VOCAB, EngineContext, FakeOptions,
                                           ScriptedRunner, engine_config, qwen_builder, script_of)
from tests.test_runner_cpu import tiny_qwen

MODEL = "qwen3.6-27b"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}


@attrs.frozen
class ResponsesOptions(FakeOptions):
    response_store_max_records: int = 1024
    response_store_max_mib: int = 256


@pytest.fixture(scope="module")
def builder(qwen_tokenizer_json) -> PromptBuilder:
    return qwen_builder(qwen_tokenizer_json)


@attrs.define
class Server:
    """The Responses routes over a fake ServerContext whose engine writes `runner.script` for every request."""

    ctx: EngineContext
    runner: ScriptedRunner
    api: ResponsesApi = attrs.Factory(ResponsesApi)

    def say(self, text: str, *, stop: bool = True) -> None:
        self.runner.script = script_of(self.ctx.prompt_builder.tokenizer, text, stop=stop)

    def call(self, method: str, path: str, body: dict | None = None, query: dict[str, str] | None = None) -> Any:
        """One request through the routing table: a JsonResponse, a StreamResponse's events (as dicts), or the
        ApiError it raised."""
        route, params = Router(self.api.routes()).match(method, path)
        request = HttpRequest(method=method, path=path, path_params=params, headers={},
                              query={k: [v] for k, v in (query or {}).items()},
                              body=json.dumps(body).encode() if body is not None else b"")

        async def main():
            try:
                response = await route.handler(self.ctx, request)
            except ApiError as error:
                return error
            if isinstance(response, StreamResponse):
                return [(event.event, json.loads(event.data)) async for event in response.events]
            return response

        return trio.run(main)

    def create(self, **body: Any) -> Any:
        return self.call("POST", "/v1/responses", {"model": MODEL, **body})

    def rendered(self, turn: int = -1) -> str:
        """The prompt text of a submitted request."""
        prompt = self.ctx.submitted[turn][0]
        return self.ctx.prompt_builder.tokenizer.decode(list(prompt.token_ids), skip_special=False)


@pytest.fixture
def server(builder):
    runner = ScriptedRunner([IM_END])
    with Engine(runner, engine_config(), QWEN_27B_PRESETS) as engine:
        yield Server(EngineContext(engine, builder, options=ResponsesOptions()), runner)


def body_of(response: Any) -> dict:
    assert isinstance(response, JsonResponse), response
    return response.body


def error_of(response: Any) -> tuple[int, str, str | None]:
    assert isinstance(response, ApiError), response
    return response.status, response.code, response.param


# ---- the response object ----

def test_a_string_input_gets_reasoning_and_a_message_with_checkpoint_native_usage(server):
    server.say("Two numbers.\n</think>\n\nThe sum is 4.")
    response = body_of(server.create(input="What is 2+2?", instructions="Be brief.", metadata={"k": "v"}))
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["id"].startswith("resp_") and response["model"] == MODEL
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two numbers."}]
    assert message == {"type": "message", "id": message["id"], "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": "The sum is 4.", "annotations": [],
                                    "logprobs": []}]}
    assert message["id"].startswith("msg_") and "output_text" not in response
    usage = response["usage"]
    prompt_tokens = len(server.ctx.submitted[0][0])
    assert usage["input_tokens"] == prompt_tokens and usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens"] == len(server.runner.script)
    assert usage["output_tokens_details"]["reasoning_tokens"] == len(script_of(
        server.ctx.prompt_builder.tokenizer, "Two numbers.\n</think>", stop=False))
    assert usage["total_tokens"] == prompt_tokens + usage["output_tokens"]
    assert response["instructions"] == "Be brief." and response["metadata"] == {"k": "v"}
    assert response["error"] is None and response["incomplete_details"] is None
    assert response["previous_response_id"] is None and response["store"] is True
    assert response["tool_choice"] == "auto" and response["tools"] == [] and response["parallel_tool_calls"]
    assert response["service_tier"] == "default" and response["truncation"] == "disabled"
    assert server.rendered().startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?")
    assert server.ctx.preparations == [("responses", {"stream": False, "input_items": 1, "tools": 0,
                                                      "media_items": 0, "continued": False,
                                                      "semantic_change": False})]


def test_the_output_limit_is_incomplete_with_the_open_item_incomplete(server):
    server.say("thinking on and on and on", stop=False)
    response = body_of(server.create(input="q", max_output_tokens=16))
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    [reasoning] = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 16 == response["max_output_tokens"]


def test_an_empty_answer_is_still_one_assistant_message(server):
    response = body_of(server.create(input="q", reasoning={"effort": "none"}))
    [message] = response["output"]
    assert message["content"] == [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
    assert server.rendered().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- streaming ----

def stream_types(events: list[tuple[str, dict]]) -> list[str]:
    for name, data in events:
        assert name == data["type"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return [name for name, _ in events]


def check_deltas_build_the_response(events: list[tuple[str, dict]]) -> dict:
    """Replay the stream the way a client does and compare with the terminal response; returns that response."""
    terminal = events[-1][1]["response"]
    items: dict[int, dict] = {}
    texts: dict[int, str] = {}
    for name, data in events:
        if name == "response.output_item.added":
            assert data["output_index"] == len(items) and data["item"]["status"] == "in_progress"
            items[data["output_index"]], texts[data["output_index"]] = data["item"], ""
        elif name.endswith(".delta"):
            assert data["item_id"] == items[data["output_index"]]["id"]
            texts[data["output_index"]] += data["delta"]
        elif name in ("response.output_text.done", "response.reasoning_text.done"):
            assert data["text"] == texts[data["output_index"]] and data["content_index"] == 0
        elif name == "response.function_call_arguments.done":
            assert data["arguments"] == texts[data["output_index"]]
        elif name == "response.output_item.done":
            done = data["item"]
            assert done["id"] == items[data["output_index"]]["id"] == terminal["output"][data["output_index"]]["id"]
            assert done == terminal["output"][data["output_index"]]
            streamed = done["arguments"] if done["type"] == "function_call" else done["content"][0]["text"]
            assert streamed == texts[data["output_index"]]
    assert len(items) == len(terminal["output"])
    return terminal


def test_a_stream_has_the_exact_event_sequence_and_its_deltas_make_the_response(server):
    server.say("Think.\n</think>\n\nHello there, friend.")
    events = server.create(input="hi", stream=True)
    types = stream_types(events)
    reasoning_deltas = types.count("response.reasoning_text.delta")
    text_deltas = types.count("response.output_text.delta")
    assert reasoning_deltas >= 1 and text_deltas >= 2
    assert types == (["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added"]
                     + ["response.reasoning_text.delta"] * reasoning_deltas
                     + ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                        "response.output_item.added", "response.content_part.added"]
                     + ["response.output_text.delta"] * text_deltas
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    terminal = check_deltas_build_the_response(events)
    assert terminal["id"] == created["id"] and terminal["status"] == "completed"
    assert [part["text"] for item in terminal["output"] for part in item["content"]] == ["Think.",
                                                                                         "Hello there, friend."]
    assert body_of(server.call("GET", f"/v1/responses/{terminal['id']}")) == terminal


def test_streamed_function_calls_are_items_with_fc_ids_and_distinct_call_ids(server):
    server.say(f"Need weather.\n</think>\n\nChecking.\n\n{CALL}\n{CALL}")
    events = server.create(input="weather in Paris?", tools=[WEATHER], stream=True)
    types = stream_types(events)
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert types[-9:] == call_events * 2 + ["response.completed"]
    terminal = check_deltas_build_the_response(events)
    reasoning, message, *calls = terminal["output"]
    assert message["content"][0]["text"] == "Checking."
    assert [c["type"] for c in calls] == ["function_call"] * 2
    for call in calls:
        assert call["id"].startswith("fc_") and call["call_id"].startswith("call_") and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris", "days": 2} and call["status"] == "completed"
    assert len({c["id"] for c in calls} | {c["call_id"] for c in calls}) == 4
    assert [d["name"] for n, d in events if n == "response.function_call_arguments.done"] == ["get_weather"] * 2
    assert terminal["tools"] == [{**WEATHER}]


def test_the_output_limit_ends_a_stream_with_response_incomplete(server):
    server.say("Thinking without end", stop=False)
    events = server.create(input="q", stream=True, max_output_tokens=16)
    types = stream_types(events)
    assert types[-1] == "response.incomplete" and "response.completed" not in types
    terminal = check_deltas_build_the_response(events)
    assert terminal["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_engine_failure_after_the_start_is_response_failed(builder):
    class FailingRunner(ScriptedRunner):
        def decode(self, batch):
            raise RuntimeError("device lost")

    runner = FailingRunner(script_of(builder.tokenizer, "partial reasoning"))
    with Engine(runner, engine_config(), QWEN_27B_PRESETS) as engine:
        server = Server(EngineContext(engine, builder, options=ResponsesOptions()), runner)
        events = server.create(input="q", stream=True)
        types = stream_types(events)
        assert types[-1] == "response.failed" and types.count("response.failed") == 1
        failed = events[-1][1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "internal_error"
        assert "device lost" in failed["error"]["message"]
        assert [item["status"] for item in failed["output"]] == ["incomplete"]
        assert error_of(server.create(input="q"))[:2] == (500, "internal_error")  # not streamed: an HTTP error
        assert error_of(server.call("GET", f"/v1/responses/{failed['id']}"))[1] == "response_not_found"


def test_the_tiny_qwen_model_streams_exactly_what_it_answers(builder):
    config = engine_config(kv_capacity=2 * MAX_CONTEXT, greedy=True)
    with Engine(build_cpu_runner(tiny_qwen(vocab=QWEN_VOCAB), config), config, QWEN_27B_PRESETS) as engine:
        server = Server(EngineContext(engine, builder, options=ResponsesOptions()), runner=None)
        events = server.create(input="hello", stream=True, max_output_tokens=24)
        answer = body_of(server.create(input="hello", max_output_tokens=24))
    streamed = check_deltas_build_the_response(events)
    assert [item["content"] for item in streamed["output"]] == [item["content"] for item in answer["output"]]
    assert streamed["usage"]["output_tokens"] == answer["usage"]["output_tokens"] == 24


# ---- conversation state ----

def test_previous_response_id_replays_the_history_without_its_instructions(server):
    server.say("r1\n</think>\n\nFirst answer.")
    first = body_of(server.create(input="first question", instructions="Old rules."))
    server.say("r2\n</think>\n\nSecond answer.")
    second = body_of(server.create(input="second question", previous_response_id=first["id"],
                                   instructions="New rules."))
    assert second["previous_response_id"] == first["id"] and second["instructions"] == "New rules."
    prompt = server.rendered()
    assert prompt.startswith("<|im_start|>system\nNew rules.<|im_end|>\n") and "Old rules." not in prompt
    assert ("<|im_start|>user\nfirst question<|im_end|>\n<|im_start|>assistant\nFirst answer.<|im_end|>\n"
            "<|im_start|>user\nsecond question<|im_end|>\n") in prompt
    third = body_of(server.create(input="third", previous_response_id=second["id"]))
    assert third["instructions"] is None and "rules." not in server.rendered()
    assert "First answer." in server.rendered() and "Second answer." in server.rendered()
    # Dropping the instructions changed the prompt's start; with the same (no) instructions the next turn reuses
    # the resident prefix of the earlier ones.
    assert third["usage"]["input_tokens_details"]["cached_tokens"] == 0
    fourth = body_of(server.create(input="fourth", previous_response_id=third["id"]))
    assert fourth["usage"]["input_tokens_details"]["cached_tokens"] > third["usage"]["input_tokens"] // 2


def test_a_tool_result_turn_continues_the_call(server):
    server.say(f"Need weather.\n</think>\n\n{CALL}")
    first = body_of(server.create(input="weather in Paris?", tools=[WEATHER]))
    call = first["output"][-1]
    server.say("ok\n</think>\n\nSunny in Paris.")
    second = body_of(server.create(previous_response_id=first["id"], tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "clear"}'}]))
    assert second["output"][-1]["content"][0]["text"] == "Sunny in Paris."
    prompt = server.rendered()
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert '<|im_start|>user\n<tool_response>\n{"sky": "clear"}\n</tool_response><|im_end|>\n' in prompt
    assert "Need weather." in prompt  # the reasoning of the open tool-calling turn is kept (after the last query)


def test_a_codex_style_second_turn_replays_the_output_items_as_input(server):
    """Stateless clients send the whole history back, output Items (with their ids and statuses) included."""
    server.say(f"Need weather.\n</think>\n\nLet me check.\n\n{CALL}")
    first = body_of(server.create(input=[{"type": "message", "role": "user",
                                          "content": [{"type": "input_text", "text": "weather in Paris?"}]}],
                                  tools=[WEATHER], store=False))
    call = first["output"][-1]
    history = [{"role": "user", "content": "weather in Paris?"}, *first["output"],
               {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    server.say("done\n</think>\n\nIt is sunny.")
    second = body_of(server.create(input=history, tools=[WEATHER], store=False))
    assert second["status"] == "completed" and second["output"][-1]["content"][0]["text"] == "It is sunny."
    # One assistant turn with its reasoning, text and call, as the model wrote it, then the tool result.
    expected = server.ctx.prompt_builder.render([
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need weather.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert server.rendered() == expected


def test_system_and_developer_items_keep_their_positions(server):
    server.say("x\n</think>\n\ny")
    body_of(server.create(instructions="Lead.", input=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "developer", "content": "New rule."}, {"role": "user", "content": "c"}]))
    assert server.rendered().startswith("<|im_start|>system\nLead.<|im_end|>\n<|im_start|>user\na<|im_end|>\n")
    assert ("<|im_start|>assistant\nb<|im_end|>\n<|im_start|>system\nNew rule.<|im_end|>\n"
            "<|im_start|>user\nc<|im_end|>\n") in server.rendered()


def test_store_false_responses_cannot_be_retrieved_or_continued(server):
    server.say("x\n</think>\n\ny")
    response = body_of(server.create(input="q", store=False))
    assert response["store"] is False
    assert error_of(server.call("GET", f"/v1/responses/{response['id']}")) == (404, "response_not_found", None)
    assert error_of(server.create(input="q", previous_response_id=response["id"])) == (
        404, "response_not_found", "previous_response_id")


def test_delete_ends_retrieval_but_not_the_descendants_context(server):
    server.say("x\n</think>\n\nalpha")
    first = body_of(server.create(input="one"))
    second = body_of(server.create(input="two", previous_response_id=first["id"]))
    assert body_of(server.call("DELETE", f"/v1/responses/{first['id']}")) == {
        "id": first["id"], "deleted": True, "object": "response.deleted"}
    assert error_of(server.call("GET", f"/v1/responses/{first['id']}"))[:2] == (404, "response_not_found")
    assert error_of(server.call("DELETE", f"/v1/responses/{first['id']}"))[:2] == (404, "response_not_found")
    assert error_of(server.create(input="q", previous_response_id=first["id"]))[1] == "response_not_found"
    body_of(server.create(input="three", previous_response_id=second["id"]))
    assert "<|im_start|>user\none<|im_end|>" in server.rendered()


def test_input_items_are_the_normalized_input_with_after_limit_and_order(server):
    server.say("x\n</think>\n\ny")
    items = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "a", "id": "msg_given"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "c"}]}]
    response = body_of(server.create(input=items))
    path = f"/v1/responses/{response['id']}/input_items"
    listing = body_of(server.call("GET", path))
    assert listing["object"] == "list" and listing["has_more"] is False
    data = listing["data"]
    assert [item["role"] for item in data] == ["user", "assistant", "user", "developer"]  # desc by default
    assert data[2] == {"type": "message", "id": "msg_given", "role": "user",
                       "content": [{"type": "input_text", "text": "a"}]}
    assert data[1]["content"] == [{"type": "output_text", "text": "b", "annotations": [], "logprobs": []}]
    assert all(item["id"].startswith("msg_") for item in data) and len({item["id"] for item in data}) == 4
    assert (listing["first_id"], listing["last_id"]) == (data[0]["id"], data[-1]["id"])
    ascending = [item["id"] for item in reversed(data)]
    page = body_of(server.call("GET", path, query={"order": "asc", "limit": "2", "after": ascending[0]}))
    assert [item["id"] for item in page["data"]] == ascending[1:3] and page["has_more"] is True
    last = body_of(server.call("GET", path, query={"order": "asc", "after": ascending[2]}))
    assert [item["id"] for item in last["data"]] == ascending[3:] and last["has_more"] is False
    assert error_of(server.call("GET", path, query={"limit": "0"}))[1:] == ("invalid_value", "limit")
    assert error_of(server.call("GET", path, query={"limit": "101"}))[1:] == ("invalid_value", "limit")
    assert error_of(server.call("GET", path, query={"limit": "many"}))[1:] == ("invalid_type", "limit")
    assert error_of(server.call("GET", path, query={"order": "up"}))[1:] == ("invalid_value", "order")
    assert error_of(server.call("GET", path, query={"after": "msg_nope"}))[1:] == ("invalid_value", "after")
    assert error_of(server.call("GET", path, query={"include": "x"}))[1:] == ("unknown_parameter", "include")
    assert error_of(server.call("GET", "/v1/responses/resp_nope/input_items"))[:2] == (404, "response_not_found")


def test_a_response_too_large_for_the_store_fails_with_capacity_exceeded(server):
    server.say("x\n</think>\n\n" + "word " * 200)
    server.api._store = ResponseStore(max_records=8, max_bytes=1500)
    assert body_of(server.create(input="fits", store=False))["status"] == "completed"
    assert error_of(server.create(input="q " * 1000))[:2] == (400, "response_store_capacity_exceeded")
    assert len(server.ctx.submitted) == 1  # refused before generating: the input alone is too large
    assert error_of(server.create(input="q"))[:2] == (400, "response_store_capacity_exceeded")
    events = server.create(input="q", stream=True)
    assert stream_types(events)[-1] == "response.failed"
    failed = events[-1][1]["response"]
    assert failed["error"]["code"] == "response_store_capacity_exceeded" and failed["output"][-1]["status"] == \
        "completed"
    assert len(server.api._store) == 0


def test_the_store_is_sized_by_the_serve_options(server):
    server.ctx.options = ResponsesOptions(response_store_max_records=1)
    server.say("x\n</think>\n\ny")
    first, second = (body_of(server.create(input=text)) for text in ("a", "b"))
    assert server.api.store(server.ctx).max_bytes == 256 << 20
    assert error_of(server.call("GET", f"/v1/responses/{first['id']}"))[1] == "response_not_found"  # evicted
    assert body_of(server.call("GET", f"/v1/responses/{second['id']}"))["id"] == second["id"]


# ---- preserve_thinking ----

def test_preserve_thinking_is_inherited_along_the_chain_until_changed(server):
    server.say("secret plan\n</think>\n\nanswer one")
    first = body_of(server.create(input="q1", preserve_thinking=True))
    assert server.ctx.submitted[-1][0].preserve_thinking is True
    second = body_of(server.create(input="q2", previous_response_id=first["id"]))
    assert server.ctx.submitted[-1][0].preserve_thinking is True
    assert "<think>\nsecret plan\n</think>\n\nanswer one" in server.rendered()  # closed-turn reasoning kept
    assert server.ctx.preparations[-1][1]["semantic_change"] is False
    third = body_of(server.create(input="q3", previous_response_id=second["id"],
                                  chat_template_kwargs={"preserve_thinking": False}))
    assert server.ctx.submitted[-1][0].preserve_thinking is False and "secret plan" not in server.rendered()
    assert server.ctx.preparations[-1][1]["semantic_change"] is True
    body_of(server.create(input="q4", previous_response_id=third["id"]))
    assert server.ctx.submitted[-1][0].preserve_thinking is False  # the branch's value, not the root's
    body_of(server.create(input="q1"))
    assert server.ctx.submitted[-1][0].preserve_thinking is False  # a new chain: the server default


def test_the_server_default_preserve_thinking_is_stored_with_the_response(server):
    server.ctx.options = ResponsesOptions(preserve_thinking=True)
    server.say("plan\n</think>\n\nok")
    first = body_of(server.create(input="q1"))
    server.ctx.options = ResponsesOptions()
    body_of(server.create(input="q2", previous_response_id=first["id"]))
    assert server.ctx.submitted[-1][0].preserve_thinking is True


# ---- input_tokens, cancel, compact ----

def test_input_tokens_counts_the_rendered_prompt_without_generating(server):
    counted = body_of(server.call("POST", "/v1/responses/input_tokens", {"model": MODEL, "input": "Count this."}))
    builder = server.ctx.prompt_builder
    assert counted == {"object": "response.input_tokens",
                       "input_tokens": len(builder.build([{"role": "user", "content": "Count this."}]).ids)}
    assert server.ctx.submitted == [] and server.ctx.preparations == []
    assert error_of(server.call("POST", "/v1/responses/input_tokens",
                                {"model": MODEL, "input": "x", "instructions": "y"}))[1:] == (
        "unknown_parameter", "instructions")
    assert error_of(server.call("POST", "/v1/responses/input_tokens", {"model": "other", "input": "x"}))[:2] == (
        404, "model_not_found")


def test_cancel_and_compact_fail_explicitly(server):
    assert error_of(server.call("POST", "/v1/responses/resp_x/cancel"))[:2] == (400, "background_not_supported")
    assert error_of(server.call("POST", "/v1/responses/compact", {"model": MODEL}))[:2] == (
        400, "compaction_not_supported")


# ---- refusals ----

@pytest.mark.parametrize("field, value, code, param", [
    ("frobnicate", 1, "unknown_parameter", "frobnicate"),
    ("seed", 1, "unknown_parameter", "seed"),
    ("background", True, "background_not_supported", "background"),
    ("conversation", "conv_1", "conversations_not_supported", "conversation"),
    ("prompt", {"id": "pmpt_1"}, "prompt_templates_not_supported", "prompt"),
    ("context_management", [{"type": "compaction"}], "context_management_not_supported", "context_management"),
    ("prompt_cache_key", "k", "prompt_cache_not_supported", "prompt_cache_key"),
    ("prompt_cache_retention", "24h", "prompt_cache_not_supported", "prompt_cache_retention"),
    ("safety_identifier", "u", "safety_identifier_not_supported", "safety_identifier"),
    ("user", "u", "user_not_supported", "user"),
    ("max_tool_calls", 3, "max_tool_calls_not_supported", "max_tool_calls"),
    ("include", ["reasoning.encrypted_content"], "include_not_supported", "include"),
    ("text", {"format": {"type": "json_schema", "name": "x", "schema": {}}}, "text_format_not_supported",
     "text.format.type"),
    ("text", {"format": {"type": "json_object"}}, "text_format_not_supported", "text.format.type"),
    ("tool_choice", "required", "tool_choice_not_supported", "tool_choice"),
    ("tool_choice", {"type": "function", "name": "get_weather"}, "tool_choice_not_supported", "tool_choice"),
    ("tools", [{"type": "web_search"}], "tools_not_supported", "tools[0].type"),
    ("tools", [{"type": "mcp", "server_label": "x"}], "tools_not_supported", "tools[0].type"),
    ("tools", [{"type": "custom", "name": "x"}], "tools_not_supported", "tools[0].type"),
    ("tools", [{**WEATHER, "strict": True}], "strict_tools_not_supported", "tools[0].strict"),
    ("parallel_tool_calls", False, "parallel_tool_calls_not_supported", "parallel_tool_calls"),
    ("truncation", "auto", "truncation_not_supported", "truncation"),
    ("top_logprobs", 5, "logprobs_not_supported", "top_logprobs"),
    ("service_tier", "flex", "service_tier_not_supported", "service_tier"),
    ("stream_options", {"include_obfuscation": True}, "stream_obfuscation_not_supported",
     "stream_options.include_obfuscation"),
    ("reasoning", {"effort": "low", "summary": "auto"}, "reasoning_summary_not_supported", "reasoning.summary"),
    ("reasoning", {"effort": "high"}, "reasoning_effort_not_supported", "reasoning.effort"),
    ("reasoning", {"effort": "maximal"}, "invalid_value", "reasoning.effort"),
    ("max_output_tokens", 15, "invalid_value", "max_output_tokens"),
    ("temperature", 2.5, "invalid_value", "temperature"),
    ("top_p", -0.1, "invalid_value", "top_p"),
    ("metadata", {f"k{i}": "v" for i in range(17)}, "invalid_value", "metadata"),
    ("chat_template_kwargs", {"enable_thinking": True}, "unknown_parameter", "chat_template_kwargs.enable_thinking"),
    ("preserve_thinking", "yes", "invalid_type", "preserve_thinking"),
])
def test_unknown_and_unsupported_fields_fail_with_their_codes(server, field, value, code, param):
    status, got_code, got_param = error_of(server.create(input="q", **{field: value}))
    assert (status, got_code, got_param) == (400, code, param)
    assert server.ctx.submitted == []


@pytest.mark.parametrize("item, code, param", [
    ({"type": "item_reference", "id": "msg_1"}, "item_type_not_supported", "input[0].type"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "modality_not_supported",
     "input[0].content[0].type"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "modality_not_supported",
     "input[0].content[0].type"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}, "vision_disabled",
     "input[0].content[0]"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "https://x", "detail": "high"}]},
     "image_detail_not_supported", "input[0].content[0].detail"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]},
     "image_file_id_not_supported", "input[0].content[0].file_id"),
    ({"role": "user", "content": [{"type": "input_image"}]}, "missing_required_parameter",
     "input[0].content[0].image_url"),
    ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "invalid_value",
     "input[0].content[0].type"),
    ({"role": "assistant", "content": "x", "phase": "final"}, "message_phase_not_supported", "input[0].phase"),
    ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}, "reasoning_summary_not_supported",
     "input[0].summary"),
    ({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}, "encrypted_reasoning_not_supported",
     "input[0].encrypted_content"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}, "invalid_value",
     "input[0].arguments"),
    ({"type": "function_call", "call_id": "c", "name": "no spaces", "arguments": "{}"}, "invalid_value",
     "input[0].name"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"}]},
     "invalid_type", "input[0].output"),
    ({"role": "tool", "content": "x"}, "invalid_value", "input[0].role"),
    ({"role": "user", "content": "x", "name": "bob"}, "unknown_parameter", "input[0].name"),
])
def test_unsupported_items_fail_with_their_codes(server, item, code, param):
    assert error_of(server.create(input=[item]))[1:] == (code, param)


def test_an_effort_the_template_exposes_is_accepted_and_echoed(qwen_tokenizer_json):
    builder = qwen_builder(qwen_tokenizer_json, "Qwen3.8-27B")
    runner = ScriptedRunner(script_of(builder.tokenizer, "x\n</think>\n\ny"))
    with Engine(runner, engine_config(), QWEN_27B_PRESETS) as engine:
        server = Server(EngineContext(engine, builder, options=ResponsesOptions()), runner)
        low = body_of(server.create(input="q", reasoning={"effort": "low"}))
        low_prompt = server.rendered()
        body_of(server.create(input="q"))
        assert error_of(server.create(input="q", reasoning={"effort": "high"}))[1:] == (
            "reasoning_effort_not_supported", "reasoning.effort")
    assert low["reasoning"] == {"effort": "low"} and low_prompt != server.rendered()


def test_prompt_errors_name_the_input(server):
    assert error_of(server.create(input=[{"role": "assistant", "content": "no question"}])) == (
        400, "invalid_value", "input")
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(2)]
    results = [{"type": "function_call_output", "call_id": f"c{i}", "output": "r"} for i in range(2)]
    between = [{"role": "user", "content": "q"}, *calls, results[0], {"role": "system", "content": "s"}, results[1]]
    assert error_of(server.create(input=between))[2] == "input"


def test_duplicate_item_ids_fail_and_other_request_errors(server):
    items = [{"role": "user", "content": "a", "id": "m1"}, {"role": "user", "content": "b", "id": "m1"}]
    assert error_of(server.create(input=items)) == (400, "duplicate_item_id", "input[1].id")
    assert error_of(server.create(input=[])) == (400, "invalid_value", "input")
    assert error_of(server.call("POST", "/v1/responses", {"input": "x"})) == (
        400, "missing_required_parameter", "model")
    assert error_of(server.call("POST", "/v1/responses", {"model": "gpt-5", "input": "x"})) == (
        404, "model_not_found", "model")
    assert error_of(server.create(input="q", reasoning={"effort": "none"}, preserve_thinking=True,
                                  chat_template_kwargs={"preserve_thinking": False}))[1] == \
        "conflicting_template_option"
