"""/v1/responses: OpenAI Responses Core over the shared generation path, and the local Response resources
(serving.md "OpenAI Responses Core").

A create request's conversation is the stored conversation of `previous_response_id` (if any), then its own
normalized input Items; `instructions` lead it as a developer turn for this request only. preserve_thinking is the
request's own, else the parent's, else the server default, and is stored with the Response for its children.

A stream is: response.created and response.in_progress (sent once the engine has produced the first output, so
capacity, queue and context errors stay ordinary HTTP errors); per output Item, output_item.added, then for a
reasoning Item or a message content_part.added, the text deltas, the text's .done and content_part.done, for a
function call function_call_arguments.delta and .done, and output_item.done; then exactly one of
response.completed, response.incomplete (the output limit or the context ran out) or response.failed (the engine
failed, or the Response did not fit the store). Every event has its type as the SSE event name and a
sequence_number counted from 0. A non-streamed response is the terminal event's response, built by the same steps,
so concatenated deltas always equal it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs

from ninfer.engine.request import PreparedPrompt, RequestOptions
from ninfer.engine.sampler import SamplingOverrides
from ninfer.frontend.prompt import PromptOptions
from ninfer.frontend.tool_calls import TextDelta, ToolCallArgumentsDelta, ToolCallDone, ToolCallStarted
from ninfer.media.prepare import PreparedMedia
from ninfer.protocol.common import CachedTokensDetails, ReasoningTokensDetails, RequestError, structure
from ninfer.protocol.openai_responses import (CONVERTER, ContentPartAddedEvent, ContentPartDoneEvent,
                                              CreateResponseRequest, DeletedResponse, FunctionCallArgumentsDeltaEvent,
                                              FunctionCallArgumentsDoneEvent, FunctionCallItem, IncompleteDetails,
                                              InputItem, InputItemList, InputItemsQuery, InputTokens,
                                              InputTokensRequest, Message, OutputItem, OutputItemAddedEvent,
                                              OutputItemDoneEvent, OutputText, OutputTextDeltaEvent,
                                              OutputTextDoneEvent, ReasoningConfig, ReasoningItem, ReasoningText,
                                              ReasoningTextDeltaEvent, ReasoningTextDoneEvent, Response,
                                              ResponseCompletedEvent, ResponseCreatedEvent, ResponseError,
                                              ResponseFailedEvent, ResponseIncompleteEvent, ResponseInProgressEvent,
                                              ResponseUsage, StreamEvent, TextConfig, TextFormat)
from ninfer.server.context import ApiError, HttpRequest, JsonResponse, Route, ServerContext, SseEvent, StreamResponse
from ninfer.server.generation import (Completed, Finish, Generation, GenerationUsage, ReasoningDelta, api_error,
                                      build_media_prompt, parse_body, require_vision, resolve_prompt_options,
                                      start_generation)
from ninfer.server.response_store import ResponseStore, ResponseStoreFull, StoredResponse
from ninfer.server.responses_items import chat_messages, chat_tools, media_params, new_id, normalize_input
from ninfer.server.sse import json_event

MIB = 1 << 20


def _check_model(ctx: ServerContext, model: str) -> None:
    if model != ctx.public_model_id:
        raise ApiError(404, "model_not_found", f"model {model!r} does not exist; this server serves "
                       f"{ctx.public_model_id!r}", param="model")


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, "response_not_found", f"no stored response {response_id!r} (never stored, store:false, "
                    f"evicted or deleted)", param=param)


def _store_full(exc: ResponseStoreFull) -> ApiError:
    return ApiError(400, "response_store_capacity_exceeded", f"{exc}; send store:false to skip storing it",
                    param="store")


def _input_items(items: str | tuple[InputItem, ...]) -> tuple[InputItem, ...]:
    try:
        return normalize_input(items)
    except RequestError as exc:
        raise api_error(exc) from None


async def _build_prompt(ctx: ServerContext, items: tuple[InputItem | OutputItem, ...], options: PromptOptions, *,
                        instructions: str | None = None, tools: list[dict[str, Any]] | None = None,
                        ) -> tuple[PreparedPrompt, PreparedMedia | None]:
    """The conversation's prompt and its prepared media (None for text; media in a stored chain are acquired
    again from their URLs). The frontend names chat `messages[i]` in its errors, which a Responses client never
    sent (its Items, instructions and history lower to other positions): those errors name `input`."""
    try:
        return await build_media_prompt(ctx, chat_messages(items, instructions), options, tools=tools)
    except ApiError as error:
        if error.param is None or not error.param.startswith("messages"):
            raise
        raise ApiError(error.status, error.code, error.message, param="input", type=error.type) from None


def _usage(usage: GenerationUsage) -> ResponseUsage:
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details=CachedTokensDetails(cached_tokens=usage.cached_tokens),
                         output_tokens=usage.completion_tokens,
                         output_tokens_details=ReasoningTokensDetails(reasoning_tokens=usage.reasoning_tokens),
                         total_tokens=usage.prompt_tokens + usage.completion_tokens)


# --- output Items from the generation's events -----------------------------------------------------------------------


@attrs.define
class _OpenItem:
    item: OutputItem  # as output_item.added announced it
    index: int
    text: list[str] = attrs.Factory(list)  # the reasoning, answer or arguments so far


class OutputBuilder:
    """One response's output Items, built from the generation's events; every step returns the stream events that
    describe it, numbered in one sequence with the response's lifecycle events. One Item is open at a time: a
    delta of another kind closes it (reasoning, answer text and each function call are Items of their own)."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []  # closed Items, in output order
        self._open: _OpenItem | None = None
        self._sequence = itertools.count()

    def event(self, cls: type, **fields: Any) -> StreamEvent:
        return cls(sequence_number=next(self._sequence), **fields)

    def feed(self, delta: ReasoningDelta | TextDelta | ToolCallStarted | ToolCallArgumentsDelta | ToolCallDone,
             ) -> list[StreamEvent]:
        if isinstance(delta, ReasoningDelta):
            return self._text(ReasoningItem, delta.text)
        if isinstance(delta, TextDelta):
            return self._text(Message, delta.text)
        if isinstance(delta, ToolCallStarted):
            call = FunctionCallItem(id=new_id("fc"), call_id=delta.id, name=delta.name, arguments="",
                                    status="in_progress")
            return self.close() + self._add(call)
        if isinstance(delta, ToolCallArgumentsDelta):
            self._open.text.append(delta.delta)
            return [self.event(FunctionCallArgumentsDeltaEvent, item_id=self._open.item.id,
                               output_index=self._open.index, delta=delta.delta)]
        return self.close()  # ToolCallDone: its arguments have all streamed

    def finish(self, status: str) -> list[StreamEvent]:
        """Close the open Item with `status`. An output without any Item gets an empty message, so a continuation
        still sees the assistant's turn."""
        events = self.close(status)
        if not self.items:
            events += self._add(_in_progress(Message)) + self.close(status)
        return events

    def close(self, status: str = "completed") -> list[StreamEvent]:
        if self._open is None:
            return []
        opened, self._open = self._open, None
        item, index, text = opened.item, opened.index, "".join(opened.text)
        if isinstance(item, FunctionCallItem):
            done = attrs.evolve(item, arguments=text, status=status)
            events = [self.event(FunctionCallArgumentsDoneEvent, item_id=item.id, output_index=index,
                                 name=item.name, arguments=text)]
        else:
            text_done, part = ((ReasoningTextDoneEvent, ReasoningText(text=text)) if isinstance(item, ReasoningItem)
                               else (OutputTextDoneEvent, OutputText(text=text)))
            done = attrs.evolve(item, content=(part,), status=status)
            events = [self.event(text_done, item_id=item.id, output_index=index, content_index=0, text=text),
                      self.event(ContentPartDoneEvent, item_id=item.id, output_index=index, content_index=0,
                                 part=part)]
        self.items.append(done)
        return events + [self.event(OutputItemDoneEvent, output_index=index, item=done)]

    def _text(self, kind: type, text: str) -> list[StreamEvent]:
        events = []
        if self._open is None or not isinstance(self._open.item, kind):
            events = self.close() + self._add(_in_progress(kind))
        self._open.text.append(text)
        delta = ReasoningTextDeltaEvent if kind is ReasoningItem else OutputTextDeltaEvent
        return events + [self.event(delta, item_id=self._open.item.id, output_index=self._open.index,
                                    content_index=0, delta=text)]

    def _add(self, item: OutputItem) -> list[StreamEvent]:
        self._open = _OpenItem(item, len(self.items))
        events = [self.event(OutputItemAddedEvent, output_index=self._open.index, item=item)]
        if not isinstance(item, FunctionCallItem):
            part = ReasoningText(text="") if isinstance(item, ReasoningItem) else OutputText(text="")
            events.append(self.event(ContentPartAddedEvent, item_id=item.id, output_index=self._open.index,
                                     content_index=0, part=part))
        return events


