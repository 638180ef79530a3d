"""Prometheus metrics (text exposition format 0.0.4) for GET /metrics, written without a client library.

The gauges come from the engine's last round-boundary snapshot, its page pool and the admission gate; the counters
from the engine's cumulative throughput and prefix-reuse counts, plus the finished requests counted by the serving
context (`RequestCounters`). The load gauges are also exported under the vLLM names that the Gateway API Inference
Extension's model-server protocol reads (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` and the older `vllm:gpu_cache_usage_perc`).
"""

from __future__ import annotations

import collections
import math
from typing import Any, Iterable, Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RequestCounters:
    """Generation requests that ended in the engine, by finish reason (stop_token, output_limit, cancelled,
    error...), and requests refused before the engine took them, by error code."""

    def __init__(self) -> None:
        self.finished: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()

    def count(self, finish_reason: str) -> None:
        self.finished[finish_reason] += 1

    def reject(self, code: str) -> None:
        self.rejected[code] += 1


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Exposition:
    """Families in the order added; each family's HELP and TYPE once, then its samples."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[Mapping[str, str], float]] | float) -> None:
        self._lines.append(f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        self._lines.append(f"# TYPE {name} {kind}")
        if isinstance(samples, (int, float)):
            samples = [({}, samples)]
        for labels, value in samples:
            sample = f"{name}_total" if kind == "counter" and not name.endswith("_total") else name
            if labels:
                rendered = ",".join(f'{key}="{_escape_label(str(val))}"' for key, val in labels.items())
                sample = f"{sample}{{{rendered}}}"
            self._lines.append(f"{sample} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def render(engine: Any, gate: Any, counters: RequestCounters | None, *, model: str) -> str:
    """The whole /metrics page. `engine`: Engine (snapshot(), throughput, prefix_stats, kv_pool_usage);
    `gate`: the AdmissionGate (outstanding, capacity)."""
    snapshot = engine.snapshot()
    throughput, prefix = engine.throughput, engine.prefix_stats
    usage = min(1.0, max(0.0, engine.kv_pool_usage))
    outstanding, capacity = gate.outstanding, gate.capacity
    label = {"model_name": model}
    out = Exposition()
    out.family("ninfer_requests_running", "gauge", "Requests admitted by the engine (prefilling or decoding).",
               snapshot.running)
    out.family("ninfer_requests_waiting", "gauge", "Requests submitted to the engine and waiting for admission.",
               snapshot.waiting)
    out.family("ninfer_requests_prefilling", "gauge", "Admitted requests still prefilling.", snapshot.prefilling)
    out.family("ninfer_requests_decode_ready", "gauge", "Admitted requests ready to decode.", snapshot.decode_ready)
    out.family("ninfer_requests_outstanding", "gauge", "Generation requests holding a capacity slot (preparation, "
               "queue, generation and writing the response).", outstanding)
    out.family("ninfer_requests_capacity", "gauge", "Capacity slots: --max-concurrency plus --max-pending-requests.",
               capacity)
    out.family("ninfer_kv_cache_usage_ratio", "gauge", "Fraction of the KV page pool allocated (0..1).", usage)
    out.family("ninfer_prompt_tokens", "counter", "Prompt tokens of requests admitted by the engine.",
               prefix.prompt_tokens)
    out.family("ninfer_prefix_cache_hit_tokens", "counter", "Prompt tokens reused from the prefix cache.",
               prefix.cached_tokens)
    out.family("ninfer_prefix_cache_queries", "counter", "Requests that looked up the prefix cache.",
               prefix.requests)
    out.family("ninfer_prefix_cache_hits", "counter", "Requests that reused a cached prefix.", prefix.hits)
    out.family("ninfer_prefill_tokens", "counter", "Prompt tokens computed by prefill (prefix-cache hits excluded).",
               throughput.prefill_tokens)
    out.family("ninfer_generation_tokens", "counter", "Tokens committed by decode rounds (each request's first "
               "token, produced by prefill, excluded).", throughput.decode_tokens)
    out.family("ninfer_decode_rounds", "counter", "Decode rounds run by the engine.", throughput.decode_rounds)
    counters = counters or RequestCounters()
    out.family("ninfer_requests_finished", "counter", "Generation requests that ended, by finish reason.",
               [({"finish_reason": reason}, count) for reason, count in sorted(counters.finished.items())])
    out.family("ninfer_requests_rejected", "counter", "Generation requests refused before the engine took them, "
               "by error code.", [({"code": code}, count) for code, count in sorted(counters.rejected.items())])
    # The Gateway API Inference Extension's model-server protocol (vLLM names).
    out.family("vllm:num_requests_running", "gauge", "Number of requests currently running.",
               [(label, snapshot.running)])
    out.family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [(label, snapshot.waiting)])
    out.family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [(label, usage)])
    out.family("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage (older name). 1 means 100 percent usage.",
               [(label, usage)])
    return out.text()
