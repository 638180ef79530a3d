"""NumPy reference ops shared by every model on the CPU backend.

All math is fp32 (reductions included) unless a function says otherwise. These are the numerical contracts the CUDA
kernels are checked against, so each one is written for clarity first.

Row invariance: every op computes each token row (each query, for attention) on its own, so a row's result is bitwise
the same whether it runs alone, in a decode batch of other sequences, in a speculative verify block or inside any
prefill chunk. The engine's determinism guarantees (greedy output independent of batch composition, of speculative
decoding and of prefix reuse) rest on this.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import numpy as np

F32 = np.float32
ATTENTION, RECURRENT = "attention", "recurrent"  # mixer kinds: a KV store per sequence, or a carried state


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, *, offset: bool) -> np.ndarray:
    """RMSNorm over the last axis. `offset=True` is Qwen's zero-centred form `(1 + w) * x / rms(x)`."""
    x = x.astype(F32, copy=False)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=F32) + F32(eps))
    scale = (F32(1.0) + weight.astype(F32)) if offset else weight.astype(F32)
    return (x * inv.astype(F32)) * scale


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """`x / sqrt(sum(x^2) + eps)` over the last axis (a sum, not a mean)."""
    x = x.astype(F32, copy=False)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True, dtype=F32) + F32(eps))


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = x.astype(F32, copy=False)
    # Split by sign so exp never overflows.
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), and exactly x above 20 (the threshold the reference uses)."""
    x = x.astype(F32, copy=False)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(F32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x.astype(F32, copy=False)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """`x @ weight.T` for a `[out, in]` weight (the storage orientation of every matrix in an artifact).

    Computed as a stack of one-row products: BLAS picks different kernels (and summation orders) for different row
    counts, so a plain `[T, in] @ [in, out]` would make a row's result depend on how many rows ran with it.
    """
    return np.matmul(x.astype(F32, copy=False)[:, None, :], weight.T)[:, 0, :]


def swiglu(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray) -> np.ndarray:
    """`down(silu(gate x) * up x)`."""
    return linear(silu(linear(x, gate_w)) * linear(x, up_w), down_w)


def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """`theta^(-2i/rotary_dim)` for i in [0, rotary_dim/2), computed in float64 then rounded once."""
    return (1.0 / (float(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))).astype(F32)


def rope_angles(positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Angles `[T, rotary_dim/2]` for 1-D integer positions `[T]`."""
    return positions.astype(F32)[:, None] * inv_freq[None, :]


def mrope_angles(positions: np.ndarray, inv_freq: np.ndarray, section: tuple[int, int, int]) -> np.ndarray:
    """Interleaved 3-axis MRoPE angles `[T, pairs]` for positions `[3, T]` (T, H, W axes).

    Pair i uses the H position when i % 3 == 1 and i < 3 * section[1], the W position when i % 3 == 2 and
    i < 3 * section[2], and the T position otherwise (ninfer-facts §3.4). With equal axes this is plain 1-D RoPE.
    """
    pairs = inv_freq.shape[0]
    axis = np.zeros(pairs, dtype=np.int64)
    idx = np.arange(pairs)
    axis[(idx % 3 == 1) & (idx < 3 * section[1])] = 1
    axis[(idx % 3 == 2) & (idx < 3 * section[2])] = 2
    pos = positions.astype(F32)[axis, :].T  # [T, pairs]
    return pos * inv_freq[None, :]


