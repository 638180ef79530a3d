"""The prepared-media cache: keys, LRU retention, the live account, handles, single-flight builds and the
preparation gate (serving.md's media-cache paragraph; issue "Vision", item 3)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from ninfer.media import MediaError
from ninfer.media.cache import (
    MediaBudgetExceeded,
    MediaHandle,
    MediaKey,
    MediaWaitCancelled,
    MediaWaitTimeout,
    PreparedMediaCache,
    ReleasedHandleError,
    default_size_of,
)
from ninfer.media.image import ProcessedImage
from tests.support.waiting import wait_until


def key(name: str, modality: str = "image") -> MediaKey:
    return MediaKey.of(name.encode(), modality)


def blob(n: int) -> bytes:
    return bytes(n)


def get(cache: PreparedMediaCache, name: str, n: int, **kwargs) -> MediaHandle:
    return cache.get_or_prepare(key(name), lambda: blob(n), **kwargs)


def assert_empty(cache: PreparedMediaCache) -> None:
    cache.clear()
    cache.audit()
    s = cache.stats()
    assert (s.live_bytes, s.cached_bytes, s.reserved_bytes, s.entries, s.cached_entries, s.open_handles,
            s.open_permits, s.in_flight, s.waiting, s.referenced_bytes) == (0,) * 10


# --- keys and sizes ---------------------------------------------------------------------------------------------------


def test_key_is_sha256_of_bytes_plus_modality():
    import hashlib

    k = MediaKey.of(b"abc", "image")
    assert k.digest == hashlib.sha256(b"abc").hexdigest() and k.modality == "image"
    assert MediaKey.of(bytearray(b"abc"), "image") == k == MediaKey.of(memoryview(b"abc"), "image")
    assert MediaKey.of(b"abc", "video") != k
    assert MediaKey.of(b"abd", "image") != k
    assert str(k) == f"image:{k.digest}"
    with pytest.raises(ValueError):
        MediaKey.of(b"abc", "audio")
    with pytest.raises(ValueError):
        MediaKey("not-a-digest", "image")


def test_a_video_and_an_image_of_the_same_bytes_are_separate_entries():
    cache = PreparedMediaCache(1000, 1000)
    with cache.get_or_prepare(MediaKey.of(b"x", "image"), lambda: blob(10)) as a, \
            cache.get_or_prepare(MediaKey.of(b"x", "video"), lambda: blob(20)) as b:
        assert not a.hit and not b.hit and a.payload is not b.payload
    assert cache.stats().entries == 2 and cache.stats().live_bytes == 30


def test_default_size_of():
    assert default_size_of(blob(7)) == 7
    assert default_size_of(np.zeros((4, 8), np.float32)) == 128
    image = ProcessedImage(np.zeros((16, 1536), np.float32), (1, 4, 4))
    assert default_size_of(image) == image.patches.nbytes
    with pytest.raises(TypeError):
        default_size_of(object())
    cache = PreparedMediaCache(100, 100, size_of=lambda p: 3)
    with cache.get_or_prepare(key("a"), lambda: object()) as h:
        assert h.nbytes == 3


def test_limits_from_mib_and_bad_arguments():
    cache = PreparedMediaCache.from_mib(1024, 2048)
    assert (cache.cache_limit, cache.live_limit) == (1024 << 20, 2048 << 20)
    with pytest.raises(ValueError):
        PreparedMediaCache(-1, 10)
    with pytest.raises(ValueError):
        cache.reserve(-1)
    with pytest.raises(ValueError):
        get(cache, "a", 1, size_hint=-1)
    with pytest.raises(TypeError):
        cache.get_or_prepare("a", lambda: blob(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        get(PreparedMediaCache(10, 10, size_of=lambda p: -1), "a", 1)


# --- hits, LRU, eviction ----------------------------------------------------------------------------------------------


def test_hit_returns_a_new_reference_to_the_same_payload():
    cache = PreparedMediaCache(1000, 1000)
    calls = []

    def prepare():
        calls.append(1)
        return blob(100)

    first = cache.get_or_prepare(key("a"), prepare)
    second = cache.get_or_prepare(key("a"), prepare)
    assert len(calls) == 1 and not first.hit and second.hit and second.payload is first.payload
    s = cache.stats()
    assert (s.hits, s.misses, s.open_handles, s.live_bytes, s.referenced_bytes) == (1, 1, 2, 100, 100)
    first.release()
    second.release()
    s = cache.stats()
    assert (s.open_handles, s.live_bytes, s.cached_bytes, s.referenced_bytes) == (0, 100, 100, 0)  # retained
    assert cache.lookup(key("a")).release() is None and cache.lookup(key("b")) is None
    assert cache.stats().hits == 2
    assert_empty(cache)


def test_lru_evicts_the_least_recently_used():
    cache = PreparedMediaCache(300, 10_000)
    for name in "abc":
        get(cache, name, 100).release()
    get(cache, "a", 100).release()  # a is now the most recent: b is the oldest
    get(cache, "d", 100).release()
    assert key("b") not in cache and all(key(n) in cache for n in "acd")
    assert cache.stats().evictions == 1
    cache.lookup(key("c")).release()  # order now a, d, c
    get(cache, "e", 200).release()  # needs two slots: a and d go
    assert [n for n in "abcde" if key(n) in cache] == ["c", "e"]
    s = cache.stats()
    assert (s.evictions, s.cached_bytes, s.live_bytes, s.cached_entries) == (3, 300, 300, 2)
    cache.audit()


def test_eviction_never_frees_a_referenced_payload():
    cache = PreparedMediaCache(200, 10_000)
    held = get(cache, "a", 100)
    get(cache, "b", 100).release()
    get(cache, "c", 100).release()  # a is the LRU: its retention goes, its payload does not
    s = cache.stats()
    assert s.evictions == 1 and (s.live_bytes, s.cached_bytes, s.entries, s.cached_entries) == (300, 200, 3, 2)
    assert len(held.payload) == 100 and key("a") in cache  # still live, still shareable
    again = cache.lookup(key("a"))  # a hit re-retains it (evicting b, the LRU now)
    assert again.payload is held.payload
    assert key("b") not in cache and cache.stats().cached_bytes == 200
    held.release()
    again.release()
    assert cache.stats().live_bytes == 200
    cache.clear()
    assert cache.stats().evictions == 2  # clear() is not an eviction
    assert_empty(cache)


def test_an_evicted_referenced_payload_is_freed_at_its_last_release():
    cache = PreparedMediaCache(100, 10_000)
    a = get(cache, "a", 100)
    a2 = a.share()
    get(cache, "b", 100).release()  # a un-retained, still referenced twice
    assert cache.stats().live_bytes == 200
    a.release()
    assert cache.stats().live_bytes == 200 and key("a") in cache
    a2.release()
    assert cache.stats().live_bytes == 100 and key("a") not in cache
    cache.audit()


def test_zero_retention_keeps_entries_only_while_referenced():
    cache = PreparedMediaCache(0, 10_000)
    a = get(cache, "a", 50)
    b = get(cache, "a", 50)  # shared while live (a hit), not retained
    assert b.hit and b.payload is a.payload and cache.stats().cached_bytes == 0
    a.release()
    b.release()
    assert key("a") not in cache and cache.stats().live_bytes == 0 and cache.stats().evictions == 0
    assert_empty(cache)


def test_a_payload_larger_than_the_retention_bound_is_not_retained():
    cache = PreparedMediaCache(100, 10_000)
    get(cache, "small", 60).release()
    big = get(cache, "big", 150)
    assert key("small") in cache and cache.stats().evictions == 0 and cache.stats().cached_bytes == 60
    big.release()
    assert key("big") not in cache and cache.stats().live_bytes == 60


def test_shrinking_the_retention_bound_evicts_at_once():
    cache = PreparedMediaCache(300, 1000)
    for name in "abc":
        get(cache, name, 100).release()
    cache.set_limits(cache_bytes=100)
    assert [n for n in "abc" if key(n) in cache] == ["c"] and cache.stats().evictions == 2
    cache.set_limits(live_bytes=50)
    with pytest.raises(MediaBudgetExceeded):
        cache.reserve(60, timeout=0)
    with pytest.raises(ValueError):
        cache.set_limits(cache_bytes=-1)


# --- handles ----------------------------------------------------------------------------------------------------------


def test_handles_are_explicit_references():
    cache = PreparedMediaCache(0, 1000)
    with get(cache, "a", 10) as h:
        shared = h.share()
        assert cache.stats().open_handles == 2 and not h.released
    assert h.released and cache.stats().open_handles == 1
    with pytest.raises(ReleasedHandleError):
        h.release()  # double release
    with pytest.raises(ReleasedHandleError):
        h.payload  # use after release
    with pytest.raises(ReleasedHandleError):
        h.share()
    assert h.key == key("a") and h.nbytes == 10 and "released" in repr(h)
    assert cache.stats().live_bytes == 10  # the double release did not free the shared reference
    shared.release()
    assert_empty(cache)


def test_a_leaked_handle_shows_in_stats():
    cache = PreparedMediaCache(0, 1000)
    get(cache, "a", 10)  # dropped without release
    cache.clear()
    s = cache.stats()
    assert (s.open_handles, s.live_bytes, s.referenced_bytes, s.entries) == (1, 10, 10, 1)


# --- failures ---------------------------------------------------------------------------------------------------------


def test_a_failed_prepare_caches_nothing_and_is_retried():
    cache = PreparedMediaCache(1000, 1000)

    def boom():
        raise RuntimeError("decode failed")

    with pytest.raises(RuntimeError, match="decode failed"):
        cache.get_or_prepare(key("a"), boom)
    s = cache.stats()
    assert (s.failures, s.misses, s.entries, s.live_bytes, s.in_flight, s.open_handles) == (1, 1, 0, 0, 0, 0)
    with get(cache, "a", 10) as h:
        assert not h.hit
    assert cache.stats().misses == 2
    cache.audit()


def test_media_budget_exceeded_is_a_typed_400():
    cache = PreparedMediaCache(100, 1000)
    with pytest.raises(MediaBudgetExceeded) as info:
        cache.reserve(1001, timeout=10)  # cannot fit even alone: refused at once, no wait
    error = info.value
    assert isinstance(error, MediaError) and isinstance(error, ValueError)
    assert (error.code, error.status, error.needed, error.limit, error.param) == ("media_budget_exceeded", 400,
                                                                                  1001, 1000, None)
    with pytest.raises(MediaBudgetExceeded):
        get(cache, "a", 10, size_hint=1001)  # the permit-less gate refuses the same way
    assert cache.stats().budget_rejections == 2 and cache.stats().waiting == 0
    cache.reserve(1000, timeout=0).close()  # exactly the limit fits


def test_a_payload_beyond_its_reservation_takes_only_free_room():
    cache = PreparedMediaCache(0, 1000)
    with cache.reserve(100, timeout=0) as permit:
        with get(cache, "a", 150, permit=permit) as h:  # 50 beyond the permit: there is room
            assert h.nbytes == 150 and permit.remaining == 0
    held = get(cache, "b", 900)  # no permit, no hint: free room only
    with cache.reserve(100, timeout=0) as permit:
        with pytest.raises(MediaBudgetExceeded, match="more than its reservation"):
            get(cache, "c", 150, permit=permit)
        assert permit.remaining == 100  # the failed build charged nothing
    s = cache.stats()
    assert (s.entries, s.live_bytes, s.failures, s.budget_rejections, s.in_flight) == (1, 900, 1, 1, 0)
    held.release()
    assert_empty(cache)


# --- permits and the gate ---------------------------------------------------------------------------------------------


def test_a_permit_reserves_and_returns_its_bytes():
    cache = PreparedMediaCache(1000, 1000)
    permit = cache.reserve(300, timeout=0)
    assert cache.stats().reserved_bytes == 300 and cache.stats().open_permits == 1
    a = get(cache, "a", 100, permit=permit)
    b = get(cache, "a", 100, permit=permit)  # a hit charges nothing
    assert permit.remaining == 200 and cache.stats().reserved_bytes == 200 and cache.stats().live_bytes == 100
    permit.close()
    permit.close()  # idempotent
    assert cache.stats().reserved_bytes == 0 and cache.stats().open_permits == 0 and "closed=True" in repr(permit)
    with pytest.raises(ReleasedHandleError):
        get(cache, "b", 1, permit=permit)
    a.release()
    b.release()
    assert cache.reserve(0, timeout=0).remaining == 0  # a zero reservation never waits


def test_the_gate_evicts_unreferenced_retained_entries_to_make_room():
    cache = PreparedMediaCache(1000, 1000)
    held = get(cache, "a", 300)
    for name in "bcd":
        get(cache, name, 200).release()
    permit = cache.reserve(400, timeout=0)  # free 100: evict b, then c (LRU order); a is referenced
    assert [n for n in "abcd" if key(n) in cache] == ["a", "d"] and cache.stats().evictions == 2
    assert cache.stats().live_bytes + cache.stats().reserved_bytes == 900
    with pytest.raises(MediaWaitTimeout):
        cache.reserve(400, timeout=0)  # only d (200) is evictable: not enough, so nothing is evicted
    assert key("d") in cache and cache.stats().wait_timeouts == 1
    permit.close()
    held.release()
    assert_empty(cache)


def test_a_waiting_reservation_opens_when_live_bytes_are_released():
    cache = PreparedMediaCache(0, 1000)
    held = get(cache, "a", 800)
    got = []
    waiter = threading.Thread(target=lambda: got.append(cache.reserve(500, timeout=5)))
    waiter.start()
    wait_until(lambda: cache.stats().waiting == 1, timeout=5.0)
    assert not got
    held.release()
    waiter.join(5)
    assert got and got[0].granted == 500 and cache.stats().reserved_bytes == 500
    got[0].close()


def test_the_gate_is_first_in_first_out():
    cache = PreparedMediaCache(0, 1000)
    held = get(cache, "a", 800)
    order = []

    def reserve(name, n):
        with cache.reserve(n, timeout=5):
            order.append(name)

    big = threading.Thread(target=reserve, args=("big", 500))
    big.start()
    wait_until(lambda: cache.stats().waiting == 1, timeout=5.0)
    small = threading.Thread(target=reserve, args=("small", 100))  # would fit now, but queues behind big
    small.start()
    wait_until(lambda: cache.stats().waiting == 2, timeout=5.0)
    time.sleep(0.02)
    assert order == []
    held.release()
    big.join(5)
    small.join(5)
    assert order == ["big", "small"]
    assert_empty(cache)


def test_a_waiter_that_gives_up_lets_the_next_through():
    cache = PreparedMediaCache(0, 1000)
    held = get(cache, "a", 800)
    result = []
    first = threading.Thread(target=lambda: result.append(pytest.raises(MediaWaitTimeout, cache.reserve, 500,
                                                                        timeout=0.1)))
    first.start()
    wait_until(lambda: cache.stats().waiting == 1, timeout=5.0)
    second = threading.Thread(target=lambda: result.append(cache.reserve(150, timeout=5)))
    second.start()
    first.join(5)
    second.join(5)
    assert result[-1].granted == 150 and cache.stats().waiting == 0
    result[-1].close()
    held.release()


def test_deadline_and_cancellation_bound_the_wait():
    cache = PreparedMediaCache(0, 100)
    held = get(cache, "a", 100)
    start = time.monotonic()
    with pytest.raises(MediaWaitTimeout):
        cache.reserve(10, deadline=time.monotonic() + 0.05)
    with pytest.raises(MediaWaitTimeout):
        get(cache, "b", 10, size_hint=10, timeout=0.05)  # the permit-less path waits at the gate too
    assert time.monotonic() - start < 2
    cancel = threading.Event()
    threading.Timer(0.05, cancel.set).start()
    with pytest.raises(MediaWaitCancelled):
        cache.reserve(10, cancel=cancel)
    with pytest.raises(MediaWaitCancelled):
        cache.reserve(10, cancel=cancel, timeout=5)  # already cancelled
    s = cache.stats()
    assert (s.waiting, s.reserved_bytes, s.wait_timeouts, s.in_flight) == (0, 0, 2, 0)
    held.release()
    assert_empty(cache)


def test_a_permitless_build_with_a_hint_reserves_and_returns_the_hint():
    cache = PreparedMediaCache(1000, 1000)
    with get(cache, "a", 100, size_hint=120) as h:
        assert not h.hit
        s = cache.stats()
        assert (s.reserved_bytes, s.open_permits, s.live_bytes) == (0, 0, 100)
    with get(cache, "a", 100, size_hint=120) as h:  # a hit never passes the gate
        assert h.hit


# --- threads ----------------------------------------------------------------------------------------------------------


def test_single_flight_runs_prepare_once_for_concurrent_identical_misses():
    n = 16
    cache = PreparedMediaCache(1000, 1000)
    calls = []
    barrier = threading.Barrier(n)

    def prepare():
        calls.append(threading.get_ident())
        # everyone else is waiting on this build
        wait_until(lambda: cache.stats().single_flight_joins == n - 1, timeout=5.0)
        return blob(100)

    def request(_):
        barrier.wait()
        return cache.get_or_prepare(key("same"), prepare, timeout=10)

    with ThreadPoolExecutor(n) as pool:
        handles = list(pool.map(request, range(n)))
    assert len(calls) == 1
    assert len({id(h.payload) for h in handles}) == 1
    assert sum(not h.joined for h in handles) == 1 and sum(h.joined for h in handles) == n - 1
    s = cache.stats()
    assert (s.misses, s.single_flight_joins, s.hits, s.open_handles, s.live_bytes) == (1, n - 1, 0, n, 100)
    for h in handles:
        h.release()
    assert cache.stats().open_handles == 0 and cache.stats().live_bytes == 100  # retained
    assert_empty(cache)


def test_single_flight_with_zero_retention_still_hands_every_joiner_a_reference():
    n = 8
    cache = PreparedMediaCache(0, 1000)
    barrier = threading.Barrier(n)

    def prepare():
        wait_until(lambda: cache.stats().single_flight_joins == n - 1, timeout=5.0)
        return blob(100)

    def request(_):
        barrier.wait()
        h = cache.get_or_prepare(key("same"), prepare, timeout=10)
        payload = h.payload  # a released builder handle must not free the joiners' payload
        h.release()
        return payload

    with ThreadPoolExecutor(n) as pool:
        payloads = list(pool.map(request, range(n)))
    assert len({id(p) for p in payloads}) == 1
    assert_empty(cache)


def test_a_failed_build_propagates_to_every_waiter():
    n = 12
    cache = PreparedMediaCache(1000, 1000)
    calls = []
    barrier = threading.Barrier(n)

    class DecodeError(MediaError):
        pass

    def prepare():
        calls.append(1)
        wait_until(lambda: cache.stats().single_flight_joins == n - 1, timeout=5.0)
        raise DecodeError("corrupt")

    def request(_):
        barrier.wait()
        try:
            cache.get_or_prepare(key("bad"), prepare, timeout=10)
        except DecodeError as error:
            return error
        return None

    with ThreadPoolExecutor(n) as pool:
        errors = list(pool.map(request, range(n)))
    assert len(calls) == 1 and all(isinstance(e, DecodeError) for e in errors)
    s = cache.stats()
    assert (s.failures, s.entries, s.live_bytes, s.in_flight, s.open_handles) == (1, 0, 0, 0, 0)


def test_a_joiner_that_times_out_leaks_no_reference():
    cache = PreparedMediaCache(0, 1000)
    release = threading.Event()
    built = []

    def prepare():
        release.wait(5)
        return blob(100)

    builder = threading.Thread(target=lambda: built.append(cache.get_or_prepare(key("a"), prepare)))
    builder.start()
    wait_until(lambda: cache.stats().in_flight == 1, timeout=5.0)
    with pytest.raises(MediaWaitTimeout):
        cache.get_or_prepare(key("a"), prepare, timeout=0.05)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(MediaWaitCancelled):
        cache.get_or_prepare(key("a"), prepare, cancel=cancel)
    release.set()
    builder.join(5)
    assert cache.stats().open_handles == 1
    built[0].release()
    assert_empty(cache)


def test_many_concurrent_requests_with_several_payloads_do_not_deadlock():
    """24 requests, each needing 3-4 payloads (some shared), against a live limit that holds only a few requests'
    worth at once; builds and joins run on a bounded pool of 4 workers sharing each request's permit."""
    live_limit = 1000
    cache = PreparedMediaCache(300, live_limit)
    sizes = {f"m{i}": 100 + 50 * (i % 4) for i in range(12)}
    plans = [[f"m{(r * 5 + j * 7) % 12}" for j in range(3 + r % 2)] for r in range(24)]
    plans = [list(dict.fromkeys(plan)) for plan in plans]
    violations = []
    built = []

    def prepare(name):
        s = cache.stats()
        if s.live_bytes + s.reserved_bytes > live_limit:
            violations.append(s)
        time.sleep(0.002)
        built.append(name)
        return blob(sizes[name])

    def request(plan, workers):
        with cache.reserve(sum(sizes[name] for name in plan), timeout=10) as permit:
            futures = [workers.submit(cache.get_or_prepare, key(name), lambda name=name: prepare(name),
                                      permit=permit, timeout=20) for name in plan]
            handles = [f.result() for f in futures]
        assert [h.nbytes for h in handles] == [sizes[name] for name in plan]
        time.sleep(0.003)  # the runtime holds them a while
        for h in handles:
            h.release()

    with ThreadPoolExecutor(4) as workers, ThreadPoolExecutor(len(plans)) as requests:
        for f in [requests.submit(request, plan, workers) for plan in plans]:
            f.result(timeout=30)
    assert not violations
    s = cache.stats()
    assert s.misses == len(built) and s.misses + s.hits + s.single_flight_joins == sum(map(len, plans))
    assert s.failures == 0 and s.budget_rejections == 0 and s.wait_timeouts == 0
    cache.audit()
    assert_empty(cache)
