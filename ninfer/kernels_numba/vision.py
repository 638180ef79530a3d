"""Kernels of the Vision tower on the GPU (everything around its cuBLAS GEMMs), each with its NumPy twin.

The tower (`backends.cuda.vision`) runs its linear layers and attention products as bf16 cuBLAS GEMMs with fp32
results; these kernels add the biases, normalise, apply the activations, 2-D RoPE and the attention softmax, and move
rows between the token-major and head-major layouts, writing bf16 wherever the next consumer is a GEMM.
Math as `models.qwen3_6_vision` (the CPU tower): LayerNorm with biased variance, tanh-GELU in the blocks, erf-GELU in
the merger, rotate-half RoPE over the whole head, softmax over every key of a temporal slice (no mask).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, uint16, uint32, uint64
from numba.cuda import libdevice

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.backends.cpu import ops
from ninfer.kernels_numba.common import WARP, bf16_pair, block_sum, blocks_for, f32_to_bf16, warp_max
from ninfer.kernels_numba.elementwise import NORM_ITEMS, norm_threads
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel

TILE = 256
F32_2D = float32[:, ::1]
F32_1D = float32[::1]
U16_2D = uint16[:, ::1]
U16_3D = uint16[:, :, ::1]
F32_3D = float32[:, :, ::1]
U32_2D = uint32[:, ::1]
U64_2D = uint64[:, ::1]
GELU_TANH, GELU_ERF = 0, 1
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)


# ---- (x += pending bias), LayerNorm -> bf16 ------------------------------------------------------------------------
# One block per row, the row held in registers (NORM_ITEMS columns per thread, as `elementwise.rms_norm_rows`), so x
# is read once. The residual GEMMs accumulate into x without their bias; the next LayerNorm adds it ("pending") and
# writes x back, which saves a separate bias launch and a pass over x per GEMM.

@kernel((F32_2D, F32_1D, F32_1D, U16_2D, F32_1D, int32, float32), fastmath=False)
def _layer_norm_bf16(x, weight, bias, out, pending_bias, add_pending, eps):
    buf = cuda.shared.array(32, float32)
    values = cuda.local.array(NORM_ITEMS, float32)
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    step = cuda.blockDim.x
    width = x.shape[1]
    acc = float32(0.0)
    for j in range(NORM_ITEMS):
        i = t + j * step
        v = float32(0.0)
        if i < width:
            v = x[r, i]
            if add_pending != 0:
                v += pending_bias[i]
                x[r, i] = v
        values[j] = v
        acc += v
    mean = block_sum(acc, buf) / float32(width)
    acc = float32(0.0)
    for j in range(NORM_ITEMS):
        if t + j * step < width:
            centred = values[j] - mean
            acc += centred * centred
    inv = float32(1.0) / math.sqrt(block_sum(acc, buf) / float32(width) + eps)
    for j in range(NORM_ITEMS):
        i = t + j * step
        if i < width:
            out[r, i] = uint16(f32_to_bf16((values[j] - mean) * inv * weight[i] + bias[i]))


def layer_norm_bf16(x, weight, bias, out, *, eps, stream, pending_bias=None) -> None:
    """out (bf16 bits [R, C]) = LayerNorm(x fp32 [R, C]) * weight + bias; with `pending_bias` [C], x += pending_bias
    first (written back to x)."""
    rows = x.shape[0]
    if rows:
        _layer_norm_bf16[rows, norm_threads(x.shape[1]), stream](
            x, weight, bias, out, weight if pending_bias is None else pending_bias,
            np.int32(pending_bias is not None), np.float32(eps))


def layer_norm_bf16_reference(x, weight, bias, *, eps) -> np.ndarray:
    from ninfer.models.qwen3_6_vision import layer_norm

    return f32_to_bf16_bits(layer_norm(x, weight, bias, eps))


# ---- x += bias ---------------------------------------------------------------------------------------------------

@kernel((F32_2D, F32_1D), fastmath=False)
def _add_rows(x, bias):
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if c < x.shape[1]:
        x[r, c] += bias[c]


def add_rows(x, bias, *, stream) -> None:
    """x[r] += bias: fp32 [R, C], bias [C]."""
    rows, width = x.shape
    if rows and width:
        _add_rows[(rows, blocks_for(width, TILE)), TILE, stream](x, bias)


def add_rows_reference(x, bias) -> np.ndarray:
    return (x.astype(np.float32) + bias).astype(np.float32)


# ---- GELU(y + bias) -> bf16 --------------------------------------------------------------------------------------

@kernel((F32_2D, F32_1D, U16_2D, int32), fastmath=False)
def _bias_gelu_bf16(y, bias, out, kind):
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if c < y.shape[1]:
        v = y[r, c] + bias[c]
        if kind == GELU_TANH:
            g = float32(0.5) * v * (float32(1.0) + math.tanh(float32(SQRT_2_OVER_PI) *
                                                             (v + float32(0.044715) * v * v * v)))
        else:
            g = float32(0.5) * v * (float32(1.0) + math.erf(v * float32(INV_SQRT_2)))
        out[r, c] = uint16(f32_to_bf16(g))


def bias_gelu_bf16(y, bias, out, *, exact: bool, stream) -> None:
    """out (bf16 bits) = GELU(y + bias), the tanh form or (exact) the erf form."""
    rows, width = y.shape
    if rows and width:
        _bias_gelu_bf16[(rows, blocks_for(width, TILE)), TILE, stream](
            y, bias, out, np.int32(GELU_ERF if exact else GELU_TANH))


def bias_gelu_bf16_reference(y, bias, *, exact: bool) -> np.ndarray:
    from ninfer.models.qwen3_6_vision import gelu_exact, gelu_tanh

    value = (y.astype(np.float32) + bias).astype(np.float32)
    return f32_to_bf16_bits(gelu_exact(value) if exact else gelu_tanh(value))


# ---- qkv rows -> head-major q (scaled, RoPE), k (RoPE), v, all bf16 ------------------------------------------------
# One block per qkv row, its threads striding over the row's 3 * H * D columns (whole warps, coalesced reads).

@kernel((F32_2D, F32_1D, F32_2D, F32_2D, U16_3D, U16_3D, U16_3D, float32, int32), fastmath=False)
def _vision_heads(qkv, bias, cos, sin, q, k, v, scale, first):
    r = cuda.blockIdx.x
    row = first + r
    heads, head_dim = q.shape[0], q.shape[2]
    half = head_dim // 2
    width = heads * head_dim
    for c in range(cuda.threadIdx.x, 3 * width, cuda.blockDim.x):
        part = c // width
        h = (c - part * width) // head_dim
        d = c - part * width - h * head_dim
        x = qkv[r, c] + bias[c]
        if part < 2:  # rotate-half over the whole head
            j = d - half if d >= half else d
            pair = c + half if d < half else c - half
            other = qkv[r, pair] + bias[pair]
            if d < half:
                x = x * cos[row, j] - other * sin[row, j]
            else:
                x = x * cos[row, j] + other * sin[row, j]
        if part == 0:
            q[h, row, d] = uint16(f32_to_bf16(x * scale))
        elif part == 1:
            k[h, row, d] = uint16(f32_to_bf16(x))
        else:
            v[h, row, d] = uint16(f32_to_bf16(x))


def vision_heads(qkv, bias, cos, sin, q, k, v, *, scale, first: int, stream) -> None:
    """qkv fp32 [m, 3*H*D] (+ bias), the item's rows first..first+m-1 -> those rows of q (times `scale`), k, v bf16
    bits [H, n, D]; q and k rotated with the item's per-row cos/sin [n, D/2] (rotate-half)."""
    rows = qkv.shape[0]
    if rows:
        _vision_heads[rows, TILE, stream](qkv, bias, cos, sin, q, k, v, np.float32(scale), np.int32(first))


