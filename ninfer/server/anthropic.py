"""POST /v1/messages and /v1/messages/count_tokens: Anthropic Messages over the shared generation path.

Lowering to the chat form the prompt builder reads: the top-level `system` becomes the leading system message;
`system` messages inside `messages` stay where they are; a user message's tool_result blocks become tool messages
ahead of its remaining content; an assistant message's thinking blocks become its reasoning and its tool_use blocks
its tool calls (redacted thinking is dropped). Image blocks (tool results' included) become `image_url` parts: a
base64 source as a data: URL, a url source as its URL; they are prepared and expanded with the rest of the prompt,
so count_tokens counts the expanded image tokens. Tools become chat-form function definitions.

A stream is message_start, then content blocks in output order - thinking (thinking_delta, then a signature_delta
before its stop), text (text_delta), tool_use (one input_json_delta with the complete arguments) - each with its
own stable index, then message_delta (stop reason, final usage) and message_stop. A generation with no output
still has one empty text block, as the non-streamed message does. Every event's SSE name is its JSON `type`.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

from ninfer.engine.request import PreparedPrompt, RequestOptions
from ninfer.engine.sampler import SamplingOverrides
from ninfer.frontend.prompt import PromptOptions
from ninfer.frontend.tool_calls import TextDelta, ToolCall, ToolCallArgumentsDelta, ToolCallDone, ToolCallStarted
from ninfer.media.prepare import PreparedMedia
from ninfer.protocol import anthropic as wire
from ninfer.protocol.anthropic import CONVERTER, CountTokensRequest, MessagesRequest
from ninfer.protocol.common import to_json
from ninfer.server.context import HttpRequest, JsonResponse, Response, Route, ServerContext, SseEvent, StreamResponse
from ninfer.server.generation import (Completed, Finish, Generation, GenerationUsage, Output, ReasoningDelta,
                                      build_media_prompt, parse_body, require_vision, resolve_prompt_options,
                                      start_generation)

STOP_REASONS = {Finish.STOP: "end_turn", Finish.STOP_SEQUENCE: "stop_sequence", Finish.LENGTH: "max_tokens",
                Finish.TOOL_CALLS: "tool_use"}
MAX_TOOL_NAME_LENGTH = 128
EMPTY_THINKING = wire.ThinkingBlock(thinking="", signature="")
EMPTY_TEXT = wire.TextBlock(text="")


def new_tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def thinking_signature(thinking: str) -> str:
    """What a thinking block's signature holds (see wire.ThinkingBlock)."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


# --- lowering --------------------------------------------------------------------------------------------------------


def _parts(blocks: tuple[wire.TextBlock | wire.ImageBlock, ...]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": b.text} if isinstance(b, wire.TextBlock)
            else {"type": "image_url", "image_url": {"url": _image_url(b.source)}} for b in blocks]


def _image_url(source: wire.ImageSource) -> str:
    """An image block's source as the URL media acquisition reads: base64 data as a data: URL."""
    if isinstance(source, wire.Base64Source):
        return f"data:{source.media_type};base64,{source.data}"
    return source.url


def _blocks(content: str | tuple[Any, ...]) -> tuple[Any, ...]:
    return (wire.TextBlock(text=content),) if isinstance(content, str) else content


def _tool_result(block: wire.ToolResultBlock) -> dict[str, Any]:
    parts = _parts(_blocks(block.content or ""))
    if block.is_error:  # the template has no error flag: the result says it
        parts.insert(0, {"type": "text", "text": "Error:"})
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": parts}


