"""`ninfer convert ... --dflash-model DIR` (ninfer-facts §2.9, §2.10) and serving its artifact with --spec dflash.

A tiny random drafter checkpoint (z-lab layout, 2 layers) for the tiny MoE checkpoint, and a shape-only one at the
real size for the 35B-A3B inventory: the 51 `dflash/*` objects appended last, fused by rows, W8 under ninfer-v2 and
BF16 under bf16 (as MTP), the published drafter's values enforced for the published target, typed errors for the
rest; then the converted tiny artifact through startup to the engine.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from ninfer.artifact.formats import BF16, FP32, I32, Q4G64, Q5G64, Q6G64, W8G32, encoded_size
from ninfer.artifact.reader import Artifact
from ninfer.backends.cpu.runner import build_cpu_runner
from ninfer.cli.main import main
from ninfer.cli.serve import parse_serve_args
from ninfer.convert.plan import recipe_format
from ninfer.convert.qwen_hf import (FRONTEND_FILES, DFlashCheckpointError, SafetensorsCheckpoint, plan_qwen_checkpoint,
                                    plan_qwen_tensor_specs)
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import PreparedPrompt, RequestOptions
from ninfer.models.loader import build_model
from ninfer.nursery.startup import load_model_stack, server_start_record, weights_bytes
from ninfer.observability.records import speculative_record
from ninfer.targets.dims import DFLASH_DIMENSIONS_RESOURCE, DIMENSIONS_RESOURCE, DFlashDims, dflash_dims_from_json
from ninfer.targets.registry import (QWEN36_35B_A3B_DFLASH_DIMS, QWEN36_35B_A3B_DIMS, TargetMismatchError,
                                     resolve_dflash_dims)
from tests.support.qwen_checkpoints import REAL_DFLASH_CONFIG, TINY_DFLASH_CONFIG, build_dflash_checkpoint, plan_dims

W8 = W8G32
DFLASH_BYTES_35B = 410_053_632  # ninfer-facts §2.10: the DFlash component of the 35B tensor payload


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory) -> Path:
    return build_dflash_checkpoint(tmp_path_factory.mktemp("dflash") / "drafter", TINY_DFLASH_CONFIG)


@pytest.fixture(scope="module")
def target_35b(shape_only) -> Path:
    return shape_only("Qwen3.6-35B-A3B")


@pytest.fixture(scope="module")
def plan(moe_checkpoint, tiny_drafter):
    return plan_qwen_checkpoint(moe_checkpoint, dflash_dir=tiny_drafter)


def dflash_objects(hidden: int, inter: int, layers: int, qkv: int, q: int, head: int, features: int) -> list:
    rows = [("dflash/feature_projection", (hidden, features), W8), ("dflash/context_norm", (hidden,), BF16)]
    for i in range(layers):
        p = f"dflash/layers/{i}/"
        rows += [(p + "input_norm", (hidden,), BF16), (p + "attention/query_key_value", (qkv, hidden), W8),
                 (p + "attention/query_norm", (head,), BF16), (p + "attention/key_norm", (head,), BF16),
                 (p + "attention/output", (hidden, q), W8), (p + "post_attention_norm", (hidden,), BF16),
                 (p + "mlp/gate_up", (2 * inter, hidden), W8), (p + "mlp/down", (hidden, inter), W8)]
    return rows + [("dflash/final_norm", (hidden,), BF16)]


def test_the_drafter_is_appended_last_with_its_dimensions(plan, tiny_drafter):
    tail = [(t.name, t.shape, t.v2_format) for t in plan.tensors[-19:]]
    assert tail == dflash_objects(64, 96, 2, qkv=64 + 2 * 32, q=64, head=16, features=2 * 64)
    assert not any(t.name.startswith("dflash/") for t in plan.tensors[:-19])
    assert [r.name for r in plan.resources] == [f"frontend/{n}" for n in FRONTEND_FILES] + [
        DIMENSIONS_RESOURCE, DFLASH_DIMENSIONS_RESOURCE]
    drafter = dflash_dims_from_json({r.name: r.data for r in plan.resources}[DFLASH_DIMENSIONS_RESOURCE])
    assert drafter == DFlashDims(hidden=64, intermediate=96, layer_types=("sliding_attention", "full_attention"),
                                 attn_heads=4, kv_heads=2, head_dim=16, block_size=16, mask_token_id=248077,
                                 target_layer_ids=(1, 2), sliding_window=32, rope_theta=1e7, rms_eps=1e-6)
    assert [(t.name, t.shape, t.v2_format) for t in plan.tensors] == [
        (s.name, s.shape, s.v2_format) for s in plan_qwen_tensor_specs(plan_dims(plan), drafter)]
    assert {recipe_format("bf16", t) for t in plan.tensors[-19:]} == {BF16}  # like MTP under bf16
    source = plan.source["dflash"]
    assert source["tensors"] == 3 + 11 * 2 and source["architecture"] == "DFlashDraftModel"
    assert "proxy" in plan.source["draft_head_ranking"]  # the shortlist ranking the report documents
    # Fused rows: q | k | v and gate | up, exactly the checkpoint's rows.
    checkpoint, produced = SafetensorsCheckpoint(tiny_drafter), {t.name: t for t in plan.tensors}
    np.testing.assert_array_equal(produced["dflash/layers/1/attention/query_key_value"].produce(), np.concatenate(
        [checkpoint.read(f"layers.1.self_attn.{x}_proj.weight") for x in "qkv"]))
    np.testing.assert_array_equal(produced["dflash/layers/0/mlp/gate_up"].produce(), np.concatenate(
        [checkpoint.read(f"layers.0.mlp.{x}_proj.weight") for x in ("gate", "up")]))
    np.testing.assert_array_equal(produced["dflash/context_norm"].produce(), checkpoint.read("hidden_norm.weight"))


def test_the_35b_inventory_with_the_published_drafter(target_35b, tmp_path):
    drafter = build_dflash_checkpoint(tmp_path / "drafter", REAL_DFLASH_CONFIG, shape_only=True)
    plan = plan_qwen_checkpoint(target_35b, dflash_dir=drafter)
    assert plan.model_id == "qwen3.6-35b-a3b" and len(plan.tensors) == 934
    assert [r.name for r in plan.resources] == [f"frontend/{n}" for n in FRONTEND_FILES]  # registered dimensions
    assert collections.Counter(t.v2_format for t in plan.tensors) == {
        BF16: 487, FP32: 60, I32: 1, Q4G64: 95, Q5G64: 91, Q6G64: 5, W8: 195}
    dflash = plan.tensors[-51:]
    assert [(t.name, t.shape, t.v2_format) for t in dflash] == dflash_objects(
        2048, 6144, 6, qkv=6144, q=4096, head=128, features=16384)
    assert sum(encoded_size(t.v2_format, t.shape) for t in dflash) == DFLASH_BYTES_35B
    assert [(t.name, t.shape, t.v2_format) for t in plan.tensors] == [
        (s.name, s.shape, s.v2_format) for s in plan_qwen_tensor_specs(QWEN36_35B_A3B_DIMS, QWEN36_35B_A3B_DFLASH_DIMS)]
    assert plan.source["dflash"]["tensors"] == 69


def test_drafter_dimensions_resolve_like_the_targets():
    """A published target's drafter is registered (an artifact's own record must agree); a custom one carries it."""
    record = QWEN36_35B_A3B_DFLASH_DIMS.to_json()
    assert dflash_dims_from_json(record) == QWEN36_35B_A3B_DFLASH_DIMS
    assert resolve_dflash_dims("qwen3.6-35b-a3b", None) == QWEN36_35B_A3B_DFLASH_DIMS
    tiny = dflash_dims_from_json(record.replace('"sliding_window":4096', '"sliding_window":64'))
    assert resolve_dflash_dims("qwen3.6-custom", tiny) == tiny
    with pytest.raises(TargetMismatchError, match="contradicts"):
        resolve_dflash_dims("qwen3.6-35b-a3b", tiny)


@pytest.mark.parametrize("change, message", [
    (dict(dflash_config=dict(mask_token_id=248070, target_layer_ids=[1, 6, 11, 16, 22, 27, 32, 37])),
     "mask_token_id is 248070, qwen3.6-35b-a3b's drafter has 248077"),
    (dict(dflash_config=dict(mask_token_id=248077, target_layer_ids=[1, 10, 19, 28, 37])),
     "target_layer_ids is (1, 10, 19, 28, 37)"),
    (dict(sliding_window=2048), "sliding_window is 2048"),
    (dict(block_size=8), "block_size is 8"),
    (dict(num_hidden_layers=8, layer_types=["sliding_attention"] * 7 + ["full_attention"]), "layer_types is"),
    (dict(num_key_value_heads=4), "kv_heads is 4"),
    (dict(num_hidden_layers=5), "num_hidden_layers 5 differs from the 6 entries of layer_types"),
    (dict(architectures=["DFlash2DraftModel"]), "is not ['DFlashDraftModel']"),
    (dict(is_causal=True), "is_causal must be false"),
    (dict(rms_norm_eps=None), "rms_norm_eps"),
])
def test_the_published_target_takes_only_the_published_drafter(target_35b, tmp_path, change, message):
    config = {key: value for key, value in dict(REAL_DFLASH_CONFIG, **change).items() if value is not None}
    drafter = build_dflash_checkpoint(tmp_path / "drafter", config, shape_only=True)
    with pytest.raises(DFlashCheckpointError) as raised:
        plan_qwen_checkpoint(target_35b, dflash_dir=drafter)
    assert message in str(raised.value)


@pytest.mark.parametrize("change, build, message", [
    (dict(dflash_config=dict(mask_token_id=248077, target_layer_ids=[1, 4])), {},
     "target_layer_ids [1, 4] must be distinct ascending layers of the target's 0..3"),
    (dict(hidden_size=32), {}, "hidden_size 32 differs from the target's 64"),
    (dict(num_target_layers=40), {}, "num_target_layers 40 differs from the target's 4"),
    (dict(dflash_config=dict(mask_token_id=248320, target_layer_ids=[1, 2])), {}, "mask_token_id 248320"),
    ({}, dict(drop=("layers.1.mlp.up_proj.weight",)), "missing tensor layers.1.mlp.up_proj.weight"),
    ({}, dict(extra={"lm_head.weight": (8, 64)}), "unknown tensor lm_head.weight"),
])
def test_a_custom_drafter_must_fit_the_tiny_target(moe_checkpoint, tmp_path, change, build, message):
    drafter = build_dflash_checkpoint(tmp_path / "drafter", dict(TINY_DFLASH_CONFIG, **change), shape_only=True,
                                      **build)
    with pytest.raises(DFlashCheckpointError) as raised:
        plan_qwen_checkpoint(moe_checkpoint, dflash_dir=drafter)
    assert message in str(raised.value)


def test_drafters_are_for_the_moe_target_only(dense_checkpoint, tiny_drafter, tmp_path, capsys):
    with pytest.raises(DFlashCheckpointError, match="35B-A3B .MoE. target only"):
        plan_qwen_checkpoint(dense_checkpoint, dflash_dir=tiny_drafter)
    code = main(["convert", str(dense_checkpoint), "--out", str(tmp_path / "x.ninfer"), "--dflash-model",
                 str(tiny_drafter), "--no-progress"])
    assert code == 1 and "this checkpoint is dense" in capsys.readouterr().err


def test_a_drafter_directory_needs_its_config_and_weights(moe_checkpoint, tmp_path):
    with pytest.raises(DFlashCheckpointError, match="needs config.json and model.safetensors"):
        plan_qwen_checkpoint(moe_checkpoint, dflash_dir=tmp_path)
    with pytest.raises(DFlashCheckpointError, match="not a directory"):
        plan_qwen_checkpoint(moe_checkpoint, dflash_dir=tmp_path / "missing")


def test_z_labs_repository_layout_is_found(moe_checkpoint, tmp_path):
    """The published repository keeps the BF16 safetensors in its dflash-bf16/ folder."""
    repository = tmp_path / "Qwen3.6-35B-A3B-DFlash"
    build_dflash_checkpoint(repository / "dflash-bf16", TINY_DFLASH_CONFIG, shape_only=True)
    (repository / "config.json").write_text(json.dumps(TINY_DFLASH_CONFIG))
    plan = plan_qwen_checkpoint(moe_checkpoint, dflash_dir=repository)
    assert plan.tensors[-1].name == "dflash/final_norm"


@pytest.fixture(scope="module")
def dflash_artifact(moe_checkpoint, tiny_drafter, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dflash-artifact") / "tiny.ninfer"
    assert main(["convert", str(moe_checkpoint), "--out", str(out), "--dflash-model", str(tiny_drafter),
                 "--no-progress"]) == 0
    return out


def test_the_converted_drafter_serves_with_spec_dflash(dflash_artifact):
    report = json.loads(dflash_artifact.with_name(dflash_artifact.name + ".conversion.json").read_text())
    assert report["source"]["dflash"]["tensors"] == 25 and "proxy" in report["source"]["draft_head_ranking"]
    options = parse_serve_args([str(dflash_artifact), "--spec", "dflash", "--draft-tokens", "4", "--greedy",
                                "--max-context", "512", "--prefill-chunk", "256", "--lm-head-draft"])
    stack = load_model_stack(options, dflash_artifact)
    assert stack.model.dflash is not None and stack.runner.info.draft_tokens == 4
    assert stack.weights_bytes == weights_bytes(stack.artifact, vision=False, dflash=True)
    assert stack.weights_bytes > weights_bytes(stack.artifact, vision=False, dflash=False)
    record = server_start_record(options, stack, None)
    assert record["engine"]["spec"] == "dflash" and record["arenas_bytes"]["sequence_state"] > 0
    text = stack.prompt_builder.tokenizer.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    prompt = PreparedPrompt(token_ids=text)
    with stack.engine:
        spec = stack.engine.submit(prompt, RequestOptions(max_tokens=12)).result(timeout=120)
    plain_config = EngineConfig(max_concurrency=1, max_context=512, prefill_chunk=256, greedy=True)
    model = build_model(Artifact.open(dflash_artifact))
    with Engine(build_cpu_runner(model, plain_config), plain_config, stack.target.sampling) as engine:
        plain = engine.submit(prompt, RequestOptions(max_tokens=12)).result(timeout=120)
    assert spec.error is None and spec.tokens == plain.tokens
    logged = speculative_record(options.spec, spec.usage.speculative)  # the request log's speculative counters
    assert logged["backend"] == "dflash" and logged["draft_window"] == 4
    assert logged["rounds"] + logged["accepted_tokens"] + logged["fallback_steps"] == len(spec.tokens) - 1
