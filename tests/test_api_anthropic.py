"""POST /v1/messages and /v1/messages/count_tokens, called directly with a ServerContext over a real Engine (see
test_generation_adapter): exact event streams, the message, stream == message, lowering, and the refusals."""

from __future__ import annotations

import copy
import hashlib
import json
import re

import pytest

from ninfer.engine.sampler import SamplingOverrides
from ninfer.server.anthropic import count_tokens, create_message
from ninfer.server.context import ApiError
from ninfer.server.sse import frame
from tests.test_generation_adapter import (CALL, EngineContext, FakeOptions, left_early, post, qwen_builder,
                                           script_of, scripted_engine, tiny_qwen_engine)

QUESTION = [{"role": "user", "content": "What is 2+2?"}]
TOOLS = [{"name": "get_weather", "description": "Weather by city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]


@pytest.fixture(scope="module")
def builder(qwen_tokenizer_json):
    return qwen_builder(qwen_tokenizer_json)


@pytest.fixture(scope="module")
def builder38(qwen_tokenizer_json):
    return qwen_builder(qwen_tokenizer_json, "Qwen3.8-27B")


def messages(ctx, **body):
    return post(ctx, create_message, {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": QUESTION, **body})


def count(ctx, **body):
    return post(ctx, count_tokens, {"model": "claude-sonnet-4-5", "messages": QUESTION, **body}).body["input_tokens"]


def scripted(builder, text: str, *, draft_tokens: int = 0, **context):
    return EngineContext(scripted_engine(script_of(builder.tokenizer, text), draft_tokens=draft_tokens), builder,
                         **context)


def normalized(events) -> str:
    wire = b"".join(frame(e) for e in events).decode()
    wire = re.sub(r"msg_[0-9a-f]{24}", "msg_ID", wire)
    return re.sub(r"toolu_[0-9a-f]{24}", "toolu_ID", wire)


def event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def block_events(index: int, start: dict, deltas: list[dict]) -> list[str]:
    return [event({"type": "content_block_start", "index": index, "content_block": start}),
            *(event({"type": "content_block_delta", "index": index, "delta": d}) for d in deltas),
            event({"type": "content_block_stop", "index": index})]


def signature(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def accumulate(events) -> dict:
    """The message an Anthropic SDK rebuilds from the events (its accumulation rules, message_delta's usage being
    cumulative)."""
    message = None
    partial_json: dict[int, str] = {}
    for e in events:
        data = json.loads(e.data)
        assert e.event == data["type"]
        if data["type"] == "message_start":
            message = copy.deepcopy(data["message"])
        elif data["type"] == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(copy.deepcopy(data["content_block"]))
        elif data["type"] == "content_block_delta":
            block, d = message["content"][data["index"]], data["delta"]
            if d["type"] == "input_json_delta":
                partial_json[data["index"]] = partial_json.get(data["index"], "") + d["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}[d["type"]]
                block[key] += d[key]
        elif data["type"] == "content_block_stop":
            if data["index"] in partial_json:
                message["content"][data["index"]]["input"] = json.loads(partial_json[data["index"]])
        elif data["type"] == "message_delta":
            message.update(data["delta"])
            message["usage"].update(data["usage"])
    assert json.loads(events[-1].data) == {"type": "message_stop"}
    return message


def without_ids(message: dict) -> dict:
    content = [{**b, "id": "toolu_ID"} if b["type"] == "tool_use" else b for b in message["content"]]
    return {**message, "id": "msg_ID", "content": content}


# ---- exact bytes ----

def test_a_thinking_and_text_stream_byte_for_byte(builder):
    ctx = scripted(builder, "Hm.</think>\n\nIt is 4.")  # 11 tokens with <|im_end|>
    with ctx.engine:
        events = messages(ctx, stream=True)
    prompt = len(ctx.submitted[0][0])
    start = {"id": "msg_ID", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5", "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": prompt, "output_tokens": 0, "cache_read_input_tokens": 0}}
    assert normalized(events) == "".join([
        event({"type": "message_start", "message": start}),
        *block_events(0, {"type": "thinking", "thinking": "", "signature": ""},
                      [{"type": "thinking_delta", "thinking": t} for t in ("H", "m", ".")]
                      + [{"type": "signature_delta", "signature": signature("Hm.")}]),
        *block_events(1, {"type": "text", "text": ""},
                      [{"type": "text_delta", "text": t} for t in ("It", " is", " 4", ".")]),
        event({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
               "usage": {"input_tokens": prompt, "output_tokens": 11, "cache_read_input_tokens": 0}}),
        event({"type": "message_stop"}),
    ])


def test_a_tool_use_stream_byte_for_byte(builder):
    ctx = scripted(builder, f"Sure.\n{CALL}\n{CALL}", options=FakeOptions(no_thinking=True))
    with ctx.engine:
        events = messages(ctx, stream=True, tools=TOOLS, max_tokens=200)
    tool = {"type": "tool_use", "id": "toolu_ID", "name": "get_weather", "input": {}}
    arguments = {"type": "input_json_delta", "partial_json": '{"city":"Paris","days":2}'}
    wire = normalized(events)
    assert wire[wire.index("event: content_block_start"): wire.index("event: message_delta")] == "".join([
        *block_events(0, {"type": "text", "text": ""}, [{"type": "text_delta", "text": t} for t in ("Sure", ".")]),
        *block_events(1, tool, [arguments]),
        *block_events(2, tool, [arguments]),
    ])
    assert '"stop_reason":"tool_use"' in wire


def test_no_output_still_has_one_empty_text_block(builder):
    ctx = scripted(builder, "", options=FakeOptions(no_thinking=True))
    with ctx.engine:
        events = messages(ctx, stream=True)
        message = messages(ctx).body
    assert normalized(events).count("event: content_block_start") == 1
    assert accumulate(events)["content"] == message["content"] == [{"type": "text", "text": ""}]


@pytest.mark.parametrize("events", [1, 4])
def test_a_client_leaving_the_stream_cancels_the_request(builder, events):
    ctx = EngineContext(scripted_engine(script_of(builder.tokenizer, "a</think>\n\nb", stop=False), slow=True),
                        builder)
    with ctx.engine:
        body = {"model": "m", "messages": QUESTION, "max_tokens": 1000, "stream": True}
        assert left_early(ctx, create_message, body, events) == 0  # 1000 rounds would take 5 s


# ---- the message ----

def test_the_message_object(builder):
    ctx = scripted(builder, f"Checking.</think>\n\nSure.\n{CALL}")  # 45 tokens
    with ctx.engine:
        body = messages(ctx, tools=TOOLS).body
    prompt = len(ctx.submitted[0][0])
    [thinking, text, tool] = body["content"]
    assert re.fullmatch(r"msg_[0-9a-f]{24}", body["id"]) and re.fullmatch(r"toolu_[0-9a-f]{24}", tool["id"])
    assert body == {"id": body["id"], "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
                    "content": [{"type": "thinking", "thinking": "Checking.", "signature": signature("Checking.")},
                                {"type": "text", "text": "Sure."},
                                {"type": "tool_use", "id": tool["id"], "name": "get_weather",
                                 "input": {"city": "Paris", "days": 2}}],
                    "stop_reason": "tool_use", "stop_sequence": None,
                    "usage": {"input_tokens": prompt, "output_tokens": 45, "cache_read_input_tokens": 0}}


@pytest.mark.parametrize(("body", "stop_reason", "stop_sequence", "text"), [
    ({}, "end_turn", None, "It is 4."),
    ({"max_tokens": 6}, "max_tokens", None, "It"),
    ({"stop_sequences": ["zzz", " 4"]}, "stop_sequence", " 4", "It is"),
])
def test_stop_reasons(builder, body, stop_reason, stop_sequence, text):
    ctx = scripted(builder, "Hm.</think>\n\nIt is 4.")
    with ctx.engine:
        message = messages(ctx, **body).body
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)
    assert message["content"][-1] == {"type": "text", "text": text}


def test_usage_splits_the_prompt_into_computed_and_cached(builder):
    ctx = scripted(builder, "a</think>\n\nb")
    with ctx.engine:
        first, second = messages(ctx).body["usage"], messages(ctx).body["usage"]
    assert first["cache_read_input_tokens"] == 0 and second["cache_read_input_tokens"] > 0
    assert second["input_tokens"] + second["cache_read_input_tokens"] == first["input_tokens"]


# ---- stream == message ----

@pytest.mark.parametrize("draft_tokens", [0, 3])
@pytest.mark.parametrize("text", ["Think.\n</think>\n\nThe answer: 4.  ", f"Plan.</think>\n\nCalling.\n{CALL}\n{CALL}",
                                  f"</think>\n\n{CALL}\nAfter the call.", "Reasoning that never ends"])
def test_accumulated_events_equal_the_message_scripted(builder, text, draft_tokens):
    ctx = scripted(builder, text, draft_tokens=draft_tokens)
    with ctx.engine:
        streamed = accumulate(messages(ctx, stream=True, tools=TOOLS, max_tokens=40))
        message = messages(ctx, tools=TOOLS, max_tokens=40).body
    # The second request reuses the first one's prompt: only the input/cache split may differ.
    usage = {"input_tokens": None, "cache_read_input_tokens": None}
    assert {**without_ids(streamed), "usage": {**streamed["usage"], **usage}} \
        == {**without_ids(message), "usage": {**message["usage"], **usage}}


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_accumulated_events_equal_the_message_on_the_tiny_model(builder, thinking):
    # Anthropic requests carry no seed: the server's --seed fixes the sampling instead.
    with tiny_qwen_engine(sampling=SamplingOverrides(seed=1234)) as engine:
        ctx = EngineContext(engine, builder)
        body = {"max_tokens": 30, "temperature": 1.0, "thinking": {"type": thinking}}
        streamed = accumulate(messages(ctx, stream=True, **body))
        message = messages(ctx, **body).body
    assert without_ids(streamed)["content"] == without_ids(message)["content"]
    assert streamed["stop_reason"] == message["stop_reason"] == "max_tokens"
    assert streamed["usage"]["output_tokens"] == message["usage"]["output_tokens"] == 30


# ---- lowering ----

def rendered(ctx) -> str:
    prompt, _ = ctx.submitted[-1]
    return ctx.prompt_builder.tokenizer.decode(prompt.token_ids.tolist(), skip_special=False)


def test_history_lowers_to_the_templates_turns(builder):
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Rome?",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "OLD-REASONING", "signature": "x"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And Paris?"}]},
        {"role": "system", "content": "Answer in French."},
    ]
    ctx = scripted(builder, "x")
    with ctx.engine:
        messages(ctx, system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                 messages=history, tools=TOOLS, metadata={"user_id": "u-1"})
    text = rendered(ctx)
    assert text.startswith("<|im_start|>system\n# Tools") and "Be brief.\nBe kind." in text
    assert '"name": "get_weather"' in text and '"description": "Weather by city"' in text
    assert text.index("Weather in Rome?") < text.index("Checking.") < text.index("<parameter=city>\nRome") \
        < text.index("<tool_response>\nsunny\n</tool_response>") < text.index("And Paris?") \
        < text.index("<|im_start|>system\nAnswer in French.<|im_end|>")
    assert "OLD-REASONING" not in text and "opaque" not in text  # closed-turn reasoning dropped by default


def test_an_error_tool_result_says_so(builder):
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                  "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                             "content": [{"type": "text", "text": "timeout"}]}]}]
    ctx = scripted(builder, "x")
    with ctx.engine:
        messages(ctx, messages=history, tools=TOOLS)
    assert "<tool_response>\nError:\ntimeout\n</tool_response>" in rendered(ctx)


@pytest.mark.parametrize(("fields", "no_thinking", "thinking"), [
    ({}, False, True), ({}, True, False), ({"thinking": {"type": "disabled"}}, False, False),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, True, True),
    ({"thinking": {"type": "adaptive"}}, True, True),
])
def test_thinking_type_over_the_server_default(builder, fields, no_thinking, thinking):
    ctx = scripted(builder, "x", options=FakeOptions(no_thinking=no_thinking))
    with ctx.engine:
        messages(ctx, **fields)
    assert ctx.submitted[-1][0].thinking is thinking


def test_effort_is_checked_against_the_template(builder38):
    ctx = scripted(builder38, "x")
    with ctx.engine:
        messages(ctx, output_config={"effort": "low"})
        low = rendered(ctx)
        messages(ctx)
        assert low != rendered(ctx)
        with pytest.raises(ApiError) as high:
            messages(ctx, output_config={"effort": "high"})
        with pytest.raises(ApiError) as disabled:
            messages(ctx, output_config={"effort": "low"}, thinking={"type": "disabled"})
    assert (high.value.code, high.value.param) == ("reasoning_effort_not_supported", "output_config.effort")
    assert (disabled.value.code, disabled.value.param) == ("conflicting_template_option", "output_config.effort")


def test_sampling_fields_reach_the_engine(builder):
    ctx = scripted(builder, "x")
    with ctx.engine:
        messages(ctx, temperature=0.5, top_p=0.9, top_k=5, max_tokens=7)
    _, options = ctx.submitted[-1]
    assert (options.max_tokens, options.sampling.temperature, options.sampling.top_p, options.sampling.top_k,
            options.sampling.seed) == (7, 0.5, 0.9, 5, None)
    assert ctx.preparations == [("messages", {"stream": False, "messages": 1, "tools": 0, "media_items": 0})]


# ---- count_tokens ----

def test_count_tokens_is_the_generation_prompt_length(builder):
    ctx = scripted(builder, "x")
    with ctx.engine:
        counted = count(ctx, tools=TOOLS, system="Be brief.")
        messages(ctx, tools=TOOLS, system="Be brief.")
        without_thinking = count(ctx, thinking={"type": "disabled"})
        with_thinking = count(ctx)
    assert counted == len(ctx.submitted[-1][0])
    prompts = builder.capabilities.non_thinking_generation_prompt, builder.capabilities.thinking_generation_prompt
    closed, opened = (len(builder.tokenizer.encode(p)) for p in prompts)
    assert without_thinking - with_thinking == closed - opened > 0
    assert ctx.preparations == [("messages", {"stream": False, "messages": 1, "tools": 1, "media_items": 0})]


# ---- refusals ----

@pytest.mark.parametrize(("body", "code", "param"), [
    ({"foo": 1}, "unknown_parameter", "foo"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "modality_not_supported",
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "invalid_value", "messages[0].content[0].type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools_not_supported", "tools[0].type"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "invalid_value", "tools[0].name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "invalid_value", "tool_choice.name"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "parallel_tool_calls_not_supported",
     "tool_choice.disable_parallel_tool_use"),
    ({"output_config": {"effort": "none"}}, "invalid_value", "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_format_not_supported", "output_config.format"),
    ({"messages": QUESTION + [{"role": "assistant", "content": "The answer is"}]},
     "assistant_prefill_not_supported", "messages[1]"),
    ({"messages": [{"role": "system", "content": "s"}, *QUESTION]}, "invalid_value", "messages[0]"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}, {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}], "tools": TOOLS},
     "invalid_value", "messages[2]"),
    ({"temperature": 1.5}, "invalid_value", "temperature"),
    ({"mcp_servers": [{"type": "url"}]}, "mcp_servers_not_supported", "mcp_servers"),
    ({"thinking": {"type": "enabled", "budget_tokens": "big"}}, "invalid_type", "thinking.budget_tokens"),
])
def test_refusals_name_the_field(builder, body, code, param):
    ctx = scripted(builder, "x")
    with ctx.engine:
        with pytest.raises(ApiError) as raised:
            messages(ctx, **body)
    error = raised.value
    assert (error.status, error.code, error.param) == (400, code, param) and ctx.submitted == []


def test_the_model_is_a_label(builder):
    ctx = scripted(builder, "x")
    with ctx.engine:
        assert messages(ctx, model="anything-at-all").body["model"] == "anything-at-all"


@pytest.mark.parametrize("handler", [create_message, count_tokens])
def test_images_without_vision_are_vision_disabled(builder, handler):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    history = [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
    ctx = scripted(builder, "x")
    with ctx.engine:
        with pytest.raises(ApiError) as raised:
            post(ctx, handler, {"model": "m", "max_tokens": 5, "messages": history} if handler is create_message
                 else {"model": "m", "messages": history})
    assert (raised.value.code, raised.value.param) == ("vision_disabled", "messages[0].content[1]")
