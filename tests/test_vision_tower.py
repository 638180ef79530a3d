"""The CPU Vision tower (ninfer.models.qwen3_6_vision) against transformers' Qwen3_5VisionModel.

Both sides use the same BF16-representable weights of the tiny `dense_checkpoint` (vision: depth 2, hidden 32,
2 heads, patch 4, 4x4 position table, out_hidden 64): ninfer's through the real conversion plan materialised under
the bf16 recipe, transformers' from the checkpoint itself. fp32 math on both sides, so the tolerance is tight.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from ninfer.convert.qwen_hf import plan_qwen_checkpoint
from ninfer.models.qwen3_6_vision import VisionTower, gelu_exact
from tests.support.qwen_checkpoints import load_hf_model, materialise, plan_dims

# Two images of different grids (one larger than the 4x4 table: upsampling, one smaller), and a 2-slice video.
GRIDS = [(1, 4, 6), (2, 4, 4), (1, 2, 2), (1, 6, 8)]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def towers(dense_checkpoint):
    plan = plan_qwen_checkpoint(dense_checkpoint)
    vision_only = attrs.evolve(plan, tensors=tuple(t for t in plan.tensors if t.name.startswith("vision/")))
    dims = plan_dims(plan).vision
    return VisionTower(dims, materialise(vision_only, "bf16")), load_hf_model(dense_checkpoint).model.visual


def _hf_encode(visual, patches: np.ndarray, grids) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = visual(torch.from_numpy(patches), grid_thw=torch.tensor(grids, dtype=torch.int64))
    return out.pooler_output.numpy()


def test_vision_tower_matches_transformers(towers):
    ours, visual = towers
    dims = ours.dims
    rng = np.random.default_rng(1)
    n = sum(t * h * w for t, h, w in GRIDS)
    patches = rng.uniform(-1.0, 1.0, (n, dims.patch_row)).astype(np.float32)
    got = ours.encode(patches, GRIDS)
    want = _hf_encode(visual, patches, GRIDS)
    assert got.shape == want.shape == (n // dims.spatial_merge**2, dims.out_hidden)
    err = float(np.max(np.abs(got - want)))
    print(f"vision tower max abs error vs transformers: {err:.3e} (output max |x| {np.max(np.abs(want)):.3f})")
    assert err < TOLERANCE


def test_items_are_independent(towers):
    """Attention is segmented per (item, temporal slice): encoding items one at a time gives the same rows."""
    ours, _ = towers
    rng = np.random.default_rng(2)
    sizes = [t * h * w for t, h, w in GRIDS]
    patches = rng.uniform(-1.0, 1.0, (sum(sizes), ours.dims.patch_row)).astype(np.float32)
    together = ours.encode(patches, GRIDS)
    parts, start = [], 0
    for grid, size in zip(GRIDS, sizes):
        parts.append(ours.encode(patches[start:start + size], [grid]))
        start += size
    np.testing.assert_allclose(together, np.concatenate(parts), rtol=0, atol=1e-5)


def test_rejects_bad_input(towers):
    ours, _ = towers
    row = ours.dims.patch_row
    with pytest.raises(ValueError):
        ours.encode(np.zeros((16, row), np.float32), [(1, 4, 6)])  # grid covers 24 patches
    with pytest.raises(ValueError):
        ours.encode(np.zeros((9, row), np.float32), [(1, 3, 3)])  # not a multiple of the merge size
    with pytest.raises(ValueError):
        ours.encode(np.zeros((4, row + 1), np.float32), [(1, 2, 2)])


def test_gelu_exact_matches_erf():
    import math

    x = np.linspace(-8.0, 8.0, 4001).astype(np.float32)
    want = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x.astype(np.float64)])
    assert np.max(np.abs(gelu_exact(x) - want)) < 2e-6
