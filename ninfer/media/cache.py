"""The prepared-media cache: SHA-256 + modality keys, LRU retention, a live-bytes account, single-flight builds and the
request-level preparation gate (serving.md, the multimodal sections; issue "Vision", item 3).

Vocabulary
==========

*Payload*
    The immutable result of one decode -> resize -> BF16-pack task (for instance a ``ProcessedImage``).  Its size in
    bytes is measured once, when the build finishes, by ``size_of`` (default: ``payload.nbytes``,
    ``payload.patches.nbytes`` or ``len(payload)``).

*Entry*
    One live payload under its :class:`MediaKey`.  An entry is **live** while it is *referenced* (at least one open
    :class:`MediaHandle`) or *retained* (held by the LRU).  Every live entry stays findable, so a later identical
    request shares it even after the LRU let go of it.

*Retention* (``cache_bytes``, ``--media-cache-mib``)
    The LRU keeps entries alive beyond their last reference.  ``cached_bytes`` - the sum of retained entries - never
    exceeds ``cache_bytes``; the least recently used retained entries are evicted first.  Evicting a referenced entry
    only drops the retention: the payload and its live bytes stay until the final handle is released.  0 disables
    retention (entries still live and shareable while referenced).

*Live account* (``live_bytes``, ``--media-live-mib``)
    ``live_bytes`` is the sum of every live entry (retained, request- or runtime-referenced).  Together with the bytes
    reserved by open :class:`PreparationPermit` s it never exceeds ``live_bytes`` (the limit):
    ``live_bytes + reserved_bytes <= live_limit`` at all times.

*Preparation gate*
    A request reserves, before it builds anything, the bytes its misses may need (:meth:`PreparedMediaCache.reserve`)
    and builds all its items under that one permit.  A build charges its payload to the permit, so no request ever
    waits for memory while it holds a partial set of payloads - the account cannot deadlock.  Reservations are
    granted in FIFO order (evicting unreferenced retained entries when that makes room); a reservation larger than
    the whole live limit is refused at once with :class:`MediaBudgetExceeded` (HTTP 400 ``media_budget_exceeded``);
    otherwise the request waits, bounded by its deadline (:class:`MediaWaitTimeout`) and its cancellation event
    (:class:`MediaWaitCancelled`).

Typical request flow::

    with cache.reserve(sum(item_bytes), deadline=request_deadline) as permit:
        handles = [cache.get_or_prepare(key, build, permit=permit, deadline=request_deadline)
                   for key, build in items]          # may run on the worker pool, sharing the permit
    # the permit is closed: what the hits did not use goes back to the account
    ...                                               # handles (and runtime copies via handle.share()) are released
    for h in handles: h.release()                     # when the request (and the runtime) are done with them

All methods are thread-safe; ``prepare`` callables run outside the lock, on the calling thread.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from ninfer.media.errors import MediaBudgetExceeded

MODALITIES = ("image", "video")
MIB = 1 << 20

P = TypeVar("P")

__all__ = [
    "MODALITIES",
    "MediaBudgetExceeded",
    "MediaCacheStats",
    "MediaHandle",
    "MediaKey",
    "MediaWaitCancelled",
    "MediaWaitTimeout",
    "PreparationPermit",
    "PreparedMediaCache",
    "ReleasedHandleError",
    "default_size_of",
]


# --- errors -----------------------------------------------------------------------------------------------------------


class MediaWaitTimeout(TimeoutError):
    """The request's deadline passed while it waited for live bytes or for another request's identical build.
    The server maps it onto its own queue-timeout answer (503 ``request_queue_timeout``)."""


class MediaWaitCancelled(Exception):
    """The request was cancelled while it waited at the preparation gate or on a shared build."""


class ReleasedHandleError(RuntimeError):
    """A handle (or permit) was used after it was released: a double release or a use after release."""


# --- keys, sizes, stats -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class MediaKey:
    """SHA-256 (hex) of the acquired bytes plus the modality they are prepared as."""

    digest: str
    modality: str

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"modality must be one of {MODALITIES}, got {self.modality!r}")
        if len(self.digest) != 64 or any(c not in "0123456789abcdef" for c in self.digest):
            raise ValueError(f"digest must be 64 lowercase hex digits, got {self.digest!r}")

    @classmethod
    def of(cls, data: bytes | bytearray | memoryview, modality: str) -> "MediaKey":
        return cls(hashlib.sha256(data).hexdigest(), modality)

    def __str__(self) -> str:
        return f"{self.modality}:{self.digest}"


def default_size_of(payload: Any) -> int:
    """Bytes a payload holds: its ``nbytes``, its ``patches.nbytes`` (``ProcessedImage``) or its ``len()`` when it
    is bytes-like."""
    nbytes = getattr(payload, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    patches = getattr(payload, "patches", None)
    if patches is not None and isinstance(getattr(patches, "nbytes", None), int):
        return patches.nbytes
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return memoryview(payload).nbytes
    raise TypeError(f"cannot size a {type(payload).__name__} payload; pass size_of= to PreparedMediaCache")


@dataclass(frozen=True)
class MediaCacheStats:
    """A consistent snapshot of the cache's counters (taken under its lock)."""

    hits: int  # get_or_prepare/lookup found a live entry
    misses: int  # get_or_prepare started a build
    single_flight_joins: int  # get_or_prepare waited on an identical build in flight
    evictions: int  # retained entries dropped by the LRU (cache bound or live pressure)
    failures: int  # builds that raised (nothing cached)
    budget_rejections: int  # MediaBudgetExceeded raised
    wait_timeouts: int  # MediaWaitTimeout raised
    live_bytes: int  # every retained or referenced payload
    cached_bytes: int  # retained payloads (<= cache limit)
    referenced_bytes: int  # payloads with at least one open handle
    reserved_bytes: int  # unused bytes of open permits
    entries: int  # live entries
    cached_entries: int  # retained entries
    open_handles: int  # handles not yet released (a leak shows here)
    open_permits: int
    in_flight: int  # builds running
    waiting: int  # reservations queued at the gate
    cache_limit: int
    live_limit: int


