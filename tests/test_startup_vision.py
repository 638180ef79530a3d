"""Startup with --vision: the Vision tower is built into the CPU model and runner, the media preparer is sized from
the options, and an artifact without Vision weights is refused with a clear StartupError.

The vision artifact is the tiny dense checkpoint (vision depth 2, patch 4) converted by the real converter, so its
frontend resources are the real ones; an image goes data: URL -> media preparer -> PromptMedia -> engine.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from ninfer.cli.serve import parse_serve_args
from ninfer.convert.driver import convert
from ninfer.convert.qwen_hf import plan_qwen_checkpoint
from ninfer.engine.request import PreparedPrompt, PromptMedia, RequestOptions
from ninfer.media.positions import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, assign_positions, token_types
from ninfer.media.prepare import MediaItem, MediaPreparer
from ninfer.nursery.startup import StartupError, load_model_stack, unsupported_options, weights_bytes
from tests.support.tiny_vision_artifact import write_tiny_vision_artifact


@pytest.fixture(scope="module")
def vision_artifact(dense_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("startup-vision") / "tiny.ninfer"
    convert(plan_qwen_checkpoint(dense_checkpoint), out, "bf16", progress=False)
    return out


def options(artifact, *extra: str):
    return parse_serve_args([str(artifact), "--max-context", "2048", "--prefill-chunk", "512", *extra])


def test_vision_is_no_longer_an_unsupported_option(vision_artifact):
    assert not any("--vision" in problem for problem in unsupported_options(options(vision_artifact, "--vision")))


def test_vision_builds_the_tower_and_the_media_preparer(vision_artifact):
    parsed = options(vision_artifact, "--vision", "--media-cache-mib", "3", "--media-live-mib", "5",
                     "--media-preprocess-threads", "2")
    stack = load_model_stack(parsed, vision_artifact)
    preparer = stack.media_preparer
    try:
        assert isinstance(preparer, MediaPreparer)
        assert stack.runner.info.vision and stack.engine.vision and stack.model.vision_tower is not None
        assert preparer._cache.cache_limit == 3 << 20 and preparer._cache.live_limit == 5 << 20
        assert preparer._pool._max_workers == 2
        assert preparer.budgets.max_vision_tokens == 2048
        vision = stack.model.dims.vision
        for config in (preparer._image, preparer._video):  # the artifact's configs, with the tower's patch geometry
            assert (config.patch_size, config.temporal_patch_size, config.merge_size) == \
                (vision.patch, vision.temporal_patch, vision.spatial_merge)
        assert preparer._image.min_pixels == 65536  # the rest comes from frontend/preprocessor_config.json
        assert stack.weights_bytes == weights_bytes(stack.artifact)

        # data: URL -> prepared payload -> PromptMedia -> the engine (the Vision rows replace the pads).
        from PIL import Image

        png = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(png, "PNG")
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        with preparer.prepare([MediaItem("image", url)]) as prepared:
            payload, handle = prepared.payloads[0], prepared.handles[0]
            text = stack.prompt_builder.tokenizer.encode("Describe:")
            ids = list(text) + [VISION_START_ID] + [IMAGE_PAD_ID] * payload.num_tokens + [VISION_END_ID]
            positions, _ = assign_positions(token_types(ids), [payload.grid])
            columns = np.flatnonzero(np.array(ids) == IMAGE_PAD_ID)
            media = PromptMedia(modality="image", digest=handle.key.digest, grid=payload.grid,
                                patches=payload.patches, columns=columns)
            prompt = PreparedPrompt(token_ids=ids, positions=positions, media=(media,))
            with stack.engine:
                done = stack.engine.submit(prompt, RequestOptions(max_tokens=2)).result(timeout=120)
        assert done.error is None and len(done.tokens) == 2 and done.usage.timings.vision > 0
    finally:
        preparer.close()


def test_without_vision_nothing_is_built(vision_artifact):
    stack = load_model_stack(options(vision_artifact), vision_artifact)
    assert stack.media_preparer is None
    assert not stack.runner.info.vision and stack.model.vision_tower is None
    assert stack.weights_bytes == weights_bytes(stack.artifact, vision=False) < weights_bytes(stack.artifact)


def test_vision_needs_vision_weights(tmp_path):
    artifact = write_tiny_vision_artifact(tmp_path / "text.ninfer", vision=False)
    with pytest.raises(StartupError, match="no Vision tower weights"):
        load_model_stack(options(artifact, "--vision"), artifact)
