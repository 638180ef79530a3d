"""model_id -> target: which model family serves an artifact, and with which dimensions.

Published targets have fixed dimensions (ninfer-facts §3.1); an artifact that also carries `model/dimensions.json`
must agree with them. `*-custom` targets (tiny test models) take their dimensions from that resource alone.
"""

from __future__ import annotations

import attrs

from ninfer.targets.dims import (FULL_ATTENTION, SLIDING_ATTENTION, DFlashDims, LlamaDims, ModelDims, QwenDims,
                                 VisionDims)


class UnknownModelError(LookupError):
    """The artifact's model_id is not one ninfer can serve."""


class TargetMismatchError(ValueError):
    """An artifact's (or checkpoint's) dimensions contradict its registered target."""


def _qwen_layer_types(layers: int) -> tuple[str, ...]:
    # Every fourth layer (i + 1) % 4 == 0 is gated full attention; the rest are Gated DeltaNet.
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))


def _vision(out_hidden: int) -> VisionDims:
    return VisionDims(depth=27, hidden=1152, intermediate=4304, heads=16, patch=16, temporal_patch=2,
                      spatial_merge=2, position_table=2304, out_hidden=out_hidden)


_QWEN_COMMON = dict(vocab_rows=248320, vocab_ids=248077, head_dim=256, rotary_dim=64, rope_theta=1e7,
                    mrope_section=(11, 11, 10), gdn_qk_heads=16, gdn_k_dim=128, gdn_v_dim=128, conv_kernel=4,
                    rms_eps=1e-6, mtp_layers=1)

QWEN36_27B_DIMS = QwenDims(hidden=5120, layer_types=_qwen_layer_types(64), attn_heads=24, kv_heads=4, gdn_v_heads=48,
                           intermediate=17408, vision=_vision(5120), **_QWEN_COMMON)
QWEN36_35B_A3B_DIMS = QwenDims(hidden=2048, layer_types=_qwen_layer_types(40), attn_heads=16, kv_heads=2,
                               gdn_v_heads=32, moe_experts=256, moe_top_k=8, moe_intermediate=512,
                               shared_intermediate=512, vision=_vision(2048), **_QWEN_COMMON)
# z-lab/Qwen3.6-35B-A3B-DFlash rev f181eece (ninfer-facts §2.10, §3.10).
QWEN36_35B_A3B_DFLASH_DIMS = DFlashDims(
    hidden=2048, intermediate=6144, layer_types=(SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,), attn_heads=32,
    kv_heads=8, head_dim=128, block_size=16, mask_token_id=248077, target_layer_ids=(1, 6, 11, 16, 22, 27, 32, 37),
    sliding_window=4096, rope_theta=1e7, rms_eps=1e-6)
SMOLLM2_135M_DIMS = LlamaDims(hidden=576, layers=30, vocab_rows=49152, vocab_ids=49152, attn_heads=9, kv_heads=3,
                              head_dim=64, intermediate=1536, rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True)


@attrs.frozen(kw_only=True)
class SamplingDefaults:
    """One registered sampling preset (serving.md): what a request gets when neither it nor a process flag says."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float = 0.0


@attrs.frozen(kw_only=True)
class SamplingPresets:
    """The presets of a target for the request's resolved thinking mode."""

    thinking: SamplingDefaults
    non_thinking: SamplingDefaults

    def for_mode(self, thinking: bool) -> SamplingDefaults:
        return self.thinking if thinking else self.non_thinking


# serving.md: 27B / 3.8-27B thinking 1.0/0.95/20/0/0, non-thinking 0.7/0.80/20/0/1.5; 35B-A3B differs only in its
# thinking presence penalty (1.5). Custom Qwen targets use the 27B presets; llama keeps the snapshot's one default.
QWEN_27B_PRESETS = SamplingPresets(
    thinking=SamplingDefaults(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0),
    non_thinking=SamplingDefaults(temperature=0.7, top_p=0.80, top_k=20, min_p=0.0, presence_penalty=1.5))
QWEN_35B_A3B_PRESETS = attrs.evolve(QWEN_27B_PRESETS,
                                    thinking=attrs.evolve(QWEN_27B_PRESETS.thinking, presence_penalty=1.5))
