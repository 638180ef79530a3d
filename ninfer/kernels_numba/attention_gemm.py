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
from numba import float32, int8, int32, uint16, uint64

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.backends.cpu import ops
from ninfer.backends.cpu.paged_kv import dequantize_int8
from ninfer.kernels_numba.common import blocks_for, f32_to_bf16, sigmoid_f32, warp_max, warp_sum
from ninfer.kernels_numba.attention import f16_bits_to_f32
from ninfer.kernels_numba.numba_setup import cuda, kernel

THREADS = 256
SOFTMAX_THREADS = 256
KEYS_PER_THREAD = 32  # softmax rows of up to REGISTER_KEYS keys stay in registers
REGISTER_KEYS = SOFTMAX_THREADS * KEYS_PER_THREAD
_F32_2D, _F32_3D = float32[:, ::1], float32[:, :, ::1]
_U16_3D, _U16_4D = uint16[:, :, ::1], uint16[:, :, :, ::1]


@kernel((_F32_3D, _U16_3D, int32, int32, int32, float32))
def _pack_queries(q, out, first, rows, group, scale):
    """out[b, g * rows + i, d] = bf16(q[first + i, b * group + g, d] * scale)."""
    r = cuda.blockIdx.x  # g * rows + i (grid x: y and z stop at 65,535)
    d = cuda.threadIdx.x + cuda.blockIdx.y * cuda.blockDim.x
    b = cuda.blockIdx.z
    head_dim = q.shape[2]
    if d >= head_dim:
        return
    g = r // rows
    i = r - g * rows
    out[b, r, d] = uint16(f32_to_bf16(q[first + i, b * group + g, d] * scale))


def pack_queries(q, out, *, first: int, rows: int, group: int, scale: float, stream) -> None:
    """Queries first..first+rows-1 of q fp32 [T, Hq, D] into out uint16 [Hkv, group * rows, D] (bf16, scaled)."""
    kv_heads, head_dim = out.shape[0], q.shape[2]
    _pack_queries[(group * rows, blocks_for(head_dim, THREADS), kv_heads), THREADS, stream](
        q, out, np.int32(first), np.int32(rows), np.int32(group), np.float32(scale))


def pack_queries_reference(q, *, first: int, rows: int, group: int, scale: float, kv_heads: int) -> np.ndarray:
    block = q[first : first + rows].astype(np.float32) * np.float32(scale)  # [rows, Hq, D]
    heads = block.reshape(rows, kv_heads, group, -1).transpose(1, 2, 0, 3)  # [Hkv, group, rows, D]
    return f32_to_bf16_bits(heads.reshape(kv_heads, group * rows, -1))


@kernel((int32[:, ::1], int32, int32, _U16_4D, _U16_4D, _U16_3D, int32, int32),
        (int32[:, ::1], int32, int32, int8[:, :, :, ::1], _U16_4D, _U16_3D, int32, int32))
def _gather_kv(page_tables, lane, length, pool, scales, out, quant, transposed):
    """out[b, j, d] (out[b, d, j] when `transposed`) = key/value j of KV head b as bf16 bits (INT8 pools
    dequantized, then rounded to bf16)."""
    j = cuda.blockIdx.x  # grid x: a lane's length passes the 65,535 blocks grid y and z allow
    d = cuda.threadIdx.x + cuda.blockIdx.y * cuda.blockDim.x
    b = cuda.blockIdx.z
    head_dim = pool.shape[3]
    if d >= head_dim or j >= length:
        return
    page_tokens = pool.shape[1]
    slot = j // page_tokens
    page = page_tables[lane, slot]
    offset = j - slot * page_tokens
    if quant != 0:
        group = head_dim // scales.shape[3]
        scale = f16_bits_to_f32(scales[page, offset, b, d // group])
        bits = uint16(f32_to_bf16(float32(pool[page, offset, b, d]) * scale))
    else:
        bits = uint16(pool[page, offset, b, d])
    if transposed != 0:
        out[b, d, j] = bits
    else:
        out[b, j, d] = bits


def gather_kv(page_tables, lane: int, length: int, pool, scales, out, *, stream, transposed: bool = False) -> None:
    """Keys (or values) 0..length-1 of `lane` from a paged pool [pages, P, Hkv, D] (uint16 bf16, or int8 with its
    fp16 `scales`) into out uint16 [Hkv, >= length, D] (`transposed`: [Hkv, D, >= length]); pass scales=None for a
    bf16 pool."""
    kv_heads, head_dim = pool.shape[2], pool.shape[3]
    quant = pool.dtype == np.int8
    scale_arg = scales if quant else pool
    _gather_kv[(length, blocks_for(head_dim, THREADS), kv_heads), THREADS, stream](
        page_tables, np.int32(lane), np.int32(length), pool, scale_arg, out, np.int32(1 if quant else 0),
        np.int32(1 if transposed else 0))


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
