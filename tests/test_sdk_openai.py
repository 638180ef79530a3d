"""The official OpenAI Python SDK against the live server (the tiny random llama of server_harness): Chat
Completions (plain, streamed with usage, tools and tool-result turns) and Responses (create, stream, retrieve,
chain by previous_response_id, input_items, delete, input_tokens). The text is arbitrary; the tests assert that the
SDK parses everything, the structure, usage consistency, and stream == non-stream for a fixed seed."""

from __future__ import annotations

import openai
import pytest

from tests.support.server_harness import ServerThread, build_tiny_artifact

MODEL = "llama-custom"
KEY = "sdk-key"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


def counts(usage) -> tuple[int, int, int]:
    """Usage without its cached-token detail, which depends on what the prefix cache holds."""
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = ServerThread.start(build_tiny_artifact(tmp_path_factory.mktemp("tiny")), "--max-context", "512",
                                 "--api-key", KEY)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=60, max_retries=0) as sdk:
        yield sdk


def test_models_list(client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion(client):
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, seed=5,
                                                temperature=1.0)
    assert completion.object == "chat.completion" and completion.model == MODEL
    [choice] = completion.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    usage = completion.usage
    assert usage.completion_tokens == 10 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_with_usage_equals_the_completion(client):
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=12, seed=11, temperature=1.0)
    completion = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == completion.choices[0].message.content
    assert finish == [completion.choices[0].finish_reason]
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(completion.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_helper_accumulates(client):
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, max_tokens=8, seed=2,
                                        temperature=1.0) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.current_completion_snapshot  # get_final_completion() refuses a finish of "length"
    assert "".join(deltas) == final.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=2, temperature=1.0)
    assert final.choices[0].message.content == plain.choices[0].message.content


def test_chat_with_tools_and_a_tool_result_turn(client):
    request = dict(model=MODEL, max_tokens=10, seed=4, temperature=1.0, tools=TOOLS)
    first = client.chat.completions.create(messages=[{"role": "user", "content": "weather in Paris?"}], **request)
    message = first.choices[0].message
    assert message.role == "assistant" and first.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert message.tool_calls is None or all(call.type == "function" for call in message.tool_calls)
    turns = [{"role": "user", "content": "weather in Paris?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    second = client.chat.completions.create(messages=turns, tool_choice="auto", **request)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    streamed = list(client.chat.completions.create(messages=turns, stream=True, **request,
                                                   stream_options={"include_usage": True}))
    assert counts(streamed[-1].usage) == counts(second.usage)
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content == (second.choices[0].message.content or "")


def test_chat_errors_are_sdk_exceptions(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"foo": 1})
    assert unknown.value.code == "unknown_parameter" and unknown.value.param == "foo"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()


def test_responses_create_retrieve_items_and_delete(client):
    response = client.responses.create(model=MODEL, input="hello there", instructions="Be brief.",
                                       max_output_tokens=16, temperature=1.0)
    assert response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and isinstance(response.output_text, str)
    usage = response.usage
    assert usage.output_tokens == 16 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert client.responses.retrieve(response.id) == response
    items = client.responses.input_items.list(response.id)
    [item] = items.data
    assert item.role == "user" and item.content[0].text == "hello there"
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(response.id)
    assert missing.value.code == "response_not_found"


def test_responses_stream_equals_the_stored_response(client):
    request = dict(model=MODEL, input="tell me", max_output_tokens=16, temperature=1.0)
    events = list(client.responses.create(**request, stream=True))
    types = [event.type for event in events]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert final.output_text == text
    assert client.responses.retrieve(final.id) == final
    with client.responses.stream(**request) as stream:  # get_final_response() wants response.completed
        last = [event for event in stream][-1]
    assert last.type == "response.incomplete" and last.response.usage.output_tokens == 16


def test_responses_chain_with_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="hello", max_output_tokens=16)
    second = client.responses.create(model=MODEL, input="and then?", previous_response_id=first.id,
                                     max_output_tokens=16)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    items = client.responses.input_items.list(second.id, order="asc")
    assert items.data[-1].content[0].text == "and then?"
    client.responses.delete(first.id)  # the descendant stays usable
    third = client.responses.create(model=MODEL, input="more", previous_response_id=second.id, max_output_tokens=16)
    assert third.status == "incomplete"


def test_responses_with_a_function_tool_and_its_output(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city.",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    response = client.responses.create(
        model=MODEL, tools=tools, max_output_tokens=16,
        input=[{"role": "user", "content": "weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert response.tools[0].name == "get_weather"
    assert all(item.type in ("message", "function_call", "reasoning") for item in response.output)


def test_responses_input_tokens(client):
    counted = client.responses.input_tokens.count(model=MODEL, input="hello there")
    assert counted.input_tokens > 0
    created = client.responses.create(model=MODEL, input="hello there", max_output_tokens=16, store=False)
    assert created.usage.input_tokens == counted.input_tokens
