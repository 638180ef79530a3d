"""The serve options as one record. `ninfer.cli.serve` parses and validates them (serving.md's option table, with
the defaults); everything below the command line reads this record. Field names are the command-line options with
dashes as underscores (`--max-pending-requests` -> `max_pending_requests`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs

from ninfer.engine.config import EngineConfig
from ninfer.engine.sampler import SamplingOverrides

MIB = 1 << 20


@attrs.frozen(kw_only=True)
class ServeOptions:
    artifact: Path | None  # None: the bundled demo model
    host: str
    port: int
    api_key: str | None
    model_id: str | None  # None: the artifact's identity.model_id
    max_context: int
    kv_capacity: int | Literal["auto"] | None  # None: follows max_context
    max_concurrency: int
    max_pending_requests: int
    pending_timeout_ms: int
    prefill_chunk: int
    log_stats_interval_ms: int  # 0: no periodic stats
    device: int
    max_request_mib: int
    media_cache_mib: int
    media_live_mib: int
    media_preprocess_threads: int
    request_log_jsonl: Path | None
    response_store_max_records: int
    response_store_max_mib: int
    kv_dtype: str
    spec: str | None
    draft_tokens: int | None
    lm_head_draft: bool
    default_max_tokens: int
    vision: bool
    no_cuda_graph: bool
    no_prefix_reuse: bool
    cold_tier_device: int
    cold_tier_capacity_mib: int
    cold_tier_staging_mib: int
    no_cold_tier: bool
    no_thinking: bool
    preserve_thinking: bool
    cors: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    greedy: bool
    drain_timeout_ms: int  # ninfer's own: how long SIGTERM/SIGINT wait for in-flight requests
    argv: tuple[str, ...] = ()  # the command line as given (the request log records it with the API key redacted)

    @property
    def capacity(self) -> int:
        """Generation requests alive at once: active plus waiting (preparation and unsent results included)."""
        return self.max_concurrency + self.max_pending_requests

    @property
    def max_request_bytes(self) -> int:
        return self.max_request_mib * MIB

    @property
    def default_thinking(self) -> bool:
        return not self.no_thinking

    def engine_config(self) -> EngineConfig:
        """The engine's part of the options (EngineConfigError when they contradict each other)."""
        return EngineConfig(
            max_concurrency=self.max_concurrency, max_context=self.max_context, prefill_chunk=self.prefill_chunk,
            kv_capacity=self.kv_capacity, kv_dtype=self.kv_dtype, spec=self.spec,
            draft_tokens=self.draft_tokens or 0, lm_head_draft=self.lm_head_draft,
            prefix_reuse=not self.no_prefix_reuse, default_max_tokens=self.default_max_tokens, greedy=self.greedy,
            sampling=SamplingOverrides(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                       min_p=self.min_p, presence_penalty=self.presence_penalty,
                                       frequency_penalty=self.frequency_penalty, seed=self.seed))
