"""OpenAI Responses wire objects: the create request, typed Items, the response object, the stream events and the
resource endpoints' bodies (serving.md "OpenAI Responses Core").

One set of Item classes serves input and output: a client replays the output Items of one response as input Items
of the next (Codex-style clients), so whatever this server writes must structure back unchanged, ids and statuses
included. Recognized OpenAI features this server does not implement are refused with a code naming the feature (the
`SupportedOnly` fields); members OpenAI does not define are `unknown_parameter`.

Extensions beyond OpenAI's schema: `chat_template_kwargs.preserve_thinking`, the top-level `preserve_thinking`
alias, and `input_video` parts.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ninfer.protocol.common import (AtLeast, CachedTokensDetails, InRange, NonEmpty, ReasoningTokensDetails,
                                    RequestError, SupportedOnly, make_converter, register_dropping_nulls,
                                    register_tagged_union)
from ninfer.protocol.openai_chat import FUNCTION_NAME, ReasoningEffort

MIN_OUTPUT_TOKENS = 16
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512

ItemStatus = Literal["in_progress", "completed", "incomplete"]
MessageRole = Literal["user", "assistant", "system", "developer"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]


def _metadata(_: Any, attribute: attrs.Attribute, value: dict[str, str] | None) -> None:
    if value is None:
        return
    if len(value) > METADATA_PAIRS:
        raise RequestError(f"at most {METADATA_PAIRS} pairs, got {len(value)}", param=attribute.name)
    for key, item in value.items():
        if len(key) > METADATA_KEY_CHARS:
            raise RequestError(f"key {key[:16]!r}... is longer than {METADATA_KEY_CHARS} characters",
                               param=attribute.name)
        if len(item) > METADATA_VALUE_CHARS:
            raise RequestError(f"the value of {key!r} is longer than {METADATA_VALUE_CHARS} characters",
                               param=f"{attribute.name}.{key}")


# --- content parts ---------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class InputText:
    text: str
    type: Literal["input_text"] = "input_text"


@attrs.frozen(kw_only=True)
class OutputText:
    """Assistant text: what this server writes, and what a client replays of it."""

    text: str
    annotations: tuple[Any, ...] = attrs.field(default=(), validator=SupportedOnly("annotations_not_supported", ()))
    logprobs: tuple[Any, ...] = attrs.field(default=(), validator=SupportedOnly("logprobs_not_supported", ()))
    type: Literal["output_text"] = "output_text"


@attrs.frozen(kw_only=True)
class InputImage:
    # HTTP(S) or a data: URI. Optional in the schema only so that an image given by file_id (OpenAI file storage)
    # is refused as that, not as a missing image_url.
    image_url: str | None = None
    detail: str | None = attrs.field(default=None, validator=SupportedOnly("image_detail_not_supported", "auto"))
    file_id: Any = attrs.field(default=None, validator=SupportedOnly("image_file_id_not_supported"))
    type: Literal["input_image"] = "input_image"

    def __attrs_post_init__(self) -> None:
        if self.image_url is None:
            raise RequestError("an input_image needs an image_url", code="missing_required_parameter",
                               param="image_url")


@attrs.frozen(kw_only=True)
class InputVideo:
    """NInfer's extension: a video as an HTTP(S) or data: URI."""

    video_url: str
    type: Literal["input_video"] = "input_video"


@attrs.frozen(kw_only=True)
class ReasoningText:
    text: str
    type: Literal["reasoning_text"] = "reasoning_text"


ContentPart = InputText | OutputText | InputImage | InputVideo
MEDIA_PARTS = (InputImage, InputVideo)
_ROLE_PARTS = {"user": (InputText, InputImage, InputVideo), "assistant": (InputText, OutputText),
               "system": (InputText,), "developer": (InputText,)}


# --- items -----------------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Message:
    role: MessageRole
    content: str | tuple[ContentPart, ...]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Any = attrs.field(default=None, validator=SupportedOnly("message_phase_not_supported"))
    type: Literal["message"] = "message"

    def __attrs_post_init__(self) -> None:
        allowed = _ROLE_PARTS[self.role]
        for index, part in enumerate(() if isinstance(self.content, str) else self.content):
            if not isinstance(part, allowed):
                raise RequestError(f"a {self.role} message cannot contain {part.type} parts",
                                   param=f"content[{index}].type")


