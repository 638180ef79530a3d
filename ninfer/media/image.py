"""Image decoding, Qwen smart resize and patch packing (facts §5.5, §3.11, §2.8).

Mirrors transformers' Qwen2-VL image processor (the PIL backend that ``AutoImageProcessor`` builds from the
official ``preprocessor_config.json``):

* RGB conversion: images with an alpha band (or palette ``transparency``) are composited onto opaque white,
  everything else goes through ``Image.convert("RGB")``.  EXIF orientation is applied first (as
  ``transformers.image_utils.load_image`` does).
* ``smart_resize`` with factor ``patch_size * merge_size`` (32), Python's round-half-even, min/max pixel rules.
* Resampling in Pillow with ``Image.BICUBIC`` (antialiased Keys a=-0.5, uint8 intermediate), no reducing gap.
* Rescale ``u8 * (1/255)`` computed in float64 then cast to float32, then ``(x - mean) / std`` in float32
  (mean = std = 0.5, i.e. ~``p/127.5 - 1``, bit-identical to the processor).
* Rows of ``C * temporal * p * p`` floats, channel-major ``[3][2][16][16]``, the frame duplicated over the
  temporal pair, rows ordered per 2x2 merge block (row-major over blocks), the block's 4 patches row-major.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ninfer.media.errors import MediaError

try:  # Pillow is needed only for decoding/resizing.
    from PIL import Image, ImageOps
except ImportError:  # pragma: no cover - exercised only without pillow
    Image = None  # type: ignore[assignment]
    ImageOps = None  # type: ignore[assignment]

PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
MIN_PIXELS = 65_536
MAX_PIXELS = 16_777_216
MAX_ASPECT_RATIO = 200
RESCALE_FACTOR = 1.0 / 255.0


class ImageDecodeError(MediaError):
    """The bytes are not a decodable image (or decoding it failed/was refused)."""


class AspectRatioError(MediaError):
    """max(h, w) / min(h, w) exceeds 200 (or a dimension is zero)."""


@dataclass(frozen=True)
class ImagePreprocessConfig:
    patch_size: int = PATCH_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE
    merge_size: int = MERGE_SIZE
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = RESCALE_FACTOR

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def row_size(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ImagePreprocessConfig":
        size = d.get("size") or {}
        return cls(
            patch_size=int(d.get("patch_size", PATCH_SIZE)),
            temporal_patch_size=int(d.get("temporal_patch_size", TEMPORAL_PATCH_SIZE)),
            merge_size=int(d.get("merge_size", MERGE_SIZE)),
            min_pixels=int(d.get("min_pixels", size.get("shortest_edge", MIN_PIXELS))),
            max_pixels=int(d.get("max_pixels", size.get("longest_edge", MAX_PIXELS))),
            image_mean=tuple(float(x) for x in d.get("image_mean", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            image_std=tuple(float(x) for x in d.get("image_std", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            rescale_factor=float(d.get("rescale_factor", RESCALE_FACTOR)),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "ImagePreprocessConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


@dataclass(frozen=True)
class ProcessedImage:
    patches: np.ndarray  # [t*h*w, 3*temporal*p*p] float32
    grid: tuple[int, int, int]  # (t, h, w) in patch units
    merge_size: int = MERGE_SIZE

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // (self.merge_size * self.merge_size)


def smart_resize(
    height: int,
    width: int,
    factor: int = PATCH_SIZE * MERGE_SIZE,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """Target (height, width), both multiples of ``factor``, pixel count within [min, max] (Qwen rule)."""
    if height <= 0 or width <= 0:
        raise AspectRatioError(f"image dimensions must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise AspectRatioError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _require_pillow() -> None:
    if Image is None:  # pragma: no cover
        raise MediaError("image support needs Pillow (pip install pillow)")


def to_rgb(image: "Image.Image") -> "Image.Image":
    """RGB conversion as transformers' ``convert_to_rgb``: alpha composited onto white, else ``convert('RGB')``."""
    _require_pillow()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes | bytearray | memoryview) -> "Image.Image":
    """Decode image bytes into a fully loaded, EXIF-oriented PIL image (not yet RGB-converted)."""
    _require_pillow()
    try:
        image = Image.open(io.BytesIO(bytes(data)))
        image.load()
        image = ImageOps.exif_transpose(image)
    except MemoryError:
        raise
    except Image.DecompressionBombError as e:  # > 2 * Image.MAX_IMAGE_PIXELS
        raise ImageDecodeError(f"image too large to decode: {e}") from e
    except Exception as e:  # unidentified format, truncated/corrupt data, malformed EXIF, ...
        raise ImageDecodeError(f"cannot decode image: {type(e).__name__}: {e}") from e
    return image


def pack_patches(
    pixels: np.ndarray,
    patch_size: int = PATCH_SIZE,
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
    merge_size: int = MERGE_SIZE,
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``pixels`` ``[C, H, W]`` (one frame) -> rows ``[gh*gw, C*temporal*p*p]`` in merge-block order, grid (1, gh, gw)."""
    c, height, width = pixels.shape
    gh, gw = height // patch_size, width // patch_size
    if gh * patch_size != height or gw * patch_size != width or gh % merge_size or gw % merge_size:
        raise MediaError(f"{height}x{width} is not a multiple of patch*merge = {patch_size * merge_size}")
    x = pixels.reshape(c, gh // merge_size, merge_size, patch_size, gw // merge_size, merge_size, patch_size)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, ph, pw)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal_patch_size, *x.shape[5:]))
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(gh * gw, c * temporal_patch_size * patch_size**2)
    return rows, (1, gh, gw)


def preprocess_image(
    image: "Image.Image | bytes | bytearray | memoryview",
    config: ImagePreprocessConfig | None = None,
) -> ProcessedImage:
    """Bytes or PIL image -> ``ProcessedImage`` (float32 patch rows + grid), identical to the HF processor."""
    _require_pillow()
    cfg = config or ImagePreprocessConfig()
    if not isinstance(image, Image.Image):
        image = decode_image(image)
    rgb = to_rgb(image)
    width, height = rgb.size
    new_h, new_w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = rgb.resize((new_w, new_h), resample=Image.BICUBIC)
    u8 = np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1)  # [3, H, W]
    x = (u8.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None, None]
    x = (x - mean) / std
    rows, grid = pack_patches(x, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)
    return ProcessedImage(patches=rows, grid=grid, merge_size=cfg.merge_size)