def apply_rotary(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Rotate-half (NeoX) RoPE on the first `2 * pairs` dims of each head; the rest pass through.

    x: `[T, heads, head_dim]`, angles: `[T, pairs]`. out[i] = x[i]cos - x[i+p]sin, out[i+p] = x[i+p]cos + x[i]sin.
    """
    pairs = angles.shape[-1]
    cos = np.cos(angles)[:, None, :]
    sin = np.sin(angles)[:, None, :]
    x = x.astype(F32, copy=False)
    out = x.copy()
    lo = x[..., :pairs]
    hi = x[..., pairs : 2 * pairs]
    out[..., :pairs] = lo * cos - hi * sin
    out[..., pairs : 2 * pairs] = hi * cos + lo * sin
    return out


def causal_gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_start: int, scale: float) -> np.ndarray:
    """Causal grouped-query attention of new queries over a cache.

    q: `[T, Hq, D]` for absolute positions q_start..q_start+T-1; k, v: `[S, Hkv, D]` for positions 0..S-1 with
    S == q_start + T. Query head h reads KV head h // (Hq / Hkv). Returns `[T, Hq, D]`.
    Each query attends over exactly its visible keys (no masked tail), so its result does not depend on T.
    """
    t, s = q.shape[0], k.shape[0]
    if s != q_start + t:
        raise ValueError(f"cache holds {s} positions, queries end at {q_start + t}")
    return _gqa_over_visible(q, k, v, scale, lambda i: slice(0, q_start + i + 1))


def windowed_gqa_attention(q: np.ndarray, q_positions: np.ndarray, k: np.ndarray, v: np.ndarray,
                           k_positions: np.ndarray, scale: float, window: int | None) -> np.ndarray:
    """Non-causal grouped-query attention: each query reads every key whose position is within `window` of its own
    (`|p_key - p_query| < window`), or every key when `window` is None.

    q: `[T, Hq, D]` at `q_positions [T]`; k, v: `[S, Hkv, D]` at `k_positions [S]`. Query head h reads KV head
    h // (Hq / Hkv). Returns `[T, Hq, D]`; each query attends over exactly its visible keys (row invariant).
    """
    if window is None:
        return _gqa_over_visible(q, k, v, scale, lambda i: slice(None))
    return _gqa_over_visible(q, k, v, scale, lambda i: np.abs(k_positions - q_positions[i]) < window)


def _gqa_over_visible(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, visible_of) -> np.ndarray:
    """Grouped-query attention where query i reads the keys `visible_of(i)` selects (a slice or a mask)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    keys = k.astype(F32, copy=False).transpose(1, 2, 0)  # [Hkv, D, S]
    values = v.astype(F32, copy=False).transpose(1, 0, 2)  # [Hkv, S, D]
    queries = q.astype(F32, copy=False).reshape(t, hkv, group, d)
    out = np.empty((t, hkv, group, d), dtype=F32)
    for i in range(t):
        visible = visible_of(i)
        scores = np.matmul(queries[i], keys[:, :, visible]) * F32(scale)  # [Hkv, group, visible]
        out[i] = np.matmul(softmax(scores, axis=-1), values[:, visible, :])
    return out.reshape(t, hq, d)


class KVStore(Protocol):
    """Where an attention layer keeps one sequence's keys and values: a KVCache, or a paged view of a shared pool."""

    @property
    def length(self) -> int: ...

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@attrs.define
class Segment:
    """Consecutive rows of a ragged batch that continue one sequence, with that sequence's per-layer state.

    `layers[i]` is layer i's KV store (attention) or recurrent state. With `record_columns`, recurrent layers also
    leave their state after every row in `columns[i]` (a speculative verify can then keep any accepted prefix).
    """

    rows: slice
    layers: list[Any]
    record_columns: bool = False
    columns: dict[int, Any] = attrs.Factory(dict)


class KVCache:
    """Growable per-layer K/V store for one sequence: `[positions, kv_heads, head_dim]` fp32."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int = 256) -> None:
        self._k = np.zeros((capacity, kv_heads, head_dim), dtype=F32)
        self._v = np.zeros((capacity, kv_heads, head_dim), dtype=F32)
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append `[T, kv_heads, head_dim]` rows and return views of the whole cache."""
        end = self.length + k.shape[0]
        if end > self._k.shape[0]:
            cap = max(end, 2 * self._k.shape[0])
            self._k = np.concatenate([self._k, np.zeros((cap - self._k.shape[0],) + self._k.shape[1:], F32)])
            self._v = np.concatenate([self._v, np.zeros((cap - self._v.shape[0],) + self._v.shape[1:], F32)])
        self._k[self.length : end] = k
        self._v[self.length : end] = v
        self.length = end
        return self._k[:end], self._v[:end]
