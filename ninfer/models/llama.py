"""Plain llama on the CPU (the bundled SmolLM2 demo model): fp32 NumPy math over the shared reference ops.

Per layer: RMSNorm -> fused QKV projection -> rotate-half RoPE over the whole head -> causal GQA attention over the
layer's KV cache -> output projection -> residual; RMSNorm -> fused gate/up -> SwiGLU -> down -> residual. Then the
final RMSNorm and the head (the embedding itself when tied). Tensor names: `ninfer.convert.gguf_llama`.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np

from ninfer.backends.cpu import ops
from ninfer.models.base import ForwardResult, LogitsWanted, WeightSource
from ninfer.targets.dims import LlamaDims


@attrs.define
class LlamaState:
    """One sequence: a KV cache per layer and the number of positions already run."""

    caches: list[ops.KVCache]
    position: int = 0


@attrs.frozen
class _Layer:
    input_norm: np.ndarray
    qkv: np.ndarray  # [q_width + 2 * kv_width, hidden], rows query | key | value
    output: np.ndarray
    post_attention_norm: np.ndarray
    gate_up: np.ndarray  # [2 * intermediate, hidden], rows gate | up
    down: np.ndarray


class LlamaModel:
    has_mtp = False

    def __init__(self, dims: LlamaDims, weights: WeightSource) -> None:
        self.dims = dims
        d = dims

        def weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
            array = np.asarray(weights.get(name), dtype=np.float32)
            if array.shape != shape:
                raise ValueError(f"weight {name!r} has shape {list(array.shape)}, expected {list(shape)}")
            return array

        self.embedding = weight("text/token_embedding", (d.vocab_rows, d.hidden))
        self.layers = [
            _Layer(
                input_norm=weight(f"text/layers/{i}/input_norm", (d.hidden,)),
                qkv=weight(f"text/layers/{i}/attention/query_key_value", (d.q_width + 2 * d.kv_width, d.hidden)),
                output=weight(f"text/layers/{i}/attention/output", (d.hidden, d.q_width)),
                post_attention_norm=weight(f"text/layers/{i}/post_attention_norm", (d.hidden,)),
                gate_up=weight(f"text/layers/{i}/mlp/gate_up", (2 * d.intermediate, d.hidden)),
                down=weight(f"text/layers/{i}/mlp/down", (d.hidden, d.intermediate)),
            )
            for i in range(d.layers)
        ]
        self.final_norm = weight("text/final_norm", (d.hidden,))
        self.head = self.embedding if d.tie_embeddings else weight("text/output_head", (d.vocab_rows, d.hidden))
        self._inv_freq = ops.rope_inv_freq(d.head_dim, d.rope_theta)
        self._scale = 1.0 / math.sqrt(d.head_dim)

    def new_state(self) -> LlamaState:
        return LlamaState(caches=[ops.KVCache(self.dims.kv_heads, self.dims.head_dim) for _ in self.layers])

    @property
    def mixer_kinds(self) -> tuple[str, ...]:
        return (ops.ATTENTION,) * len(self.layers)

    def forward(self, state: LlamaState, token_ids: np.ndarray, *, logits: LogitsWanted = "last") -> ForwardResult:
        """Run `token_ids` as the continuation of `state` (prefill or decode alike) and advance it."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        start = state.position
        positions = np.broadcast_to(np.arange(start, start + ids.size), (3, ids.size))
        hidden = self.forward_batch(ids, positions, [ops.Segment(slice(0, ids.size), state.caches)])
        state.position = start + ids.size
        return ForwardResult(logits=self.logits(hidden if logits == "all" else hidden[-1:]), hidden=hidden)

    def forward_batch(self, token_ids: np.ndarray, positions: np.ndarray,
                      segments: Sequence[ops.Segment]) -> np.ndarray:
        """Several sequences in one traversal: `token_ids [N]`, `positions [3, N]` (all axes equal: plain RoPE uses
        the first), `segments` each continuing one sequence with its per-layer KV stores. Returns the hidden rows
        after the final norm; every row is bitwise what it would be in any other batch or chunk."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= self.dims.vocab_rows:
            raise ValueError(f"token ids must be in [0, {self.dims.vocab_rows})")
        angles = ops.rope_angles(np.asarray(positions)[0], self._inv_freq)
        x = self.embedding[ids]
        for index, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.input_norm, self.dims.rms_eps, offset=False)
            x = x + self._attention(layer, [(s.rows, s.layers[index]) for s in segments], h, angles)
            x = x + self._mlp(layer, ops.rms_norm(x, layer.post_attention_norm, self.dims.rms_eps, offset=False))
        return ops.rms_norm(x, self.final_norm, self.dims.rms_eps, offset=False)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return ops.linear(hidden, self.head)

    def _attention(self, layer: _Layer, parts: list[tuple[slice, ops.KVStore]], h: np.ndarray,
                   angles: np.ndarray) -> np.ndarray:
        d = self.dims
        t = h.shape[0]
        qkv = ops.linear(h, layer.qkv)
        q = ops.apply_rotary(qkv[:, : d.q_width].reshape(t, d.attn_heads, d.head_dim), angles)
        k = ops.apply_rotary(qkv[:, d.q_width : d.q_width + d.kv_width].reshape(t, d.kv_heads, d.head_dim), angles)
        v = qkv[:, d.q_width + d.kv_width :].reshape(t, d.kv_heads, d.head_dim)
        out = np.empty_like(q)
        for rows, cache in parts:
            start = cache.length
            keys, values = cache.append(k[rows], v[rows])
            out[rows] = ops.causal_gqa_attention(q[rows], keys, values, start, self._scale)
        return ops.linear(out.reshape(t, d.q_width), layer.output)

    def _mlp(self, layer: _Layer, h: np.ndarray) -> np.ndarray:
        gate_up = ops.linear(h, layer.gate_up)
        gate, up = gate_up[:, : self.dims.intermediate], gate_up[:, self.dims.intermediate :]
        return ops.linear(ops.silu(gate) * up, layer.down)
