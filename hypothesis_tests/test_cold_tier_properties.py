"""Cold-tier arenas under any sequence of parks and restores: parked ranges never overlap or leave their arena, the
byte account matches the entries, every restored image is the one parked, and eviction takes the oldest first."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from ninfer.engine.cold_tier import ColdTier
from ninfer.engine.prefix import Residency
from ninfer.engine.request import PreparedPrompt
from ninfer.engine.runner import LaneImage
from tests.test_cold_tier import HostArena


def resident(frontier: int) -> Residency:
    r = Residency()
    ids = np.arange(10_000 + frontier, 10_000 + 2 * frontier + 1, dtype=np.int32)  # distinct per frontier
    r.ledger.assign(ids, np.tile(np.arange(len(ids)), (3, 1)), ())
    r.frontier = frontier
    return r


operations = st.lists(st.tuples(st.sampled_from(["park", "restore"]), st.integers(1, 40), st.integers(1, 3000)),
                      min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(operations=operations, capacities=st.lists(st.integers(2_000, 12_000), min_size=1, max_size=3))
def test_arenas_stay_consistent(operations, capacities):
    tier = ColdTier([HostArena(c) for c in capacities])
    parked: dict[int, np.ndarray] = {}  # entry id -> the bytes parked in it
    for op, frontier, size in operations:
        if op == "park":
            data = np.random.default_rng(frontier * 7919 + size).integers(0, 255, size, dtype=np.uint8)
            before = tier.parked()
            ok = tier.park(resident(frontier), LaneImage(tokens=frontier, pages=1, has_tail=True,
                                                         arrays={"bytes": data}))
            if ok:
                (new_key,) = set(tier.parked()) - set(before)
                parked[new_key] = data
                old_keys = list(before)
                kept = [k for k in old_keys if k in tier.parked()]
                assert kept == old_keys[len(old_keys) - len(kept):]  # evictions took the oldest entries
            else:
                assert -(-size // 256) * 256 > max(capacities)  # only an image larger than every arena is refused
        else:
            prompt = PreparedPrompt(token_ids=resident(frontier).ledger.ids[: frontier + 1])
            match = tier.best_match(prompt)
            if match is not None:
                _, image = tier.take(match[0])
                np.testing.assert_array_equal(image.arrays["bytes"].host(), parked.pop(match[0]))
                tier.finish(match[0], restored=True)
        for index, arena in enumerate(tier.arenas):
            ranges = sorted((e.offset, e.offset + e.nbytes) for e in tier.parked().values() if e.arena == index)
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
            assert all(0 <= start and end <= arena.capacity_bytes for start, end in ranges)
        assert tier.used_bytes == sum(e.nbytes for e in tier.parked().values()) <= tier.capacity_bytes


@settings(max_examples=60, deadline=None)
@given(first=st.integers(500, 4000), parks=st.lists(st.integers(1, 5000), max_size=12),
       capacity=st.integers(4_096, 12_000))
def test_parks_made_during_a_restore_never_overwrite_the_entry_in_transit(first, parks, capacity):
    """The scheduler parks the lanes it takes between `take` and the import: the taken range stays reserved."""
    tier = ColdTier([HostArena(capacity)])
    original = np.random.default_rng(first).integers(0, 255, first, dtype=np.uint8)
    assert tier.park(resident(1), LaneImage(tokens=1, pages=1, has_tail=True, arrays={"bytes": original}))
    key, _ = tier.best_match(PreparedPrompt(token_ids=resident(1).ledger.ids[:2]))
    _, taken = tier.take(key)
    for n, size in enumerate(parks):
        data = np.full(size, n + 1, np.uint8)
        tier.park(resident(2 + n), LaneImage(tokens=2 + n, pages=1, has_tail=True, arrays={"bytes": data}))
        assert tier.used_bytes <= tier.capacity_bytes
    np.testing.assert_array_equal(taken.arrays["bytes"].host(), original)
    before = tier.used_bytes
    tier.finish(key, restored=True)
    assert tier.used_bytes == before - (-(-first // 256) * 256) and tier.counters.restores == 1
