"""One generation as every HTTP API runs it: request errors, prompt preparation, the output policy, the results.

The APIs differ only in their wire objects. What they share lives here and knows no API:

- `parse_body` / `api_error`: protocol and prompt errors as the ApiError the app renders.
- `resolve_prompt_options`, `build_prompt`: the request's template options against the server defaults, and the
  PreparedPrompt with the engine's checkpoint boundaries (`prepare_prompt`). `build_media_prompt` is the same for a
  conversation that may hold images and videos: it prepares them (`prepare_media`: acquisition, the prepared-media
  cache, preprocessing, on a worker thread under the request's pending deadline), expands their placeholders and
  gives the prompt its MRoPE positions and PromptMedia. The PreparedMedia it returns holds cache references until
  released: `start_generation` hands it to the Generation, which releases it when the request ends (or releases it
  itself when the request fails to start).
- `OutputAdapter`: the engine OutputPolicy over the frontend ResponseStream (stop ids, stop strings, tool calls).
  Its payloads are `OutputEvent`s: reasoning text, answer text and tool-call events, whitespace-trimmed.
- `start_generation` -> `Generation`: `events()` for a stream (ending in `Completed`), `collect()` for one object.
  Both read the same events, so concatenated stream deltas always equal the non-streamed object.

Sampling: a request's fields go into `SamplingOverrides` as they are. The engine's `resolve_sampling` applies
serving.md's precedence (request, process flags, the model's preset for the thinking mode, `--greedy`) and draws a
fresh random seed when neither the request nor `--seed` gives one, so nothing here repeats it.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import attrs
import cattrs
import trio

from ninfer.engine.request import FinishReason as EngineFinish
from ninfer.engine.request import PreparedPrompt, PromptMedia, RequestEvent, RequestOptions, Verdict
from ninfer.frontend.media import expand_media
from ninfer.frontend.output import THINK_CLOSE, OutputDecoder
from ninfer.frontend.output import FinishReason as DecoderFinish
from ninfer.frontend.prompt import Prompt, PromptBuilder, PromptError, PromptOptions, resolve_options
from ninfer.frontend.stream import ResponseStream, StreamDelta
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.frontend.tool_calls import (TextDelta, ToolCall, ToolCallArgumentsDelta, ToolCallDone, ToolCallParser,
                                        ToolCallStarted, new_call_id)
from ninfer.media.acquire import MediaFetchTimeout
from ninfer.media.cache import MediaWaitCancelled, MediaWaitTimeout
from ninfer.media.errors import MediaError
from ninfer.media.prepare import MediaItem, PreparedMedia
from ninfer.protocol.common import RequestError, structure
from ninfer.server.context import ApiError, HttpRequest, ServerContext
from ninfer.server.errors import internal_error

T = TypeVar("T")

# --- errors ----------------------------------------------------------------------------------------------------------


def api_error(exc: RequestError | PromptError) -> ApiError:
    """A protocol or prompt refusal as the HTTP error the app renders (code and param kept)."""
    if isinstance(exc, RequestError):
        return ApiError(exc.status, exc.code, exc.message, param=exc.param)
    return ApiError(400, exc.code, f"{exc.param}: {exc}" if exc.param else str(exc), param=exc.param)


def parse_body(request: HttpRequest, converter: cattrs.Converter, cls: type[T]) -> T:
    try:
        return structure(converter, request.json(), cls)
    except RequestError as exc:
        raise api_error(exc) from None


# --- the prompt ------------------------------------------------------------------------------------------------------


def resolve_prompt_options(ctx: ServerContext, *, reasoning_effort: str | None, enable_thinking: bool | None,
                           preserve_thinking: bool | None, effort_param: str, thinking_param: str) -> PromptOptions:
    """The request's thinking, effort and preserve_thinking against the loaded template and the server defaults
    (--no-thinking, --preserve-thinking); `*_param` name the request fields in errors."""
    try:
        return resolve_options(ctx.prompt_builder.capabilities, reasoning_effort=reasoning_effort,
                               enable_thinking=enable_thinking, preserve_thinking=preserve_thinking,
                               default_thinking=not ctx.options.no_thinking,
                               default_preserve_thinking=ctx.options.preserve_thinking,
                               effort_param=effort_param, thinking_param=thinking_param)
    except PromptError as exc:
        raise api_error(exc) from None


def vision_disabled(param: str | None) -> ApiError:
    return ApiError(400, "vision_disabled", "image and video input needs a server started with --vision",
                    param=param)


def require_vision(ctx: ServerContext, param: str) -> None:
    """A media part needs a server started with --vision (serving.md: 400 vision_disabled): one whose model stack
    has a media preparer."""
    if getattr(ctx, "media_preparer", None) is None:
        raise vision_disabled(param)


def build_prompt(ctx: ServerContext, messages: list[dict[str, Any]], options: PromptOptions, *,
                 tools: list[dict[str, Any]] | None = None) -> PreparedPrompt:
    """Chat-form text messages (what the protocol adapters lower to) rendered, tokenized and prepared for the
    engine. A conversation with media goes through `build_media_prompt`."""
    prompt = _render(ctx, messages, options, tools)
    if prompt.media:
        require_vision(ctx, prompt.media[0].param)
        raise RuntimeError("a prompt with media is built by build_media_prompt")
    return prepare_prompt(ctx.prompt_builder, prompt, options)


async def build_media_prompt(ctx: ServerContext, messages: list[dict[str, Any]], options: PromptOptions, *,
                             tools: list[dict[str, Any]] | None = None,
                             ) -> tuple[PreparedPrompt, PreparedMedia | None]:
    """`build_prompt` for a conversation that may hold media: the prompt with its media prepared and expanded, and
    the PreparedMedia (None for text) whose references the caller releases when the request ends (pass it to
    `start_generation`). Raises ApiError: vision_disabled, a media error's own status and code (invalid_media,
    media_budget_exceeded, media_fetch_failed 502, media_fetch_timeout 504, ...), 503 request_queue_timeout when
    the pending deadline passes while the request waits for media."""
    prompt = _render(ctx, messages, options, tools)
    if not prompt.media:
        return prepare_prompt(ctx.prompt_builder, prompt, options), None
    require_vision(ctx, prompt.media[0].param)
    for source in prompt.media:
        if source.url is None:
            raise ApiError(400, "invalid_media", f"{source.param}: a media part needs a URL", param=source.param)
    prepared = await prepare_media(ctx, [MediaItem(source.modality, source.url) for source in prompt.media])
    try:
        return prepare_prompt(ctx.prompt_builder, prompt, options, prepared), prepared
    except MediaError as exc:
        prepared.release()
        raise exc.to_api_error() from None
    except BaseException:
        prepared.release()
        raise


def _render(ctx: ServerContext, messages: list[dict[str, Any]], options: PromptOptions,
            tools: list[dict[str, Any]] | None) -> Prompt:
    try:
        return ctx.prompt_builder.build(messages, options, tools=tools or None)
    except PromptError as exc:
        raise api_error(exc) from None


def prepare_prompt(builder: PromptBuilder, prompt: Prompt, options: PromptOptions,
                   media: PreparedMedia | None = None) -> PreparedPrompt:
    """The engine's view of a prompt that ends with the template's generation prompt for `options.thinking`.

    prologue_end is the prompt's end (the whole generation prompt is deterministic), assistant_boundary the end of
    the generation prompt's first line (ChatML's `<|im_start|>assistant\\n`). Both need the generation prompt to
    tokenize on its own exactly as it did in place (true after a special token such as `<|im_start|>`); when it does
    not, the engine gets no checkpoint boundaries rather than wrong ones.

    `media`, the prompt's prepared items in prompt order, expands the placeholders (`expand_media`) and gives the
    prompt its MRoPE positions and one PromptMedia per item (PositionError, a MediaError, when they disagree).
    """
    ids: tuple[int, ...] = prompt.ids
    positions = None
    items: list[PromptMedia] = []
    if media is not None:
        payloads = media.payloads
        expanded = expand_media(prompt.ids, [source.modality for source in prompt.media], payloads,
                                builder.tokenizer.encode)
        ids, positions = expanded.ids, expanded.positions
        items = [PromptMedia(modality=item.modality, digest=digest, grid=payload.grid, patches=payload.patches,
                             columns=columns)
                 for item, digest, payload, columns in zip(media.items, media.digests, payloads, expanded.columns)]
    boundary = prologue_end = None
    generation_prompt = builder.capabilities.generation_prompt(options.thinking)
    tail = builder.tokenizer.encode(generation_prompt) if prompt.text.endswith(generation_prompt) else []
    if tail and list(ids[-len(tail):]) == tail:
        prologue_end = len(ids)
        opener = builder.tokenizer.encode(generation_prompt[: generation_prompt.find("\n") + 1])
        if opener and tail[: len(opener)] == opener:
            boundary = prologue_end - len(tail) + len(opener)
    return PreparedPrompt(token_ids=ids, positions=positions, thinking=prompt.thinking, assistant_boundary=boundary,
                          prologue_end=prologue_end, preserve_thinking=options.preserve_thinking, media=items)


# --- media preparation -----------------------------------------------------------------------------------------------


async def prepare_media(ctx: ServerContext, items: Sequence[MediaItem]) -> PreparedMedia:
    """The request's media prepared by the context's media preparer: through `ctx.prepare_media` when the context
    has one (the server's: the pending deadline, the request log, a release when the request's scope ends), else
    without a deadline. MediaError and the preparation timeouts come out as ApiError."""
    own = getattr(ctx, "prepare_media", None)
    if own is not None:
        return await own(items)
    return await run_media_preparation(ctx.media_preparer, items, deadline=None)


async def run_media_preparation(preparer: Any, items: Sequence[MediaItem], *, deadline: float | None,
                                ) -> PreparedMedia:
    """`preparer.prepare(items, deadline=)` on a worker thread (`deadline` a time.monotonic() value, the request's
    pending deadline). A cancelled caller (a client that left) abandons the thread, which then releases what it
    prepared itself, so no cache reference outlives the request. Errors are ApiErrors: a MediaError's own, 503
    request_queue_timeout for a deadline that passed while waiting for media bytes or fetching them."""
    lock = threading.Lock()
    state: dict[str, Any] = {"abandoned": False, "result": None}

    def work() -> PreparedMedia | None:
        prepared = preparer.prepare(list(items), deadline=deadline)
        with lock:
            if state["abandoned"]:
                prepared.release()
                return None
            state["result"] = prepared
        return prepared

    try:
        try:
            return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        except BaseException:
            with lock:
                state["abandoned"] = True
                result, state["result"] = state["result"], None
            if result is not None:
                result.release()
            raise
    except (MediaWaitTimeout, MediaWaitCancelled) as exc:
        raise queue_timeout(f"the request's media were not prepared before its pending deadline ({exc})") from None
    except MediaFetchTimeout as exc:
        if deadline is not None and time.monotonic() >= deadline:
            raise queue_timeout(f"the request's media were not fetched before its pending deadline ({exc})") \
                from None
        raise exc.to_api_error() from None
    except MediaError as exc:
        raise exc.to_api_error() from None


def queue_timeout(message: str) -> ApiError:
    return ApiError(503, "request_queue_timeout", message, type="server_error")


# --- output events ---------------------------------------------------------------------------------------------------


@attrs.define
class ReasoningDelta:
    text: str


# Content events are the tool-call parser's own: TextDelta, ToolCallStarted, ToolCallArgumentsDelta, ToolCallDone.
OutputEvent = ReasoningDelta | TextDelta | ToolCallStarted | ToolCallArgumentsDelta | ToolCallDone


class Finish(enum.Enum):
    STOP = "stop"  # the model ended its answer (a stop token)
    STOP_SEQUENCE = "stop_sequence"  # one of the request's stop strings
    LENGTH = "length"  # the output limit, or the context, ran out
    TOOL_CALLS = "tool_calls"  # the model stopped after calling tools


@attrs.frozen(kw_only=True)
class GenerationUsage:
    prompt_tokens: int  # the full prepared prompt
    completion_tokens: int  # accepted generated ids, a stop token included
    cached_tokens: int  # the resident prefix the engine reused
    reasoning_tokens: int  # counted by the output decoder while the reasoning channel was open


@attrs.frozen(kw_only=True)
class Completed:
    """The last item of a generation's events."""

    finish: Finish
    stop_sequence: str | None  # the stop string that ended the output (with Finish.STOP_SEQUENCE)
    usage: GenerationUsage


