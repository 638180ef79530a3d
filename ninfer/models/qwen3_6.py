"""Qwen3.5/3.6 hybrid model on the CPU backend (ninfer-facts §3): Gated DeltaNet + gated full attention, dense
SwiGLU or sparse MoE FFN, untied head, and the one-layer MTP draft head.

Weights are read by ninfer name (§2.9). Dense models use the 27B inventory layout (separate `query_key` /
`gate_value`, `gdn/query_key` / `gdn/value_z`, `mlp/*`), MoE models the 35B one (fused `query_key_gate_value`,
`gdn/query_key_value_z`, `moe/*`), whatever their size. Fused objects are split by rows exactly as §2.9 lists them.
"""

from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from ninfer.backends.cpu.gdn import causal_conv, gated_delta_rule
from ninfer.backends.cpu.moe import MoeWeights, sparse_moe
from ninfer.backends.cpu.ops import (
    F32,
    KVCache,
    apply_rotary,
    causal_gqa_attention,
    l2_normalize,
    linear,
    mrope_angles,
    rms_norm,
    rope_inv_freq,
    sigmoid,
    silu,
    softplus,
    swiglu,
)
from ninfer.models.base import ForwardResult, LogitsWanted, WeightSource
from ninfer.targets.dims import QwenDims


def _get(weights: WeightSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(weights.get(name), dtype=F32)
    if array.shape != shape:
        raise ValueError(f"weight {name!r} has shape {array.shape}, the model dimensions need {shape}")
    return array


@attrs.define
class GdnState:
    conv: np.ndarray  # [conv_kernel - 1, channels]: the last RAW (pre-convolution) q|k|v columns, oldest first
    recurrent: np.ndarray  # [v_heads, k_dim, v_dim] fp32


@attrs.define
class Qwen36State:
    """One sequence: per layer a KVCache (full attention) or a GdnState, and the next text position."""

    layers: list[KVCache | GdnState]
    next_position: int = 0  # MRoPE positions may run ahead of the token count after media (§3.12)


@attrs.define
class MtpState:
    cache: KVCache
    next_position: int = 0


class GatedAttention:
    """§3.4: per-head offset q/k norms, partial interleaved MRoPE, causal GQA, sigmoid output gate."""

    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str, *, fused: bool) -> None:
        h, qw, kvw, d = dims.hidden, dims.q_width, dims.kv_width, dims.head_dim
        # One input matrix with rows q | k | gate | v: the 35B object as stored, the 27B pair concatenated once.
        if fused:
            self.in_proj = _get(weights, prefix + "query_key_gate_value", (2 * qw + 2 * kvw, h))
        else:
            self.in_proj = np.concatenate([
                _get(weights, prefix + "query_key", (qw + kvw, h)),
                _get(weights, prefix + "gate_value", (qw + kvw, h)),
            ])
        self.splits = np.cumsum([qw, kvw, qw])
        self.query_norm = _get(weights, prefix + "query_norm", (d,))
        self.key_norm = _get(weights, prefix + "key_norm", (d,))
        self.output = _get(weights, prefix + "output", (h, qw))
        self.heads, self.kv_heads, self.head_dim, self.eps = dims.attn_heads, dims.kv_heads, d, dims.rms_eps

    def new_state(self) -> KVCache:
        return KVCache(self.kv_heads, self.head_dim)

    def __call__(self, h: np.ndarray, cache: KVCache, angles: np.ndarray) -> np.ndarray:
        t = h.shape[0]
        q, k, gate, v = np.split(linear(h, self.in_proj), self.splits, axis=1)
        q = rms_norm(q.reshape(t, self.heads, self.head_dim), self.query_norm, self.eps, offset=True)
        k = rms_norm(k.reshape(t, self.kv_heads, self.head_dim), self.key_norm, self.eps, offset=True)
        q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        start = cache.length
        keys, values = cache.append(k, v.reshape(t, self.kv_heads, self.head_dim))
        attended = causal_gqa_attention(q, keys, values, start, 1.0 / np.sqrt(self.head_dim))
        return linear(attended.reshape(t, -1) * sigmoid(gate), self.output)


