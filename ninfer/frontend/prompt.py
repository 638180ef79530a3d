"""Prompt assembly: chat messages -> the artifact template's text -> token ids, plus the thinking/effort options.

Messages are the OpenAI Chat form the protocol adapters lower to: roles system, developer, user, assistant and tool;
content a string or ordered parts (`text`, `image_url`/`image`, `video_url`/`video`); assistant `reasoning_content`
(or `reasoning`, as transformers also accepts) and `tool_calls` (arguments a JSON object or its JSON text). Adjacent text parts are joined with "\\n"; each media
part becomes one `{"type": "image"|"video"}` item, which the template turns into its own placeholder. The media
parts' sources (`image_url`/`video_url` as a string or `{"url": ...}`, or the `image`/`video` member) are kept, in
prompt order, as the Prompt's `media`; `ninfer.frontend.media` expands the placeholders once they are prepared.

System-class messages (serving.md): `developer` is a system message. A leading one is the template's system message,
so the template composes it with its tool and reasoning-effort instructions. Later ones stay at their positions as
`<|im_start|>system\\n...<|im_end|>\\n` blocks, which the official templates refuse to render. They are placed by
rendering the conversation with an assistant-turn marker in each slot (assistants neither count as queries nor
group with tool results, so the template's logic over the other turns is unchanged), swapping each marker's turn
for the system block, and checking that what remains is exactly the template's rendering without them.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import attrs

from ninfer.frontend.capabilities import PromptCapabilities, detect_capabilities
from ninfer.frontend.chat import ChatTemplate, ChatTemplateError, opens_thinking
from ninfer.frontend.tokenizer import Tokenizer

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TEXT_PART_SEPARATOR = "\n"
EFFORT_NONE = "none"  # the protocols' "no reasoning": thinking off, not an effort level
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>\n"
_IMAGE_PARTS = frozenset({"image_url", "image"})
_VIDEO_PARTS = frozenset({"video_url", "video"})


class PromptError(ValueError):
    """A request the prompt cannot be prepared from (HTTP 400); `code` and `param` go into the error body."""

    code = "invalid_value"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownRoleError(PromptError):
    pass


class ContentPartError(PromptError):
    """Content that is neither a string nor a list of text/image/video parts."""


class SystemMediaError(PromptError):
    pass


class ToolCallError(PromptError):
    """A tool call without a name, or whose arguments are not a JSON object."""


class SystemPlacementError(PromptError):
    """A system message the template's turn structure has no boundary for (inside a run of tool results)."""


class TemplateRejectedError(PromptError):
    """The chat template itself refused the conversation (e.g. no user query)."""


class ReasoningEffortNotSupportedError(PromptError):
    code = "reasoning_effort_not_supported"


class ConflictingTemplateOptionError(PromptError):
    code = "conflicting_template_option"


@attrs.frozen
class PromptOptions:
    thinking: bool = True
    preserve_thinking: bool = False
    reasoning_effort: str | None = None  # a level the template exposes; None when it has none or thinking is off


@attrs.frozen
class MediaSource:
    """One image or video part of the conversation, in the order the template renders them."""

    modality: str  # "image" | "video"
    url: str | None  # HTTP(S) or data: URL; None when the part gave none (a template-only `{"type": "image"}`)
    param: str  # where the part is in the request, e.g. messages[0].content[1]


@attrs.frozen
class Prompt:
    text: str
    ids: tuple[int, ...]  # with one <|image_pad|> / <|video_pad|> per media item (not yet expanded)
    thinking: bool  # the prompt ends inside an open <think>: generation starts in the reasoning channel
    media: tuple[MediaSource, ...] = ()  # the media parts, in prompt order


