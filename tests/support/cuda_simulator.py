"""Real kernels in numba's CUDA simulator, with Python stand-ins for what the simulator cannot run.

Import this only in a process started with NUMBA_ENABLE_CUDASIM=1 (numba reads it once, at import). The simulator
runs a kernel's Python source with one Python thread per CUDA thread and real barriers, so index arithmetic, tile
staging, masks, tails and barriers run as written. It has no inline PTX and no warp collectives; here they are:
- raw byte addresses (`address_of`, `shared_address`) as (byte view, offset) pairs, so address arithmetic runs as
  written; `cp.async` copies at once and checks what the hardware requires (16-byte aligned on both sides, in bounds);
- warp shuffles, warp barriers, warp sums and the tensor-core mma (bf16 m16n8k16, TF32 m16n8k8) as exchanges among
  the 32 threads of a warp, with the PTX fragment layouts;
- libdevice's bit casts and byte permute.
An emulated mma sums exactly and rounds once to fp32, so kernels match their twins within fp32 tolerance, not
bitwise. `install(namespace)` swaps the stand-ins into a kernel's globals (`kernel.py_func.__globals__`: templated
kernels have their own) or a module's.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    raise RuntimeError("tests.support.cuda_simulator needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported")

from numba.cuda import libdevice  # noqa: E402
from numba.cuda.simulator import kernelapi  # noqa: E402

# ---- warp collectives ----------------------------------------------------------------------------------------------

_warps_lock = threading.Lock()
_warps: dict[tuple, list] = {}  # per warp: [barrier, the lanes' values, the combined result]


def warp_collective(value, combine):
    """`combine(values of lanes 0..31)`, computed once (by lane 0), to every lane of the calling warp (all 32 must
    call), and this lane. Two barriers: lane 0 reads the values between them, every lane reads the result after the
    second, and nobody overwrites either before the next call's first barrier, which every lane must reach."""
    thread = threading.current_thread()
    block = thread.blockIdx
    key = (block.x, block.y, block.z, thread.thread_id >> 5)
    with _warps_lock:
        if key not in _warps:
            _warps[key] = [threading.Barrier(32), [None] * 32, None]
    state = _warps[key]
    lane = thread.thread_id & 31
    state[1][lane] = value
    state[0].wait()
    if lane == 0:
        state[2] = combine(list(state[1]))
    state[0].wait()
    return state[2], lane


def shfl_xor_sync(mask, value, lane_mask):
    values, lane = warp_collective(value, tuple)
    return values[lane ^ int(lane_mask)]


def shfl_sync(mask, value, source_lane):
    values, _ = warp_collective(value, tuple)
    return values[int(source_lane) & 31]


_masked_barriers: dict[tuple, threading.Barrier] = {}


def syncwarp(mask=0xFFFFFFFF):
    """A barrier among the lanes of `mask` (each of them must call it, as on the GPU)."""
    mask = int(mask) & 0xFFFFFFFF
    thread = threading.current_thread()
    if not mask >> (thread.thread_id & 31) & 1:
        raise ValueError(f"lane {thread.thread_id & 31} calls syncwarp with a mask {mask:#x} that leaves it out")
    block = thread.blockIdx
    key = (block.x, block.y, block.z, thread.thread_id >> 5, mask)
    with _warps_lock:
        if key not in _masked_barriers:
            _masked_barriers[key] = threading.Barrier(bin(mask).count("1"))
    _masked_barriers[key].wait()


def _lane_order_sum(values) -> np.float32:
    total = np.float32(0)
    for v in values:
        total = np.float32(total + v)
    return total


def warp_sum(value):
    """The sum over the warp in lane order (the butterfly's order differs: equal within fp32 rounding)."""
    return warp_collective(np.float32(value), _lane_order_sum)[0]


# ---- bit casts -----------------------------------------------------------------------------------------------------

def float_as_int(value):
    return np.array([value], np.float32).view(np.int32)[0]