def _in_progress(kind: type) -> ReasoningItem | Message:
    if kind is ReasoningItem:
        return ReasoningItem(id=new_id("rs"), content=(), status="in_progress")
    return Message(id=new_id("msg"), role="assistant", content=(), status="in_progress")


# --- one create request ----------------------------------------------------------------------------------------------


@attrs.define
class _ResponseRun:
    """A started generation turned into a Response: its events, the terminal one last, and storing it."""

    generation: Generation
    base: Response  # the in-progress response object: identity and echoed request configuration
    store: ResponseStore | None  # None for store:false
    input_items: tuple[InputItem, ...]
    parent: StoredResponse | None
    preserve_thinking: bool
    builder: OutputBuilder = attrs.Factory(OutputBuilder)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Every event through response.completed or response.incomplete. A failure (the engine's, or a Response
        too large for the store) raises ApiError; `failed` then gives the stream's ending."""
        builder = self.builder
        yield builder.event(ResponseCreatedEvent, response=self.base)
        yield builder.event(ResponseInProgressEvent, response=self.base)
        try:
            async for item in self.generation.events():
                if isinstance(item, Completed):
                    completed = item
                else:
                    for event in builder.feed(item):
                        yield event
        finally:  # also when the client leaves mid-stream: the engine request is cancelled, its media released
            await self.generation.aclose()
        incomplete = completed.finish is Finish.LENGTH
        for event in builder.finish("incomplete" if incomplete else "completed"):
            yield event
        response = attrs.evolve(self.base, status="incomplete" if incomplete else "completed",
                                output=tuple(builder.items), usage=_usage(completed.usage),
                                incomplete_details=IncompleteDetails() if incomplete else None)
        if self.store is not None:
            try:
                self.store.put(response, self.input_items, parent=self.parent,
                               preserve_thinking=self.preserve_thinking)
            except ResponseStoreFull as exc:
                raise _store_full(exc) from None
        yield builder.event(ResponseIncompleteEvent if incomplete else ResponseCompletedEvent, response=response)

    def failed(self, error: ApiError) -> list[StreamEvent]:
        """The end of a stream that failed after it started: the open Item closed as incomplete, response.failed."""
        events = self.builder.close("incomplete")
        response = attrs.evolve(self.base, status="failed", output=tuple(self.builder.items),
                                error=ResponseError(code=error.code, message=error.message))
        return events + [self.builder.event(ResponseFailedEvent, response=response)]

    async def collect(self) -> Response:
        async for event in self.events():
            terminal = event
        return terminal.response

    async def stream(self) -> AsyncIterator[SseEvent]:
        try:
            async for event in self.events():
                yield _sse(event)
        except ApiError as error:
            for event in self.failed(error):
                yield _sse(event)


