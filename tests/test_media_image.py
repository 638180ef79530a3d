"""Image preprocessing parity with transformers' Qwen2-VL image processor (PIL backend, built offline from the
official Qwen3.6 preprocessor_config.json).  Tolerance: exact (max |diff| == 0 in float32)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageOps  # noqa: E402

from ninfer.media import (  # noqa: E402
    AspectRatioError,
    ImageDecodeError,
    ImagePreprocessConfig,
    MediaError,
    decode_image,
    preprocess_image,
    smart_resize,
)

FIXTURE = Path(__file__).parent / "fixtures" / "qwen" / "Qwen3.6-27B"
ATOL = 0.0  # measured: bit-identical float32 rows


@pytest.fixture(scope="module")
def hf_processor():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoImageProcessor.from_pretrained(str(FIXTURE))


@pytest.fixture(scope="module")
def config():
    return ImagePreprocessConfig.from_file(FIXTURE / "preprocessor_config.json")


def _noise(h: int, w: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    # smooth-ish content plus noise so resampling is exercised on realistic and adversarial values
    yy, xx = np.mgrid[0:h, 0:w]
    base = (127 + 100 * np.sin(yy / 7.0)[..., None] * np.cos(xx / 5.0)[..., None]).astype(np.int64)
    chans = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode] if mode != "P" else 3
    arr = np.clip(base + rng.integers(-40, 41, (h, w, chans)), 0, 255).astype(np.uint8)
    if mode == "L":
        return Image.fromarray(arr[..., 0], "L")
    if mode == "P":
        img = Image.fromarray(arr, "RGB").quantize(colors=32)
        img.info["transparency"] = 3
        return img
    if mode == "LA":
        return Image.fromarray(arr, "LA")
    return Image.fromarray(arr, mode)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


CASES = [
    (17, 33, "RGB"),
    (224, 224, "RGB"),
    (480, 640, "RGB"),
    (1000, 30, "RGB"),
    (30, 1000, "RGB"),
    (1, 1, "RGB"),
    (301, 257, "RGBA"),
    (123, 77, "P"),
    (200, 150, "L"),
    (64, 96, "LA"),
    (1080, 1920, "RGB"),
]


@pytest.mark.parametrize("h,w,mode", CASES)
def test_patches_match_hf(hf_processor, config, h, w, mode):
    img = _noise(h, w, mode, seed=h * 1000 + w)
    data = _png(img)
    ours = preprocess_image(data, config)
    ref_img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    ref = hf_processor(images=[ref_img], return_tensors="np")
    pv = np.asarray(ref["pixel_values"])
    grid = tuple(int(v) for v in np.asarray(ref["image_grid_thw"])[0])
    assert ours.grid == grid
    assert ours.patches.dtype == np.float32
    assert ours.patches.shape == pv.shape == (grid[0] * grid[1] * grid[2], 1536)
    assert float(np.max(np.abs(ours.patches - pv.astype(np.float32)))) <= ATOL
    assert ours.num_tokens == grid[0] * grid[1] * grid[2] // 4
    assert ours.num_tokens == hf_processor.get_number_of_image_patches(h, w) // 4


def test_exif_jpeg_matches_hf_load_image(hf_processor, config):
    from transformers.image_utils import load_image

    img = _noise(90, 170, "RGB", seed=7)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif, quality=90)
    data = buf.getvalue()
    decoded = decode_image(data)
    assert decoded.size == (90, 170)  # (w, h) after transpose
    ours = preprocess_image(data, config)
    ref_img = load_image(base64.b64encode(data).decode())
    ref = hf_processor(images=[ref_img], return_tensors="np")
    assert ours.grid == tuple(int(v) for v in np.asarray(ref["image_grid_thw"])[0])
    assert float(np.max(np.abs(ours.patches - np.asarray(ref["pixel_values"])))) <= ATOL


def test_row_layout_and_normalization(config):
    # A constant-per-channel image: every row is channel-major [3][2][16][16] with value p/127.5 - 1.
    img = Image.new("RGB", (64, 64), (0, 128, 255))
    out = preprocess_image(img, config)
    assert out.grid == (1, 16, 16)  # 64x64 < min pixels -> 256x256 -> 16x16 patches, 64 tokens
    assert out.num_tokens == 64
    rows = out.patches.reshape(-1, 3, 2, 16, 16)
    np.testing.assert_allclose(rows[:, 0], -1.0, atol=1e-6)
    np.testing.assert_allclose(rows[:, 1], 128 / 127.5 - 1, atol=1e-6)
    np.testing.assert_allclose(rows[:, 2], 1.0, atol=1e-6)


def test_patch_order_is_merge_block_major(config):
    # Encode the patch coordinate in the pixels and check the order of rows.
    h, w = 64 * 4, 64 * 5  # 320x256 >= min pixels, multiple of 32 -> no resize
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack([yy // 16, xx // 16, np.zeros_like(yy)], axis=-1).astype(np.uint8)
    out = preprocess_image(Image.fromarray(arr, "RGB"), config)
    t, gh, gw = out.grid
    assert (t, gh, gw) == (1, h // 16, w // 16)
    rows = out.patches.reshape(-1, 3, 2, 16, 16)
    py = np.rint((rows[:, 0, 0, 0, 0] + 1) * 127.5).astype(int)
    px = np.rint((rows[:, 1, 0, 0, 0] + 1) * 127.5).astype(int)
    expect = [
        (by * 2 + my, bx * 2 + mx) for by in range(gh // 2) for bx in range(gw // 2) for my in range(2) for mx in range(2)
    ]
    assert list(zip(py.tolist(), px.tolist())) == expect
    np.testing.assert_array_equal(rows[:, :, 0], rows[:, :, 1])  # temporal pair duplicates the frame


def test_smart_resize_matches_hf():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = np.random.default_rng(0)
    dims = [(1, 1), (15, 15), (16, 48), (1, 200), (200, 1), (4000, 5000), (5000, 4000), (8191, 8191), (100000, 600)]
    dims += [tuple(int(v) for v in rng.integers(1, 6000, 2)) for _ in range(300)]
    for h, w in dims:
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize(h, w, 32, 65536, 16777216) == hf_smart_resize(h, w, 32, 65536, 16777216), (h, w)
    assert smart_resize(1, 1) == (256, 256)


def test_aspect_ratio_error():
    with pytest.raises(AspectRatioError):
        smart_resize(1, 201)
    with pytest.raises(AspectRatioError):
        preprocess_image(_png(Image.new("RGB", (2000, 3))))
    with pytest.raises(AspectRatioError):
        smart_resize(0, 10)
    assert issubclass(AspectRatioError, MediaError) and issubclass(MediaError, ValueError)


@pytest.mark.parametrize("data", [b"", b"not an image", _png(Image.new("RGB", (40, 40)))[:60]])
def test_undecodable_bytes(data):
    with pytest.raises(ImageDecodeError):
        preprocess_image(data)