class GatedDeltaNet:
    """§3.5: conv(q|k|v) + SiLU, L2-normalised q/k, gated delta rule, per-head plain RMSNorm * SiLU(z)."""

    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str, *, fused: bool) -> None:
        h, qkw, vw, hv = dims.hidden, dims.gdn_qk_width, dims.gdn_v_width, dims.gdn_v_heads
        channels = dims.gdn_conv_channels
        # One input matrix with rows q | k | v | z and one with rows a | b, as the 35B objects store them.
        if fused:
            self.in_proj = _get(weights, prefix + "query_key_value_z", (channels + vw, h))
            self.ab_proj = _get(weights, prefix + "a_b_projection", (2 * hv, h))
        else:
            self.in_proj = np.concatenate([
                _get(weights, prefix + "query_key", (2 * qkw, h)),
                _get(weights, prefix + "value_z", (2 * vw, h)),
            ])
            self.ab_proj = np.concatenate([
                _get(weights, prefix + "a_projection", (hv, h)),
                _get(weights, prefix + "b_projection", (hv, h)),
            ])
        self.conv = _get(weights, prefix + "convolution", (dims.conv_kernel, channels))
        self.neg_a = -np.exp(_get(weights, prefix + "a_log", (hv,)))
        self.dt_bias = _get(weights, prefix + "dt_bias", (hv,))
        self.norm = _get(weights, prefix + "norm", (dims.gdn_v_dim,))
        self.output = _get(weights, prefix + "output", (h, vw))
        self.splits = [qkw, 2 * qkw]  # q | k | v inside the convolved channels
        self.dims = dims

    def new_state(self) -> GdnState:
        d = self.dims
        return GdnState(conv=np.zeros((d.conv_kernel - 1, d.gdn_conv_channels), F32),
                        recurrent=np.zeros((d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim), F32))

    def __call__(self, h: np.ndarray, state: GdnState, angles: np.ndarray) -> np.ndarray:
        """`angles` is unused (GDN has no positions); mixers share one call signature."""
        d, t = self.dims, h.shape[0]
        projected = linear(h, self.in_proj)
        mixed, z = projected[:, : d.gdn_conv_channels], projected[:, d.gdn_conv_channels :]
        conv_out, state.conv = causal_conv(mixed, state.conv, self.conv)
        q, k, v = np.split(silu(conv_out), self.splits, axis=1)
        # Each QK head serves v_heads / qk_heads consecutive V heads.
        repeat = d.gdn_v_heads // d.gdn_qk_heads
        q = np.repeat(l2_normalize(q.reshape(t, d.gdn_qk_heads, d.gdn_k_dim)), repeat, axis=1)
        k = np.repeat(l2_normalize(k.reshape(t, d.gdn_qk_heads, d.gdn_k_dim)), repeat, axis=1)
        q = q * F32(1.0 / np.sqrt(d.gdn_k_dim))  # the output scale, folded into q
        v = v.reshape(t, d.gdn_v_heads, d.gdn_v_dim)
        a, b = np.split(linear(h, self.ab_proj), 2, axis=1)
        log_decay = self.neg_a * softplus(a + self.dt_bias)
        out, state.recurrent = gated_delta_rule(q, k, v, log_decay, sigmoid(b), state.recurrent)
        normed = rms_norm(out, self.norm, d.rms_eps, offset=False) * silu(z.reshape(t, d.gdn_v_heads, d.gdn_v_dim))
        return linear(normed.reshape(t, -1), self.output)


class DenseMlp:
    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str) -> None:
        gate_up = _get(weights, prefix + "gate_up", (2 * dims.intermediate, dims.hidden))
        self.gate, self.up = gate_up[: dims.intermediate], gate_up[dims.intermediate :]
        self.down = _get(weights, prefix + "down", (dims.hidden, dims.intermediate))

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return swiglu(h, self.gate, self.up, self.down)


