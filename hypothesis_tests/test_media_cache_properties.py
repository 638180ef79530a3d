"""Random prepare / lookup / share / release / reserve / clear sequences against the prepared-media cache, checked
step by step against a reference model of its LRU and live account; and random concurrent request plans, where
single-flight holds, the live account never overflows, nobody deadlocks, and everything comes back."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ninfer.media.cache import (
    MediaBudgetExceeded,
    MediaKey,
    MediaWaitTimeout,
    PreparedMediaCache,
    ReleasedHandleError,
)

KEYS = [MediaKey.of(bytes([i]), "image" if i % 3 else "video") for i in range(8)]
sizes = st.integers(0, 120)


class Model:
    """The cache's specified behaviour, sequentially: live entries, the retained LRU, the reservation account."""

    def __init__(self, cache_limit: int, live_limit: int) -> None:
        self.cache_limit, self.live_limit = cache_limit, live_limit
        self.sizes: dict[MediaKey, int] = {}  # live entries
        self.refs: dict[MediaKey, int] = {}
        self.lru: OrderedDict[MediaKey, int] = OrderedDict()
        self.reserved = 0
        self.hits = self.misses = self.evictions = self.failures = self.rejections = self.timeouts = 0

    @property
    def live(self) -> int:
        return sum(self.sizes.values())

    @property
    def cached(self) -> int:
        return sum(self.lru.values())

    def free(self) -> int:
        return self.live_limit - self.live - self.reserved

    def make_room(self, n: int) -> bool:
        if self.free() >= n:
            return True
        unreferenced = [k for k in self.lru if not self.refs.get(k)]
        if self.free() + sum(self.lru[k] for k in unreferenced) < n:
            return False
        for k in unreferenced:
            if self.free() >= n:
                break
            self.evictions += 1
            self.unretain(k)
        return True

    def unretain(self, k: MediaKey) -> None:
        del self.lru[k]
        self.drop_if_dead(k)

    def drop_if_dead(self, k: MediaKey) -> None:
        if not self.refs.get(k) and k not in self.lru:
            del self.sizes[k]
            self.refs.pop(k, None)

    def retain(self, k: MediaKey) -> None:
        if self.sizes[k] > self.cache_limit:
            return
        self.lru[k] = self.sizes[k]
        while self.cached > self.cache_limit:
            self.evictions += 1
            self.unretain(next(iter(self.lru)))

    def touch(self, k: MediaKey) -> None:
        if k in self.lru:
            self.lru.move_to_end(k)
        else:
            self.retain(k)


