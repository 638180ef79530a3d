"""Anthropic Messages wire objects: the request (count_tokens' and the full one), the message, the stream events
(serving.md "Anthropic Messages", ninfer-facts §8.2).

Extensions beyond Anthropic's schema: `role: "system"` messages inside `messages` (kept at their position; see
`CountTokensRequest`), and the top-level `preserve_thinking`. Accepted but without effect: `cache_control` (prefix
reuse is automatic), `thinking.budget_tokens` (thinking ends when the model closes it; `max_tokens` bounds the whole
output), `metadata.user_id`. Recognized features this server does not implement are refused with a code naming
the feature.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import attrs

from ninfer.protocol.common import (AtLeast, InRange, Matches, NonEmpty, RequestError, SupportedOnly, make_converter,
                                    register_tagged_union)

TOOL_NAME = Matches(re.compile(r"[A-Za-z0-9_-]{1,128}"), "a tool name (1 to 128 of A-Z, a-z, 0-9, _ and -)")

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
Effort = Literal["low", "medium", "high", "xhigh", "max"]


# --- content blocks --------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CacheControl:
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


@attrs.frozen(kw_only=True)
class TextBlock:
    type: Literal["text"] = "text"
    text: str
    cache_control: CacheControl | None = None
    citations: Any = attrs.field(default=None, validator=SupportedOnly("citations_not_supported"))


def _image_media_type(_: Any, attribute: attrs.Attribute, value: str) -> None:
    if not value.lower().startswith("image/"):
        raise RequestError(f"{value!r} is not an image media type", code="invalid_media", param=attribute.name)


@attrs.frozen(kw_only=True)
class Base64Source:
    """Base64 image bytes; prepared as the data: URL `data:{media_type};base64,{data}`."""

    type: Literal["base64"]
    media_type: str = attrs.field(validator=_image_media_type)
    data: str


@attrs.frozen(kw_only=True)
class UrlSource:
    type: Literal["url"]
    url: str


ImageSource = Base64Source | UrlSource


@attrs.frozen(kw_only=True)
class ImageBlock:
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


ToolResultPart = TextBlock | ImageBlock


@attrs.frozen(kw_only=True)
class ToolResultBlock:
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | tuple[ToolResultPart, ...] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


@attrs.frozen(kw_only=True)
class ThinkingBlock:
    """Reasoning. ninfer's signature is the SHA-256 (hex) of the thinking text, so clients that keep only signed
    thinking blocks keep these; ninfer does not check signatures it is sent back."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


@attrs.frozen(kw_only=True)
class RedactedThinkingBlock:
    type: Literal["redacted_thinking"]
    data: str  # another model's encrypted reasoning: dropped from the prompt


@attrs.frozen(kw_only=True)
class ToolUseBlock:
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ContentBlock = TextBlock | ImageBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock
OutputBlock = ThinkingBlock | TextBlock | ToolUseBlock

_ROLE_BLOCKS = {"user": (TextBlock, ImageBlock, ToolResultBlock),
                "assistant": (TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock),
                "system": (TextBlock,)}


@attrs.frozen(kw_only=True)
class InputMessage:
    role: Literal["user", "assistant", "system"]
    content: str | tuple[ContentBlock, ...]

    def __attrs_post_init__(self) -> None:
        for j, block in enumerate(() if isinstance(self.content, str) else self.content):
            if not isinstance(block, _ROLE_BLOCKS[self.role]):
                raise RequestError(f"a {self.role} message cannot hold a {block.type} block",
                                   param=f"content[{j}].type")


# --- tools and options -----------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Tool:
    """A client tool. Anthropic's server tools (web search, code execution, ...) are refused: tools_not_supported."""

    type: Literal["custom"] | None = None
    name: str = attrs.field(validator=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]  # JSON Schema, rendered into the prompt; never enforced
    cache_control: CacheControl | None = None


@attrs.frozen(kw_only=True)
class ToolChoice:
    type: Literal["auto", "any", "none", "tool"]
    name: str | None = None  # with type "tool"
    disable_parallel_tool_use: bool | None = attrs.field(
        default=None, validator=SupportedOnly("parallel_tool_calls_not_supported", False))

    def __attrs_post_init__(self) -> None:
        if (self.type == "tool") != (self.name is not None):
            raise RequestError("a name goes with type \"tool\", and only with it", param="name")


@attrs.frozen(kw_only=True)
class ThinkingConfig:
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = attrs.field(default=None, validator=AtLeast(1))


@attrs.frozen(kw_only=True)
class OutputConfig:
    effort: Effort | None = None
    format: Any = attrs.field(default=None, validator=SupportedOnly("output_format_not_supported"))


@attrs.frozen(kw_only=True)
class Metadata:
    user_id: str | None = None


