"""Placeholder expansion and MRoPE positions vs transformers' Qwen3_5Model.get_rope_index (exact integers)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from ninfer.media import (
    IMAGE_PAD_ID,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    PositionError,
    assign_positions,
    expand_image_placeholders,
    image_placeholder_ids,
    token_types,
)

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _hf_rope_index(ids, image_grids=None, video_grids=None):
    # get_rope_index only reads config.vision_config.spatial_merge_size and calls get_vision_position_ids.
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)))
    fake.get_vision_position_ids = functools.partial(qwen3_5.Qwen3_5Model.get_vision_position_ids, fake)
    input_ids = torch.tensor([ids], dtype=torch.long)
    types = torch.from_numpy(token_types(ids).astype(np.int32))[None]
    kw = {}
    if image_grids:
        kw["image_grid_thw"] = torch.tensor(image_grids, dtype=torch.long)
    if video_grids:
        kw["video_grid_thw"] = torch.tensor(video_grids, dtype=torch.long)
    pos, delta = qwen3_5.Qwen3_5Model.get_rope_index(fake, input_ids, types, **kw)
    return pos[:, 0].numpy(), int(delta.reshape(-1)[0])


def _prompt(grids):
    # text, then for each image the template's <|vision_start|><|image_pad|><|vision_end|> and more text
    ids = [248045, 872, 198, 11, 12]
    for i, _ in enumerate(grids):
        ids += [VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID] + list(range(100 + i, 103 + 2 * i))
    return ids + [248046, 198]


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 16, 16)],
        [(1, 4, 38)],
        [(1, 62, 2)],
        [(1, 30, 40), (1, 16, 16)],
        [(1, 2, 2), (1, 68, 120)],
    ],
)
def test_positions_match_hf(grids):
    ids = expand_image_placeholders(_prompt(grids), grids)
    assert sum(1 for t in ids if t == IMAGE_PAD_ID) == sum(t * h * w // 4 for t, h, w in grids)
    pos, delta = assign_positions(token_types(ids), grids)
    ref_pos, ref_delta = _hf_rope_index(ids, image_grids=grids)
    assert pos.shape == (3, len(ids)) and pos.dtype == np.int64
    np.testing.assert_array_equal(pos, ref_pos)
    assert delta == ref_delta
    assert delta == int(pos.max()) + 1 - len(ids)


def test_video_slices_match_hf():
    # Video expansion per §5.5: per temporal pair "<ts seconds><|vision_start|>pads<|vision_end|>".
    image = (1, 8, 12)
    video = (3, 6, 4)
    ids = [1, 2] + image_placeholder_ids(image) + [3]
    ids += [VISION_START_ID]
    for t in range(video[0]):
        ids += [50 + t, 51, VISION_START_ID] + [VIDEO_PAD_ID] * (video[1] * video[2] // 4) + [VISION_END_ID]
    ids += [VISION_END_ID, 4, 5]
    pos, delta = assign_positions(token_types(ids), [image, video])
    ref_pos, ref_delta = _hf_rope_index(ids, image_grids=[image], video_grids=[video])
    np.testing.assert_array_equal(pos, ref_pos)
    assert delta == ref_delta


def test_text_only_is_plain_positions():
    pos, delta = assign_positions(np.zeros(7, dtype=np.int8), [])
    np.testing.assert_array_equal(pos, np.tile(np.arange(7), (3, 1)))
    assert delta == 0


def test_placeholder_helpers():
    assert image_placeholder_ids((1, 4, 6)) == [VISION_START_ID] + [IMAGE_PAD_ID] * 6 + [VISION_END_ID]
    ids = [7, VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID, 8]
    assert expand_image_placeholders(ids, [(1, 4, 6)]) == [7] + image_placeholder_ids((1, 4, 6)) + [8]


def test_errors():
    ids = [7, VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID, 8]
    with pytest.raises(PositionError):
        expand_image_placeholders(ids, [])
    with pytest.raises(PositionError):
        expand_image_placeholders(ids, [(1, 2, 2), (1, 2, 2)])
    with pytest.raises(PositionError):
        expand_image_placeholders([7, IMAGE_PAD_ID, 8], [(1, 2, 2)])
    with pytest.raises(PositionError):  # run length disagrees with grid
        assign_positions([0, 1, 1, 0], [(1, 4, 4)])
    with pytest.raises(PositionError):  # grid left over
        assign_positions([0, 1, 0], [(1, 2, 2), (1, 2, 2)])
    with pytest.raises(PositionError):  # media run without grid
        assign_positions([0, 1, 0], [])