@attrs.frozen
class Output:
    """A whole generation, for non-streamed responses."""

    segments: tuple[ReasoningDelta | TextDelta | ToolCall, ...]  # in output order, adjacent texts of a kind joined
    completed: Completed

    @property
    def reasoning(self) -> str:
        return "".join(s.text for s in self.segments if isinstance(s, ReasoningDelta))

    @property
    def content(self) -> str:
        return "".join(s.text for s in self.segments if isinstance(s, TextDelta))

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(s for s in self.segments if isinstance(s, ToolCall))


class _TrimmedText:
    """One channel's text with the whitespace at both ends of each segment dropped, as it streams: leading
    whitespace is skipped, trailing whitespace held until more text follows it. A tool call ends a segment."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept):]
        return kept

    def end_segment(self) -> None:
        self._started, self._held = False, ""


# --- the output policy -----------------------------------------------------------------------------------------------

_ENGINE_FINISH = {DecoderFinish.STOP_TOKEN: EngineFinish.STOP_TOKEN,
                  DecoderFinish.STOP_STRING: EngineFinish.STOP_STRING}


class OutputAdapter:
    """The OutputPolicy of a served request: each round's accepted tokens through the frontend ResponseStream
    (reasoning/content channels, stop ids and stop strings, tool calls when the prompt offered tools); the payload
    of each engine event is its list of OutputEvents. Runs on the engine thread; the request's consumer reads the
    counters and `stop_sequence` after the final event."""

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool, stop_ids: frozenset[int],
                 stop_strings: tuple[str, ...] = (), tools: Sequence[dict[str, Any]] | None = None,
                 max_tool_name_length: int = 64, new_tool_call_id: Callable[[], str] = new_call_id) -> None:
        decoder = OutputDecoder(tokenizer, thinking=thinking, stop_ids=stop_ids, stop_strings=stop_strings)
        parser = ToolCallParser(tools, new_id=new_tool_call_id, max_name_length=max_tool_name_length) \
            if tools else None
        self._stream = ResponseStream(decoder, parser)
        self._tokenizer, self._thinking, self._stop_strings = tokenizer, thinking, stop_strings
        self._accepted: list[int] = []
        self._reasoning, self._content = _TrimmedText(), _TrimmedText()

    @property
    def reasoning_tokens(self) -> int:
        return self._stream.decoder.reasoning_tokens

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._stream.tool_calls

    def accept(self, tokens: Sequence[int]) -> Verdict:
        delta, accepted = self._stream.push(tokens)
        self._accepted += tokens[:accepted]
        return Verdict(accepted, _ENGINE_FINISH.get(delta.finish), payload=self._events(delta))

    def close(self, reason: EngineFinish) -> list[OutputEvent]:
        return self._events(self._stream.finish())

    def _events(self, delta: StreamDelta) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        reasoning = self._reasoning.feed(delta.reasoning)
        if reasoning:
            events.append(ReasoningDelta(reasoning))
        for event in delta.content:
            if isinstance(event, TextDelta):
                text = self._content.feed(event.text)
                if text:
                    events.append(TextDelta(text))
                continue
            if isinstance(event, ToolCallStarted):
                self._content.end_segment()  # whitespace before a call is not part of the answer
            events.append(event)
        return events

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the output, found again in the accepted tokens' content (the decoder cuts
        the output before a match without saying which string it was): the earliest match, ties to the first
        declared, as the decoder decides."""
        if self._stream.decoder.finished is not DecoderFinish.STOP_STRING:
            return None
        text = self._tokenizer.decode(self._accepted)
        if self._thinking:  # stop strings apply to the content channel, after the reasoning
            text = text.partition(THINK_CLOSE)[2].lstrip()
        found = [(text.find(s), i, s) for i, s in enumerate(self._stop_strings) if s in text]
        return min(found)[2] if found else None


