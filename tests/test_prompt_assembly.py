"""Prompt assembly: message lowering, serving.md's system/developer placement, typed errors, ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.artifact.reader import Artifact
from ninfer.artifact.writer import ResourceSpec, write_artifact
from ninfer.frontend.chat import ChatTemplate
from ninfer.frontend.prompt import (ContentPartError, PromptBuilder, PromptError, PromptOptions, SystemMediaError,
                                    SystemPlacementError, TemplateRejectedError, ToolCallError, UnknownRoleError)
from ninfer.frontend.tokenizer import Tokenizer
from tests.support.qwen_tokenizer import TOKENIZER_CONFIG

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
MODELS = ["Qwen3.5-0.8B", "Qwen3.6-27B", "Qwen3.8-27B"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": "", "reasoning_content": "use the tool",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}


def block(text: str) -> str:
    return f"<|im_start|>system\n{text}<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_json: Path) -> Tokenizer:
    return Tokenizer(qwen_tokenizer_json.read_bytes(), TOKENIZER_CONFIG.read_bytes())


@pytest.fixture(scope="module", params=MODELS)
def builder(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> PromptBuilder:
    return PromptBuilder(ChatTemplate((FIXTURES / request.param / "chat_template.jinja").read_text()), tokenizer)


def plain(builder: PromptBuilder, messages, options=PromptOptions(), **kw) -> str:
    """The official template's own rendering, with the options the builder passes."""
    variables = {"preserve_thinking": options.preserve_thinking}
    if options.reasoning_effort is not None:
        variables["reasoning_effort"] = options.reasoning_effort
    return builder.template.render(messages, enable_thinking=options.thinking, **kw, **variables)


def test_from_artifact_reads_the_embedded_template_and_tokenizer(qwen_tokenizer_json: Path, tmp_path: Path):
    resources = {"frontend/tokenizer.json": qwen_tokenizer_json.read_bytes(),
                 "frontend/tokenizer_config.json": TOKENIZER_CONFIG.read_bytes(),
                 "frontend/chat_template.jinja": (FIXTURES / "Qwen3.8-27B" / "chat_template.jinja").read_bytes()}
    path = tmp_path / "frontend-only.ninfer"
    # the model id says 3.6; the capabilities follow the embedded (Qwen3.8) template
    write_artifact(path, "qwen3.6-27b", [(ResourceSpec(name, len(data)), data) for name, data in resources.items()])
    with Artifact.open(path) as artifact:
        builder = PromptBuilder.from_artifact(artifact)
    assert builder.capabilities.effort_levels == ("low", "medium", "xhigh")
    assert builder.build([{"role": "user", "content": "hi"}]).ids[-2:] == (248068, 198)


def test_without_later_system_messages_the_prompt_is_the_templates(builder: PromptBuilder):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"}, CALL,
                {"role": "tool", "content": "sunny"}, {"role": "user", "content": "thanks"}]
    for options in (PromptOptions(), PromptOptions(False, True), PromptOptions(True, True)):
        assert builder.render(messages, options, tools=TOOLS) == plain(builder, messages, options, tools=TOOLS)


def test_a_leading_developer_message_is_the_system_message(builder: PromptBuilder):
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for tools in (None, TOOLS):
        assert builder.render(developer, tools=tools) == plain(builder, system, tools=tools)


@pytest.mark.parametrize("preserve", [False, True])
def test_a_system_message_before_a_new_user_turn_stays_there(builder: PromptBuilder, preserve: bool):
    options = PromptOptions(preserve_thinking=preserve)
    first = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"}]
    second = [{"role": "user", "content": "q2"}]
    expected = plain(builder, first + second, options).replace("<|im_start|>user\nq2", block("New rule.") +
                                                               "<|im_start|>user\nq2")
    assert builder.render(first + [{"role": "system", "content": "  New rule.\n"}] + second, options) == expected


def test_system_and_developer_messages_keep_their_order_and_positions(builder: PromptBuilder):
    messages = [{"role": "system", "content": "S0"}, {"role": "developer", "content": "D1"},
                {"role": "user", "content": "q1"}, {"role": "developer", "content": "D3"},
                {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "user", "content": "q2"}, {"role": "system", "content": "S6"}, {"role": "system", "content": "S7"}]
    kept = [m for m in messages if m["content"] in ("S0", "q1", "a1", "q2")]
    expected = plain(builder, kept, tools=TOOLS)
    expected = expected.replace("<|im_start|>user\nq1", block("D1") + "<|im_start|>user\nq1")
    expected = expected.replace("<|im_start|>assistant\n", block("D3") + "<|im_start|>assistant\n", 1)
    expected = expected.replace("q2<|im_end|>\n", "q2<|im_end|>\n" + block("S6") + block("S7"))
    assert builder.render(messages, tools=TOOLS) == expected
    assert expected.index("S0") < expected.index("D1") < expected.index("q1") < expected.index("D3")


