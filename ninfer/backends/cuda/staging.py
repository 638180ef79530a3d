"""Small host <-> device copies through pinned staging slots, so a write does not wait for the stream.

A copy from pageable host memory waits for the stream to drain before it starts (the driver stages it through
pinned memory of its own). The MoE prefill writes small tables between launches (the experts' first rows, the
grouped GEMMs' operand addresses, twice a layer): each such write held the host until the GPU had finished
everything queued, and the GPU then idled while the host queued the next launches (~38 ms of the 35B-A3B's 223 ms 8K
prefill on the H200, results/cuda_model_prefill_session18.json). Here a write copies the values into the next of
SLOTS pinned slots and queues `cuMemcpyHtoDAsync` from there; an event recorded after the copy says when the slot
is free again (a write waits for it only when the stream has not yet reached the copy SLOTS writes ago). Reads go
through a slot as well (one driver copy and one stream synchronisation, no pageable staging).

Values larger than a slot, and arrays that are not contiguous, take numba's own (pageable) copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ninfer.kernels_numba.numba_setup import cuda

SLOTS = 32
SLOT_BYTES = 256 * 1024  # holds the largest GEMM address table (blas: 3 x 8 bytes x MAX_CHUNKS)


class StagingSlots:
    """The pinned slots of one stream (`CudaDevice` owns one for its serving stream)."""

    def __init__(self, driver: Any, stream_handle: int, event: Any, check: Any) -> None:
        """`stream_handle`: the stream reads synchronise (a write names its own)."""
        self._driver, self._stream, self._check = driver, stream_handle, check
        self._host = cuda.pinned_array(SLOTS * SLOT_BYTES, dtype=np.uint8)
        self._address = int(self._host.ctypes.data)
        self._events = [event(driver) for _ in range(SLOTS)]
        self._recorded = [False] * SLOTS
        self._reading: set[int] = set()  # slots whose read's values the caller has not taken yet
        self._next = 0
        self._pitched = driver.CUDA_MEMCPY2D()  # `write_rows`' copy description, its per-copy fields set each time
        self._pitched.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_HOST
        self._pitched.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE

    @staticmethod
    def fits(array: Any) -> bool:
        return 0 < array.nbytes <= SLOT_BYTES and array.is_c_contiguous()

    def _slot(self) -> int:
        """The next slot no read holds, once the stream has passed the copy that used it last."""
        for _ in range(SLOTS):
            slot, self._next = self._next, (self._next + 1) % SLOTS
            if slot not in self._reading:
                break
        else:
            raise RuntimeError(f"all {SLOTS} staging slots hold reads whose values were never taken")
        if self._recorded[slot]:
            self._check(self._driver.cuEventSynchronize(self._events[slot]), "cuEventSynchronize")
        return slot

    def write(self, destination_address: int, host: np.ndarray, stream_handle: int) -> None:
        """Queue a copy of `host` (contiguous, the destination's dtype and size) to the device address on the
        stream."""
        slot, source = self._staged(host)
        self._check(self._driver.cuMemcpyHtoDAsync(destination_address, source, host.nbytes, stream_handle),
                    "cuMemcpyHtoDAsync")
        self._mark(slot, stream_handle)

    def write_rows(self, destination_address: int, destination_pitch: int, host: np.ndarray,
                   stream_handle: int) -> None:
        """Queue a copy of `host` ([H, W], contiguous, at most a slot) to H device rows `destination_pitch` bytes
        apart from the address: one pitched copy (`cuMemcpy2DAsync`) where H row writes took H copies."""
        slot, source = self._staged(host)
        copy, width = self._pitched, host.shape[1] * host.itemsize
        copy.srcHost, copy.srcPitch, copy.WidthInBytes, copy.Height = source, width, width, host.shape[0]
        copy.dstDevice, copy.dstPitch = destination_address, destination_pitch
        self._check(self._driver.cuMemcpy2DAsync(copy, stream_handle), "cuMemcpy2DAsync")
        self._mark(slot, stream_handle)

    def _staged(self, host: np.ndarray) -> tuple[int, int]:
        """(slot, its host address) holding a copy of `host`'s bytes: the source of a write's driver copy."""
        slot = self._slot()
        start = slot * SLOT_BYTES
        self._host[start:start + host.nbytes] = host.reshape(-1).view(np.uint8)
        return slot, self._address + start

    def _mark(self, slot: int, stream_handle: int) -> None:
        """The slot is free again once the stream passes this point (after the copy just queued from it)."""
        self._check(self._driver.cuEventRecord(self._events[slot], stream_handle), "cuEventRecord")
        self._recorded[slot] = True

    def start_read(self, source: Any, source_address: int) -> "PendingRead":
        """Queue a copy of the device array's values (everything queued before on the stream has written them);
        `PendingRead.values()` waits for it. The host may queue more work in between: the GPU runs it while the
        copy's values travel and the host waits for them."""
        slot = self._slot()
        self._check(self._driver.cuMemcpyDtoHAsync(self._address + slot * SLOT_BYTES, source_address, source.nbytes,
                                                   self._stream), "cuMemcpyDtoHAsync")
        self._mark(slot, self._stream)
        self._reading.add(slot)
        return PendingRead(self, slot, source.dtype, source.shape)

    def read(self, source: Any, source_address: int) -> np.ndarray:
        """The device array's values, after everything queued before on the stream."""
        return self.start_read(source, source_address).values()

    def _take(self, slot: int, dtype: Any, shape: tuple) -> np.ndarray:
        self._check(self._driver.cuEventSynchronize(self._events[slot]), "cuEventSynchronize")
        self._reading.discard(slot)
        start, nbytes = slot * SLOT_BYTES, int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self._host[start:start + nbytes].view(dtype).reshape(shape).copy()


class PendingRead:
    """A device array's values on their way to the host (`StagingSlots.start_read`)."""

    def __init__(self, slots: StagingSlots, slot: int, dtype: Any, shape: tuple) -> None:
        self._slots, self._slot, self._dtype, self._shape = slots, slot, dtype, tuple(shape)
        self._values: np.ndarray | None = None

    def values(self) -> np.ndarray:
        """The values (waits for the copy the first time)."""
        if self._values is None:
            self._values = self._slots._take(self._slot, self._dtype, self._shape)
        return self._values


class ReadValues:
    """Values already on the host, in `PendingRead`'s form (reads that bypass the slots, the host backend)."""

    def __init__(self, values: np.ndarray) -> None:
        self._values = values

    def values(self) -> np.ndarray:
        return self._values