_LLAMA_DEFAULTS = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.0)
LLAMA_PRESETS = SamplingPresets(thinking=_LLAMA_DEFAULTS, non_thinking=_LLAMA_DEFAULTS)


@attrs.frozen
class Target:
    model_id: str
    family: str  # "qwen3_6" | "llama"
    dims: ModelDims | None  # None: taken from the artifact's model/dimensions.json
    description: str
    sampling: SamplingPresets
    dflash: DFlashDims | None = None  # the target's published DFlash drafter (custom targets carry theirs)


TARGETS: dict[str, Target] = {
    t.model_id: t
    for t in (
        Target("qwen3.6-27b", "qwen3_6", QWEN36_27B_DIMS, "Qwen3.6-27B (dense, 64 layers)", QWEN_27B_PRESETS),
        Target("qwen3.8-27b", "qwen3_6", QWEN36_27B_DIMS, "Qwen3.8-27B (same geometry as Qwen3.6-27B)",
               QWEN_27B_PRESETS),
        Target("qwen3.6-35b-a3b", "qwen3_6", QWEN36_35B_A3B_DIMS, "Qwen3.6-35B-A3B (MoE, 40 layers)",
               QWEN_35B_A3B_PRESETS, dflash=QWEN36_35B_A3B_DFLASH_DIMS),
        Target("qwen3.6-custom", "qwen3_6", None, "a Qwen3.5/3.6-architecture model of any size (tests)",
               QWEN_27B_PRESETS),
        Target("smollm2-135m-instruct", "llama", SMOLLM2_135M_DIMS, "SmolLM2-135M-Instruct (the bundled demo)",
               LLAMA_PRESETS),
        Target("llama-custom", "llama", None, "a llama-architecture model of any size (tests)", LLAMA_PRESETS),
    )
}


def lookup_target(model_id: str) -> Target:
    try:
        return TARGETS[model_id]
    except KeyError:
        known = ", ".join(sorted(TARGETS))
        raise UnknownModelError(f"unknown model_id {model_id!r}: ninfer serves {known}") from None


def resolve_dims(model_id: str, carried: ModelDims | None) -> ModelDims:
    """The dimensions an artifact is served with: the target's own, checked against what the artifact carries."""
    target = lookup_target(model_id)
    if target.dims is None:
        if carried is None:
            raise TargetMismatchError(f"model_id {model_id!r} needs the resource model/dimensions.json")
        if carried.family != target.family:
            raise TargetMismatchError(f"model_id {model_id!r} is a {target.family} target, dimensions say {carried.family}")
        return carried
    if carried is not None and carried != target.dims:
        raise TargetMismatchError(f"model/dimensions.json contradicts the registered dimensions of {model_id!r}")
    return target.dims


def dflash_mismatches(model_id: str, dflash: DFlashDims) -> list[str]:
    """How a drafter differs from the one registered for `model_id`'s target, field by field (empty for a target
    without a registered drafter: custom targets' drafters may have any size)."""
    registered = lookup_target(model_id).dflash
    if registered is None:
        return []
    return [f"{field.name} is {getattr(dflash, field.name)!r}, {model_id}'s drafter has "
            f"{getattr(registered, field.name)!r}"
            for field in attrs.fields(DFlashDims) if getattr(dflash, field.name) != getattr(registered, field.name)]


def resolve_dflash_dims(model_id: str, carried: DFlashDims | None) -> DFlashDims | None:
    """The drafter dimensions an artifact with DFlash objects is served with: the target's registered ones (checked
    against what the artifact carries), or what a custom artifact carries."""
    target = lookup_target(model_id)
    if target.dims is None:
        return carried
    if carried is not None and carried != target.dflash:
        raise TargetMismatchError(f"model/dflash_dimensions.json contradicts the registered drafter of {model_id!r}")
    return target.dflash


def target_for_qwen_dims(dims: QwenDims) -> str:
    """The published target whose geometry `dims` has, else the custom one."""
    for model_id in ("qwen3.6-27b", "qwen3.6-35b-a3b"):
        if TARGETS[model_id].dims == dims:
            return model_id
    return "qwen3.6-custom"
