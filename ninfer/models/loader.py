"""Open an artifact and build the CPU model its model_id names."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ninfer.artifact.reader import Artifact
from ninfer.models.base import CausalLM
from ninfer.targets.dims import (DFLASH_DIMENSIONS_RESOURCE, DIMENSIONS_RESOURCE, DFlashDims, LlamaDims, ModelDims,
                                 QwenDims, dflash_dims_from_json, dims_from_json)
from ninfer.targets.registry import resolve_dflash_dims, resolve_dims


class ArtifactWeights:
    """A WeightSource over an open artifact: each tensor is dequantized to fp32 once, on first use."""

    def __init__(self, artifact: Artifact) -> None:
        self._artifact = artifact
        self._cache: dict[str, np.ndarray] = {}

    def get(self, name: str) -> np.ndarray:
        array = self._cache.get(name)
        if array is None:
            array = self._artifact.tensor(name).to_numpy()
            self._cache[name] = array
        return array

    def has(self, name: str) -> bool:
        return name in self._artifact


def artifact_dims(artifact: Artifact) -> ModelDims:
    """The dimensions the artifact is served with (registered target, checked against what it carries)."""
    carried = dims_from_json(artifact.resource(DIMENSIONS_RESOURCE)) if DIMENSIONS_RESOURCE in artifact else None
    return resolve_dims(artifact.model_id, carried)


VISION_PREFIX = "vision/"


def has_vision_weights(artifact: Artifact) -> bool:
    """The artifact carries a Vision tower: Qwen dimensions with a vision record and the `vision/...` objects."""
    dims = artifact_dims(artifact)
    return (isinstance(dims, QwenDims) and dims.vision is not None
            and any(entry.name.startswith(VISION_PREFIX) for entry in artifact.objects))


DFLASH_PREFIX = "dflash/"


def artifact_dflash_dims(artifact: Artifact) -> DFlashDims | None:
    """The DFlash drafter's dimensions when the artifact carries one (its `dflash/...` objects), else None."""
    if not any(entry.name.startswith(DFLASH_PREFIX) for entry in artifact.objects):
        return None
    carried = dflash_dims_from_json(artifact.resource(DFLASH_DIMENSIONS_RESOURCE)) \
        if DFLASH_DIMENSIONS_RESOURCE in artifact else None
    dims = resolve_dflash_dims(artifact.model_id, carried)
    if dims is None:
        raise ValueError(f"{artifact.model_id}: the artifact has dflash/... objects but no drafter dimensions "
                         f"({DFLASH_DIMENSIONS_RESOURCE})")
    return dims


def build_model(artifact: Artifact, *, vision: bool = False, dflash: bool = False) -> CausalLM:
    """The CPU model; `vision` also builds the Qwen Vision tower and `dflash` the DFlash drafter (ValueError when
    the artifact has none)."""
    dims = artifact_dims(artifact)
    weights = ArtifactWeights(artifact)
    if vision and not has_vision_weights(artifact):
        raise ValueError(f"{artifact.model_id}: the artifact has no Vision tower (no vision/... weights)")
    drafter = artifact_dflash_dims(artifact) if dflash else None
    if dflash and drafter is None:
        raise ValueError(f"{artifact.model_id}: the artifact has no DFlash drafter (no dflash/... weights)")
    if isinstance(dims, QwenDims):
        from ninfer.models.qwen3_6 import Qwen36Model

        return Qwen36Model(dims, weights, vision=vision, dflash=drafter)
    if isinstance(dims, LlamaDims):
        from ninfer.models.llama import LlamaModel

        return LlamaModel(dims, weights)
    raise TypeError(f"no CPU model for dimensions of type {type(dims).__name__}")


def load_model(path: str | Path) -> CausalLM:
    """Open `path` (kept open for the model's lifetime: weights are read lazily) and build its CPU model."""
    return build_model(Artifact.open(path))
