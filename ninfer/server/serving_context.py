"""The ServerContext handlers get: admission (capacity, pending deadline), the engine bridge, and the request log.

One HTTP request is one `RequestScope`, opened by the app when the request arrives (so the pending deadline starts
before any preparation) and closed when its response has been written (so the capacity slot covers the whole
lifetime, unsent results included). Handlers do not see the scope: `generate`, `begin_preparation` and
`prepare_media` find it through a context variable. Media a request prepared are released when its scope closes at
the latest (success, error or disconnect); a Generation releases them earlier, when the engine is done.
"""

from __future__ import annotations

import contextvars
import logging
import time
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterator, Mapping, NoReturn, Sequence

import attrs
import trio

from ninfer.engine.engine import RequestHandle
from ninfer.engine.request import (ContextLengthExceeded, FinishReason, OutputPolicy, PreparedPrompt, PromptError,
                                   RequestEvent, RequestOptions, Usage)
from ninfer.engine.sampler import SamplingParamsError
from ninfer.media.prepare import MediaItem, PreparedMedia
from ninfer.nursery.admission import AdmissionGate, ServerOverloaded, ShuttingDown, Slot
from ninfer.nursery.engine_bridge import AdmissionTimeout, submit
from ninfer.nursery.options import ServeOptions
from ninfer.nursery.startup import ModelStack
from ninfer.observability.metrics import RequestCounters
from ninfer.observability.records import (RequestClock, sampler_record, speculative_record, timings_record,
                                          usage_record)
from ninfer.observability.request_log import RequestLog
from ninfer.server.context import ApiError
from ninfer.server.generation import queue_timeout, run_media_preparation

log = logging.getLogger("ninfer.requests")


@attrs.define(eq=False)
class RequestScope:
    arrived: float  # time.perf_counter() when the request reached the app
    deadline: float  # trio time by which the engine must admit a generation (--pending-timeout-ms)
    slot: Slot | None = None
    request_id: int | None = None  # given when preparation begins
    api: str | None = None
    shape: Mapping[str, Any] | None = None
    logged: bool = False  # request_start or request_rejected was written
    media: list[PreparedMedia] = attrs.Factory(list)  # released when the scope closes
    media_record: dict[str, Any] | None = None  # the request's media preparation, for request_start

    def release_media(self) -> None:
        for prepared in self.media:
            prepared.release()
        self.media.clear()


_scope: contextvars.ContextVar[RequestScope] = contextvars.ContextVar("ninfer_request_scope")


