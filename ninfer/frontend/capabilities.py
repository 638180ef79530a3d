"""What the loaded chat template can do, found once at startup by rendering probe conversations through it.

serving.md: capabilities come from the exact `frontend/chat_template.jinja` in the artifact, never from the model id,
the artifact identity or a target profile. So nothing here looks at names; each answer is what the template renders:

- effort levels: the protocol's effort values the template renders differently from an unknown value (or, for a
  template that rejects unknown values, the ones it accepts); its default is the level whose rendering equals the
  rendering without `reasoning_effort`;
- preserve_thinking: whether closed-turn reasoning before the last user query renders differently with it on and off;
- generation prompts: what `add_generation_prompt` appends with thinking on and off.
"""

from __future__ import annotations

from typing import Any

import attrs

from ninfer.frontend.chat import ChatTemplate, ChatTemplateError, opens_thinking

# The effort values of the OpenAI and Anthropic protocols, besides "none" (which means thinking off, not a level).
PROTOCOL_EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")
_UNKNOWN_EFFORT = "ninfer-unknown-effort-probe"

_QUESTION = [{"role": "user", "content": "capability probe"}]
_CLOSED_TURN = [
    {"role": "user", "content": "capability probe"},
    {"role": "assistant", "content": "answer", "reasoning_content": "closed-turn reasoning"},
    {"role": "user", "content": "follow-up"},
]


@attrs.frozen
class PromptCapabilities:
    effort_levels: tuple[str, ...]  # in PROTOCOL_EFFORTS order; empty for a template without reasoning effort
    default_effort: str | None  # the level the template uses when the request names none
    preserve_thinking: bool  # the template keeps or drops closed-turn reasoning as `preserve_thinking` says
    thinking_generation_prompt: str  # appended by add_generation_prompt with enable_thinking true
    non_thinking_generation_prompt: str  # ... with enable_thinking false

    @property
    def can_think(self) -> bool:
        return opens_thinking(self.thinking_generation_prompt)

    @property
    def can_disable_thinking(self) -> bool:
        return self.can_think and not opens_thinking(self.non_thinking_generation_prompt)

    def generation_prompt(self, thinking: bool) -> str:
        return self.thinking_generation_prompt if thinking else self.non_thinking_generation_prompt


def detect_capabilities(template: ChatTemplate) -> PromptCapabilities:
    """Probe `template`; a template that cannot render a one-question conversation raises ChatTemplateError."""
    levels, default = _efforts(template)
    return PromptCapabilities(
        effort_levels=levels,
        default_effort=default,
        preserve_thinking=(template.render(_CLOSED_TURN, preserve_thinking=True)
                           != template.render(_CLOSED_TURN, preserve_thinking=False)),
        thinking_generation_prompt=_generation_prompt(template, thinking=True),
        non_thinking_generation_prompt=_generation_prompt(template, thinking=False),
    )


def _generation_prompt(template: ChatTemplate, *, thinking: bool) -> str:
    without = template.render(_QUESTION, add_generation_prompt=False, enable_thinking=thinking)
    with_prompt = template.render(_QUESTION, add_generation_prompt=True, enable_thinking=thinking)
    if not with_prompt.startswith(without):
        raise ChatTemplateError("add_generation_prompt changes the conversation instead of appending to it")
    return with_prompt[len(without):]


def _efforts(template: ChatTemplate) -> tuple[tuple[str, ...], str | None]:
    def render(**effort: Any) -> str | None:
        try:
            return template.render(_QUESTION, enable_thinking=True, **effort)
        except ChatTemplateError:
            return None

    rendered = {level: render(reasoning_effort=level) for level in PROTOCOL_EFFORTS}
    unknown = render(reasoning_effort=_UNKNOWN_EFFORT)
    # A validating template rejects the unknown value: what it accepts is what it exposes. A permissive one renders
    # an unsupported value like the unknown one (Qwen3.6 ignores the variable altogether).
    levels = tuple(level for level, text in rendered.items() if text is not None and text != unknown)
    omitted = render()
    matches = [level for level in levels if rendered[level] == omitted]
    return levels, matches[0] if len(matches) == 1 else None
