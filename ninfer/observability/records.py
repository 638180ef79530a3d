"""The request log's per-request records, built from the engine's own results (never from generated text)."""

from __future__ import annotations

from typing import Any

import attrs

from ninfer.engine.request import Usage
from ninfer.engine.sampler import SamplingParams
from ninfer.engine.speculative import SpeculativeCounters


def sampler_record(sampling: SamplingParams | None) -> dict[str, Any] | None:
    """The resolved sampler, its seed included."""
    return None if sampling is None else attrs.asdict(sampling)


def speculative_record(backend: str | None, counters: SpeculativeCounters | None) -> dict[str, Any]:
    if counters is None:
        return {"backend": backend, "draft_window": 0, "rounds": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                "fallback_steps": 0, "accepted_per_position": []}
    return {"backend": backend, **attrs.asdict(counters)}


@attrs.frozen(kw_only=True)
class RequestClock:
    """Seconds of one request's server-side phases, measured on one monotonic clock (`time.perf_counter`)."""

    arrived: float  # the HTTP request reached the app
    submitted: float  # preparation finished; the request entered the engine queue
    first_token: float | None  # the first generated token reached the server
    finished: float


def timings_record(clock: RequestClock, usage: Usage | None) -> dict[str, float | None]:
    """request_done.timings_seconds: prepare (arrival to the engine queue), queue (engine FIFO wait), ttft
    (arrival to the first token), vision (the Vision tower), prefill and decode (the engine's own), and total
    (arrival to finish)."""
    return {"prepare": clock.submitted - clock.arrived,
            "queue": usage.timings.queued if usage is not None else None,
            "ttft": None if clock.first_token is None else clock.first_token - clock.arrived,
            "vision": usage.timings.vision if usage is not None else None,
            "prefill": usage.timings.prefill if usage is not None else None,
            "decode": usage.timings.decode if usage is not None else None,
            "total": clock.finished - clock.arrived}


def usage_record(usage: Usage | None, *, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Token counts. Without the engine's usage (the consumer left before the final event) only what the server saw
    itself is known."""
    if usage is None:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "cached_tokens": None,
                "computed_prefill_tokens": None, "prefix_reuse_path": None}
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens, "computed_prefill_tokens": usage.prefill_tokens,
            "prefix_reuse_path": usage.reuse_path}
