"""The `.ninfer` v1 container: formats, payload codec, streaming writer, memory-mapped reader and inspector."""

from ninfer.artifact.codec import bf16_bits_to_f32, decode, encode, f32_to_bf16_bits
from ninfer.artifact.errors import (
    ArtifactError,
    ArtifactFormatError,
    ArtifactGeometryError,
    ArtifactUsageError,
    MissingObjectError,
    QuantizationError,
)
from ninfer.artifact.formats import (
    BF16,
    CONTIGUOUS,
    FP32,
    I32,
    PAYLOAD_ALIGNMENT,
    Q4G64,
    Q5G64,
    Q6G64,
    RAW_BYTES,
    ROW_SPLIT,
    W8G32,
    encoded_size,
    layout_for,
)
from ninfer.artifact.inspect import describe, describe_json
from ninfer.artifact.reader import Artifact, ObjectEntry, TensorView
from ninfer.artifact.writer import ArtifactWriter, ResourceSpec, TensorSpec, write_artifact

__all__ = [
    "ArtifactError",
    "ArtifactFormatError",
    "ArtifactGeometryError",
    "ArtifactUsageError",
    "MissingObjectError",
    "QuantizationError",
    "BF16",
    "FP32",
    "I32",
    "Q4G64",
    "Q5G64",
    "Q6G64",
    "W8G32",
    "CONTIGUOUS",
    "ROW_SPLIT",
    "RAW_BYTES",
    "PAYLOAD_ALIGNMENT",
    "layout_for",
    "encoded_size",
    "encode",
    "decode",
    "f32_to_bf16_bits",
    "bf16_bits_to_f32",
    "TensorSpec",
    "ResourceSpec",
    "ArtifactWriter",
    "write_artifact",
    "Artifact",
    "ObjectEntry",
    "TensorView",
    "describe",
    "describe_json",
]
