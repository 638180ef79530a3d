"""Model dimensions: the numbers every layer below reads its shapes from.

The two published Qwen3.6 targets have fixed dimensions (ninfer-facts §3.1). Test and demo artifacts carry theirs in
the resource `model/dimensions.json`, so a tiny model travels exactly the same code path as a real one. The DFlash
drafter of the 35B-A3B target (ninfer-facts §3.10) has its own record, carried by custom artifacts in
`model/dflash_dimensions.json`.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

DIMENSIONS_RESOURCE = "model/dimensions.json"
DFLASH_DIMENSIONS_RESOURCE = "model/dflash_dimensions.json"
SLIDING_ATTENTION, FULL_ATTENTION = "sliding_attention", "full_attention"  # DFlash layer types


class DimensionsError(ValueError):
    """A dimensions record (or the HF config it came from) is missing a field or is inconsistent."""


@attrs.frozen(kw_only=True)
class VisionDims:
    depth: int
    hidden: int
    intermediate: int
    heads: int
    patch: int
    temporal_patch: int
    spatial_merge: int
    position_table: int  # number of rows of the learned position table (48*48 for the real models)
    out_hidden: int

    @property
    def patch_row(self) -> int:
        return 3 * self.temporal_patch * self.patch * self.patch

    @property
    def merged_hidden(self) -> int:
        return self.hidden * self.spatial_merge * self.spatial_merge


class _DimsRecord:
    """What both families' records share: attention widths and the `model/dimensions.json` encoding."""

    family: str
    attn_heads: int
    kv_heads: int
    head_dim: int

    @property
    def q_width(self) -> int:
        return self.attn_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def to_json(self) -> str:
        return json.dumps({"family": self.family, **attrs.asdict(self)}, sort_keys=True, separators=(",", ":"))


@attrs.frozen(kw_only=True)
class QwenDims(_DimsRecord):
    """Hybrid Gated DeltaNet + gated attention (Qwen3.5/3.6/3.8); dense SwiGLU or sparse MoE FFN."""

    hidden: int
    layer_types: tuple[str, ...]  # "full_attention" | "linear_attention", one per layer
    vocab_rows: int  # rows of the embedding and the head (248320 for the real models)
    vocab_ids: int  # ids the tokenizer can emit (248077): sampling and argmax run over rows [0, vocab_ids)
    # gated full attention
    attn_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    mrope_section: tuple[int, int, int]
    # Gated DeltaNet
    gdn_qk_heads: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    conv_kernel: int
    rms_eps: float
    # FFN: dense when moe_experts == 0
    intermediate: int = 0
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    mtp_layers: int = 1
    vision: VisionDims | None = None

    family = "qwen3_6"

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def gdn_qk_width(self) -> int:
        return self.gdn_qk_heads * self.gdn_k_dim

    @property
    def gdn_v_width(self) -> int:
        return self.gdn_v_heads * self.gdn_v_dim

    @property
    def gdn_conv_channels(self) -> int:
        return 2 * self.gdn_qk_width + self.gdn_v_width

    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]


@attrs.frozen(kw_only=True)
class LlamaDims(_DimsRecord):
    """Plain llama (the bundled SmolLM2 demo model): RMSNorm, rotate-half RoPE, GQA, SwiGLU."""

    hidden: int
    layers: int
    vocab_rows: int
    vocab_ids: int
    attn_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool

    family = "llama"


ModelDims = QwenDims | LlamaDims


