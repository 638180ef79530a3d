"""What a converter produces before anything is written: the ordered objects of one artifact.

A source-specific planner (Hugging Face Qwen checkpoint, GGUF llama) returns a ConversionPlan whose tensors load
lazily: `produce()` reads one source tensor (or a few, for fused objects), applies the transform and returns it, so
the driver holds at most one object in memory at a time.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import numpy as np

BF16 = "BF16"
FP32 = "FP32"
I32 = "I32"
QUANTIZED = ("Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S")
RECIPES = ("bf16", "ninfer-v2")


class RecipeError(ValueError):
    """Unknown recipe, or a format a recipe cannot store."""


@attrs.frozen
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    v2_format: str  # the format under the ninfer-v2 recipe (the original per-role quantization)
    produce: Callable[[], np.ndarray] = attrs.field(eq=False, repr=False)


@attrs.frozen
class PlannedResource:
    name: str
    data: bytes = attrs.field(repr=False)


@attrs.frozen
class ConversionPlan:
    model_id: str
    resources: tuple[PlannedResource, ...]
    tensors: tuple[PlannedTensor, ...]
    source: dict[str, Any]  # description for the conversion report (paths, source kind, config digest, ...)
    target_key: str = ""  # e.g. "qwen3_6_27b"; recipe ids in the report are f"{target_key}-v2"


# Tensors that only propose tokens the full output head then verifies: their precision moves the acceptance rate,
# never the output, so every recipe stores them in their ninfer-v2 format (§3.9's shortlist head is Q4: a third of
# the bf16 bytes each MTP / DFlash proposal reads).
PROPOSAL_ONLY = frozenset({"text/draft_head"})


def recipe_format(recipe: str, tensor: Any) -> str:
    """The storage format of `tensor` (anything with a `name` and a `v2_format`) under `recipe`: bf16 keeps FP32/I32
    and the proposal-only tensors' formats and stores everything else as BF16."""
    v2_format = tensor.v2_format
    if recipe not in RECIPES:
        raise RecipeError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if v2_format not in (BF16, FP32, I32) + QUANTIZED:
        raise RecipeError(f"unknown tensor format {v2_format!r}")
    if recipe == "bf16" and v2_format in QUANTIZED and tensor.name not in PROPOSAL_ONLY:
        return BF16
    return v2_format
