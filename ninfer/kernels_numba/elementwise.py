"""Small per-layer kernels: embedding gather, RMSNorm (plain and fused with the residual add), SwiGLU's silu(g) * u,
fp32 -> bf16 conversion and the MoE shared-expert sigmoid gate.

Every launcher takes numba device arrays (C-contiguous, row-major `[rows, width]`) and a keyword `stream`; it never
synchronises nor allocates, so it can be captured into a CUDA graph. Each output row depends only on its own input
row (fixed per-row reduction order: thread-strided partial sums, a warp butterfly, then the block's warps summed in
warp order), so results are batch invariant. The `<launcher>_reference` twins compute the same functions in NumPy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, int64, uint16, uint32, uint64
from numba.cuda import libdevice

from ninfer.backends.cpu import ops
from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.kernels_numba.common import (FULL_MASK, address_of, bf16_hi_to_f32, bf16_pair, bf16_target, bf16_to_f32,
                                         block_sum, blocks_for, f32_to_bf16, flat_row_piece, fragment_target,
                                         load_words4_at, sigmoid_f32, silu_times, store_word_at, store_words2_at,
                                         store_words4_at)
from ninfer.kernels_numba.linear import load4, store4
from ninfer.kernels_numba.quant_mma import FRAGMENT_HALVES_PER_COLUMN, check_fragment_output, fragment_half
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel
from ninfer.kernels_numba.programmatic import allow_dependents

ROW_THREADS = 256  # threads of a one-block-per-row kernel (8 warps)
TILE = 256  # threads of the 2-D elementwise kernels (grid: column tiles x rows)

F32_2D = float32[:, ::1]
F32_1D = float32[::1]


# ---------------------------------------------------------------------------------------------------- embed_rows


@kernel((uint64[:, ::1], int32[::1], F32_2D), fastmath=False)
def _embed_rows_u64(table, ids, out):
    r = cuda.blockIdx.x
    row = ids[r]
    j = cuda.threadIdx.x
    while j < table.shape[1]:
        w = table[row, j]
        lo = uint32(w & uint64(0xFFFFFFFF))
        hi = uint32(w >> uint64(32))
        c = 4 * j
        out[r, c] = bf16_to_f32(lo & uint32(0xFFFF))
        out[r, c + 1] = bf16_to_f32(lo >> uint32(16))
        out[r, c + 2] = bf16_to_f32(hi & uint32(0xFFFF))
        out[r, c + 3] = bf16_to_f32(hi >> uint32(16))
        j += cuda.blockDim.x


@kernel((uint16[:, ::1], int32[::1], F32_2D), fastmath=False)
def _embed_rows_u16(table, ids, out):
    r = cuda.blockIdx.x
    row = ids[r]
    j = cuda.threadIdx.x
    while j < table.shape[1]:
        out[r, j] = bf16_to_f32(table[row, j])
        j += cuda.blockDim.x


def embed_rows(table, ids, out, *, stream):
    """out[r] = bf16 table[ids[r]] as fp32. table uint16 [V, H]; ids int32 [R]; out fp32 [R, H]. Ids must be < V."""
    rows = ids.shape[0]
    if rows == 0:
        return
    if table.shape[1] % 4 == 0:
        _embed_rows_u64[rows, ROW_THREADS, stream](table.view(np.uint64), ids, out)
    else:
        _embed_rows_u16[rows, ROW_THREADS, stream](table, ids, out)


def embed_rows_reference(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(table[np.asarray(ids, dtype=np.int64)])


# ---------------------------------------------------------------------------------------------------- rms_norm
# One block per row, latency-bound at decode (a 5120-wide row is 20 KB): every thread loads its NORM_ITEMS columns
# at once into registers, so the row is read from memory once and in one round trip; the block size depends only on
# the width, so a row's reduction order never depends on the number of rows. A block runs on one multiprocessor, so
# its instruction count is its time: the row moves in 16-byte vectors (thread t takes vectors t + j * threads, 4
# columns each) through raw addresses, and the outputs (fp32, bf16, x fragments) are written the same way.

NORM_ITEMS = 16
NORM_VECTORS = NORM_ITEMS // 4
NORM_MAX_WIDTH = 1024 * NORM_ITEMS


def norm_threads(width: int) -> int:
    if width > NORM_MAX_WIDTH or width % 4:
        raise ValueError(f"row norms hold a row in registers in 4-column vectors: width {width} must be a multiple "
                         f"of 4 and at most {NORM_MAX_WIDTH}")
    return int(max(32, 32 * -(-width // (32 * NORM_ITEMS))))


@device_function
def keep_vector(values, weights, j, x0, x1, x2, x3, w0, w1, w2, w3, offset, acc):
    """values[4 j + e] = x_e, weights[4 j + e] = the (offset +) weight of word w_e; returns acc plus the squares."""
    for e in range(4):
        xv = x0 if e == 0 else (x1 if e == 1 else (x2 if e == 2 else x3))
        wv = libdevice.int_as_float(int32(w0 if e == 0 else (w1 if e == 1 else (w2 if e == 2 else w3))))
        values[4 * j + e] = xv
        weights[4 * j + e] = wv + float32(1.0) if offset != 0 else wv
        acc += xv * xv
    return acc


@device_function
def load_floats4_at(address):
    """The 4 fp32 of the 16 bytes at `address`."""
    x0, x1, x2, x3 = load_words4_at(address)
    return (libdevice.int_as_float(int32(x0)), libdevice.int_as_float(int32(x1)), libdevice.int_as_float(int32(x2)),
            libdevice.int_as_float(int32(x3)))


@device_function
def load_row(x, weight, values, weights, r, offset):
    """values[4 j + e] = x[r, 4 (t + j * threads) + e] and weights the matching (offset +) weight, all loads issued
    together (the weights are not waited for after the reduction); returns this thread's sum of squares."""
    return load_row_adding_slices(x, x, weight, values, weights, r, offset, 0)


