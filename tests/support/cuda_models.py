"""Tiny Qwen artifacts for the CUDA backend's GPU tests: the same random models the CPU runner tests use, at widths
the kernels accept (multiples of 64), written as real `.ninfer` files in either recipe so both backends load exactly
the same stored weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ninfer.artifact.writer import ResourceSpec, TensorSpec, write_artifact
from ninfer.convert.plan import recipe_format
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs
from ninfer.targets.dims import DIMENSIONS_RESOURCE, QwenDims
from tests.test_runner_cpu import tiny_qwen


def cuda_tiny_dims(*, moe: bool, gdn_k_dim: int = 32, head_dim: int = 64) -> QwenDims:
    """4 layers (3 GDN + 1 full attention), hidden 64, every matrix width a multiple of 64 (`gdn_k_dim` 128: the
    real models' key dim, which the prefill conv normalises q and k at, `gdn.gdn_conv_normed`; `head_dim` 256: the
    real models' attention head dim, which the decode kernels of head dim 256 serve)."""
    ffn = dict(moe_experts=8, moe_top_k=2, moe_intermediate=64, shared_intermediate=64) if moe else \
        dict(intermediate=128)
    return QwenDims(hidden=64, layer_types=("linear_attention",) * 3 + ("full_attention",), vocab_rows=512,
                    vocab_ids=500, rope_theta=1e7, attn_heads=4, kv_heads=2, head_dim=head_dim, rotary_dim=16,
                    mrope_section=(3, 3, 2), gdn_qk_heads=2, gdn_v_heads=4, gdn_k_dim=gdn_k_dim, gdn_v_dim=32,
                    conv_kernel=4, rms_eps=1e-6, mtp_layers=1, **ffn)


def write_tiny_qwen_artifact(path: Path, *, moe: bool, recipe: str, seed: int = 0, predictable: bool = False,
                             gdn_k_dim: int = 32, head_dim: int = 64) -> Path:
    dims = cuda_tiny_dims(moe=moe, gdn_k_dim=gdn_k_dim, head_dim=head_dim)
    model = tiny_qwen(dims=dims, seed=seed, predictable=predictable)
    weights = model._weights  # the DictWeights the CPU model was built from
    items = [(ResourceSpec(DIMENSIONS_RESOURCE, len(dims.to_json().encode())), dims.to_json().encode())]
    for spec in plan_qwen_tensor_specs(dims):
        fmt = recipe_format(recipe, spec)
        value = np.asarray(weights.get(spec.name))
        items.append((TensorSpec(spec.name, value.shape, fmt), value))  # the writer encodes; the tiny draft head is a shortlist
    write_artifact(path, "qwen3.6-custom", items)
    return path
