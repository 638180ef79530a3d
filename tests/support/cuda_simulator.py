"""Real kernels in numba's CUDA simulator, with Python stand-ins for what the simulator cannot run.

Import this only in a process started with NUMBA_ENABLE_CUDASIM=1 (numba reads it once, at import). The simulator
runs a kernel's Python source with one Python thread per CUDA thread and real barriers, so index arithmetic, tile
staging, masks, tails and barriers run as written. It has no inline PTX and no warp collectives; here they are:
- raw byte addresses (`address_of`, `shared_address`) as integers that loads, stores and copies resolve to the
  arrays they point into, so address arithmetic runs as written; `cp.async` copies at once and checks what the
  hardware requires (16-byte aligned on both sides, in bounds);
- warp shuffles, warp barriers, warp sums, `ldmatrix` and the tensor-core mma (bf16 m16n8k16, TF32 m16n8k8) as
  exchanges among the 32 threads of a warp, with the PTX fragment layouts;
- global loads and stores by address and vector loads by index (checked for alignment and bounds), packed bf16
  fma, bf16 and half pair conversions, libdevice's bit casts and byte permute, and its cosf, sinf and rintf (NumPy's).
An emulated mma sums exactly and rounds once to fp32, so kernels match their twins within fp32 tolerance, not
bitwise. `install(namespace)` swaps the stand-ins into a kernel's globals (`kernel.py_func.__globals__`: templated
kernels have their own) or a module's.
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    raise RuntimeError("tests.support.cuda_simulator needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported")

from numba.cuda import libdevice  # noqa: E402

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from numba.cuda.simulator import kernel as simulator_kernel  # noqa: E402
from numba.cuda.simulator import kernelapi  # noqa: E402

# ---- barriers and warp collectives ---------------------------------------------------------------------------------

class _Barrier:
    """A barrier of `parties` threads (fewer as threads `leave`: a block's exited threads no longer count at its
    syncthreads), whose last to arrive runs `action` first. Each waiting thread sleeps on its own gate, a lock, and
    on waking opens the next one's: the threads resume one by one, as the interpreter runs them anyway. (With
    threading.Barrier or a condition variable every waiter woke at once into a scramble for one lock, then for the
    interpreter: 32 threads a shuffle or mma, up to 1024 at syncthreads. A shuffle took 2.4 ms, now 0.7.)
    `abort` breaks it: the threads waiting and any that arrive later raise BrokenBarrierError."""

    def __init__(self, parties: int, action=None) -> None:
        self._lock = threading.Lock()
        self._parties, self._action, self._waiting, self._broken = parties, action, [], False

    def wait(self) -> None:
        thread = threading.current_thread()
        if not hasattr(thread, "gate"):  # locked except while its thread is being let through
            thread.gate = threading.Lock()
            thread.gate.acquire()
        with self._lock:
            if self._broken:
                raise threading.BrokenBarrierError
            waiting, at = self._waiting, len(self._waiting)
            last = at + 1 == self._parties
            if not last:
                waiting.append(thread.gate)
        if last:
            self._open()
        else:
            thread.gate.acquire()
            if at + 1 < len(waiting):
                waiting[at + 1].release()
        if self._broken:
            raise threading.BrokenBarrierError

    def leave(self) -> None:
        with self._lock:
            self._parties -= 1
            last = 0 < len(self._waiting) == self._parties
        if last:
            self._open()

    def abort(self) -> None:
        with self._lock:
            self._broken = True
        self._let_through()

    def _open(self) -> None:
        """Every other party waits (none arrives or leaves meanwhile): run the action, then let them through (or,
        the action failing, break the barrier and raise)."""
        try:
            if self._action is not None:
                self._action()
        except BaseException:
            self.abort()
            raise
        self._let_through()

    def _let_through(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        if waiting:
            waiting[0].release()


_warps_lock = threading.Lock()
_warps: dict[tuple, list] = {}  # per warp: [barrier, the lanes' values, the combined result, lane 0's combine]


def _combine(state: list) -> None:
    state[2] = state[3](list(state[1]))


def _check_block(thread) -> None:
    """Raise if another thread of the block failed (call with _warps_lock held): `_break_all` broke and dropped
    every warp's barrier, and a lane late to a collective would wait on a fresh one for lanes already gone."""
    if thread.block_barrier._broken:
        raise threading.BrokenBarrierError