def _lower_message(message: wire.InputMessage) -> list[dict[str, Any]]:
    blocks = _blocks(message.content)
    if message.role == "assistant":
        reasoning = "\n".join(b.thinking for b in blocks if isinstance(b, wire.ThinkingBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if isinstance(b, wire.ToolUseBlock)]
        return [{"role": "assistant", "content": _parts(tuple(b for b in blocks if isinstance(b, wire.TextBlock))),
                 "reasoning_content": reasoning or None, "tool_calls": calls or None}]
    results = [b for b in blocks if isinstance(b, wire.ToolResultBlock)]
    rest = tuple(b for b in blocks if not isinstance(b, wire.ToolResultBlock))
    lowered = [_tool_result(b) for b in results]
    if rest or not results:
        lowered.append({"role": message.role, "content": _parts(rest)})
    return lowered


def _media_params(body: CountTokensRequest) -> list[str]:
    """Where the request has images (tool results included), as error params."""
    params = []
    for i, message in enumerate(body.messages):
        for j, block in enumerate(_blocks(message.content)):
            inner = _blocks(block.content or "") if isinstance(block, wire.ToolResultBlock) else (block,)
            if any(isinstance(b, wire.ImageBlock) for b in inner):
                params.append(f"messages[{i}].content[{j}]")
    return params


def _tool(tool: wire.Tool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _options(ctx: ServerContext, body: CountTokensRequest) -> PromptOptions:
    return resolve_prompt_options(
        ctx, reasoning_effort=body.output_config and body.output_config.effort, enable_thinking=body.enable_thinking,
        preserve_thinking=body.preserve_thinking, effort_param="output_config.effort", thinking_param="thinking.type")


async def _prepare(ctx: ServerContext, body: CountTokensRequest, media: list[str], tools: list[dict[str, Any]],
                   options: PromptOptions | None = None) -> tuple[PreparedPrompt, PreparedMedia | None]:
    if media:
        require_vision(ctx, media[0])
    if options is None:
        options = _options(ctx, body)
    messages = [{"role": "system", "content": _parts(_blocks(body.system))}] if body.system else []
    for message in body.messages:
        messages += _lower_message(message)
    return await build_media_prompt(ctx, messages, options, tools=tools)


# --- handlers --------------------------------------------------------------------------------------------------------


async def count_tokens(ctx: ServerContext, request: HttpRequest) -> Response:
    body = parse_body(request, CONVERTER, CountTokensRequest)
    tools = [_tool(tool) for tool in body.rendered_tools]
    prompt, prepared = await _prepare(ctx, body, _media_params(body), tools)
    if prepared is not None:  # counted: the media are not needed any more
        prepared.release()
    return JsonResponse(CONVERTER.unstructure(wire.TokenCount(input_tokens=len(prompt))))


async def create_message(ctx: ServerContext, request: HttpRequest) -> Response:
    body = parse_body(request, CONVERTER, MessagesRequest)
    media = _media_params(body)
    tools = [_tool(tool) for tool in body.rendered_tools]
    options = _options(ctx, body)  # serving.md: an effort the template does not expose fails before preparation
    ctx.begin_preparation(api="messages", shape={"stream": bool(body.stream), "messages": len(body.messages),
                                                 "tools": len(tools), "media_items": len(media)})
    prompt, prepared = await _prepare(ctx, body, media, tools, options)
    sampling = SamplingOverrides(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    generation = await start_generation(ctx, prompt, RequestOptions(max_tokens=body.max_tokens, sampling=sampling),
                                        api="messages", stop_strings=body.stop_strings, tools=tools,
                                        max_tool_name_length=MAX_TOOL_NAME_LENGTH, new_tool_call_id=new_tool_use_id,
                                        media=prepared)
    message_id = f"msg_{secrets.token_hex(12)}"
    if body.stream:
        return StreamResponse(_events(generation, message_id, body.model, len(prompt)))
    return JsonResponse(CONVERTER.unstructure(_message(await generation.collect(), message_id, body.model)))


def routes() -> list[Route]:
    return [Route("POST", "/v1/messages", create_message, flavor="anthropic"),
            Route("POST", "/v1/messages/count_tokens", count_tokens, flavor="anthropic")]


# --- the message and its stream --------------------------------------------------------------------------------------


def _usage(usage: GenerationUsage) -> wire.Usage:
    return wire.Usage(input_tokens=usage.prompt_tokens - usage.cached_tokens, output_tokens=usage.completion_tokens,
                      cache_read_input_tokens=usage.cached_tokens)


def _block(segment: ReasoningDelta | TextDelta | ToolCall) -> wire.OutputBlock:
    if isinstance(segment, ReasoningDelta):
        return wire.ThinkingBlock(thinking=segment.text, signature=thinking_signature(segment.text))
    if isinstance(segment, TextDelta):
        return wire.TextBlock(text=segment.text)
    return wire.ToolUseBlock(id=segment.id, name=segment.name, input=segment.arguments)


def _message(output: Output, message_id: str, model: str) -> wire.Message:
    completed = output.completed
    return wire.Message(id=message_id, model=model,
                        content=tuple(_block(s) for s in output.segments) or (EMPTY_TEXT,),
                        stop_reason=STOP_REASONS[completed.finish], stop_sequence=completed.stop_sequence,
                        usage=_usage(completed.usage))


def _event(obj: Any) -> SseEvent:
    return SseEvent(to_json(CONVERTER, obj), obj.type)


class _Blocks:
    """A stream's content blocks: a new one (at the next index) starts whenever the output changes kind."""

    def __init__(self) -> None:
        self.index = -1
        self._open: type | None = None  # the wire class of the open block
        self._thinking: list[str] = []  # the open thinking block's text, for its signature

    def delta(self, empty: wire.OutputBlock, delta: wire.TextDelta | wire.ThinkingDelta) -> list[SseEvent]:
        events = [] if self._open is type(empty) else self.start(empty)
        if isinstance(delta, wire.ThinkingDelta):
            self._thinking.append(delta.thinking)
        return events + [_event(wire.ContentBlockDelta(index=self.index, delta=delta))]

    def start(self, block: wire.OutputBlock) -> list[SseEvent]:
        events = self.stop()
        self.index += 1
        self._open = type(block)
        return events + [_event(wire.ContentBlockStart(index=self.index, content_block=block))]

    def stop(self) -> list[SseEvent]:
        if self._open is None:
            return []
        events = []
        if self._open is wire.ThinkingBlock:
            signature = wire.SignatureDelta(signature=thinking_signature("".join(self._thinking)))
            events.append(_event(wire.ContentBlockDelta(index=self.index, delta=signature)))
            self._thinking = []
        self._open = None
        return events + [_event(wire.ContentBlockStop(index=self.index))]


async def _events(generation: Generation, message_id: str, model: str, prompt_tokens: int) -> AsyncIterator[SseEvent]:
    # Before the engine reports the reused prefix, the whole prompt counts as input; message_delta's cumulative
    # usage carries the final split.
    start = wire.Usage(input_tokens=prompt_tokens, output_tokens=0, cache_read_input_tokens=0)
    blocks = _Blocks()
    try:
        yield _event(wire.MessageStart(message=wire.Message(id=message_id, model=model, content=(), stop_reason=None,
                                                            stop_sequence=None, usage=start)))
        async for item in generation.events():
            match item:
                case ReasoningDelta(text=text):
                    events = blocks.delta(EMPTY_THINKING, wire.ThinkingDelta(thinking=text))
                case TextDelta(text=text):
                    events = blocks.delta(EMPTY_TEXT, wire.TextDelta(text=text))
                case ToolCallStarted(id=call_id, name=name):
                    events = blocks.start(wire.ToolUseBlock(id=call_id, name=name, input={}))
                case ToolCallArgumentsDelta(delta=arguments):
                    events = [_event(wire.ContentBlockDelta(index=blocks.index,
                                                            delta=wire.InputJsonDelta(partial_json=arguments)))]
                case ToolCallDone():
                    events = blocks.stop()
                case Completed():
                    events = blocks.stop()
                    if blocks.index < 0:
                        events += blocks.start(EMPTY_TEXT) + blocks.stop()
                    stop = wire.StopInfo(stop_reason=STOP_REASONS[item.finish], stop_sequence=item.stop_sequence)
                    events += [_event(wire.MessageDelta(delta=stop, usage=_usage(item.usage))),
                               _event(wire.MessageStop())]
            for event in events:
                yield event
    finally:  # also when the client leaves mid-stream: the engine request is cancelled
        await generation.aclose()