class SparseMoe:
    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str) -> None:
        e, h, inter, shared = dims.moe_experts, dims.hidden, dims.moe_intermediate, dims.shared_intermediate
        router_shared_gate = _get(weights, prefix + "router_shared_gate", (e + 1, h))
        self.weights = MoeWeights(
            router=router_shared_gate[:e],
            shared_gate=router_shared_gate[e],
            routed_gate_up=_get(weights, prefix + "routed_gate_up", (e * 2 * inter, h)).reshape(e, 2 * inter, h),
            routed_down=_get(weights, prefix + "routed_down", (e * h, inter)).reshape(e, h, inter),
            shared_gate_up=_get(weights, prefix + "shared_gate_up", (2 * shared, h)),
            shared_down=_get(weights, prefix + "shared_down", (h, shared)),
        )
        self.top_k = dims.moe_top_k

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return sparse_moe(h, self.weights, self.top_k)


class DecoderLayer:
    """§3.3: x += mixer(offset_norm(x)); x += ffn(offset_norm(x))."""

    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str, mixer: GatedAttention | GatedDeltaNet,
                 ffn: Callable[[np.ndarray], np.ndarray]) -> None:
        self.input_norm = _get(weights, prefix + "input_norm", (dims.hidden,))
        self.post_attention_norm = _get(weights, prefix + "post_attention_norm", (dims.hidden,))
        self.mixer, self.ffn, self.eps = mixer, ffn, dims.rms_eps

    def __call__(self, x: np.ndarray, state: KVCache | GdnState, angles: np.ndarray) -> np.ndarray:
        x = x + self.mixer(rms_norm(x, self.input_norm, self.eps, offset=True), state, angles)
        return x + self.ffn(rms_norm(x, self.post_attention_norm, self.eps, offset=True))


def _ffn(dims: QwenDims, weights: WeightSource, prefix: str) -> DenseMlp | SparseMoe:
    return SparseMoe(dims, weights, prefix + "moe/") if dims.is_moe else DenseMlp(dims, weights, prefix + "mlp/")


class MtpHead:
    """§3.8: fc(concat(offset_norm(embed(next)), offset_norm(h))) -> one gated-attention layer -> offset norm."""

    def __init__(self, dims: QwenDims, weights: WeightSource) -> None:
        h = dims.hidden
        self.input_projection = _get(weights, "mtp/input_projection", (h, 2 * h))
        self.embedding_norm = _get(weights, "mtp/embedding_norm", (h,))
        self.hidden_norm = _get(weights, "mtp/hidden_norm", (h,))
        attention = GatedAttention(dims, weights, "mtp/layer/attention/", fused=True)
        self.layer = DecoderLayer(dims, weights, "mtp/layer/", attention, _ffn(dims, weights, "mtp/layer/"))
        self.final_norm = _get(weights, "mtp/final_norm", (h,))


