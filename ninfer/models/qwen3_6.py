"""Qwen3.5/3.6 hybrid model on the CPU backend (ninfer-facts §3): Gated DeltaNet + gated full attention, dense
SwiGLU or sparse MoE FFN, untied head, the one-layer MTP draft head, and (35B-A3B, on request) the DFlash drafter
of `ninfer.models.dflash`, whose context features this model captures while it runs.

Weights are read by ninfer name (§2.9). Dense models use the 27B inventory layout (separate `query_key` /
`gate_value`, `gdn/query_key` / `gdn/value_z`, `mlp/*`), MoE models the 35B one (fused `query_key_gate_value`,
`gdn/query_key_value_z`, `moe/*`), whatever their size. Fused objects are split by rows exactly as §2.9 lists them.

Layers run over ragged batches: `Segment`s of rows that each continue one sequence with that sequence's own KV stores
and recurrent states. The per-sequence `forward` is a one-segment batch, and the paged runner batches many.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import attrs
import numpy as np

from ninfer.backends.cpu.gdn import causal_conv, conv_histories, gated_delta_rule
from ninfer.backends.cpu.moe import MoeWeights, sparse_moe
from ninfer.backends.cpu.ops import (
    ATTENTION,
    F32,
    RECURRENT,
    KVCache,
    KVStore,
    Segment,
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
from ninfer.models.qwen3_6_vision import VisionTower
from ninfer.targets.dims import DFlashDims, QwenDims


def read_weight(weights: WeightSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A weight as float32, checked against the shape the model dimensions imply."""
    array = np.asarray(weights.get(name), dtype=F32)
    if array.shape != shape:
        raise ValueError(f"weight {name!r} has shape {array.shape}, the model dimensions need {shape}")
    return array


@attrs.define
class GdnState:
    conv: np.ndarray  # [conv_kernel - 1, channels]: the last RAW (pre-convolution) q|k|v columns, oldest first
    recurrent: np.ndarray  # [v_heads, k_dim, v_dim] fp32

    def copy(self) -> "GdnState":
        return GdnState(conv=self.conv.copy(), recurrent=self.recurrent.copy())


@attrs.frozen
class GdnColumns:
    """A GdnState after each of T consecutive tokens: `conv [T, K-1, C]`, `recurrent [T, Hv, Dk, Dv]`."""

    conv: np.ndarray
    recurrent: np.ndarray

    def state_after(self, column: int) -> GdnState:
        return GdnState(conv=self.conv[column].copy(), recurrent=self.recurrent[column].copy())


@attrs.frozen
class MixerRows:
    """The rows of one sequence inside a ragged batch, as one mixer layer sees them."""

    rows: slice
    state: KVStore | GdnState
    record_columns: bool = False


@attrs.frozen
class DraftHead:
    """§3.9: a shortlist of output-head rows; a proposal is the best shortlist row, mapped back to its token id."""

    weight: np.ndarray  # [rows, hidden]
    token_ids: np.ndarray  # [rows] int32


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
            self.in_proj = read_weight(weights, prefix + "query_key_gate_value", (2 * qw + 2 * kvw, h))
        else:
            self.in_proj = np.concatenate([
                read_weight(weights, prefix + "query_key", (qw + kvw, h)),
                read_weight(weights, prefix + "gate_value", (qw + kvw, h)),
            ])
        self.splits = np.cumsum([qw, kvw, qw])
        self.query_norm = read_weight(weights, prefix + "query_norm", (d,))
        self.key_norm = read_weight(weights, prefix + "key_norm", (d,))
        self.output = read_weight(weights, prefix + "output", (h, qw))
        self.heads, self.kv_heads, self.head_dim, self.eps = dims.attn_heads, dims.kv_heads, d, dims.rms_eps

    def new_state(self) -> KVCache:
        return KVCache(self.kv_heads, self.head_dim)

    def __call__(self, h: np.ndarray, parts: Sequence[MixerRows],
                 angles: np.ndarray) -> tuple[np.ndarray, list[None]]:
        t = h.shape[0]
        q, k, gate, v = np.split(linear(h, self.in_proj), self.splits, axis=1)
        q = rms_norm(q.reshape(t, self.heads, self.head_dim), self.query_norm, self.eps, offset=True)
        k = rms_norm(k.reshape(t, self.kv_heads, self.head_dim), self.key_norm, self.eps, offset=True)
        q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        v = v.reshape(t, self.kv_heads, self.head_dim)
        attended = np.empty_like(q)
        for part in parts:
            r, cache = part.rows, part.state
            start = cache.length
            keys, values = cache.append(k[r], v[r])
            attended[r] = causal_gqa_attention(q[r], keys, values, start, 1.0 / np.sqrt(self.head_dim))
        return linear(attended.reshape(t, -1) * sigmoid(gate), self.output), [None] * len(parts)