@attrs.frozen(kw_only=True)
class ReasoningItem:
    """Raw reasoning (the model's thinking text), never a summary: this server has no summarizer."""

    content: tuple[ReasoningText, ...] | None = None
    summary: tuple[Any, ...] = attrs.field(default=(), validator=SupportedOnly("reasoning_summary_not_supported", ()))
    encrypted_content: Any = attrs.field(default=None, validator=SupportedOnly("encrypted_reasoning_not_supported"))
    id: str | None = None
    status: ItemStatus | None = None
    type: Literal["reasoning"] = "reasoning"

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


@attrs.frozen(kw_only=True)
class FunctionCallItem:
    call_id: str  # the client answers with a function_call_output of this call_id
    name: str = attrs.field(validator=FUNCTION_NAME)
    arguments: str  # JSON object text; empty while a streamed call is in progress (input Items are checked)
    id: str | None = None  # the Item's own id (fc_...), distinct from call_id
    status: ItemStatus | None = None
    type: Literal["function_call"] = "function_call"


@attrs.frozen(kw_only=True)
class FunctionCallOutputItem:
    call_id: str
    output: str
    id: str | None = None
    status: ItemStatus | None = None
    type: Literal["function_call_output"] = "function_call_output"


InputItem = Message | ReasoningItem | FunctionCallItem | FunctionCallOutputItem
OutputItem = Message | ReasoningItem | FunctionCallItem


