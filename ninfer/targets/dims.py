"""Model dimensions: the numbers every layer below reads its shapes from.

The two published Qwen3.6 targets have fixed dimensions (ninfer-facts §3.1). Test and demo artifacts carry theirs in
the resource `model/dimensions.json`, so a tiny model travels exactly the same code path as a real one.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

DIMENSIONS_RESOURCE = "model/dimensions.json"


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
