"""Prompt capabilities come from what the template renders, not from any name."""

from pathlib import Path

import pytest

from ninfer.frontend.capabilities import PROTOCOL_EFFORTS, PromptCapabilities, detect_capabilities
from ninfer.frontend.chat import ChatTemplate, ChatTemplateError

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
THINKING = "<|im_start|>assistant\n<think>\n"
NON_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def capabilities(model: str) -> PromptCapabilities:
    return detect_capabilities(ChatTemplate((FIXTURES / model / "chat_template.jinja").read_text()))


def test_official_templates():
    assert capabilities("Qwen3.5-0.8B") == PromptCapabilities((), None, False, THINKING, NON_THINKING)
    for model in ("Qwen3.6-27B", "Qwen3.6-35B-A3B"):
        assert capabilities(model) == PromptCapabilities((), None, True, THINKING, NON_THINKING)
    qwen38 = capabilities("Qwen3.8-27B")
    assert qwen38 == PromptCapabilities(("low", "medium", "xhigh"), "xhigh", True, THINKING, NON_THINKING)
    assert qwen38.can_think and qwen38.can_disable_thinking
    assert qwen38.generation_prompt(True) == THINKING and qwen38.generation_prompt(False) == NON_THINKING


def test_the_default_effort_is_read_from_the_template():
    source = (FIXTURES / "Qwen3.8-27B" / "chat_template.jinja").read_text()
    assert source.count("reasoning_effort|default('xhigh')") == 1
    edited = ChatTemplate(source.replace("reasoning_effort|default('xhigh')", "reasoning_effort|default('low')"))
    assert detect_capabilities(edited).default_effort == "low"


@pytest.mark.parametrize(("effort_block", "levels", "default"), [
    # permissive: any value renders, only "high" changes the text
    ("{% if reasoning_effort == 'high' %}Think hard.\n{% endif %}", ("high",), None),
    # every value is printed, with a default
    ("Reasoning: {{ reasoning_effort | default('medium') }}\n", PROTOCOL_EFFORTS, "medium"),
    # validating, no default instruction
    ("{% if reasoning_effort is defined and reasoning_effort not in ('max', 'minimal') %}"
     "{{ raise_exception('bad effort') }}{% endif %}", ("minimal", "max"), None),
])
def test_effort_levels_of_other_template_shapes(effort_block, levels, default):
    caps = detect_capabilities(ChatTemplate(effort_block + CHATML))
    assert (caps.effort_levels, caps.default_effort) == (levels, default)


def test_a_template_without_thinking():
    caps = detect_capabilities(ChatTemplate(CHATML))
    assert caps == PromptCapabilities((), None, False, "<|im_start|>assistant\n", "<|im_start|>assistant\n")
    assert not caps.can_think and not caps.can_disable_thinking


def test_a_template_that_always_thinks_cannot_disable_it():
    caps = detect_capabilities(ChatTemplate(CHATML.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")))
    assert caps.can_think and not caps.can_disable_thinking


def test_a_generation_prompt_that_rewrites_the_conversation_is_refused():
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        detect_capabilities(ChatTemplate("{% if add_generation_prompt %}A{% else %}B{% endif %}"))
