"""Prefix reuse (serving.md "Execution behavior", ninfer-facts §4.4): which resident state a new prompt may continue
from, and where the new request's checkpoint goes.

A lane's resident sequence has a ledger (token ids and 3-axis positions of the prompt and the accepted output) and an
execution frontier E: tokens whose KV and recurrent state are materialized (the newest token is not). Recurrent
state cannot be rolled back, so only two kinds of points are reusable: the frontier itself, and checkpoints (a
copy of the recurrent state, the hidden row before it and hence the MTP bridge, taken while prefilling). Matching KV
tokens alone never authorise a partial hit.

* append_frontier: the prompt continues the ledger's first E tokens; only the suffix is prefilled.
* restore_turn_checkpoint: back to the previous prompt's assistant boundary (after `<|im_start|>assistant\\n`),
  where a re-rendered closed turn (reasoning dropped) starts.
* restore_response_checkpoint: back to the end of the previous response's generation prologue, when the history
  re-renders that response (preserve_thinking) but its normalized text no longer matches the raw generated tokens:
  only the response and what follows are replayed.
* full_reset otherwise.

Media (serving.md, ninfer-facts §4.4): placeholder token ids are the same for every image, so a reuse point also
needs the same media before it: every item that starts before the point has the same identity (modality, digest,
grid) and the same columns (spans) in both prompts, which with equal ids makes the token types equal too; and no item
may be split by the point (a frontier never sits inside a Vision item). A changed earlier image therefore makes
every point at or after its first column invalid, and the plan falls back to an earlier checkpoint or a reset.
"""

from __future__ import annotations

import collections
import enum
from typing import Sequence

import attrs
import numpy as np

from ninfer.engine.request import PreparedPrompt, PromptMedia


class ReusePath(enum.Enum):
    FULL_RESET = "full_reset"
    APPEND_FRONTIER = "append_frontier"
    RESTORE_TURN_CHECKPOINT = "restore_turn_checkpoint"
    RESTORE_RESPONSE_CHECKPOINT = "restore_response_checkpoint"


class CheckpointKind(enum.Enum):
    TURN = 0  # at the assistant boundary
    RESPONSE = 1  # at the end of the generation prologue

    @property
    def slot(self) -> int:
        """The runner's checkpoint slot for this kind: each kind keeps (at most) one checkpoint per lane."""
        return self.value

    @property
    def restore_path(self) -> ReusePath:
        return ReusePath.RESTORE_TURN_CHECKPOINT if self is CheckpointKind.TURN else \
            ReusePath.RESTORE_RESPONSE_CHECKPOINT


@attrs.frozen(eq=False)
class MediaSpan:
    """What the ledger remembers of a prompt's media item: its identity and columns (not its patches)."""

    identity: tuple
    columns: np.ndarray

    @classmethod
    def of(cls, item: PromptMedia) -> MediaSpan:
        return cls(item.identity, item.columns)

    @property
    def first(self) -> int:
        return int(self.columns[0])

    @property
    def last(self) -> int:
        return int(self.columns[-1])

    def same_as(self, item: PromptMedia) -> bool:
        return self.identity == item.identity and np.array_equal(self.columns, item.columns)


def media_prefix_matches(spans: Sequence[MediaSpan], media: Sequence[PromptMedia], count: int) -> bool:
    """The media of a ledger (`spans`) and of a prompt agree on the first `count` tokens, and none is split there."""
    ours = [span for span in spans if span.first < count]
    theirs = [item for item in media if int(item.columns[0]) < count]
    if len(ours) != len(theirs) or not all(span.same_as(item) for span, item in zip(ours, theirs)):
        return False
    return all(span.last < count for span in ours)


