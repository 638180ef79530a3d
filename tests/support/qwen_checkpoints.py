"""Tiny random Hugging Face Qwen3.5/3.6 checkpoints laid out like the real ones, and helpers around them.

A checkpoint directory holds config.json, BF16 safetensors (optionally sharded with model.safetensors.index.json),
fabricated `mtp.*` tensors with the real names, and the six frontend files. DFlash drafter checkpoints (z-lab layout:
config.json and `fc`, `hidden_norm`, `norm`, `layers.{i}.*` tensors) are written for the tiny MoE target, or
shape-only at the real size. The vocabulary is the real one (248,320
rows) so the real tokenizer fits; everything else is tiny. Weights are random with a fixed seed and a scale that
keeps activations O(1): norm weights are far from zero so the (1 + w) offset form matters.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np

from ninfer.artifact import codec
from ninfer.convert.plan import ConversionPlan, recipe_format
from ninfer.convert.qwen_hf import plan_qwen_checkpoint
from ninfer.models.base import DictWeights
from ninfer.models.qwen3_6 import Qwen36Model
from ninfer.targets.dims import DIMENSIONS_RESOURCE, QwenDims, dims_from_json
from tests.support.qwen_tokenizer import FIXTURES

FRONTEND_FIXTURES = ("chat_template.jinja", "tokenizer_config.json", "generation_config.json",
                     "preprocessor_config.json", "video_preprocessor_config.json")

_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
               spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=64, deepstack_visual_indexes=[],
               hidden_act="gelu_pytorch_tanh")
_COMMON = dict(vocab_size=248320, hidden_size=64, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_num_key_heads=2, mtp_num_hidden_layers=1, attn_output_gate=True,
               mamba_ssm_dtype="float32", tie_word_embeddings=False, max_position_embeddings=4096)
# Dense: 8 layers, GQA group 2, head_dim 64 (16 rotary dims, sections 3/3/2), 3 V heads per GDN QK head.
DENSE_TEXT = dict(_COMMON, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  linear_num_value_heads=6, intermediate_size=128,
                  rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                       mrope_section=[3, 3, 2], mrope_interleaved=True))
# MoE: 4 layers, GQA group 4, head_dim 32 (8 rotary dims, sections 2/1/1), 2 V heads per QK head, 8 experts top-2.
MOE_TEXT = dict(_COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))


def _hf_classes(moe: bool):
    """(config class, model class) of transformers' multimodal Qwen3.5 models."""
    import transformers

    if moe:
        return transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
    return transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration


def _hf_shapes(config, moe: bool) -> dict[str, tuple[int, ...]]:
    """Every parameter name and shape transformers declares for `config` (built on the meta device: no memory)."""
    import torch

    with torch.device("meta"):
        model = _hf_classes(moe)[1](config)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def _random_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias") or name.endswith(".bias"):
        return rng.normal(0.0, 0.5, shape)
    if "embed_tokens" in name:
        return rng.normal(0.0, 1.0, shape)
    if len(shape) == 1:  # norm weights: far from 0 so the offset form (1 + w) is exercised
        return rng.normal(0.0, 0.4, shape)
    if "conv1d" in name:
        return rng.normal(0.0, 0.5, shape)
    fan_in = int(np.prod(shape[1:])) if "patch_embed" in name else shape[-1]
    return rng.normal(0.0, 1.0 / np.sqrt(fan_in), shape)


def _mtp_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The real `mtp.*` names: fc, the two pre-fc norms, one full-attention decoder layer, the final norm."""
    h = shapes["model.language_model.norm.weight"][0]
    mtp = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    # Layer 3 is full attention: its tensors have exactly the MTP layer's names and shapes.
    source = "model.language_model.layers.3."
    mtp.update({"mtp.layers.0." + k[len(source):]: v for k, v in shapes.items() if k.startswith(source)})
    return mtp


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor a real checkpoint of `config` holds: transformers' parameters plus the `mtp.*` ones."""
    shapes = _hf_shapes(config, config.model_type == "qwen3_5_moe")
    shapes.update(_mtp_shapes(shapes))
    return shapes