def resolve_options(
    capabilities: PromptCapabilities,
    *,
    reasoning_effort: str | None = None,
    enable_thinking: bool | None = None,
    preserve_thinking: bool | None = None,
    default_thinking: bool = True,
    default_preserve_thinking: bool = False,
    effort_param: str = "reasoning_effort",
    thinking_param: str = "enable_thinking",
) -> PromptOptions:
    """The request's template options against the loaded template, before any prompt is prepared (serving.md).

    `reasoning_effort` "none" turns thinking off; another value must be a level the template exposes and implies
    thinking on; contradicting `enable_thinking` is an error. `*_param` name the request fields in the errors
    (e.g. "reasoning.effort", "output_config.effort", "thinking.type").
    """
    preserve = default_preserve_thinking if preserve_thinking is None else preserve_thinking
    if reasoning_effort is None:
        thinking = default_thinking if enable_thinking is None else enable_thinking
        return PromptOptions(thinking, preserve, capabilities.default_effort if thinking else None)
    if reasoning_effort == EFFORT_NONE:
        if enable_thinking:
            raise ConflictingTemplateOptionError(
                f"{effort_param} {EFFORT_NONE!r} disables thinking but {thinking_param} enables it", param=effort_param)
        return PromptOptions(False, preserve, None)
    if reasoning_effort not in capabilities.effort_levels:
        exposed = ", ".join(capabilities.effort_levels) or "no effort levels"
        raise ReasoningEffortNotSupportedError(
            f"reasoning effort {reasoning_effort!r} is not supported by the loaded chat template "
            f"(it exposes {exposed})", param=effort_param)
    if enable_thinking is False:
        raise ConflictingTemplateOptionError(
            f"{effort_param} {reasoning_effort!r} needs thinking but {thinking_param} disables it", param=effort_param)
    return PromptOptions(True, preserve, reasoning_effort)