class Ledger:
    """Token ids and `[3, n]` rope positions of a lane's sequence, growing as output is accepted, and the spans of
    its prompt's media."""

    def __init__(self) -> None:
        self._ids = np.zeros(0, np.int32)
        self._positions = np.zeros((3, 0), np.int32)
        self._length = 0
        self.media: tuple[MediaSpan, ...] = ()

    def __len__(self) -> int:
        return self._length

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self._length]

    @property
    def positions(self) -> np.ndarray:
        return self._positions[:, : self._length]

    def assign(self, ids: np.ndarray, positions: np.ndarray, media: Sequence[PromptMedia] = ()) -> None:
        self._length = 0
        self.media = tuple(MediaSpan.of(item) for item in media)
        self.append(ids, positions)

    def append(self, ids: Sequence[int] | np.ndarray, positions: np.ndarray) -> None:
        """Add tokens; `positions` is `[3, n]`, or `[n]` for tokens whose three axes are equal."""
        end = self._length + len(ids)
        if end > len(self._ids):
            capacity = max(end, 2 * len(self._ids), 64)
            self._ids = np.resize(self._ids, capacity)
            self._positions = np.concatenate([self._positions, np.zeros((3, capacity - self._positions.shape[1]),
                                                                        np.int32)], axis=1)
        self._ids[self._length : end] = ids
        self._positions[:, self._length : end] = positions
        self._length = end

    def matches(self, prompt: PreparedPrompt, count: int) -> bool:
        """The first `count` tokens of `prompt` have this ledger's ids, positions and media."""
        if count > min(len(self), len(prompt)):
            return False
        return bool(np.array_equal(self.ids[:count], prompt.token_ids[:count])
                    and np.array_equal(self.positions[:, :count], prompt.rope_positions[:, :count])
                    and media_prefix_matches(self.media, prompt.media, count))


@attrs.define
class Residency:
    """The sequence whose state a lane holds (running or retained): ledger, frontier E and checkpoint positions."""

    ledger: Ledger = attrs.Factory(Ledger)
    frontier: int = 0
    checkpoints: dict[CheckpointKind, int] = attrs.Factory(dict)

    def forget_checkpoints_after(self, position: int) -> None:
        """Drop checkpoints beyond `position`: the tokens after it are about to be rewritten."""
        self.checkpoints = {kind: at for kind, at in self.checkpoints.items() if at <= position}


@attrs.frozen
class ReusePlan:
    path: ReusePath
    frontier: int  # the reused prefix: prefill starts here, and usage reports it as cached_tokens
    checkpoint: CheckpointKind | None = None  # the checkpoint restored


FULL_RESET = ReusePlan(ReusePath.FULL_RESET, 0)


def plan_reuse(resident: Residency, prompt: PreparedPrompt) -> ReusePlan:
    """The longest valid reuse of `resident` for `prompt`: its frontier, else its latest matching checkpoint."""
    frontier = resident.frontier
    if frontier > 0 and resident.ledger.matches(prompt, frontier):
        return ReusePlan(ReusePath.APPEND_FRONTIER, frontier)
    for kind, at in sorted(resident.checkpoints.items(), key=lambda item: -item[1]):
        if resident.ledger.matches(prompt, at):
            return ReusePlan(kind.restore_path, at, kind)
    return FULL_RESET


@attrs.frozen
class CheckpointTarget:
    kind: CheckpointKind
    position: int


def desired_checkpoint(prompt: PreparedPrompt) -> CheckpointTarget | None:
    """preserve_thinking selects where the request's checkpoint should live: at the end of the response prologue
    (the next turn re-renders this response), otherwise at the assistant boundary (the next turn re-renders the
    closed turn without its reasoning)."""
    if prompt.preserve_thinking and prompt.prologue_end is not None:
        return CheckpointTarget(CheckpointKind.RESPONSE, prompt.prologue_end)
    if prompt.assistant_boundary is not None:
        return CheckpointTarget(CheckpointKind.TURN, prompt.assistant_boundary)
    return None


def checkpoint_to_capture(prompt: PreparedPrompt, plan: ReusePlan) -> CheckpointTarget | None:
    """The desired checkpoint when the request will pass it while prefilling (at or after the reuse frontier).
    One behind the frontier, with no snapshot there, is deferred: the valid hit is kept rather than reset."""
    target = desired_checkpoint(prompt)
    if target is None or target.position < plan.frontier:
        return None
    return target


@attrs.define
class PrefixStats:
    """Engine-wide prefix-reuse counters."""

    requests: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    deferred_checkpoints: int = 0
    paths: collections.Counter = attrs.Factory(collections.Counter)

    def record(self, plan: ReusePlan, prompt_tokens: int, *, deferred: bool) -> None:
        self.requests += 1
        self.hits += plan.frontier > 0
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += plan.frontier
        self.deferred_checkpoints += deferred
        self.paths[plan.path.value] += 1

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0
