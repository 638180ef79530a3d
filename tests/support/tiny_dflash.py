"""Tiny DFlash drafters on the CPU runner tests' tiny 35B-shaped (MoE) model, and a float64 transcription of §3.10.

`tiny_dflash_qwen` is `tiny_qwen(moe=True)` (4 layers of width 32, 512-token vocabulary) with a 2-layer drafter
(one sliding layer with a short window, so prompts wrap its cyclic cache, and one full layer) reading target layers
1 and 2, its mask row the first padding row (500).

`write_tiny_dflash_artifact` writes that model as a `qwen3.6-custom` artifact (dimension resources, every tensor);
`write_cuda_tiny_dflash_artifact` the same drafter shape on the CUDA tests' tiny MoE target (`cuda_tiny_dims`, width
64), with every matrix width a multiple of 64 as the GPU kernels need.

`predictable` makes the target nearly a bigram model (`tiny_qwen`'s) and the drafter copy the anchor: its queries are
zero (uniform attention), its values the identity and the mask embedding row zero, so every mask row's output is
close to the anchor's normed embedding and the first draft is usually the target's next token. The context still
enters every output (scaled down), so a wrong context shows bitwise in the drafter's rows. `query_scale` keeps that
much of the random queries instead of none: the keys then shape the attention too (a wrong key shows in the rows),
while the anchor still dominates every output.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ninfer.artifact.writer import ResourceSpec, TensorSpec, write_artifact
from ninfer.convert.plan import recipe_format
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs
from ninfer.models.base import DictWeights
from ninfer.models.qwen3_6 import Qwen36Model
from ninfer.targets.dims import (DFLASH_DIMENSIONS_RESOURCE, DIMENSIONS_RESOURCE, FULL_ATTENTION, SLIDING_ATTENTION,
                                 DFlashDims, QwenDims)
from tests.support.cuda_models import cuda_tiny_dims
from tests.test_runner_cpu import tiny_qwen, tiny_qwen_dims


def tiny_dflash_dims(target: QwenDims, *, window: int = 24, intermediate: int = 48) -> DFlashDims:
    """2 layers (sliding, full), 4 query / 2 KV heads of hidden / 2 (KV width = the target's hidden)."""
    return DFlashDims(hidden=target.hidden, intermediate=intermediate,
                      layer_types=(SLIDING_ATTENTION, FULL_ATTENTION), attn_heads=4, kv_heads=2,
                      head_dim=target.hidden // 2, block_size=16, mask_token_id=target.vocab_ids,
                      target_layer_ids=(1, 2), sliding_window=window, rope_theta=1e7, rms_eps=1e-6)


def tiny_dflash_tensors(target: QwenDims, dims: DFlashDims, *, seed: int = 0, predictable: bool = False,
                        query_scale: float = 0.0) -> dict[str, np.ndarray]:
    """Every `dflash/...` tensor the converter would write for `dims`."""
    rng = np.random.default_rng(seed + 1000)
    tensors = {}
    for spec in plan_qwen_tensor_specs(target, dims):
        if not spec.name.startswith("dflash/"):
            continue
        shape = spec.shape
        value = 1.0 + rng.normal(0.0, 0.2, shape) if len(shape) == 1 else \
            rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape)
        tensors[spec.name] = value.astype(np.float32)
    if predictable:
        h, qw, kvw = dims.hidden, dims.q_width, dims.kv_width
        if kvw != h:
            raise ValueError("a predictable drafter copies the anchor through V: it needs kv_width == hidden")
        group = dims.attn_heads // dims.kv_heads
        # Query head j * group reads KV head j: the output projection puts KV head j's slice back in place.
        output = np.zeros((h, qw), np.float32)
        for head in range(dims.kv_heads):
            rows = slice(head * dims.head_dim, (head + 1) * dims.head_dim)
            output[rows, head * group * dims.head_dim : (head * group + 1) * dims.head_dim] = np.eye(dims.head_dim)
        for index in range(dims.layers):
            p = f"dflash/layers/{index}/"
            qkv = tensors[p + "attention/query_key_value"]
            qkv[:qw] *= np.float32(query_scale)
            qkv[qw + kvw :] = np.eye(h)
            tensors[p + "attention/output"] = output
            tensors[p + "mlp/down"] = np.zeros_like(tensors[p + "mlp/down"])
            for norm in ("input_norm", "post_attention_norm"):
                tensors[p + norm] = np.ones(h, np.float32)
        tensors["dflash/context_norm"] *= np.float32(1e-4)
        tensors["dflash/final_norm"] = np.ones(h, np.float32)
    return tensors


def tiny_dflash_qwen(*, seed: int = 0, predictable: bool = True, window: int = 24, target: QwenDims | None = None,
                     intermediate: int = 48, query_scale: float = 0.0) -> Qwen36Model:
    """The drafter on `target` (default: `tiny_qwen_dims(moe=True)`)."""
    target = target or tiny_qwen_dims(moe=True)
    dims = tiny_dflash_dims(target, window=window, intermediate=intermediate)
    base = tiny_qwen(dims=target, seed=seed, predictable=predictable)._weights
    tensors = {spec.name: np.asarray(base.get(spec.name)) for spec in plan_qwen_tensor_specs(target)}
    tensors.update(tiny_dflash_tensors(target, dims, seed=seed, predictable=predictable, query_scale=query_scale))
    if predictable:
        tensors["text/token_embedding"] = tensors["text/token_embedding"].copy()
        tensors["text/token_embedding"][dims.mask_token_id] = 0.0
    return Qwen36Model(target, DictWeights(tensors), dflash=dims)