class ServingContext:
    """Implements `ninfer.server.context.ServerContext`, plus `begin_preparation` and `started_unix`."""

    def __init__(self, options: ServeOptions, stack: ModelStack, gate: AdmissionGate, request_log: RequestLog,
                 *, started_unix: int) -> None:
        self.options = options
        self.public_model_id = stack.public_model_id
        self.prompt_builder = stack.prompt_builder
        self.stop_ids = stack.stop_ids
        self.max_context = options.max_context
        self.started_unix = started_unix  # the model objects' `created`
        self.engine = stack.engine
        self.media_preparer = stack.media_preparer  # None without --vision
        self.gate = gate
        self.request_log = request_log
        self.request_counters = RequestCounters()  # GET /metrics

    # ---- for the app ----

    @contextmanager
    def request_scope(self) -> Iterator[RequestScope]:
        """One HTTP request's scope; its capacity slot is released on exit."""
        scope = RequestScope(arrived=time.perf_counter(),
                             deadline=trio.current_time() + self.options.pending_timeout_ms / 1000)
        token = _scope.set(scope)
        try:
            yield scope
        finally:
            _scope.reset(token)
            scope.release_media()
            if scope.slot is not None:
                scope.slot.release()

    def note_rejection(self, scope: RequestScope, error: ApiError, *, phase: str = "prepare") -> None:
        """A request that began preparation and failed before the engine took it: request_rejected (once)."""
        if scope.request_id is None or scope.logged:
            return
        scope.logged = True
        self.request_counters.reject(error.code)
        shape = dict(scope.shape or {})
        self.request_log.write("request_rejected", request_id=scope.request_id, protocol=scope.api, shape=shape,
                               media_items=shape.get("media_items", 0), phase=phase, status=error.status,
                               type=error.type, code=error.code, param=error.param, message=error.message)
        log.info("[req %d] rejected %d %s: %s", scope.request_id, error.status, error.code, error.message)

    # ---- for handlers ----

    def begin_preparation(self, *, api: str, shape: Mapping[str, Any] | None = None) -> None:
        """Call after schema and model validation, before preparing the prompt (optional: `generate` calls it when
        a handler did not). The request takes its capacity slot (ApiError 429 server_overloaded when
        max_concurrency + max_pending requests are outstanding; 503 server_shutting_down while draining) and its
        request id; from here on an ApiError is logged as request_rejected. `shape` describes the request for the
        log without its content, e.g. {"stream": true, "messages": 3, "tools": 1, "media_items": 0}."""
        scope = _scope.get()
        if scope.slot is not None:
            return
        try:
            scope.slot = self.gate.take()
        except ServerOverloaded as exc:
            self.request_log.write("request_rejected", request_id=None, protocol=api, shape=dict(shape or {}),
                                   phase="capacity", status=429, type="rate_limit_error", code="server_overloaded",
                                   param=None, message=str(exc))
            self.request_counters.reject("server_overloaded")
            raise ApiError(429, "server_overloaded", str(exc), type="rate_limit_error") from None
        except ShuttingDown as exc:
            raise ApiError(503, "server_shutting_down", str(exc), type="server_error") from None
        scope.request_id, scope.api, scope.shape = self.request_log.new_request_id(), api, shape

    async def prepare_media(self, items: Sequence[MediaItem]) -> PreparedMedia:
        """The request's media, prepared on a worker thread under its pending deadline (503 request_queue_timeout
        once it has passed), held by the request's scope until it closes. Errors are ApiErrors (see
        `ninfer.server.generation.run_media_preparation`)."""
        scope = _scope.get()
        remaining = scope.deadline - trio.current_time()
        if remaining <= 0:
            raise queue_timeout(f"the request was not prepared within --pending-timeout-ms "
                                f"({self.options.pending_timeout_ms} ms)")
        began = time.perf_counter()
        prepared = await run_media_preparation(self.media_preparer, items, deadline=time.monotonic() + remaining)
        scope.media.append(prepared)
        record = scope.media_record or {"items": 0, "images": 0, "videos": 0, "acquired_bytes": 0,
                                        "payload_bytes": 0, "vision_tokens": 0, "cache_hits": 0, "cache_misses": 0,
                                        "single_flight_joins": 0, "wall_seconds": 0.0, "work_seconds": 0.0}
        for key, value in (("items", len(prepared.items)),
                           ("images", sum(1 for item in prepared.items if item.modality == "image")),
                           ("videos", sum(1 for item in prepared.items if item.modality == "video")),
                           ("acquired_bytes", prepared.acquired_bytes), ("payload_bytes", prepared.payload_bytes),
                           ("vision_tokens", prepared.vision_tokens), ("cache_hits", prepared.cache_hits),
                           ("cache_misses", prepared.cache_misses), ("single_flight_joins", prepared.joined_builds),
                           ("wall_seconds", time.perf_counter() - began), ("work_seconds", prepared.seconds)):
            record[key] += value
        scope.media_record = record
        return prepared

    async def generate(self, prompt: PreparedPrompt, options: RequestOptions, policy: OutputPolicy, *,
                       api: str) -> AsyncIterator[RequestEvent]:
        self.begin_preparation(api=api)
        scope = _scope.get()
        if trio.current_time() >= scope.deadline:
            self._queue_timeout(scope)
        try:
            request = submit(self.engine, prompt, options, policy)
        except ContextLengthExceeded as exc:
            self._reject(scope, ApiError(400, "context_length_exceeded", str(exc), param="messages",
                                         extra={"prompt_tokens": exc.prompt_tokens, "max_context": exc.max_context}))
        except (PromptError, SamplingParamsError) as exc:
            self._reject(scope, ApiError(400, "invalid_value", str(exc)))
        submitted = time.perf_counter()
        started, first_token, completion, usage = False, None, 0, None

        def clock() -> RequestClock:
            return RequestClock(arrived=scope.arrived, submitted=submitted, first_token=first_token,
                                finished=time.perf_counter())

        try:
            try:
                await request.admission(scope.deadline)
            except AdmissionTimeout:
                self._queue_timeout(scope)
            self._log_start(scope, prompt, request.handle)
            started = True
            async for event in request.events():
                if event.tokens and first_token is None:
                    first_token = time.perf_counter()
                completion += len(event.tokens)
                if event.finish is not None:
                    usage = event.usage
                    self._log_end(scope, event.finish, usage, event.error, len(prompt), completion, clock())
                yield event
        finally:
            request.close()
            if started and usage is None:  # the consumer left first: the engine cancels the request
                self._log_end(scope, FinishReason.CANCELLED, None, None, len(prompt), completion, clock())

    # ---- the request log ----

    def _reject(self, scope: RequestScope, error: ApiError, *, phase: str = "prepare") -> NoReturn:
        self.note_rejection(scope, error, phase=phase)
        raise error

    def _queue_timeout(self, scope: RequestScope) -> NoReturn:
        self._reject(scope, ApiError(503, "request_queue_timeout", f"the request was not admitted within "
                                     f"--pending-timeout-ms ({self.options.pending_timeout_ms} ms)",
                                     type="server_error"), phase="admission")

    def _log_start(self, scope: RequestScope, prompt: PreparedPrompt, handle: RequestHandle) -> None:
        scope.logged = True
        sampling = handle.sampling
        self.request_log.write(
            "request_start", request_id=scope.request_id, protocol=scope.api, shape=dict(scope.shape or {}),
            prompt_tokens=len(prompt), thinking=prompt.thinking, preserve_thinking=prompt.preserve_thinking,
            output_budget=handle.output_budget, sampler=sampler_record(sampling),
            seed=None if sampling is None else sampling.seed,
            **({"media": scope.media_record} if scope.media_record is not None else {}))

    def _log_end(self, scope: RequestScope, finish: FinishReason, usage: Usage | None, error: str | None,
                 prompt_tokens: int, completion_tokens: int, clock: RequestClock) -> None:
        self.request_counters.count(finish.value)
        counts = usage_record(usage, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        timings = timings_record(clock, usage)
        if finish is FinishReason.ERROR:
            self.request_log.write("request_error", request_id=scope.request_id, protocol=scope.api,
                                   shape=dict(scope.shape or {}), error=error, **counts, timings_seconds=timings)
            log.error("[req %d] error: %s", scope.request_id, error)
            return
        speculative = speculative_record(self.options.spec, None if usage is None else usage.speculative)
        tier = self.engine.cold_tier
        cold = tier.stats() if tier.active else None
        self.request_log.write("request_done", request_id=scope.request_id, protocol=scope.api,
                               finish_reason=finish.value, **counts, timings_seconds=timings,
                               speculative=speculative, **(cold or {}))
        log.info("[req %d] done finish=%s prompt=%d gen=%d cache=%s ttft=%s prefill=%s decode=%s wall=%.3fs%s%s",
                 scope.request_id, finish.value, counts["prompt_tokens"], counts["completion_tokens"],
                 counts["cached_tokens"], _seconds(timings["ttft"]), _seconds(timings["prefill"]),
                 _seconds(timings["decode"]), timings["total"], _speculative_summary(speculative),
                 _cold_tier_summary(cold))


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _cold_tier_summary(stats: dict[str, int] | None) -> str:
    """The request-done line's cumulative cold-tier suffix while the tier is active (serving.md)."""
    if stats is None:
        return ""
    failures = stats["cold_tier_park_failures"] + stats["cold_tier_restore_failures"]
    return (f" cold=parks={stats['cold_tier_parks']} restores={stats['cold_tier_restores']} failures={failures} "
            f"entries={stats['cold_tier_entries']} evictions={stats['cold_tier_evictions']} "
            f"used={stats['cold_tier_used_bytes'] / 2**30:.2f}GiB")


def _speculative_summary(record: dict[str, Any]) -> str:
    if not record["rounds"]:
        return ""
    return (f" speculative=rounds={record['rounds']} accepted={record['accepted_tokens']}/"
            f"{record['drafted_tokens']} per_round={1 + record['accepted_tokens'] / record['rounds']:.2f}")