def test_a_system_message_around_tool_results(builder: PromptBuilder):
    head = [{"role": "user", "content": "weather?"}, CALL]
    results = [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"}]
    answer = [{"role": "assistant", "content": "Sunny and warm."}]
    expected = plain(builder, head + results + answer)
    after_results = expected.replace("</tool_response><|im_end|>\n", "</tool_response><|im_end|>\n" + block("Cite."))
    assert builder.render(head + results + [{"role": "system", "content": "Cite."}] + answer) == after_results
    before_results = expected.replace("<|im_start|>user\n<tool_response>", block("Cite.") + "<|im_start|>user\n"
                                      "<tool_response>")
    assert builder.render(head + [{"role": "developer", "content": "Cite."}] + results + answer) == before_results
    with pytest.raises(SystemPlacementError) as err:
        builder.render(head + results[:1] + [{"role": "system", "content": "Cite."}] + results[1:] + answer)
    assert err.value.param == "messages[3]"


def test_qwen38_effort_instructions_compose_with_the_leading_message_only(tokenizer: Tokenizer):
    builder = PromptBuilder(ChatTemplate((FIXTURES / "Qwen3.8-27B" / "chat_template.jinja").read_text()), tokenizer)
    options = PromptOptions(reasoning_effort="low")
    text = builder.render([{"role": "developer", "content": "Lead."}, {"role": "user", "content": "q"},
                           {"role": "developer", "content": "Later."}], options)
    assert text.startswith("<|im_start|>system\nReasoning effort is set to low.")
    assert "\n\nLead.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n" + block("Later.") + "<|im_start|>assistant\n" in text


def test_content_parts_and_tool_arguments_are_lowered(builder: PromptBuilder):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "second"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, {"type": "text", "text": "third"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]},
        {**CALL, "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                                {"type": "function", "function": {"name": "noop", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": None}]
    text = builder.render(messages)
    assert ("user\nfirst\nsecond<|vision_start|><|image_pad|><|vision_end|>third"
            "<|vision_start|><|video_pad|><|vision_end|><|im_end|>") in text
    assert "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n" in text
    assert "<function=noop>\n</function>" in text
    assert "<tool_response>\n\n</tool_response>" in text


def test_build_returns_the_ids_and_the_thinking_channel(builder: PromptBuilder, tokenizer: Tokenizer):
    messages = [{"role": "user", "content": "你好，简单介绍一下你自己。"}]
    on, off = builder.build(messages), builder.build(messages, PromptOptions(thinking=False))
    assert on.ids == tuple(tokenizer.encode(on.text)) and on.thinking
    assert on.ids[-2:] == (248068, 198) and not off.thinking
    assert off.text.endswith(builder.capabilities.non_thinking_generation_prompt)
    if not builder.capabilities.effort_levels:  # Qwen3.8 adds its effort instruction when thinking
        assert len(on.ids) == 16 and len(off.ids) == 18  # ninfer-facts §5.2 goldens


@pytest.mark.parametrize(("messages", "error", "param"), [
    ([{"role": "user", "content": "hi"}, {"role": "critic", "content": "x"}], UnknownRoleError, "messages[1].role"),
    ([{"content": "no role"}], UnknownRoleError, "messages[0].role"),
    ([{"role": "system", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]},
      {"role": "user", "content": "hi"}], SystemMediaError, "messages[0].content[1]"),
    ([{"role": "user", "content": "hi"}, {"role": "developer", "content": [{"type": "video"}]}],
     SystemMediaError, "messages[1].content[0]"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], ContentPartError, "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], ContentPartError, "messages[0].content[0].text"),
    ([{"role": "user", "content": {"text": "an object"}}], ContentPartError, "messages[0].content"),
    (["not a message"], PromptError, "messages[0]"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": 1}],
     ContentPartError, "messages[1].reasoning_content"),
    ([{"role": "user", "content": "hi"}, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     ToolCallError, "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "hi"}, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     ToolCallError, "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "hi"}, {**CALL, "tool_calls": [{"function": {"arguments": {}}}]}],
     ToolCallError, "messages[1].tool_calls[0].function.name"),
    ([{"role": "user", "content": "hi"}, {**CALL, "tool_calls": {"name": "f"}}], ToolCallError, "messages[1].tool_calls"),
    ([{"role": "assistant", "content": "no user query"}], TemplateRejectedError, "messages"),
])
def test_bad_input_is_a_typed_error(builder: PromptBuilder, messages, error, param):
    with pytest.raises(error) as err:
        builder.build(messages)
    assert isinstance(err.value, PromptError)
    assert (err.value.code, err.value.param) == ("invalid_value", param)
