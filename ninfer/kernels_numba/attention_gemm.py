"""Prefill attention on the tensor cores: the glue kernels around two strided-batched cuBLAS GEMMs.

For a prefill chunk of T queries of one lane (query i at KV index kv_start + i), per KV head b (batch index):

    S_b = Q_b K_b^T        Q_b: the `group` query heads of KV head b stacked, [group * Tq, D] bf16 (scale folded in)
    P_b = causal_softmax(S_b)    key j is visible to query i when j <= kv_start + i
    O_b = P_b V_b           then out[i, h*D:(h+1)*D] = O * sigmoid(gate)

The caller walks the queries in blocks of Tq so the [Hkv, group * Tq, S] score buffer stays within its scratch; a
block reads only the keys its last query can see. The kernels here pack Q, gather K/V from the paged pool into
contiguous bf16, apply the causal softmax, and unpack with the gate; each has a NumPy twin.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int8, int32, int64, uint16, uint32, uint64
from numba.cuda import libdevice

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.backends.cpu import ops
from ninfer.backends.cpu.paged_kv import dequantize_int8
from ninfer.kernels_numba.common import (address_of, bf16_pair, blocks_for, f32_to_bf16, flat_row_piece,
                                         load_words2_at, load_words4_at, sigmoid_f32, store_words4_at, warp_max,
                                         warp_sum)
from ninfer.kernels_numba.attention import f16_bits_to_f32
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel

THREADS = 256
SOFTMAX_THREADS = 256
KEYS_PER_THREAD = 32  # softmax rows of up to REGISTER_KEYS keys stay in registers
REGISTER_KEYS = SOFTMAX_THREADS * KEYS_PER_THREAD
_F32_2D, _F32_3D = float32[:, ::1], float32[:, :, ::1]
_U16_3D, _U16_4D = uint16[:, :, ::1], uint16[:, :, :, ::1]


@kernel((_F32_3D, _U16_3D, int32, int32, int32, float32))
def _pack_queries(q, out, first, rows, group, scale):
    """out[b, g * rows + i, d] = bf16(q[first + i, b * group + g, d] * scale): a thread per 8 values of a row (two
    16-byte loads, one 16-byte store; a thread per value, 2-byte stores in blocks of one row, ran at ~0.23 of copy:
    200 us a 35B-A3B layer at 8K rows)."""
    head_dim = q.shape[2]
    r, p = flat_row_piece(head_dim >> 3)  # r: the flat out row b * (group * rows) + g * rows + i
    per_head = group * rows
    if r >= out.shape[0] * per_head:
        return
    b = r // per_head
    row = r - b * per_head
    g = row // rows
    i = row - g * rows
    source = address_of(q) + int64(first + i) * q.strides[0] + int64(b * group + g) * q.strides[1] + 32 * p
    a0, a1, a2, a3 = load_words4_at(source)
    a4, a5, a6, a7 = load_words4_at(source + 16)
    store_words4_at(address_of(out) + int64(b) * out.strides[0] + int64(row) * out.strides[1] + 16 * p,
                    bf16_pair(_f32(a0) * scale, _f32(a1) * scale), bf16_pair(_f32(a2) * scale, _f32(a3) * scale),
                    bf16_pair(_f32(a4) * scale, _f32(a5) * scale), bf16_pair(_f32(a6) * scale, _f32(a7) * scale))


@device_function
def _f32(word):
    return libdevice.int_as_float(int32(word))


def pack_queries(q, out, *, first: int, rows: int, group: int, scale: float, stream) -> None:
    """Queries first..first+rows-1 of q fp32 [T, Hq, D] into out uint16 [Hkv, group * rows, D] (bf16, scaled)."""
    kv_heads, head_dim = out.shape[0], q.shape[2]
    if head_dim % 8:
        raise ValueError(f"pack_queries moves 8 values a thread: head_dim {head_dim} must be a multiple of 8")
    pieces = kv_heads * group * rows * (head_dim // 8)
    if pieces:
        _pack_queries[blocks_for(pieces, THREADS), THREADS, stream](
            q, out, np.int32(first), np.int32(rows), np.int32(group), np.float32(scale))


def pack_queries_reference(q, *, first: int, rows: int, group: int, scale: float, kv_heads: int) -> np.ndarray:
    block = q[first : first + rows].astype(np.float32) * np.float32(scale)  # [rows, Hq, D]
    heads = block.reshape(rows, kv_heads, group, -1).transpose(1, 2, 0, 3)  # [Hkv, group, rows, D]
    return f32_to_bf16_bits(heads.reshape(kv_heads, group * rows, -1))


@device_function
def _kv_piece(page_tables, lane, pool, scales, quant, b, j, p):
    """Dims 8p..8p+7 of key/value j of KV head b as 4 words of bf16 pairs (INT8 codes times their fp16 scale, rounded
    to bf16, as `gather_kv_reference`): one 16-byte load of a bf16 pool, one 8-byte load of an INT8 one."""
    page_tokens = pool.shape[1]
    slot = j // page_tokens
    page = int64(page_tables[lane, slot])
    offset = j - slot * page_tokens
    at = (address_of(pool) + page * pool.strides[0] + int64(offset) * pool.strides[1] + int64(b) * pool.strides[2]
          + 8 * p * pool.strides[3])
    if quant == 0:
        return load_words4_at(at)
    scale = f16_bits_to_f32(scales[page, offset, b, (8 * p) // (pool.shape[3] // scales.shape[3])])
    low, high = load_words2_at(at)
    return (bf16_pair(_code(low, 0) * scale, _code(low, 1) * scale),
            bf16_pair(_code(low, 2) * scale, _code(low, 3) * scale),
            bf16_pair(_code(high, 0) * scale, _code(high, 1) * scale),
            bf16_pair(_code(high, 2) * scale, _code(high, 3) * scale))


@device_function
def _code(word, k):
    """Signed byte k of a word as float32 (exactly: the INT8 code)."""
    return float32(int32(uint32(word) << uint32(24 - 8 * k)) >> 24)


_GATHER_SIGS = ((int32[:, ::1], int32, int32, _U16_4D, _U16_4D, _U16_3D, int32),
                (int32[:, ::1], int32, int32, int8[:, :, :, ::1], _U16_4D, _U16_3D, int32))


@kernel(*_GATHER_SIGS)
def _gather_kv(page_tables, lane, length, pool, scales, out, quant):
    """out[b, j, 8p..8p+7] = dims 8p.. of key/value j of KV head b: a thread per 8 dims (a flat grid over
    Hkv x length rows: a lane's length passes the 65,535 blocks grid y and z allow)."""
    head_dim = pool.shape[3]
    r, p = flat_row_piece(head_dim >> 3)
    if r >= pool.shape[2] * length:
        return
    b = r // length
    j = r - b * length
    w0, w1, w2, w3 = _kv_piece(page_tables, lane, pool, scales, quant, b, j, p)
    store_words4_at(address_of(out) + int64(b) * out.strides[0] + int64(j) * out.strides[1] + 16 * p, w0, w1, w2, w3)


TRANSPOSE_TILE = 64  # keys x dims a block of `_gather_kv_transposed` turns around in shared memory
TRANSPOSE_ROW = TRANSPOSE_TILE + 8  # halves a shared row: 8 of padding
TRANSPOSE_THREADS = 256


@kernel(*_GATHER_SIGS)
def _gather_kv_transposed(page_tables, lane, length, pool, scales, out, quant):
    """out[b, d, j] = dim d of key/value j of KV head b, a 64 x 64 tile a block: keys read as 16-byte rows of dims
    into shared memory, written out as 16-byte rows of keys (a thread a value wrote 2 bytes a row of out apart)."""
    tile = cuda.shared.array((TRANSPOSE_TILE, TRANSPOSE_ROW), uint16)
    j0 = cuda.blockIdx.x * TRANSPOSE_TILE
    d0 = cuda.blockIdx.y * TRANSPOSE_TILE
    b = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    for e in range(TRANSPOSE_TILE * TRANSPOSE_TILE // 8 // TRANSPOSE_THREADS):
        index = e * TRANSPOSE_THREADS + tid
        key = index >> 3
        piece = index & 7
        w0 = w1 = w2 = w3 = uint32(0)
        if j0 + key < length:
            w0, w1, w2, w3 = _kv_piece(page_tables, lane, pool, scales, quant, b, j0 + key, (d0 >> 3) + piece)
        dim = 8 * piece
        tile[dim, key] = uint16(w0 & uint32(0xFFFF))
        tile[dim + 1, key] = uint16(w0 >> uint32(16))
        tile[dim + 2, key] = uint16(w1 & uint32(0xFFFF))
        tile[dim + 3, key] = uint16(w1 >> uint32(16))
        tile[dim + 4, key] = uint16(w2 & uint32(0xFFFF))
        tile[dim + 5, key] = uint16(w2 >> uint32(16))
        tile[dim + 6, key] = uint16(w3 & uint32(0xFFFF))
        tile[dim + 7, key] = uint16(w3 >> uint32(16))
    cuda.syncthreads()
    for e in range(TRANSPOSE_TILE * TRANSPOSE_TILE // 8 // TRANSPOSE_THREADS):
        index = e * TRANSPOSE_THREADS + tid
        dim = index >> 3
        keys = 8 * (index & 7)
        j = j0 + keys
        d = d0 + dim
        if j + 8 <= length:
            store_words4_at(address_of(out) + int64(b) * out.strides[0] + int64(d) * out.strides[1] + 2 * j,
                            _halves(tile[dim, keys], tile[dim, keys + 1]),
                            _halves(tile[dim, keys + 2], tile[dim, keys + 3]),
                            _halves(tile[dim, keys + 4], tile[dim, keys + 5]),
                            _halves(tile[dim, keys + 6], tile[dim, keys + 7]))
        else:  # the lane's last keys: only those below `length` are written
            for k in range(8):
                if j + k < length:
                    out[b, d, j + k] = tile[dim, keys + k]


@device_function
def _halves(low, high):
    return uint32(low) | (uint32(high) << uint32(16))


def gather_kv(page_tables, lane: int, length: int, pool, scales, out, *, stream, transposed: bool = False) -> None:
    """Keys (or values) 0..length-1 of `lane` from a paged pool [pages, P, Hkv, D] (uint16 bf16, or int8 with its
    fp16 `scales`) into out uint16 [Hkv, >= length, D] (`transposed`: [Hkv, D, >= length], rows a multiple of 8 keys
    long); pass scales=None for a bf16 pool. Dims move 8 at a time: D a multiple of 64 transposed, of 8 otherwise,
    and an INT8 pool's scale groups a multiple of 8 dims."""
    kv_heads, head_dim = pool.shape[2], pool.shape[3]
    quant = pool.dtype == np.int8
    if head_dim % (TRANSPOSE_TILE if transposed else 8) or (quant and (head_dim // scales.shape[3]) % 8) or (
            transposed and out.strides[1] % 16):
        raise ValueError(f"gather_kv moves 8 dims at a time: head_dim {head_dim}"
                         + (f", INT8 scale groups of {head_dim // scales.shape[3]}" if quant else "")
                         + (f", transposed rows of {out.strides[1] // 2} keys" if transposed else ""))
    if length == 0:
        return
    scale_arg = scales if quant else pool
    arguments = (page_tables, np.int32(lane), np.int32(length), pool, scale_arg, out, np.int32(1 if quant else 0))
    if transposed:
        grid = (-(-length // TRANSPOSE_TILE), head_dim // TRANSPOSE_TILE, kv_heads)
        _gather_kv_transposed[grid, TRANSPOSE_THREADS, stream](*arguments)
    else:
        _gather_kv[blocks_for(kv_heads * length * (head_dim // 8), THREADS), THREADS, stream](*arguments)


def gather_kv_reference(page_tables, lane: int, length: int, pool, scales) -> np.ndarray:
    page_tokens = pool.shape[1]
    positions = np.arange(length)
    pages, offsets = page_tables[lane, positions // page_tokens], positions % page_tokens
    if pool.dtype == np.int8:
        values = dequantize_int8(pool[pages, offsets], scales[pages, offsets].view(np.float16))
        bits = f32_to_bf16_bits(values)
    else:
        bits = pool[pages, offsets]
    return np.ascontiguousarray(bits.transpose(1, 0, 2))  # [Hkv, length, D]


@kernel((_F32_3D, _U16_3D, int32, int32, int32, int32))
def _causal_softmax(scores, probs, rows, first_position, keys, group):
    """One block per score row (b, g * rows + i): softmax over keys 0..first_position + i, zeros after. Rows of up to
    REGISTER_KEYS keys are read once into registers (all loads in flight together); longer rows are read three
    times (max, sum, write). Both paths do the same arithmetic in the same order, so they give the same bits."""
    r = cuda.blockIdx.x
    b = cuda.blockIdx.y
    i = r - (r // rows) * rows
    visible = min(first_position + i + 1, keys)
    buf = cuda.shared.array(32, float32)
    values = cuda.local.array(KEYS_PER_THREAD, float32)
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    warps = cuda.blockDim.x // 32
    ub, ur = uint64(b), uint64(r)
    fast = keys <= REGISTER_KEYS
    best = float32(-math.inf)
    if fast:
        for e in range(KEYS_PER_THREAD):
            j = tid + e * SOFTMAX_THREADS
            value = float32(-math.inf)
            if j < visible:
                value = scores[ub, ur, uint64(j)]
            values[e] = value
            best = max(best, value)
    else:
        for j in range(tid, visible, cuda.blockDim.x):
            best = max(best, scores[ub, ur, uint64(j)])
    best = warp_max(best)
    if lane == 0:
        buf[warp] = best
    cuda.syncthreads()
    best = buf[0]
    for w in range(1, warps):
        best = max(best, buf[w])
    cuda.syncthreads()
    total = float32(0.0)
    if fast:
        for e in range(KEYS_PER_THREAD):
            if tid + e * SOFTMAX_THREADS < visible:
                values[e] = math.exp(values[e] - best)
                total += values[e]
    else:
        for j in range(tid, visible, cuda.blockDim.x):
            total += math.exp(scores[ub, ur, uint64(j)] - best)
    total = warp_sum(total)
    if lane == 0:
        buf[warp] = total
    cuda.syncthreads()
    total = float32(0.0)
    for w in range(warps):
        total += buf[w]
    inverse = float32(1.0) / total
    if fast:
        for e in range(KEYS_PER_THREAD):
            j = tid + e * SOFTMAX_THREADS
            if j < keys:
                value = values[e] * inverse if j < visible else float32(0.0)
                probs[ub, ur, uint64(j)] = uint16(f32_to_bf16(value))
    else:
        for j in range(tid, keys, cuda.blockDim.x):
            value = float32(0.0)
            if j < visible:
                value = math.exp(scores[ub, ur, uint64(j)] - best) * inverse
            probs[ub, ur, uint64(j)] = uint16(f32_to_bf16(value))


def causal_softmax(scores, probs, *, rows: int, first_position: int, stream) -> None:
    """scores fp32 [Hkv, group * rows, keys] -> probs bf16 bits, row (g, i) seeing keys 0..first_position + i."""
    kv_heads, total_rows, keys = scores.shape
    _causal_softmax[(total_rows, kv_heads), SOFTMAX_THREADS, stream](
        scores, probs, np.int32(rows), np.int32(first_position), np.int32(keys), np.int32(total_rows // rows))


def causal_softmax_reference(scores, *, rows: int, first_position: int) -> np.ndarray:
    kv_heads, total_rows, keys = scores.shape
    i = np.arange(total_rows) % rows
    visible = np.arange(keys)[None, :] <= (first_position + i)[:, None]
    masked = np.where(visible[None], scores.astype(np.float32), -np.inf)
    return f32_to_bf16_bits(ops.softmax(masked, axis=-1))


@kernel((_F32_3D, _F32_2D, _F32_2D, int32, int32, int32))
def _unpack_gated(o, qkgv, out, first, rows, group):
    """out[first + i, (b*group + g)*D + d] = o[b, g*rows + i, d] * sigmoid(gate of that head and dim)."""
    r = cuda.blockIdx.x  # g * rows + i (grid x, as in _pack_queries)
    d = cuda.threadIdx.x + cuda.blockIdx.y * cuda.blockDim.x
    b = cuda.blockIdx.z
    kv_heads, head_dim = o.shape[0], o.shape[2]
    if d >= head_dim:
        return
    g = r // rows
    i = r - g * rows
    h = b * group + g
    heads = kv_heads * group
    gate = qkgv[first + i, (heads + kv_heads) * head_dim + h * head_dim + d]
    out[first + i, h * head_dim + d] = o[b, r, d] * sigmoid_f32(gate)


def unpack_gated(o, qkgv, out, *, first: int, rows: int, group: int, stream) -> None:
    kv_heads, total_rows, head_dim = o.shape
    _unpack_gated[(total_rows, blocks_for(head_dim, THREADS), kv_heads), THREADS, stream](
        o, qkgv, out, np.int32(first), np.int32(rows), np.int32(group))


def unpack_gated_reference(o, qkgv, out, *, first: int, rows: int, group: int) -> np.ndarray:
    kv_heads, _, head_dim = o.shape
    heads = kv_heads * group
    block = o.reshape(kv_heads, group, rows, head_dim).transpose(2, 0, 1, 3).reshape(rows, heads * head_dim)
    gate = qkgv[first : first + rows, (heads + kv_heads) * head_dim : (2 * heads + kv_heads) * head_dim]
    out[first : first + rows] = block * ops.sigmoid(gate)
    return out
