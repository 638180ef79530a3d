"""POST /v1/chat/completions, called directly with a ServerContext over a real Engine (see test_generation_adapter):
exact stream bytes, the non-streamed object, stream == non-stream, request options, and the 400s serving.md names."""

from __future__ import annotations

import json
import re

import pytest

from ninfer.server.context import ApiError
from ninfer.server.openai_chat import create_chat_completion
from ninfer.server.sse import frame
from tests.test_generation_adapter import (CALL, TOOLS, EngineContext, FakeOptions, left_early, post, qwen_builder,
                                           script_of, scripted_engine, tiny_qwen_engine)

MODEL = "qwen3.6-27b"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def builder(qwen_tokenizer_json):
    return qwen_builder(qwen_tokenizer_json)


@pytest.fixture(scope="module")
def builder38(qwen_tokenizer_json):
    return qwen_builder(qwen_tokenizer_json, "Qwen3.8-27B")


def chat(ctx, **body):
    return post(ctx, create_chat_completion, {"model": MODEL, "messages": QUESTION, **body})


def scripted(builder, text: str, *, draft_tokens: int = 0, **context):
    """A context whose model writes `text` (then <|im_end|>)."""
    return EngineContext(scripted_engine(script_of(builder.tokenizer, text), draft_tokens=draft_tokens), builder,
                         **context)


def normalized(events) -> str:
    """The stream's bytes with the random parts (response id, created, call ids) replaced by fixed ones."""
    wire = b"".join(frame(e) for e in events).decode()
    wire = re.sub(r"chatcmpl-[0-9a-f]{16}", "chatcmpl-ID", wire)
    wire = re.sub(r'"created":\d+', '"created":0', wire)
    return re.sub(r"call_[0-9a-f]{16}", "call_ID", wire)


def chunk(body: str) -> str:
    return f'data: {{"id":"chatcmpl-ID","object":"chat.completion.chunk","created":0,"model":"{MODEL}",{body}}}\n\n'


def delta(body: str, finish: str = "null") -> str:
    return chunk(f'"choices":[{{"index":0,"delta":{{{body}}},"finish_reason":{finish}}}]')


def data_of(events) -> list[dict]:
    return [json.loads(e.data) for e in events if e.data != "[DONE]"]


