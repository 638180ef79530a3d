"""The Engine: one thread owns the runner and drives the scheduler; submit, cancel and events are thread-safe.

Requests and cancellations reach the engine thread through a command queue and take effect at the next round
boundary. Events leave through each request's sink: by default a per-request queue (RequestHandle.events), or a
callback that runs on the engine thread and must not block. The engine thread never waits on a consumer.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Any, Callable, Iterator

import attrs

from ninfer.engine.config import EngineConfig
from ninfer.engine.prefix import PrefixStats
from ninfer.engine.request import (FinishReason, OutputPolicy, PreparedPrompt, RequestEvent, RequestOptions,
                                   StopTokenPolicy, Usage)
from ninfer.engine.runner import ModelRunner
from ninfer.engine.sampler import SamplingParams, resolve_sampling
from ninfer.engine.cold_tier import ColdTier
from ninfer.engine.scheduler import Scheduler, SchedulerSnapshot, ThroughputCounters
from ninfer.targets.registry import SamplingPresets

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class Completion:
    """A finished request, gathered from its events."""

    tokens: tuple[int, ...]
    payloads: tuple[Any, ...]  # the policy payload of every event, in order (None ones included)
    finish: FinishReason
    usage: Usage
    error: str | None


class RequestHandle:
    def __init__(self, request_id: int, engine: Engine) -> None:
        self.id = request_id
        self.sampling: SamplingParams | None = None  # resolved at submit (the request log records it)
        self.output_budget = 0  # the effective output limit: min(max_tokens, max_context - prompt + 1)
        self.events: queue.SimpleQueue[RequestEvent] = queue.SimpleQueue()
        self._engine = engine

    def cancel(self) -> None:
        self._engine.cancel(self.id)

    def __iter__(self) -> Iterator[RequestEvent]:
        """Events until (and including) the final one."""
        while True:
            event = self.events.get()
            yield event
            if event.finish is not None:
                return

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the final event (`timeout` applies to each event: queue.Empty when one takes longer)."""
        tokens, payloads = [], []
        while True:
            event = self.events.get(timeout=timeout)
            tokens += event.tokens
            payloads.append(event.payload)
            if event.finish is not None:
                return Completion(tokens=tuple(tokens), payloads=tuple(payloads), finish=event.finish,
                                  usage=event.usage, error=event.error)


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, presets: SamplingPresets,
                 cold_tier: ColdTier | None = None) -> None:
        self.config = config
        self._presets = presets
        self._scheduler = Scheduler(runner, config, cold_tier)
        self._snapshot = self._scheduler.snapshot()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)

    def start(self) -> Engine:
        """Start the engine thread (once; starting a running engine is a no-op)."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine thread; every request still waiting or running ends as cancelled."""
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the API ----

    def submit(self, prompt: PreparedPrompt, options: RequestOptions = RequestOptions(),
               policy: OutputPolicy | None = None, *,
               on_event: Callable[[RequestEvent], None] | None = None,
               on_admit: Callable[[], None] | None = None) -> RequestHandle:
        """Queue a request (FIFO). Invalid prompts and sampling values raise here, before anything is queued.
        Without a policy only the output limit and the context end the request. `on_admit` runs on the engine
        thread (it must not block) when the request leaves the queue for a lane, before its first event."""
        sampling = resolve_sampling(self._presets.for_mode(prompt.thinking), self.config.sampling, options.sampling,
                                    greedy=self.config.greedy)
        handle = RequestHandle(next(self._ids), self)
        request = self._scheduler.new_request(handle.id, prompt, options.max_tokens, sampling,
                                              policy or StopTokenPolicy(), on_event or handle.events.put)
        request.on_admit = on_admit
        handle.sampling, handle.output_budget = sampling, request.budget
        self._commands.put(("submit", request))
        return handle

    def cancel(self, request_id: int) -> None:
        """Takes effect at the next round boundary; the request's pages and lane state are freed then."""
        self._commands.put(("cancel", request_id))

    def count_tokens(self, prompt: PreparedPrompt) -> int:
        """Prompt tokens of a prepared prompt, without generating (usage's prompt_tokens)."""
        return len(prompt)

    def snapshot(self) -> SchedulerSnapshot:
        """Scheduler occupancy at the last round boundary."""
        return self._snapshot

    @property
    def vision(self) -> bool:
        """The runner has the Vision tower: prompts may carry media (PreparedPrompt.media)."""
        return bool(self._scheduler.runner.info.vision)

    @property
    def prefix_stats(self) -> PrefixStats:
        return self._scheduler.prefix

    @property
    def kv_pool_usage(self) -> float:
        """Allocated pages over all pages of the shared KV pool (0..1), retained residents included."""
        pool = self._scheduler.pool
        return (pool.pages - pool.free) / pool.pages if pool.pages else 0.0

    @property
    def throughput(self) -> ThroughputCounters:
        return self._scheduler.throughput

    @property
    def cold_tier(self) -> ColdTier:
        """The cross-GPU cold tier (inactive without arenas); its counters are cumulative."""
        return self._scheduler.cold_tier

    # ---- the engine thread ----

    def _run(self) -> None:
        scheduler = self._scheduler
        while True:
            block = not scheduler.has_work
            while True:
                try:
                    kind, value = self._commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if kind == "stop":
                    scheduler.cancel_all()
                    return
                if kind == "submit":
                    scheduler.enqueue(value)
                else:
                    scheduler.cancel(value)
            try:
                scheduler.step()
            except Exception as exc:  # a runner or policy failure ends the admitted requests, not the engine
                log.exception("engine round failed")
                scheduler.fail_active(f"{type(exc).__name__}: {exc}")
            self._snapshot = scheduler.snapshot()
