"""Decode-time bf16 linear layers (GEMV / skinny GEMM) and their MoE "gathered" variant.

`linear_bf16`: y[M, N] (+)= x[M, K] @ w[N, K]^T, w bf16 bits (uint16, [out, in] like the artifact), x/y fp32.
Geometry: blocks of WARPS warps; each warp owns R consecutive output rows n and walks the whole K: lane l reads the
16 bytes (8 bf16) at columns 256*i + 8*l of each of its R rows (one `ld.global.v2.u64`, coalesced 512 B per warp),
software-pipelined one step ahead (the first step's loads are issued before x is staged), and FMAs them with x staged
in shared memory (fp32, permuted so each lane's 8 x values are two conflict-free `ld.shared.v4.f32`; staging itself
uses float4 global loads, several in flight). x rows are processed in register tiles of up to 8 (weights are read
once per tile; M == 1 has its own kernel with a 1-row tile, fewer registers). K is walked in shared-memory chunks of
`kc` columns (a multiple of 256, at most SHARED_BUDGET bytes of x per block). Every (row m, output n) accumulates in
one lane-private fp32 register in the same column order whatever M, the tile kernel, the chunking or the grid are,
then a fixed xor-butterfly warp sum: a row's result is bitwise independent of how many rows share the launch.

Requirements: K % 8 == 0 (the artifact's K are multiples of 64), arrays C-contiguous, device allocations 16-byte
aligned (numba's are 256-aligned). fastmath is off on purpose: LLVM reassociation could reorder sums per unrolled
position; NVVM still contracts a*b+c into FMA.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from llvmlite import ir
from numba import float32, int32, int64, types, uint32, uint64
from numba.cuda.extending import intrinsic

from ninfer.backends.cpu.ops import linear as cpu_linear
from ninfer.backends.cpu.ops import silu as cpu_silu
from ninfer.kernels_numba.common import bf16_hi_to_f32, bf16_to_f32, silu_times, warp_sum
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel, register_options
from ninfer.kernels_numba.programmatic import allow_dependents, launch, wait_for_prior_grids

WARPS = 8  # warps per block
THREADS = 32 * WARPS
ROW_TILE = 8  # x rows per register tile
BF16_SPAN = 256  # columns one warp covers per iteration (32 lanes x 8 bf16)
SHARED_BUDGET = 32 * 1024  # bytes of dynamic shared memory per block for the x chunk (< 48 KiB: no opt-in needed)
BF16_ROWS_PER_WARP = 2
# The MoE decode's bf16 gathered GEMV: 4 rows a warp (121 registers, 2 blocks an SM: the 35B-A3B's gate|up in one
# wave, twice the loads in flight a warp) in blocks of 4 warps. H200, 8 experts cycled past the L2 (results/
# kernel_linear_session27.json), us (2 rows x 8 warps before): gate|up 14.7 -> 11.5, down 9.2 -> 8.0. A row's sum
# is the same lanes' in the same order at any geometry: the same bits.
GATHERED_ROWS_PER_WARP = 4
GATHERED_WARPS = 4
# Where K fits, the gathered GEMVs may issue every weight load of a lane before any multiply
# (`make_linear_bf16_gathered_flight_kernel`): (rows a warp, 256-column steps a lane, fewest slots a launch) for the
# gate | up kernel (K = hidden: 2048 on the 35B-A3B) and the SwiGLU down kernel (K = the experts' intermediate: 512).
# H200, 35B-A3B shapes (results/kernel_linear_gathered_flight_session36.json, *_gathered_flight_*_session36.*): alone
# at 8 slots (B=1), us: gate | up 12.2 (2 rows a warp) against the stepping kernel's 11.5, the down 8.5 (4 rows) /
# 8.0 (2 or 8) against 8.7; a whole bf16 step with both kernels in flight B=1 3.53 against 3.48 ms, B=8 7.57 against
# 8.02. So the gate | up kernel keeps the stepping form at one row of 8 slots; the down keeps the 4 rows a warp of
# the timed steps.
GATHERED_FLIGHT = {False: (2, 8, 16), True: (4, 2, 1)}


def _make_vector_load(count: int):
    @intrinsic
    def load_vector(typingctx, array, index):
        """`count` consecutive elements of a C-contiguous array starting at FLAT element `index`, as one vector
        load (the address must be aligned to count * itemsize bytes)."""
        signature = types.UniTuple(array.dtype, count)(array, index)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            pointer = builder.gep(data, [args[1]])
            element = context.get_value_type(sig.args[0].dtype)
            vector_type = ir.VectorType(element, count)
            vector_pointer = builder.bitcast(pointer, vector_type.as_pointer(pointer.type.addrspace))
            vector = builder.load(vector_pointer, align=count * context.get_abi_sizeof(element))
            values = [builder.extract_element(vector, ir.Constant(ir.IntType(32), i)) for i in range(count)]
            return context.make_tuple(builder, sig.return_type, values)

        return signature, codegen

    return load_vector


load2 = _make_vector_load(2)  # e.g. two uint64 = 16 bytes
load4 = _make_vector_load(4)  # e.g. four float32 = 16 bytes


@intrinsic
def store4(typingctx, array, index, a, b, c, d):
    """array[index : index + 4] = (a, b, c, d) as one 16-byte vector store (FLAT index, 16-byte aligned)."""
    signature = types.void(array, index, a, b, c, d)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        pointer = builder.gep(data, [args[1]])
        element = context.get_value_type(sig.args[0].dtype)
        vector_type = ir.VectorType(element, 4)
        vector = ir.Constant(vector_type, ir.Undefined)
        for i in range(4):
            value = context.cast(builder, args[2 + i], sig.args[2 + i], sig.args[0].dtype)
            vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), i))
        vector_pointer = builder.bitcast(pointer, vector_type.as_pointer(pointer.type.addrspace))
        builder.store(vector, vector_pointer, align=4 * context.get_abi_sizeof(element))
        return context.get_dummy_value()

    return signature, codegen


STAGE_UNROLL = 4
STAGE_VALUES = 8 * STAGE_UNROLL  # 8-column pieces each thread loads before storing (loads in flight while staging x)


@device_function
def stage_x(xs, x, row0, rows, c0, width, kc, layout):
    """x[row0 + m, c0 + c] (m < rows, c < width, width % 8 == 0) into the shared chunk xs[m * kc + ...], permuted
    for the kernels' conflict-free float4 reads. Each thread moves 8 consecutive columns per piece with two float4
    global loads, STAGE_UNROLL pieces in flight before their stores.
    layout 0 (bf16): column c = 256 q + 8 l + 4 h + e goes to 256 q + 128 h + 4 l + e.
    layout 4/5/6 (Q formats) and 8 (W8): see `quant_linear.stage_x_quant`."""
    K = x.shape[1]
    step = cuda.blockDim.x * 8
    slot_stride = kc >> 3
    vals = cuda.local.array(STAGE_VALUES, float32)
    for m in range(rows):
        src = (row0 + m) * K + c0
        dst_row = m * kc
        c = cuda.threadIdx.x * 8
        while c < width:
            for u in range(STAGE_UNROLL):
                cu = c + u * step
                if cu < width:
                    vals[8 * u], vals[8 * u + 1], vals[8 * u + 2], vals[8 * u + 3] = load4(x, src + cu)
                    vals[8 * u + 4], vals[8 * u + 5], vals[8 * u + 6], vals[8 * u + 7] = load4(x, src + cu + 4)
            for u in range(STAGE_UNROLL):
                cu = c + u * step
                if cu < width:
                    if layout == 0:
                        d = dst_row + ((cu >> 8) << 8) + ((cu & 255) >> 1)
                        store4(xs, d, vals[8 * u], vals[8 * u + 1], vals[8 * u + 2], vals[8 * u + 3])
                        store4(xs, d + 128, vals[8 * u + 4], vals[8 * u + 5], vals[8 * u + 6], vals[8 * u + 7])
                    elif layout == 8:
                        v = (cu & 31) >> 2
                        d = dst_row + v * slot_stride + ((cu >> 5) << 2)
                        store4(xs, d, vals[8 * u], vals[8 * u + 1], vals[8 * u + 2], vals[8 * u + 3])
                        store4(xs, d + slot_stride, vals[8 * u + 4], vals[8 * u + 5], vals[8 * u + 6],
                               vals[8 * u + 7])
                    else:
                        v = (cu & 31) >> 2  # = 2 j for the piece's base word j
                        d = dst_row + v * slot_stride + ((cu >> 5) << 2)
                        store4(xs, d, vals[8 * u], vals[8 * u + 2], vals[8 * u + 4], vals[8 * u + 6])
                        store4(xs, d + slot_stride, vals[8 * u + 1], vals[8 * u + 3], vals[8 * u + 5],
                               vals[8 * u + 7])
            c += STAGE_UNROLL * step


@device_function
def stage_x_bf16(xs, x, row0, rows, c0, width, kc):
    stage_x(xs, x, row0, rows, c0, width, kc, 0)


@device_function
def fma_bf16x8(s, a, b, x0, x1, x2, x3, x4, x5, x6, x7):
    """s plus the 8 bf16 of the little-endian words a (columns 0-3) and b (4-7) times x0..x7, added one product at
    a time in column order (the summation order the kernels' twins and batch invariance rely on)."""
    u0 = uint32(a & uint64(0xFFFFFFFF))
    u1 = uint32(a >> uint64(32))
    u2 = uint32(b & uint64(0xFFFFFFFF))
    u3 = uint32(b >> uint64(32))
    s += bf16_to_f32(u0) * x0
    s += bf16_hi_to_f32(u0) * x1
    s += bf16_to_f32(u1) * x2
    s += bf16_hi_to_f32(u1) * x3
    s += bf16_to_f32(u2) * x4
    s += bf16_hi_to_f32(u2) * x5
    s += bf16_to_f32(u3) * x6
    s += bf16_hi_to_f32(u3) * x7
    return s

def make_linear_bf16_kernel(R: int, MT: int = ROW_TILE, max_registers: int | None = None):
    """The bf16 GEMV kernel with R output rows per warp and x-row tiles of MT (compile-time constants; MT=1 is the
    M == 1 fast path). Weight loads are software-pipelined one warp step ahead (the first step's loads are issued
    before x is staged)."""
    ACC = MT * R

    @kernel((float32[:, ::1], uint64[:, ::1], float32[:, ::1], int32, int32), fastmath=False,
            **register_options(max_registers))
    def linear_bf16_kernel(x, w, y, accumulate, kc):
        xs = cuda.shared.array(0, float32)
        M = x.shape[0]
        K = x.shape[1]
        N = y.shape[1]
        K4 = w.shape[1]  # uint64 words per weight row
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        n0 = (cuda.blockIdx.x * (cuda.blockDim.x >> 5) + warp) * R
        acc = cuda.local.array(ACC, float32)
        wa = cuda.local.array(R, uint64)
        wb = cuda.local.array(R, uint64)
        ca = cuda.local.array(R, uint64)
        cb = cuda.local.array(R, uint64)
        rowoff = cuda.local.array(R, int64)
        for r in range(R):
            rowoff[r] = min(n0 + r, N - 1) * K4
        for t0 in range(0, M, MT):
            mt = min(MT, M - t0)
            for a in range(ACC):
                acc[a] = float32(0.0)
            for c0 in range(0, K, kc):
                width = min(kc, K - c0)
                c = lane * 8
                if n0 < N and c < width:
                    for r in range(R):
                        wa[r], wb[r] = load2(w, rowoff[r] + ((c0 + c) >> 2))
                cuda.syncthreads()
                stage_x_bf16(xs, x, t0, mt, c0, width, kc)
                cuda.syncthreads()
                if n0 < N:
                    while c < width:
                        for r in range(R):
                            ca[r] = wa[r]
                            cb[r] = wb[r]
                        cn = c + 256
                        if cn < width:
                            for r in range(R):
                                wa[r], wb[r] = load2(w, rowoff[r] + ((c0 + cn) >> 2))
                        xoff = c - lane * 4
                        for m in range(MT):
                            if m < mt:
                                p = m * kc + xoff
                                x0, x1, x2, x3 = load4(xs, p)
                                x4, x5, x6, x7 = load4(xs, p + 128)
                                for r in range(R):
                                    acc[m * R + r] = fma_bf16x8(acc[m * R + r], ca[r], cb[r], x0, x1, x2, x3, x4,
                                                                x5, x6, x7)
                        c = cn
            if n0 < N:
                for m in range(MT):
                    if m < mt:
                        for r in range(R):
                            total = warp_sum(acc[m * R + r])
                            n = n0 + r
                            if lane == 0 and n < N:
                                if accumulate != 0:
                                    y[t0 + m, n] += total
                                else:
                                    y[t0 + m, n] = total

    return linear_bf16_kernel


@device_function
def stage_swiglu_bf16(xs, gate_up, row, c0, width):
    """`stage_x_bf16` of one row of silu(gate) * up, from gate_up's row (its gate | up halves, K each: K = the half
    width), by `silu_times` as `elementwise._silu_mul_kernel` computes it (the same bits)."""
    inter = gate_up.shape[1] >> 1
    src = row * gate_up.shape[1] + c0
    c = cuda.threadIdx.x * 8
    while c < width:
        g0, g1, g2, g3 = load4(gate_up, src + c)
        g4, g5, g6, g7 = load4(gate_up, src + c + 4)
        u0, u1, u2, u3 = load4(gate_up, src + inter + c)
        u4, u5, u6, u7 = load4(gate_up, src + inter + c + 4)
        d = ((c >> 8) << 8) + ((c & 255) >> 1)  # stage_x's layout 0
        store4(xs, d, silu_times(g0, u0), silu_times(g1, u1), silu_times(g2, u2), silu_times(g3, u3))
        store4(xs, d + 128, silu_times(g4, u4), silu_times(g5, u5), silu_times(g6, u6), silu_times(g7, u7))
        c += cuda.blockDim.x * 8


@device_function
def gathered_start(swiglu, w, ids, rows_per_expert, rows_per_warp):
    """A gathered kernel's start: it waits for the kernels before it where `make_linear_bf16_gathered_kernel` says
    (the plain one at once, then lets the next start; the SwiGLU one lets the next start and waits later, itself);
    returns its (uint64 words a weight row, slot, lane, first row of its warp, the slot's expert's first row)."""
    if swiglu:
        allow_dependents()
    else:
        wait_for_prior_grids()
        allow_dependents()
    slot = cuda.blockIdx.y
    n0 = (cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5)) * rows_per_warp
    return w.shape[1], slot, cuda.threadIdx.x & 31, n0, ids[slot] * rows_per_expert


