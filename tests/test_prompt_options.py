"""Thinking, reasoning effort and preserve_thinking resolved against the loaded template (serving.md)."""

from pathlib import Path

import pytest

from ninfer.frontend.capabilities import detect_capabilities
from ninfer.frontend.chat import ChatTemplate
from ninfer.frontend.prompt import (ConflictingTemplateOptionError, PromptOptions,
                                    ReasoningEffortNotSupportedError, resolve_options)

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
QWEN36 = detect_capabilities(ChatTemplate((FIXTURES / "Qwen3.6-27B" / "chat_template.jinja").read_text()))
QWEN38 = detect_capabilities(ChatTemplate((FIXTURES / "Qwen3.8-27B" / "chat_template.jinja").read_text()))


def test_defaults_follow_the_server_and_the_templates_default_effort():
    assert resolve_options(QWEN38) == PromptOptions(thinking=True, preserve_thinking=False, reasoning_effort="xhigh")
    assert resolve_options(QWEN38, default_thinking=False) == PromptOptions(False, False, None)
    assert resolve_options(QWEN36) == PromptOptions(True, False, None)
    assert resolve_options(QWEN36, default_preserve_thinking=True) == PromptOptions(True, True, None)
    assert resolve_options(QWEN36, preserve_thinking=False, default_preserve_thinking=True).preserve_thinking is False


@pytest.mark.parametrize("effort", ["low", "medium", "xhigh"])
def test_exposed_efforts_select_the_level_and_turn_thinking_on(effort):
    assert resolve_options(QWEN38, reasoning_effort=effort) == PromptOptions(True, False, effort)
    assert resolve_options(QWEN38, reasoning_effort=effort, enable_thinking=True).reasoning_effort == effort
    # an explicit effort is a request for thinking even where the server's default is off
    assert resolve_options(QWEN38, reasoning_effort=effort, default_thinking=False).thinking


@pytest.mark.parametrize("caps", [QWEN36, QWEN38])
def test_effort_none_disables_thinking(caps):
    assert resolve_options(caps, reasoning_effort="none") == PromptOptions(False, False, None)
    assert resolve_options(caps, reasoning_effort="none", enable_thinking=False).thinking is False
    assert resolve_options(caps, enable_thinking=False) == PromptOptions(False, False, None)


@pytest.mark.parametrize(("caps", "effort"), [(QWEN38, "minimal"), (QWEN38, "high"), (QWEN38, "max"),
                                              (QWEN38, "ultra"), (QWEN36, "low"), (QWEN36, "xhigh")])
def test_efforts_the_template_does_not_expose_are_rejected(caps, effort):
    with pytest.raises(ReasoningEffortNotSupportedError) as err:
        resolve_options(caps, reasoning_effort=effort)
    assert (err.value.code, err.value.param) == ("reasoning_effort_not_supported", "reasoning_effort")
    assert repr(effort) in str(err.value)


def test_contradictions_are_rejected():
    with pytest.raises(ConflictingTemplateOptionError) as err:
        resolve_options(QWEN38, reasoning_effort="none", enable_thinking=True)
    assert (err.value.code, err.value.param) == ("conflicting_template_option", "reasoning_effort")
    with pytest.raises(ConflictingTemplateOptionError):
        resolve_options(QWEN38, reasoning_effort="low", enable_thinking=False)


def test_errors_name_the_protocols_own_fields():
    # Anthropic: output_config.effort "high" from Claude Code is a clear 400, with thinking disabled or not
    with pytest.raises(ReasoningEffortNotSupportedError) as err:
        resolve_options(QWEN38, reasoning_effort="high", effort_param="output_config.effort")
    assert err.value.param == "output_config.effort"
    with pytest.raises(ConflictingTemplateOptionError) as err:
        resolve_options(QWEN38, reasoning_effort="medium", enable_thinking=False,
                        effort_param="output_config.effort", thinking_param="thinking.type")
    assert err.value.param == "output_config.effort" and "thinking.type" in str(err.value)
