"""Tiny Qwen models with a Vision tower, for the engine and startup tests of the media path.

`tiny_vision_qwen` is the CPU runner tests' random 4-layer model (512-token vocabulary) plus a one-block Vision tower
whose output width is the text hidden size; `write_tiny_vision_artifact` writes it as a real `.ninfer` file (the
dimensions resource, every planned tensor, the Vision ones included, and optionally frontend resources).
`media_prompt` lays out a prompt of text runs and media items with their §3.12 positions and `PromptMedia` records.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import attrs
import numpy as np

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.artifact.writer import ResourceSpec, TensorSpec, write_artifact
from ninfer.convert.plan import recipe_format
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs
from ninfer.engine.request import PreparedPrompt, PromptMedia
from ninfer.media.positions import assign_positions
from ninfer.models.qwen3_6 import Qwen36Model
from ninfer.targets.dims import DIMENSIONS_RESOURCE, QwenDims, VisionDims
from tests.test_runner_cpu import tiny_qwen, tiny_qwen_dims

IMAGE_PAD, VIDEO_PAD = 450, 451  # placeholder ids inside the tiny vocabulary (any id works: overrides replace them)
TYPES = {"image": 1, "video": 2}


def tiny_vision_dims(*, moe: bool = False) -> QwenDims:
    """`tiny_qwen_dims` plus a Vision tower: 1 block of width 16 (2 heads of 8), 2x2 patches, temporal pairs, a 4x4
    position table, merged tokens of the text width (32)."""
    text = tiny_qwen_dims(moe=moe)
    return attrs.evolve(text, vision=VisionDims(depth=1, hidden=16, intermediate=32, heads=2, patch=2,
                                                temporal_patch=2, spatial_merge=2, position_table=16,
                                                out_hidden=text.hidden))


def tiny_vision_qwen(*, moe: bool = False, seed: int = 0, vision: bool = True) -> Qwen36Model:
    dims = tiny_vision_dims(moe=moe)
    weights = tiny_qwen(dims=dims, seed=seed)._weights
    return Qwen36Model(dims, weights, vision=vision)


def write_tiny_vision_artifact(path: Path, *, moe: bool = False, recipe: str = "bf16", seed: int = 0,
                               vision: bool = True, resources: dict[str, bytes] | None = None) -> Path:
    """A `qwen3.6-custom` artifact of the tiny vision model; `vision=False` leaves the Vision tower out (dimensions
    and tensors). `resources` adds more resources (e.g. the frontend files)."""
    dims = tiny_vision_dims(moe=moe)
    weights = tiny_qwen(dims=dims, seed=seed)._weights
    if not vision:
        dims = attrs.evolve(dims, vision=None)
    encoded = dims.to_json().encode()
    items = [(ResourceSpec(DIMENSIONS_RESOURCE, len(encoded)), encoded)]
    for name, data in (resources or {}).items():
        items.append((ResourceSpec(name, len(data)), data))
    for spec in plan_qwen_tensor_specs(dims):
        value = np.asarray(weights.get(spec.name))
        items.append((TensorSpec(spec.name, value.shape, recipe_format(recipe, spec)), value))
    write_artifact(path, "qwen3.6-custom", items)
    return path


def media_item(modality: str, grid: tuple[int, int, int], columns: Sequence[int], *, seed: int,
               patch_row: int) -> PromptMedia:
    """A PromptMedia with random bf16 patches; its digest is a function of `seed`, so equal seeds are the same
    media (identity) and different seeds different media."""
    t, h, w = grid
    patches = np.random.default_rng(seed).uniform(-1, 1, (t * h * w, patch_row)).astype(np.float32)
    digest = hashlib.sha256(f"media-{seed}".encode()).hexdigest()
    return PromptMedia(modality=modality, digest=digest, grid=grid, patches=f32_to_bf16_bits(patches),
                       columns=columns)


def media_prompt(parts: Sequence, *, patch_row: int, merge: int = 2, **prompt_fields) -> PreparedPrompt:
    """A prompt from `parts`: lists of text ids, and media tuples `(modality, grid, seed)` or, for a video whose
    temporal slices are separated by text, `("video", grid, seed, [gap ids between slices])`. Positions follow
    ninfer-facts §3.12 (`assign_positions`)."""
    ids: list[int] = []
    types: list[int] = []
    media: list[tuple[str, tuple[int, int, int], int, list[int]]] = []
    for part in parts:
        if isinstance(part, tuple):
            modality, grid, seed = part[:3]
            gap = list(part[3]) if len(part) > 3 else [300]  # a video's slices are separate runs
            t, h, w = grid
            per_slice = h * w // (merge * merge)
            pad = IMAGE_PAD if modality == "image" else VIDEO_PAD
            columns = []
            slices = t if modality == "video" else 1
            for s in range(slices):
                if s and gap:
                    ids += gap
                    types += [0] * len(gap)
                count = per_slice if modality == "video" else t * per_slice
                columns += range(len(ids), len(ids) + count)
                ids += [pad] * count
                types += [TYPES[modality]] * count
            media.append((modality, grid, seed, columns))
        else:
            ids += list(part)
            types += [0] * len(part)
    grids = [grid for _, grid, _, _ in media]
    positions, _ = assign_positions(types, grids, merge)
    items = [media_item(modality, grid, columns, seed=seed, patch_row=patch_row)
             for modality, grid, seed, columns in media]
    return PreparedPrompt(token_ids=ids, positions=positions, media=items, **prompt_fields)