# --- handles and permits ----------------------------------------------------------------------------------------------


class _Entry(Generic[P]):
    __slots__ = ("key", "payload", "nbytes", "refs", "retained")

    def __init__(self, key: MediaKey, payload: P, nbytes: int) -> None:
        self.key, self.payload, self.nbytes = key, payload, nbytes
        self.refs = 0
        self.retained = False


class _Flight:
    """One build in progress; its joiners wait on the cache's condition."""

    __slots__ = ("done", "entry", "error", "joiners")

    def __init__(self) -> None:
        self.done = False
        self.entry: _Entry | None = None
        self.error: BaseException | None = None
        self.joiners = 0  # waiting joiners, each pre-assigned a reference when the build succeeds


class MediaHandle(Generic[P]):
    """One explicit reference to a live payload.  Release it exactly once (``release()`` or ``with``); until then
    the payload's bytes stay live even if the LRU evicts it.  ``share()`` takes another, independent reference
    (for the runtime, a continued request, ...)."""

    __slots__ = ("_cache", "_entry", "_released", "hit", "joined")

    def __init__(self, cache: "PreparedMediaCache", entry: _Entry[P], *, hit: bool = False,
                 joined: bool = False) -> None:
        self._cache, self._entry, self._released = cache, entry, False
        self.hit = hit  # found live in the cache
        self.joined = joined  # shared an identical build that was in flight

    @property
    def key(self) -> MediaKey:
        return self._entry.key

    @property
    def nbytes(self) -> int:
        return self._entry.nbytes

    @property
    def released(self) -> bool:
        return self._released

    @property
    def payload(self) -> P:
        if self._released:
            raise ReleasedHandleError(f"handle for {self._entry.key} used after release")
        return self._entry.payload

    def share(self) -> "MediaHandle[P]":
        return self._cache._share(self)

    def release(self) -> None:
        self._cache._release(self)

    def __enter__(self) -> "MediaHandle[P]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "open"
        return f"MediaHandle({self._entry.key}, {self._entry.nbytes} bytes, {state})"


