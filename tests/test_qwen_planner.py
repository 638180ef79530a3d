"""The Hugging Face planner: §2.9 inventories (names, order, shapes, v2 formats) for the real geometries, through
sparse full-size checkpoints whose headers carry every real tensor name; and the tiny checkpoints' plans."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from ninfer.artifact import codec
from ninfer.artifact.formats import BF16, FP32, I32, Q4G64, Q5G64, Q6G64, W8G32
from ninfer.convert.qwen_hf import (DRAFT_HEAD_ROWS, FRONTEND_FILES, SafetensorsCheckpoint, TensorSpec,
                                    plan_qwen_checkpoint, plan_qwen_tensor_specs)
from ninfer.models.qwen3_6 import Qwen36Model
from ninfer.targets.dims import DIMENSIONS_RESOURCE
from ninfer.targets.registry import QWEN36_27B_DIMS, QWEN36_35B_A3B_DIMS
from tests.support.qwen_checkpoints import QwenCase, build_qwen_checkpoint, materialise, plan_dims
from tests.support.qwen_tokenizer import FIXTURES

Q4, Q5, Q6, W8 = Q4G64, Q5G64, Q6G64, W8G32
FRONTEND = [f"frontend/{name}" for name in FRONTEND_FILES]


def specs_of(plan) -> list[TensorSpec]:
    return [TensorSpec(t.name, t.shape, t.v2_format) for t in plan.tensors]


def by_name(plan) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.name: (t.shape, t.v2_format) for t in plan.tensors}


def layer_sequence(plan) -> list[int]:
    return [int(t.name.split("/")[2]) for t in plan.tensors if t.name.startswith("text/layers/")]


def test_27b_inventory(shape_only) -> None:
    plan = plan_qwen_checkpoint(shape_only("Qwen3.6-27B"))
    assert (plan.model_id, plan.target_key) == ("qwen3.6-27b", "qwen3_6_27b")
    assert [r.name for r in plan.resources] == FRONTEND
    assert len(plan.tensors) == 1118 and len(plan.resources) + len(plan.tensors) == 1124
    assert collections.Counter(t.v2_format for t in plan.tensors) == {
        BF16: 582, FP32: 96, I32: 1, Q4: 183, Q5: 246, Q6: 3, W8: 7}
    assert plan.source["tensors"] == 1199 and plan.source["shards"] == 1
    assert specs_of(plan) == plan_qwen_tensor_specs(QWEN36_27B_DIMS)
    names = [t.name for t in plan.tensors]
    assert names[0] == "text/token_embedding"
    assert layer_sequence(plan) == sorted(layer_sequence(plan))
    tail = names[names.index("text/final_norm"):]
    assert tail[:4] == ["text/final_norm", "text/output_head", "text/draft_head", "text/draft_head_token_ids"]
    assert tail[4:16] == [
        "mtp/input_projection", "mtp/embedding_norm", "mtp/hidden_norm", "mtp/layer/input_norm",
        "mtp/layer/attention/query_key_gate_value", "mtp/layer/attention/query_norm", "mtp/layer/attention/key_norm",
        "mtp/layer/attention/output", "mtp/layer/post_attention_norm", "mtp/layer/mlp/gate_up", "mtp/layer/mlp/down",
        "mtp/final_norm"]
    assert len(tail[16:]) == 3 + 27 * 12 + 6 and all(n.startswith("vision/") for n in tail[16:])
    objects = by_name(plan)
    expected = {
        "text/token_embedding": ((248320, 5120), Q6),
        "text/final_norm": ((5120,), BF16),
        "text/output_head": ((248320, 5120), Q6),
        "text/draft_head": ((131072, 5120), Q4),
        "text/draft_head_token_ids": ((131072,), I32),
        "mtp/input_projection": ((5120, 10240), W8),
        "mtp/layer/attention/query_key_gate_value": ((14336, 5120), W8),
        "mtp/layer/attention/output": ((5120, 6144), W8),
        "mtp/layer/mlp/gate_up": ((34816, 5120), W8),
        "mtp/layer/mlp/down": ((5120, 17408), W8),
        "vision/patch_embedding": ((1152, 1536), Q6),
        "vision/patch_embedding_bias": ((1152,), BF16),
        "vision/position_embedding": ((2304, 1152), BF16),
        "vision/blocks/26/attention/qkv": ((3456, 1152), Q4),
        "vision/blocks/26/attention/qkv_bias": ((3456,), BF16),
        "vision/blocks/26/attention/output": ((1152, 1152), Q5),
        "vision/blocks/26/mlp/fc1": ((4304, 1152), Q4),
        "vision/blocks/26/mlp/fc2": ((1152, 4304), Q5),
        "vision/blocks/26/norm2/bias": ((1152,), BF16),
        "vision/merger/fc1": ((4608, 4608), W8),
        "vision/merger/fc2": ((5120, 4608), W8),
        "vision/merger/fc2_bias": ((5120,), BF16),
        "vision/merger/norm/weight": ((1152,), BF16),
    }
    assert {name: objects[name] for name in expected} == expected
    full_attention = [(f"text/layers/63/{n}", shape, fmt) for n, shape, fmt in [
        ("input_norm", (5120,), BF16), ("attention/query_key", (7168, 5120), Q4),
        ("attention/gate_value", (7168, 5120), Q5), ("attention/query_norm", (256,), BF16),
        ("attention/key_norm", (256,), BF16), ("attention/output", (5120, 6144), Q5),
        ("post_attention_norm", (5120,), BF16), ("mlp/gate_up", (34816, 5120), Q4), ("mlp/down", (5120, 17408), Q5)]]
    gdn = [(f"text/layers/0/{n}", shape, fmt) for n, shape, fmt in [
        ("input_norm", (5120,), BF16), ("gdn/a_log", (48,), FP32), ("gdn/dt_bias", (48,), FP32),
        ("gdn/convolution", (4, 10240), BF16), ("gdn/a_projection", (48, 5120), BF16),
        ("gdn/b_projection", (48, 5120), BF16), ("gdn/query_key", (4096, 5120), Q4),
        ("gdn/value_z", (12288, 5120), Q5), ("gdn/norm", (128,), BF16), ("gdn/output", (5120, 6144), Q5),
        ("post_attention_norm", (5120,), BF16), ("mlp/gate_up", (34816, 5120), Q4), ("mlp/down", (5120, 17408), Q5)]]
    for layer in (gdn, full_attention):
        start = names.index(layer[0][0])
        assert [(t.name, t.shape, t.v2_format) for t in plan.tensors[start : start + len(layer)]] == layer


def test_35b_inventory(shape_only) -> None:
    plan = plan_qwen_checkpoint(shape_only("Qwen3.6-35B-A3B"))
    assert (plan.model_id, plan.target_key) == ("qwen3.6-35b-a3b", "qwen3_6_35b_a3b")
    # The original's 934 tensors include the 51 DFlash ones, which come from a separate checkpoint.
    assert len(plan.tensors) == 934 - 51
    assert collections.Counter(t.v2_format for t in plan.tensors) == {
        BF16: 487 - 26, FP32: 60, I32: 1, Q4: 95, Q5: 91, Q6: 5, W8: 195 - 25}
    assert plan.source["tensors"] == 1045
    assert specs_of(plan) == plan_qwen_tensor_specs(QWEN36_35B_A3B_DIMS)
    objects = by_name(plan)
    moe = [("moe/router_shared_gate", (257, 2048), BF16), ("moe/routed_gate_up", (262144, 2048), Q4),
           ("moe/routed_down", (524288, 512), Q5), ("moe/shared_gate_up", (1024, 2048), W8),
           ("moe/shared_down", (2048, 512), W8)]
    gdn = [("input_norm", (2048,), BF16), ("gdn/a_log", (32,), FP32), ("gdn/dt_bias", (32,), FP32),
           ("gdn/convolution", (4, 8192), BF16), ("gdn/a_b_projection", (64, 2048), BF16),
           ("gdn/query_key_value_z", (12288, 2048), W8), ("gdn/norm", (128,), BF16),
           ("gdn/output", (2048, 4096), W8), ("post_attention_norm", (2048,), BF16)] + moe
    full_attention = [("input_norm", (2048,), BF16), ("attention/query_key_gate_value", (9216, 2048), W8),
                      ("attention/query_norm", (256,), BF16), ("attention/key_norm", (256,), BF16),
                      ("attention/output", (2048, 4096), W8), ("post_attention_norm", (2048,), BF16)] + moe
    names = [t.name for t in plan.tensors]
    for layer, rows in ((0, gdn), (3, full_attention)):
        start = names.index(f"text/layers/{layer}/input_norm")
        assert [(t.name, t.shape, t.v2_format) for t in plan.tensors[start : start + len(rows)]] == [
            (f"text/layers/{layer}/{n}", shape, fmt) for n, shape, fmt in rows]
    assert {layer for layer in range(40) if objects[f"text/layers/{layer}/moe/routed_down"][1] == Q6} == {34, 38, 39}
    assert objects["text/token_embedding"] == ((248320, 2048), W8)
    assert objects["text/output_head"] == ((248320, 2048), Q6)
    mtp = [n for n in names if n.startswith("mtp/")]
    assert len(mtp) == 15 and mtp[-1] == "mtp/final_norm"
    assert objects["mtp/layer/moe/router_shared_gate"] == ((257, 2048), BF16)
    assert objects["mtp/layer/moe/routed_gate_up"] == ((262144, 2048), W8)
    assert objects["mtp/layer/moe/routed_down"] == ((524288, 512), W8)
    assert objects["vision/merger/fc2"] == ((2048, 4608), W8)


def test_qwen38_chat_template_selects_the_qwen38_target(shape_only, tmp_path: Path) -> None:
    assert plan_qwen_checkpoint(shape_only("Qwen3.8-27B")).model_id == "qwen3.8-27b"
    # Upstream Qwen3.8 keeps its template in tokenizer_config.json; without chat_template.jinja it is read there.
    clone = tmp_path / "qwen38"
    clone.mkdir()
    for path in shape_only("Qwen3.8-27B").iterdir():
        if path.name != "chat_template.jinja":
            (clone / path.name).symlink_to(path)
    plan = plan_qwen_checkpoint(clone)
    assert plan.model_id == "qwen3.8-27b"
    template = {r.name: r.data for r in plan.resources}["frontend/chat_template.jinja"]
    assert template == (FIXTURES / "Qwen3.8-27B" / "chat_template.jinja").read_bytes()


def test_tiny_plan_follows_the_inventory(qwen_case: QwenCase) -> None:
    plan = qwen_case.plan
    assert plan.model_id == "qwen3.6-custom" and plan.target_key == "qwen3_6_custom"
    assert [r.name for r in plan.resources] == FRONTEND + [DIMENSIONS_RESOURCE]
    assert specs_of(plan) == plan_qwen_tensor_specs(qwen_case.dims)
    for tensor in plan.tensors:
        value = qwen_case.weights.get(tensor.name)
        assert value.shape == tensor.shape
        assert value.dtype == (np.int32 if tensor.v2_format == I32 else np.float32)
    assert plan.source["shards"] == (3 if qwen_case.kind == "moe" else 1)
    assert "proxy" in plan.source["draft_head_ranking"]


def test_draft_head_is_ascending_ids_with_special_tokens_forced_in(qwen_case: QwenCase) -> None:
    ids = qwen_case.weights.get("text/draft_head_token_ids")
    config = json.loads((qwen_case.hf_dir / "tokenizer_config.json").read_text())
    special = sorted(int(i) for i, e in config["added_tokens_decoder"].items() if e["special"])
    assert len(special) == 21
    assert len(ids) == DRAFT_HEAD_ROWS and np.all(np.diff(ids) > 0)
    np.testing.assert_array_equal(ids, np.concatenate([np.arange(DRAFT_HEAD_ROWS - 21), special]))
    # the shortlist keeps Q4 under the bf16 recipe these weights were stored with: the head's rows, Q4-rounded
    rows = qwen_case.weights.get("text/output_head")[ids]
    np.testing.assert_array_equal(qwen_case.weights.get("text/draft_head"),
                                  codec.decode(codec.encode(rows, Q4G64), Q4G64, rows.shape))


def test_per_expert_checkpoint_plans_like_fused_banks(moe_checkpoint: Path, qwen_tokenizer_json: Path,
                                                      tmp_path: Path) -> None:
    """transformers' save_pretrained writes one linear per expert; real checkpoints store 3-D banks."""
    per_expert = build_qwen_checkpoint(tmp_path / "per-expert", moe=True, tokenizer_json=qwen_tokenizer_json,
                                       per_expert=True)
    assert "model.language_model.layers.0.mlp.experts.7.up_proj.weight" in SafetensorsCheckpoint(per_expert).entries
    plan, fused = plan_qwen_checkpoint(per_expert), plan_qwen_checkpoint(moe_checkpoint)
    assert specs_of(plan) == specs_of(fused)
    for tensor, reference in zip(plan.tensors, fused.tensors):
        if "/moe/routed" in tensor.name:
            np.testing.assert_array_equal(tensor.produce(), reference.produce())


