"""Chat rendering: the artifact's own `frontend/chat_template.jinja`, run in a jinja2 sandbox.

The environment mirrors what Hugging Face's `apply_chat_template` gives templates (trim_blocks, lstrip_blocks, the
loop-controls extension, `raise_exception`, a `tojson` that keeps non-ASCII text, namespaces that refuse underscore
names, message keys whose value is None dropped), so prompts render character for character as transformers renders
them from the official template.
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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` without underscore attributes, which could otherwise reach CPython internals from a template."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick, so `self=` works
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _without_none(message: dict[str, Any]) -> dict[str, Any]:
    # APIs send `content: null` or `tool_calls: null`; templates handle a missing key, some print "None" for a null.
    return {key: value for key, value in message.items() if value is not None}


class ChatTemplate:
    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _Namespace
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
        """The template's text for `messages`; `extra` are further template variables (preserve_thinking, ...)."""
        try:
            return self._template.render(
                messages=[_without_none(m) if isinstance(m, dict) else m for m in messages],
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                **extra,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError, ValueError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


def opens_thinking(prompt: str) -> bool:
    """The prompt ends inside an open `<think>` block, so generation starts in the reasoning channel."""
    return prompt.rstrip("\n").endswith(THINK_OPEN)