def _sse(event: StreamEvent) -> SseEvent:
    return json_event(CONVERTER.unstructure(event), event.type)


# --- the routes ------------------------------------------------------------------------------------------------------


class ResponsesApi:
    """The Responses routes and the Response store they share (sized from the serve options on first use, so one
    store lives as long as the app that routes to it)."""

    def __init__(self) -> None:
        self._store: ResponseStore | None = None

    def routes(self) -> list[Route]:
        # The literal paths come before the {id} patterns that would also match them.
        return [Route("POST", "/v1/responses", self.create),
                Route("POST", "/v1/responses/input_tokens", self.input_tokens),
                Route("POST", "/v1/responses/compact", compact),
                Route("GET", "/v1/responses/{id}", self.retrieve),
                Route("DELETE", "/v1/responses/{id}", self.delete),
                Route("GET", "/v1/responses/{id}/input_items", self.list_input_items),
                Route("POST", "/v1/responses/{id}/cancel", cancel)]

    def store(self, ctx: ServerContext) -> ResponseStore:
        if self._store is None:
            options = ctx.options
            self._store = ResponseStore(options.response_store_max_records, options.response_store_max_mib * MIB)
        return self._store

    async def create(self, ctx: ServerContext, request: HttpRequest) -> JsonResponse | StreamResponse:
        body = parse_body(request, CONVERTER, CreateResponseRequest)
        _check_model(ctx, body.model)
        store = self.store(ctx)
        parent = None
        if body.previous_response_id is not None:
            parent = store.get(body.previous_response_id)
            if parent is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
        input_items = _input_items(body.input)
        requested = body.template_preserve_thinking
        tools = chat_tools(body.rendered_tools)
        media = media_params(input_items)
        # serving.md: an effort the template does not expose fails before preparation.
        options = resolve_prompt_options(
            ctx, reasoning_effort=body.reasoning_effort, enable_thinking=None,
            preserve_thinking=parent.preserve_thinking if requested is None and parent else requested,
            effort_param="reasoning.effort", thinking_param="reasoning.effort")
        ctx.begin_preparation(api="responses", shape={
            "stream": bool(body.stream), "input_items": len(input_items), "tools": len(tools),
            "media_items": len(media), "continued": parent is not None,
            # serving.md: an explicit preserve_thinking unlike the parent's starts a new semantic branch.
            "semantic_change": parent is not None and requested is not None
            and requested != parent.preserve_thinking})
        if media:
            require_vision(ctx, media[0])
        conversation = (parent.conversation if parent else ()) + input_items
        storing = body.store is not False
        if storing:
            try:
                store.check_fits(input_items, parent)
            except ResponseStoreFull as exc:
                raise _store_full(exc) from None
        prompt, prepared = await _build_prompt(ctx, conversation, options, instructions=body.instructions,
                                               tools=tools)
        sampling = SamplingOverrides(temperature=body.temperature, top_p=body.top_p)
        generation = await start_generation(ctx, prompt, RequestOptions(max_tokens=body.max_output_tokens,
                                                                         sampling=sampling),
                                            api="responses", tools=tools, media=prepared)
        run = _ResponseRun(generation, _base_response(ctx, body, storing), store if storing else None, input_items,
                           parent, options.preserve_thinking)
        if body.stream:
            return StreamResponse(run.stream())
        return JsonResponse(CONVERTER.unstructure(await run.collect()))

    async def input_tokens(self, ctx: ServerContext, request: HttpRequest) -> JsonResponse:
        """The prompt the input would render to (template included), counted without generating."""
        body = parse_body(request, CONVERTER, InputTokensRequest)
        _check_model(ctx, body.model)
        input_items = _input_items(body.input)
        media = media_params(input_items)
        if media:
            require_vision(ctx, media[0])
        options = resolve_prompt_options(ctx, reasoning_effort=None, enable_thinking=None, preserve_thinking=None,
                                         effort_param="reasoning.effort", thinking_param="reasoning.effort")
        prompt, prepared = await _build_prompt(ctx, input_items, options)
        if prepared is not None:  # counted: the media are not needed any more
            prepared.release()
        return JsonResponse(CONVERTER.unstructure(InputTokens(input_tokens=len(prompt))))

    async def retrieve(self, ctx: ServerContext, request: HttpRequest) -> JsonResponse:
        stored = self._stored(ctx, request)
        return JsonResponse(CONVERTER.unstructure(stored.response))

    async def delete(self, ctx: ServerContext, request: HttpRequest) -> JsonResponse:
        response_id = request.path_params["id"]
        if not self.store(ctx).delete(response_id):
            raise _not_found(response_id)
        return JsonResponse(CONVERTER.unstructure(DeletedResponse(id=response_id)))

    async def list_input_items(self, ctx: ServerContext, request: HttpRequest) -> JsonResponse:
        query = _input_items_query(request)
        items = self._stored(ctx, request).input_items
        if query.order == "desc":
            items = items[::-1]
        start = 0
        if query.after is not None:
            ids = [item.id for item in items]
            if query.after not in ids:
                raise ApiError(400, "invalid_value", f"after: {query.after!r} is not an input Item of this "
                               f"response", param="after")
            start = ids.index(query.after) + 1
        page = items[start : start + query.limit]
        listing = InputItemList(data=page, first_id=page[0].id if page else None,
                                last_id=page[-1].id if page else None, has_more=start + query.limit < len(items))
        return JsonResponse(CONVERTER.unstructure(listing))

    def _stored(self, ctx: ServerContext, request: HttpRequest) -> StoredResponse:
        response_id = request.path_params["id"]
        stored = self.store(ctx).get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored


def _base_response(ctx: ServerContext, body: CreateResponseRequest, storing: bool) -> Response:
    return Response(id=new_id("resp"), created_at=int(time.time()), status="in_progress", model=ctx.public_model_id,
                    output=(), usage=None, error=None, incomplete_details=None, instructions=body.instructions,
                    previous_response_id=body.previous_response_id, max_output_tokens=body.max_output_tokens,
                    temperature=body.temperature, top_p=body.top_p, metadata=body.metadata or {},
                    reasoning=ReasoningConfig(effort=body.reasoning_effort), text=TextConfig(format=TextFormat()),
                    tools=body.tools or (), tool_choice=body.tool_choice or "auto", store=storing)


def _input_items_query(request: HttpRequest) -> InputItemsQuery:
    """The query string's parameters (the last of repeated ones) as an InputItemsQuery; `limit` is an integer."""
    values: dict[str, Any] = {name: found[-1] for name, found in request.query.items()}
    limit = values.get("limit")
    if isinstance(limit, str) and limit.lstrip("-").isdigit():
        values["limit"] = int(limit)
    try:
        return structure(CONVERTER, values, InputItemsQuery)
    except RequestError as exc:
        raise api_error(exc) from None


async def cancel(ctx: ServerContext, request: HttpRequest) -> JsonResponse:
    raise ApiError(400, "background_not_supported", "responses run in the foreground only (background execution "
                   "is not supported), so there is nothing to cancel")


async def compact(ctx: ServerContext, request: HttpRequest) -> JsonResponse:
    raise ApiError(400, "compaction_not_supported", "conversation compaction is not supported by this server")


def routes() -> list[Route]:
    return ResponsesApi().routes()