def test_text_only_causal_lm_checkpoint(qwen_case: QwenCase, tmp_path: Path) -> None:
    """A `*ForCausalLM` checkpoint: flat text config, `model.` prefix, no Vision objects."""
    import torch
    from safetensors.torch import save_file

    source = SafetensorsCheckpoint(qwen_case.hf_dir)
    tensors = {name.replace("model.language_model.", "model."): torch.from_numpy(source.read(name)).bfloat16()
               for name in source.entries if not name.startswith("model.visual.")}
    out = tmp_path / "text-only"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((qwen_case.hf_dir / "config.json").read_text())
    text = config["text_config"]
    text["architectures"] = ["Qwen3_5MoeForCausalLM" if qwen_case.kind == "moe" else "Qwen3_5ForCausalLM"]
    (out / "config.json").write_text(json.dumps(text))
    for name in FRONTEND_FILES:
        (out / name).symlink_to(qwen_case.hf_dir / name)
    plan = plan_qwen_checkpoint(out)
    assert plan.source["architecture"] == text["architectures"][0]
    expected = [t.name for t in qwen_case.plan.tensors if not t.name.startswith("vision/")]
    assert [t.name for t in plan.tensors] == expected
    for tensor in plan.tensors[:5]:
        np.testing.assert_array_equal(tensor.produce(), qwen_case.weights.get(tensor.name))


def test_checkpoint_without_mtp_has_no_mtp_objects(qwen_tokenizer_json: Path, tmp_path: Path) -> None:
    directory = build_qwen_checkpoint(tmp_path / "no-mtp", moe=False, tokenizer_json=qwen_tokenizer_json, mtp=False)
    plan = plan_qwen_checkpoint(directory)
    assert not [t for t in plan.tensors if t.name.startswith("mtp/")]
    model = Qwen36Model(plan_dims(plan), materialise(plan, "bf16"))
    with pytest.raises(ValueError, match="no MTP head"):
        model.mtp_new_state()


def test_planning_reads_headers_only(qwen_case: QwenCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tensor data is read until produce(), and produce() reads only its own sources."""
    reads: list[str] = []
    original = SafetensorsCheckpoint.read
    monkeypatch.setattr(SafetensorsCheckpoint, "read", lambda self, name: reads.append(name) or original(self, name))
    plan = plan_qwen_checkpoint(qwen_case.hf_dir)
    assert reads == []
    next(t for t in plan.tensors if t.name == "text/layers/3/attention/output").produce()
    assert reads == ["model.language_model.layers.3.self_attn.o_proj.weight"]