@device_function
def load_row_adding_slices(partials, residual, weight, values, weights, r, offset, slices):
    """`load_row` of residual[r] + (partials[0, r] + ... + partials[slices - 1, r]), the sum stored back into
    residual[r] (each thread's own vectors, 16 bytes at a time). `slices` is a kernel's constant: the slices' loop
    unrolls, so every slice's load is in flight before the adds; 0 is `load_row` (partials unread, nothing
    stored)."""
    t = cuda.threadIdx.x
    step = cuda.blockDim.x
    width = residual.shape[1]
    row = address_of(residual) + int64(r) * int64(width) * 4
    slice_bytes = int64(partials.shape[1]) * int64(width) * 4
    first_slice = address_of(partials) + int64(r) * int64(width) * 4
    weight_at = address_of(weight)
    acc = float32(0.0)
    for j in range(NORM_VECTORS):
        v = t + j * step
        x0 = x1 = x2 = x3 = float32(0.0)
        w0 = w1 = w2 = w3 = uint32(0)
        if 4 * v < width:
            x0, x1, x2, x3 = load_floats4_at(row + int64(v) * 16)
            w0, w1, w2, w3 = load_words4_at(weight_at + int64(v) * 16)
            if slices > 0:
                s0, s1, s2, s3 = load_floats4_at(first_slice + int64(v) * 16)
                for s in range(1, slices):  # in slice order
                    p0, p1, p2, p3 = load_floats4_at(first_slice + s * slice_bytes + int64(v) * 16)
                    s0 += p0
                    s1 += p1
                    s2 += p2
                    s3 += p3
                x0 += s0
                x1 += s1
                x2 += s2
                x3 += s3
        acc = keep_vector(values, weights, j, x0, x1, x2, x3, w0, w1, w2, w3, offset, acc)
    if slices > 0:  # the sums stored once every vector is read: ptxas keeps no later load ahead of a store
        for j in range(NORM_VECTORS):
            v = t + j * step
            if 4 * v < width:
                store_words4_at(row + int64(v) * 16, uint32(libdevice.float_as_int(values[4 * j])),
                                uint32(libdevice.float_as_int(values[4 * j + 1])),
                                uint32(libdevice.float_as_int(values[4 * j + 2])),
                                uint32(libdevice.float_as_int(values[4 * j + 3])))
    return acc