class MediaCacheMachine(RuleBasedStateMachine):
    @initialize(cache_limit=st.integers(0, 400), live_limit=st.integers(0, 600))
    def start(self, cache_limit, live_limit):
        self.cache = PreparedMediaCache(cache_limit, live_limit)
        self.model = Model(cache_limit, live_limit)
        self.handles = []  # open handles
        self.released = []  # some released ones, for double-release attempts
        self.permits = []  # open permits with the model's view of what remains

    # --- rules --------------------------------------------------------------------------------------------------------

    def _get(self, i, size, permit_index, fail):
        k, m = KEYS[i], self.model
        permit = self.permits[permit_index % len(self.permits)] if permit_index is not None and self.permits else None
        calls = []

        def prepare():
            calls.append(1)
            if fail:
                raise RuntimeError("prepare failed")
            return bytes(size)

        if k in m.sizes:  # a hit: no build, no charge
            h = self.cache.get_or_prepare(k, prepare, permit=permit)
            m.hits += 1
            m.touch(k)
            m.refs[k] = m.refs.get(k, 0) + 1
            assert h.hit and not calls and len(h.payload) == m.sizes[k]
            self.handles.append(h)
            event("hit")
            return
        m.misses += 1
        from_permit = min(size, permit.remaining) if permit is not None else 0
        if fail:
            with pytest.raises(RuntimeError):
                self.cache.get_or_prepare(k, prepare, permit=permit)
            m.failures += 1
            event("failed prepare")
        elif size - from_permit and not m.make_room(size - from_permit):
            with pytest.raises(MediaBudgetExceeded):
                self.cache.get_or_prepare(k, prepare, permit=permit)
            m.failures += 1
            m.rejections += 1
            event("budget exceeded")
        else:
            h = self.cache.get_or_prepare(k, prepare, permit=permit)
            assert not h.hit and h.nbytes == size
            m.reserved -= from_permit
            m.sizes[k] = size
            m.refs[k] = 1
            m.retain(k)
            self.handles.append(h)
            event("miss")
        assert len(calls) == 1

    @rule(i=st.integers(0, len(KEYS) - 1), size=sizes)
    def prepare(self, i, size):
        self._get(i, size, None, False)

    @rule(i=st.integers(0, len(KEYS) - 1), size=sizes, permit=st.integers(0, 3))
    def prepare_under_permit(self, i, size, permit):
        self._get(i, size, permit, False)

    @rule(i=st.integers(0, len(KEYS) - 1), size=sizes, hint=st.integers(0, 700))
    def prepare_with_hint(self, i, size, hint):
        """No permit: a miss passes the gate for its size hint itself (without waiting: timeout 0)."""
        k, m = KEYS[i], self.model
        if k in m.sizes:
            return self._get(i, size, None, False)
        prepare = lambda: bytes(size)  # noqa: E731
        if hint > m.live_limit:
            with pytest.raises(MediaBudgetExceeded):
                self.cache.get_or_prepare(k, prepare, size_hint=hint, timeout=0)
            m.rejections += 1
            return
        if hint and not m.make_room(hint):
            with pytest.raises(MediaWaitTimeout):
                self.cache.get_or_prepare(k, prepare, size_hint=hint, timeout=0)
            m.timeouts += 1
            return
        m.misses += 1
        m.reserved += hint
        excess = size - min(size, hint)
        if excess and not m.make_room(excess):
            with pytest.raises(MediaBudgetExceeded):
                self.cache.get_or_prepare(k, prepare, size_hint=hint, timeout=0)
            m.failures += 1
            m.rejections += 1
        else:
            h = self.cache.get_or_prepare(k, prepare, size_hint=hint, timeout=0)
            assert not h.hit and h.nbytes == size
            m.sizes[k] = size
            m.refs[k] = 1
            m.retain(k)
            self.handles.append(h)
            event("miss under its own hint")
        m.reserved -= hint  # the private permit is closed: what the build used is live, the rest comes back

    @rule(i=st.integers(0, len(KEYS) - 1), size=sizes)
    def failing_prepare(self, i, size):
        self._get(i, size, None, True)

    @rule(i=st.integers(0, len(KEYS) - 1))
    def lookup(self, i):
        k, m = KEYS[i], self.model
        h = self.cache.lookup(k)
        assert (h is not None) == (k in m.sizes)
        if h is not None:
            m.hits += 1
            m.touch(k)
            m.refs[k] += 1
            self.handles.append(h)

    @precondition(lambda self: self.handles)
    @rule(pick=st.integers(0, 1000))
    def share(self, pick):
        h = self.handles[pick % len(self.handles)]
        self.handles.append(h.share())
        self.model.refs[h.key] += 1

    @precondition(lambda self: self.handles)
    @rule(pick=st.integers(0, 1000))
    def release(self, pick):
        h = self.handles.pop(pick % len(self.handles))
        h.release()
        self.model.refs[h.key] -= 1
        self.model.drop_if_dead(h.key)
        self.released.append(h)

    @precondition(lambda self: self.released)
    @rule(pick=st.integers(0, 1000))
    def double_release(self, pick):
        with pytest.raises(ReleasedHandleError):
            self.released[pick % len(self.released)].release()

    @rule(n=st.integers(0, 700))
    def reserve(self, n):
        m = self.model
        if n > m.live_limit:
            with pytest.raises(MediaBudgetExceeded):
                self.cache.reserve(n, timeout=0)
            m.rejections += 1
        elif n == 0 or m.make_room(n):
            self.permits.append(self.cache.reserve(n, timeout=0))
            m.reserved += n
        else:
            with pytest.raises(MediaWaitTimeout):
                self.cache.reserve(n, timeout=0)
            m.timeouts += 1

    @precondition(lambda self: self.permits)
    @rule(pick=st.integers(0, 1000))
    def close_permit(self, pick):
        permit = self.permits.pop(pick % len(self.permits))
        self.model.reserved -= permit.remaining
        permit.close()
        assert permit.remaining == 0

    @rule()
    def clear(self):
        self.cache.clear()
        for k in list(self.model.lru):
            self.model.unretain(k)

    # --- invariants ---------------------------------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self):
        self.cache.audit()
        s, m = self.cache.stats(), self.model
        referenced = {h.key for h in self.handles}
        assert s.live_bytes == sum(m.sizes[k] for k in referenced | set(m.lru)) == m.live
        assert s.cached_bytes == m.cached <= m.cache_limit
        assert s.referenced_bytes == sum(m.sizes[k] for k in referenced)
        assert s.live_bytes + s.reserved_bytes <= m.live_limit
        assert (s.entries, s.cached_entries, s.open_handles, s.open_permits, s.reserved_bytes) == \
            (len(m.sizes), len(m.lru), len(self.handles), len(self.permits), m.reserved)
        assert list(self.cache._lru) == list(m.lru)  # the same LRU order
        assert (s.hits, s.misses, s.evictions, s.failures, s.budget_rejections, s.wait_timeouts) == \
            (m.hits, m.misses, m.evictions, m.failures, m.rejections, m.timeouts)
        assert s.single_flight_joins == 0 and s.in_flight == 0 and s.waiting == 0
        assert all(v >= 0 for v in (s.live_bytes, s.cached_bytes, s.reserved_bytes, s.open_handles))
        assert all(count >= 0 for count in m.refs.values())

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for h in self.handles:
            h.release()
        for permit in self.permits:
            permit.close()
        self.cache.clear()
        s = self.cache.stats()
        assert (s.live_bytes, s.cached_bytes, s.referenced_bytes, s.reserved_bytes, s.entries, s.cached_entries,
                s.open_handles, s.open_permits) == (0,) * 8
        self.cache.audit()


MediaCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
test_media_cache_matches_its_model = MediaCacheMachine.TestCase


# --- concurrent requests ----------------------------------------------------------------------------------------------

class Corrupt(Exception):
    pass


item_sizes = st.integers(1, 200)
plans = st.lists(st.lists(st.tuples(st.integers(0, 9), st.booleans()), min_size=1, max_size=5), min_size=2,
                 max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cache_limit=st.integers(0, 600), live_limit=st.integers(200, 1000),
       sizes=st.lists(item_sizes, min_size=10, max_size=10), plans=plans, workers=st.integers(1, 4))
def test_concurrent_requests_share_builds_and_keep_the_account(cache_limit, live_limit, sizes, plans, workers):
    """Each request reserves its items' total, then builds them on a shared bounded pool under its permit; some
    items fail to prepare.  Single-flight: never two builds of one key at once.  The live account never exceeds its
    limit.  A request that cannot fit alone is refused at once; every other request completes (no deadlock), and
    every failed item reports its own error.  All bytes come back."""
    cache = PreparedMediaCache(cache_limit, live_limit)
    keys = [MediaKey.of(b"media-%d" % i, "image") for i in range(10)]
    lock = threading.Lock()
    building: dict[int, int] = {}
    problems: list[str] = []
    gate_queued: list[int] = []
    start = threading.Barrier(len(plans))

    def prepare(i: int, fail: bool):
        with lock:
            building[i] = building.get(i, 0) + 1
            if building[i] > 1:
                problems.append(f"two concurrent builds of {i}")
        s = cache.stats()
        if s.waiting:
            gate_queued.append(1)
        if s.live_bytes + s.reserved_bytes > live_limit:
            problems.append(f"live account overflow: {s}")
        threading.Event().wait(0.0005)
        with lock:
            building[i] -= 1
        if fail:
            raise Corrupt(f"item {i} is corrupt")
        return bytes(sizes[i])

    def request(plan, pool):
        plan = list(dict(plan).items())  # one entry per key; a key's failure flag is fixed per request
        total = sum(sizes[i] for i, _ in plan)
        start.wait()
        try:
            permit = cache.reserve(total, timeout=10)
        except MediaBudgetExceeded:
            assert total > live_limit
            return "rejected"
        handles, errors = [], []
        with permit:
            futures = [pool.submit(cache.get_or_prepare, keys[i], lambda i=i, f=f: prepare(i, f), permit=permit,
                                   timeout=10) for i, f in plan]
            for future in futures:
                try:
                    handles.append(future.result())
                except Corrupt as error:
                    errors.append(error)
        for h in handles:
            assert len(h.payload) == h.nbytes
            h.release()
        return "errors" if errors else "ok"

    with ThreadPoolExecutor(workers) as pool, ThreadPoolExecutor(len(plans)) as requests:
        outcomes = [f.result(timeout=30) for f in [requests.submit(request, plan, pool) for plan in plans]]
    for outcome in outcomes:
        event(outcome)
    event(f"requests queued at the gate during builds: {bool(gate_queued)}")
    assert not problems
    s = cache.stats()
    assert s.wait_timeouts == 0 and s.in_flight == 0 and s.waiting == 0
    assert s.open_handles == 0 and s.open_permits == 0 and s.reserved_bytes == 0
    assert s.cached_bytes <= cache_limit and s.live_bytes == s.cached_bytes
    cache.audit()
    cache.clear()
    s = cache.stats()
    assert (s.live_bytes, s.cached_bytes, s.entries) == (0, 0, 0)