class Qwen36Model:
    """The text model and its MTP head; holds weights only, all per-sequence data lives in the state objects."""

    def __init__(self, dims: QwenDims, weights: WeightSource) -> None:
        self.dims = dims
        fused = dims.is_moe
        self.embedding = _get(weights, "text/token_embedding", (dims.vocab_rows, dims.hidden))
        self.layers: list[DecoderLayer] = []
        for index, kind in enumerate(dims.layer_types):
            prefix = f"text/layers/{index}/"
            if kind == "full_attention":
                mixer: GatedAttention | GatedDeltaNet = GatedAttention(dims, weights, prefix + "attention/",
                                                                       fused=fused)
            else:
                mixer = GatedDeltaNet(dims, weights, prefix + "gdn/", fused=fused)
            self.layers.append(DecoderLayer(dims, weights, prefix, mixer, _ffn(dims, weights, prefix)))
        self.final_norm = _get(weights, "text/final_norm", (dims.hidden,))
        self.output_head = _get(weights, "text/output_head", (dims.vocab_rows, dims.hidden))
        self.mtp = MtpHead(dims, weights) if dims.mtp_layers > 0 else None
        self._inv_freq = rope_inv_freq(dims.rotary_dim, dims.rope_theta)

    # ---- target model ----

    def new_state(self) -> Qwen36State:
        return Qwen36State(layers=[layer.mixer.new_state() for layer in self.layers])

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self.embedding[_token_ids(token_ids, self.dims.vocab_rows)]

    def forward(self, state: Qwen36State, token_ids: np.ndarray, *, positions: np.ndarray | None = None,
                logits: LogitsWanted = "last") -> ForwardResult:
        """Run `token_ids` `[T]` as the continuation of `state` (updated in place).

        positions: `[3, T]` MRoPE (T, H, W) positions; by default text positions continuing the state.
        """
        return self.forward_embeddings(state, self.embed(token_ids), positions=positions, logits=logits)

    def forward_embeddings(self, state: Qwen36State, x: np.ndarray, *, positions: np.ndarray | None = None,
                           logits: LogitsWanted = "last") -> ForwardResult:
        """`forward` from input embeddings `[T, hidden]` (where Vision output replaces media pad columns)."""
        positions = _positions(state.next_position, x.shape[0], positions)
        angles = mrope_angles(positions, self._inv_freq, self.dims.mrope_section)
        x = x.astype(F32, copy=False)
        for layer, layer_state in zip(self.layers, state.layers):
            x = layer(x, layer_state, angles)
        state.next_position = int(positions.max()) + 1
        hidden = rms_norm(x, self.final_norm, self.dims.rms_eps, offset=True)
        return ForwardResult(logits=self._logits(hidden, logits), hidden=hidden)

    # ---- MTP head ----

    def mtp_new_state(self) -> MtpState:
        return MtpState(cache=self._require_mtp().layer.mixer.new_state())

    def mtp_forward(self, mtp_state: MtpState, hidden: np.ndarray, next_ids: np.ndarray, *,
                    positions: np.ndarray | None = None, logits: LogitsWanted = "last") -> ForwardResult:
        """Fuse target hidden h_t `[T, hidden]` (after the final norm) with the embedding of token t+1, at h_t's
        position. `result.hidden` is the MTP output `d` (after `mtp/final_norm`), the `h` of the next draft step."""
        mtp, eps = self._require_mtp(), self.dims.rms_eps
        if hidden.shape != (len(next_ids), self.dims.hidden):
            raise ValueError(f"hidden {hidden.shape} does not match {len(next_ids)} next ids")
        embedded = rms_norm(self.embed(next_ids), mtp.embedding_norm, eps, offset=True)
        carried = rms_norm(hidden, mtp.hidden_norm, eps, offset=True)
        u = linear(np.concatenate([embedded, carried], axis=1), mtp.input_projection)
        positions = _positions(mtp_state.next_position, u.shape[0], positions)
        u = mtp.layer(u, mtp_state.cache, mrope_angles(positions, self._inv_freq, self.dims.mrope_section))
        mtp_state.next_position = int(positions.max()) + 1
        d = rms_norm(u, mtp.final_norm, eps, offset=True)
        return ForwardResult(logits=self._logits(d, logits), hidden=d)

    def _require_mtp(self) -> MtpHead:
        if self.mtp is None:
            raise ValueError("this model has no MTP head (mtp_layers == 0)")
        return self.mtp

    def _logits(self, hidden: np.ndarray, wanted: LogitsWanted) -> np.ndarray:
        if wanted not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {wanted!r}")
        return linear(hidden if wanted == "all" else hidden[-1:], self.output_head)


def _token_ids(token_ids: np.ndarray, vocab_rows: int) -> np.ndarray:
    ids = np.asarray(token_ids).reshape(-1)
    if ids.size == 0:
        raise ValueError("no tokens to run")
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab_rows:
        raise ValueError(f"token ids must be integers in [0, {vocab_rows})")
    return ids


def _positions(next_position: int, count: int, positions: np.ndarray | None) -> np.ndarray:
    if positions is None:
        return np.broadcast_to(next_position + np.arange(count), (3, count))
    positions = np.asarray(positions)
    if positions.shape != (3, count) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions must be integer [3, {count}], got {positions.dtype} {positions.shape}")
    return positions