@device_function
def scale_row(values, weights, out, write_f32, out_bf16, write_bf16, fragments, write_fragments, r, total, width,
              eps):
    """out[r, 4 (t + j * threads) + e] = values[4 j + e] * rsqrt(total / width + eps) * weights[4 j + e] (unless
    write_f32 is 0), the bf16 copy, and the bf16 x fragments of row r (a vector's columns 4v, 4v + 1 and 4v + 2,
    4v + 3 are two words)."""
    t = cuda.threadIdx.x
    step = cuda.blockDim.x
    inv = float32(1.0) / math.sqrt(total / float32(width) + eps)
    out_row = address_of(out) + int64(r) * int64(width) * 4
    bf16_row = address_of(out_bf16) + int64(r) * int64(width) * 2
    fragment_words = address_of(fragments)
    for j in range(NORM_VECTORS):
        v = t + j * step
        if 4 * v < width:
            y0 = (values[4 * j] * inv) * weights[4 * j]
            y1 = (values[4 * j + 1] * inv) * weights[4 * j + 1]
            y2 = (values[4 * j + 2] * inv) * weights[4 * j + 2]
            y3 = (values[4 * j + 3] * inv) * weights[4 * j + 3]
            if write_f32 != 0:
                store_words4_at(out_row + int64(v) * 16, uint32(libdevice.float_as_int(y0)),
                                uint32(libdevice.float_as_int(y1)), uint32(libdevice.float_as_int(y2)),
                                uint32(libdevice.float_as_int(y3)))
            if write_bf16 != 0 or write_fragments != 0:
                low = bf16_pair(y0, y1)
                high = bf16_pair(y2, y3)
                if write_bf16 != 0:
                    store_words2_at(bf16_row + int64(v) * 8, low, high)
                if write_fragments != 0:
                    c = int32(4 * v)
                    store_word_at(fragment_words + int64(fragment_half(int32(r), c) >> 1) * 4, low)
                    store_word_at(fragment_words + int64(fragment_half(int32(r), c + 2) >> 1) * 4, high)


@device_function
def norm_row(x, weight, out, write_f32, out_bf16, write_bf16, fragments, write_fragments, r, eps, offset):
    """Row r of `rms_norm_rows` (one block a row): out[r] (and its bf16 copy and x fragments) = rms_norm(x[r]).
    load_row reads the thread's own vectors of x, so a kernel may write them just before (the residual adds)."""
    values = cuda.local.array(NORM_ITEMS, float32)
    weights = cuda.local.array(NORM_ITEMS, float32)
    acc = load_row(x, weight, values, weights, r, offset)
    norm_loaded_row(values, weights, acc, out, write_f32, out_bf16, write_bf16, fragments, write_fragments, r,
                    x.shape[1], eps)


@device_function
def norm_loaded_row(values, weights, acc, out, write_f32, out_bf16, write_bf16, fragments, write_fragments, r, width,
                    eps):
    """The rest of `norm_row` once a row is loaded (`load_row`, `load_row_adding_slices`; acc: the thread's sum of
    squares): the block's sum, then the scaled row written."""
    buf = cuda.shared.array(32, float32)
    total = block_sum(acc, buf)  # its barrier also orders the reads of x before writes to an aliased out
    scale_row(values, weights, out, write_f32, out_bf16, write_bf16, fragments, write_fragments, r, total, width, eps)


@kernel((F32_2D, F32_1D, F32_2D, int32, uint16[:, ::1], int32, uint16[::1], int32, float32, int32), fastmath=False)
def _rms_norm_kernel(x, weight, out, write_f32, out_bf16, write_bf16, fragments, write_fragments, eps, offset):
    allow_dependents()  # a projection of the normed rows may start loading its weights (`programmatic`)
    norm_row(x, weight, out, write_f32, out_bf16, write_bf16, fragments, write_fragments, cuda.blockIdx.x, eps,
             offset)


ADD_SLICES = (1, 2, 4, 8)  # the slice counts `add_slices_rms_norm_rows` takes (a kernel each)


def _make_add_slices_rms_norm_kernel(slices: int):
    @kernel((float32[:, :, ::1], F32_2D, F32_1D, F32_2D, int32, uint16[:, ::1], int32, uint16[::1], int32, float32,
             int32), fastmath=False)
    def add_slices_rms_norm_kernel(partials, residual, weight, out, write_f32, out_bf16, write_bf16, fragments,
                                   write_fragments, eps, offset):
        r = cuda.blockIdx.x
        values = cuda.local.array(NORM_ITEMS, float32)
        weights = cuda.local.array(NORM_ITEMS, float32)
        acc = load_row_adding_slices(partials, residual, weight, values, weights, r, offset, slices)
        norm_loaded_row(values, weights, acc, out, write_f32, out_bf16, write_bf16, fragments, write_fragments, r,
                        residual.shape[1], eps)

    return add_slices_rms_norm_kernel