# --- running it ------------------------------------------------------------------------------------------------------


class Generation:
    """A started request: its first engine event is in, so admission and context errors have been raised.
    Whoever holds one calls `aclose()` when done with it, however that came about (`collect` does): a stream the
    client left may not have read `events()` to its end, or at all."""

    def __init__(self, events: AsyncIterator[RequestEvent], first: RequestEvent, adapter: OutputAdapter,
                 media: PreparedMedia | None = None) -> None:
        self._events, self._first, self._adapter = events, first, adapter
        self._media = media  # the request's prepared media: released when the request ends

    def _release_media(self) -> None:
        if self._media is not None:
            self._media.release()
            self._media = None

    async def events(self) -> AsyncIterator[OutputEvent | Completed]:
        """The output events, then one Completed (once only); the engine iteration is closed when they end. A
        request the engine ended with an error raises ApiError in place of Completed."""
        try:
            async with aclosing(self._events) as remaining:
                event = self._first
                while True:
                    if event.finish is not None:
                        self._release_media()  # the engine is done with the request's media
                    for item in event.payload or ():
                        yield item
                    if event.finish is not None:
                        yield self._completed(event)
                        return
                    event = await anext(remaining)
        finally:
            self._release_media()

    async def aclose(self) -> None:
        """Close the engine iteration: a request that has not finished is cancelled (its pages are freed), and
        release its prepared media."""
        try:
            await self._events.aclose()
        finally:
            self._release_media()

    async def collect(self) -> Output:
        segments: list[ReasoningDelta | TextDelta | ToolCall] = []
        try:
            async for item in self.events():
                if isinstance(item, Completed):
                    return Output(tuple(segments), item)
                if isinstance(item, ToolCallDone):
                    segments.append(item.call)
                elif isinstance(item, (ReasoningDelta, TextDelta)):
                    if segments and type(segments[-1]) is type(item):
                        segments[-1] = type(item)(segments[-1].text + item.text)
                    else:
                        segments.append(item)
        finally:
            await self.aclose()
        raise RuntimeError("the generation's events ended without a final event")

    def _completed(self, event: RequestEvent) -> Completed:
        if event.finish is EngineFinish.ERROR:
            raise internal_error(f"generation failed: {event.error}")
        if event.finish is EngineFinish.CANCELLED:
            raise ApiError(503, "request_cancelled", "the server cancelled the request", type="server_error")
        usage = GenerationUsage(prompt_tokens=event.usage.prompt_tokens,
                                completion_tokens=event.usage.completion_tokens,
                                cached_tokens=event.usage.cached_tokens,
                                reasoning_tokens=self._adapter.reasoning_tokens)
        if event.finish in (EngineFinish.OUTPUT_LIMIT, EngineFinish.CONTEXT_CAPACITY):
            finish = Finish.LENGTH
        elif self._adapter.tool_calls:
            finish = Finish.TOOL_CALLS
        elif event.finish is EngineFinish.STOP_STRING:
            finish = Finish.STOP_SEQUENCE
        else:
            finish = Finish.STOP
        stop_sequence = self._adapter.stop_sequence if finish is Finish.STOP_SEQUENCE else None
        return Completed(finish=finish, stop_sequence=stop_sequence, usage=usage)


async def start_generation(ctx: ServerContext, prompt: PreparedPrompt, options: RequestOptions, *, api: str,
                           stop_strings: tuple[str, ...] = (), tools: Sequence[dict[str, Any]] | None = None,
                           max_tool_name_length: int = 64,
                           new_tool_call_id: Callable[[], str] = new_call_id,
                           media: PreparedMedia | None = None) -> Generation:
    """Submit the request and wait for its first event, so that the errors ctx.generate raises before any output
    (429 server_overloaded, 503 request_queue_timeout, 400 context_length_exceeded) are ordinary HTTP errors even
    for a streamed response. `tools` are the ones the prompt rendered: they switch tool-call parsing on. `media`
    (from `build_media_prompt`) is released when the Generation ends, or here when the request does not start."""
    try:
        adapter = OutputAdapter(ctx.prompt_builder.tokenizer, thinking=prompt.thinking, stop_ids=ctx.stop_ids,
                                stop_strings=stop_strings, tools=tools, max_tool_name_length=max_tool_name_length,
                                new_tool_call_id=new_tool_call_id)
        events = ctx.generate(prompt, options, adapter, api=api)
        first = await anext(events)
    except BaseException:
        if media is not None:
            media.release()
        raise
    return Generation(events, first, adapter, media)
