"""Session fixtures: the Qwen tokenizer.json and tiny Qwen3.5/3.6 checkpoints, each built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.qwen_checkpoints import QwenCase, build_qwen_checkpoint, build_shape_only_checkpoint
from tests.support.qwen_tokenizer import build_qwen_tokenizer_json


@pytest.fixture(scope="session")
def qwen_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen_tokenizer_json(tmp_path_factory.mktemp("qwen-tokenizer") / "tokenizer.json")


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_json: Path) -> Path:
    """Tiny Qwen3_5ForConditionalGeneration, one safetensors file."""
    return build_qwen_checkpoint(tmp_path_factory.mktemp("qwen-dense"), moe=False, tokenizer_json=qwen_tokenizer_json)


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_json: Path) -> Path:
    """Tiny Qwen3_5MoeForConditionalGeneration in three shards with model.safetensors.index.json."""
    return build_qwen_checkpoint(tmp_path_factory.mktemp("qwen-moe"), moe=True, tokenizer_json=qwen_tokenizer_json,
                                 shards=3)


@pytest.fixture(scope="session")
def shape_only(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_json: Path):
    """Full-size sparse checkpoints of the official configs (`shape_only("Qwen3.6-35B-A3B")`), built once each."""
    built: dict[str, Path] = {}

    def get(fixture: str) -> Path:
        if fixture not in built:
            built[fixture] = build_shape_only_checkpoint(tmp_path_factory.mktemp(fixture), fixture,
                                                         tokenizer_json=qwen_tokenizer_json)
        return built[fixture]

    return get


@pytest.fixture(scope="session", params=["dense", "moe"])
def qwen_case(request: pytest.FixtureRequest, qwen_tokenizer_json: Path) -> QwenCase:
    return QwenCase(request.param, request.getfixturevalue(f"{request.param}_checkpoint"), qwen_tokenizer_json)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests run only where an NVIDIA GPU is present (the device machine); CI has none and skips them."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    from ninfer.backends.cuda_probe import cuda_device_count

    if not gpu_items or cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in gpu_items:
        item.add_marker(skip)