_ADD_SLICES_KERNELS = {slices: _make_add_slices_rms_norm_kernel(slices) for slices in ADD_SLICES}


def rms_norm_rows(x, weight, out, *, eps, offset, stream, out_bf16=None, out_fragments=None):
    """out = ops.rms_norm(x, weight, eps, offset=offset). x, out fp32 [R, H] (may alias); weight fp32 [H].
    With `out_bf16` (uint16 [R, H]) the same values rounded to bf16 bits are written there too: the input of the
    cuBLAS linear layers that follow, without a separate conversion launch; `out` None then writes that copy alone
    (every consumer a cuBLAS GEMM: at the 35B-A3B's 8K prefill 2/5 of the norm's bytes, ~16 us a launch). With
    `out_fragments` (uint32, R <= 8) they are written as the tensor-core x fragments (`quant_mma.x_fragments` of
    out; rows R..7 left as they were: the mma keeps each x row's column apart, so no output reads them)."""
    rows = x.shape[0]
    if out is None and out_bf16 is None:
        raise ValueError("rms_norm_rows needs an fp32 out, a bf16 out or both")
    if out_fragments is not None:
        check_fragment_output(rows, x.shape[1], out_fragments)
    written = x if out is None else out  # x stands in for an fp32 out not asked for (never written)
    if rows:
        _rms_norm_kernel[rows, norm_threads(x.shape[1]), stream](
            x, weight, written, np.int32(out is not None), *bf16_target(written, out_bf16),
            *fragment_target(written, out_fragments), np.float32(eps), np.int32(bool(offset)))


def rms_norm_rows_reference(x, weight, *, eps, offset):
    return ops.rms_norm(x, weight, eps, offset=offset)


def add_rms_norm_rows(residual, delta, weight, out, *, eps, offset, stream):
    """residual += delta (in place), then out = rms_norm(residual). All fp32 [R, H]; weight fp32 [H]. (One slice of
    `add_slices_rms_norm_rows`.)"""
    add_slices_rms_norm_rows(delta.reshape(1, *delta.shape), residual, weight, out, eps=eps, offset=offset,
                             stream=stream)


def add_slices_rms_norm_rows(partials, residual, weight, out, *, eps, offset, stream, out_bf16=None,
                             out_fragments=None):
    """residual[r] += partials[0, r] + partials[1, r] + ... (in slice order: the K slices of one projection,
    `Blas.split_k_gemm_bf16`, of which only the first R = residual.shape[0] rows are read), then out = rms_norm of the
    new residual as `rms_norm_rows` writes it (its bf16 copy and x fragments too; out None: the bf16 copy alone).
    partials fp32 [S, >= R, H], residual and out fp32 [R, H], weight fp32 [H]."""
    rows, width = residual.shape
    if partials.ndim != 3 or partials.shape[0] not in ADD_SLICES or partials.shape[1] < rows or \
            partials.shape[2] != width:
        raise ValueError(f"add_slices_rms_norm_rows takes partials [S in {ADD_SLICES}, >= {rows}, {width}], got "
                         f"{tuple(partials.shape)}")
    if out is None and out_bf16 is None:
        raise ValueError("add_slices_rms_norm_rows needs an fp32 out, a bf16 out or both")
    if out_fragments is not None:
        check_fragment_output(rows, width, out_fragments)
    written = residual if out is None else out  # (never written when out is None)
    if rows:
        _ADD_SLICES_KERNELS[partials.shape[0]][rows, norm_threads(width), stream](
            partials, residual, weight, written, np.int32(out is not None), *bf16_target(written, out_bf16),
            *fragment_target(written, out_fragments), np.float32(eps), np.int32(bool(offset)))


def add_slices_rms_norm_rows_reference(partials, residual, weight, *, eps, offset):
    """Returns (new residual, normed) of `add_slices_rms_norm_rows`."""
    rows = residual.shape[0]
    total = partials[0, :rows].astype(np.float32)
    for s in range(1, partials.shape[0]):
        total = (total + partials[s, :rows]).astype(np.float32)
    return add_rms_norm_rows_reference(residual, total, weight, eps=eps, offset=offset)


def add_rms_norm_rows_reference(residual, delta, weight, *, eps, offset):
    """Returns (new residual, normed)."""
    new = (residual.astype(np.float32) + delta.astype(np.float32)).astype(np.float32)
    return new, ops.rms_norm(new, weight, eps, offset=offset)


