"""Startup-fixed engine configuration (serving.md's option table, the engine's part of it), validated once."""

from __future__ import annotations

from typing import Literal

import attrs

from ninfer.engine.sampler import SamplingOverrides

MAX_LANES = 8
MAX_CONTEXT_LIMIT = 262144
PREFILL_CHUNK_QUANTUM = 128
MTP_DRAFT_RANGE = range(1, 6)
DFLASH_DRAFT_RANGE = range(1, 16)
DRAFT_RANGES = {"mtp": MTP_DRAFT_RANGE, "dflash": DFLASH_DRAFT_RANGE}  # --spec -> legal --draft-tokens


class EngineConfigError(ValueError):
    """An engine option is out of range or contradicts another (startup rejection)."""


@attrs.frozen(kw_only=True)
class EngineConfig:
    max_concurrency: int = 1  # active generation requests (lanes), 1..8
    max_context: int = 8192  # each sequence's logical ceiling, prompt + output
    prefill_chunk: int = 1024  # prompt tokens per prefill step, a positive multiple of 128
    kv_capacity: int | Literal["auto"] | None = None  # shared pool tokens; None follows max_context
    kv_dtype: str = "bf16"  # "bf16" | "int8"
    spec: str | None = None  # "mtp" | "dflash" | None
    draft_tokens: int = 0  # draft window k: 1..5 with spec="mtp", 1..15 with spec="dflash"
    lm_head_draft: bool = False  # proposals from the shortlist head (when the artifact has one)
    prefix_reuse: bool = True
    default_max_tokens: int = 8192  # output limit of a request that gives none
    greedy: bool = False  # force temperature 0 for every request
    sampling: SamplingOverrides = SamplingOverrides()  # process-level flags (--temperature ... --seed)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.max_concurrency <= MAX_LANES:
            raise EngineConfigError(f"--max-concurrency must be in 1..{MAX_LANES}, got {self.max_concurrency}")
        if not 1 <= self.max_context <= MAX_CONTEXT_LIMIT:
            raise EngineConfigError(f"--max-context must be in 1..{MAX_CONTEXT_LIMIT}, got {self.max_context}")
        if self.prefill_chunk <= 0 or self.prefill_chunk % PREFILL_CHUNK_QUANTUM:
            raise EngineConfigError(f"--prefill-chunk must be a positive multiple of {PREFILL_CHUNK_QUANTUM}, "
                                    f"got {self.prefill_chunk}")
        if self.kv_dtype not in ("bf16", "int8"):
            raise EngineConfigError(f"--kv-dtype must be bf16 or int8, got {self.kv_dtype!r}")
        if self.spec is None:
            if self.draft_tokens or self.lm_head_draft:
                raise EngineConfigError("--draft-tokens and --lm-head-draft need --spec")
        elif self.spec in DRAFT_RANGES:
            window = DRAFT_RANGES[self.spec]
            if self.draft_tokens not in window:
                raise EngineConfigError(f"--spec {self.spec} needs --draft-tokens in "
                                        f"{window.start}..{window.stop - 1}, got {self.draft_tokens}")
        else:
            raise EngineConfigError(f"--spec {self.spec!r} is not supported (choose one of {', '.join(DRAFT_RANGES)})")
        if self.default_max_tokens < 1:
            raise EngineConfigError(f"--default-max-tokens must be at least 1, got {self.default_max_tokens}")
