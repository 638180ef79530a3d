"""The closed registries of `.ninfer` v1 (ninfer-facts §2.4-2.6): formats, layouts, encodings and their sizes.

Formats, layouts and encodings are string identities compared exactly; there are no numeric codes.
"""

from __future__ import annotations

import math
import struct

import attrs

from ninfer.artifact.errors import ArtifactFormatError, ArtifactGeometryError

BF16, FP32, I32 = "BF16", "FP32", "I32"
Q4G64, Q5G64, Q6G64, W8G32 = "Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S"
CONTIGUOUS, ROW_SPLIT, RAW_BYTES = "contiguous-le-v1", "row-split-k128-v1", "raw-bytes-v1"

MAGIC = b"NINFER\x00\x01"  # "NINFER", 0x00, framing revision 1
PREFIX = struct.Struct("<8sQ")  # magic, then the byte length of the JSON directory
PAYLOAD_ALIGNMENT = 4096
MAX_CONTIGUOUS_RANK = 16
ROW_SPLIT_K_ALIGNMENT = 128  # every row is padded to a multiple of 128 columns
PLANE_ALIGNMENT = 256  # the high and scale planes of a row-split payload start on 256-byte boundaries


@attrs.frozen
class QuantFormat:
    """A grouped quantized format: `bits`-bit codes in groups of `group` lanes sharing one binary16 scale."""

    bits: int
    group: int
    qmin: int  # the legal code range; the encoder clamps to it
    qmax: int  # also the encoder's divisor: scale = amax / qmax

    @property
    def base_bits(self) -> int:
        """Bits per lane in the base plane: the low nibble, or the whole byte for 8-bit codes."""
        return 8 if self.bits == 8 else 4

    @property
    def base_group_bytes(self) -> int:
        return self.group * self.base_bits // 8

    @property
    def high_group_bytes(self) -> int:
        return self.group * (self.bits - self.base_bits) // 8


WORD_BYTES = {BF16: 2, FP32: 4, I32: 4}
QUANT_FORMATS = {
    Q4G64: QuantFormat(bits=4, group=64, qmin=-8, qmax=7),
    Q5G64: QuantFormat(bits=5, group=64, qmin=-16, qmax=15),
    Q6G64: QuantFormat(bits=6, group=64, qmin=-32, qmax=31),
    W8G32: QuantFormat(bits=8, group=32, qmin=-127, qmax=127),  # -128 (0x80) is forbidden
}
FORMATS = tuple(WORD_BYTES) + tuple(QUANT_FORMATS)
LAYOUTS = (CONTIGUOUS, ROW_SPLIT)
ENCODINGS = (RAW_BYTES,)
_ALIGNMENT = {CONTIGUOUS: 256, ROW_SPLIT: 256, RAW_BYTES: 1}


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def alignment(layout_or_encoding: str) -> int:
    """Where an object with this tensor layout or resource encoding may start, relative to the payload."""
    return _ALIGNMENT[layout_or_encoding]


def is_valid_text(value: object) -> bool:
    """A model_id or object name: a non-empty string that UTF-8 can encode (no lone surrogates)."""
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def layout_for(fmt: str) -> str:
    if fmt in WORD_BYTES:
        return CONTIGUOUS
    if fmt in QUANT_FORMATS:
        return ROW_SPLIT
    raise ArtifactFormatError("unknown-format", f"unknown tensor format {fmt!r}")


def check_shape(fmt: str, shape: tuple[int, ...]) -> None:
    """Raise unless `shape` is a legal logical shape for `fmt` (rank range, positive integer extents)."""
    layout = layout_for(fmt)
    if layout == ROW_SPLIT and len(shape) != 2:
        raise ArtifactGeometryError("rank", f"{fmt} needs a rank-2 [N,K] shape, got {list(shape)}")
    if len(shape) > MAX_CONTIGUOUS_RANK:
        raise ArtifactGeometryError("rank", f"rank {len(shape)} exceeds {MAX_CONTIGUOUS_RANK}")
    for extent in shape:
        if type(extent) is not int or extent <= 0:
            raise ArtifactGeometryError("shape", f"shape entries must be positive integers, got {list(shape)}")


@attrs.frozen
class RowSplitGeometry:
    """Plane sizes and offsets of one `row-split-k128-v1` payload for an [N,K] tensor (§2.6)."""

    quant: QuantFormat
    rows: int
    cols: int

    @property
    def groups_per_row(self) -> int:
        return align_up(self.cols, ROW_SPLIT_K_ALIGNMENT) // self.quant.group

    @property
    def logical_groups(self) -> int:
        """Groups holding at least one real column; the rest of each row is padding (scale 0, codes 0)."""
        return -(-self.cols // self.quant.group)

    @property
    def base_row_bytes(self) -> int:
        return self.groups_per_row * self.quant.base_group_bytes

    @property
    def high_row_bytes(self) -> int:
        return self.groups_per_row * self.quant.high_group_bytes

    @property
    def scale_row_bytes(self) -> int:
        return self.groups_per_row * 2

    @property
    def high_offset(self) -> int:
        return align_up(self.rows * self.base_row_bytes, PLANE_ALIGNMENT)

    @property
    def scale_offset(self) -> int:
        return self.high_offset + align_up(self.rows * self.high_row_bytes, PLANE_ALIGNMENT)

    @property
    def total_bytes(self) -> int:
        return self.scale_offset + self.rows * self.scale_row_bytes


def row_split_geometry(fmt: str, shape: tuple[int, ...]) -> RowSplitGeometry:
    check_shape(fmt, shape)
    if fmt not in QUANT_FORMATS:
        raise ArtifactFormatError("format-layout", f"{fmt} is not stored in {ROW_SPLIT}")
    rows, cols = shape
    return RowSplitGeometry(QUANT_FORMATS[fmt], rows, cols)


def encoded_size(fmt: str, shape: tuple[int, ...]) -> int:
    """Payload bytes of a tensor of `fmt` and logical `shape` in the format's layout."""
    check_shape(fmt, shape)
    if fmt in WORD_BYTES:
        return math.prod(shape) * WORD_BYTES[fmt]
    return row_split_geometry(fmt, shape).total_bytes
