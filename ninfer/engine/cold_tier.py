"""The cross-GPU cold tier (serving.md "Cross-GPU cold tier"): retained sequences parked instead of dropped.

When the scheduler takes a lane from a retained resident (an admission eviction, or an in-place reset for another
conversation), the resident's ledger stays here on the host and its `LaneImage` is serialized into an arena: a
byte range of memory on a secondary device. A later request whose prompt reuses the parked sequence (at its frontier
or at a checkpoint, by the same rules as a resident lane) gets it restored into a freshly allocated lane before lane
selection, and then takes the ordinary prefix-reuse path.

Arenas are LRU: parking evicts the least recently parked entries until the image fits. The tier is best effort: an
image larger than every arena, or a failed transfer, is counted and forgotten; the request proceeds as without the
tier. With no arenas (one GPU, the CPU backend, --no-cold-tier) the tier is inactive and nothing changes.

Images move without host copies where the runner allows it: an image's arrays may be device arrays (or `RowRuns` of
them), which a device arena moves through its pinned staging buffer; `take` hands back `ParkedArray`s that still live
in the arena, and the runner streams them into its own memory (or the caller reads them to the host with `host()`).
The entry's range stays reserved until `finish` reports how the restore ended.
"""

from __future__ import annotations

import itertools
from typing import Protocol, Sequence

import attrs
import numpy as np

from ninfer.engine.prefix import ReusePlan, Residency, plan_reuse
from ninfer.engine.request import PreparedPrompt
from ninfer.engine.runner import LaneImage

ALIGN = 256  # bytes: every array of an image starts at this alignment inside its arena range


class Arena(Protocol):
    """Memory that holds parked bytes: `capacity_bytes` of it, written and read at byte offsets. `data` and
    `destination` are C-contiguous host arrays or, for a device arena, device arrays too."""

    capacity_bytes: int

    def write(self, offset: int, data) -> None: ...

    def read(self, offset: int, nbytes: int) -> np.ndarray: ...

    def read_into(self, offset: int, destination) -> None: ...


@attrs.frozen(eq=False)
class RowRuns:
    """One image array held as consecutive row runs (the pages of a lane that are not contiguous in the pool):
    parked as if concatenated."""

    parts: tuple
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@attrs.frozen(eq=False)
class ParkedArray:
    """An array of a taken image, still in its arena until read."""

    arena: Arena
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def host(self) -> np.ndarray:
        # the arena hands back a fresh uint8 array: reinterpret it in place (an image can be gigabytes)
        return self.arena.read(self.offset, self.nbytes).view(self.dtype).reshape(self.shape)

    def copy_rows_to(self, first: int, destination) -> None:
        """Rows first.. of this array (as many as `destination`, a contiguous host or device array, holds)."""
        row_bytes = self.nbytes // self.shape[0]
        self.arena.read_into(self.offset + first * row_bytes, destination)


@attrs.define
class ColdTierCounters:
    parks: int = 0
    restores: int = 0
    evictions: int = 0  # LRU entries dropped to make room
    park_failures: int = 0
    restore_failures: int = 0