@device_function
def store_slot_sums(acc, rows, y, slot, n0, rows_per_expert):
    """A gathered kernel's end: row n0 + r's lane-private sums acc[r] (r < rows) added over the warp in the fixed
    butterfly order; lane 0 stores them to y[slot] where the expert has that row."""
    lane = cuda.threadIdx.x & 31
    for r in range(rows):
        total = warp_sum(acc[r])
        n = n0 + r
        if lane == 0 and n < rows_per_expert:
            y[slot, n] = total


def make_linear_bf16_gathered_kernel(R: int, swiglu: bool = False):
    """MoE decode: blockIdx.y = slot j (flattened m*S+s); weight rows expert_ids[j] * rpe + n, x row x[j // xdiv].
    `swiglu`: x is the slots' gate | up rows ([M*S, 2K], xdiv 1), multiplied as silu(gate) * up
    (`stage_swiglu_bf16`): the down projection without `silu_mul_slots`' launch before it.

    Launched programmatically (`kernels_numba.programmatic`), the plain kernel (the experts' gate | up, after the
    routing) waits for the kernels before it at once, since the routing wrote the ids, and only then lets the next
    kernel start; the SwiGLU kernel, which follows it, reads the ids (complete: the gate | up kernel's blocks all
    passed their wait) and loads its first weights before waiting for the gate | up rows. The same bits either way."""

    @kernel((float32[:, ::1], uint64[:, ::1], int32[::1], float32[:, ::1], int32, int32, int32), fastmath=False)
    def linear_bf16_gathered_kernel(x, w, ids, y, rpe, xdiv, kc):
        K4, j, lane, n0, base = gathered_start(swiglu, w, ids, rpe, R)
        K = K4 * 4
        xs = cuda.shared.array(0, float32)
        xrow = j // xdiv
        acc = cuda.local.array(R, float32)
        wa = cuda.local.array(R, uint64)
        wb = cuda.local.array(R, uint64)
        ca = cuda.local.array(R, uint64)
        cb = cuda.local.array(R, uint64)
        rowoff = cuda.local.array(R, int64)
        for r in range(R):
            acc[r] = float32(0.0)
            rowoff[r] = (base + min(n0 + r, rpe - 1)) * K4
        for c0 in range(0, K, kc):
            width = min(kc, K - c0)
            c = lane * 8
            if n0 < rpe and c < width:
                for r in range(R):
                    wa[r], wb[r] = load2(w, rowoff[r] + ((c0 + c) >> 2))
            if swiglu and c0 == 0:
                wait_for_prior_grids()  # the gate | up rows are the kernel before's
            cuda.syncthreads()
            if swiglu:
                stage_swiglu_bf16(xs, x, xrow, c0, width)
            else:
                stage_x_bf16(xs, x, xrow, 1, c0, width, kc)
            cuda.syncthreads()
            if n0 < rpe:
                while c < width:
                    for r in range(R):
                        ca[r] = wa[r]
                        cb[r] = wb[r]
                    cn = c + 256
                    if cn < width:
                        for r in range(R):
                            wa[r], wb[r] = load2(w, rowoff[r] + ((c0 + cn) >> 2))
                    p = c - lane * 4
                    x0, x1, x2, x3 = load4(xs, p)
                    x4, x5, x6, x7 = load4(xs, p + 128)
                    for r in range(R):
                        acc[r] = fma_bf16x8(acc[r], ca[r], cb[r], x0, x1, x2, x3, x4, x5, x6, x7)
                    c = cn
        if n0 < rpe:
            store_slot_sums(acc, R, y, j, n0, rpe)

    return linear_bf16_gathered_kernel