def _per_expert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' save_pretrained layout: one gate/up/down linear per expert instead of 3-D banks."""
    out = {}
    for name, value in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = value[e, inter:]
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    return out


def _save_bf16(tensors: dict[str, np.ndarray], out_dir: Path, shards: int) -> None:
    import torch
    from safetensors.torch import save_file

    names = sorted(tensors)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        file = "model.safetensors" if shards == 1 else f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({n: torch.from_numpy(np.ascontiguousarray(tensors[n], dtype=np.float32)).bfloat16()
                   for n in group}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in group})
    if shards > 1:
        total = sum(2 * v.size for v in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_qwen_checkpoint(out_dir: Path, *, moe: bool, tokenizer_json: Path, shards: int = 1,
                          per_expert: bool = False, mtp: bool = True, seed: int = 0) -> Path:
    """Write a tiny random Qwen3_5(Moe)ForConditionalGeneration checkpoint directory and return it."""
    config_class, model_class = _hf_classes(moe)
    text = dict(MOE_TEXT if moe else DENSE_TEXT, mtp_num_hidden_layers=1 if mtp else 0)
    config = config_class(text_config=text, vision_config=dict(_VISION))
    config.architectures = [model_class.__name__]
    shapes = _hf_shapes(config, moe)
    if mtp:
        shapes.update(_mtp_shapes(shapes))
    rng = np.random.default_rng(seed)
    tensors = {name: _random_value(name, shape, rng).astype(np.float32) for name, shape in sorted(shapes.items())}
    if per_expert:
        tensors = _per_expert(tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    _save_bf16(tensors, out_dir, shards)
    copy_frontend("Qwen3.6-27B", out_dir, tokenizer_json)
    return out_dir


def copy_frontend(fixture: str, out_dir: Path, tokenizer_json: Path) -> None:
    for name in FRONTEND_FIXTURES:
        shutil.copyfile(FIXTURES / fixture / name, out_dir / name)
    shutil.copyfile(tokenizer_json, out_dir / "tokenizer.json")


def _write_sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A BF16 safetensors file with a real header over a hole of zeros (no disk or memory cost)."""
    header, offset = {}, 0
    for name, shape in sorted(shapes.items()):
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        f.truncate(8 + len(encoded) + offset)


def build_shape_only_checkpoint(out_dir: Path, fixture: str, *, tokenizer_json: Path) -> Path:
    """A full-size checkpoint directory for an official config (fixture `Qwen3.6-27B`, `Qwen3.8-27B`, ...) whose
    single safetensors file is SPARSE: a real header (every tensor transformers declares, plus the real `mtp.*`
    names) over a hole of zeros, so planning sees the true inventory at no disk or memory cost."""
    from transformers import AutoConfig

    _write_sparse_safetensors(out_dir / "model.safetensors",
                              checkpoint_shapes(AutoConfig.from_pretrained(FIXTURES / fixture)))
    shutil.copyfile(FIXTURES / fixture / "config.json", out_dir / "config.json")
    copy_frontend(fixture, out_dir, tokenizer_json)
    return out_dir


# z-lab/Qwen3.6-35B-A3B-DFlash rev f181eece as ninfer-facts §2.10 and §3.1 describe it.
REAL_DFLASH_CONFIG = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=2048, intermediate_size=6144,
    num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"], num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, block_size=16,
    dflash_config=dict(mask_token_id=248077, target_layer_ids=[1, 6, 11, 16, 22, 27, 32, 37]),
    sliding_window=4096, rope_theta=10000000.0, rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu",
    num_target_layers=40, vocab_size=248320, tie_word_embeddings=False)
# A drafter of the tiny MoE target (MOE_TEXT: hidden 64, 4 layers): one sliding and one full layer.
TINY_DFLASH_CONFIG = dict(
    REAL_DFLASH_CONFIG, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    layer_types=["sliding_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    dflash_config=dict(mask_token_id=248077, target_layer_ids=[1, 2]), sliding_window=32, num_target_layers=4)


def dflash_checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The 3 + 11 * layers tensors of a z-lab DFlash drafter checkpoint."""
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    qw, kvw = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    features = len(config["dflash_config"]["target_layer_ids"]) * h
    shapes = {"fc.weight": (h, features), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        x = f"layers.{i}."
        shapes.update({x + "input_layernorm.weight": (h,), x + "post_attention_layernorm.weight": (h,),
                       x + "self_attn.q_proj.weight": (qw, h), x + "self_attn.k_proj.weight": (kvw, h),
                       x + "self_attn.v_proj.weight": (kvw, h), x + "self_attn.o_proj.weight": (h, qw),
                       x + "self_attn.q_norm.weight": (hd,), x + "self_attn.k_norm.weight": (hd,),
                       x + "mlp.gate_proj.weight": (inter, h), x + "mlp.up_proj.weight": (inter, h),
                       x + "mlp.down_proj.weight": (h, inter)})
    return shapes


def build_dflash_checkpoint(out_dir: Path, config: dict, *, seed: int = 0, shape_only: bool = False,
                            extra: dict[str, tuple[int, ...]] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A DFlash drafter checkpoint directory for `config`: random BF16 weights, or a sparse file when `shape_only`.
    `extra` adds tensors and `drop` leaves some out (malformed checkpoints)."""
    shapes = {name: shape for name, shape in dflash_checkpoint_shapes(config).items() if name not in drop}
    shapes.update(extra or {})
    out_dir.mkdir(parents=True, exist_ok=True)
    if shape_only:
        _write_sparse_safetensors(out_dir / "model.safetensors", shapes)
    else:
        rng = np.random.default_rng(seed)
        _save_bf16({name: _random_value(name, shape, rng).astype(np.float32) for name, shape in sorted(shapes.items())},
                   out_dir, 1)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def load_hf_model(hf_dir: Path):
    """The transformers model of a checkpoint, eval mode, fp32 math on BF16-representable parameters."""
    import torch

    moe = json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    model = _hf_classes(moe)[1].from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def plan_dims(plan: ConversionPlan) -> QwenDims:
    """The dimensions a custom-target plan carries in its `model/dimensions.json` resource."""
    return dims_from_json({r.name: r.data for r in plan.resources}[DIMENSIONS_RESOURCE])


def materialise(plan: ConversionPlan, recipe: str) -> DictWeights:
    """Every planned tensor as the artifact would store it under `recipe`, decoded back to float32 / int32."""
    tensors = {}
    for tensor in plan.tensors:
        fmt = recipe_format(recipe, tensor)
        tensors[tensor.name] = codec.decode(codec.encode(tensor.produce(), fmt), fmt, tensor.shape)
    return DictWeights(tensors)


# A short chat turn (about 40 tokens) with special tokens, so every id kind runs through the models.
PROMPT = ("<|im_start|>user\nWhat is the capital of France, and why is it famous? Answer briefly.<|im_end|>\n"
          "<|im_start|>assistant\n<think>\n\n</think>\n\nThe capital of France is Paris; it is")


def prompt_ids(tokenizer_json: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    return np.array(Tokenizer.from_file(str(tokenizer_json)).encode(PROMPT).ids, dtype=np.int64)


def hf_logits(model, ids: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """transformers' logits `[T, vocab]` for one sequence; positions `[3, T]` are MRoPE (T, H, W) positions."""
    import torch

    with torch.no_grad():
        position_ids = None if positions is None else torch.from_numpy(positions)[:, None, :]
        out = model(input_ids=torch.from_numpy(ids)[None], position_ids=position_ids, use_cache=False)
    return out.logits[0].numpy()


class QwenCase:
    """One tiny checkpoint and everything derived from it: the plan, BF16-stored weights, the ninfer model and
    (built on first use) the transformers model."""

    def __init__(self, kind: str, hf_dir: Path, tokenizer_json: Path) -> None:
        self.kind, self.hf_dir = kind, hf_dir
        self.plan = plan_qwen_checkpoint(hf_dir)
        self.dims = plan_dims(self.plan)
        self.weights = materialise(self.plan, "bf16")
        self.model = Qwen36Model(self.dims, self.weights)
        self.prompt = prompt_ids(tokenizer_json)

    @functools.cached_property
    def hf_model(self):
        return load_hf_model(self.hf_dir)
