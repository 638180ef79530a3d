"""Kernel launches straight through the driver, with the arguments packed the way numba packs them.

Why: numba's own launch types every argument, wraps each device array in a memory view and converts the stream for
cuda.core: 27-33 us of host time for a small kernel on the GPU machine, against 8-11 us here
(bench/host_round_trip.py). The model's launch wrappers paid far more (rms_norm_rows ~140-190 us a call inside the
35B-A3B's 8K prefill, 31 us after this and remembered dtype views; results/cuda_model_35b_host_trace_session20.json
against cuda_model_35b_fast_launch_session20.json), and the prefill is ~1,300 launches: the GPU idled wherever short
kernels followed one another. Decode replays graphs and pays none of this; prefill, short prompts above all, pays it
on every launch.

`FastKernel` wraps a numba dispatcher. `kernel[grid, block, stream, shared](*args)` keys the launch on the argument
kinds (a device array's numba type, a scalar's Python type). The first launch of each kind is numba's own, and a
pre-launch callback records the overload numba picked (compiled, conversions included, exactly as always); from then
on each argument is packed into the slots numba's kernel ABI gives it (an array: meminfo, parent, item count, item
size, data address, shape, strides) with one `struct.pack_into`, then `cuLaunchKernel` launches it. A device array's
slot values and type are worked out once per array object (the workspace's views are long-lived objects) and
remembered through a weak reference.

A launcher keeps the kernel handle numba gave on its first launch: kernels run on one GPU a process (the engine's;
the cold tier's secondary GPUs only take copies).

Anything else (a host array to copy, a foreign CUDA array, an empty array, a type this packer does not know) takes
numba's own launch, so the fast path never changes what a launch computes, only what it costs:
tests/kernels/test_fast_launch.py launches a kernel of every argument kind both ways and compares the bits, and every
other GPU kernel test runs through the fast path against its NumPy twin. Every other attribute reads through to the
dispatcher (compile, overloads, ...).
"""

from __future__ import annotations

import struct
import threading
import weakref
from typing import Any

import numpy as np

_ARRAY_CACHE_LIMIT = 1 << 15  # remembered device arrays before the table starts afresh (dead entries accumulate)
_INT64_RANGE = (-(1 << 63), 1 << 63)
_UNSEEN = object()  # launchers' marker for argument kinds not launched yet


class LaunchError(RuntimeError):
    """The driver refused a launch (bad grid, too much shared memory, a sticky error from an earlier kernel)."""


def _array_entry(array: Any) -> tuple[Any, Any, tuple[int, ...]] | None:
    """(weak reference, numba type, ABI slot values) of a numba device array, or None where numba's own launch must
    handle it. An empty array's data slot is a null pointer, as numba's launch passes it (a model without speculative
    decoding passes its recurrence an empty column buffer every step)."""
    from numba.core.typing.typeof import Purpose, typeof
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    if not isinstance(array, DeviceNDArray):  # (the workspace's are ViewMemoArrays)
        return None
    numba_type = typeof(array, Purpose.argument)
    values = (0, 0, int(array.size), int(array.dtype.itemsize), int(array.device_ctypes_pointer.value or 0),
              *(int(n) for n in array.shape), *(int(s) for s in array.strides))
    return weakref.ref(array), numba_type, values


_ARRAYS: dict[int, tuple[Any, Any, tuple[int, ...]]] = {}

# Scalar argument types the key takes as they are (numba types each by its Python type alone: a Python int as int64
# when it fits, which the key checks)
_SCALARS = frozenset({float, int, bool, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
                      np.uint16, np.uint32, np.uint64, np.bool_})


def _scalar_code(numba_type: Any) -> str | None:
    """The struct code of a scalar parameter's 8-byte slot (the driver reads the parameter's own size from its
    start, little-endian), or None for a kind this packer leaves to numba."""
    from numba import types

    if isinstance(numba_type, types.Boolean):
        return "?7x"
    if isinstance(numba_type, types.Integer):
        return "q" if numba_type.signed else "Q"
    if numba_type == types.float32:
        return "f4x"
    if numba_type == types.float64:
        return "d"
    return None


class _Launcher:
    """One compiled overload's packed launch: the kernel handle, the struct layout of its flattened parameters (an
    8-byte slot each; the driver copies each parameter's own size from the slot's start) and the slots'
    addresses, the `kernelParams` array cuLaunchKernel reads."""

    def __init__(self, handle: Any, codes: list[str], name: str) -> None:
        self.handle, self.name = handle, name
        self.layout = struct.Struct("<" + "".join(codes))
        self.buffer = np.zeros(max(1, len(codes)), np.uint64)
        self.pointers = (self.buffer.ctypes.data + 8 * np.arange(len(codes), dtype=np.uint64)).astype(np.uint64)
        self.pointers_address = int(self.pointers.ctypes.data)
        self.lock = threading.Lock()


