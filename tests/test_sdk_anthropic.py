"""The official Anthropic Python SDK against the live server (the tiny random llama of server_harness, its process
seed fixed since Anthropic requests carry none): messages (plain, streamed, tools and tool-result turns) and
count_tokens. The text is arbitrary; the tests assert that the SDK parses everything, the structure, usage
consistency, and stream == non-stream."""

from __future__ import annotations

import anthropic
import pytest

from tests.support.server_harness import ServerThread, build_tiny_artifact

MODEL = "ninfer-local-label"  # an echoed label
KEY = "sdk-key"
MESSAGES = [{"role": "user", "content": "hello there"}]
TOOLS = [{"name": "get_weather", "description": "Weather of a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
TOOL_TURNS = [{"role": "user", "content": "weather in Paris?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                 "input": {"city": "Paris"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = ServerThread.start(build_tiny_artifact(tmp_path_factory.mktemp("tiny")), "--max-context", "512",
                                 "--seed", "7", "--temperature", "1.0", "--api-key", KEY)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=60, max_retries=0) as sdk:
        yield sdk


def content_of(message) -> list[tuple]:
    return [(block.type, getattr(block, "text", None), getattr(block, "name", None), getattr(block, "input", None))
            for block in message.content]


def test_a_plain_message(client):
    message = client.messages.create(model=MODEL, max_tokens=10, messages=MESSAGES, system="Be brief.")
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_") and message.stop_reason == "max_tokens"
    assert all(block.type in ("text", "thinking", "tool_use") for block in message.content)
    assert message.usage.output_tokens == 10 and message.usage.input_tokens >= 0


def test_the_stream_equals_the_message(client):
    request = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "count with me"}])
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert content_of(streamed) == content_of(message)
    assert text == "".join(block.text for block in message.content if block.type == "text")
    assert streamed.stop_reason == message.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == message.usage.output_tokens == 12
    total = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0)  # noqa: E731
    assert total(streamed.usage) == total(message.usage)
    raw = list(client.messages.create(**request, stream=True))
    assert raw[0].type == "message_start" and raw[-1].type == "message_stop"
    assert raw[-2].type == "message_delta" and raw[-2].delta.stop_reason == "max_tokens"


def test_tools_and_a_tool_result_turn(client):
    first = client.messages.create(model=MODEL, max_tokens=10, tools=TOOLS, messages=TOOL_TURNS[:1])
    assert first.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert all(block.type != "tool_use" or block.name == "get_weather" for block in first.content)
    second = client.messages.create(model=MODEL, max_tokens=10, tools=TOOLS, tool_choice={"type": "auto"},
                                    messages=TOOL_TURNS)
    with client.messages.stream(model=MODEL, max_tokens=10, tools=TOOLS, tool_choice={"type": "auto"},
                                messages=TOOL_TURNS) as stream:
        streamed = stream.get_final_message()
    assert content_of(streamed) == content_of(second)
    counted = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=TOOL_TURNS)
    usage = second.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_count_tokens(client):
    counted = client.messages.count_tokens(model=MODEL, messages=MESSAGES, system="Be brief.")
    message = client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES, system="Be brief.")
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0
    assert client.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens < counted.input_tokens


def test_errors_are_sdk_exceptions(client, server):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES, extra_body={"frobnicate": 1})
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=MESSAGES)