def int_as_float(value):
    return np.array([int(value) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


def byte_perm(x, y, selector):
    """PTX prmt: bytes of the 8-byte (y:x) picked by the selector's four 3-bit fields."""
    pool = (int(x) & 0xFFFFFFFF).to_bytes(4, "little") + (int(y) & 0xFFFFFFFF).to_bytes(4, "little")
    picked = bytes(pool[(int(selector) >> (4 * n)) & 7] for n in range(4))
    return np.array([int.from_bytes(picked, "little")], np.uint32).view(np.int32)[0]


def _bf16_pair_values(word) -> tuple[float, float]:
    word = int(word) & 0xFFFFFFFF
    low = np.array([(word & 0xFFFF) << 16], np.uint32).view(np.float32)[0]
    high = np.array([word & 0xFFFF0000], np.uint32).view(np.float32)[0]
    return float(low), float(high)


# ---- tensor-core mma -----------------------------------------------------------------------------------------------

def _mma(fragments: list, a_of, b_of) -> tuple:
    """D = A B + C from every lane's fragments; returns this lane's four D values (rows g and g + 8, columns 2t and
    2t + 1: the C/D layout both shapes share)."""
    def product(values):
        c = np.zeros((16, 8))
        for other, lane_values in enumerate(values):
            g, t = other >> 2, other & 3
            c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = (float(v) for v in lane_values[-4:])
        return (a_of(values) @ b_of(values) + c).astype(np.float32)

    d, lane = warp_collective(fragments, product)
    g, t = lane >> 2, lane & 3
    return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]


def _bf16_a(values) -> np.ndarray:
    a = np.zeros((16, 16))
    for lane, v in enumerate(values):
        g, t = lane >> 2, lane & 3
        a[g, 2 * t:2 * t + 2] = _bf16_pair_values(v[0])
        a[g + 8, 2 * t:2 * t + 2] = _bf16_pair_values(v[1])
        a[g, 2 * t + 8:2 * t + 10] = _bf16_pair_values(v[2])
        a[g + 8, 2 * t + 8:2 * t + 10] = _bf16_pair_values(v[3])
    return a


def _bf16_b(values) -> np.ndarray:
    b = np.zeros((16, 8))
    for lane, v in enumerate(values):
        g, t = lane >> 2, lane & 3
        b[2 * t:2 * t + 2, g] = _bf16_pair_values(v[4])
        b[2 * t + 8:2 * t + 10, g] = _bf16_pair_values(v[5])
    return b


def mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma([a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], _bf16_a, _bf16_b)


def _tf32(value) -> float:
    """What the tensor core reads of a float32 TF32 operand: its top 19 bits."""
    bits = np.array([value], np.float32).view(np.uint32)[0] & np.uint32(0xFFFFE000)
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def _tf32_a(values) -> np.ndarray:
    a = np.zeros((16, 8))
    for lane, v in enumerate(values):
        g, t = lane >> 2, lane & 3
        a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4] = (_tf32(x) for x in v[:4])
    return a


def _tf32_b(values) -> np.ndarray:
    b = np.zeros((8, 8))
    for lane, v in enumerate(values):
        g, t = lane >> 2, lane & 3
        b[t, g], b[t + 4, g] = _tf32(v[4]), _tf32(v[5])
    return b


def mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma([a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], _tf32_a, _tf32_b)


# ---- raw addresses and cp.async ------------------------------------------------------------------------------------

class Address:
    """A byte address: a flat byte view of one array and an offset into it. Adding integers moves the offset."""

    def __init__(self, data: np.ndarray, offset: int):
        self.data, self.offset = data, offset

    def __add__(self, other):
        return Address(self.data, self.offset + int(other))

    __radd__ = __add__

    def __sub__(self, other):
        return Address(self.data, self.offset - int(other))


def _ndarray(array) -> np.ndarray:
    while not isinstance(array, np.ndarray):
        array = array._item if hasattr(array, "_item") else array._ary
    return array


def address_of(array) -> Address:
    array = _ndarray(array)
    if not array.flags.c_contiguous:
        raise ValueError("address_of needs a C-contiguous array")
    return Address(array.reshape(-1).view(np.uint8), 0)


def shared_address(address: Address) -> Address:
    return address


def copy_async_16(shared: Address, source: Address, source_bytes) -> None:
    size = int(source_bytes)
    if not 0 <= size <= 16:
        raise ValueError(f"cp.async source size {size} is not 0..16")
    for name, address in (("shared", shared), ("global", source)):
        if address.offset % 16:
            raise ValueError(f"cp.async {name} address is not 16-byte aligned (offset {address.offset})")
    if shared.offset + 16 > len(shared.data):
        raise IndexError(f"cp.async writes past shared memory ({shared.offset} + 16 > {len(shared.data)})")
    if size and not 0 <= source.offset <= len(source.data) - size:
        raise IndexError(f"cp.async reads past its array ({source.offset} + {size} > {len(source.data)})")
    shared.data[shared.offset:shared.offset + size] = source.data[source.offset:source.offset + size]
    shared.data[shared.offset + size:shared.offset + 16] = 0


def copy_async_commit() -> None:
    """Copies land at issue in the simulator: nothing is in flight."""


def copy_async_wait_all() -> None:
    """Copies land at issue in the simulator: nothing to wait for."""


def allow_dynamic_shared(dispatcher, signature, nbytes) -> None:
    """The simulator gives a launch whatever dynamic shared memory it asks for."""


STAND_INS = {
    "address_of": address_of, "shared_address": shared_address, "copy_async_16": copy_async_16,
    "copy_async_commit": copy_async_commit, "copy_async_wait_all": copy_async_wait_all,
    "mma_bf16_m16n8k16": mma_bf16_m16n8k16, "mma_tf32_m16n8k8": mma_tf32_m16n8k8, "warp_sum": warp_sum,
    "allow_dynamic_shared": allow_dynamic_shared,
}


def install(namespace: dict) -> None:
    """Replace, in a kernel's or a module's globals, every name that has a stand-in here."""
    for name, stand_in in STAND_INS.items():
        if name in namespace:
            namespace[name] = stand_in


# Threads waiting at a barrier wake sooner than at the default 5 ms switch interval: 2.4x faster kernels here.
sys.setswitchinterval(0.001)
# Module-wide: libdevice's bit casts, and the shuffles on the simulator's fake `cuda` module inside kernels.
libdevice.float_as_int = float_as_int
libdevice.int_as_float = int_as_float
libdevice.byte_perm = byte_perm
kernelapi.FakeCUDAModule.shfl_xor_sync = staticmethod(shfl_xor_sync)
kernelapi.FakeCUDAModule.shfl_sync = staticmethod(shfl_sync)
kernelapi.FakeCUDAModule.syncwarp = staticmethod(syncwarp)
