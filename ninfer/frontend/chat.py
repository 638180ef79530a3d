"""Chat rendering: the artifact's own `frontend/chat_template.jinja`, run in a jinja2 sandbox.

The environment mirrors what Hugging Face's `apply_chat_template` gives templates (trim_blocks, lstrip_blocks, the
loop-controls extension, `raise_exception`, a `tojson` that keeps non-ASCII text), so prompts render token for token
as the official template intends.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE = "frontend/chat_template.jinja"
THINK_OPEN = "<think>"


class ChatTemplateError(ValueError):
    """The template rejected the conversation (its own raise_exception) or could not be compiled."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{CHAT_TEMPLATE}: {exc}") from exc
        self.source = source

    @classmethod
    def from_artifact(cls, artifact) -> "ChatTemplate":
        if CHAT_TEMPLATE not in artifact:
            raise ChatTemplateError(f"artifact has no {CHAT_TEMPLATE}")
        return cls(artifact.resource(CHAT_TEMPLATE).decode("utf-8"))

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        **extra: Any,
    ) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                **extra,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


def opens_thinking(prompt: str) -> bool:
    """The prompt ends inside an open `<think>` block, so generation starts in the reasoning channel."""
    return prompt.rstrip("\n").endswith(THINK_OPEN)