def _dims(value: Any) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)):
        return int(value), 1, 1
    dims = tuple(int(v) for v in value) + (1, 1)
    if len(dims) > 5:
        raise ValueError(f"launch dimensions {value!r}: at most 3")
    return dims[0], dims[1], dims[2]


def _stream_handle(stream: Any) -> int | None:
    if stream is None or stream == 0:
        return 0
    handle = getattr(stream, "handle", None)
    return None if handle is None else int(handle)


class _Configured:
    __slots__ = ("_fast", "_grid", "_block", "_stream", "_shared", "_config")

    def __init__(self, fast: "FastKernel", config: tuple) -> None:
        self._fast, self._config = fast, config
        grid, block = config[0], config[1]
        self._stream = config[2] if len(config) > 2 else 0
        self._shared = int(config[3]) if len(config) > 3 else 0
        self._grid, self._block = _dims(grid), _dims(block)

    def __call__(self, *args: Any) -> None:
        fast = self._fast
        stream = _stream_handle(self._stream)
        kinds: list[Any] = []
        values: list[Any] = []
        arrays = _ARRAYS
        for value in args:
            entry = arrays.get(id(value))
            if entry is None or entry[0]() is not value:
                kind = type(value)
                if kind in _SCALARS:
                    if kind is int and not _INT64_RANGE[0] <= value < _INT64_RANGE[1]:
                        stream = None  # numba types it uint64
                    kinds.append(kind)
                    values.append(value)
                    continue
                entry = _array_entry(value)
                if entry is None:
                    stream = None
                    break
                if len(arrays) >= _ARRAY_CACHE_LIMIT:
                    arrays.clear()
                arrays[id(value)] = entry
            kinds.append(entry[1])
            values.extend(entry[2])
        if stream is None:  # numba's own launch
            fast.dispatcher[self._config](*args)
            return
        key = tuple(kinds)
        launcher = fast.launchers.get(key, _UNSEEN)
        if launcher is None or launcher is _UNSEEN:  # numba's launch (the first of these kinds: numba's choice)
            fast.numba_launch(key if launcher is _UNSEEN else None, self._config, args)
            return
        (gx, gy, gz), (bx, by, bz) = self._grid, self._block
        with launcher.lock:
            try:
                launcher.layout.pack_into(launcher.buffer, 0, *values)
            except struct.error:  # a value its slot's code refuses (a negative into an unsigned): numba's ctypes
                fast.dispatcher[self._config](*args)
                return
            result, = fast.driver.cuLaunchKernel(launcher.handle, gx, gy, gz, bx, by, bz, self._shared, stream,
                                                 launcher.pointers_address, 0)
        if result != fast.success:
            if result == fast.invalid_context:  # a thread numba has not set up yet: its launch makes the context
                fast.dispatcher[self._config](*args)
                return
            raise LaunchError(f"{launcher.name}: cuLaunchKernel grid {self._grid} block {self._block} shared "
                              f"{self._shared}: {result!r}")


class FastKernel:
    """A numba CUDA dispatcher whose launches go through `_Configured` (see the module docstring)."""

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher
        self.launchers: dict[tuple, _Launcher | None] = {}  # None: numba's launch for those kinds
        self.driver = self.success = self.invalid_context = None  # (the bindings load at the first fast launch)

    def __getitem__(self, config: Any) -> _Configured:
        return _Configured(self, config if isinstance(config, tuple) else (config,))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dispatcher, name)

    def numba_launch(self, key: tuple | None, config: tuple, args: tuple) -> None:
        """numba's own launch; with `key`, also remember the overload numba picked for these argument kinds (the
        same choice as numba's, conversions included) and lay out its parameters, or None (numba's launch from then
        on) for a parameter this packer does not know."""
        configured = self.dispatcher[config]
        chosen: list = []
        if key is not None:
            configured.pre_launch_callbacks.append(lambda kernel, _: chosen.append(kernel))
        configured(*args)
        if key is None:
            return
        from numba import types

        compiled, codes = chosen[0], []
        launcher: _Launcher | None = None
        for numba_type in compiled.argument_types:
            if isinstance(numba_type, types.Array):
                codes.extend("q" * (5 + 2 * numba_type.ndim))
            elif (code := _scalar_code(numba_type)) is not None:
                codes.append(code)
            else:
                break
        else:
            from cuda.bindings import driver

            self.driver, self.success = driver, driver.CUresult.CUDA_SUCCESS
            self.invalid_context = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
            function = compiled._codelibrary.get_cufunc()
            launcher = _Launcher(function.handle, codes, function.name)
        self.launchers[key] = launcher