class GatedDeltaNet:
    """§3.5: conv(q|k|v) + SiLU, L2-normalised q/k, gated delta rule, per-head plain RMSNorm * SiLU(z)."""

    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str, *, fused: bool) -> None:
        h, qkw, vw, hv = dims.hidden, dims.gdn_qk_width, dims.gdn_v_width, dims.gdn_v_heads
        channels = dims.gdn_conv_channels
        # One input matrix with rows q | k | v | z and one with rows a | b, as the 35B objects store them.
        if fused:
            self.in_proj = read_weight(weights, prefix + "query_key_value_z", (channels + vw, h))
            self.ab_proj = read_weight(weights, prefix + "a_b_projection", (2 * hv, h))
        else:
            self.in_proj = np.concatenate([
                read_weight(weights, prefix + "query_key", (2 * qkw, h)),
                read_weight(weights, prefix + "value_z", (2 * vw, h)),
            ])
            self.ab_proj = np.concatenate([
                read_weight(weights, prefix + "a_projection", (hv, h)),
                read_weight(weights, prefix + "b_projection", (hv, h)),
            ])
        self.conv = read_weight(weights, prefix + "convolution", (dims.conv_kernel, channels))
        self.neg_a = -np.exp(read_weight(weights, prefix + "a_log", (hv,)))
        self.dt_bias = read_weight(weights, prefix + "dt_bias", (hv,))
        self.norm = read_weight(weights, prefix + "norm", (dims.gdn_v_dim,))
        self.output = read_weight(weights, prefix + "output", (h, vw))
        self.splits = [qkw, 2 * qkw]  # q | k | v inside the convolved channels
        self.dims = dims

    def new_state(self) -> GdnState:
        d = self.dims
        return GdnState(conv=np.zeros((d.conv_kernel - 1, d.gdn_conv_channels), F32),
                        recurrent=np.zeros((d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim), F32))

    def __call__(self, h: np.ndarray, parts: Sequence[MixerRows],
                 angles: np.ndarray) -> tuple[np.ndarray, list[GdnColumns | None]]:
        """`angles` is unused (GDN has no positions); mixers share one call signature. Returns the output and, per
        part that asked for them, its states after every column."""
        d, t = self.dims, h.shape[0]
        projected = linear(h, self.in_proj)
        mixed, z = projected[:, : d.gdn_conv_channels], projected[:, d.gdn_conv_channels :]
        conv_out = np.empty_like(mixed)
        columns: list[GdnColumns | None] = []
        for part in parts:
            r, state = part.rows, part.state
            conv_history = conv_histories(mixed[r], state.conv) if part.record_columns else None
            conv_out[r], state.conv = causal_conv(mixed[r], state.conv, self.conv)
            columns.append(None if conv_history is None else GdnColumns(
                conv=conv_history, recurrent=np.empty((r.stop - r.start,) + state.recurrent.shape, F32)))
        q, k, v = np.split(silu(conv_out), self.splits, axis=1)
        # Each QK head serves v_heads / qk_heads consecutive V heads.
        repeat = d.gdn_v_heads // d.gdn_qk_heads
        q = np.repeat(l2_normalize(q.reshape(t, d.gdn_qk_heads, d.gdn_k_dim)), repeat, axis=1)
        k = np.repeat(l2_normalize(k.reshape(t, d.gdn_qk_heads, d.gdn_k_dim)), repeat, axis=1)
        q = q * F32(1.0 / np.sqrt(d.gdn_k_dim))  # the output scale, folded into q
        v = v.reshape(t, d.gdn_v_heads, d.gdn_v_dim)
        a, b = np.split(linear(h, self.ab_proj), 2, axis=1)
        log_decay, beta = self.neg_a * softplus(a + self.dt_bias), sigmoid(b)
        out = np.empty_like(v)
        for part, recorded in zip(parts, columns):
            r, state = part.rows, part.state
            out[r], state.recurrent = gated_delta_rule(
                q[r], k[r], v[r], log_decay[r], beta[r], state.recurrent,
                column_states=None if recorded is None else recorded.recurrent)
        normed = rms_norm(out, self.norm, d.rms_eps, offset=False) * silu(z.reshape(t, d.gdn_v_heads, d.gdn_v_dim))
        return linear(normed.reshape(t, -1), self.output), columns


