"""Gated DeltaNet ops (ninfer-facts §3.5): the short causal convolution and the gated delta rule.

Both carry state across calls, so a prefill of N tokens followed by single-token steps gives the same result as one
call over all tokens. All math is fp32.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def causal_conv(x: np.ndarray, history: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution with carried input history (no bias, no activation).

    x: `[T, C]` new columns; history: `[K-1, C]` the previous K-1 RAW input columns, oldest first (zeros at the
    start of a sequence); weight: tap-major `[K, C]`, tap K-1 multiplies the current column.
    Returns (`[T, C]` outputs, the new `[K-1, C]` history).
    """
    taps = weight.shape[0]
    t = x.shape[0]
    extended = np.concatenate([history.astype(F32, copy=False), x.astype(F32, copy=False)])
    y = weight[0] * extended[:t]
    for j in range(1, taps):
        y = y + weight[j] * extended[j : j + t]
    return y, extended[t:].copy()


def conv_histories(x: np.ndarray, history: np.ndarray) -> np.ndarray:
    """The `causal_conv` history after each of the T columns of `x`: `[T, K-1, C]` (for per-column snapshots)."""
    keep = history.shape[0]
    extended = np.concatenate([history.astype(F32, copy=False), x.astype(F32, copy=False)])
    return np.stack([extended[t + 1 : t + 1 + keep] for t in range(x.shape[0])])


def gated_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, log_decay: np.ndarray, beta: np.ndarray, state: np.ndarray,
    *, column_states: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule recurrence, one token at a time, vectorised over heads.

    q, k: `[T, H, Dk]` (already L2-normalised, q already scaled, both repeated to the V heads); v: `[T, H, Dv]`;
    log_decay (g) and beta: `[T, H]`; state: `[H, Dk, Dv]`. Per token and head:
        S = exp(g) * S;  u = beta * (v - S^T k);  S = S + k u^T;  o = S^T q
    The decay is applied BEFORE the delta error is measured. Returns (`[T, H, Dv]` outputs, the new state).
    `column_states` (`[T', H, Dk, Dv]`, T' <= T), when given, receives the state after each of the first T' tokens.
    """
    s = state.astype(F32, copy=True)
    decay = np.exp(log_decay.astype(F32, copy=False))
    out = np.empty(v.shape, dtype=F32)
    for t in range(q.shape[0]):
        s *= decay[t][:, None, None]
        predicted = np.matmul(k[t][:, None, :], s)[:, 0, :]  # [H, Dv] = S^T k
        update = beta[t][:, None] * (v[t] - predicted)
        s += k[t][:, :, None] * update[:, None, :]
        out[t] = np.matmul(q[t][:, None, :], s)[:, 0, :]
        if column_states is not None and t < len(column_states):
            column_states[t] = s
    return out, s