# --- requests --------------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CountTokensRequest:
    """Everything that decides the prompt; POST /v1/messages/count_tokens takes exactly this.

    A `system` message inside `messages` stays at its position (serving.md): it must follow a user (or tool-result)
    message and be the last message or come right before an assistant one, so it never splits a tool use from its
    result. The last message must not be the assistant's: continuing a partial answer (Anthropic's prefill) is not
    supported, since the prompt always opens a new assistant turn."""

    model: str  # a label: echoed, never checked against the loaded model
    messages: tuple[InputMessage, ...] = attrs.field(validator=NonEmpty())
    system: str | tuple[TextBlock, ...] | None = None
    tools: tuple[Tool, ...] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    preserve_thinking: bool | None = None
    mcp_servers: Any = attrs.field(default=None, validator=SupportedOnly("mcp_servers_not_supported"))
    context_management: Any = attrs.field(default=None,
                                          validator=SupportedOnly("context_management_not_supported"))

    def __attrs_post_init__(self) -> None:
        roles = [message.role for message in self.messages]
        for i, role in enumerate(roles):
            if role != "system":
                continue
            before = next((r for r in reversed(roles[:i]) if r != "system"), None)
            after = next((r for r in roles[i + 1:] if r != "system"), None)
            if before != "user" or after not in (None, "assistant"):
                raise RequestError("a system message must follow a user message and be last or precede an "
                                   "assistant message", param=f"messages[{i}]")
        if roles[-1] == "assistant":
            raise RequestError("continuing a final assistant message (prefill) is not supported",
                               code="assistant_prefill_not_supported", param=f"messages[{len(roles) - 1}]")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in self.tools or ()}:
            raise RequestError(f"names {choice.name!r}, which is not among the request's tools",
                               param="tool_choice.name")

    @property
    def rendered_tools(self) -> tuple[Tool, ...]:
        """The tools the prompt offers: none for tool_choice "none", only the named one for "tool". "any" is
        rendered like "auto": nothing forces the model to call (no constrained decoding)."""
        choice = self.tool_choice
        if choice is not None and choice.type == "none":
            return ()
        if choice is not None and choice.type == "tool":
            return tuple(tool for tool in self.tools or () if tool.name == choice.name)
        return self.tools or ()

    @property
    def enable_thinking(self) -> bool | None:
        """thinking.type "disabled" turns thinking off, any other type on; absent, the server default holds."""
        return None if self.thinking is None else self.thinking.type != "disabled"


@attrs.frozen(kw_only=True)
class MessagesRequest(CountTokensRequest):
    max_tokens: int | None = attrs.field(default=None, validator=AtLeast(1))  # absent: --default-max-tokens
    stream: bool | None = None
    stop_sequences: tuple[str, ...] | None = None
    temperature: float | None = attrs.field(default=None, validator=InRange(0.0, 1.0))
    top_p: float | None = attrs.field(default=None, validator=InRange(0.0, 1.0))
    top_k: int | None = attrs.field(default=None, validator=AtLeast(0))
    metadata: Metadata | None = None
    service_tier: str | None = attrs.field(
        default=None, validator=SupportedOnly("service_tier_not_supported", "auto", "standard_only"))
    container: Any = attrs.field(default=None, validator=SupportedOnly("container_not_supported"))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.stop_sequences or () if s)


# --- the message -----------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Usage:
    """Anthropic's split: input_tokens are the prompt tokens computed for this request, cache_read_input_tokens
    the resident prefix the engine reused; their sum is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int


@attrs.frozen(kw_only=True)
class Message:
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: tuple[OutputBlock, ...]
    stop_reason: StopReason | None  # null only in message_start
    stop_sequence: str | None
    usage: Usage


@attrs.frozen(kw_only=True)
class TokenCount:
    input_tokens: int


# --- stream events ---------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class MessageStart:
    type: Literal["message_start"] = "message_start"
    message: Message


@attrs.frozen(kw_only=True)
class ContentBlockStart:
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock  # empty: "" text or thinking (and signature), {} input


@attrs.frozen(kw_only=True)
class TextDelta:
    type: Literal["text_delta"] = "text_delta"
    text: str


@attrs.frozen(kw_only=True)
class ThinkingDelta:
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


@attrs.frozen(kw_only=True)
class SignatureDelta:
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


@attrs.frozen(kw_only=True)
class InputJsonDelta:
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


BlockDelta = TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


@attrs.frozen(kw_only=True)
class ContentBlockDelta:
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: BlockDelta


@attrs.frozen(kw_only=True)
class ContentBlockStop:
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


@attrs.frozen(kw_only=True)
class StopInfo:
    stop_reason: StopReason
    stop_sequence: str | None


@attrs.frozen(kw_only=True)
class MessageDelta:
    type: Literal["message_delta"] = "message_delta"
    delta: StopInfo
    usage: Usage  # cumulative: the message's final usage


@attrs.frozen(kw_only=True)
class MessageStop:
    type: Literal["message_stop"] = "message_stop"


CONVERTER = make_converter()
register_tagged_union(CONVERTER, ContentBlock, {
    "text": TextBlock, "image": ImageBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock, "tool_use": ToolUseBlock}, unknown_code="modality_not_supported")
register_tagged_union(CONVERTER, ToolResultPart, {"text": TextBlock, "image": ImageBlock},
                      unknown_code="modality_not_supported")
register_tagged_union(CONVERTER, TextBlock, {"text": TextBlock}, unknown_code="modality_not_supported")
register_tagged_union(CONVERTER, ImageSource, {"base64": Base64Source, "url": UrlSource},
                      unknown_code="invalid_media")
register_tagged_union(CONVERTER, Tool, {None: Tool, "custom": Tool}, unknown_code="tools_not_supported")
register_tagged_union(CONVERTER, OutputBlock, {"thinking": ThinkingBlock, "text": TextBlock,
                                               "tool_use": ToolUseBlock})
register_tagged_union(CONVERTER, BlockDelta, {"text_delta": TextDelta, "thinking_delta": ThinkingDelta,
                                              "signature_delta": SignatureDelta,
                                              "input_json_delta": InputJsonDelta})