def accumulate(events) -> dict:
    """What a client rebuilds from the chunks: the message, finish reason and usage (OpenAI SDK rules)."""
    message = {"role": None, "content": "", "reasoning_content": "", "reasoning": "", "tool_calls": []}
    finish = usage = None
    for data in data_of(events):
        usage = data.get("usage") or usage
        for choice in data["choices"]:
            finish = choice["finish_reason"] or finish
            d = choice["delta"]
            message["role"] = d.get("role", message["role"])
            for key in ("content", "reasoning_content", "reasoning"):
                message[key] += d.get(key) or ""
            for call in d.get("tool_calls", []):
                if call["index"] == len(message["tool_calls"]):
                    message["tool_calls"].append({"id": call["id"], "type": call["type"],
                                                  "function": {"name": call["function"]["name"], "arguments": ""}})
                message["tool_calls"][call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    if not message["tool_calls"]:
        del message["tool_calls"]
    elif not message["content"]:
        message["content"] = None  # the non-streamed message's null content next to tool calls
    for key in ("reasoning_content", "reasoning"):
        if not message[key]:
            del message[key]
    return {"message": message, "finish_reason": finish, "usage": usage}


def without_ids(message: dict) -> dict:
    calls = [{**call, "id": "call_ID"} for call in message.get("tool_calls", [])]
    return {**message, **({"tool_calls": calls} if calls else {})}


# ---- exact bytes ----

def test_a_reasoning_stream_byte_for_byte(builder):
    ctx = scripted(builder, "Hm.</think>\n\nIt is 4.")  # 11 tokens with <|im_end|>, 4 up to </think>
    with ctx.engine:
        events = chat(ctx, stream=True, stream_options={"include_usage": True}, max_tokens=50)
    prompt = len(ctx.submitted[0][0])
    usage = (f'"usage":{{"prompt_tokens":{prompt},"completion_tokens":11,"total_tokens":{prompt + 11},'
             f'"prompt_tokens_details":{{"cached_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":4}}}}')
    assert normalized(events) == "".join([
        delta('"role":"assistant","content":""'),
        delta('"reasoning_content":"H","reasoning":"H"'),
        delta('"reasoning_content":"m","reasoning":"m"'),
        delta('"reasoning_content":".","reasoning":"."'),
        delta('"content":"It"'),
        delta('"content":" is"'),
        delta('"content":" 4"'),  # the lone " " token waited for the text after it
        delta('"content":"."'),
        delta("", '"stop"'),
        chunk(f'"choices":[],{usage}'),
        "data: [DONE]\n\n",
    ])


def test_a_tool_call_stream_byte_for_byte(builder):
    ctx = scripted(builder, f"Checking.</think>\n\nSure.\n{CALL}")
    with ctx.engine:
        events = chat(ctx, stream=True, tools=TOOLS)
    arguments = json.dumps('{"city":"Paris","days":2}')
    assert normalized(events) == "".join([
        delta('"role":"assistant","content":""'),
        *(delta(f'"reasoning_content":"{t}","reasoning":"{t}"') for t in ("Checking", ".")),
        delta('"content":"Sure"'),
        delta('"content":"."'),
        delta('"tool_calls":[{"index":0,"id":"call_ID","type":"function","function":{"name":"get_weather",'
              '"arguments":""}}]'),
        delta(f'"tool_calls":[{{"index":0,"function":{{"arguments":{arguments}}}}}]'),
        delta("", '"tool_calls"'),
        "data: [DONE]\n\n",
    ])


def test_one_id_and_created_for_the_whole_stream(builder):
    ctx = scripted(builder, "a</think>\n\nb c d")
    with ctx.engine:
        chunks = data_of(chat(ctx, stream=True, stream_options={"include_usage": True}))
    assert len({(c["id"], c["created"]) for c in chunks}) == 1 and re.fullmatch(r"chatcmpl-[0-9a-f]{16}",
                                                                               chunks[0]["id"])


@pytest.mark.parametrize("events", [1, 3])
def test_a_client_leaving_the_stream_cancels_the_request(builder, events):
    ctx = EngineContext(scripted_engine(script_of(builder.tokenizer, "a</think>\n\nb", stop=False), slow=True),
                        builder)
    with ctx.engine:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1000, "stream": True}
        assert left_early(ctx, create_chat_completion, body, events) == 0  # 1000 rounds would take 5 s


# ---- the non-streamed object ----