def make_linear_bf16_gathered_flight_kernel(R: int, STEPS: int, swiglu: bool = False):
    """`make_linear_bf16_gathered_kernel` for K <= 256 STEPS (compile-time): each lane issues the loads of all its
    R rows' K columns (R STEPS 16-byte words) before it stages x, so a warp pays one DRAM round trip instead of one a
    256-column step (the other kernel keeps one step in flight). Each lane adds its 8 columns a step in the same
    order and the warp sums the same way: the same bits as the other kernel."""
    WORDS = R * STEPS

    @kernel((float32[:, ::1], uint64[:, ::1], int32[::1], float32[:, ::1], int32, int32), fastmath=False)
    def linear_bf16_gathered_flight_kernel(x, w, ids, y, rpe, xdiv):
        K4, j, lane, n0, base = gathered_start(swiglu, w, ids, rpe, R)
        K = K4 * 4
        xs = cuda.shared.array(0, float32)
        wa = cuda.local.array(WORDS, uint64)
        wb = cuda.local.array(WORDS, uint64)
        acc = cuda.local.array(R, float32)
        if n0 < rpe:
            for r in range(R):
                row = (base + min(n0 + r, rpe - 1)) * K4
                for step in range(STEPS):
                    c = step * BF16_SPAN + lane * 8
                    if c < K:
                        wa[step * R + r], wb[step * R + r] = load2(w, row + (c >> 2))
        if swiglu:
            wait_for_prior_grids()  # the gate | up rows are the kernel before's
            stage_swiglu_bf16(xs, x, j, 0, K)
        else:
            stage_x_bf16(xs, x, j // xdiv, 1, 0, K, K)
        cuda.syncthreads()
        if n0 < rpe:
            for r in range(R):
                acc[r] = float32(0.0)
            for step in range(STEPS):
                c = step * BF16_SPAN + lane * 8
                if c < K:
                    p = step * BF16_SPAN + lane * 4
                    x0, x1, x2, x3 = load4(xs, p)
                    x4, x5, x6, x7 = load4(xs, p + 128)
                    for r in range(R):
                        acc[r] = fma_bf16x8(acc[r], wa[step * R + r], wb[step * R + r], x0, x1, x2, x3, x4, x5,
                                            x6, x7)
            store_slot_sums(acc, R, y, j, n0, rpe)

    return linear_bf16_gathered_flight_kernel


class GatheredKernel(NamedTuple):
    """A gathered kernel and what its launch needs of how it was made: its rows a warp, and whether it is an
    all-in-flight one (`make_linear_bf16_gathered_flight_kernel`: one x chunk, no chunk argument)."""
    kernel: Any
    rows_per_warp: int
    in_flight: bool


def gathered_stepping(rows_per_warp: int, swiglu: bool) -> GatheredKernel:
    return GatheredKernel(make_linear_bf16_gathered_kernel(rows_per_warp, swiglu=swiglu), rows_per_warp, False)


def gathered_in_flight(rows_per_warp: int, steps: int, swiglu: bool) -> GatheredKernel:
    return GatheredKernel(make_linear_bf16_gathered_flight_kernel(rows_per_warp, steps, swiglu=swiglu),
                          rows_per_warp, True)


linear_bf16_kernel = make_linear_bf16_kernel(BF16_ROWS_PER_WARP)
linear_bf16_kernel_m1 = make_linear_bf16_kernel(BF16_ROWS_PER_WARP, 1)
# the gathered kernels the launches pick from, for the gate | up (False) and the SwiGLU down (True)
GATHERED_STEPPING_KERNELS = {swiglu: gathered_stepping(GATHERED_ROWS_PER_WARP, swiglu) for swiglu in (False, True)}
GATHERED_FLIGHT_KERNELS = {swiglu: gathered_in_flight(*GATHERED_FLIGHT[swiglu][:2], swiglu)
                           for swiglu in (False, True)}


def chunk_columns(rows: int, K: int, span: int, budget: int = SHARED_BUDGET) -> int:
    """Columns of x staged per chunk: a multiple of `span`, at least one span, no more than K rounded up."""
    fit = max(1, budget // (4 * rows * span)) * span
    return min(fit, math.ceil(K / span) * span)


def _as_u64(w):
    return w.view(np.uint64) if w.dtype == np.uint16 else w


def linear_bf16(x, w, y, *, stream, accumulate: bool = False, rows_per_warp: int = BF16_ROWS_PER_WARP,
                warps: int = WARPS, _kernel=None) -> None:
    """y[M, N] (+)= x[M, K] @ w[N, K]^T. x, y float32 device arrays (C-contiguous), w uint16 bf16 bits [N, K]
    (or already viewed as uint64 [N, K/4]). K % 8 == 0. No allocation, no sync: capture-safe."""
    M, K = x.shape
    N = y.shape[1]
    w64 = _as_u64(w)
    assert K % 8 == 0 and w64.shape == (N, K // 4) and y.shape[0] == M, (x.shape, w.shape, y.shape)
    if M == 0 or N == 0:
        return
    rows = min(M, ROW_TILE)
    kc = chunk_columns(rows, K, BF16_SPAN)
    fn = _kernel if _kernel is not None else (linear_bf16_kernel_m1 if M == 1 else linear_bf16_kernel)
    blocks = math.ceil(N / (warps * rows_per_warp))
    fn[blocks, 32 * warps, stream, rows * kc * 4](x, w64, y, int32(1 if accumulate else 0), int32(kc))


def linear_bf16_gathered(x, w, expert_ids, y, *, rows_per_expert: int, x_per_slot: bool, stream,
                         warps: int = GATHERED_WARPS, programmatic: bool = False,
                         _kernel: GatheredKernel | None = None) -> None:
    """y[m, s, :] = X(m, s) @ W_{expert_ids[m, s]}^T, W_e = w[e*rpe:(e+1)*rpe]; X(m, s) = x[m] ([M, K]) or x[m, s]
    ([M, S, K]) when x_per_slot. expert_ids int32 [M, S] on the device, y float32 [M, S, rpe]. `programmatic`: see
    `make_linear_bf16_gathered_kernel`. `_kernel` (benchmarks, tests): another kernel than the launch would pick."""
    M, S = expert_ids.shape
    K = x.shape[2] if x_per_slot else x.shape[1]
    rpe = int(rows_per_expert)
    w64 = _as_u64(w)
    assert K % 8 == 0 and w64.shape[1] == K // 4 and w64.shape[0] % rpe == 0
    assert y.shape == (M, S, rpe)
    if M * S == 0:
        return
    x2 = x.reshape(M * S, K) if x_per_slot else x
    assert x2.shape[0] == (M * S if x_per_slot else M)
    y2 = y.reshape(M * S, rpe)
    ids = expert_ids.reshape(M * S)
    _launch_gathered(x2, w64, ids, y2, rpe, 1 if x_per_slot else S, K, warps, stream, programmatic, False, _kernel)


def _launch_gathered(x2, w64, ids, y2, rpe: int, xdiv: int, K: int, warps: int, stream, programmatic: bool,
                     swiglu: bool, chosen: GatheredKernel | None) -> None:
    """A gathered kernel's launch: blocks of `warps` warps over the rpe rows, one grid row a slot, x staged in
    shared memory in chunks of a single row (one chunk for the all-in-flight kernel, taken where K fits it and the
    launch has enough slots: `GATHERED_FLIGHT`)."""
    if chosen is None:
        _, steps, fewest_slots = GATHERED_FLIGHT[swiglu]
        in_flight = K <= steps * BF16_SPAN and ids.shape[0] >= fewest_slots
        chosen = (GATHERED_FLIGHT_KERNELS if in_flight else GATHERED_STEPPING_KERNELS)[swiglu]
    kc = chunk_columns(1, K, BF16_SPAN)
    chunk = () if chosen.in_flight else (int32(kc),)
    launch(chosen.kernel, (math.ceil(rpe / (warps * chosen.rows_per_warp)), ids.shape[0]), 32 * warps, stream,
           kc * 4, x2, w64, ids, y2, int32(rpe), int32(xdiv), *chunk, programmatic=programmatic)


def linear_bf16_gathered_swiglu(gate_up, w, expert_ids, y, *, rows_per_expert: int, stream,
                                warps: int = GATHERED_WARPS, programmatic: bool = False,
                                _kernel: GatheredKernel | None = None) -> None:
    """y[m, s, :] = (silu(g) * u) @ W_{expert_ids[m, s]}^T for gate_up[m, s] = g | u ([M, S, 2K] fp32): one launch
    for `silu_mul_slots` then `linear_bf16_gathered(..., x_per_slot=True)`, the same bits."""
    M, S = expert_ids.shape
    K = gate_up.shape[2] // 2
    rpe = int(rows_per_expert)
    w64 = _as_u64(w)
    assert gate_up.shape == (M, S, 2 * K) and K % 8 == 0 and w64.shape[1] == K // 4 and w64.shape[0] % rpe == 0
    assert y.shape == (M, S, rpe)
    if M * S == 0:
        return
    _launch_gathered(gate_up.reshape(M * S, 2 * K), w64, expert_ids.reshape(M * S), y.reshape(M * S, rpe), rpe, 1,
                     K, warps, stream, programmatic, True, _kernel)


# ---- NumPy twins --------------------------------------------------------------------------------------------------

def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def linear_bf16_reference(x: np.ndarray, w: np.ndarray, y: np.ndarray | None = None, *,
                          accumulate: bool = False) -> np.ndarray:
    """fp32 twin of `linear_bf16` (w uint16 bf16 bits [N, K]); returns the new y."""
    out = cpu_linear(np.asarray(x, np.float32), bf16_bits_to_f32(w))
    if accumulate:
        out = np.asarray(y, np.float32) + out
    return out.astype(np.float32)


def gathered_reference(x: np.ndarray, weight_f32: np.ndarray, expert_ids: np.ndarray, *, rows_per_expert: int,
                       x_per_slot: bool) -> np.ndarray:
    """y[m, s] = X(m, s) @ W_e^T over an fp32 weight matrix [E*rpe, K]."""
    M, S = expert_ids.shape
    rpe = rows_per_expert
    y = np.empty((M, S, rpe), np.float32)
    for m in range(M):
        for s in range(S):
            e = int(expert_ids[m, s])
            row = x[m, s] if x_per_slot else x[m]
            y[m, s] = cpu_linear(np.asarray(row, np.float32)[None, :], weight_f32[e * rpe:(e + 1) * rpe])[0]
    return y


def linear_bf16_gathered_reference(x: np.ndarray, w: np.ndarray, expert_ids: np.ndarray, *, rows_per_expert: int,
                                   x_per_slot: bool) -> np.ndarray:
    return gathered_reference(x, bf16_bits_to_f32(w), expert_ids, rows_per_expert=rows_per_expert,
                              x_per_slot=x_per_slot)


def linear_bf16_gathered_swiglu_reference(gate_up: np.ndarray, w: np.ndarray, expert_ids: np.ndarray, *,
                                          rows_per_expert: int) -> np.ndarray:
    """Twin of `linear_bf16_gathered_swiglu`: silu(gate) * up of each slot's gate | up halves, then the gathered
    GEMV."""
    half = gate_up.shape[-1] // 2
    act = (cpu_silu(gate_up[..., :half]) * gate_up[..., half:]).astype(np.float32)
    return linear_bf16_gathered_reference(act, w, expert_ids, rows_per_expert=rows_per_expert, x_per_slot=True)
