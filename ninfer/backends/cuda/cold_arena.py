"""Cold-tier arenas on the secondary GPUs (serving.md "Cross-GPU cold tier"), through the CUDA driver API.

Each arena is one device allocation on a non-primary GPU (in that device's primary context). Parked bytes move
through one shared pinned host staging buffer (`--cold-tier-staging-mib`) in staging-sized pieces, each piece one DMA
in and one DMA out: straight from the engine's device arrays when the runner hands views (no host copy of the image),
or from host arrays. Transfers are synchronous: the tier runs between scheduler rounds, and a failure raises for the
tier to count (best effort).

`build_cold_arenas` chooses the devices: the pinned `--cold-tier-device`, else every device other than the primary
with at least MIN_FREE bytes free; each arena takes `--cold-tier-capacity-mib`, or the device's free memory minus
ARENA_RESERVE when that is 0.
"""

from __future__ import annotations

import ctypes
from typing import Any

import attrs
import numpy as np

from ninfer.backends.cuda.device import check

MIB = 1 << 20
MIN_FREE = 512 * MIB  # a secondary device with less free memory gets no arena
ARENA_RESERVE = 256 * MIB  # left free on a device whose arena capacity is automatic


class PinnedStaging:
    """A page-locked host buffer shared by the arenas: allocated portable (pinned for every context) while GPU
    `device`'s primary context is current, since the driver allocates pinned memory through a context."""

    def __init__(self, nbytes: int, device: int) -> None:
        from cuda.bindings import driver

        with _ContextScope(primary_context(device)):
            err, self._pointer = driver.cuMemHostAlloc(nbytes, driver.CU_MEMHOSTALLOC_PORTABLE)
            check(err, "cuMemHostAlloc")
        self.nbytes = nbytes
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(self._pointer)))
        self.pointer = int(self._pointer)  # page-locked for the process's life, like the arenas it serves


@attrs.define(eq=False)
class CudaArena:
    """`capacity_bytes` of device memory on GPU `device`, written and read through the staging buffer."""

    device: int
    capacity_bytes: int
    staging: PinnedStaging
    _context: Any = None
    _base: int = 0

    def __attrs_post_init__(self) -> None:
        from cuda.bindings import driver

        self._context = primary_context(self.device)
        with self._current():
            err, base = driver.cuMemAlloc(self.capacity_bytes)
            check(err, f"cuMemAlloc of a {self.capacity_bytes >> 20} MiB cold-tier arena on GPU {self.device}")
        self._base = int(base)

    def write(self, offset: int, data: Any) -> None:
        """Park `data` (a C-contiguous host array, or a device array on any GPU) at `offset`, piece by piece through
        the staging buffer: device -> staging -> arena, or host -> staging -> arena."""
        source = _device_pointer(data)
        host = None if source is not None else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        nbytes = int(data.nbytes)
        self._bounds(offset, nbytes)
        with self._current():
            for start in range(0, nbytes, self.staging.nbytes):
                size = min(self.staging.nbytes, nbytes - start)
                if source is None:
                    self.staging.view[:size] = host[start : start + size]
                else:
                    _copy(self.staging.pointer, source + start, size, "cold tier park (device -> staging)")
                _copy(self._base + offset + start, self.staging.pointer, size, "cold tier park (staging -> arena)")

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        self.read_into(offset, out)
        return out

    def read_into(self, offset: int, destination: Any) -> None:
        """Fill `destination` (a C-contiguous host array, or a device array on any GPU) from `offset`: arena ->
        staging -> destination, piece by piece."""
        target = _device_pointer(destination)
        host = None if target is not None else destination.reshape(-1).view(np.uint8)
        nbytes = int(destination.nbytes)
        self._bounds(offset, nbytes)
        with self._current():
            for start in range(0, nbytes, self.staging.nbytes):
                size = min(self.staging.nbytes, nbytes - start)
                _copy(self.staging.pointer, self._base + offset + start, size, "cold tier restore (arena -> staging)")
                if target is None:
                    host[start : start + size] = self.staging.view[:size]
                else:
                    _copy(target + start, self.staging.pointer, size, "cold tier restore (staging -> device)")

    def _bounds(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.capacity_bytes:
            raise ValueError(f"cold-tier range {offset}+{nbytes} outside the {self.capacity_bytes}-byte arena")

    def _current(self) -> "_ContextScope":
        return _ContextScope(self._context)


def _device_pointer(array: Any) -> int | None:
    """The device address of a numba device array; None for a host array."""
    pointer = getattr(array, "device_ctypes_pointer", None)
    return None if pointer is None else int(pointer.value or 0)


def _copy(destination: int, source: int, nbytes: int, what: str) -> None:
    """A synchronous copy between unified addresses (device memory of any GPU, the pinned staging buffer). It runs
    on the legacy default stream, so it also waits for the work already queued on the engine's stream."""
    from cuda.bindings import driver

    check(driver.cuMemcpy(destination, source, nbytes), what)


class _ContextScope:
    """The arena's device context made current for a block, the caller's restored after."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def __enter__(self) -> None:
        from cuda.bindings import driver

        check(driver.cuCtxPushCurrent(self._context), "cuCtxPushCurrent")

    def __exit__(self, *exc: object) -> None:
        from cuda.bindings import driver

        driver.cuCtxPopCurrent()


def primary_context(device: int) -> Any:
    """GPU `device`'s primary context (retained: it lives as long as the process)."""
    from cuda.bindings import driver

    check(driver.cuInit(0), "cuInit")
    err, handle = driver.cuDeviceGet(device)
    check(err, "cuDeviceGet")
    err, context = driver.cuDevicePrimaryCtxRetain(handle)
    check(err, "cuDevicePrimaryCtxRetain")
    return context


def free_bytes(device: int) -> int:
    """Free memory on GPU `device` (its primary context made current for the query)."""
    from cuda.bindings import driver

    with _ContextScope(primary_context(device)):
        err, free, _total = driver.cuMemGetInfo()
        check(err, "cuMemGetInfo")
    return int(free)


def build_cold_arenas(*, primary: int, devices: int, pinned: int, capacity_mib: int,
                      staging_mib: int) -> tuple[list[CudaArena], PinnedStaging | None]:
    """The arenas for this machine (none with a single GPU) and their staging buffer."""
    candidates = [pinned] if pinned >= 0 else [d for d in range(devices) if d != primary]
    chosen = []
    for device in candidates:
        free = free_bytes(device)
        capacity = capacity_mib * MIB if capacity_mib else free - ARENA_RESERVE
        if free >= MIN_FREE and 0 < capacity <= free:
            chosen.append((device, capacity))
    if not chosen:
        return [], None
    staging = PinnedStaging(staging_mib * MIB, chosen[0][0])
    return [CudaArena(device, capacity, staging) for device, capacity in chosen], staging
