"""The GPU a runner owns: its context, one stream, and a ledger of every device allocation by purpose.

Everything is allocated once at startup with plain device allocations (cudaMalloc through numba); nothing is
allocated while serving, so graph replays always see the same addresses.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

import attrs
import numpy as np

from ninfer.backends.cuda.staging import SLOT_BYTES, ReadValues, StagingSlots
from ninfer.backends.cuda.views import remembering_views
from ninfer.kernels_numba.numba_setup import cuda

GIB = 1 << 30


class Device(Protocol):
    """What the model and runner need from a device: `CudaDevice`, or `HostDevice` (NumPy twins, no GPU)."""

    stream: Any
    stream_handle: int
    ledger: collections.Counter[str]

    @property
    def info(self) -> "DeviceInfo": ...

    @property
    def kernels(self) -> Any: ...

    def empty(self, shape: Any, dtype: Any, purpose: str) -> Any: ...

    def zeros(self, shape: Any, dtype: Any, purpose: str) -> Any: ...

    def upload(self, host: np.ndarray, purpose: str) -> Any: ...

    def synchronize(self) -> None: ...

    def write(self, destination: Any, host: np.ndarray, *, stream_handle: int | None = None) -> None: ...

    def write_rows(self, destination: Any, host: np.ndarray) -> None: ...

    def read(self, source: Any) -> np.ndarray: ...

    def start_read(self, source: Any) -> Any: ...

    def clear(self, array: Any) -> None: ...

    def copy(self, destination: Any, source: Any) -> None: ...

    def blas(self) -> Any: ...

    def side_stream(self) -> Any: ...

    def ahead_stream(self) -> Any: ...

    def capture(self, record: Any) -> Any: ...

    def capture_pieces(self, record: Any) -> Any: ...


class CudaUnavailableError(RuntimeError):
    """No usable NVIDIA GPU (or the requested index does not exist)."""


@attrs.frozen
class DeviceInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    multiprocessors: int


class CudaDevice:
    """One GPU: context, the serving stream (a cuda-python stream seen by numba as an external stream), allocations."""

    def __init__(self, index: int = 0) -> None:
        if not cuda.is_available():
            raise CudaUnavailableError("no NVIDIA GPU is available to this process")
        count = len(cuda.gpus)
        if not 0 <= index < count:
            raise CudaUnavailableError(f"--device {index}: this machine has {count} GPU(s)")
        cuda.select_device(index)
        self.index = index
        self._context = cuda.current_context()
        from cuda.bindings import driver

        self._driver = driver
        self._stream_object, self.stream_handle, self.stream = _new_stream(driver)
        self.ledger: collections.Counter[str] = collections.Counter()
        self._side: SideStream | None = None
        self._ahead: AheadStream | None = None
        self._staging = StagingSlots(driver, self.stream_handle, _event, check)

    @property
    def info(self) -> DeviceInfo:
        device = cuda.get_current_device()
        free, total = self._context.get_memory_info()
        return DeviceInfo(self.index, device.name.decode() if isinstance(device.name, bytes) else str(device.name),
                          int(total), int(free), int(device.MULTIPROCESSOR_COUNT))

    def empty(self, shape: Any, dtype: Any, purpose: str) -> Any:
        """A new device array (uninitialised), charged to `purpose` in the ledger."""
        array = remembering_views(cuda.device_array(shape, dtype=np.dtype(dtype), stream=self.stream))
        self.ledger[purpose] += int(array.nbytes)
        return array

    def zeros(self, shape: Any, dtype: Any, purpose: str) -> Any:
        array = self.empty(shape, dtype, purpose)
        memset(array, self.stream_handle)
        return array

    def upload(self, host: np.ndarray, purpose: str) -> Any:
        array = remembering_views(cuda.to_device(np.ascontiguousarray(host), stream=self.stream))
        self.ledger[purpose] += int(array.nbytes)
        return array

    def synchronize(self) -> None:
        self.stream.synchronize()

    # The operations the model and runner use, shared with `HostDevice` (the NumPy stand-in).

    @property
    def kernels(self) -> Any:
        from ninfer.backends.cuda import kernels

        return kernels

    def write(self, destination: Any, host: np.ndarray, *, stream_handle: int | None = None) -> None:
        """Copy host values into a device array in the order of the serving stream (or of `stream_handle`'s);
        `host` may change once this returns. Small values go through a pinned slot and do not wait for the stream
        (`staging`)."""
        values = np.ascontiguousarray(host, dtype=destination.dtype).reshape(destination.shape)
        if self._staging.fits(destination):
            self._staging.write(device_pointer(destination), values,
                                self.stream_handle if stream_handle is None else stream_handle)
        elif stream_handle is None or stream_handle == self.stream_handle:
            destination.copy_to_device(values, stream=self.stream)
        else:
            raise ValueError(f"a write of {values.nbytes} bytes on another stream than the serving one")

    def write_rows(self, destination: Any, host: np.ndarray) -> None:
        """`write` for a 2D device view whose rows are contiguous but need not follow each other (the first columns
        of some rows of a wider array): one pitched copy through a pinned slot, in the serving stream's order, or a
        write a row when the values pass a slot."""
        values = np.ascontiguousarray(host, dtype=destination.dtype).reshape(destination.shape)
        if values.size == 0:
            return
        if destination.ndim != 2 or destination.strides[1] != destination.dtype.itemsize:
            raise ValueError(f"write_rows takes a 2D view with contiguous rows, got strides {destination.strides}")
        if values.nbytes > SLOT_BYTES:
            for row in range(values.shape[0]):
                self.write(destination[row], values[row])
            return
        self._staging.write_rows(device_pointer(destination), int(destination.strides[0]), values,
                                 self.stream_handle)

    def read(self, source: Any) -> np.ndarray:
        """A device array's values on the host, after everything queued before on the stream."""
        if self._staging.fits(source):
            return self._staging.read(source, device_pointer(source))
        host = source.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return host

    def start_read(self, source: Any) -> Any:
        """`read` in two steps: the copy queues now, `.values()` of the result waits for it, so work queued in
        between runs on the GPU while the values travel (a read too large for a staging slot happens here)."""
        if self._staging.fits(source):
            return self._staging.start_read(source, device_pointer(source))
        return ReadValues(self.read(source))

    def clear(self, array: Any) -> None:
        memset(array, self.stream_handle)

    def copy(self, destination: Any, source: Any) -> None:
        copy_device(destination, source, self.stream_handle)

    def blas(self) -> Any:
        from ninfer.backends.cuda.blas import Blas

        return Blas(self)

    def side_stream(self) -> "SideStream":
        """The device's second stream (created on first use, then the same one)."""
        if self._side is None:
            self._side = SideStream(self)
        return self._side

    def ahead_stream(self) -> "AheadStream":
        """The device's stream for work queued ahead of the serving stream's need (created on first use)."""
        if self._ahead is None:
            self._ahead = AheadStream(self)
        return self._ahead

    def capture(self, record: Any) -> Any:
        from ninfer.backends.cuda.graphs import capture
        from ninfer.kernels_numba.numba_setup import cuda

        # numba frees dropped device arrays in batches, at whatever moment the batch fills; cuMemFree is illegal
        # while a stream captures and would invalidate the graph, so the batch waits until the capture ends.
        with cuda.defer_cleanup():
            return capture(self.stream_handle, record)

    def capture_pieces(self, record: Any) -> Any:
        """`graphs.capture_pieces` on the serving stream (frees deferred as in `capture`)."""
        from ninfer.backends.cuda.graphs import capture_pieces
        from ninfer.kernels_numba.numba_setup import cuda

        with cuda.defer_cleanup():
            return capture_pieces(self.stream_handle, record)


class SideStream:
    """A second stream for work that may run beside the serving stream's: `fork()` makes it wait for everything
    queued on the serving stream so far, `run(work)` issues `work()` (whose launches name this stream), `join()`
    makes the serving stream wait for it. Captured, the two events turn one stream capture into one graph with two
    branches (the side stream joins the capture at the fork and must be joined back before the capture ends). It has
    its own cuBLAS handle and workspace: two GEMMs in flight must not share a workspace."""

    def __init__(self, device: CudaDevice) -> None:
        from cuda.bindings import driver

        from ninfer.backends.cuda.blas import Blas

        self._driver, self._serving = driver, device.stream_handle
        self._handle_object, self.stream_handle, self.stream = _new_stream(driver)
        self._forked, self._joined = (_event(driver), _event(driver))
        self.blas = Blas(device, stream_handle=self.stream_handle)

    def fork(self) -> None:
        _record_and_wait(self._driver, self._forked, self._serving, self.stream_handle)

    def run(self, work: Any) -> None:
        work()

    def join(self) -> None:
        _record_and_wait(self._driver, self._joined, self.stream_handle, self._serving)


class AheadStream:
    """A stream for work the serving stream needs later (`dequant_ahead.WeightDequantizer`): `after_serving()` makes
    it wait for everything queued on the serving stream so far, `mark(slot)` records that its work so far is done
    under a numbered mark, and `serving_waits(slot)` makes the serving stream wait for the last such mark. Never
    captured: it runs beside eager prefill chunks only. Same priority as the serving stream: the serving stream at
    the context's greatest priority (this one at its least) changed nothing measurable (results/
    cuda_model_v2_dequant_ahead_priority_session25.json)."""

    def __init__(self, device: CudaDevice) -> None:
        from cuda.bindings import driver

        self._driver, self._serving = driver, device.stream_handle
        self._handle_object, self.stream_handle, self.stream = _new_stream(driver)
        self._after = _event(driver)
        self._marks: dict[int, Any] = {}

    def after_serving(self) -> None:
        _record_and_wait(self._driver, self._after, self._serving, self.stream_handle)

    def mark(self, slot: int) -> None:
        if slot not in self._marks:
            self._marks[slot] = _event(self._driver)
        check(self._driver.cuEventRecord(self._marks[slot], self.stream_handle), "cuEventRecord")

    def serving_waits(self, slot: int) -> None:
        check(self._driver.cuStreamWaitEvent(self._serving, self._marks[slot], 0), "cuStreamWaitEvent")


def _new_stream(driver: Any) -> tuple[Any, int, Any]:
    """A non-blocking stream: the driver's handle object, its integer handle, and numba's view of it."""
    err, handle = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
    check(err, "cuStreamCreate")
    return handle, int(handle), cuda.external_stream(int(handle))


def _record_and_wait(driver: Any, event: Any, recorded_on: int, waiting: int) -> None:
    """Stream `waiting` waits for everything queued on stream `recorded_on` so far."""
    check(driver.cuEventRecord(event, recorded_on), "cuEventRecord")
    check(driver.cuStreamWaitEvent(waiting, event, 0), "cuStreamWaitEvent")


def _event(driver: Any) -> Any:
    err, event = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    check(err, "cuEventCreate")
    return event


def check(result: Any, what: str) -> None:
    """Raise on a cuda-python error code (`CUresult` or a tuple starting with one)."""
    code = result[0] if isinstance(result, tuple) else result
    if int(code) != 0:
        raise RuntimeError(f"{what} failed: {code!r}")


def device_pointer(array: Any) -> int:
    return int(array.device_ctypes_pointer.value or 0)


def memset(array: Any, stream_handle: int, value: int = 0) -> None:
    """Fill a contiguous device array's bytes with `value`, asynchronously on the stream (capture-safe)."""
    from cuda.bindings import driver

    if array.nbytes:
        check(driver.cuMemsetD8Async(device_pointer(array), value, int(array.nbytes), stream_handle),
              "cuMemsetD8Async")


def copy_device(destination: Any, source: Any, stream_handle: int) -> None:
    """Device-to-device copy of equal-sized contiguous arrays on the stream (capture-safe)."""
    from cuda.bindings import driver

    if destination.nbytes != source.nbytes:
        raise ValueError(f"copy of {source.nbytes} bytes into {destination.nbytes}")
    if source.nbytes:
        check(driver.cuMemcpyDtoDAsync(device_pointer(destination), device_pointer(source), int(source.nbytes),
                                       stream_handle), "cuMemcpyDtoDAsync")
