"""OpenAI Chat Completions wire objects: the request, the completion, the stream chunks (serving.md "OpenAI Chat
Completions", ninfer-facts §8.2).

Extensions beyond OpenAI's schema: `top_k`, `enable_thinking`, `preserve_thinking`, `chat_template_kwargs`
(`preserve_thinking`, `enable_thinking`), `video_url` parts, assistant `reasoning_content` / `reasoning`, and both
reasoning spellings on output (clients read either). Recognized OpenAI features this server does not implement are
refused with a code naming the feature; see the `SupportedOnly` fields of ChatCompletionRequest.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import attrs

from ninfer.protocol.common import (AtLeast, CachedTokensDetails, InRange, Matches, NonEmpty, ReasoningTokensDetails,
                                    RequestError, SupportedOnly, make_converter, register_dropping_nulls,
                                    register_tagged_union)

FUNCTION_NAME = Matches(re.compile(r"[A-Za-z0-9_-]{1,64}"), "a function name (1 to 64 of A-Z, a-z, 0-9, _ and -)")
MAX_SEED = 2**64 - 1

FinishReason = Literal["stop", "length", "tool_calls"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


# --- message content -------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TextPart:
    type: Literal["text"]
    text: str


@attrs.frozen(kw_only=True)
class MediaUrl:
    url: str  # HTTP(S) or a data: URL
    # The image is always prepared at the processor's own resolution: only "auto" means that.
    detail: Literal["auto", "low", "high"] | None = attrs.field(
        default=None, validator=SupportedOnly("image_detail_not_supported", "auto"))


@attrs.frozen(kw_only=True)
class VideoUrl:
    url: str  # HTTP(S) or a data: URL


@attrs.frozen(kw_only=True)
class ImageUrlPart:
    type: Literal["image_url"]
    image_url: str | MediaUrl  # the bare string is an extension (OpenAI nests it in an object)


@attrs.frozen(kw_only=True)
class VideoUrlPart:
    """NInfer's extension: a video as an HTTP(S) or data: URL."""

    type: Literal["video_url"]
    video_url: str | VideoUrl


UserContentPart = TextPart | ImageUrlPart | VideoUrlPart
MEDIA_PARTS = (ImageUrlPart, VideoUrlPart)


# --- messages --------------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SystemMessage:
    role: Literal["system"]
    content: str | tuple[TextPart, ...]
    name: str | None = None  # a participant label; the template has no place for it


@attrs.frozen(kw_only=True)
class DeveloperMessage:
    role: Literal["developer"]
    content: str | tuple[TextPart, ...]
    name: str | None = None


@attrs.frozen(kw_only=True)
class UserMessage:
    role: Literal["user"]
    content: str | tuple[UserContentPart, ...]
    name: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as text


@attrs.frozen(kw_only=True)
class ToolCall:
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


@attrs.frozen(kw_only=True)
class AssistantMessage:
    role: Literal["assistant"]
    content: str | tuple[TextPart, ...] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the other spelling of reasoning_content
    tool_calls: tuple[ToolCall, ...] | None = None
    name: str | None = None
    refusal: str | None = attrs.field(default=None, validator=SupportedOnly("refusal_not_supported"))
    audio: Any = attrs.field(default=None, validator=SupportedOnly("audio_not_supported"))
    function_call: Any = attrs.field(default=None, validator=SupportedOnly("tools_not_supported"))


@attrs.frozen(kw_only=True)
class ToolMessage:
    role: Literal["tool"]
    content: str | tuple[TextPart, ...]
    tool_call_id: str
    name: str | None = None


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


