"""The artifact's chat template renders in our sandbox exactly as transformers renders it."""

from pathlib import Path

import pytest

from ninfer.frontend.chat import ChatTemplate, ChatTemplateError, opens_thinking

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"


def template(model: str) -> ChatTemplate:
    return ChatTemplate((FIXTURES / model / "chat_template.jinja").read_text())


def test_qwen36_golden_generation_prompt_with_and_without_thinking():
    t = template("Qwen3.6-27B")
    hello = [{"role": "user", "content": "hello"}]
    on = t.render(hello)
    assert on == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert opens_thinking(on)
    off = t.render(hello, enable_thinking=False)
    assert off == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert not opens_thinking(off)


def test_template_errors_are_typed():
    with pytest.raises(ChatTemplateError):
        template("Qwen3.6-27B").render([{"role": "assistant", "content": "no user turn"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% if %}")


@pytest.mark.parametrize("model", ["Qwen3.5-0.8B", "Qwen3.6-27B", "Qwen3.8-27B"])
def test_matches_transformers_apply_chat_template(model):
    jinja_env = pytest.importorskip("transformers.utils.chat_template_utils")
    source = (FIXTURES / model / "chat_template.jinja").read_text()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ça va? 你好"}],
        [{"role": "user", "content": "weather in Paris?"},
         {"role": "assistant", "content": "", "reasoning_content": "need the tool",
          "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris", "days": 2}}}]},
         {"role": "tool", "content": "sunny"},
         {"role": "user", "content": "thanks"}],
    ]
    ours = ChatTemplate(source)
    for messages in conversations:
        for thinking in (True, False):
            expected = jinja_env.render_jinja_template(
                conversations=[messages], tools=tools, chat_template=source, add_generation_prompt=True,
                enable_thinking=thinking)[0][0]
            assert ours.render(messages, tools=tools, enable_thinking=thinking) == expected


def test_namespace_refuses_underscore_attributes():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns._x }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(x=1) %}{% set ns._y = 2 %}").render([])
    assert ChatTemplate("{% set ns = namespace(x=1) %}{% set ns.x = ns.x + 1 %}{{ ns.x }}").render([]) == "2"


def test_null_message_fields_are_left_out_like_transformers_does():
    t = ChatTemplate("{% for m in messages %}{{ m.name if m.name is defined else 'anonymous' }}{% endfor %}")
    assert t.render([{"role": "user", "content": "x", "name": None}]) == "anonymous"


def test_tojson_keeps_non_ascii_text_and_takes_json_dumps_options():
    t = ChatTemplate("{{ v | tojson }}|{{ v | tojson(separators=(',', ':'), sort_keys=true) }}")
    assert t.render([], v={"b": "é<&>", "a": [1, None]}) == '{"b": "é<&>", "a": [1, null]}|{"a":[1,null],"b":"é<&>"}'