class PreparationPermit:
    """Bytes reserved at the preparation gate for one request's builds.  Builds under the permit charge their
    payloads to it; ``close()`` (idempotent; also on ``with`` exit) returns what is left to the account."""

    __slots__ = ("_cache", "granted", "remaining", "closed")

    def __init__(self, cache: "PreparedMediaCache", nbytes: int) -> None:
        self._cache = cache
        self.granted = nbytes
        self.remaining = nbytes
        self.closed = False

    def close(self) -> None:
        self._cache._close_permit(self)

    def __enter__(self) -> "PreparationPermit":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PreparationPermit(granted={self.granted}, remaining={self.remaining}, closed={self.closed})"


# --- the cache --------------------------------------------------------------------------------------------------------


def _deadline_of(timeout: float | None, deadline: float | None) -> float | None:
    """An absolute ``time.monotonic()`` deadline from a relative timeout and/or an absolute deadline (the earlier)."""
    if timeout is not None:
        by_timeout = time.monotonic() + max(0.0, timeout)
        deadline = by_timeout if deadline is None else min(deadline, by_timeout)
    return deadline


class PreparedMediaCache(Generic[P]):
    """Prepared media payloads shared across requests under a retention bound (``cache_bytes``) and a live bound
    (``live_bytes``).  See the module docstring for the accounting rules."""

    # While a waiter has a cancellation event, it re-checks at least this often (seconds).
    CANCEL_POLL_S = 0.02

    def __init__(self, cache_bytes: int, live_bytes: int, *,
                 size_of: Callable[[P], int] = default_size_of) -> None:
        if cache_bytes < 0 or live_bytes < 0:
            raise ValueError(f"cache and live limits must be >= 0, got {cache_bytes}, {live_bytes}")
        self.cache_limit = int(cache_bytes)
        self.live_limit = int(live_bytes)
        self._size_of = size_of
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[MediaKey, _Entry[P]] = {}  # every live entry
        self._lru: OrderedDict[MediaKey, _Entry[P]] = OrderedDict()  # retained entries, least recent first
        self._flights: dict[MediaKey, _Flight] = {}
        self._gate: list[object] = []  # FIFO tickets of reservations waiting
        self._live = 0
        self._cached = 0
        self._reserved = 0
        self._handles = 0
        self._permits = 0
        self._hits = self._misses = self._joins = self._evictions = 0
        self._failures = self._rejections = self._timeouts = 0

    @classmethod
    def from_mib(cls, cache_mib: int, live_mib: int, **kwargs: Any) -> "PreparedMediaCache[P]":
        """From the server options ``--media-cache-mib`` and ``--media-live-mib``."""
        return cls(cache_mib * MIB, live_mib * MIB, **kwargs)

    # --- public API ---------------------------------------------------------------------------------------------------

    def stats(self) -> MediaCacheStats:
        with self._cond:
            return MediaCacheStats(
                hits=self._hits, misses=self._misses, single_flight_joins=self._joins, evictions=self._evictions,
                failures=self._failures, budget_rejections=self._rejections, wait_timeouts=self._timeouts,
                live_bytes=self._live, cached_bytes=self._cached,
                referenced_bytes=sum(e.nbytes for e in self._entries.values() if e.refs),
                reserved_bytes=self._reserved, entries=len(self._entries), cached_entries=len(self._lru),
                open_handles=self._handles, open_permits=self._permits, in_flight=len(self._flights),
                waiting=len(self._gate), cache_limit=self.cache_limit, live_limit=self.live_limit)

    def __contains__(self, key: MediaKey) -> bool:
        with self._cond:
            return key in self._entries

    def lookup(self, key: MediaKey) -> MediaHandle[P] | None:
        """A new reference to a live entry (a hit, refreshed in the LRU), or None; never builds or waits."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._hits += 1
            self._touch(entry)
            return self._new_handle(entry, hit=True)

    def reserve(self, nbytes: int, *, timeout: float | None = None, deadline: float | None = None,
                cancel: threading.Event | None = None) -> PreparationPermit:
        """Pass the preparation gate: reserve ``nbytes`` of the live account for one request's builds.

        Refused at once with :class:`MediaBudgetExceeded` when ``nbytes`` exceeds the live limit (it could never fit,
        even alone).  Otherwise waits, in FIFO order, until the account has room (unreferenced retained entries are
        evicted to make it), up to ``deadline`` (absolute ``time.monotonic()``) / ``timeout`` (seconds) - then
        :class:`MediaWaitTimeout` - or until ``cancel`` is set - then :class:`MediaWaitCancelled`."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative byte count ({nbytes})")
        nbytes = int(nbytes)
        deadline = _deadline_of(timeout, deadline)
        with self._cond:
            if nbytes > self.live_limit:
                self._rejections += 1
                raise MediaBudgetExceeded(
                    f"prepared media need {nbytes} bytes, more than the live media limit of {self.live_limit} bytes "
                    f"(--media-live-mib)", needed=nbytes, limit=self.live_limit)
            if nbytes == 0:  # nothing to wait for
                self._permits += 1
                return PreparationPermit(self, 0)
            ticket = object()
            self._gate.append(ticket)
            try:
                while not (self._gate[0] is ticket and self._make_room(nbytes)):
                    self._wait(deadline, cancel, "live media bytes")
            finally:
                self._gate.remove(ticket)
                self._cond.notify_all()  # the next ticket may now be at the head
            self._reserved += nbytes
            self._permits += 1
            return PreparationPermit(self, nbytes)

    def get_or_prepare(self, key: MediaKey, prepare: Callable[[], P], *, size_hint: int | None = None,
                       permit: PreparationPermit | None = None, timeout: float | None = None,
                       deadline: float | None = None, cancel: threading.Event | None = None) -> MediaHandle[P]:
        """A new reference to the payload of ``key``, building it with ``prepare()`` on a miss.

        * A hit (a live entry) returns at once and refreshes the entry in the LRU.
        * Concurrent identical misses run ``prepare`` once: later callers join the build in flight and share its
          payload, or its exception (nothing is cached when a build fails).
        * A build is charged to ``permit``.  Without one, the caller passes the gate for ``size_hint`` bytes itself
          (for a request that needs a single item; several items must share one permit, or partial builds could
          deadlock the account).  Bytes beyond the reservation are taken only if the account has room right now,
          else the build fails with :class:`MediaBudgetExceeded`.
        * ``timeout`` / ``deadline`` / ``cancel`` bound the waits (the gate, or an identical build in flight)."""
        if not isinstance(key, MediaKey):
            raise TypeError(f"key must be a MediaKey, got {type(key).__name__}")
        if size_hint is not None and size_hint < 0:
            raise ValueError(f"size_hint must be >= 0, got {size_hint}")
        deadline = _deadline_of(timeout, deadline)
        own_permit: PreparationPermit | None = None
        try:
            while True:
                with self._cond:
                    if permit is not None and permit.closed:
                        raise ReleasedHandleError("get_or_prepare with a closed preparation permit")
                    found = self._find(key, deadline, cancel)
                    if found is not None:
                        return found
                    if permit is not None or own_permit is not None or size_hint is None:
                        # We build: the flight is registered before the lock is dropped, so identical misses join.
                        flight = _Flight()
                        self._flights[key] = flight
                        self._misses += 1
                        break
                # A permit-less miss with a known size passes the gate first (holding nothing), then looks again.
                own_permit = self.reserve(size_hint, deadline=deadline, cancel=cancel)
            return self._build(key, flight, prepare, permit or own_permit)
        finally:
            if own_permit is not None:
                own_permit.close()

    def clear(self) -> None:
        """Drop every retention: unreferenced entries are freed now, referenced ones when their last handle goes.
        Not counted as evictions."""
        with self._cond:
            for entry in list(self._lru.values()):
                self._unretain(entry)
            self._cond.notify_all()

    def set_limits(self, cache_bytes: int | None = None, live_bytes: int | None = None) -> None:
        """Change the limits at run time.  A smaller retention bound evicts at once; a smaller live bound applies to
        later reservations (bytes already live or reserved are not revoked)."""
        with self._cond:
            if cache_bytes is not None:
                if cache_bytes < 0:
                    raise ValueError("cache_bytes must be >= 0")
                self.cache_limit = int(cache_bytes)
                self._evict_to_cache_limit()
            if live_bytes is not None:
                if live_bytes < 0:
                    raise ValueError("live_bytes must be >= 0")
                self.live_limit = int(live_bytes)
            self._cond.notify_all()

    def audit(self) -> None:
        """Check the accounting invariants (tests; cheap enough for a debug endpoint).  Raises AssertionError."""
        with self._cond:
            live = sum(e.nbytes for e in self._entries.values())
            cached = sum(e.nbytes for e in self._lru.values())
            assert all(e.refs > 0 or e.retained for e in self._entries.values()), "a dead entry is still indexed"
            assert all(e.refs >= 0 and e.nbytes >= 0 for e in self._entries.values()), "negative count"
            assert all(self._entries.get(k) is e and e.retained for k, e in self._lru.items()), "LRU not indexed"
            assert sum(e.retained for e in self._entries.values()) == len(self._lru), "retained entry not in LRU"
            assert self._live == live, f"live bytes {self._live} != {live}"
            assert self._cached == cached, f"cached bytes {self._cached} != {cached}"
            assert self._cached <= self.cache_limit, f"cached bytes {self._cached} > limit {self.cache_limit}"
            assert self._reserved >= 0 and self._handles >= 0 and self._permits >= 0, "negative count"
            assert sum(e.refs for e in self._entries.values()) == self._handles, "handle count drifted"
            assert not set(self._flights) & set(self._entries), "a key is both in flight and live"

    # --- internals (all under self._cond unless noted) ----------------------------------------------------------------

    def _wait(self, deadline: float | None, cancel: threading.Event | None, what: str) -> None:
        if cancel is not None and cancel.is_set():
            raise MediaWaitCancelled(f"cancelled while waiting for {what}")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            self._timeouts += 1
            raise MediaWaitTimeout(f"deadline passed while waiting for {what}")
        if cancel is not None:
            remaining = self.CANCEL_POLL_S if remaining is None else min(remaining, self.CANCEL_POLL_S)
        self._cond.wait(remaining)

    def _find(self, key: MediaKey, deadline: float | None, cancel: threading.Event | None) -> MediaHandle[P] | None:
        """A handle to a live entry, or the result of joining a build in flight; None when the caller must build."""
        entry = self._entries.get(key)
        if entry is not None:
            self._hits += 1
            self._touch(entry)
            return self._new_handle(entry, hit=True)
        flight = self._flights.get(key)
        if flight is None:
            return None
        self._joins += 1
        flight.joiners += 1
        try:
            while not flight.done:
                self._wait(deadline, cancel, f"the identical build of {key}")
        except BaseException:
            if not flight.done:  # leaving before the result: give up our pre-assigned reference
                flight.joiners -= 1
                raise
            # The build finished while we were timing out or being cancelled: take the result anyway.
        if flight.error is not None:
            raise flight.error
        assert flight.entry is not None
        return MediaHandle(self, flight.entry, joined=True)  # the reference was taken at completion

    def _build(self, key: MediaKey, flight: _Flight, prepare: Callable[[], P],
               permit: PreparationPermit | None) -> MediaHandle[P]:
        """Run ``prepare`` (outside the lock), charge and publish its payload, wake the joiners."""
        try:
            payload = prepare()
            nbytes = int(self._size_of(payload))
            if nbytes < 0:
                raise ValueError(f"payload size of {key} is negative ({nbytes})")
        except BaseException as error:
            self._finish_failed(key, flight, error)
            raise
        with self._cond:
            try:
                self._charge(key, nbytes, permit)
            except BaseException as error:
                self._finish_failed(key, flight, error, locked=True)
                raise
            entry = _Entry(key, payload, nbytes)
            self._entries[key] = entry
            self._live += nbytes
            entry.refs += flight.joiners  # one reference per joiner still waiting
            self._handles += flight.joiners
            handle = self._new_handle(entry)
            self._retain(entry)
            flight.entry, flight.done = entry, True
            del self._flights[key]
            self._cond.notify_all()
            return handle

    def _finish_failed(self, key: MediaKey, flight: _Flight, error: BaseException, *, locked: bool = False) -> None:
        if not locked:
            with self._cond:
                return self._finish_failed(key, flight, error, locked=True)
        self._failures += 1
        flight.error, flight.done = error, True
        del self._flights[key]
        self._cond.notify_all()

    def _charge(self, key: MediaKey, nbytes: int, permit: PreparationPermit | None) -> None:
        """Move ``nbytes`` into the live account: from the permit first, any excess only if there is room now."""
        from_permit = 0
        if permit is not None:
            if permit.closed:
                raise ReleasedHandleError("a build finished under a closed preparation permit")
            from_permit = min(nbytes, permit.remaining)
        excess = nbytes - from_permit
        if excess and not self._make_room(excess):
            self._rejections += 1
            reserved = permit.granted if permit is not None else 0
            raise MediaBudgetExceeded(
                f"prepared {key.modality} needs {nbytes} bytes, {excess} more than its reservation of {reserved}, and "
                f"the live media account (--media-live-mib, {self.live_limit} bytes) has no room for them",
                needed=nbytes, limit=self.live_limit)
        if permit is not None:
            permit.remaining -= from_permit
            self._reserved -= from_permit

    def _free_now(self) -> int:
        return self.live_limit - self._live - self._reserved

    def _make_room(self, nbytes: int) -> bool:
        """Ensure ``nbytes`` unreserved live room, evicting unreferenced retained entries (LRU first) if - and only
        if - that is enough.  Returns whether the room is there."""
        if self._free_now() >= nbytes:
            return True
        evictable = sum(e.nbytes for e in self._lru.values() if e.refs == 0)
        if self._free_now() + evictable < nbytes:
            return False
        for entry in [e for e in self._lru.values() if e.refs == 0]:
            if self._free_now() >= nbytes:
                break
            self._evictions += 1
            self._unretain(entry)
        return True

    def _new_handle(self, entry: _Entry[P], *, hit: bool = False) -> MediaHandle[P]:
        entry.refs += 1
        self._handles += 1
        return MediaHandle(self, entry, hit=hit)

    def _touch(self, entry: _Entry[P]) -> None:
        if entry.retained:
            self._lru.move_to_end(entry.key)
        else:
            self._retain(entry)

    def _retain(self, entry: _Entry[P]) -> None:
        """Make ``entry`` the most recently used retained entry, if it fits the retention bound at all."""
        if entry.nbytes > self.cache_limit:
            return
        entry.retained = True
        self._lru[entry.key] = entry
        self._cached += entry.nbytes
        self._evict_to_cache_limit()

    def _evict_to_cache_limit(self) -> None:
        while self._cached > self.cache_limit:
            _, oldest = next(iter(self._lru.items()))
            self._evictions += 1
            self._unretain(oldest)

    def _unretain(self, entry: _Entry[P]) -> None:
        del self._lru[entry.key]
        entry.retained = False
        self._cached -= entry.nbytes
        self._drop_if_dead(entry)

    def _drop_if_dead(self, entry: _Entry[P]) -> None:
        if entry.refs == 0 and not entry.retained:
            del self._entries[entry.key]
            self._live -= entry.nbytes
            self._cond.notify_all()  # live bytes came back: the gate may open

    def _share(self, handle: MediaHandle[P]) -> MediaHandle[P]:
        with self._cond:
            if handle._released:
                raise ReleasedHandleError(f"cannot share a released handle for {handle.key}")
            return self._new_handle(handle._entry)

    def _release(self, handle: MediaHandle[P]) -> None:
        with self._cond:
            if handle._released:
                raise ReleasedHandleError(f"handle for {handle.key} released twice")
            handle._released = True
            entry = handle._entry
            entry.refs -= 1
            self._handles -= 1
            self._drop_if_dead(entry)

    def _close_permit(self, permit: PreparationPermit) -> None:
        with self._cond:
            if permit.closed:
                return
            permit.closed = True
            self._reserved -= permit.remaining
            permit.remaining = 0
            self._permits -= 1
            self._cond.notify_all()