class PromptBuilder:
    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.capabilities = detect_capabilities(template)

    @classmethod
    def from_artifact(cls, artifact) -> "PromptBuilder":
        return cls(ChatTemplate.from_artifact(artifact), Tokenizer.from_artifact(artifact))

    def build(self, messages: list[dict[str, Any]], options: PromptOptions = PromptOptions(), *,
              tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> Prompt:
        media: list[MediaSource] = []
        text = self.render(messages, options, tools=tools, add_generation_prompt=add_generation_prompt,
                           media=media)
        return Prompt(text, tuple(self.tokenizer.encode(text)), opens_thinking(text), tuple(media))

    def render(self, messages: list[dict[str, Any]], options: PromptOptions = PromptOptions(), *,
               tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
               media: list[MediaSource] | None = None) -> str:
        """The template's text for `messages`; `media` (when given) receives the media parts in prompt order."""
        found: list[MediaSource] = []
        lowered = [_lower_message(message, f"messages[{i}]", found) for i, message in enumerate(messages)]
        if media is not None:
            media.extend(found)
        variables: dict[str, Any] = {"enable_thinking": options.thinking, "preserve_thinking": options.preserve_thinking}
        if options.reasoning_effort is not None:
            variables["reasoning_effort"] = options.reasoning_effort

        def render_template(conversation: list[dict[str, Any]]) -> str:
            try:
                return self.template.render(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                            **variables)
            except ChatTemplateError as exc:
                raise TemplateRejectedError(str(exc), param="messages") from exc

        later_systems = [i for i, message in enumerate(lowered) if i > 0 and message["role"] == "system"]
        if not later_systems:
            return render_template(lowered)
        _check_system_positions(lowered, later_systems)
        nonce = secrets.token_hex(8)  # the slot markers must not occur in any real content
        slots = {i: f"ninfer-system-slot-{nonce}-{i}" for i in later_systems}
        plain = render_template([m for i, m in enumerate(lowered) if i not in slots])
        marked = render_template([{"role": "assistant", "content": slots[i]} if i in slots else m
                                  for i, m in enumerate(lowered)])
        blocks = [(slots[i], f"{TURN_START}system\n{lowered[i]['content'].strip()}{TURN_END}") for i in later_systems]
        return _splice_system_blocks(marked, plain, blocks)


def _lower_message(message: Any, param: str, media: list[MediaSource]) -> dict[str, Any]:
    """One message in the form the template reads; `developer` becomes `system`."""
    if not isinstance(message, dict):
        raise PromptError("a message must be an object", param=param)
    role = message.get("role")
    if role not in ROLES:
        raise UnknownRoleError(f"unknown role {role!r} (expected one of {', '.join(sorted(ROLES))})",
                               param=f"{param}.role")
    role = "system" if role == "developer" else role
    lowered: dict[str, Any] = {"role": role,
                               "content": _lower_content(message.get("content"), f"{param}.content", role, media)}
    if role == "assistant":
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ContentPartError("reasoning_content must be a string", param=f"{param}.reasoning_content")
            lowered["reasoning_content"] = reasoning
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ToolCallError("tool_calls must be an array", param=f"{param}.tool_calls")
        if calls:
            lowered["tool_calls"] = [_lower_tool_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(calls)]
    return lowered


def _lower_content(content: Any, param: str, role: str, media: list[MediaSource]) -> str | list[dict[str, str]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ContentPartError("content must be a string or an array of parts", param=param)
    items: list[dict[str, str]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ContentPartError("a text part needs a string text", param=f"{param}[{j}].text")
            if items and items[-1]["type"] == "text":
                items[-1]["text"] += TEXT_PART_SEPARATOR + text
            else:
                items.append({"type": "text", "text": text})
        elif kind in _IMAGE_PARTS or kind in _VIDEO_PARTS:
            if role == "system":
                raise SystemMediaError("system and developer messages cannot contain images or videos",
                                       param=f"{param}[{j}]")
            modality = "image" if kind in _IMAGE_PARTS else "video"
            items.append({"type": modality})
            media.append(MediaSource(modality, _media_url(part.get(kind)), f"{param}[{j}]"))
        else:
            raise ContentPartError(f"unsupported content part type {kind!r}", param=f"{param}[{j}].type")
    if all(item["type"] == "text" for item in items):
        return "".join(item["text"] for item in items)  # at most one item: adjacent texts were joined
    return items


def _media_url(source: Any) -> str | None:
    """A media part's URL: the member itself (a string) or its `url`."""
    if isinstance(source, dict):
        source = source.get("url")
    return source if isinstance(source, str) else None


def _lower_tool_call(call: Any, param: str) -> dict[str, Any]:
    # OpenAI nests name and arguments under "function"; the templates also accept them at the top level.
    function = call.get("function", call) if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ToolCallError("a tool call needs a function name", param=f"{param}.function.name")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"tool call arguments are not valid JSON ({exc})",
                                param=f"{param}.function.arguments") from exc
    if not isinstance(arguments, dict):
        raise ToolCallError("tool call arguments must be a JSON object", param=f"{param}.function.arguments")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _check_system_positions(messages: list[dict[str, Any]], later_systems: list[int]) -> None:
    """Tool results in a row form one user turn: a system message between two of them has no turn boundary."""
    for i in later_systems:
        before = next((m["role"] for m in reversed(messages[:i]) if m["role"] != "system"), None)
        after = next((m["role"] for m in messages[i + 1:] if m["role"] != "system"), None)
        if before == after == "tool":
            raise SystemPlacementError("a system message cannot sit between two tool results",
                                       param=f"messages[{i}]")


def _splice_system_blocks(marked: str, plain: str, blocks: list[tuple[str, str]]) -> str:
    """`marked` with each marker's whole assistant turn replaced by its system block, checked against `plain`."""
    out: list[str] = []
    kept: list[str] = []
    cursor = 0
    for marker, block in blocks:
        at = marked.find(marker, cursor)
        start = marked.rfind(TURN_START, cursor, at)
        end = at + len(marker)
        if at < 0 or start < 0 or not marked.startswith(TURN_END, end):
            raise SystemPlacementError("the chat template has no ChatML turn boundary for a system message",
                                       param="messages")
        out += [marked[cursor:start], block]
        kept.append(marked[cursor:start])
        cursor = end + len(TURN_END)
    out.append(marked[cursor:])
    kept.append(marked[cursor:])
    if "".join(kept) != plain:
        raise SystemPlacementError("the chat template renders the other turns differently around a system message",
                                   param="messages")
    return "".join(out)
