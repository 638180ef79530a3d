"""Hugging Face Qwen3.5/3.6 checkpoint (and the 35B-A3B's DFlash drafter checkpoint) -> ConversionPlan
(ninfer-facts §2.8-§2.10).

Preflight reads config.json and refuses what ninfer cannot serve. The plan lists the six frontend resources, then
(custom targets only) `model/dimensions.json` and, with a drafter, `model/dflash_dimensions.json`, then the tensors in
§2.9 order: token embedding, layers, final norm, output head, draft head + its ids, MTP, Vision, DFlash. Dense
checkpoints get the 27B inventory layout and MoE checkpoints the 35B one, whatever their size. Every source tensor
must be consumed by some object: nothing is silently dropped.

Vision blocks are named `vision/blocks/{b}/...` and the merger `vision/merger/...` (§2.9 lists only the leaf names).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np

from ninfer.artifact.codec import bf16_bits_to_f32
from ninfer.artifact.formats import BF16, FP32, I32, Q4G64, Q5G64, Q6G64, W8G32
from ninfer.convert.plan import ConversionPlan, PlannedResource, PlannedTensor
from ninfer.targets.dims import (DFLASH_DIMENSIONS_RESOURCE, DIMENSIONS_RESOURCE, DFlashDims, DimensionsError,
                                 QwenDims, VisionDims, dflash_dims_from_hf_config, qwen_dims_from_hf_config)
from ninfer.targets.registry import TargetMismatchError, dflash_mismatches, lookup_target, target_for_qwen_dims

Q4, Q5, Q6, W8 = Q4G64, Q5G64, Q6G64, W8G32  # short names keep the inventory below readable

FRONTEND_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                  "preprocessor_config.json", "video_preprocessor_config.json")
DRAFT_HEAD_ROWS = 131072
# The 35B stores the routed down projections of these Text layers as Q6 instead of Q5 (§2.9).
Q6_ROUTED_DOWN_LAYERS = frozenset({34, 38, 39})
# Qwen3.8-27B shares the Qwen3.6-27B geometry; its effort-capable chat template is what tells them apart.
QWEN38_CHAT_TEMPLATE_SHA256 = "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041"
DRAFT_HEAD_RANKING = ("proxy: token ids ascending (BPE ids are merge-rank order) with every special added token "
                      "forced in; the original frequency counts are not available")

# architecture -> (model_type, is MoE); the CausalLM forms are text-only checkpoints without Vision.
_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", False),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", True),
    "Qwen3_5ForCausalLM": ("qwen3_5_text", False),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", True),
}
_VISION = "model.visual."
DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH_WEIGHTS_FOLDER = "dflash-bf16"  # where z-lab's repository keeps the drafter's BF16 safetensors


class CheckpointError(ValueError):
    """The checkpoint cannot be converted: its config, files or tensors do not fit a Qwen3.5/3.6 target."""


class DFlashCheckpointError(CheckpointError):
    """The --dflash-model checkpoint cannot be converted: not a DFlash drafter of this target, or not one ninfer
    runs (its config, files or tensors)."""


@attrs.frozen
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    v2_format: str


# ---------------------------------------------------------------------------------------------------------------
# Lazy safetensors reading. numpy has no bfloat16, so safetensors' numpy backend cannot load BF16 tensors and torch
# is no runtime dependency: the headers are parsed here and each tensor's bytes are read only when asked for.


_FLOAT_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}  # safetensors dtype -> stored little-endian words


@attrs.frozen
class _Entry:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    stop: int


READ_BLOCK_BYTES = 32 << 20


class SafetensorsCheckpoint:
    """The tensors of `model.safetensors` or of the shards `model.safetensors.index.json` lists."""

    def __init__(self, hf_dir: Path) -> None:
        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.files = sorted({hf_dir / shard for shard in weight_map.values()})
        elif (hf_dir / "model.safetensors").exists():
            weight_map, self.files = {}, [hf_dir / "model.safetensors"]
        else:
            raise CheckpointError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json")
        self.entries: dict[str, _Entry] = {}
        for path in self.files:
            if not path.exists():
                raise CheckpointError(f"{index.name} lists the shard {path.name}, which is missing")
            for name, entry in _read_header(path).items():
                if name in self.entries:
                    raise CheckpointError(f"tensor {name!r} appears in two shards")
                self.entries[name] = entry
        if weight_map:
            mismatched = sorted(set(weight_map) ^ set(self.entries)) + [
                n for n, shard in weight_map.items() if n in self.entries and self.entries[n].path.name != shard]
            if mismatched:
                raise CheckpointError(f"{index.name} does not match the shards' contents: {mismatched[:3]}")

    def shape(self, name: str) -> tuple[int, ...] | None:
        entry = self.entries.get(name)
        return entry.shape if entry else None

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 (BF16 widened exactly)."""
        return self.read_rows(name, None)

    def read_rows(self, name: str, rows: np.ndarray | None) -> np.ndarray:
        """Rows `rows` (ascending; None: all) of the tensor as float32, read run by run in blocks straight into the
        result, so the peak memory is the float32 result itself, not the file bytes plus widening temporaries."""
        entry = self.entries[name]
        dtype = np.dtype(_FLOAT_DTYPES[entry.dtype])
        row_words = math.prod(entry.shape[1:])
        rows = np.arange(entry.shape[0]) if rows is None else np.asarray(rows)
        out = np.empty((len(rows), row_words), dtype=np.float32)
        # Consecutive ids form one contiguous span of the file.
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        with open(entry.path, "rb") as f:
            for run_start, run_stop in zip(np.r_[0, breaks], np.r_[breaks, len(rows)]):
                f.seek(entry.start + int(rows[run_start]) * row_words * dtype.itemsize)
                self._read_words(f, entry, dtype, out[run_start:run_stop].reshape(-1))
        return out.reshape((len(rows),) + tuple(entry.shape[1:]))

    @staticmethod
    def _read_words(f, entry: _Entry, dtype: np.dtype, out: np.ndarray) -> None:
        block = np.empty(max(1, READ_BLOCK_BYTES // dtype.itemsize), dtype=dtype)
        for begin in range(0, out.size, block.size):
            words = block[: min(block.size, out.size - begin)]
            if f.readinto(memoryview(words).cast("B")) != words.nbytes:
                raise CheckpointError(f"{entry.path.name}: a tensor is cut short")
            out[begin : begin + words.size] = bf16_bits_to_f32(words) if entry.dtype == "BF16" else words


def _read_header(path: Path) -> dict[str, _Entry]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {name: _Entry(path, meta["dtype"], tuple(meta["shape"]), base + meta["data_offsets"][0],
                            base + meta["data_offsets"][1])
               for name, meta in header.items() if name != "__metadata__"}
    unsupported = sorted(f"{name} ({e.dtype})" for name, e in entries.items() if e.dtype not in _FLOAT_DTYPES)
    if unsupported:
        raise CheckpointError(f"{path.name}: only BF16, F16 and F32 tensors convert, not {unsupported[:3]}")
    if entries and max(e.stop for e in entries.values()) > path.stat().st_size:
        raise CheckpointError(f"{path.name} is truncated: its header describes more bytes than the file holds")
    return entries


# ---------------------------------------------------------------------------------------------------------------
# Sources: how one ninfer object is made from checkpoint tensors (§2.10 transforms). Each knows its leaves, so the
# planner can check names and shapes up front and prove that every checkpoint tensor is used.


class _Source(Protocol):
    def leaves(self) -> tuple[_Hf, ...]: ...

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray: ...


@attrs.frozen
class _Hf:
    """A checkpoint tensor as stored, with the shape the config implies for it."""

    name: str
    shape: tuple[int, ...]

    def leaves(self) -> tuple[_Hf, ...]:
        return (self,)

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray:
        return checkpoint.read(self.name)


@attrs.frozen
class _Rows:
    part: _Hf
    start: int
    stop: int

    def leaves(self) -> tuple[_Hf, ...]:
        return self.part.leaves()

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray:
        return self.part.load(checkpoint)[self.start : self.stop]


@attrs.frozen
class _HeadHalf:
    """q_proj rows are per-head interleaved [query_d | gate_d]: half 0 gathers the query rows, half 1 the gate."""

    part: _Hf
    heads: int
    head_dim: int
    half: int

    def leaves(self) -> tuple[_Hf, ...]:
        return self.part.leaves()

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray:
        w = self.part.load(checkpoint).reshape(self.heads, 2 * self.head_dim, -1)
        half = w[:, self.half * self.head_dim : (self.half + 1) * self.head_dim]
        return half.reshape(self.heads * self.head_dim, -1)


@attrs.frozen
class _Concat:
    """Row concatenation (fused objects)."""

    parts: tuple[_Source, ...]

    def leaves(self) -> tuple[_Hf, ...]:
        return tuple(leaf for part in self.parts for leaf in part.leaves())

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray:
        return np.concatenate([part.load(checkpoint) for part in self.parts])


@attrs.frozen
class _Reshape:
    """Fused expert banks `[E, R, K]` -> `[E*R, K]` (expert-major) and the Vision patch kernel -> `[hidden, row]`."""

    part: _Hf
    shape: tuple[int, ...]

    def leaves(self) -> tuple[_Hf, ...]:
        return self.part.leaves()

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray:
        return self.part.load(checkpoint).reshape(self.shape)


@attrs.frozen
class _ConvTaps:
    """Depthwise conv weight `[C, 1, K]` -> tap-major `[K, C]`."""

    part: _Hf

    def leaves(self) -> tuple[_Hf, ...]:
        return self.part.leaves()

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray:
        return np.ascontiguousarray(self.part.load(checkpoint)[:, 0, :].T)


@attrs.frozen
class _GatherRows:
    part: _Hf
    ids: np.ndarray = attrs.field(eq=False)

    def leaves(self) -> tuple[_Hf, ...]:
        return self.part.leaves()

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray:
        # Only the gathered rows are read: the draft head is a shortlist of a huge output head.
        return checkpoint.read_rows(self.part.name, self.ids)


@attrs.frozen
class _Constant:
    value: np.ndarray = attrs.field(eq=False)

    def leaves(self) -> tuple[_Hf, ...]:
        return ()

    def load(self, checkpoint: SafetensorsCheckpoint) -> np.ndarray:
        return self.value


# ---------------------------------------------------------------------------------------------------------------
# The inventory (§2.9): names, shapes, v2 formats and sources, in artifact order.


@attrs.frozen
class _HfNames:
    text: str  # "model.language_model." (multimodal checkpoints) or "model." (text-only)
    tied: bool  # tie_word_embeddings: the head is the embedding when no lm_head.weight is stored
    keys: frozenset[str] | None  # None: describe the canonical layout, without a checkpoint at hand

    def head(self, embedding: _Hf) -> _Hf:
        if self.tied and (self.keys is not None and "lm_head.weight" not in self.keys):
            return embedding
        return _Hf("lm_head.weight", embedding.shape)

    def fused_experts(self, mlp: str) -> bool:
        # Real checkpoints store 3-D banks; transformers' save_pretrained writes one linear per expert.
        return self.keys is None or f"{mlp}experts.gate_up_proj" in self.keys


class _Inventory:
    def __init__(self) -> None:
        self.items: list[tuple[TensorSpec, _Source]] = []

    def add(self, name: str, shape: tuple[int, ...], v2_format: str, source: _Source) -> None:
        self.items.append((TensorSpec(name, shape, v2_format), source))

    def vector(self, name: str, hf_name: str, size: int) -> None:
        """Norm weights and biases: stored as they are, BF16."""
        self.add(name, (size,), BF16, _Hf(hf_name, (size,)))

    def matrix(self, name: str, hf_name: str, shape: tuple[int, int], v2_format: str) -> None:
        self.add(name, shape, v2_format, _Hf(hf_name, shape))


def _attention(inv: _Inventory, d: QwenDims, p: str, s: str, *, fused: bool) -> None:
    h, qw, kvw = d.hidden, d.q_width, d.kv_width
    q_proj = _Hf(s + "q_proj.weight", (2 * qw, h))
    query, gate = (_HeadHalf(q_proj, d.attn_heads, d.head_dim, half) for half in (0, 1))
    key, value = _Hf(s + "k_proj.weight", (kvw, h)), _Hf(s + "v_proj.weight", (kvw, h))
    if fused:
        inv.add(p + "query_key_gate_value", (2 * qw + 2 * kvw, h), W8, _Concat((query, key, gate, value)))
    else:
        inv.add(p + "query_key", (qw + kvw, h), Q4, _Concat((query, key)))
        inv.add(p + "gate_value", (qw + kvw, h), Q5, _Concat((gate, value)))
    inv.vector(p + "query_norm", s + "q_norm.weight", d.head_dim)
    inv.vector(p + "key_norm", s + "k_norm.weight", d.head_dim)
    inv.matrix(p + "output", s + "o_proj.weight", (h, qw), W8 if fused else Q5)


def _gdn(inv: _Inventory, d: QwenDims, p: str, s: str, *, fused: bool) -> None:
    h, hv, qkw, vw, channels = d.hidden, d.gdn_v_heads, d.gdn_qk_width, d.gdn_v_width, d.gdn_conv_channels
    qkv, z = _Hf(s + "in_proj_qkv.weight", (channels, h)), _Hf(s + "in_proj_z.weight", (vw, h))
    a, b = _Hf(s + "in_proj_a.weight", (hv, h)), _Hf(s + "in_proj_b.weight", (hv, h))
    inv.add(p + "a_log", (hv,), FP32, _Hf(s + "A_log", (hv,)))
    inv.add(p + "dt_bias", (hv,), FP32, _Hf(s + "dt_bias", (hv,)))
    inv.add(p + "convolution", (d.conv_kernel, channels), BF16,
            _ConvTaps(_Hf(s + "conv1d.weight", (channels, 1, d.conv_kernel))))
    if fused:
        inv.add(p + "a_b_projection", (2 * hv, h), BF16, _Concat((a, b)))
        inv.add(p + "query_key_value_z", (channels + vw, h), W8, _Concat((qkv, z)))
    else:
        inv.add(p + "a_projection", (hv, h), BF16, a)
        inv.add(p + "b_projection", (hv, h), BF16, b)
        inv.add(p + "query_key", (2 * qkw, h), Q4, _Rows(qkv, 0, 2 * qkw))
        inv.add(p + "value_z", (2 * vw, h), Q5, _Concat((_Rows(qkv, 2 * qkw, channels), z)))
    inv.vector(p + "norm", s + "norm.weight", d.gdn_v_dim)
    inv.matrix(p + "output", s + "out_proj.weight", (h, vw), W8 if fused else Q5)


def _dense_mlp(inv: _Inventory, d: QwenDims | DFlashDims, p: str, s: str, formats: tuple[str, str]) -> None:
    h, inter = d.hidden, d.intermediate
    inv.add(p + "gate_up", (2 * inter, h), formats[0],
            _Concat((_Hf(s + "gate_proj.weight", (inter, h)), _Hf(s + "up_proj.weight", (inter, h)))))
    inv.matrix(p + "down", s + "down_proj.weight", (h, inter), formats[1])


def _moe(inv: _Inventory, d: QwenDims, hf: _HfNames, p: str, s: str, formats: tuple[str, str]) -> None:
    h, e, inter, shared = d.hidden, d.moe_experts, d.moe_intermediate, d.shared_intermediate
    inv.add(p + "router_shared_gate", (e + 1, h), BF16,
            _Concat((_Hf(s + "gate.weight", (e, h)), _Hf(s + "shared_expert_gate.weight", (1, h)))))
    if hf.fused_experts(s):
        gate_up: _Source = _Reshape(_Hf(s + "experts.gate_up_proj", (e, 2 * inter, h)), (e * 2 * inter, h))
        down: _Source = _Reshape(_Hf(s + "experts.down_proj", (e, h, inter)), (e * h, inter))
    else:
        x = s + "experts."
        gate_up = _Concat(tuple(_Hf(f"{x}{i}.{kind}_proj.weight", (inter, h)) for i in range(e)
                                for kind in ("gate", "up")))
        down = _Concat(tuple(_Hf(f"{x}{i}.down_proj.weight", (h, inter)) for i in range(e)))
    inv.add(p + "routed_gate_up", (e * 2 * inter, h), formats[0], gate_up)
    inv.add(p + "routed_down", (e * h, inter), formats[1], down)
    x = s + "shared_expert."
    inv.add(p + "shared_gate_up", (2 * shared, h), W8,
            _Concat((_Hf(x + "gate_proj.weight", (shared, h)), _Hf(x + "up_proj.weight", (shared, h)))))
    inv.matrix(p + "shared_down", x + "down_proj.weight", (h, shared), W8)


def _mtp(inv: _Inventory, d: QwenDims, hf: _HfNames) -> None:
    h = d.hidden
    inv.matrix("mtp/input_projection", "mtp.fc.weight", (h, 2 * h), W8)
    inv.vector("mtp/embedding_norm", "mtp.pre_fc_norm_embedding.weight", h)
    inv.vector("mtp/hidden_norm", "mtp.pre_fc_norm_hidden.weight", h)
    inv.vector("mtp/layer/input_norm", "mtp.layers.0.input_layernorm.weight", h)
    _attention(inv, d, "mtp/layer/attention/", "mtp.layers.0.self_attn.", fused=True)
    inv.vector("mtp/layer/post_attention_norm", "mtp.layers.0.post_attention_layernorm.weight", h)
    if d.is_moe:
        _moe(inv, d, hf, "mtp/layer/moe/", "mtp.layers.0.mlp.", (W8, W8))
    else:
        _dense_mlp(inv, d, "mtp/layer/mlp/", "mtp.layers.0.mlp.", (W8, W8))
    inv.vector("mtp/final_norm", "mtp.norm.weight", h)


def _vision(inv: _Inventory, v: VisionDims) -> None:
    h, s = v.hidden, _VISION
    kernel = _Hf(s + "patch_embed.proj.weight", (h, 3, v.temporal_patch, v.patch, v.patch))
    inv.add("vision/patch_embedding", (h, v.patch_row), Q6, _Reshape(kernel, (h, v.patch_row)))
    inv.vector("vision/patch_embedding_bias", s + "patch_embed.proj.bias", h)
    inv.matrix("vision/position_embedding", s + "pos_embed.weight", (v.position_table, h), BF16)
    for b in range(v.depth):
        p, x = f"vision/blocks/{b}/", f"{s}blocks.{b}."
        inv.matrix(p + "attention/qkv", x + "attn.qkv.weight", (3 * h, h), Q4)
        inv.vector(p + "attention/qkv_bias", x + "attn.qkv.bias", 3 * h)
        inv.matrix(p + "attention/output", x + "attn.proj.weight", (h, h), Q5)
        inv.vector(p + "attention/output_bias", x + "attn.proj.bias", h)
        inv.matrix(p + "mlp/fc1", x + "mlp.linear_fc1.weight", (v.intermediate, h), Q4)
        inv.vector(p + "mlp/fc1_bias", x + "mlp.linear_fc1.bias", v.intermediate)
        inv.matrix(p + "mlp/fc2", x + "mlp.linear_fc2.weight", (h, v.intermediate), Q5)
        inv.vector(p + "mlp/fc2_bias", x + "mlp.linear_fc2.bias", h)
        for norm in ("norm1", "norm2"):
            inv.vector(f"{p}{norm}/weight", f"{x}{norm}.weight", h)
            inv.vector(f"{p}{norm}/bias", f"{x}{norm}.bias", h)
    m, x = v.merged_hidden, s + "merger."
    inv.matrix("vision/merger/fc1", x + "linear_fc1.weight", (m, m), W8)
    inv.vector("vision/merger/fc1_bias", x + "linear_fc1.bias", m)
    inv.matrix("vision/merger/fc2", x + "linear_fc2.weight", (v.out_hidden, m), W8)
    inv.vector("vision/merger/fc2_bias", x + "linear_fc2.bias", v.out_hidden)
    inv.vector("vision/merger/norm/weight", x + "norm.weight", h)
    inv.vector("vision/merger/norm/bias", x + "norm.bias", h)


def _dflash(d: DFlashDims) -> list[tuple[TensorSpec, _Source]]:
    """The 8 objects per drafter layer and 3 shared ones (§2.9), from the drafter checkpoint's names: every matrix
    W8 under ninfer-v2 (BF16 under bf16, like MTP), q|k|v and gate|up fused by rows."""
    inv, h, qw, kvw = _Inventory(), d.hidden, d.q_width, d.kv_width
    inv.matrix("dflash/feature_projection", "fc.weight", (h, d.feature_width), W8)
    inv.vector("dflash/context_norm", "hidden_norm.weight", h)
    for index in range(d.layers):
        p, s = f"dflash/layers/{index}/", f"layers.{index}."
        inv.vector(p + "input_norm", s + "input_layernorm.weight", h)
        inv.add(p + "attention/query_key_value", (qw + 2 * kvw, h), W8, _Concat((
            _Hf(s + "self_attn.q_proj.weight", (qw, h)), _Hf(s + "self_attn.k_proj.weight", (kvw, h)),
            _Hf(s + "self_attn.v_proj.weight", (kvw, h)))))
        inv.vector(p + "attention/query_norm", s + "self_attn.q_norm.weight", d.head_dim)
        inv.vector(p + "attention/key_norm", s + "self_attn.k_norm.weight", d.head_dim)
        inv.matrix(p + "attention/output", s + "self_attn.o_proj.weight", (h, qw), W8)
        inv.vector(p + "post_attention_norm", s + "post_attention_layernorm.weight", h)
        _dense_mlp(inv, d, p + "mlp/", s + "mlp.", (W8, W8))
    inv.vector("dflash/final_norm", "norm.weight", h)
    return inv.items


def _inventory(d: QwenDims, hf: _HfNames, draft_ids: np.ndarray) -> list[tuple[TensorSpec, _Source]]:
    inv, dense = _Inventory(), not d.is_moe
    h, t = d.hidden, hf.text
    embedding = _Hf(t + "embed_tokens.weight", (d.vocab_rows, h))
    head = hf.head(embedding)
    inv.add("text/token_embedding", embedding.shape, Q6 if dense else W8, embedding)
    for index, kind in enumerate(d.layer_types):
        p, s = f"text/layers/{index}/", f"{t}layers.{index}."
        inv.vector(p + "input_norm", s + "input_layernorm.weight", h)
        if kind == "full_attention":
            _attention(inv, d, p + "attention/", s + "self_attn.", fused=not dense)
        else:
            _gdn(inv, d, p + "gdn/", s + "linear_attn.", fused=not dense)
        inv.vector(p + "post_attention_norm", s + "post_attention_layernorm.weight", h)
        if dense:
            _dense_mlp(inv, d, p + "mlp/", s + "mlp.", (Q4, Q5))
        else:
            _moe(inv, d, hf, p + "moe/", s + "mlp.", (Q4, Q6 if index in Q6_ROUTED_DOWN_LAYERS else Q5))
    inv.vector("text/final_norm", t + "norm.weight", h)
    inv.add("text/output_head", head.shape, Q6, head)
    inv.add("text/draft_head", (len(draft_ids), h), Q4, _GatherRows(head, draft_ids))
    inv.add("text/draft_head_token_ids", (len(draft_ids),), I32, _Constant(draft_ids))
    if d.mtp_layers:
        _mtp(inv, d, hf)
    if d.vision is not None:
        _vision(inv, d.vision)
    return inv.items


def plan_qwen_tensor_specs(dims: QwenDims, dflash: DFlashDims | None = None) -> list[TensorSpec]:
    """The tensor objects (name, shape, v2 format) of a checkpoint with these dimensions (and a DFlash drafter of
    these), in artifact order."""
    # Without a tokenizer the draft ids are plain ascending ids; only their count matters here.
    draft_ids = np.arange(min(DRAFT_HEAD_ROWS, dims.vocab_ids), dtype=np.int32)
    canonical = _HfNames(text="model.language_model.", tied=False, keys=None)
    items = _inventory(dims, canonical, draft_ids) + (_dflash(dflash) if dflash is not None else [])
    return [spec for spec, _ in items]


# ---------------------------------------------------------------------------------------------------------------
# Preflight, frontend resources, draft-head ids, and the plan.


def _preflight(config: dict[str, Any]) -> tuple[str, QwenDims]:
    """(architecture, dims) of a config ninfer can serve; a CheckpointError naming the first problem otherwise."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in _ARCHITECTURES:
        raise CheckpointError(f"config.json: architectures {architectures!r} is not one of {sorted(_ARCHITECTURES)}")
    architecture = architectures[0]
    model_type, moe = _ARCHITECTURES[architecture]
    if config.get("model_type") != model_type:
        raise CheckpointError(f"config.json: {architecture} needs model_type {model_type!r}, "
                              f"not {config.get('model_type')!r}")
    try:
        dims = qwen_dims_from_hf_config(config)
    except DimensionsError as exc:
        raise CheckpointError(str(exc)) from exc
    text = config.get("text_config", config)
    rope = text.get("rope_parameters") or {}

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"config.json: {what}")

    require(dims.is_moe == moe, f"{architecture} {'needs' if moe else 'must not have'} num_experts")
    expected = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(dims.layers))
    require(dims.layer_types == expected, "layer_types must put full attention exactly on layers (i+1) % 4 == 0")
    require(text.get("num_hidden_layers", dims.layers) == dims.layers, "num_hidden_layers != len(layer_types)")
    require(text.get("attn_output_gate", True) is True, "attn_output_gate must be true (gated attention)")
    require(text.get("mamba_ssm_dtype", "float32") == "float32", "mamba_ssm_dtype must be float32")
    require(text.get("hidden_act", "silu") == "silu", "hidden_act must be silu")
    require(not text.get("attention_bias", False), "attention_bias must be false")
    require(not text.get("mtp_use_dedicated_embeddings", False), "mtp_use_dedicated_embeddings must be false")
    require(not text.get("mlp_only_layers"), "mlp_only_layers must be empty")
    require(rope.get("mrope_interleaved", True) is True, "rope_parameters.mrope_interleaved must be true")
    require(rope.get("rope_type", "default") == "default", "rope_parameters.rope_type must be default (no YaRN)")
    require(dims.rotary_dim % 2 == 0 and sum(dims.mrope_section) == dims.rotary_dim // 2,
            "mrope_section must cover the rotary pairs (head_dim * partial_rotary_factor / 2)")
    require(dims.attn_heads % dims.kv_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads")
    require(dims.gdn_v_heads % dims.gdn_qk_heads == 0,
            "linear_num_value_heads must be a multiple of linear_num_key_heads")
    require(dims.mtp_layers in (0, 1), "mtp_num_hidden_layers must be 0 or 1")
    if moe:
        require(0 < dims.moe_top_k <= dims.moe_experts and dims.shared_intermediate > 0,
                "MoE needs 0 < num_experts_per_tok <= num_experts and a shared expert")
    vision = config.get("vision_config")
    require((vision is not None) == architecture.endswith("ForConditionalGeneration"),
            f"{architecture} {'needs' if vision is None else 'must not have'} a vision_config")
    if vision is not None:
        require(vision.get("hidden_act", "gelu_pytorch_tanh") == "gelu_pytorch_tanh",
                "vision_config.hidden_act must be gelu_pytorch_tanh")
        require(not vision.get("deepstack_visual_indexes"), "vision_config.deepstack_visual_indexes must be empty")
        require(vision.get("in_channels", 3) == 3, "vision_config.in_channels must be 3")
    return architecture, dims


def _dflash_files(dflash_dir: Path) -> tuple[Path, Path]:
    """(config.json, the folder of the safetensors) of a drafter directory: the directory itself, or z-lab's
    repository layout with the weights (and possibly the config) in its `dflash-bf16/` folder."""
    if not dflash_dir.is_dir():
        raise DFlashCheckpointError(f"--dflash-model {dflash_dir}: not a directory")
    folders = [dflash_dir, dflash_dir / DFLASH_WEIGHTS_FOLDER]
    configs = [folder / "config.json" for folder in folders if (folder / "config.json").is_file()]
    weights = [folder for folder in folders if (folder / "model.safetensors").is_file()
               or (folder / "model.safetensors.index.json").is_file()]
    if not configs or not weights:
        raise DFlashCheckpointError(f"--dflash-model {dflash_dir}: needs config.json and model.safetensors (in the "
                                    f"directory or its {DFLASH_WEIGHTS_FOLDER}/ folder)")
    return configs[0], weights[0]


def _dflash_preflight(config: dict[str, Any], target: QwenDims, model_id: str) -> DFlashDims:
    """The drafter's dimensions when it is a DFlash drafter ninfer runs for `target` (served as `model_id`): the
    registered drafter's exact values for a published target, a consistent drafter of any size for a custom one."""
    architectures = config.get("architectures")
    if architectures != [DFLASH_ARCHITECTURE]:
        raise DFlashCheckpointError(f"DFlash config.json: architectures {architectures!r} is not "
                                    f"[{DFLASH_ARCHITECTURE!r}] (the z-lab DFlash drafter)")
    try:
        dims = dflash_dims_from_hf_config(config)
    except DimensionsError as exc:
        raise DFlashCheckpointError(f"DFlash {exc}") from exc
    problems = dims.problems_with(target) + dflash_mismatches(model_id, dims)
    if config.get("attention_bias", False):
        problems.append("attention_bias must be false")
    if config.get("hidden_act", "silu") != "silu":
        problems.append("hidden_act must be silu")
    if config.get("is_causal", False):
        problems.append("is_causal must be false (every DFlash layer attends non-causally)")
    if config.get("num_target_layers", target.layers) != target.layers:
        problems.append(f"num_target_layers {config['num_target_layers']} differs from the target's {target.layers}")
    if config.get("vocab_size", target.vocab_rows) != target.vocab_rows:
        problems.append(f"vocab_size {config['vocab_size']} differs from the target's {target.vocab_rows} rows "
                        f"(the drafter reads the target's embeddings and head)")
    if problems:
        raise DFlashCheckpointError("DFlash config.json does not fit the target: " + "; ".join(problems))
    return dims


def _plan_dflash(dflash_dir: Path, target: QwenDims,
                 model_id: str) -> tuple[DFlashDims, tuple[PlannedTensor, ...], dict[str, Any]]:
    """The drafter's dimensions, its 8 * layers + 3 planned tensors and the report's description of its source."""
    if not target.is_moe:
        raise DFlashCheckpointError("--dflash-model: DFlash drafters exist for the 35B-A3B (MoE) target only, and "
                                    "this checkpoint is dense")
    config_path, weights_dir = _dflash_files(Path(dflash_dir))
    config_bytes = config_path.read_bytes()
    dims = _dflash_preflight(json.loads(config_bytes), target, model_id)
    try:
        checkpoint = SafetensorsCheckpoint(weights_dir)
        items = _dflash(dims)
        _check_sources(items, checkpoint)
    except CheckpointError as exc:
        raise DFlashCheckpointError(f"--dflash-model {dflash_dir}: {exc}") from exc
    return dims, _planned(items, checkpoint), _source_record(Path(dflash_dir), DFLASH_ARCHITECTURE, config_bytes,
                                                            checkpoint)


def _planned(items: list[tuple[TensorSpec, _Source]], checkpoint: SafetensorsCheckpoint) -> tuple[PlannedTensor, ...]:
    return tuple(PlannedTensor(spec.name, spec.shape, spec.v2_format, _producer(spec, source, checkpoint))
                 for spec, source in items)


def _source_record(path: Path, architecture: str, config_bytes: bytes,
                   checkpoint: SafetensorsCheckpoint) -> dict[str, Any]:
    """What the conversion report says about one source checkpoint."""
    return {
        "kind": "huggingface-safetensors",
        "path": str(path.resolve()),
        "architecture": architecture,
        "config_sha256": hashlib.sha256(config_bytes).hexdigest(),
        "shards": len(checkpoint.files),
        "source_bytes": sum(f.stat().st_size for f in checkpoint.files),
        "tensors": len(checkpoint.entries),
    }


def _frontend_resources(hf_dir: Path) -> tuple[PlannedResource, ...]:
    def read(name: str) -> bytes:
        path = hf_dir / name
        if not path.exists():
            raise CheckpointError(f"{hf_dir}: missing frontend file {name}")
        return path.read_bytes()

    tokenizer_config = read("tokenizer_config.json")
    resources = []
    for name in FRONTEND_FILES:
        if name == "tokenizer_config.json":
            data = tokenizer_config
        elif name == "chat_template.jinja" and not (hf_dir / name).exists():
            template = json.loads(tokenizer_config).get("chat_template")
            if not isinstance(template, str):
                raise CheckpointError(f"{hf_dir}: no chat_template.jinja and no chat_template string in "
                                      "tokenizer_config.json")
            data = template.encode()
        else:
            data = read(name)
        resources.append(PlannedResource(f"frontend/{name}", data))
    return tuple(resources)


def draft_head_ids(tokenizer_json: dict[str, Any], tokenizer_config: dict[str, Any], vocab_ids: int) -> np.ndarray:
    """The draft-head shortlist, ascending: every special added token plus the lowest other ids."""
    forced = {int(i) for i, entry in tokenizer_config.get("added_tokens_decoder", {}).items() if entry.get("special")}
    forced |= {int(entry["id"]) for entry in tokenizer_json.get("added_tokens", []) if entry.get("special")}
    forced_ids = np.array(sorted(i for i in forced if i < vocab_ids), dtype=np.int64)
    size = min(DRAFT_HEAD_ROWS, vocab_ids)
    if len(forced_ids) > size:
        raise CheckpointError(f"{len(forced_ids)} special tokens do not fit a {size}-row draft head")
    others = np.ones(vocab_ids, dtype=bool)
    others[forced_ids] = False
    chosen = np.concatenate([np.flatnonzero(others)[: size - len(forced_ids)], forced_ids])
    return np.sort(chosen).astype(np.int32)


def _choose_model_id(dims: QwenDims, model_id: str | None, chat_template: bytes) -> str:
    if model_id is not None:
        target = lookup_target(model_id)
        if target.family != "qwen3_6":
            raise TargetMismatchError(f"model_id {model_id!r} is a {target.family} target, not a Qwen3.5/3.6 one")
        if target.dims is not None and target.dims != dims:
            raise TargetMismatchError(f"model_id {model_id!r} refuses checkpoints whose config does not match the "
                                      "target's registered dimensions")
        return model_id
    chosen = target_for_qwen_dims(dims)
    if chosen == "qwen3.6-27b" and hashlib.sha256(chat_template).hexdigest() == QWEN38_CHAT_TEMPLATE_SHA256:
        return "qwen3.8-27b"
    return chosen


def _check_sources(items: list[tuple[TensorSpec, _Source]], checkpoint: SafetensorsCheckpoint) -> None:
    problems, used = [], set()
    for _, source in items:
        for leaf in source.leaves():
            used.add(leaf.name)
            actual = checkpoint.shape(leaf.name)
            if actual is None:
                problems.append(f"missing tensor {leaf.name}")
            elif actual != leaf.shape:
                problems.append(f"tensor {leaf.name} has shape {list(actual)}, the config implies {list(leaf.shape)}")
    leftover = sorted(set(checkpoint.entries) - used)
    problems += [f"unknown tensor {name} (no ninfer object uses it)" for name in leftover]
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError("checkpoint tensors do not fit the config: " + "; ".join(problems[:10]) + more)


def _producer(spec: TensorSpec, source: _Source, checkpoint: SafetensorsCheckpoint):
    def produce() -> np.ndarray:
        array = source.load(checkpoint)
        if array.shape != spec.shape:
            raise CheckpointError(f"{spec.name}: produced shape {array.shape}, planned {spec.shape}")
        return array

    return produce


def plan_qwen_checkpoint(hf_dir: Path, *, model_id: str | None = None,
                         dflash_dir: Path | None = None) -> ConversionPlan:
    """Plan the conversion of a Hugging Face Qwen3.5/3.6 safetensors checkpoint directory, with the DFlash drafter
    checkpoint in `dflash_dir` appended (35B-A3B-shaped MoE targets only)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").exists():
        raise CheckpointError(f"{hf_dir}: no config.json")
    config_bytes = (hf_dir / "config.json").read_bytes()
    config = json.loads(config_bytes)
    architecture, dims = _preflight(config)
    resources = _frontend_resources(hf_dir)
    chosen = _choose_model_id(dims, model_id, resources[FRONTEND_FILES.index("chat_template.jinja")].data)
    custom = lookup_target(chosen).dims is None
    if custom:
        resources += (PlannedResource(DIMENSIONS_RESOURCE, dims.to_json().encode()),)
    dflash = _plan_dflash(dflash_dir, dims, chosen) if dflash_dir is not None else None
    if dflash is not None and custom:
        resources += (PlannedResource(DFLASH_DIMENSIONS_RESOURCE, dflash[0].to_json().encode()),)

    checkpoint = SafetensorsCheckpoint(hf_dir)
    tokenizer_json = json.loads(resources[FRONTEND_FILES.index("tokenizer.json")].data)
    tokenizer_config = json.loads(resources[FRONTEND_FILES.index("tokenizer_config.json")].data)
    text = config.get("text_config", config)
    names = _HfNames(
        text="model.language_model." if "model.language_model.embed_tokens.weight" in checkpoint.entries
        else "model.",
        tied=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        keys=frozenset(checkpoint.entries),
    )
    items = _inventory(dims, names, draft_head_ids(tokenizer_json, tokenizer_config, dims.vocab_ids))
    _check_sources(items, checkpoint)
    tensors = _planned(items, checkpoint)
    source = {**_source_record(hf_dir, architecture, config_bytes, checkpoint),
              "draft_head_ranking": DRAFT_HEAD_RANKING}
    if dflash is not None:
        _, dflash_tensors, dflash_source = dflash
        tensors += dflash_tensors
        source["dflash"] = dflash_source
        source["source_bytes"] += dflash_source["source_bytes"]  # everything read, for the report's throughput
    return ConversionPlan(model_id=chosen, resources=resources, tensors=tensors, source=source,
                          target_key=chosen.replace(".", "_").replace("-", "_"))