# ---------------------------------------------------------------------------------------------------- silu_mul


@kernel((F32_2D, F32_2D, uint16[:, ::1], int32, uint16[::1], int32, int32), fastmath=False)
def _silu_mul_kernel(gate_up, out, out_bf16, write_bf16, fragments, write_fragments, slots):
    """Row r of [R * slots, I] is slot r % slots of x row r // slots: its fragments are set r % slots."""
    allow_dependents()  # the down projection may start loading its weights (`programmatic`)
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    inter = out.shape[1]
    if c < inter:
        g = gate_up[r, c]
        value = silu_times(g, gate_up[r, inter + c])
        out[r, c] = value
        if write_bf16 != 0:
            out_bf16[r, c] = uint16(f32_to_bf16(value))
        if write_fragments != 0:
            set_halves = int32(inter) * int32(FRAGMENT_HALVES_PER_COLUMN)
            at = (int32(r) % slots) * set_halves + fragment_half(int32(r) // slots, int32(c))
            fragments[at] = uint16(f32_to_bf16(value))


def silu_mul_rows(gate_up, out, *, stream, out_bf16=None, out_fragments=None):
    """out = silu(gate) * up: gate_up fp32 [R, 2I] = [gate | up] -> out fp32 [R, I]; also [R, S, 2I] -> [R, S, I].
    With `out_bf16` (uint16 [R, I]) also the bf16 bits of out, with `out_fragments` its tensor-core x fragments
    (see `rms_norm_rows`)."""
    if gate_up.ndim == 3:
        silu_mul_slots(gate_up, out, stream=stream, out_fragments=out_fragments)
        return
    rows, inter = out.shape
    if out_fragments is not None:
        check_fragment_output(rows, inter, out_fragments)
    if rows and inter:
        _silu_mul_kernel[(rows, blocks_for(inter, TILE)), TILE, stream](
            gate_up, out, *bf16_target(out, out_bf16), *fragment_target(out, out_fragments), np.int32(1))


def silu_mul_slots(gate_up, out, *, stream, out_fragments=None):
    """[R, S, 2I] -> [R, S, I] (each slot's gate | up halves). With `out_fragments` also the x fragments of each
    slot, set s those of out[:, s] (`quant_mma.x_slot_fragments` of out)."""
    rows, slots, inter = out.shape
    if out_fragments is not None:
        check_fragment_output(rows, inter, out_fragments, slots)
    if rows * slots and inter:
        g2 = gate_up.reshape(rows * slots, 2 * inter)
        o2 = out.reshape(rows * slots, inter)
        _silu_mul_kernel[(rows * slots, blocks_for(inter, TILE)), TILE, stream](
            g2, o2, *bf16_target(o2, None), *fragment_target(o2, out_fragments), np.int32(slots))


@device_function
def _silu_mul_word(g, u):
    """The bf16 pair of silu(gate) * up for one word of gate pairs and one of up pairs (the arithmetic of
    _silu_mul_kernel)."""
    g0 = bf16_to_f32(g & uint32(0xFFFF))
    g1 = bf16_hi_to_f32(g)
    return bf16_pair(silu_times(g0, bf16_to_f32(u & uint32(0xFFFF))), silu_times(g1, bf16_hi_to_f32(u)))


@kernel((uint32[:, ::1], uint32[:, ::1]), fastmath=False)
def _silu_mul_bf16_kernel(gate_up, out):
    """Word j of out row r: the pair (2 j, 2 j + 1) of silu(gate) * up, from word j of the gate half and word
    pairs + j of the up half (the arithmetic of _silu_mul_kernel)."""
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    pairs = out.shape[1]
    if j < pairs:
        out[r, j] = _silu_mul_word(gate_up[r, j], gate_up[r, pairs + j])


@kernel((uint32[:, ::1], uint32[:, ::1]), fastmath=False)
def _silu_mul_bf16_quads(gate_up, out):
    """Thread i: words 4 q .. 4 q + 3 of out row r = i // quads (q = i % quads), from one 16-byte load of the gate
    half and one of the up half, one 16-byte store (pairs % 4 == 0). The word kernel's 4-byte accesses and a block
    a row took the 35B-A3B's 8K prefill ~0.14 ms a layer (~0.4 of copy)."""
    pairs = out.shape[1]
    r, q = flat_row_piece(pairs // 4)
    if r < out.shape[0]:
        gate_at = address_of(gate_up) + (int64(r) * int64(2 * pairs) + int64(4 * q)) * 4
        g0, g1, g2, g3 = load_words4_at(gate_at)
        u0, u1, u2, u3 = load_words4_at(gate_at + int64(pairs) * 4)
        store_words4_at(address_of(out) + (int64(r) * int64(pairs) + int64(4 * q)) * 4, _silu_mul_word(g0, u0),
                        _silu_mul_word(g1, u1), _silu_mul_word(g2, u2), _silu_mul_word(g3, u3))


def silu_mul_bf16_rows(gate_up, out, *, stream):
    """out = bf16(silu(gate) * up), from bf16 bits gate_up uint16 [R, 2I] = [gate | up] to out uint16 [R, I] (I
    even), fp32 math in between: the MoE prefill's expert activations, from the grouped GEMM's bf16 output straight
    to the down GEMM's bf16 input."""
    rows, inter = out.shape
    if tuple(gate_up.shape) != (rows, 2 * inter) or inter % 2:
        raise ValueError(f"silu_mul_bf16_rows: gate_up{tuple(gate_up.shape)} must be [R, 2I] for out{tuple(out.shape)}"
                         f" = [R, I], I even")
    if not rows or not inter:
        return
    if inter % 8 == 0:
        _silu_mul_bf16_quads[blocks_for(rows * inter // 8, TILE), TILE, stream](gate_up.view(np.uint32),
                                                                                out.view(np.uint32))
    else:
        _silu_mul_bf16_kernel[(rows, blocks_for(inter // 2, TILE)), TILE, stream](gate_up.view(np.uint32),
                                                                                    out.view(np.uint32))


SILU_QUADS = 4  # columns a thread of the fp32 -> bf16 silu-mul: one 16-byte load per half, one 8-byte store


@device_function
def _silu_times(gate_bits, up_bits):
    """silu(gate) * up of two fp32 numbers given as their bits (words of a vector load)."""
    g = libdevice.int_as_float(int32(gate_bits))
    return silu_times(g, libdevice.int_as_float(int32(up_bits)))


@kernel((F32_2D, uint16[:, ::1]), fastmath=False)
def _silu_mul_to_bf16_kernel(gate_up, out):
    """Columns 4 q .. 4 q + 3 of out row r: bf16(silu(gate) * up) from fp32 gate_up, the arithmetic and rounding of
    _silu_mul_kernel's bf16 output. I % 4 == 0, so every access is aligned to its width."""
    q = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    inter = out.shape[1]
    if q * SILU_QUADS < inter:
        gate_at = address_of(gate_up) + (int64(r) * int64(2 * inter) + int64(q * SILU_QUADS)) * 4
        g0, g1, g2, g3 = load_words4_at(gate_at)
        u0, u1, u2, u3 = load_words4_at(gate_at + int64(inter) * 4)
        store_words2_at(address_of(out) + (int64(r) * int64(inter) + int64(q * SILU_QUADS)) * 2,
                        bf16_pair(_silu_times(g0, u0), _silu_times(g1, u1)),
                        bf16_pair(_silu_times(g2, u2), _silu_times(g3, u3)))


def check_silu_to_bf16_shapes(gate_up_shape: tuple, out_shape: tuple) -> None:
    rows, inter = out_shape
    if tuple(gate_up_shape) != (rows, 2 * inter) or inter % SILU_QUADS:
        raise ValueError(f"silu_mul_to_bf16_rows: gate_up{tuple(gate_up_shape)} must be [R, 2I] for out"
                         f"{tuple(out_shape)} = [R, I], I % {SILU_QUADS} == 0")


def silu_mul_to_bf16_rows(gate_up, out, *, stream):
    """out = bf16(silu(gate) * up) from fp32 gate_up [R, 2I] to bf16 bits out [R, I], I % 4 == 0, and no fp32
    copy: the prefill's activation when its only consumer is a cuBLAS GEMM. At 8K rows the 27B's silu-mul wrote
    fp32 and bf16 and moved 2.0 GB a layer at 1.9 TB/s (67 ms of a 0.92 s prefill); this moves 1.4 GB."""
    check_silu_to_bf16_shapes(gate_up.shape, out.shape)
    rows, inter = out.shape
    if rows and inter:
        _silu_mul_to_bf16_kernel[(rows, blocks_for(inter // SILU_QUADS, TILE)), TILE, stream](gate_up, out)


def silu_mul_to_bf16_rows_reference(gate_up: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(silu_mul_rows_reference(gate_up))


def silu_mul_bf16_rows_reference(gate_up: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(silu_mul_rows_reference(bf16_bits_to_f32(gate_up)))


def silu_mul_rows_reference(gate_up: np.ndarray) -> np.ndarray:
    inter = gate_up.shape[-1] // 2
    g = gate_up[..., :inter].astype(np.float32)
    return ops.silu(g) * gate_up[..., inter:].astype(np.float32)


silu_mul_slots_reference = silu_mul_rows_reference


# ---------------------------------------------------------------------------------------------------- to_bf16


@kernel((F32_2D, uint32[:, ::1]), fastmath=False)
def _to_bf16_pairs(x, out):
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if j < out.shape[1]:
        lo = f32_to_bf16(x[r, 2 * j])
        hi = f32_to_bf16(x[r, 2 * j + 1])
        out[r, j] = lo | (hi << uint32(16))


@kernel((F32_2D, uint16[:, ::1]), fastmath=False)
def _to_bf16_single(x, out):
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if j < out.shape[1]:
        out[r, j] = uint16(f32_to_bf16(x[r, j]))


def to_bf16_rows(x, out, *, stream):
    """out = bf16 bits of x (round to nearest even, as codec.f32_to_bf16_bits). x fp32 [R, K]; out uint16 [R, K]."""
    rows, width = x.shape
    if not rows or not width:
        return
    if width % 2 == 0:
        _to_bf16_pairs[(rows, blocks_for(width // 2, TILE)), TILE, stream](x, out.view(np.uint32))
    else:
        _to_bf16_single[(rows, blocks_for(width, TILE)), TILE, stream](x, out)


def to_bf16_rows_reference(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(x)


# ---------------------------------------------------------------------------------------------------- sigmoid gate


@kernel((F32_2D, F32_2D, F32_2D), (F32_2D, F32_2D, float32[:, :]), fastmath=False)
def _sigmoid_gate_add_kernel(residual, delta, gate_logit):
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if c < residual.shape[1]:
        residual[r, c] += sigmoid_f32(gate_logit[r, 0]) * delta[r, c]


@kernel((F32_2D, F32_2D, F32_2D), (F32_2D, F32_2D, float32[:, :]), fastmath=False)
def _sigmoid_gate_add_quads(residual, delta, gate_logit):
    """_sigmoid_gate_add_kernel 4 columns a thread (width % 4 == 0): 16-byte loads of residual and delta, one
    16-byte store, one sigmoid; per element the same arithmetic. The column kernel ran the MoE prefill's shared
    expert gate at ~0.6 of copy bandwidth."""
    width = residual.shape[1]
    r, q = flat_row_piece(width // 4)
    if r < residual.shape[0]:
        g = sigmoid_f32(gate_logit[r, 0])
        at = r * width + 4 * q
        x0, x1, x2, x3 = load4(residual, at)
        d0, d1, d2, d3 = load4(delta, at)
        store4(residual, at, x0 + g * d0, x1 + g * d1, x2 + g * d2, x3 + g * d3)


def sigmoid_gate_add(residual, delta, gate_logit, *, stream):
    """residual[r] += sigmoid(gate_logit[r, 0]) * delta[r]. residual, delta fp32 [R, H]; gate_logit fp32 [R, >=1]."""
    rows, width = residual.shape
    if not rows or not width:
        return
    if width % 4 == 0:
        _sigmoid_gate_add_quads[blocks_for(rows * width // 4, TILE), TILE, stream](residual, delta, gate_logit)
    else:
        _sigmoid_gate_add_kernel[(rows, blocks_for(width, TILE)), TILE, stream](residual, delta, gate_logit)


def sigmoid_gate_add_reference(residual, delta, gate_logit):
    g = ops.sigmoid(np.ascontiguousarray(gate_logit[:, :1], dtype=np.float32))
    return (residual.astype(np.float32) + g * delta.astype(np.float32)).astype(np.float32)


__all__ = ["embed_rows", "rms_norm_rows", "add_rms_norm_rows", "add_slices_rms_norm_rows", "silu_mul_rows",
           "silu_mul_slots", "to_bf16_rows", "sigmoid_gate_add", "sigmoid_f32", "FULL_MASK"]
