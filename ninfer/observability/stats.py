"""Periodic aggregate activity (serving.md): every --log-stats-interval-ms, the token and round deltas of the
interval and the scheduler snapshot at its end, as a console line and a JSONL `throughput` event. Fully idle zero
intervals are omitted.

prefill counts prompt tokens actually computed (prefix-cache hits excluded); decode counts tokens committed by
decode rounds (each request's first token, produced by prefill, excluded); avg_decode_batch is decode row-rounds
over decode rounds.
"""

from __future__ import annotations

import logging
import time

import attrs
import trio

from ninfer.engine.engine import Engine
from ninfer.engine.scheduler import SchedulerSnapshot, ThroughputCounters
from ninfer.observability.request_log import RequestLog

log = logging.getLogger("ninfer.stats")


@attrs.frozen(kw_only=True)
class ThroughputInterval:
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    decode_rounds: int
    decode_rows: int
    snapshot: SchedulerSnapshot

    @property
    def idle(self) -> bool:
        counts = (self.prefill_tokens, self.decode_tokens, self.decode_rounds, self.snapshot.running,
                  self.snapshot.waiting)
        return not any(counts)

    def record(self) -> dict:
        """The JSONL `throughput` event: the raw deltas first, the derived rates after them."""
        return {"interval_seconds": self.seconds, "prefill_tokens": self.prefill_tokens,
                "decode_tokens": self.decode_tokens, "decode_rounds": self.decode_rounds,
                "decode_rows": self.decode_rows, "prefill_tok_s": self.prefill_tokens / self.seconds,
                "decode_tok_s": self.decode_tokens / self.seconds,
                "avg_decode_batch": self.decode_rows / self.decode_rounds if self.decode_rounds else 0.0,
                **attrs.asdict(self.snapshot)}

    def line(self) -> str:
        r = self.record()
        return (f"throughput: prefill={r['prefill_tok_s']:.1f} tok/s decode={r['decode_tok_s']:.1f} tok/s "
                f"avg_decode_batch={r['avg_decode_batch']:.2f} running={r['running']} prefilling={r['prefilling']} "
                f"decode_ready={r['decode_ready']} waiting={r['waiting']}")


class ThroughputMeter:
    """Deltas of the engine's cumulative counters since the previous reading."""

    def __init__(self, counters: ThroughputCounters, now: float) -> None:
        self._counters = counters
        self._last = attrs.evolve(counters)
        self._last_time = now

    def read(self, snapshot: SchedulerSnapshot, now: float) -> ThroughputInterval:
        current, previous = attrs.evolve(self._counters), self._last
        interval = ThroughputInterval(
            seconds=now - self._last_time, prefill_tokens=current.prefill_tokens - previous.prefill_tokens,
            decode_tokens=current.decode_tokens - previous.decode_tokens,
            decode_rounds=current.decode_rounds - previous.decode_rounds,
            decode_rows=current.decode_rows - previous.decode_rows, snapshot=snapshot)
        self._last, self._last_time = current, now
        return interval


async def report_throughput(engine: Engine, request_log: RequestLog, interval_seconds: float) -> None:
    """Runs until cancelled."""
    meter = ThroughputMeter(engine.throughput, time.perf_counter())
    while True:
        await trio.sleep(interval_seconds)
        interval = meter.read(engine.snapshot(), time.perf_counter())
        if interval.idle:
            continue
        log.info(interval.line())
        request_log.write("throughput", **interval.record())
