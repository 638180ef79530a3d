"""Target registry: the published geometries, the custom targets, and clear failures."""

import json
from pathlib import Path

import pytest

from ninfer.targets.dims import DimensionsError, dims_from_json, qwen_dims_from_hf_config
from ninfer.targets.registry import (QWEN36_27B_DIMS, QWEN36_35B_A3B_DIMS, TargetMismatchError, UnknownModelError,
                                     lookup_target, resolve_dims, target_for_qwen_dims)

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"


def config(model: str) -> dict:
    return json.loads((FIXTURES / model / "config.json").read_text())


@pytest.mark.parametrize("model,dims,model_id", [("Qwen3.6-27B", QWEN36_27B_DIMS, "qwen3.6-27b"),
                                                 ("Qwen3.8-27B", QWEN36_27B_DIMS, "qwen3.6-27b"),
                                                 ("Qwen3.6-35B-A3B", QWEN36_35B_A3B_DIMS, "qwen3.6-35b-a3b")])
def test_official_configs_have_the_registered_geometry(model, dims, model_id):
    parsed = qwen_dims_from_hf_config(config(model))
    assert parsed == dims
    assert target_for_qwen_dims(parsed) == model_id


def test_registered_dimensions_are_the_published_ones():
    d = QWEN36_27B_DIMS
    assert (d.hidden, d.layers, d.q_width, d.kv_width, d.gdn_conv_channels, d.intermediate) == (
        5120, 64, 6144, 1024, 10240, 17408)
    assert d.full_attention_layers() == list(range(3, 64, 4))
    m = QWEN36_35B_A3B_DIMS
    assert (m.hidden, m.layers, m.q_width, m.kv_width, m.gdn_conv_channels, m.moe_experts, m.moe_top_k) == (
        2048, 40, 4096, 512, 8192, 256, 8)
    assert lookup_target("qwen3.8-27b").dims == QWEN36_27B_DIMS


def test_small_configs_are_custom_and_round_trip_through_the_resource():
    small = qwen_dims_from_hf_config(config("Qwen3.5-0.8B"))
    assert target_for_qwen_dims(small) == "qwen3.6-custom"
    assert dims_from_json(small.to_json()) == small
    assert resolve_dims("qwen3.6-custom", small) == small


def test_unknown_model_id_fails_with_the_known_ones_listed():
    with pytest.raises(UnknownModelError, match="qwen3.6-27b"):
        lookup_target("qwen9-1t")


def test_custom_target_needs_its_dimensions_and_published_ones_must_agree():
    with pytest.raises(TargetMismatchError):
        resolve_dims("qwen3.6-custom", None)
    small = qwen_dims_from_hf_config(config("Qwen3.5-0.8B"))
    with pytest.raises(TargetMismatchError):
        resolve_dims("qwen3.6-27b", small)
    assert resolve_dims("qwen3.6-27b", None) == QWEN36_27B_DIMS
    with pytest.raises(TargetMismatchError):
        resolve_dims("llama-custom", small)


@pytest.mark.parametrize("text", ["{", "{}", '{"family":"qwen3_6"}', '{"family":"gpt"}', "[]"])
def test_malformed_dimension_records_are_typed_errors(text):
    with pytest.raises(DimensionsError):
        dims_from_json(text)


def test_config_missing_fields_is_a_typed_error():
    cfg = config("Qwen3.6-27B")
    del cfg["text_config"]["head_dim"]
    with pytest.raises(DimensionsError, match="head_dim"):
        qwen_dims_from_hf_config(cfg)