def warp_collective(value, combine):
    """`combine(values of lanes 0..31)` (lane 0's `combine`), computed once, to every lane of the calling warp (all
    32 must call), and this lane. One barrier, whose action (run by the last lane to arrive, before any leaves)
    combines: no lane writes its next value before every lane has arrived, and no next combine overwrites the result
    before every lane has read it (it waits for every lane's next call)."""
    thread = threading.current_thread()
    block = thread.blockIdx
    key = (block.x, block.y, block.z, thread.thread_id >> 5)
    with _warps_lock:
        _check_block(thread)
        if key not in _warps:
            state = [None, [None] * 32, None, None]
            state[0] = _Barrier(32, functools.partial(_combine, state))
            _warps[key] = state
        state = _warps[key]
    lane = thread.thread_id & 31
    state[1][lane] = value
    if lane == 0:
        state[3] = combine
    state[0].wait()
    return state[2], lane


def shfl_xor_sync(mask, value, lane_mask):
    values, lane = warp_collective(value, tuple)
    return values[lane ^ int(lane_mask)]


def shfl_sync(mask, value, source_lane):
    values, _ = warp_collective(value, tuple)
    return values[int(source_lane) & 31]


def shfl_up_sync(mask, value, delta):
    """Lane l gets lane l - delta's value, or its own where l < delta (as `shfl.sync.up`)."""
    values, lane = warp_collective(value, tuple)
    return values[lane - int(delta)] if lane >= int(delta) else values[lane]


_masked_barriers: dict[tuple, _Barrier] = {}


def syncwarp(mask=0xFFFFFFFF):
    """A barrier among the lanes of `mask` (each of them must call it, as on the GPU)."""
    mask = int(mask) & 0xFFFFFFFF
    thread = threading.current_thread()
    if not mask >> (thread.thread_id & 31) & 1:
        raise ValueError(f"lane {thread.thread_id & 31} calls syncwarp with a mask {mask:#x} that leaves it out")
    block = thread.blockIdx
    key = (block.x, block.y, block.z, thread.thread_id >> 5, mask)
    with _warps_lock:
        _check_block(thread)
        if key not in _masked_barriers:
            _masked_barriers[key] = _Barrier(bin(mask).count("1"))
        barrier = _masked_barriers[key]
    barrier.wait()


def _lane_order_sum(values) -> np.float32:
    total = np.float32(0)
    for v in values:
        total = np.float32(total + v)
    return total


def warp_max_u32(value):
    """`redux.sync.max.u32`: the largest of the warp's uint32 values."""
    return warp_collective(np.uint32(value), max)[0]


def warp_sum(value):
    """The sum over the warp in lane order (the butterfly's order differs: equal within fp32 rounding)."""
    return warp_collective(np.float32(value), _lane_order_sum)[0]


# ---- bit casts -----------------------------------------------------------------------------------------------------

def float_as_int(value):
    return np.array([value], np.float32).view(np.int32)[0]


