"""POST /v1/chat/completions: OpenAI Chat Completions over the shared generation path.

A stream is: one assistant-role chunk, reasoning deltas (both `reasoning_content` and `reasoning`), content deltas,
tool-call deltas (the call's id and name with empty arguments, then its arguments, at the parser's stable index), a
finish-reason chunk, the usage chunk when `stream_options.include_usage`, then `data: [DONE]`. Every chunk carries
the response's one id and `created`. A failure after the stream started is written by the app as an error data
line, without `[DONE]`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import attrs

from ninfer.engine.request import RequestOptions
from ninfer.engine.sampler import SamplingOverrides
from ninfer.frontend.tool_calls import TextDelta, ToolCallArgumentsDelta, ToolCallStarted
from ninfer.protocol.common import CachedTokensDetails, ReasoningTokensDetails, to_json
from ninfer.protocol.openai_chat import (CONVERTER, MEDIA_PARTS, ChatCompletion, ChatCompletionChunk,
                                         ChatCompletionMessage, ChatCompletionRequest, ChatDelta, ChatUsage, Choice,
                                         ChunkChoice, FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta,
                                         UserMessage)
from ninfer.server.context import (ApiError, HttpRequest, JsonResponse, Response, Route, ServerContext, SseEvent,
                                  StreamResponse)
from ninfer.server.generation import (Completed, Finish, Generation, GenerationUsage, Output, ReasoningDelta,
                                      build_media_prompt, parse_body, require_vision, resolve_prompt_options,
                                      start_generation)

FINISH_REASONS = {Finish.STOP: "stop", Finish.STOP_SEQUENCE: "stop", Finish.LENGTH: "length",
                  Finish.TOOL_CALLS: "tool_calls"}
DONE = SseEvent("[DONE]")


@attrs.frozen
class _Identity:
    """What every object of one response repeats."""

    id: str
    created: int
    model: str


async def create_chat_completion(ctx: ServerContext, request: HttpRequest) -> Response:
    body = parse_body(request, CONVERTER, ChatCompletionRequest)
    if body.model != ctx.public_model_id:
        raise ApiError(404, "model_not_found", f"model {body.model!r} does not exist; this server serves "
                       f"{ctx.public_model_id!r}", param="model")
    media = [f"messages[{i}].content[{j}]" for i, message in enumerate(body.messages)
             if isinstance(message, UserMessage) and not isinstance(message.content, str)
             for j, part in enumerate(message.content) if isinstance(part, MEDIA_PARTS)]
    tools = [CONVERTER.unstructure(tool) for tool in body.rendered_tools]
    # serving.md: an effort the template does not expose (and a contradictory option) fails before preparation.
    options = resolve_prompt_options(ctx, reasoning_effort=body.reasoning_effort,
                                     enable_thinking=body.template_enable_thinking,
                                     preserve_thinking=body.template_preserve_thinking,
                                     effort_param="reasoning_effort", thinking_param="enable_thinking")
    ctx.begin_preparation(api="chat", shape={"stream": bool(body.stream), "messages": len(body.messages),
                                             "tools": len(tools), "media_items": len(media)})
    if media:
        require_vision(ctx, media[0])
    prompt, prepared = await build_media_prompt(ctx, [CONVERTER.unstructure(message) for message in body.messages],
                                                options, tools=tools)
    sampling = SamplingOverrides(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                 presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                 seed=body.seed)
    generation = await start_generation(ctx, prompt, RequestOptions(max_tokens=body.output_limit, sampling=sampling),
                                        api="chat", stop_strings=body.stop_strings, tools=tools, media=prepared)
    identity = _Identity(f"chatcmpl-{secrets.token_hex(8)}", int(time.time()), ctx.public_model_id)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamResponse(_chunks(generation, identity, include_usage))
    return JsonResponse(CONVERTER.unstructure(_completion(await generation.collect(), identity)))


def _usage(usage: GenerationUsage) -> ChatUsage:
    return ChatUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.prompt_tokens + usage.completion_tokens,
                     prompt_tokens_details=CachedTokensDetails(cached_tokens=usage.cached_tokens),
                     completion_tokens_details=ReasoningTokensDetails(reasoning_tokens=usage.reasoning_tokens))


def _completion(output: Output, identity: _Identity) -> ChatCompletion:
    calls = tuple(ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments_json))
                  for call in output.tool_calls)
    reasoning = output.reasoning or None
    message = ChatCompletionMessage(content=output.content or (None if calls else ""), reasoning_content=reasoning,
                                    reasoning=reasoning, tool_calls=calls or None)
    choice = Choice(index=0, message=message, finish_reason=FINISH_REASONS[output.completed.finish])
    return ChatCompletion(id=identity.id, created=identity.created, model=identity.model, choices=(choice,),
                          usage=_usage(output.completed.usage))


async def _chunks(generation: Generation, identity: _Identity, include_usage: bool) -> AsyncIterator[SseEvent]:
    def chunk(delta: ChatDelta, finish: Completed | None = None) -> SseEvent:
        choice = ChunkChoice(index=0, delta=delta, finish_reason=finish and FINISH_REASONS[finish.finish])
        return SseEvent(to_json(CONVERTER, ChatCompletionChunk(id=identity.id, created=identity.created,
                                                               model=identity.model, choices=(choice,))))

    try:
        yield chunk(ChatDelta(role="assistant", content=""))
        async for item in generation.events():
            match item:
                case ReasoningDelta(text=text):
                    yield chunk(ChatDelta(reasoning_content=text, reasoning=text))
                case TextDelta(text=text):
                    yield chunk(ChatDelta(content=text))
                case ToolCallStarted(index=index, id=call_id, name=name):
                    function = FunctionCallDelta(name=name, arguments="")
                    yield chunk(ChatDelta(tool_calls=(ToolCallDelta(index=index, id=call_id, type="function",
                                                                    function=function),)))
                case ToolCallArgumentsDelta(index=index, delta=arguments):
                    function = FunctionCallDelta(arguments=arguments)
                    yield chunk(ChatDelta(tool_calls=(ToolCallDelta(index=index, function=function),)))
                case Completed():
                    yield chunk(ChatDelta(), item)
                    if include_usage:
                        yield SseEvent(to_json(CONVERTER, ChatCompletionChunk(
                            id=identity.id, created=identity.created, model=identity.model, choices=(),
                            usage=_usage(item.usage))))
        yield DONE
    finally:  # also when the client leaves mid-stream: the engine request is cancelled
        await generation.aclose()


def routes() -> list[Route]:
    return [Route("POST", "/v1/chat/completions", create_chat_completion)]
