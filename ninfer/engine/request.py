"""What goes into the engine with a request and what comes back out of it.

A request is a PreparedPrompt (token ids and what the frontend knows about them), RequestOptions, and an
OutputPolicy that decides, round by round, how many generated tokens are accepted and whether the request is done.
Its results are RequestEvents: one per round that produced tokens, and a final one with the finish reason and usage.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, Sequence

import attrs
import numpy as np

from ninfer.engine.sampler import SamplingOverrides
from ninfer.engine.speculative import SpeculativeCounters


class PromptError(ValueError):
    """The prepared prompt is malformed (ids, positions or boundary indices out of range)."""


class ContextLengthExceeded(ValueError):
    """The prompt does not fit --max-context (the server's HTTP 400 context_length_exceeded)."""

    def __init__(self, prompt_tokens: int, max_context: int) -> None:
        super().__init__(f"the prompt has {prompt_tokens} tokens, more than the context limit of {max_context}")
        self.prompt_tokens, self.max_context = prompt_tokens, max_context


def _int32_array(value: Any) -> np.ndarray:
    array = np.array(value, dtype=np.int32)
    array.setflags(write=False)
    return array


def _optional_positions(value: Any) -> np.ndarray | None:
    return None if value is None else _int32_array(value)


@attrs.frozen(kw_only=True, eq=False)
class PromptMedia:
    """One image or video of a prompt: its prepared vision input and the placeholder columns its embeddings fill.

    digest: SHA-256 (hex) of the acquired bytes; with modality and grid it is the item's identity for prefix reuse.
    grid: (t, h, w) in patch units, as the preprocessor produced it.
    patches: uint16 bf16 bits `[t*h*w, patch_row]`, the vision tower's input (immutable, shared with the cache).
    columns: int32 prompt indices of the item's placeholder tokens (`<|image_pad|>` / `<|video_pad|>`), ascending,
        one per merged vision token: the tower's output row i replaces the embedding of column columns[i]. A video's
        columns are not contiguous (timestamps and frame delimiters sit between its temporal slices).
    """

    modality: str
    digest: str
    grid: tuple[int, int, int] = attrs.field(converter=lambda g: tuple(int(v) for v in g))
    patches: np.ndarray = attrs.field(repr=False)
    columns: np.ndarray = attrs.field(converter=_int32_array, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.modality not in ("image", "video"):
            raise PromptError(f"media modality must be image or video, got {self.modality!r}")
        if self.columns.ndim != 1 or self.columns.size == 0 or np.any(np.diff(self.columns) <= 0):
            raise PromptError("media columns must be a non-empty ascending 1-D sequence")

    @property
    def identity(self) -> tuple[str, str, tuple[int, int, int]]:
        return (self.modality, self.digest, self.grid)


@attrs.frozen(kw_only=True)
class PreparedPrompt:
    """A tokenized prompt as the frontend prepared it.

    token_ids: the complete prompt (chat template, tools and expanded media tokens).
    positions: `[3, T]` MRoPE (T, H, W) positions; None means text positions 0..T-1 on all three axes.
    thinking: the prompt opened a reasoning block; selects the thinking or non-thinking sampling preset.
    assistant_boundary: index just after the generation prompt's `<|im_start|>assistant\\n` (the turn checkpoint).
    prologue_end: index just after the complete deterministic generation prologue (`<think>\\n`, or the whole empty
        thinking block when thinking is off) - the prompt length for a generation prompt (the response checkpoint).
    preserve_thinking: the request keeps closed-turn reasoning, so its next turn re-renders this response: the
        engine then checkpoints at the prologue end instead of the assistant boundary.
    media: the prompt's images and videos in prompt order (empty for text); their columns never overlap.
    """

    token_ids: np.ndarray = attrs.field(converter=_int32_array, eq=False)
    positions: np.ndarray | None = attrs.field(default=None, converter=_optional_positions, eq=False)
    thinking: bool = False
    assistant_boundary: int | None = None
    prologue_end: int | None = None
    preserve_thinking: bool = False
    media: tuple[PromptMedia, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        count = len(self)
        previous_end = -1
        for item in self.media:
            if item.columns[0] <= previous_end or item.columns[-1] >= count:
                raise PromptError("media columns must lie inside the prompt, in prompt order, without overlap")
            previous_end = int(item.columns[-1])
        if self.token_ids.ndim != 1 or count == 0 or self.token_ids.min() < 0:
            raise PromptError("a prompt needs at least one non-negative token id, as a 1-D sequence")
        if self.positions is not None and self.positions.shape != (3, count):
            raise PromptError(f"positions must have shape [3, {count}], got {list(self.positions.shape)}")
        for name in ("assistant_boundary", "prologue_end"):
            index = getattr(self, name)
            if index is not None and not 1 <= index <= count:
                raise PromptError(f"{name} must be in 1..{count}, got {index}")

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def rope_positions(self) -> np.ndarray:
        """`[3, T]` positions, text positions when none were given."""
        if self.positions is not None:
            return self.positions
        return np.broadcast_to(np.arange(len(self), dtype=np.int32), (3, len(self)))

    @property
    def rope_delta(self) -> int:
        """Generated token i (i >= T) sits at position i + rope_delta on every axis (§3.12)."""
        return 0 if self.positions is None else int(self.positions.max()) + 1 - len(self)


@attrs.frozen(kw_only=True)
class RequestOptions:
    max_tokens: int | None = None  # output limit; None: the engine's default
    sampling: SamplingOverrides = SamplingOverrides()


class FinishReason(enum.Enum):
    STOP_TOKEN = "stop_token"  # wire: stop / end_turn
    STOP_STRING = "stop_string"  # wire: stop / end_turn
    OUTPUT_LIMIT = "output_limit"  # wire: length / max_tokens
    CONTEXT_CAPACITY = "context_capacity"  # the output limit was cut by --max-context; wire: length / max_tokens
    CANCELLED = "cancelled"
    ERROR = "error"


@attrs.frozen
class Verdict:
    """An output policy's decision on one round's tokens: accept the first `accepted` (at least one), and finish the
    request if `finish` is set. Fewer than all tokens may be accepted only when finishing. `payload` travels to the
    consumer untouched (e.g. the decoded text of the accepted tokens)."""

    accepted: int
    finish: FinishReason | None = None
    payload: Any = None


class OutputPolicy(Protocol):
    """Per request, stateful: decides stops. The server implements it with the frontend's OutputDecoder (stop ids,
    stop strings in decoded text); `StopTokenPolicy` is the plain token-id version. Called on the engine thread."""

    def accept(self, tokens: Sequence[int]) -> Verdict: ...

    def close(self, reason: FinishReason) -> Any:
        """The engine ended the request itself (limit, cancellation, error): flush; returns the final payload."""


class StopTokenPolicy:
    """Finish at the first stop id, which is accepted (it counts as a generated token)."""

    def __init__(self, stop_ids: frozenset[int] | set[int] = frozenset()) -> None:
        self.stop_ids = frozenset(stop_ids)

    def accept(self, tokens: Sequence[int]) -> Verdict:
        for index, token in enumerate(tokens):
            if token in self.stop_ids:
                return Verdict(index + 1, FinishReason.STOP_TOKEN)
        return Verdict(len(tokens))

    def close(self, reason: FinishReason) -> None:
        return None


@attrs.frozen(kw_only=True)
class Timings:
    queued: float  # seconds from submission to admission
    prefill: float  # seconds in this request's prefill chunks (to its first token)
    decode: float  # seconds from the first token to the finish
    total: float
    vision: float = 0.0  # seconds in the Vision tower (encode_media), not included in prefill


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # accepted generated ids, a stop token included
    cached_tokens: int  # the exact resident prefix reused (prompt tokens not recomputed)
    prefill_tokens: int  # prompt tokens actually computed
    reuse_path: str  # full_reset | append_frontier | restore_turn_checkpoint | restore_response_checkpoint
    speculative: SpeculativeCounters | None
    timings: Timings


@attrs.frozen(kw_only=True)
class RequestEvent:
    request_id: int
    tokens: tuple[int, ...] = ()  # accepted in this round
    payload: Any = None  # the policy's payload for these tokens, or its close() payload
    finish: FinishReason | None = None  # set on the request's last event
    usage: Usage | None = None  # with the last event
    error: str | None = None  # with FinishReason.ERROR