class DenseMlp:
    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str) -> None:
        gate_up = read_weight(weights, prefix + "gate_up", (2 * dims.intermediate, dims.hidden))
        self.gate, self.up = gate_up[: dims.intermediate], gate_up[dims.intermediate :]
        self.down = read_weight(weights, prefix + "down", (dims.hidden, dims.intermediate))

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return swiglu(h, self.gate, self.up, self.down)


class SparseMoe:
    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str) -> None:
        e, h, inter, shared = dims.moe_experts, dims.hidden, dims.moe_intermediate, dims.shared_intermediate
        router_shared_gate = read_weight(weights, prefix + "router_shared_gate", (e + 1, h))
        self.weights = MoeWeights(
            router=router_shared_gate[:e],
            shared_gate=router_shared_gate[e],
            routed_gate_up=read_weight(weights, prefix + "routed_gate_up", (e * 2 * inter, h)).reshape(e, 2 * inter, h),
            routed_down=read_weight(weights, prefix + "routed_down", (e * h, inter)).reshape(e, h, inter),
            shared_gate_up=read_weight(weights, prefix + "shared_gate_up", (2 * shared, h)),
            shared_down=read_weight(weights, prefix + "shared_down", (h, shared)),
        )
        self.top_k = dims.moe_top_k

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return sparse_moe(h, self.weights, self.top_k)


class DecoderLayer:
    """§3.3: x += mixer(offset_norm(x)); x += ffn(offset_norm(x))."""

    def __init__(self, dims: QwenDims, weights: WeightSource, prefix: str, mixer: GatedAttention | GatedDeltaNet,
                 ffn: Callable[[np.ndarray], np.ndarray]) -> None:
        self.input_norm = read_weight(weights, prefix + "input_norm", (dims.hidden,))
        self.post_attention_norm = read_weight(weights, prefix + "post_attention_norm", (dims.hidden,))
        self.mixer, self.ffn, self.eps = mixer, ffn, dims.rms_eps

    def __call__(self, x: np.ndarray, parts: Sequence[MixerRows],
                 angles: np.ndarray) -> tuple[np.ndarray, list[GdnColumns | None]]:
        mixed, columns = self.mixer(rms_norm(x, self.input_norm, self.eps, offset=True), parts, angles)
        x = x + mixed
        return x + self.ffn(rms_norm(x, self.post_attention_norm, self.eps, offset=True)), columns


def _ffn(dims: QwenDims, weights: WeightSource, prefix: str) -> DenseMlp | SparseMoe:
    return SparseMoe(dims, weights, prefix + "moe/") if dims.is_moe else DenseMlp(dims, weights, prefix + "mlp/")


class MtpHead:
    """§3.8: fc(concat(offset_norm(embed(next)), offset_norm(h))) -> one gated-attention layer -> offset norm."""

    def __init__(self, dims: QwenDims, weights: WeightSource) -> None:
        h = dims.hidden
        self.input_projection = read_weight(weights, "mtp/input_projection", (h, 2 * h))
        self.embedding_norm = read_weight(weights, "mtp/embedding_norm", (h,))
        self.hidden_norm = read_weight(weights, "mtp/hidden_norm", (h,))
        attention = GatedAttention(dims, weights, "mtp/layer/attention/", fused=True)
        self.layer = DecoderLayer(dims, weights, "mtp/layer/", attention, _ffn(dims, weights, "mtp/layer/"))
        self.final_norm = read_weight(weights, "mtp/final_norm", (h,))


def build_vision_tower(dims: QwenDims, weights: WeightSource) -> VisionTower:
    """The NumPy Vision tower of a Qwen model whose weights carry one (the CPU model's, and the CUDA runner's until
    it has a device tower)."""
    if dims.vision is None:
        raise ValueError("this model has no Vision tower (its dimensions carry no vision record)")
    if dims.vision.out_hidden != dims.hidden:
        raise ValueError(f"the Vision tower's out_hidden {dims.vision.out_hidden} differs from the text hidden "
                         f"size {dims.hidden}")
    if hasattr(weights, "has") and not weights.has("vision/patch_embedding"):
        raise ValueError("the weights have no Vision tower (no vision/... tensors)")
    return VisionTower(dims.vision, weights)