def test_the_completion_object(builder):
    ctx = scripted(builder, f"Checking.</think>\n\nSure.\n{CALL}")  # 45 tokens, 3 up to </think>
    with ctx.engine:
        body = chat(ctx, tools=TOOLS).body
    prompt_tokens = len(ctx.submitted[0][0])
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{16}", call["id"])
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["id"]) and isinstance(body["created"], int)
    assert {k: body[k] for k in ("object", "model")} == {"object": "chat.completion", "model": MODEL}
    assert body["choices"] == [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Sure.", "reasoning_content": "Checking.", "reasoning": "Checking.",
        "tool_calls": [{"id": call["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'}}]}}]
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 45,
                             "total_tokens": prompt_tokens + 45, "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 3}}


def test_only_tool_calls_make_content_null_and_no_reasoning_leaves_the_fields_out(builder):
    ctx = scripted(builder, CALL, options=FakeOptions(no_thinking=True))
    with ctx.engine:
        message = chat(ctx, tools=TOOLS).body["choices"][0]["message"]
    assert message["content"] is None and "reasoning_content" not in message and "reasoning" not in message


def test_cached_tokens_report_the_reused_prefix(builder):
    ctx = scripted(builder, "a</think>\n\nb")
    with ctx.engine:
        first, second = chat(ctx).body["usage"], chat(ctx).body["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"] == first["prompt_tokens"]


# ---- stream == non-stream ----

@pytest.mark.parametrize("draft_tokens", [0, 3])
@pytest.mark.parametrize("text", ["Think a bit.\n</think>\n\nThe answer: 4.  ",
                                  f"Plan.</think>\n\nCalling.\n{CALL}\n{CALL}",
                                  "Only reasoning that never ends"])
def test_concatenated_deltas_equal_the_completion_scripted(builder, text, draft_tokens):
    ctx = scripted(builder, text, draft_tokens=draft_tokens)
    with ctx.engine:
        streamed = accumulate(chat(ctx, stream=True, tools=TOOLS, max_tokens=40,
                                   stream_options={"include_usage": True}))
        choice_usage = chat(ctx, tools=TOOLS, max_tokens=40).body
    [choice] = choice_usage["choices"]
    assert without_ids(streamed["message"]) == without_ids(choice["message"])
    assert streamed["finish_reason"] == choice["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "completion_tokens_details"):
        assert streamed["usage"][key] == choice_usage["usage"][key]


@pytest.mark.parametrize("thinking", [True, False])
def test_concatenated_deltas_equal_the_completion_on_the_tiny_model(builder, thinking):
    with tiny_qwen_engine() as engine:
        ctx = EngineContext(engine, builder)
        request = dict(seed=1234, temperature=1.0, max_completion_tokens=30, enable_thinking=thinking)
        streamed = accumulate(chat(ctx, stream=True, stream_options={"include_usage": True}, **request))
        completion = chat(ctx, **request).body
    assert streamed["message"] == completion["choices"][0]["message"]
    assert streamed["finish_reason"] == completion["choices"][0]["finish_reason"] == "length"
    assert streamed["usage"]["completion_tokens"] == completion["usage"]["completion_tokens"] == 30


# ---- request options ----

def test_sampling_fields_and_the_output_limit_reach_the_engine(builder):
    ctx = scripted(builder, "a</think>\n\nb")
    with ctx.engine:
        chat(ctx, temperature=0.5, top_p=0.9, top_k=7, presence_penalty=0.25, frequency_penalty=-0.5, seed=42,
             max_completion_tokens=9, max_tokens=99)
        chat(ctx, max_tokens=99)
    (_, first), (_, second) = ctx.submitted
    sampling = first.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0.5, 0.9, 7, 42)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.min_p) == (0.25, -0.5, None)
    assert first.max_tokens == 9 and second.max_tokens == 99  # max_completion_tokens wins over max_tokens
    assert second.sampling.seed is None  # the engine draws a fresh seed (or --seed) for it


@pytest.mark.parametrize("stop", ["is", ["nothing", "is"], ["", "is"]])
def test_a_stop_string_cuts_the_content(builder, stop):
    ctx = scripted(builder, "Hm.</think>\n\nIt is 4.")
    with ctx.engine:
        body = chat(ctx, stop=stop).body
    assert body["choices"][0]["message"]["content"] == "It" and body["choices"][0]["finish_reason"] == "stop"


def test_the_output_limit_is_length(builder):
    ctx = scripted(builder, "a b c d e f g")
    with ctx.engine:
        body = chat(ctx, max_tokens=3).body
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3


def rendered(ctx) -> str:
    prompt, _ = ctx.submitted[-1]
    return ctx.prompt_builder.tokenizer.decode(prompt.token_ids.tolist(), skip_special=False)


@pytest.mark.parametrize(("fields", "thinking"), [
    ({}, True), ({"reasoning_effort": "none"}, False), ({"enable_thinking": False}, False),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False),
])
def test_thinking_switches(builder, fields, thinking):
    ctx = scripted(builder, "x")
    with ctx.engine:
        chat(ctx, **fields)
    assert rendered(ctx).endswith("<think>\n") is thinking and ctx.submitted[-1][0].thinking is thinking


def test_an_exposed_effort_reaches_the_template(builder38):
    ctx = scripted(builder38, "x")
    with ctx.engine:
        chat(ctx, reasoning_effort="low")
        low = rendered(ctx)
        chat(ctx)
    assert low != rendered(ctx)


def test_preserve_thinking_keeps_closed_turn_reasoning(builder):
    history = [{"role": "user", "content": "q1"},
               {"role": "assistant", "content": "a1", "reasoning_content": "SECRET-REASONING"},
               {"role": "user", "content": "q2"}]
    ctx = scripted(builder, "x")
    with ctx.engine:
        chat(ctx, messages=history)
        dropped = rendered(ctx)
        chat(ctx, messages=history, preserve_thinking=True)
        kept = rendered(ctx)
        chat(ctx, messages=history, chat_template_kwargs={"preserve_thinking": True}, preserve_thinking=True)
    assert "SECRET-REASONING" not in dropped and "SECRET-REASONING" in kept
    assert ctx.submitted[-1][0].preserve_thinking


def test_tool_choice_selects_the_rendered_tools(builder):
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    ctx = scripted(builder, f"a</think>\n\n{CALL}")
    with ctx.engine:
        none = chat(ctx, tools=TOOLS + [other], tool_choice="none").body["choices"][0]
        prompt_none = rendered(ctx)
        chat(ctx, tools=TOOLS + [other], tool_choice={"type": "function", "function": {"name": "get_time"}})
        prompt_named = rendered(ctx)
    assert "get_weather" not in prompt_none and none["finish_reason"] == "stop"
    assert none["message"]["content"].startswith("<tool_call>")  # no tools offered: no parsing either
    assert '"get_time"' in prompt_named and '"get_weather"' not in prompt_named


def test_history_roles_and_tool_turns_render(builder):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                {"role": "system", "content": [{"type": "text", "text": "Mention the source."}]}]
    ctx = scripted(builder, "x")
    with ctx.engine:
        chat(ctx, messages=messages, tools=TOOLS)
    text = rendered(ctx)
    assert text.index("Be brief.") < text.index("weather?") < text.index("<parameter=city>\nParis") \
        < text.index("<tool_response>\nsunny") < text.index("<|im_start|>system\nMention the source.")


# ---- refusals ----

def refused(ctx, **body) -> ApiError:
    with pytest.raises(ApiError) as raised:
        chat(ctx, **body)
    return raised.value


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"foo": 1}, "unknown_parameter", "foo"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "unknown_parameter", "messages[0].extra"),
    ({"n": 2}, "n_not_supported", "n"),
    ({"logprobs": True}, "logprobs_not_supported", "logprobs"),
    ({"top_logprobs": 3}, "logprobs_not_supported", "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format_not_supported", "response_format.type"),
    ({"audio": {"voice": "alloy"}}, "audio_not_supported", "audio"),
    ({"modalities": ["text", "audio"]}, "modality_not_supported", "modalities"),
    ({"functions": [{"name": "f"}]}, "tools_not_supported", "functions"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools_not_supported", "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "strict_tools_not_supported",
     "tools[0].function.strict"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls_not_supported", "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "modality_not_supported", "messages[0].content[0].type"),
    ({"messages": [{"role": "function", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"temperature": 2.5}, "invalid_value", "temperature"),
    ({"seed": -1}, "invalid_value", "seed"),
    ({"max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"max_tokens": "10"}, "invalid_type", "max_tokens"),
    ({"messages": []}, "invalid_value", "messages"),
    ({"model": None}, "invalid_type", "model"),
    ({"reasoning_effort": "high"}, "reasoning_effort_not_supported", "reasoning_effort"),
    ({"reasoning_effort": "none", "enable_thinking": True}, "conflicting_template_option", "reasoning_effort"),
    ({"preserve_thinking": True, "chat_template_kwargs": {"preserve_thinking": False}},
     "conflicting_template_option", "preserve_thinking"),
    ({"chat_template_kwargs": {"add_vision_id": True}}, "unknown_parameter", "chat_template_kwargs.add_vision_id"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
        {"role": "user", "content": "x"}]}, "invalid_value", "messages[0].tool_calls[0].function.arguments"),
])
def test_refusals_name_the_field(builder, body, code, param):
    ctx = scripted(builder, "x")
    with ctx.engine:
        error = refused(ctx, **body)
    assert (error.status, error.code, error.param) == (400, code, param) and param.split("[")[0] in error.message
    assert ctx.submitted == []