def vision_heads_reference(qkv, bias, cos, sin, *, heads, scale) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v [H, m, D] of qkv rows [m, 3*H*D] with their cos/sin rows [m, D/2]."""
    rows = qkv.shape[0]
    x = (qkv.astype(np.float32) + bias).reshape(rows, 3, heads, -1)
    half = x.shape[-1] // 2

    def rotate(t):
        lo, hi = t[..., :half], t[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1).astype(np.float32)

    q = rotate(x[:, 0]) * np.float32(scale)
    k = rotate(x[:, 1])
    return tuple(f32_to_bf16_bits(np.ascontiguousarray(t.transpose(1, 0, 2))) for t in (q, k, x[:, 2]))


# ---- softmax over every key of each score row -> bf16 ------------------------------------------------------------
# One block per row (head, query). Rows move as 8-byte words (two fp32 scores in, two bf16 probabilities out as one
# 4-byte word), so a row is read as few times as its length allows: held in registers (SOFTMAX_PAIRS words per
# thread, up to HELD_KEYS keys) it is read once; longer rows are read twice (a running max and rescaled sum, then the
# write), never three times.

SOFTMAX_PAIRS = 8
HELD_PER_THREAD = 2 * SOFTMAX_PAIRS
MAX_THREADS = 1024  # a block's limit
HELD_KEYS = HELD_PER_THREAD * MAX_THREADS
STREAMED_THREADS = 512


@device_function
def block_max_dyn(value, buf):
    """The block's maximum of `value`, in every thread (any multiple of 32 threads; buf: shared [32])."""
    value = warp_max(value)
    t = cuda.threadIdx.x
    if (t & 31) == 0:
        buf[t >> 5] = value
    cuda.syncthreads()
    best = buf[0]
    for w in range(1, cuda.blockDim.x >> 5):
        best = max(best, buf[w])
    cuda.syncthreads()
    return best


