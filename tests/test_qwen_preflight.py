"""What the Hugging Face planner refuses, each with an error that names the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from ninfer.convert.qwen_hf import CheckpointError, plan_qwen_checkpoint
from ninfer.targets.registry import TargetMismatchError, UnknownModelError


def clone(source: Path, dest: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """A checkpoint directory of symlinks, so single files can be replaced or left out cheaply."""
    dest.mkdir()
    for path in source.iterdir():
        if path.name not in skip:
            (dest / path.name).symlink_to(path)
    return dest


def edit_config(directory: Path, change: Callable[[dict], None]) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").unlink()
    (directory / "config.json").write_text(json.dumps(config))


def test_explicit_model_id_must_match_the_checkpoint(dense_checkpoint: Path) -> None:
    with pytest.raises(TargetMismatchError, match="refuses checkpoints whose config does not match"):
        plan_qwen_checkpoint(dense_checkpoint, model_id="qwen3.6-27b")
    with pytest.raises(TargetMismatchError, match="llama"):
        plan_qwen_checkpoint(dense_checkpoint, model_id="smollm2-135m-instruct")
    with pytest.raises(UnknownModelError):
        plan_qwen_checkpoint(dense_checkpoint, model_id="qwen9-1t")
    assert plan_qwen_checkpoint(dense_checkpoint, model_id="qwen3.6-custom").model_id == "qwen3.6-custom"


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["text_config"]["layer_types"].reverse(), "layer_types"),
    (lambda c: c["text_config"].update(attn_output_gate=False), "attn_output_gate"),
    (lambda c: c["text_config"].update(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype"),
    (lambda c: c.update(architectures=["Qwen3NextForCausalLM"]), "architectures"),
    (lambda c: c.update(model_type="qwen3_5_moe"), "model_type"),
    (lambda c: c["text_config"].update(mtp_num_hidden_layers=2), "mtp_num_hidden_layers"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[3, 3, 3]), "mrope_section"),
    (lambda c: c["vision_config"].update(deepstack_visual_indexes=[1]), "deepstack"),
])
def test_refuses_configs_it_cannot_serve(dense_checkpoint: Path, tmp_path: Path, change, message: str) -> None:
    directory = clone(dense_checkpoint, tmp_path / "ckpt")
    edit_config(directory, change)
    with pytest.raises(CheckpointError, match=message):
        plan_qwen_checkpoint(directory)


def test_refuses_a_missing_frontend_file(dense_checkpoint: Path, tmp_path: Path) -> None:
    directory = clone(dense_checkpoint, tmp_path / "ckpt", skip=("video_preprocessor_config.json",))
    with pytest.raises(CheckpointError, match="missing frontend file video_preprocessor_config.json"):
        plan_qwen_checkpoint(directory)


def test_refuses_a_missing_chat_template(dense_checkpoint: Path, tmp_path: Path) -> None:
    directory = clone(dense_checkpoint, tmp_path / "ckpt", skip=("chat_template.jinja", "tokenizer_config.json"))
    config = json.loads((dense_checkpoint / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="chat_template"):
        plan_qwen_checkpoint(directory)


def add_shard(directory: Path, tensors: dict[str, np.ndarray]) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({n: torch.from_numpy(v).bfloat16() for n, v in tensors.items()}, str(directory / "extra.safetensors"))
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "extra.safetensors" for name in tensors})
    (directory / "model.safetensors.index.json").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_refuses_leftover_unknown_tensors(moe_checkpoint: Path, tmp_path: Path) -> None:
    directory = clone(moe_checkpoint, tmp_path / "ckpt")
    add_shard(directory, {"model.language_model.layers.0.mlp.router_bias": np.zeros(8, np.float32)})
    with pytest.raises(CheckpointError, match="unknown tensor model.language_model.layers.0.mlp.router_bias"):
        plan_qwen_checkpoint(directory)


def test_refuses_missing_and_misshapen_tensors(moe_checkpoint: Path, tmp_path: Path) -> None:
    directory = clone(moe_checkpoint, tmp_path / "ckpt")
    index = json.loads((moe_checkpoint / "model.safetensors.index.json").read_text())
    dropped = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != dropped}
    (directory / dropped).unlink()
    (directory / "model.safetensors.index.json").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing tensor"):
        plan_qwen_checkpoint(directory)

    directory = clone(moe_checkpoint, tmp_path / "ckpt2")
    index = json.loads((moe_checkpoint / "model.safetensors.index.json").read_text())
    name = "model.language_model.norm.weight"
    shard = index["weight_map"][name]
    (directory / shard).unlink()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(moe_checkpoint / shard))
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(directory / shard))
    with pytest.raises(CheckpointError, match=r"model.language_model.norm.weight has shape \[63\]"):
        plan_qwen_checkpoint(directory)


def test_refuses_an_index_that_does_not_match_its_shards(moe_checkpoint: Path, tmp_path: Path) -> None:
    directory = clone(moe_checkpoint, tmp_path / "ckpt")
    index = json.loads((moe_checkpoint / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.language_model.phantom.weight"] = next(iter(index["weight_map"].values()))
    (directory / "model.safetensors.index.json").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not match the shards"):
        plan_qwen_checkpoint(directory)