# --- tools -----------------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FunctionDefinition:
    name: str = attrs.field(validator=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema, rendered into the prompt; never enforced
    # strict:true asks for schema-constrained decoding, which this server does not do.
    strict: bool | None = attrs.field(default=None, validator=SupportedOnly("strict_tools_not_supported", False))


@attrs.frozen(kw_only=True)
class ChatTool:
    type: Literal["function"]
    function: FunctionDefinition


@attrs.frozen(kw_only=True)
class NamedFunction:
    name: str


@attrs.frozen(kw_only=True)
class NamedToolChoice:
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# --- the request -----------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool | None = None


@attrs.frozen(kw_only=True)
class ResponseFormat:
    type: Literal["text"]


@attrs.frozen(kw_only=True)
class ChatTemplateKwargs:
    """The template variables a request may set. Null members are ignored; unknown ones with a value are refused."""

    preserve_thinking: bool | None = None
    enable_thinking: bool | None = None


@attrs.frozen(kw_only=True)
class ChatCompletionRequest:
    model: str
    messages: tuple[ChatMessage, ...] = attrs.field(validator=NonEmpty())
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = attrs.field(default=None, validator=AtLeast(1))
    max_tokens: int | None = attrs.field(default=None, validator=AtLeast(1))  # the legacy spelling
    temperature: float | None = attrs.field(default=None, validator=InRange(0.0, 2.0))
    top_p: float | None = attrs.field(default=None, validator=InRange(0.0, 1.0))
    top_k: int | None = attrs.field(default=None, validator=AtLeast(0))
    presence_penalty: float | None = attrs.field(default=None, validator=InRange(-2.0, 2.0))
    frequency_penalty: float | None = attrs.field(default=None, validator=InRange(-2.0, 2.0))
    seed: int | None = attrs.field(default=None, validator=InRange(0, MAX_SEED))
    stop: str | tuple[str, ...] | None = None
    tools: tuple[ChatTool, ...] | None = None
    tool_choice: ToolChoice | None = None
    reasoning_effort: ReasoningEffort | None = None
    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    response_format: ResponseFormat | None = None
    # Recognized features this server does not implement: refused unless absent or in their "unused" setting.
    n: int | None = attrs.field(default=None, validator=SupportedOnly("n_not_supported", 1))
    logprobs: bool | None = attrs.field(default=None, validator=SupportedOnly("logprobs_not_supported", False))
    top_logprobs: int | None = attrs.field(default=None, validator=SupportedOnly("logprobs_not_supported", 0))
    logit_bias: dict[str, Any] | None = attrs.field(default=None,
                                                     validator=SupportedOnly("logit_bias_not_supported", {}))
    parallel_tool_calls: bool | None = attrs.field(
        default=None, validator=SupportedOnly("parallel_tool_calls_not_supported", True))
    modalities: tuple[str, ...] | None = attrs.field(default=None,
                                                     validator=SupportedOnly("modality_not_supported", ("text",)))
    service_tier: str | None = attrs.field(default=None,
                                           validator=SupportedOnly("service_tier_not_supported", "auto", "default"))
    store: bool | None = attrs.field(default=None, validator=SupportedOnly("store_not_supported", False))
    audio: Any = attrs.field(default=None, validator=SupportedOnly("audio_not_supported"))
    functions: Any = attrs.field(default=None, validator=SupportedOnly("tools_not_supported"))
    function_call: Any = attrs.field(default=None, validator=SupportedOnly("tools_not_supported"))
    prediction: Any = attrs.field(default=None, validator=SupportedOnly("prediction_not_supported"))
    web_search_options: Any = attrs.field(default=None, validator=SupportedOnly("web_search_not_supported"))
    verbosity: Any = attrs.field(default=None, validator=SupportedOnly("verbosity_not_supported"))
    metadata: Any = attrs.field(default=None, validator=SupportedOnly("metadata_not_supported"))
    user: Any = attrs.field(default=None, validator=SupportedOnly("user_not_supported"))
    safety_identifier: Any = attrs.field(default=None, validator=SupportedOnly("safety_identifier_not_supported"))
    prompt_cache_key: Any = attrs.field(default=None, validator=SupportedOnly("prompt_cache_not_supported"))
    prompt_cache_retention: Any = attrs.field(default=None, validator=SupportedOnly("prompt_cache_not_supported"))

    def __attrs_post_init__(self) -> None:
        kwargs = self.chat_template_kwargs or ChatTemplateKwargs()
        for name in ("preserve_thinking", "enable_thinking"):
            top, nested = getattr(self, name), getattr(kwargs, name)
            if top is not None and nested is not None and top != nested:
                raise RequestError(f"contradicts chat_template_kwargs.{name}", code="conflicting_template_option",
                                   param=name)
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {tool.function.name for tool in self.tools or ()}:
                raise RequestError(f"names {name!r}, which is not among the request's tools",
                                   param="tool_choice.function.name")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings; empty ones are dropped (they would match everywhere)."""
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop or ()
        return tuple(s for s in stops if s)

    @property
    def template_enable_thinking(self) -> bool | None:
        return self.enable_thinking if self.enable_thinking is not None else \
            (self.chat_template_kwargs or ChatTemplateKwargs()).enable_thinking

    @property
    def template_preserve_thinking(self) -> bool | None:
        return self.preserve_thinking if self.preserve_thinking is not None else \
            (self.chat_template_kwargs or ChatTemplateKwargs()).preserve_thinking

    @property
    def rendered_tools(self) -> tuple[ChatTool, ...]:
        """The tools the prompt offers: none for tool_choice "none", only the named one for a named choice.
        "required" is rendered like "auto": nothing forces the model to call (no constrained decoding)."""
        if self.tool_choice == "none":
            return ()
        if isinstance(self.tool_choice, NamedToolChoice):
            return tuple(t for t in self.tools or () if t.function.name == self.tool_choice.function.name)
        return self.tools or ()


# --- the completion --------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ChatUsage:
    prompt_tokens: int  # the full prepared prompt, reused prefix included
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokensDetails
    completion_tokens_details: ReasoningTokensDetails


@attrs.frozen(kw_only=True)
class ChatCompletionMessage:
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is only tool calls
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text as reasoning_content
    tool_calls: tuple[ToolCall, ...] | None = None


@attrs.frozen(kw_only=True)
class Choice:
    index: int
    message: ChatCompletionMessage
    finish_reason: FinishReason


@attrs.frozen(kw_only=True)
class ChatCompletion:
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: tuple[Choice, ...]
    usage: ChatUsage


# --- stream chunks ---------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FunctionCallDelta:
    name: str | None = None
    arguments: str | None = None


@attrs.frozen(kw_only=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


@attrs.frozen(kw_only=True)
class ChatDelta:
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] | None = None


@attrs.frozen(kw_only=True)
class ChunkChoice:
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None


@attrs.frozen(kw_only=True)
class ChatCompletionChunk:
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: tuple[ChunkChoice, ...]  # empty in the usage chunk
    usage: ChatUsage | None = None  # only in the usage chunk (stream_options.include_usage)


CONVERTER = make_converter()
register_tagged_union(CONVERTER, ChatMessage, {"system": SystemMessage, "developer": DeveloperMessage,
                                               "user": UserMessage, "assistant": AssistantMessage,
                                               "tool": ToolMessage}, tag="role")
register_tagged_union(CONVERTER, UserContentPart, {"text": TextPart, "image_url": ImageUrlPart,
                                                   "video_url": VideoUrlPart}, unknown_code="modality_not_supported")
register_tagged_union(CONVERTER, TextPart, {"text": TextPart}, unknown_code="modality_not_supported")
register_tagged_union(CONVERTER, ChatTool, {"function": ChatTool}, unknown_code="tools_not_supported")
register_tagged_union(CONVERTER, NamedToolChoice, {"function": NamedToolChoice},
                      unknown_code="tool_choice_not_supported")
register_tagged_union(CONVERTER, ResponseFormat, {"text": ResponseFormat},
                      unknown_code="response_format_not_supported")
register_dropping_nulls(CONVERTER, ChatTemplateKwargs)