@attrs.frozen(kw_only=True)
class DFlashDims:
    """The DFlash block drafter (ninfer-facts §3.10): non-causal attention layers over a context projected from the
    residuals of `target_layer_ids`, reading the target's embedding (the mask row included) and output head."""

    hidden: int  # equals the target's hidden size: it reads the target's embeddings and head
    intermediate: int
    layer_types: tuple[str, ...]  # "sliding_attention" (cyclic `sliding_window`-slot cache) | "full_attention"
    attn_heads: int
    kv_heads: int
    head_dim: int  # RoPE rotates every head dim (split-half pairs)
    block_size: int  # rows of the largest proposal block: the anchor and at most block_size - 1 masks
    mask_token_id: int  # the embedding row of the mask columns
    target_layer_ids: tuple[int, ...]  # target layers whose post-MLP residuals form the context features
    sliding_window: int  # sliding layers see keys with |p_key - p_query| < sliding_window
    rope_theta: float
    rms_eps: float

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def q_width(self) -> int:
        return self.attn_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def feature_width(self) -> int:
        """Width of one position's context features: the concatenated residuals of every target layer listed."""
        return len(self.target_layer_ids) * self.hidden

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size - 1

    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION]

    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True, separators=(",", ":"))

    def problems_with(self, target: QwenDims) -> list[str]:
        """Why this drafter cannot serve `target` (empty when it can): DFlash drafts for the MoE (35B-A3B-shaped)
        target only, reads its embeddings and head, and takes its context from existing target layers."""
        problems = []
        if not target.is_moe:
            problems.append("DFlash drafts for the 35B-A3B (MoE) target only; this target is dense")
        if self.hidden != target.hidden:
            problems.append(f"hidden_size {self.hidden} differs from the target's {target.hidden}")
        ids = self.target_layer_ids
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= target.layers:
            problems.append(f"target_layer_ids {list(ids)} must be distinct ascending layers of the target's "
                            f"0..{target.layers - 1}")
        if not 0 <= self.mask_token_id < target.vocab_rows:
            problems.append(f"mask_token_id {self.mask_token_id} is not an embedding row (0..{target.vocab_rows - 1})")
        if not self.layer_types:
            problems.append("the drafter has no layers")
        if self.attn_heads <= 0 or self.kv_heads <= 0 or self.attn_heads % self.kv_heads:
            problems.append(f"num_attention_heads {self.attn_heads} must be a positive multiple of "
                            f"num_key_value_heads {self.kv_heads}")
        if self.head_dim <= 0 or self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be positive and even (split-half RoPE)")
        if self.intermediate <= 0:
            problems.append(f"intermediate_size {self.intermediate} must be positive")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} leaves no room for a proposal (needs at least 2)")
        if self.sliding_window < 1:
            problems.append(f"sliding_window {self.sliding_window} must be positive")
        return problems