def write_tiny_dflash_artifact(path: Path, *, recipe: str = "bf16", seed: int = 0, window: int = 24,
                               target: QwenDims | None = None, intermediate: int = 48,
                               query_scale: float = 0.0) -> Path:
    model = tiny_dflash_qwen(seed=seed, window=window, target=target, intermediate=intermediate,
                             query_scale=query_scale)
    dims, drafter = model.dims, model.dflash.dims
    items = [(ResourceSpec(name, len(data)), data) for name, data in (
        (DIMENSIONS_RESOURCE, dims.to_json().encode()), (DFLASH_DIMENSIONS_RESOURCE, drafter.to_json().encode()))]
    for spec in plan_qwen_tensor_specs(dims, drafter):
        value = np.asarray(model._weights.get(spec.name))
        items.append((TensorSpec(spec.name, value.shape, recipe_format(recipe, spec)), value))
    write_artifact(path, "qwen3.6-custom", items)
    return path


def write_cuda_tiny_dflash_artifact(path: Path, *, recipe: str = "bf16", seed: int = 0, window: int = 24,
                                    query_scale: float = 0.5) -> Path:
    return write_tiny_dflash_artifact(path, recipe=recipe, seed=seed, window=window,
                                      target=cuda_tiny_dims(moe=True), intermediate=128, query_scale=query_scale)


# ---- the drafter, transcribed from ninfer-facts §3.10 (float64, one position at a time) ----

def _plain_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / math.sqrt(float(np.mean(x * x)) + eps)


def _rope(x: np.ndarray, position: int, theta: float) -> np.ndarray:
    half = len(x) // 2
    angles = position * theta ** (-np.arange(half) * 2.0 / len(x))
    c, s = np.cos(angles), np.sin(angles)
    return np.concatenate([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s])


def reference_block(model: Qwen36Model, features: np.ndarray, anchor: int, k: int) -> np.ndarray:
    """The drafter's final rows `[k, hidden]` of the k mask columns for a sequence whose committed positions
    0..L-1 have context features `features [L, F]`, with the anchor at position L."""
    d = model.dflash.dims
    weights = model._weights

    def get(name):
        return np.asarray(weights.get(name), dtype=np.float64)

    length, eps, hd = len(features), d.rms_eps, d.head_dim
    c = [_plain_norm(get("dflash/feature_projection") @ s, get("dflash/context_norm"), eps)
         for s in features.astype(np.float64)]
    positions = list(range(length + k + 1))
    u = [get("text/token_embedding")[anchor]] + [get("text/token_embedding")[d.mask_token_id]] * k
    for index, kind in enumerate(d.layer_types):
        p = f"dflash/layers/{index}/"
        qkv = get(p + "attention/query_key_value")
        w_q, w_k, w_v = qkv[: d.q_width], qkv[d.q_width : d.q_width + d.kv_width], qkv[d.q_width + d.kv_width :]

        def heads(vector, count):
            return vector.reshape(count, hd)

        def key(x, position):
            return np.stack([_rope(_plain_norm(head, get(p + "attention/key_norm"), eps), position, d.rope_theta)
                             for head in heads(w_k @ x, d.kv_heads)])

        normed = [_plain_norm(x, get(p + "input_norm"), eps) for x in u]
        keys = [key(x, t) for t, x in enumerate(c)] + [key(x, length + i) for i, x in enumerate(normed)]
        values = [heads(w_v @ x, d.kv_heads) for x in c + normed]
        out = []
        for i, x in enumerate(normed):
            position = length + i
            visible = [j for j in range(len(keys))
                       if kind != SLIDING_ATTENTION or abs(positions[j] - position) < d.sliding_window]
            query = [_rope(_plain_norm(head, get(p + "attention/query_norm"), eps), position, d.rope_theta)
                     for head in heads(w_q @ x, d.attn_heads)]
            attended = []
            for h, q in enumerate(query):
                kv = h // (d.attn_heads // d.kv_heads)
                scores = np.array([q @ keys[j][kv] for j in visible]) / math.sqrt(hd)
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                attended.append(sum(w * values[j][kv] for w, j in zip(probs, visible)))
            y = u[i] + get(p + "attention/output") @ np.concatenate(attended)
            m = _plain_norm(y, get(p + "post_attention_norm"), eps)
            gate_up = get(p + "mlp/gate_up")
            g, up = gate_up[: d.intermediate] @ m, gate_up[d.intermediate :] @ m
            out.append(y + get(p + "mlp/down") @ (g / (1.0 + np.exp(-g)) * up))
        u = out
    return np.stack([_plain_norm(x, get("dflash/final_norm"), eps) for x in u[1:]])
