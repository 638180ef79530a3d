"""The scheduler: FIFO admission with full-entitlement page reservation, one prefill chunk at a time, one batched
decode round for every decode-ready request, and exact commits of what output policies accept.

Single-threaded: the engine thread calls `step()` between round boundaries; requests enter through `enqueue` and
leave through `cancel` or by finishing. A request moves WAITING -> PREFILL -> DECODE -> finished; when it finishes
its lane keeps the sequence as a retained resident for prefix reuse (unless cancelled or reuse is off), and
retained residents are evicted, least recently used first, when admission needs their pages.

Media: when a prefill chunk covers placeholder columns of a prompt's image or video, the item is encoded
(`runner.encode_media`, once per item per request, timed as the request's vision seconds) and the chunk carries the
rows of its columns as embedding overrides; the rows are dropped once the item's last column is prefilled. Items
wholly inside the reused prefix are never encoded (prefill starts at the reuse frontier, after them).
"""

from __future__ import annotations

import collections
import enum
import itertools
import time
from typing import Callable, Sequence

import attrs
import numpy as np

from ninfer.engine.cold_tier import ColdTier, host_image
from ninfer.engine.config import EngineConfig
from ninfer.engine.kv_pool import KVCapacityError, PagePool, pages_for
from ninfer.engine.prefix import (FULL_RESET, CheckpointKind, CheckpointTarget, PrefixStats, ReusePath, ReusePlan,
                                  Residency, checkpoint_to_capture, desired_checkpoint, plan_reuse)
from ninfer.engine.request import (ContextLengthExceeded, FinishReason, OutputPolicy, PreparedPrompt, PromptError,
                                   RequestEvent, Timings, Usage, Verdict)
from ninfer.engine.runner import DecodeBatch, ModelRunner, PrefillChunk, SequenceStart, StateSource
from ninfer.engine.sampler import SamplingParams
from ninfer.engine.speculative import SpeculativeCounters

EventSink = Callable[[RequestEvent], None]


class MediaUnsupported(PromptError):
    """The prompt carries images or videos, but the runner has no Vision tower (the server runs without --vision)."""


class OutputPolicyError(RuntimeError):
    """An output policy's verdict broke the contract (accepted nothing, or dropped tokens without finishing)."""


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"


@attrs.define(eq=False)
class Request:
    id: int
    prompt: PreparedPrompt
    sampling: SamplingParams
    policy: OutputPolicy
    sink: EventSink
    budget: int  # effective output tokens: min(max_tokens, max_context - prompt + 1)
    limit_reason: FinishReason  # why the request ends when the budget runs out
    counters: SpeculativeCounters | None
    on_admit: Callable[[], None] | None = None  # told on the engine thread when the request takes a lane
    submitted: float = attrs.Factory(time.perf_counter)
    phase: Phase = Phase.WAITING
    lane: Lane | None = None
    plan: ReusePlan = FULL_RESET
    capture: CheckpointTarget | None = None  # checkpoint still to take while prefilling
    cursor: int = 0  # next prompt token to prefill
    generated: int = 0
    drafts_ready: bool = False
    admitted: float = 0.0
    first_token: float = 0.0
    prefill_seconds: float = 0.0
    vision_seconds: float = 0.0
    media_rows: dict[int, np.ndarray] = attrs.Factory(dict)  # encoded items (prompt.media index) still to prefill
    media_encoded: int = 0  # encode_media calls made for this request

    @property
    def kv_tokens(self) -> int:
        """The page entitlement in tokens: the last output token never needs a KV slot."""
        return len(self.prompt) + self.budget - 1


@attrs.define(eq=False)
class Lane:
    index: int
    pages: list[int] = attrs.Factory(list)
    resident: Residency | None = None  # the sequence whose state the runner holds here
    request: Request | None = None  # the active request, None while idle
    last_used: int = 0


@attrs.frozen
class SchedulerSnapshot:
    running: int  # admitted requests
    prefilling: int
    decode_ready: int
    waiting: int


@attrs.define
class ThroughputCounters:
    """Cumulative counts for the periodic throughput report (serving.md's definitions)."""

    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    decode_tokens: int = 0  # tokens committed by decode rounds (each request's first token excluded)
    decode_rounds: int = 0
    decode_rows: int = 0  # decode row-rounds: avg batch = decode_rows / decode_rounds