@device_function
def f32_low(word):
    return libdevice.int_as_float(int32(uint32(word & uint64(0xFFFFFFFF))))


@device_function
def f32_high(word):
    return libdevice.int_as_float(int32(uint32(word >> uint64(32))))


@kernel((U64_2D, U32_2D), fastmath=False)
def _vision_softmax_held(scores, probs):
    buf = cuda.shared.array(32, float32)
    held = cuda.local.array(HELD_PER_THREAD, float32)
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    step = cuda.blockDim.x
    pairs = probs.shape[1]
    best = float32(-math.inf)
    for j in range(SOFTMAX_PAIRS):
        p = t + j * step
        low = float32(-math.inf)  # padding: exp(-inf) adds nothing
        high = float32(-math.inf)
        if p < pairs:
            word = scores[r, p]
            low = f32_low(word)
            high = f32_high(word)
        held[2 * j] = low
        held[2 * j + 1] = high
        best = max(best, max(low, high))
    best = block_max_dyn(best, buf)
    total = float32(0.0)
    for j in range(HELD_PER_THREAD):
        e = math.exp(held[j] - best)
        held[j] = e
        total += e
    total = block_sum(total, buf)
    for j in range(SOFTMAX_PAIRS):
        p = t + j * step
        if p < pairs:
            probs[r, p] = bf16_pair(held[2 * j] / total, held[2 * j + 1] / total)


@kernel((U64_2D, U32_2D), fastmath=False)
def _vision_softmax_streamed(scores, probs):
    buf = cuda.shared.array(32, float32)
    r = cuda.blockIdx.x
    pairs = probs.shape[1]
    best = float32(-math.inf)
    total = float32(0.0)
    for p in range(cuda.threadIdx.x, pairs, cuda.blockDim.x):
        word = scores[r, p]
        low, high = f32_low(word), f32_high(word)
        top = max(low, high)
        if top > best:
            total *= math.exp(best - top)
            best = top
        total += math.exp(low - best) + math.exp(high - best)
    row_best = block_max_dyn(best, buf)
    total = block_sum(total * math.exp(best - row_best), buf)
    for p in range(cuda.threadIdx.x, pairs, cuda.blockDim.x):
        word = scores[r, p]
        probs[r, p] = bf16_pair(math.exp(f32_low(word) - row_best) / total,
                                math.exp(f32_high(word) - row_best) / total)


def held_threads(pairs: int) -> int:
    return int(min(MAX_THREADS, WARP * -(-pairs // (WARP * SOFTMAX_PAIRS))))


def vision_softmax(scores, probs, *, stream) -> None:
    """probs (bf16 bits) = softmax over the last axis of scores (fp32 [..., keys], every key visible; keys even)."""
    keys = scores.shape[-1]
    if keys % 2:
        raise ValueError(f"vision_softmax moves scores in pairs: {keys} keys is odd")
    rows = scores.size // keys if keys else 0
    if not rows:
        return
    words = scores.reshape(rows, keys).view(np.uint64)
    packed = probs.reshape(rows, keys).view(np.uint32)
    if keys <= HELD_KEYS:
        _vision_softmax_held[rows, held_threads(keys // 2), stream](words, packed)
    else:
        _vision_softmax_streamed[rows, STREAMED_THREADS, stream](words, packed)


def vision_softmax_reference(scores) -> np.ndarray:
    return f32_to_bf16_bits(ops.softmax(scores, axis=-1))


# ---- head-major attention output -> token-major bf16 rows --------------------------------------------------------

@kernel((F32_3D, U16_2D), fastmath=False)
def _vision_merge_heads(o, out):
    i = cuda.blockIdx.x
    head_dim = o.shape[2]
    for c in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        h = c // head_dim
        out[i, c] = uint16(f32_to_bf16(o[h, i, c - h * head_dim]))


def vision_merge_heads(o, out, *, stream) -> None:
    """out[i, h*D + d] = bf16(o[h, i, d]) for o fp32 [H, m, D], out [m, H*D]."""
    rows = o.shape[1]
    if rows:
        _vision_merge_heads[rows, TILE, stream](o, out)


def vision_merge_heads_reference(o) -> np.ndarray:
    heads, rows, head_dim = o.shape
    return f32_to_bf16_bits(np.ascontiguousarray(o.transpose(1, 0, 2)).reshape(rows, heads * head_dim))