def test_null_template_kwargs_are_ignored(builder):
    ctx = scripted(builder, "x")
    with ctx.engine:
        assert chat(ctx, chat_template_kwargs={"add_vision_id": None}).status == 200


def test_a_model_other_than_the_served_one_is_404(builder):
    ctx = scripted(builder, "x")
    with ctx.engine:
        error = refused(ctx, model="gpt-4o")
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")


def test_media_without_vision_is_vision_disabled(builder):
    image = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    ctx = scripted(builder, "x")
    with ctx.engine:
        error = refused(ctx, messages=[image])
    assert (error.status, error.code, error.param) == (400, "vision_disabled", "messages[0].content[1]")


def test_a_prompt_over_the_context_is_context_length_exceeded(builder):
    ctx = scripted(builder, "x")
    with ctx.engine:
        error = refused(ctx, messages=[{"role": "user", "content": "word " * 3000}], stream=True)
    assert error.code == "context_length_exceeded" and error.extra["prompt_tokens"] > error.extra["max_context"]


def test_preparation_is_announced_with_the_request_shape(builder):
    ctx = scripted(builder, "x")
    with ctx.engine:
        chat(ctx, stream=True, tools=TOOLS)
    assert ctx.preparations == [("chat", {"stream": True, "messages": 1, "tools": 1, "media_items": 0})]
