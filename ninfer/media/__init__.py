"""Media preprocessing for the Qwen3.6 vision path: image decode/resize/patch packing and multimodal positions."""

from ninfer.media.image import (
    AspectRatioError,
    ImageDecodeError,
    ImagePreprocessConfig,
    MediaError,
    ProcessedImage,
    decode_image,
    pack_patches,
    preprocess_image,
    smart_resize,
    to_rgb,
)
from ninfer.media.positions import (
    IMAGE_PAD_ID,
    PositionError,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    assign_positions,
    expand_image_placeholders,
    image_placeholder_ids,
    token_types,
)

__all__ = [
    "AspectRatioError",
    "IMAGE_PAD_ID",
    "ImageDecodeError",
    "ImagePreprocessConfig",
    "MediaError",
    "PositionError",
    "ProcessedImage",
    "VIDEO_PAD_ID",
    "VISION_END_ID",
    "VISION_START_ID",
    "assign_positions",
    "decode_image",
    "expand_image_placeholders",
    "image_placeholder_ids",
    "pack_patches",
    "preprocess_image",
    "smart_resize",
    "to_rgb",
    "token_types",
]
