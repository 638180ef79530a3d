"""The DFlash block drafter (ninfer-facts §3.10) on the CPU backend.

One forward over a block `[anchor, MASK x k]` at positions L..L+k proposes k tokens: the final hidden row of mask i
(position L+1+i) predicts the token at its own position, through the target's output head (or its shortlist head).
Every layer is non-causal: a block query reads the layer's context keys (committed target positions) and all of the
block's own keys; a sliding layer sees only keys whose position is within `sliding_window` of the query's, on either
side. The context of a position is projected once from its context features s (the target's post-MLP residuals after
`target_layer_ids`, concatenated): `c = plain_rmsnorm(W_fc s, context_norm)`, then per layer
`K = rope(plain_head_rmsnorm(W_k c, k_norm))` and `V = W_v c`. Block keys and values are temporary. Every norm is a
plain RMSNorm and RoPE is 1-D split-half over the whole head.

The drafter holds weights only: where a lane's context K/V live (cyclic caches, pages) is the runner's business, and
each block is handed its layers' context as `ContextKV` arrays. Rows are computed independently of each other, so a
lane's proposals do not depend on the other blocks of the batch.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from ninfer.backends.cpu.ops import (apply_rotary, linear, rms_norm, rope_angles, rope_inv_freq, swiglu,
                                     windowed_gqa_attention)
from ninfer.models.base import WeightSource
from ninfer.models.qwen3_6 import read_weight
from ninfer.targets.dims import SLIDING_ATTENTION, DFlashDims, QwenDims


class DFlashMismatchError(ValueError):
    """A DFlash drafter whose dimensions cannot serve the target model (size, context layers, mask row)."""


@attrs.frozen(eq=False)
class ContextKV:
    """One drafter layer's context for one sequence: keys (normed and rotated) and values of committed positions."""

    keys: np.ndarray  # [S, kv_heads, head_dim]
    values: np.ndarray  # [S, kv_heads, head_dim]
    positions: np.ndarray  # [S]


@attrs.frozen(eq=False)
class DraftBlock:
    """The rows of one proposal block inside a ragged batch, and its sequence's context, one per drafter layer."""

    rows: slice
    context: Sequence[ContextKV]


class DFlashLayer:
    def __init__(self, dims: DFlashDims, weights: WeightSource, prefix: str, index: int) -> None:
        h, qw, kvw, d = dims.hidden, dims.q_width, dims.kv_width, dims.head_dim
        qkv = read_weight(weights, prefix + "attention/query_key_value", (qw + 2 * kvw, h))
        self.query, self.key, self.value = np.split(qkv, [qw, qw + kvw])
        self.query_norm = read_weight(weights, prefix + "attention/query_norm", (d,))
        self.key_norm = read_weight(weights, prefix + "attention/key_norm", (d,))
        self.output = read_weight(weights, prefix + "attention/output", (h, qw))
        self.input_norm = read_weight(weights, prefix + "input_norm", (h,))
        self.post_attention_norm = read_weight(weights, prefix + "post_attention_norm", (h,))
        gate_up = read_weight(weights, prefix + "mlp/gate_up", (2 * dims.intermediate, h))
        self.gate, self.up = np.split(gate_up, 2)
        self.down = read_weight(weights, prefix + "mlp/down", (h, dims.intermediate))
        self.index = index
        self.window = dims.sliding_window if dims.layer_types[index] == SLIDING_ATTENTION else None
        self.heads, self.kv_heads, self.head_dim, self.eps = dims.attn_heads, dims.kv_heads, d, dims.rms_eps

    def keys_values(self, x: np.ndarray, angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K (per-head plain norm, then RoPE) and V `[T, kv_heads, head_dim]` of rows `x`: context rows c or the
        block's normed rows."""
        t = x.shape[0]
        k = rms_norm(linear(x, self.key).reshape(t, self.kv_heads, self.head_dim), self.key_norm, self.eps,
                     offset=False)
        return apply_rotary(k, angles), linear(x, self.value).reshape(t, self.kv_heads, self.head_dim)

    def __call__(self, u: np.ndarray, positions: np.ndarray, angles: np.ndarray,
                 blocks: Sequence[DraftBlock]) -> np.ndarray:
        t = u.shape[0]
        n = rms_norm(u, self.input_norm, self.eps, offset=False)
        q = rms_norm(linear(n, self.query).reshape(t, self.heads, self.head_dim), self.query_norm, self.eps,
                     offset=False)
        q = apply_rotary(q, angles)
        k, v = self.keys_values(n, angles)
        attended = np.empty_like(q)
        for block in blocks:
            r, context = block.rows, block.context[self.index]
            attended[r] = windowed_gqa_attention(
                q[r], positions[r], np.concatenate([context.keys, k[r]]), np.concatenate([context.values, v[r]]),
                np.concatenate([context.positions, positions[r]]), 1.0 / np.sqrt(self.head_dim), self.window)
        u = u + linear(attended.reshape(t, -1), self.output)
        return u + swiglu(rms_norm(u, self.post_attention_norm, self.eps, offset=False), self.gate, self.up,
                          self.down)


class DFlashDrafter:
    """The drafter's weights (`dflash/...`) and math; it reads the target's embeddings and head through the target
    model, which owns them."""

    def __init__(self, target: QwenDims, dims: DFlashDims, weights: WeightSource) -> None:
        problems = dims.problems_with(target)
        if problems:
            raise DFlashMismatchError("the DFlash drafter does not fit the target model: " + "; ".join(problems))
        h = dims.hidden
        self.dims = dims
        self.feature_projection = read_weight(weights, "dflash/feature_projection", (h, dims.feature_width))
        self.context_norm = read_weight(weights, "dflash/context_norm", (h,))
        self.layers = [DFlashLayer(dims, weights, f"dflash/layers/{i}/", i) for i in range(dims.layers)]
        self.final_norm = read_weight(weights, "dflash/final_norm", (h,))
        self._inv_freq = rope_inv_freq(dims.head_dim, dims.rope_theta)

    def context_keys_values(self, features: np.ndarray, positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per drafter layer, the context K and V `[n, kv_heads, head_dim]` of committed positions `[n]` from their
        context features `[n, feature_width]`."""
        c = rms_norm(linear(features, self.feature_projection), self.context_norm, self.dims.rms_eps, offset=False)
        angles = rope_angles(positions, self._inv_freq)
        return [layer.keys_values(c, angles) for layer in self.layers]

    def forward(self, x: np.ndarray, positions: np.ndarray, blocks: Sequence[DraftBlock]) -> np.ndarray:
        """The drafter over a ragged batch of blocks: input embeddings `x [N, hidden]` at positions `[N]`. Returns the
        hidden rows after the final norm `[N, hidden]`; a mask row's row is its proposal's input to the head."""
        angles = rope_angles(positions, self._inv_freq)
        u = x.astype(np.float32, copy=False)
        for layer in self.layers:
            u = layer(u, positions, angles, blocks)
        return rms_norm(u, self.final_norm, self.dims.rms_eps, offset=False)