def dflash_dims_from_json(text: str | bytes) -> DFlashDims:
    """Parse a `model/dflash_dimensions.json` resource; every field is required."""
    try:
        raw: dict[str, Any] = json.loads(text)
        raw["layer_types"] = tuple(raw["layer_types"])
        raw["target_layer_ids"] = tuple(raw["target_layer_ids"])
        dims = DFlashDims(**raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DimensionsError(f"{DFLASH_DIMENSIONS_RESOURCE}: malformed DFlash dimensions record ({exc})") from exc
    return _known_layer_types(dims, DFLASH_DIMENSIONS_RESOURCE)


def _known_layer_types(dims: DFlashDims, source: str) -> DFlashDims:
    bad = sorted({str(t) for t in dims.layer_types} - {SLIDING_ATTENTION, FULL_ATTENTION})
    if bad:
        raise DimensionsError(f"{source}: unknown DFlash layer types {bad}")
    return dims


def dims_from_json(text: str | bytes) -> ModelDims:
    """Parse a `model/dimensions.json` resource; every field is required and typed."""
    try:
        raw: dict[str, Any] = json.loads(text)
        family = raw.pop("family")
        if family == "qwen3_6":
            vision = raw.pop("vision")
            raw["layer_types"] = tuple(raw["layer_types"])
            raw["mrope_section"] = tuple(raw["mrope_section"])
            return QwenDims(vision=VisionDims(**vision) if vision is not None else None, **raw)
        if family == "llama":
            return LlamaDims(**raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DimensionsError(f"{DIMENSIONS_RESOURCE}: malformed dimensions record ({exc})") from exc
    raise DimensionsError(f"{DIMENSIONS_RESOURCE}: unknown model family {family!r}")


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise DimensionsError(f"config.json: missing {key!r}")
    return cfg[key]


def qwen_dims_from_hf_config(config: dict[str, Any], vocab_ids: int = 248077) -> QwenDims:
    """Dimensions of a Hugging Face Qwen3.5/3.6/3.8 (`qwen3_5` / `qwen3_5_moe`) config.json."""
    text = config.get("text_config", config)
    rope = text.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", text.get("rope_theta"))
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    section = rope.get("mrope_section") or text.get("rope_scaling", {}).get("mrope_section")
    if rope_theta is None or section is None:
        raise DimensionsError("config.json: rope_parameters needs rope_theta and mrope_section")
    head_dim = int(_require(text, "head_dim"))
    layer_types = tuple(_require(text, "layer_types"))
    bad = [t for t in layer_types if t not in ("full_attention", "linear_attention")]
    if bad:
        raise DimensionsError(f"config.json: unknown layer types {sorted(set(bad))}")
    vocab_rows = int(_require(text, "vocab_size"))
    moe = "num_experts" in text and int(text["num_experts"]) > 0
    vision_cfg = config.get("vision_config")
    vision = None
    if vision_cfg is not None:
        vision = VisionDims(
            depth=int(_require(vision_cfg, "depth")),
            hidden=int(_require(vision_cfg, "hidden_size")),
            intermediate=int(_require(vision_cfg, "intermediate_size")),
            heads=int(_require(vision_cfg, "num_heads")),
            patch=int(_require(vision_cfg, "patch_size")),
            temporal_patch=int(_require(vision_cfg, "temporal_patch_size")),
            spatial_merge=int(_require(vision_cfg, "spatial_merge_size")),
            position_table=int(_require(vision_cfg, "num_position_embeddings")),
            out_hidden=int(_require(vision_cfg, "out_hidden_size")),
        )
    return QwenDims(
        hidden=int(_require(text, "hidden_size")),
        layer_types=layer_types,
        vocab_rows=vocab_rows,
        vocab_ids=min(vocab_ids, vocab_rows),
        attn_heads=int(_require(text, "num_attention_heads")),
        kv_heads=int(_require(text, "num_key_value_heads")),
        head_dim=head_dim,
        rotary_dim=int(round(head_dim * float(partial))),
        rope_theta=float(rope_theta),
        mrope_section=tuple(int(s) for s in section),
        gdn_qk_heads=int(_require(text, "linear_num_key_heads")),
        gdn_v_heads=int(_require(text, "linear_num_value_heads")),
        gdn_k_dim=int(_require(text, "linear_key_head_dim")),
        gdn_v_dim=int(_require(text, "linear_value_head_dim")),
        conv_kernel=int(_require(text, "linear_conv_kernel_dim")),
        rms_eps=float(_require(text, "rms_norm_eps")),
        intermediate=0 if moe else int(_require(text, "intermediate_size")),
        moe_experts=int(text["num_experts"]) if moe else 0,
        moe_top_k=int(_require(text, "num_experts_per_tok")) if moe else 0,
        moe_intermediate=int(_require(text, "moe_intermediate_size")) if moe else 0,
        shared_intermediate=int(_require(text, "shared_expert_intermediate_size")) if moe else 0,
        mtp_layers=int(text.get("mtp_num_hidden_layers", 0)),
        vision=vision,
    )


def dflash_dims_from_hf_config(config: dict[str, Any]) -> DFlashDims:
    """Dimensions of a DFlash drafter's config.json (z-lab layout). The drafter-specific members (block_size,
    mask_token_id, target_layer_ids) are read from its `dflash_config` object first, then from the top level."""
    extra = config.get("dflash_config") or {}
    if not isinstance(extra, dict):
        raise DimensionsError("config.json: dflash_config must be an object")

    def drafter(key: str) -> Any:
        return extra[key] if key in extra else _require(config, key)

    rope = config.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", config.get("rope_theta"))
    if rope_theta is None:
        raise DimensionsError("config.json: missing rope_theta (top level or in rope_parameters)")
    layer_types, ids = _require(config, "layer_types"), drafter("target_layer_ids")
    if not isinstance(layer_types, list) or not isinstance(ids, list):
        raise DimensionsError("config.json: layer_types and target_layer_ids must be lists")
    dims = DFlashDims(
        hidden=_integer(config, "hidden_size"),
        intermediate=_integer(config, "intermediate_size"),
        layer_types=tuple(layer_types),
        attn_heads=_integer(config, "num_attention_heads"),
        kv_heads=_integer(config, "num_key_value_heads"),
        head_dim=_integer(config, "head_dim"),
        block_size=_as_int(drafter("block_size"), "block_size"),
        mask_token_id=_as_int(drafter("mask_token_id"), "mask_token_id"),
        target_layer_ids=tuple(_as_int(i, "target_layer_ids") for i in ids),
        sliding_window=_integer(config, "sliding_window"),
        rope_theta=float(rope_theta),
        rms_eps=float(_require(config, "rms_norm_eps")),
    )
    if _integer(config, "num_hidden_layers") != dims.layers:
        raise DimensionsError(f"config.json: num_hidden_layers {config['num_hidden_layers']} differs from the "
                              f"{dims.layers} entries of layer_types")
    return _known_layer_types(dims, "config.json")


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DimensionsError(f"config.json: {key!r} must be an integer, got {value!r}")
    return value


def _integer(config: dict[str, Any], key: str) -> int:
    return _as_int(_require(config, key), key)