# --- the create request ----------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FunctionTool:
    """A flat Responses function definition (Chat Completions nests the same under `function`)."""

    name: str = attrs.field(validator=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema, rendered into the prompt; never enforced
    # strict:true asks for schema-constrained decoding, which this server does not do.
    strict: bool | None = attrs.field(default=None, validator=SupportedOnly("strict_tools_not_supported", False))
    type: Literal["function"] = "function"


@attrs.frozen(kw_only=True)
class ReasoningConfig:
    effort: ReasoningEffort | None = None
    summary: Any = attrs.field(default=None, validator=SupportedOnly("reasoning_summary_not_supported"))
    generate_summary: Any = attrs.field(default=None, validator=SupportedOnly("reasoning_summary_not_supported"))


@attrs.frozen(kw_only=True)
class TextFormat:
    type: Literal["text"] = "text"


@attrs.frozen(kw_only=True)
class TextConfig:
    format: TextFormat | None = None
    verbosity: Any = attrs.field(default=None, validator=SupportedOnly("verbosity_not_supported"))


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_obfuscation: bool | None = attrs.field(
        default=None, validator=SupportedOnly("stream_obfuscation_not_supported", False))


@attrs.frozen(kw_only=True)
class ChatTemplateKwargs:
    """The template variables a Responses request may set. Null members are ignored; unknown ones with a value are
    refused."""

    preserve_thinking: bool | None = None


@attrs.frozen(kw_only=True)
class CreateResponseRequest:
    model: str = attrs.field(validator=NonEmpty())
    input: str | tuple[InputItem, ...] = attrs.field(validator=NonEmpty())
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = attrs.field(default=None, validator=AtLeast(MIN_OUTPUT_TOKENS))
    stream: bool | None = None
    store: bool | None = None
    temperature: float | None = attrs.field(default=None, validator=InRange(0.0, 2.0))
    top_p: float | None = attrs.field(default=None, validator=InRange(0.0, 1.0))
    metadata: dict[str, str] | None = attrs.field(default=None, validator=_metadata)
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    preserve_thinking: bool | None = None
    text: TextConfig | None = None
    tools: tuple[FunctionTool, ...] | None = None
    tool_choice: str | dict[str, Any] | None = attrs.field(
        default=None, validator=SupportedOnly("tool_choice_not_supported", "auto", "none"))
    stream_options: StreamOptions | None = None
    # Recognized features this server does not implement: refused unless absent or in their "unused" setting.
    parallel_tool_calls: bool | None = attrs.field(
        default=None, validator=SupportedOnly("parallel_tool_calls_not_supported", True))
    truncation: str | None = attrs.field(default=None, validator=SupportedOnly("truncation_not_supported",
                                                                                 "disabled"))
    top_logprobs: int | None = attrs.field(default=None, validator=SupportedOnly("logprobs_not_supported", 0))
    service_tier: str | None = attrs.field(default=None,
                                           validator=SupportedOnly("service_tier_not_supported", "auto", "default"))
    background: bool | None = attrs.field(default=None, validator=SupportedOnly("background_not_supported", False))
    include: tuple[str, ...] | None = attrs.field(default=None, validator=SupportedOnly("include_not_supported", ()))
    conversation: Any = attrs.field(default=None, validator=SupportedOnly("conversations_not_supported"))
    prompt: Any = attrs.field(default=None, validator=SupportedOnly("prompt_templates_not_supported"))
    context_management: Any = attrs.field(default=None,
                                          validator=SupportedOnly("context_management_not_supported"))
    max_tool_calls: Any = attrs.field(default=None, validator=SupportedOnly("max_tool_calls_not_supported"))
    prompt_cache_key: Any = attrs.field(default=None, validator=SupportedOnly("prompt_cache_not_supported"))
    prompt_cache_retention: Any = attrs.field(default=None, validator=SupportedOnly("prompt_cache_not_supported"))
    safety_identifier: Any = attrs.field(default=None, validator=SupportedOnly("safety_identifier_not_supported"))
    user: Any = attrs.field(default=None, validator=SupportedOnly("user_not_supported"))

    def __attrs_post_init__(self) -> None:
        nested = (self.chat_template_kwargs or ChatTemplateKwargs()).preserve_thinking
        if self.preserve_thinking is not None and nested is not None and self.preserve_thinking != nested:
            raise RequestError("contradicts chat_template_kwargs.preserve_thinking",
                               code="conflicting_template_option", param="preserve_thinking")

    @property
    def template_preserve_thinking(self) -> bool | None:
        """The request's own preserve_thinking (either spelling); None: inherit it or use the server default."""
        if self.preserve_thinking is not None:
            return self.preserve_thinking
        return (self.chat_template_kwargs or ChatTemplateKwargs()).preserve_thinking

    @property
    def reasoning_effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    @property
    def rendered_tools(self) -> tuple[FunctionTool, ...]:
        """The tools the prompt offers: none under tool_choice "none"."""
        return () if self.tool_choice == "none" else self.tools or ()


@attrs.frozen(kw_only=True)
class InputTokensRequest:
    """POST /v1/responses/input_tokens: exactly these two members."""

    model: str = attrs.field(validator=NonEmpty())
    input: str | tuple[InputItem, ...] = attrs.field(validator=NonEmpty())


@attrs.frozen(kw_only=True)
class InputItemsQuery:
    """GET /v1/responses/{id}/input_items query parameters (already converted from their query-string text)."""

    after: str | None = None
    limit: int = attrs.field(default=20, validator=InRange(1, 100))
    order: Literal["asc", "desc"] = "desc"


# --- the response object ---------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ResponseUsage:
    input_tokens: int  # the whole prepared prompt: template and expanded media tokens, reused prefix included
    input_tokens_details: CachedTokensDetails
    output_tokens: int  # accepted generated ids, a withheld stop token included
    output_tokens_details: ReasoningTokensDetails
    total_tokens: int


@attrs.frozen(kw_only=True)
class ResponseError:
    code: str
    message: str


@attrs.frozen(kw_only=True)
class IncompleteDetails:
    reason: Literal["max_output_tokens"] = "max_output_tokens"


@attrs.frozen(kw_only=True)
class Response:
    """The response object. Members without a default are always written, null included, as OpenAI writes them."""

    id: str
    created_at: int
    status: ResponseStatus
    model: str
    output: tuple[OutputItem, ...]
    usage: ResponseUsage | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    reasoning: ReasoningConfig
    text: TextConfig
    tools: tuple[FunctionTool, ...]
    tool_choice: str
    store: bool
    parallel_tool_calls: bool = True
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["default"] = "default"
    background: bool = False
    top_logprobs: int = 0
    object: Literal["response"] = "response"


@attrs.frozen(kw_only=True)
class InputTokens:
    input_tokens: int
    object: Literal["response.input_tokens"] = "response.input_tokens"


@attrs.frozen(kw_only=True)
class DeletedResponse:
    id: str
    deleted: bool = True
    object: Literal["response.deleted"] = "response.deleted"


@attrs.frozen(kw_only=True)
class InputItemList:
    data: tuple[InputItem, ...]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


# --- stream events ---------------------------------------------------------------------------------------------------
# Every event carries its `type` (also the SSE event name) and the stream's `sequence_number`, counted from 0.


@attrs.frozen(kw_only=True)
class ResponseCreatedEvent:
    sequence_number: int
    response: Response
    type: Literal["response.created"] = "response.created"


@attrs.frozen(kw_only=True)
class ResponseInProgressEvent:
    sequence_number: int
    response: Response
    type: Literal["response.in_progress"] = "response.in_progress"


@attrs.frozen(kw_only=True)
class ResponseCompletedEvent:
    sequence_number: int
    response: Response
    type: Literal["response.completed"] = "response.completed"


@attrs.frozen(kw_only=True)
class ResponseIncompleteEvent:
    sequence_number: int
    response: Response
    type: Literal["response.incomplete"] = "response.incomplete"


@attrs.frozen(kw_only=True)
class ResponseFailedEvent:
    sequence_number: int
    response: Response
    type: Literal["response.failed"] = "response.failed"


@attrs.frozen(kw_only=True)
class OutputItemAddedEvent:
    sequence_number: int
    output_index: int
    item: OutputItem
    type: Literal["response.output_item.added"] = "response.output_item.added"


@attrs.frozen(kw_only=True)
class OutputItemDoneEvent:
    sequence_number: int
    output_index: int
    item: OutputItem
    type: Literal["response.output_item.done"] = "response.output_item.done"


StreamedPart = OutputText | ReasoningText


@attrs.frozen(kw_only=True)
class ContentPartAddedEvent:
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: StreamedPart
    type: Literal["response.content_part.added"] = "response.content_part.added"


@attrs.frozen(kw_only=True)
class ContentPartDoneEvent:
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: StreamedPart
    type: Literal["response.content_part.done"] = "response.content_part.done"


@attrs.frozen(kw_only=True)
class OutputTextDeltaEvent:
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: tuple[Any, ...] = ()
    type: Literal["response.output_text.delta"] = "response.output_text.delta"


@attrs.frozen(kw_only=True)
class OutputTextDoneEvent:
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: tuple[Any, ...] = ()
    type: Literal["response.output_text.done"] = "response.output_text.done"


@attrs.frozen(kw_only=True)
class ReasoningTextDeltaEvent:
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"


@attrs.frozen(kw_only=True)
class ReasoningTextDoneEvent:
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDeltaEvent:
    sequence_number: int
    item_id: str
    output_index: int
    delta: str
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDoneEvent:
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"


TerminalEvent = ResponseCompletedEvent | ResponseIncompleteEvent | ResponseFailedEvent
StreamEvent = (ResponseCreatedEvent | ResponseInProgressEvent | TerminalEvent | OutputItemAddedEvent
               | OutputItemDoneEvent | ContentPartAddedEvent | ContentPartDoneEvent | OutputTextDeltaEvent
               | OutputTextDoneEvent | ReasoningTextDeltaEvent | ReasoningTextDoneEvent
               | FunctionCallArgumentsDeltaEvent | FunctionCallArgumentsDoneEvent)


def _tags(union: Any) -> dict[Any, type]:
    """Each member class of `union` by its `type` tag (the default of its `type` member)."""
    return {attrs.fields_dict(cls)["type"].default: cls for cls in union.__args__}


CONVERTER = make_converter()
register_tagged_union(CONVERTER, InputItem, {**_tags(InputItem), None: Message},
                      unknown_code="item_type_not_supported")
register_tagged_union(CONVERTER, OutputItem, _tags(OutputItem))
register_tagged_union(CONVERTER, ContentPart, _tags(ContentPart), unknown_code="modality_not_supported")
register_tagged_union(CONVERTER, StreamedPart, _tags(StreamedPart))
register_tagged_union(CONVERTER, ReasoningText, {"reasoning_text": ReasoningText},
                      unknown_code="reasoning_summary_not_supported")
register_tagged_union(CONVERTER, FunctionTool, {"function": FunctionTool}, unknown_code="tools_not_supported")
register_tagged_union(CONVERTER, TextFormat, {"text": TextFormat}, unknown_code="text_format_not_supported")
register_tagged_union(CONVERTER, StreamEvent, _tags(StreamEvent))
register_dropping_nulls(CONVERTER, ChatTemplateKwargs)