def int_as_float(value):
    return np.array([int(value) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


def _float32_function(function):
    """A libdevice fp32 function (the simulator's libdevice names are stubs that return None) as NumPy's on float32:
    within an ulp of the device's, not bitwise."""
    return lambda value: np.float32(function(np.float32(value)))


def byte_perm(x, y, selector):
    """PTX prmt: bytes of the 8-byte (y:x) picked by the selector's four 3-bit fields."""
    pool = (int(x) & 0xFFFFFFFF).to_bytes(4, "little") + (int(y) & 0xFFFFFFFF).to_bytes(4, "little")
    picked = bytes(pool[(int(selector) >> (4 * n)) & 7] for n in range(4))
    return np.array([int.from_bytes(picked, "little")], np.uint32).view(np.int32)[0]


def _bf16_pair_values(word) -> tuple[float, float]:
    """The two bf16 halves of a word (low first) as floats."""
    low, high = bf16_bits_to_f32(np.array([int(word) & 0xFFFFFFFF], np.uint32).view(np.uint16))
    return float(low), float(high)


def grid_dependency_no_op():
    """`griddepcontrol.wait` / `.launch_dependents`: the simulator runs one grid at a time, in stream order."""


def and_or(a, b, c):
    """`lop3.b32` with LUT 0xEA: (a & b) | c."""
    return np.uint32((int(a) & int(b)) | int(c))


def fma_bf16x2(a, b, c):
    """`fma.rn.bf16x2`: a * b + c on the two bf16 halves, each rounded to bf16 (through float32: exact for the small
    integers the kernels build)."""
    (a0, a1), (b0, b1), (c0, c1) = (_bf16_pair_values(v) for v in (a, b, c))
    return f32_to_bf16_bits(np.array([a0 * b0 + c0, a1 * b1 + c1], np.float32)).view(np.uint32)[0]


def exp2_approx(x):
    """`ex2.approx.ftz.f32`: 2**x in float32 (the hardware's approximation is within 2 ulp of this)."""
    return np.exp2(np.float32(x), dtype=np.float32)


def pack_bf16x2(low, high):
    """`cvt.rn.bf16x2.f32`: low into bits 0..15, high into 16..31, each rounded to nearest even."""
    return f32_to_bf16_bits(np.array([low, high], np.float32)).view(np.uint32)[0]


def half_pair_to_f32(word):
    """The two binary16 halves of a word as float32 (low, high)."""
    low, high = np.array([int(word) & 0xFFFFFFFF], np.uint32).view(np.float16).astype(np.float32)
    return low, high


# ---- tensor-core mma -----------------------------------------------------------------------------------------------

# Where each lane's fragment registers sit (PTX layouts): lane 4g + t holds C/D rows g and g + 8, columns 2t and
# 2t + 1; bf16 A register r rows g (+8 for odd r), columns 2t (+8 for r >= 2) and the next; bf16 B register r rows
# 2t (+8 for r = 1) and the next, column g; TF32 A register r row g (+8 for odd r), column t (+4 for r >= 2), TF32 B
# register r row t (+4 for r = 1), column g. As index arrays [lane, register(, half)]: the warp's operands are built
# in a few NumPy calls, not one per lane and register (2.8 ms an mma, while the warp's other lanes waited: a third
# of the simulated tensor-core kernels' time).
_G, _T, _R = np.arange(32)[:, None] >> 2, np.arange(32)[:, None] & 3, np.arange(4)[None, :]  # [lane, register]
_HALF = np.arange(2)[None, None, :]
_C_AT = tuple(np.broadcast_arrays(_G + 8 * (_R >> 1), 2 * _T + (_R & 1)))
_BF16_A_AT = tuple(np.broadcast_arrays((_G + 8 * (_R & 1))[..., None], (2 * _T + 8 * (_R >> 1))[..., None] + _HALF))
_BF16_B_AT = tuple(np.broadcast_arrays((2 * _T + 8 * _R[:, :2])[..., None] + _HALF, _G[..., None]))
_TF32_A_AT = tuple(np.broadcast_arrays(_G + 8 * (_R & 1), _T + 4 * (_R >> 1)))
_TF32_B_AT = tuple(np.broadcast_arrays(_T + 4 * _R[:, :2], _G))


def _mma(fragments: list, a_of, b_of) -> tuple:
    """D = A B + C from every lane's fragments; returns this lane's four D values (rows g and g + 8, columns 2t and
    2t + 1: the C/D layout both shapes share)."""
    def product(values):
        c = np.zeros((16, 8))
        c[_C_AT] = np.array([lane_values[-4:] for lane_values in values], np.float64)
        return (a_of(values) @ b_of(values) + c).astype(np.float32)

    d, lane = warp_collective(fragments, product)
    g, t = lane >> 2, lane & 3
    return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]


def _bf16_registers(values, first: int, count: int) -> np.ndarray:
    """[lane, register, half]: the bf16 halves (low first) of registers first.. of every lane, as floats."""
    words = np.array([[int(w) & 0xFFFFFFFF for w in v[first:first + count]] for v in values], np.uint32)
    return bf16_bits_to_f32(words.view(np.uint16).reshape(32, count, 2)).astype(np.float64)


def _bf16_a(values) -> np.ndarray:
    a = np.zeros((16, 16))
    a[_BF16_A_AT] = _bf16_registers(values, 0, 4)
    return a


def _bf16_b(values) -> np.ndarray:
    b = np.zeros((16, 8))
    b[_BF16_B_AT] = _bf16_registers(values, 4, 2)
    return b


def mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma([a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], _bf16_a, _bf16_b)


def _tf32_registers(values, first: int, count: int) -> np.ndarray:
    """[lane, register]: what the tensor core reads of float32 TF32 operands, their top 19 bits, as floats."""
    bits = np.array([v[first:first + count] for v in values], np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return bits.view(np.float32).astype(np.float64)


def _tf32_a(values) -> np.ndarray:
    a = np.zeros((16, 8))
    a[_TF32_A_AT] = _tf32_registers(values, 0, 4)
    return a


def _tf32_b(values) -> np.ndarray:
    b = np.zeros((8, 8))
    b[_TF32_B_AT] = _tf32_registers(values, 4, 2)
    return b


def mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma([a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], _tf32_a, _tf32_b)


# ---- raw addresses and cp.async ------------------------------------------------------------------------------------
# Addresses are integers, as on the GPU, so kernels may keep them in int64 local arrays: an array's is its real host
# address, and every array whose address was taken is remembered (and kept alive, so no later array reuses its
# memory) for loads and copies to find. A block's dynamic shared array gets a 32-bit window at SHARED_WINDOW, as
# `cvta.to.shared` gives.

SHARED_WINDOW = 0x1000_0000
_regions: list[tuple[int, np.ndarray]] = []  # (address, flat byte view), newest last
_shared_windows: dict[tuple, np.ndarray] = {}  # block -> its shared array's bytes


def _ndarray(array) -> np.ndarray:
    while not isinstance(array, np.ndarray):
        array = array._item if hasattr(array, "_item") else array._ary
    return array


def address_of(array) -> int:
    array = _ndarray(array)
    if not array.flags.c_contiguous:
        raise ValueError("address_of needs a C-contiguous array")
    address = array.ctypes.data
    with _warps_lock:
        if not any(start == address and len(data) == array.nbytes for start, data in _regions[-8:]):
            _regions.append((address, array.reshape(-1).view(np.uint8)))
    return address


def _region(address: int, size: int) -> tuple[int, np.ndarray]:
    """(start, bytes) of the newest remembered array holding `size` bytes at `address`."""
    for start, data in reversed(_regions):
        if start <= address and address + size <= start + len(data):
            return start, data
    raise IndexError(f"a {size}-byte access at {address:#x} is outside every array whose address was taken")


def _bytes_at(address: int, size: int) -> np.ndarray:
    address = int(address)
    start, data = _region(address, size)
    return data[address - start:address - start + size]


def _block_key() -> tuple:
    block = threading.current_thread().blockIdx
    return (block.x, block.y, block.z)


def shared_address(address: int):
    """The 32-bit shared-window address of a generic address inside the block's (one) dynamic shared array."""
    address = int(address)
    start, data = _region(address, 1)
    _shared_windows[_block_key()] = data
    return np.uint32(SHARED_WINDOW + address - start)


def _shared_bytes(address, size: int) -> np.ndarray:
    offset, data = int(address) - SHARED_WINDOW, _shared_windows[_block_key()]
    if not 0 <= offset <= len(data) - size:
        raise IndexError(f"a {size}-byte shared access at {offset} is past shared memory ({len(data)} bytes)")
    return data[offset:offset + size]


def _copy_async(shared, source, source_bytes, width: int) -> None:
    size = int(source_bytes)
    if not 0 <= size <= width:
        raise ValueError(f"cp.async source size {size} is not 0..{width}")
    for name, address in (("shared", shared), ("global", source)):
        if int(address) % width:
            raise ValueError(f"cp.async {name} address {int(address):#x} is not {width}-byte aligned")
    destination = _shared_bytes(shared, width)
    destination[:size] = _bytes_at(source, size) if size else destination[:0]
    destination[size:] = 0


def copy_async_16(shared, source, source_bytes) -> None:
    _copy_async(shared, source, source_bytes, 16)


def copy_async_8(shared, source, source_bytes) -> None:
    _copy_async(shared, source, source_bytes, 8)


def _words(address: int, count: int) -> np.ndarray:
    size = 4 * count
    if int(address) % size:
        raise ValueError(f"a {size}-byte access at {int(address):#x} is not {size}-byte aligned")
    return _bytes_at(address, size).view(np.uint32)


def load_word_at(address):
    return _words(address, 1)[0]


def load_words2_at(address):
    return tuple(_words(address, 2))


def load_words4_at(address):
    return tuple(_words(address, 4))


def store_word_at(address, w0) -> None:
    _words(address, 1)[:] = [int(w0) & 0xFFFFFFFF]


def store_words2_at(address, w0, w1) -> None:
    _words(address, 2)[:] = [int(w) & 0xFFFFFFFF for w in (w0, w1)]


def store_words4_at(address, w0, w1, w2, w3) -> None:
    _words(address, 4)[:] = [int(w) & 0xFFFFFFFF for w in (w0, w1, w2, w3)]


def load2(array, index):
    """`linear.load2`: two consecutive elements of a contiguous array (one vector load on the GPU)."""
    flat, i = _ndarray(array).reshape(-1), int(index)
    return flat[i], flat[i + 1]


def load4(array, index):
    flat, i = _ndarray(array).reshape(-1), int(index)
    return flat[i], flat[i + 1], flat[i + 2], flat[i + 3]


def store4(array, index, a, b, c, d) -> None:
    flat, i = _ndarray(array).reshape(-1), int(index)
    flat[i], flat[i + 1], flat[i + 2], flat[i + 3] = a, b, c, d


def load_matrix_x4(shared):
    """`ldmatrix .x4`: lanes 8m..8m+7 give matrix m's row addresses; lane 4g + t gets word t of row g of each."""
    rows, lane = warp_collective(int(shared), tuple)
    words = []
    for m in range(4):
        address = rows[8 * m + (lane >> 2)]
        if address % 16:
            raise ValueError(f"ldmatrix row address {address:#x} is not 16-byte aligned")
        words.append(_shared_bytes(address, 16).view(np.uint32)[lane & 3])
    return tuple(words)


def load_matrix_x4_trans(shared):
    """`ldmatrix .x4.trans`: lanes 8m..8m+7 give matrix m's row addresses; lane 4g + t gets element g of rows 2t
    (low half) and 2t + 1 (high half) of each."""
    rows, lane = warp_collective(int(shared), tuple)
    words = []
    for m in range(4):
        halves = []
        for row in (2 * (lane & 3), 2 * (lane & 3) + 1):
            address = rows[8 * m + row]
            if address % 16:
                raise ValueError(f"ldmatrix row address {address:#x} is not 16-byte aligned")
            halves.append(int(_shared_bytes(address, 16).view(np.uint16)[lane >> 2]))
        words.append(np.uint32(halves[0] | (halves[1] << 16)))
    return tuple(words)


def copy_async_commit() -> None:
    """Copies land at issue in the simulator: nothing is in flight."""


def copy_async_wait_all() -> None:
    """Copies land at issue in the simulator: nothing to wait for."""


def copy_async_wait_prior() -> None:
    """Copies land at issue in the simulator: nothing to wait for."""


def allow_dynamic_shared(dispatcher, signature, nbytes) -> None:
    """The simulator gives a launch whatever dynamic shared memory it asks for."""


STAND_INS = {
    "address_of": address_of, "shared_address": shared_address, "copy_async_16": copy_async_16,
    "copy_async_8": copy_async_8,
    "copy_async_commit": copy_async_commit, "copy_async_wait_all": copy_async_wait_all,
    "copy_async_wait_prior": copy_async_wait_prior,
    "mma_bf16_m16n8k16": mma_bf16_m16n8k16, "mma_tf32_m16n8k8": mma_tf32_m16n8k8, "warp_sum": warp_sum,
    "warp_max_u32": warp_max_u32,
    "allow_dynamic_shared": allow_dynamic_shared, "load_word_at": load_word_at, "load_words2_at": load_words2_at,
    "load_words4_at": load_words4_at, "load_words4_streaming_at": load_words4_at, "store_word_at": store_word_at,
    "store_words2_at": store_words2_at,
    "store_words4_at": store_words4_at, "load2": load2, "load4": load4, "store4": store4, "fma_bf16x2": fma_bf16x2,
    "and_or": and_or,
    "wait_for_prior_grids": grid_dependency_no_op, "allow_dependents": grid_dependency_no_op,
    "half_pair_to_f32": half_pair_to_f32, "pack_bf16x2": pack_bf16x2, "load_matrix_x4": load_matrix_x4,
    "load_matrix_x4_trans": load_matrix_x4_trans,
    "exp2_approx": exp2_approx,
}


def install(namespace: dict) -> None:
    """Replace, in a kernel's or a module's globals, every name that has a stand-in here."""
    for name, stand_in in STAND_INS.items():
        if name in namespace:
            namespace[name] = stand_in


# ---- the block's threads -------------------------------------------------------------------------------------------
# The simulator's own block manager polls every thread for arrival at a barrier in a Python loop, which takes the
# interpreter from the threads doing the work; here each block has a `_Barrier` of its running threads (an exited
# thread no longer counts, as in the simulator's manager). A failing thread breaks it, and every warp barrier, so no
# other thread waits forever.

def _break_all(barrier: _Barrier) -> None:
    """Break the block's barrier, then (in this order: `_check_block`) every warp's."""
    barrier.abort()
    with _warps_lock:
        for state in _warps.values():
            state[0].abort()
        for warp_barrier in _masked_barriers.values():
            warp_barrier.abort()
        _warps.clear()
        _masked_barriers.clear()


def _run_block(manager, grid_point, *args) -> None:
    barrier = _Barrier(int(np.prod(manager._block_dim)))

    def target() -> None:
        try:
            manager._f(*args)
        except BaseException:
            _break_all(barrier)
            raise
        finally:
            barrier.leave()

    threads = []
    for block_point in np.ndindex(*manager._block_dim):
        thread = simulator_kernel.BlockThread(target, manager, grid_point, block_point, manager._debug)
        thread.block_barrier = barrier
        threads.append(thread)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failures = [thread.exception for thread in threads if thread.exception]
    # the thread that failed first, not the others its failure released from their barriers
    causes = [f for f in failures if not isinstance(f[0], threading.BrokenBarrierError)]
    if failures:
        first = (causes or failures)[0]
        raise first[0].with_traceback(first[1])


def _syncthreads(thread) -> None:
    thread.block_barrier.wait()


simulator_kernel.BlockManager.run = _run_block
simulator_kernel.BlockThread.syncthreads = _syncthreads
# Module-wide: libdevice's bit casts, and the shuffles on the simulator's fake `cuda` module inside kernels.
libdevice.float_as_int = float_as_int
libdevice.int_as_float = int_as_float
libdevice.byte_perm = byte_perm
libdevice.cosf, libdevice.sinf, libdevice.rintf = (_float32_function(f) for f in (np.cos, np.sin, np.rint))
kernelapi.FakeCUDAModule.shfl_xor_sync = staticmethod(shfl_xor_sync)
kernelapi.FakeCUDAModule.shfl_sync = staticmethod(shfl_sync)
kernelapi.FakeCUDAModule.shfl_up_sync = staticmethod(shfl_up_sync)
kernelapi.FakeCUDAModule.syncwarp = staticmethod(syncwarp)