class Qwen36Model:
    """The text model and its MTP head; holds weights only, all per-sequence data lives in the state objects.
    `dflash` (the drafter's dimensions) also builds the DFlash drafter from the `dflash/...` weights."""

    def __init__(self, dims: QwenDims, weights: WeightSource, *, vision: bool = False,
                 dflash: DFlashDims | None = None) -> None:
        self.dims = dims
        fused = dims.is_moe
        self.embedding = read_weight(weights, "text/token_embedding", (dims.vocab_rows, dims.hidden))
        self.layers: list[DecoderLayer] = []
        for index, kind in enumerate(dims.layer_types):
            prefix = f"text/layers/{index}/"
            if kind == "full_attention":
                mixer: GatedAttention | GatedDeltaNet = GatedAttention(dims, weights, prefix + "attention/",
                                                                       fused=fused)
            else:
                mixer = GatedDeltaNet(dims, weights, prefix + "gdn/", fused=fused)
            self.layers.append(DecoderLayer(dims, weights, prefix, mixer, _ffn(dims, weights, prefix)))
        self.final_norm = read_weight(weights, "text/final_norm", (dims.hidden,))
        self.output_head = read_weight(weights, "text/output_head", (dims.vocab_rows, dims.hidden))
        self.mtp = MtpHead(dims, weights) if dims.mtp_layers > 0 else None
        self._inv_freq = rope_inv_freq(dims.rotary_dim, dims.rope_theta)
        self._weights = weights  # the draft head is read only when speculative decoding asks for it
        self.vision_tower = build_vision_tower(dims, weights) if vision else None
        self.dflash = None
        if dflash is not None:
            # Imported here: the drafter module reads its weights with this module's read_weight.
            from ninfer.models.dflash import DFlashDrafter

            self.dflash = DFlashDrafter(dims, dflash, weights)

    # ---- target model ----

    def new_state(self) -> Qwen36State:
        return Qwen36State(layers=[layer.mixer.new_state() for layer in self.layers])

    @property
    def mixer_kinds(self) -> tuple[str, ...]:
        return tuple(ATTENTION if isinstance(layer.mixer, GatedAttention) else RECURRENT for layer in self.layers)

    def new_recurrent_state(self, layer: int) -> GdnState:
        return self.layers[layer].mixer.new_state()

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
        hidden = self.forward_segments(x, positions, [Segment(slice(0, x.shape[0]), state.layers)])
        state.next_position = int(positions.max()) + 1
        return ForwardResult(logits=self._logits(hidden, logits), hidden=hidden)

    def forward_batch(self, token_ids: np.ndarray, positions: np.ndarray, segments: Sequence[Segment], *,
                      embedding_columns: np.ndarray | None = None,
                      embedding_rows: np.ndarray | None = None) -> np.ndarray:
        """Several sequences in one traversal (the paged runner's entry point): `token_ids [N]` with MRoPE
        `positions [3, N]`, split into `segments` that each continue one sequence. Returns the hidden rows after the
        final norm `[N, hidden]`; every row is bitwise what it would be in any other batch or chunk.
        `embedding_rows [n, hidden]` replace the token embeddings at rows `embedding_columns [n]` (Vision output)."""
        return self.forward_segments(self._embed_with(token_ids, embedding_columns, embedding_rows), positions,
                                     segments)

    def _embed_with(self, token_ids: np.ndarray, columns: np.ndarray | None, rows: np.ndarray | None) -> np.ndarray:
        x = self.embed(token_ids)
        if columns is not None and len(columns):
            rows = np.asarray(rows, dtype=F32)
            if rows.shape != (len(columns), self.dims.hidden):
                raise ValueError(f"embedding rows {rows.shape} do not match {len(columns)} columns of width "
                                 f"{self.dims.hidden}")
            x = np.array(x, dtype=F32)  # embed() may return a view of the table: never write through it
            x[np.asarray(columns, dtype=np.intp)] = rows
        return x

    def forward_batch_features(self, token_ids: np.ndarray, positions: np.ndarray, segments: Sequence[Segment],
                               feature_layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """`forward_batch` (text only) that also returns every row's context features `[N, len(layers) * hidden]`:
        the residual stream after each of `feature_layers` (post-MLP, before the next input norm), concatenated in
        that order (the DFlash drafter's input, ninfer-facts §3.10)."""
        return self._run_layers(self.embed(token_ids), positions, segments, feature_layers)

    def forward_segments(self, x: np.ndarray, positions: np.ndarray, segments: Sequence[Segment]) -> np.ndarray:
        return self._run_layers(x, positions, segments, ())[0]

    def _run_layers(self, x: np.ndarray, positions: np.ndarray, segments: Sequence[Segment],
                    feature_layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        angles = mrope_angles(positions, self._inv_freq, self.dims.mrope_section)
        x = x.astype(F32, copy=False)
        captured = {}
        for index, layer in enumerate(self.layers):
            x, columns = layer(x, _layer_parts(segments, index), angles)
            for segment, recorded in zip(segments, columns):
                if recorded is not None:
                    segment.columns[index] = recorded
            if index in feature_layers:
                captured[index] = x
        features = np.concatenate([captured[i] for i in feature_layers], axis=1) if feature_layers else \
            np.zeros((x.shape[0], 0), F32)
        return rms_norm(x, self.final_norm, self.dims.rms_eps, offset=True), features

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Head rows `[N, vocab_rows]` for hidden rows after the final norm."""
        return linear(hidden, self.output_head)

    # ---- MTP head ----

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    def mtp_new_state(self) -> MtpState:
        return MtpState(cache=self._require_mtp().layer.mixer.new_state())

    def mtp_forward(self, mtp_state: MtpState, hidden: np.ndarray, next_ids: np.ndarray, *,
                    positions: np.ndarray | None = None, logits: LogitsWanted = "last") -> ForwardResult:
        """Fuse target hidden h_t `[T, hidden]` (after the final norm) with the embedding of token t+1, at h_t's
        position. `result.hidden` is the MTP output `d` (after `mtp/final_norm`), the `h` of the next draft step."""
        if hidden.shape != (len(next_ids), self.dims.hidden):
            raise ValueError(f"hidden {hidden.shape} does not match {len(next_ids)} next ids")
        positions = _positions(mtp_state.next_position, hidden.shape[0], positions)
        d = self.mtp_forward_batch(hidden, next_ids, positions, [Segment(slice(0, len(next_ids)), [mtp_state.cache])])
        mtp_state.next_position = int(positions.max()) + 1
        return ForwardResult(logits=self._logits(d, logits), hidden=d)

    def mtp_forward_batch(self, hidden: np.ndarray, next_ids: np.ndarray, positions: np.ndarray,
                          segments: Sequence[Segment], *, embedding_columns: np.ndarray | None = None,
                          embedding_rows: np.ndarray | None = None) -> np.ndarray:
        """The MTP layer over a ragged batch; each segment's `layers` is `[its MTP KV store]`. Returns `d [N, hidden]`.
        `embedding_rows` replace the next-token embeddings at rows `embedding_columns` (a Vision placeholder next
        token is embedded as its Vision output, ninfer-facts §3.8)."""
        mtp, eps = self._require_mtp(), self.dims.rms_eps
        embedded = rms_norm(self._embed_with(next_ids, embedding_columns, embedding_rows), mtp.embedding_norm, eps,
                            offset=True)
        carried = rms_norm(hidden, mtp.hidden_norm, eps, offset=True)
        u = linear(np.concatenate([embedded, carried], axis=1), mtp.input_projection)
        angles = mrope_angles(positions, self._inv_freq, self.dims.mrope_section)
        u, _ = mtp.layer(u, _layer_parts(segments, 0), angles)
        return rms_norm(u, mtp.final_norm, eps, offset=True)

    def draft_ids(self, d: np.ndarray, *, shortlist: bool) -> np.ndarray:
        """Greedy proposals for draft rows `d [N, hidden]` (MTP outputs, DFlash mask rows): argmax over the full
        head's token rows, or over the §3.9 shortlist head when `shortlist` (and the artifact has one). Neither
        drafter samples."""
        head = self.draft_head if shortlist else None
        if head is None:
            return np.argmax(self.logits(d)[:, : self.dims.vocab_ids], axis=1).astype(np.int32)
        return head.token_ids[np.argmax(linear(d, head.weight), axis=1)]

    @functools.cached_property
    def draft_head(self) -> DraftHead | None:
        """The optimized proposal head (`text/draft_head` + its token ids), when the weights carry one."""
        if not (self._weights.has("text/draft_head") and self._weights.has("text/draft_head_token_ids")):
            return None
        ids = np.asarray(self._weights.get("text/draft_head_token_ids"), dtype=np.int32)
        weight = read_weight(self._weights, "text/draft_head", (len(ids), self.dims.hidden))
        return DraftHead(weight=weight, token_ids=ids)

    def _require_mtp(self) -> MtpHead:
        if self.mtp is None:
            raise ValueError("this model has no MTP head (mtp_layers == 0)")
        return self.mtp

    def _logits(self, hidden: np.ndarray, wanted: LogitsWanted) -> np.ndarray:
        if wanted not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', not {wanted!r}")
        return self.logits(hidden if wanted == "all" else hidden[-1:])


def _layer_parts(segments: Sequence[Segment], index: int) -> list[MixerRows]:
    return [MixerRows(s.rows, s.layers[index], s.record_columns) for s in segments]


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