class Scheduler:
    def __init__(self, runner: ModelRunner, config: EngineConfig, cold_tier: ColdTier | None = None) -> None:
        info = runner.info
        if info.lanes != config.max_concurrency or info.draft_tokens != config.draft_tokens:
            raise ValueError(f"runner built for {info.lanes} lanes and {info.draft_tokens} drafts, the engine is "
                             f"configured for {config.max_concurrency} and {config.draft_tokens}")
        if info.checkpoint_slots < len(CheckpointKind):
            raise ValueError(f"prefix reuse needs {len(CheckpointKind)} checkpoint slots per lane")
        if info.pages < pages_for(config.max_context, info.page_tokens):
            # Admission relies on it: with every lane idle, any request's entitlement fits (no endless wait).
            raise KVCapacityError(f"the runner's {info.pages} pages cannot hold one --max-context sequence")
        self.runner, self.config = runner, config
        self._page_tokens = info.page_tokens
        self.pool = PagePool(info.pages)
        self.lanes = [Lane(i) for i in range(info.lanes)]
        self.prefix = PrefixStats()
        self.cold_tier = cold_tier if cold_tier is not None else ColdTier([])
        # a runner that moves lane images between its device memory and the tier's arenas without host copies
        self._streams_images = bool(getattr(runner, "streams_lane_images", False))
        self.throughput = ThroughputCounters()
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []  # admission order
        self._clock = itertools.count(1)

    # ---- requests in and out ----

    def new_request(self, request_id: int, prompt: PreparedPrompt, max_tokens: int | None, sampling: SamplingParams,
                    policy: OutputPolicy, sink: EventSink) -> Request:
        """Validate and size a request (pure: safe on any thread); `enqueue` it on the engine thread."""
        config, prompt_tokens = self.config, len(prompt)
        if prompt_tokens > config.max_context:
            raise ContextLengthExceeded(prompt_tokens, config.max_context)
        if int(prompt.token_ids.max()) >= self.runner.info.vocab_ids:
            raise PromptError(f"token ids must be below {self.runner.info.vocab_ids}")
        if prompt.media and not self.runner.info.vision:
            raise MediaUnsupported("the prompt has image or video input, but Vision is disabled (start the server "
                                   "with --vision)")
        requested = config.default_max_tokens if max_tokens is None else max_tokens
        if requested < 1:
            raise PromptError(f"max_tokens must be at least 1, got {requested}")
        room = config.max_context - prompt_tokens + 1
        counters = SpeculativeCounters(config.draft_tokens) if config.draft_tokens else None
        return Request(id=request_id, prompt=prompt, sampling=sampling, policy=policy, sink=sink,
                       budget=min(requested, room), counters=counters,
                       limit_reason=FinishReason.CONTEXT_CAPACITY if requested > room else FinishReason.OUTPUT_LIMIT)

    def enqueue(self, request: Request) -> None:
        self._waiting.append(request)

    def cancel(self, request_id: int) -> None:
        """Finish the request now (a round boundary): a waiting one leaves the queue, an admitted one frees its
        pages and lane state immediately. Unknown or finished ids are ignored (the race is the caller's)."""
        for request in self._waiting:
            if request.id == request_id:
                self._waiting.remove(request)
                self._emit_final(request, FinishReason.CANCELLED, request.policy.close(FinishReason.CANCELLED))
                return
        for request in self._active:
            if request.id == request_id:
                self._finish(request, FinishReason.CANCELLED, request.policy.close(FinishReason.CANCELLED))
                return

    def fail_active(self, message: str) -> None:
        """The runner failed mid-round: every admitted request ends with an error, its lane wiped."""
        for request in list(self._active):
            self._finish(request, FinishReason.ERROR, request.policy.close(FinishReason.ERROR), error=message)

    def cancel_all(self) -> None:
        for request in list(self._waiting) + list(self._active):
            self.cancel(request.id)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    def snapshot(self) -> SchedulerSnapshot:
        phases = collections.Counter(r.phase for r in self._active)
        return SchedulerSnapshot(running=len(self._active), prefilling=phases[Phase.PREFILL],
                                 decode_ready=phases[Phase.DECODE], waiting=len(self._waiting))

    # ---- one boundary ----

    def step(self) -> None:
        """One boundary: admit what fits, run one prefill chunk (the oldest prefilling request), then one decode
        round over every decode-ready request (including one whose prefill just finished)."""
        self._admit()
        prefilling = next((r for r in self._active if r.phase is Phase.PREFILL), None)
        if prefilling is not None:
            self._prefill_chunk(prefilling)
        ready = [r for r in self._active if r.phase is Phase.DECODE]
        if ready:
            self._decode_round(ready)

    # ---- admission ----

    def _admit(self) -> None:
        while self._waiting:
            idle = [lane for lane in self.lanes if lane.request is None]
            if not idle:
                return
            request = self._waiting[0]
            if self.cold_tier.active and self.config.prefix_reuse:
                self._restore_parked(request, idle)
            lane, plan = self._choose_lane(request, idle)
            kept = pages_for(plan.frontier, self._page_tokens)
            needed = pages_for(request.kv_tokens, self._page_tokens) - kept
            evictable = sorted((other for other in idle if other is not lane and other.pages),
                               key=lambda other: other.last_used)
            reclaimable = len(lane.pages) - kept + sum(len(other.pages) for other in evictable)
            if self.pool.free + reclaimable < needed:
                return  # FIFO: nothing behind the head is admitted before it
            self._waiting.popleft()
            if plan.path is ReusePath.FULL_RESET:
                self._park(lane)  # an in-place reset takes the lane from its retained resident
            self._release_pages(lane, keep=kept)
            while self.pool.free < needed:
                self._evict(evictable.pop(0))
            lane.pages += self.pool.allocate(lane.index, needed)
            self._start(request, lane, plan)

    def _choose_lane(self, request: Request, idle: list[Lane]) -> tuple[Lane, ReusePlan]:
        """The idle lane whose resident gives the longest reuse; else an empty lane; else the least recently used
        resident, reset in place."""
        if self.config.prefix_reuse:
            plans = [(plan_reuse(lane.resident, request.prompt), lane) for lane in idle if lane.resident is not None]
            if plans:
                plan, lane = max(plans, key=lambda item: (item[0].frontier, item[1].last_used))
                if plan.frontier > 0:
                    return lane, plan
        empty = [lane for lane in idle if lane.resident is None]
        if empty:
            return empty[0], FULL_RESET
        return min(idle, key=lambda lane: lane.last_used), FULL_RESET

    def _start(self, request: Request, lane: Lane, plan: ReusePlan) -> None:
        prompt, runner = request.prompt, self.runner
        if plan.path is ReusePath.FULL_RESET:
            lane.resident = Residency()
            source = StateSource.RESET
        else:
            source = StateSource.RESIDENT if plan.checkpoint is None else StateSource.CHECKPOINT
        resident = lane.resident
        resident.forget_checkpoints_after(plan.frontier)
        resident.ledger.assign(prompt.token_ids, prompt.rope_positions, prompt.media)
        resident.frontier = plan.frontier
        runner.assign_pages(lane.index, np.array(lane.pages, np.int32))
        runner.begin_sequence(lane.index, SequenceStart(
            source=source, sampling=request.sampling,
            checkpoint_slot=-1 if plan.checkpoint is None else plan.checkpoint.slot))
        lane.request, lane.last_used = request, next(self._clock)
        self._active.append(request)
        request.lane, request.plan, request.cursor = lane, plan, plan.frontier
        request.phase, request.admitted = Phase.PREFILL, time.perf_counter()
        request.capture = checkpoint_to_capture(prompt, plan)
        if request.on_admit is not None:
            request.on_admit()
        self.prefix.record(plan, len(prompt),
                           deferred=request.capture is None and desired_checkpoint(prompt) is not None)
        if request.capture is not None and request.capture.position == plan.frontier:
            self._take_checkpoint(request)  # the restored (or resident) state already is the checkpoint's

    def _take_checkpoint(self, request: Request) -> None:
        target, lane = request.capture, request.lane
        if lane.resident.checkpoints.get(target.kind) != target.position:
            self.runner.save_checkpoint(lane.index, target.kind.slot)
            lane.resident.checkpoints[target.kind] = target.position
        request.capture = None

    # ---- prefill ----

    def _prefill_chunk(self, request: Request) -> None:
        prompt, lane, start = request.prompt, request.lane, request.cursor
        end = min(start + self.config.prefill_chunk, len(prompt))
        if request.capture is not None and start < request.capture.position < end:
            end = request.capture.position  # a chunk ends exactly at the checkpoint
        final = end == len(prompt)
        positions = prompt.rope_positions
        columns, rows = self._media_overrides(request, start, end)
        began = time.perf_counter()
        result = self.runner.prefill(PrefillChunk(
            lane=lane.index, token_ids=prompt.token_ids[start:end], positions=positions[:, start:end],
            kv_length=start, tail_position=positions[:, start - 1] if start else np.zeros(3, np.int32),
            final=final, remaining=request.budget, embedding_columns=columns, embedding_rows=rows))
        request.prefill_seconds += time.perf_counter() - began
        for index in [i for i in request.media_rows if int(prompt.media[i].columns[-1]) < end]:
            del request.media_rows[index]  # the item is fully prefilled: its rows are not needed again
        self.throughput.prefill_tokens += end - start
        request.cursor = lane.resident.frontier = end
        if request.capture is not None and request.capture.position == end:
            self._take_checkpoint(request)
        if final:
            request.first_token = time.perf_counter()
            request.phase = Phase.DECODE
            request.drafts_ready = result.drafts_ready
            self._commit(request, [result.token], decode_round=False)

    def _media_overrides(self, request: Request, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The embedding overrides of prompt tokens start..end-1: the Vision rows of the media columns there
        (chunk-relative columns), encoding each item the first time a chunk reaches it."""
        columns: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        for index, item in enumerate(request.prompt.media):
            if int(item.columns[-1]) < start:
                continue  # already prefilled, or inside the reused prefix
            if int(item.columns[0]) >= end:
                break
            lo, hi = np.searchsorted(item.columns, [start, end])
            if lo == hi:
                continue  # the chunk falls between two of a video's temporal slices
            embeddings = request.media_rows.get(index)
            if embeddings is None:
                began = time.perf_counter()
                embeddings = np.asarray(self.runner.encode_media(item), dtype=np.float32)
                request.vision_seconds += time.perf_counter() - began
                request.media_encoded += 1
                if embeddings.ndim != 2 or embeddings.shape[0] != len(item.columns):
                    raise ValueError(f"encode_media returned {embeddings.shape} for an item of "
                                     f"{len(item.columns)} columns")
                request.media_rows[index] = embeddings
            columns.append(item.columns[lo:hi] - start)
            rows.append(embeddings[lo:hi])
        if not columns:
            return np.zeros(0, np.int32), np.zeros((0, 0), np.float32)
        return np.concatenate(columns), np.concatenate(rows)

    # ---- decode ----

    def _decode_round(self, ready: list[Request]) -> None:
        batch = DecodeBatch(
            lanes=[r.lane.index for r in ready],
            input_tokens=[int(r.lane.resident.ledger.ids[-1]) for r in ready],
            kv_lengths=[r.lane.resident.frontier for r in ready],
            positions=[int(r.lane.resident.ledger.positions[0, -1]) for r in ready],
            speculative=[r.drafts_ready for r in ready],
            remaining=[r.budget - r.generated for r in ready])
        result = self.runner.decode(batch)
        self.throughput.decode_rounds += 1
        self.throughput.decode_rows += batch.size
        for b, request in enumerate(ready):
            if request.counters is not None:
                if batch.speculative[b]:
                    request.counters.record_round(int(result.accepted[b]))
                else:
                    request.counters.record_fallback()
            request.drafts_ready = bool(result.drafts_ready[b])
            self._commit(request, result.tokens[b, : result.counts[b]].tolist(), decode_round=True)

    # ---- output ----

    def _commit(self, request: Request, tokens: Sequence[int], *, decode_round: bool) -> None:
        """Offer a round's tokens to the policy and commit exactly the accepted prefix: ledger, frontier and (when a
        stop cut a speculative round) the runner's state, so the resident stays exact for the next turn."""
        verdict: Verdict = request.policy.accept(tokens)
        kept = verdict.accepted
        if not 1 <= kept <= len(tokens) or (kept < len(tokens) and verdict.finish is None):
            raise OutputPolicyError(f"request {request.id}: policy accepted {kept} of {len(tokens)} tokens "
                                    f"without finishing")
        resident = request.lane.resident
        if kept < len(tokens):
            self.runner.rewind(request.lane.index, kept)
        first_position = len(resident.ledger) + request.prompt.rope_delta  # generated tokens: equal axes
        resident.ledger.append(tokens[:kept], np.arange(first_position, first_position + kept))
        if decode_round:
            resident.frontier += kept
            self.throughput.decode_tokens += kept
        request.generated += kept
        request.sink(RequestEvent(request_id=request.id, tokens=tuple(tokens[:kept]), payload=verdict.payload))
        if verdict.finish is not None:
            self._finish(request, verdict.finish, None)
        elif request.generated >= request.budget:
            self._finish(request, request.limit_reason, request.policy.close(request.limit_reason))

    def _finish(self, request: Request, reason: FinishReason, payload, *, error: str | None = None) -> None:
        lane = request.lane
        request.media_rows.clear()
        self._active.remove(request)
        lane.request = None
        if reason in (FinishReason.CANCELLED, FinishReason.ERROR) or not self.config.prefix_reuse:
            self._evict(lane)  # no resident: pages and state go back now
        else:  # the lane retains the sequence: its pages up to the frontier, its checkpoints
            self._release_pages(lane, keep=pages_for(lane.resident.frontier, self._page_tokens))
        self._emit_final(request, reason, payload, error=error)

    def _emit_final(self, request: Request, reason: FinishReason, payload, *, error: str | None = None) -> None:
        now = time.perf_counter()
        timings = Timings(queued=(request.admitted or now) - request.submitted, prefill=request.prefill_seconds,
                          decode=now - request.first_token if request.first_token else 0.0,
                          total=now - request.submitted, vision=request.vision_seconds)
        usage = Usage(prompt_tokens=len(request.prompt), completion_tokens=request.generated,
                      cached_tokens=request.plan.frontier,
                      prefill_tokens=request.cursor - request.plan.frontier,
                      reuse_path=request.plan.path.value, speculative=request.counters, timings=timings)
        request.sink(RequestEvent(request_id=request.id, payload=payload, finish=reason, usage=usage, error=error))

    # ---- pages ----

    def _release_pages(self, lane: Lane, *, keep: int) -> None:
        self.pool.release(lane.index, lane.pages[keep:])
        del lane.pages[keep:]

    def _evict(self, lane: Lane) -> None:
        """Drop whatever sequence the lane holds (parked in the cold tier first when there is one): its pages return
        to the pool, the runner forgets its state."""
        self._park(lane)
        self._release_pages(lane, keep=0)
        lane.resident = None
        self.runner.release(lane.index)

    # ---- the cold tier ----

    def _park(self, lane: Lane) -> None:
        """Copy the lane's retained resident into the cold tier (best effort) before the lane is taken from it."""
        resident = lane.resident
        if not self.cold_tier.active or resident is None or resident.frontier == 0:
            return
        try:  # a streaming runner's view is parked at once, before the lane runs again
            export = self.runner.export_lane_view if self._streams_images else self.runner.export_lane
            image = export(lane.index, resident.frontier)
        except Exception:  # noqa: BLE001 - a failed copy loses only the parked copy, never the request
            self.cold_tier.counters.park_failures += 1
            return
        self.cold_tier.park(resident, image)

    def _restore_parked(self, request: Request, idle: list[Lane]) -> None:
        """Before lane selection: when a parked sequence reuses more of the request's prompt than any idle resident,
        swap it back into an idle lane (an empty one, else the least recently used, which is parked in turn) with
        freshly allocated pages. Skipped when the pages cannot be made free from idle lanes."""
        match = self.cold_tier.best_match(request.prompt)
        if match is None:
            return
        key, plan = match
        resident_best = max((plan_reuse(lane.resident, request.prompt).frontier for lane in idle
                             if lane.resident is not None), default=0)
        if resident_best >= plan.frontier:
            return
        empty = [lane for lane in idle if lane.resident is None and not lane.pages]
        target = empty[0] if empty else min(idle, key=lambda lane: lane.last_used)
        needed = self.cold_tier.pages_of(key)
        evictable = sorted((lane for lane in idle if lane is not target and lane.pages), key=lambda l: l.last_used)
        if self.pool.free + len(target.pages) + sum(len(lane.pages) for lane in evictable) < needed:
            return
        residency, image = self.cold_tier.take(key)  # its bytes stay reserved while lanes are parked below
        if target.resident is not None or target.pages:
            self._evict(target)
        while self.pool.free < needed:
            self._evict(evictable.pop(0))
        target.pages = list(self.pool.allocate(target.index, needed))
        self.runner.assign_pages(target.index, np.array(target.pages, np.int32))
        try:
            self.runner.import_lane(target.index, image if self._streams_images else host_image(image))
        except Exception:  # noqa: BLE001 - fall back to the normal admission path
            self.cold_tier.finish(key, restored=False)
            self._release_pages(target, keep=0)
            self.runner.release(target.index)
            return
        self.cold_tier.finish(key, restored=True)
        target.resident, target.last_used = residency, next(self._clock)
