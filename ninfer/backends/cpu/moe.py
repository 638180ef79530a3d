"""Sparse mixture of experts (ninfer-facts §3.6): softmax router, top-k, routed SwiGLU experts, gated shared expert.

No capacity factor and no token dropping; routing and accumulation are fp32.
"""

from __future__ import annotations

import attrs
import numpy as np

from ninfer.backends.cpu.ops import F32, linear, sigmoid, silu, softmax, swiglu


@attrs.frozen(kw_only=True)
class MoeWeights:
    router: np.ndarray  # [E, hidden]
    shared_gate: np.ndarray  # [hidden]: the scalar gate of the shared expert
    routed_gate_up: np.ndarray  # [E, 2 * inter, hidden]: per expert, gate rows then up rows
    routed_down: np.ndarray  # [E, hidden, inter]
    shared_gate_up: np.ndarray  # [2 * shared_inter, hidden]
    shared_down: np.ndarray  # [hidden, shared_inter]


def route_top_k(router_logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Experts and weights per token: softmax over ALL experts, top-k (ties to the lower id), renormalised.

    Returns (`[T, k]` expert ids, `[T, k]` weights summing to 1 per token).
    """
    probs = softmax(router_logits, axis=-1)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    top = np.take_along_axis(probs, ids, axis=-1)
    return ids, top / np.sum(top, axis=-1, keepdims=True)


def sparse_moe(x: np.ndarray, w: MoeWeights, top_k: int) -> np.ndarray:
    """`sum_e w_e * down_e(silu(gate_e x) * up_e x) + sigmoid(shared_gate . x) * shared(x)` for x `[T, hidden]`."""
    x = x.astype(F32, copy=False)
    ids, weights = route_top_k(linear(x, w.router), top_k)
    inter = w.routed_gate_up.shape[1] // 2
    routed = np.zeros_like(x)
    # Expert by expert over the tokens that chose it; a token picks an expert at most once, so rows are unique.
    # Each token sums its experts in ascending id order whatever else is in the batch (row invariance).
    for expert in np.unique(ids):
        rows, slot = np.nonzero(ids == expert)
        gate_up = linear(x[rows], w.routed_gate_up[expert])
        hidden = silu(gate_up[:, :inter]) * gate_up[:, inter:]
        routed[rows] += weights[rows, slot][:, None] * linear(hidden, w.routed_down[expert])
    shared_inter = w.shared_gate_up.shape[0] // 2
    shared = swiglu(x, w.shared_gate_up[:shared_inter], w.shared_gate_up[shared_inter:], w.shared_down)
    return routed + sigmoid(linear(x, w.shared_gate[None, :]))[:, :1] * shared