@attrs.define(eq=False)
class ParkedEntry:
    residency: Residency
    tokens: int
    pages: int
    has_tail: bool
    layout: list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, offset within the range)
    arena: int
    offset: int
    nbytes: int


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class ColdTier:
    def __init__(self, arenas: Sequence[Arena]) -> None:
        self.arenas = list(arenas)
        self.counters = ColdTierCounters()
        self._entries: dict[int, ParkedEntry] = {}  # park order = LRU order (restored entries leave the tier)
        self._in_transit: dict[int, ParkedEntry] = {}  # taken, being restored: their ranges stay reserved
        self._ids = itertools.count()

    @property
    def active(self) -> bool:
        return bool(self.arenas)

    @property
    def capacity_bytes(self) -> int:
        return sum(arena.capacity_bytes for arena in self.arenas)

    @property
    def used_bytes(self) -> int:
        return sum(entry.nbytes for entry in (*self._entries.values(), *self._in_transit.values()))

    @property
    def entries(self) -> int:
        return len(self._entries)

    def parked(self) -> dict[int, ParkedEntry]:
        """The entries by id, oldest parked first (a copy: the LRU order eviction follows)."""
        return dict(self._entries)

    def stats(self) -> dict[str, int]:
        """The request log's cold-tier fields."""
        return {"cold_tier_parks": self.counters.parks, "cold_tier_restores": self.counters.restores,
                "cold_tier_evictions": self.counters.evictions,
                "cold_tier_park_failures": self.counters.park_failures,
                "cold_tier_restore_failures": self.counters.restore_failures,
                "cold_tier_capacity_bytes": self.capacity_bytes, "cold_tier_used_bytes": self.used_bytes,
                "cold_tier_entries": self.entries}

    # ---- parking ----

    def park(self, residency: Residency, image: LaneImage) -> bool:
        """Keep `residency` (the caller gives up the object) and a copy of `image`'s bytes; False when it cannot
        (counted as a park failure)."""
        layout, size = [], 0
        for name, array in image.arrays.items():
            layout.append((name, np.dtype(array.dtype).str, tuple(array.shape), size))
            size += _aligned(array.nbytes)
        place = self._make_room(size)
        if place is None:
            self.counters.park_failures += 1
            return False
        arena_index, offset = place
        arena = self.arenas[arena_index]
        try:
            for (name, _, _, at), array in zip(layout, image.arrays.values()):
                for part in array.parts if isinstance(array, RowRuns) else (array,):
                    arena.write(offset + at, part)
                    at += part.nbytes
        except Exception:  # noqa: BLE001 - best effort: a failed transfer never fails the request
            self.counters.park_failures += 1
            return False
        self._entries[next(self._ids)] = ParkedEntry(residency, image.tokens, image.pages, image.has_tail, layout,
                                                     arena_index, offset, size)
        self.counters.parks += 1
        return True

    def _make_room(self, size: int) -> tuple[int, int] | None:
        """(arena, offset) of a free range of `size` bytes, evicting the oldest entries until one exists."""
        if not any(size <= arena.capacity_bytes for arena in self.arenas):
            return None
        while True:
            for index, arena in enumerate(self.arenas):
                offset = self._first_fit(index, size)
                if offset is not None:
                    return index, offset
            if not self._entries:  # what is left is being restored
                return None
            oldest = next(iter(self._entries))
            del self._entries[oldest]
            self.counters.evictions += 1

    def _first_fit(self, arena_index: int, size: int) -> int | None:
        used = sorted((e.offset, e.offset + e.nbytes) for e in (*self._entries.values(), *self._in_transit.values())
                      if e.arena == arena_index)
        cursor = 0
        for start, stop in used:
            if start - cursor >= size:
                return cursor
            cursor = max(cursor, stop)
        return cursor if self.arenas[arena_index].capacity_bytes - cursor >= size else None

    # ---- restoring ----

    def best_match(self, prompt: PreparedPrompt) -> tuple[int, ReusePlan] | None:
        """The parked entry with the longest valid reuse of `prompt` (entry id, plan), newest first on ties."""
        best = None
        for key, entry in self._entries.items():
            plan = plan_reuse(entry.residency, prompt)
            if plan.frontier > 0 and (best is None or plan.frontier >= best[1].frontier):
                best = (key, plan)
        return best

    def pages_of(self, key: int) -> int:
        return self._entries[key].pages

    def take(self, key: int) -> tuple[Residency, LaneImage]:
        """Remove the entry from matching and hand back its ledger and its image as `ParkedArray`s; the bytes stay
        reserved until `finish`."""
        entry = self._entries.pop(key)
        self._in_transit[key] = entry
        arena = self.arenas[entry.arena]
        arrays = {name: ParkedArray(arena, entry.offset + at, np.dtype(dtype), tuple(shape))
                  for name, dtype, shape, at in entry.layout}
        return entry.residency, LaneImage(tokens=entry.tokens, pages=entry.pages, has_tail=entry.has_tail,
                                          arrays=arrays)

    def finish(self, key: int, *, restored: bool) -> None:
        """The restore of a taken entry ended (a failed one is counted); its range is free again."""
        del self._in_transit[key]
        if restored:
            self.counters.restores += 1
        else:
            self.counters.restore_failures += 1


def host_image(image: LaneImage) -> LaneImage:
    """`image` with every array read to host memory (for runners that do not stream parked arrays)."""
    arrays = {name: array.host() if isinstance(array, ParkedArray) else array for name, array in image.arrays.items()}
    return attrs.evolve(image, arrays=arrays)
