"""Kernels of the Vision tower on the GPU (everything around its cuBLAS GEMMs), each with its NumPy twin.

The tower (`backends.cuda.vision`) runs its linear layers and attention products as bf16 cuBLAS GEMMs with fp32
results; these kernels add the biases and position embeddings, normalise, apply the activations and 2-D RoPE, and
move rows between the token-major and head-major layouts, writing bf16 wherever the next consumer is a GEMM.
Math as `models.qwen3_6_vision` (the CPU tower): LayerNorm with biased variance, tanh-GELU in the blocks, erf-GELU in
the merger, rotate-half RoPE over the whole head.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, uint16

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.kernels_numba.common import blocks_for, f32_to_bf16
from ninfer.kernels_numba.elementwise import block_sum_dyn, norm_threads
from ninfer.kernels_numba.numba_setup import cuda, kernel

TILE = 256
F32_2D = float32[:, ::1]
F32_1D = float32[::1]
U16_2D = uint16[:, ::1]
U16_3D = uint16[:, :, ::1]
F32_3D = float32[:, :, ::1]
GELU_TANH, GELU_ERF = 0, 1
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)


# ---- LayerNorm -> bf16 -------------------------------------------------------------------------------------------

@kernel((F32_2D, F32_1D, F32_1D, U16_2D, float32), fastmath=False)
def _layer_norm_bf16(x, weight, bias, out, eps):
    buf = cuda.shared.array(32, float32)
    r = cuda.blockIdx.x
    width = x.shape[1]
    acc = float32(0.0)
    for i in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        acc += x[r, i]
    mean = block_sum_dyn(acc, buf) / float32(width)
    acc = float32(0.0)
    for i in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        centred = x[r, i] - mean
        acc += centred * centred
    inv = float32(1.0) / math.sqrt(block_sum_dyn(acc, buf) / float32(width) + eps)
    for i in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        out[r, i] = uint16(f32_to_bf16((x[r, i] - mean) * inv * weight[i] + bias[i]))


def layer_norm_bf16(x, weight, bias, out, *, eps, stream) -> None:
    """out (bf16 bits [R, C]) = LayerNorm(x fp32 [R, C]) * weight + bias."""
    rows = x.shape[0]
    if rows:
        _layer_norm_bf16[rows, norm_threads(x.shape[1]), stream](x, weight, bias, out, np.float32(eps))


def layer_norm_bf16_reference(x, weight, bias, *, eps) -> np.ndarray:
    from ninfer.models.qwen3_6_vision import layer_norm

    return f32_to_bf16_bits(layer_norm(x, weight, bias, eps))


# ---- x += bias (+ extra rows) ------------------------------------------------------------------------------------

@kernel((F32_2D, F32_1D, F32_2D, int32), fastmath=False)
def _add_rows(x, bias, extra, with_extra):
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if c < x.shape[1]:
        value = x[r, c] + bias[c]
        if with_extra != 0:
            value += extra[r, c]
        x[r, c] = value


def add_rows(x, bias, *, stream, extra=None) -> None:
    """x[r] += bias (+ extra[r]): fp32 [R, C], bias [C], extra [R, C]."""
    rows, width = x.shape
    if rows and width:
        _add_rows[(rows, blocks_for(width, TILE)), TILE, stream](
            x, bias, x if extra is None else extra, np.int32(extra is not None))


def add_rows_reference(x, bias, extra=None) -> np.ndarray:
    out = x.astype(np.float32) + bias
    return out if extra is None else (out + extra).astype(np.float32)


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

@kernel((F32_2D, F32_1D, F32_2D, F32_2D, U16_3D, U16_3D, U16_3D, float32), fastmath=False)
def _vision_heads(qkv, bias, cos, sin, q, k, v, scale):
    d = cuda.threadIdx.x
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y
    heads, head_dim = q.shape[0], q.shape[2]
    half = head_dim // 2
    if d >= head_dim:
        return
    width = heads * head_dim
    for part in range(3):
        base = part * width + h * head_dim
        x = qkv[r, base + d] + bias[base + d]
        if part < 2:  # rotate-half over the whole head
            pair = d - half if d >= half else d + half
            other = qkv[r, base + pair] + bias[base + pair]
            j = d - half if d >= half else d
            if d < half:
                x = x * cos[r, j] - other * sin[r, j]
            else:
                x = x * cos[r, j] + other * sin[r, j]
        if part == 0:
            q[h, r, d] = uint16(f32_to_bf16(x * scale))
        elif part == 1:
            k[h, r, d] = uint16(f32_to_bf16(x))
        else:
            v[h, r, d] = uint16(f32_to_bf16(x))


def vision_heads(qkv, bias, cos, sin, q, k, v, *, scale, stream) -> None:
    """qkv fp32 [n, 3*H*D] (+ bias) -> q (times `scale`), k, v bf16 bits [H, n, D]; q and k rotated with the
    per-row cos/sin [n, D/2] (rotate-half)."""
    heads, rows, head_dim = q.shape
    if rows:
        _vision_heads[(rows, heads), max(32, head_dim), stream](qkv, bias, cos, sin, q, k, v, np.float32(scale))


def vision_heads_reference(qkv, bias, cos, sin, *, heads, scale) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


# ---- head-major attention output -> token-major bf16 rows --------------------------------------------------------

@kernel((F32_3D, U16_2D, int32), fastmath=False)
def _vision_merge_heads(o, out, first):
    d = cuda.threadIdx.x
    i = cuda.blockIdx.x
    h = cuda.blockIdx.y
    head_dim = o.shape[2]
    if d < head_dim:
        out[first + i, h * head_dim + d] = uint16(f32_to_bf16(o[h, i, d]))


def vision_merge_heads(o, out, *, first: int, stream) -> None:
    """out[first + i, h*D + d] = bf16(o[h, i, d]) for o fp32 [H, m, D]."""
    heads, rows, head_dim = o.shape
    if rows:
        _vision_merge_heads[(rows, heads), max(32, head_dim), stream](o, out, np.int32(first))


def vision_merge_heads_reference(o) -> np.ndarray:
    heads, rows, head_dim = o.shape
    return f32_to_bf16_bits(np.ascontiguousarray(o.transpose(1, 0, 2)).reshape(rows, heads * head_dim))

