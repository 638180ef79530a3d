"""Tensor payload encoding and decoding for every `.ninfer` v1 format (ninfer-facts §2.5-2.7).

Contiguous formats are little-endian words in C order. Quantized formats use the canonical
MAXABS_F16_RECIP_RNE_V1 encoder and the `row-split-k128-v1` layout: a base plane of low nibbles (or whole bytes for
W8), a high plane of the remaining bits (Q5/Q6) and a plane of binary16 scales, each in row-major group order.
Large tensors are processed in row blocks so temporaries stay near BLOCK_ELEMENTS floats.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ninfer.artifact.errors import ArtifactGeometryError, ArtifactUsageError, QuantizationError
from ninfer.artifact.formats import (
    BF16,
    FP32,
    I32,
    QUANT_FORMATS,
    WORD_BYTES,
    RowSplitGeometry,
    check_shape,
    encoded_size,
    row_split_geometry,
)

BLOCK_ELEMENTS = 16 * 1024 * 1024  # ~64 MiB of float32 per processing block
_WORD_DTYPES = {BF16: np.dtype("<u2"), FP32: np.dtype("<f4"), I32: np.dtype("<i4")}
_I32_RANGE = np.iinfo(np.int32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns of float32 values, rounded to nearest even; NaNs stay (quiet) NaNs."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases to even. It cannot wrap for non-NaN inputs
    # (the largest, -inf = 0xFF800000, stays far below 2^32), and NaNs are handled separately.
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode(array: np.ndarray, fmt: str) -> bytes:
    """The payload bytes of `array` stored as `fmt` (the array's shape is the tensor's logical shape)."""
    return encode_buffer(array, fmt).tobytes()


def encode_buffer(array: np.ndarray, fmt: str) -> np.ndarray:
    """Like `encode`, as a uint8 array: lets the writer stream a large payload without a bytes copy."""
    array = np.asarray(array)
    check_shape(fmt, array.shape)
    if fmt == I32:
        return _encode_i32(array)
    if not _is_float(array.dtype):
        raise ArtifactUsageError("dtype", f"{fmt} needs floating-point input, got {array.dtype}")
    if fmt in QUANT_FORMATS:
        return _encode_row_split(array, row_split_geometry(fmt, array.shape))
    return _encode_float_words(array, fmt)


def encode_chunks(array: np.ndarray, fmt: str) -> Iterator[np.ndarray]:
    """The payload of `array` as `fmt`, in consecutive uint8 pieces: contiguous float formats come block by block,
    so writing a huge BF16/FP32 tensor never holds its whole encoding; other formats come as one piece."""
    array = np.asarray(array)
    if fmt in (BF16, FP32) and _is_float(array.dtype):
        check_shape(fmt, array.shape)
        flat = array.reshape(-1)
        for begin in range(0, flat.size, BLOCK_ELEMENTS):
            yield _float_words(flat[begin : begin + BLOCK_ELEMENTS], fmt).view(np.uint8)
        return
    yield encode_buffer(array, fmt)


def decode(buf, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor stored in `buf`: float formats as float32 (quantized ones dequantized), I32 as int32."""
    if not shape:
        return _decode_words(_payload_array(buf, fmt, shape), fmt).reshape(())
    return decode_rows(buf, fmt, shape, 0, shape[0])


def decode_rows(buf, fmt: str, shape: tuple[int, ...], start: int, count: int) -> np.ndarray:
    """Rows [start, start+count) of the rank>=1 tensor whose whole payload is `buf`, touching only their bytes."""
    data = _payload_array(buf, fmt, shape)
    if not shape or start < 0 or count < 0 or start + count > shape[0]:
        raise ArtifactUsageError("row-range", f"rows [{start}, {start + count}) of a tensor of shape {list(shape)}")
    if fmt in QUANT_FORMATS:
        return _decode_row_split(data, row_split_geometry(fmt, shape), start, count)
    row_bytes = math.prod(shape[1:]) * WORD_BYTES[fmt]
    words = _decode_words(data[start * row_bytes : (start + count) * row_bytes], fmt)
    return words.reshape((count,) + tuple(shape[1:]))


def quantized_codes(buf, fmt: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The integer codes (int8 [N, logical groups * G]) and binary16 scale bits (uint16 [N, logical groups]) of a
    quantized row-split payload: what kernels repack into their own layouts."""
    geometry = row_split_geometry(fmt, tuple(shape))
    data = _payload_array(buf, fmt, tuple(shape))
    base, high, scales = _plane_views(data, geometry)
    groups = geometry.logical_groups
    codes = _unpack_codes(base[:, :groups], high[:, :groups], geometry)
    return codes.reshape(geometry.rows, -1), np.ascontiguousarray(scales[:, :groups])


def _payload_array(buf, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    """`buf` as a uint8 array (no copy), after checking it has the encoded size of (fmt, shape)."""
    expected = encoded_size(fmt, shape)
    data = np.frombuffer(buf, dtype=np.uint8)
    if data.size != expected:
        raise ArtifactGeometryError("bytes-mismatch", f"{fmt} {list(shape)} needs {expected} bytes, got {data.size}")
    return data


def _is_float(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 (what bf16 checkpoints load as) is not a numpy floating subtype but converts exactly.
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def _encode_i32(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind not in "iu":
        raise ArtifactUsageError("dtype", f"I32 needs integer input, got {array.dtype}")
    if array.size and (array.min() < _I32_RANGE.min or array.max() > _I32_RANGE.max):
        raise ArtifactUsageError("out-of-range", "I32 values must fit in a signed 32-bit integer")
    return np.ascontiguousarray(array, dtype="<i4").reshape(-1).view(np.uint8)


def _float_words(block: np.ndarray, fmt: str) -> np.ndarray:
    block = block.astype(np.float32, copy=False)
    return f32_to_bf16_bits(block) if fmt == BF16 else np.ascontiguousarray(block, dtype="<f4")


def _encode_float_words(array: np.ndarray, fmt: str) -> np.ndarray:
    flat = array.reshape(-1)
    out = np.empty(flat.size, dtype=_WORD_DTYPES[fmt])
    for begin in range(0, flat.size, BLOCK_ELEMENTS):
        out[begin : begin + BLOCK_ELEMENTS] = _float_words(flat[begin : begin + BLOCK_ELEMENTS], fmt)
    return out.view(np.uint8)


def _decode_words(data: np.ndarray, fmt: str) -> np.ndarray:
    words = data.view(_WORD_DTYPES[fmt])
    if fmt == BF16:
        return bf16_bits_to_f32(words)
    return words.astype(np.float32 if fmt == FP32 else np.int32)  # astype copies: results never alias the file


def _rows_per_block(geometry: RowSplitGeometry) -> int:
    return max(1, BLOCK_ELEMENTS // (geometry.groups_per_row * geometry.quant.group))


def _plane_views(out: np.ndarray, geometry: RowSplitGeometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The base [N,groups,B], high [N,groups,H] and scale [N,groups] (uint16) planes inside a payload array."""
    rows, groups, quant = geometry.rows, geometry.groups_per_row, geometry.quant
    base = out[: rows * geometry.base_row_bytes].reshape(rows, groups, quant.base_group_bytes)
    high_end = geometry.high_offset + rows * geometry.high_row_bytes
    high = out[geometry.high_offset : high_end].reshape(rows, groups, quant.high_group_bytes)
    scales = out[geometry.scale_offset : geometry.total_bytes].view("<u2").reshape(rows, groups)
    return base, high, scales


def _encode_row_split(array: np.ndarray, geometry: RowSplitGeometry) -> np.ndarray:
    # Zero-initialised, so padding groups (scale 0x0000, codes 0) and the gaps between planes need no extra work.
    out = np.zeros(geometry.total_bytes, dtype=np.uint8)
    base, high, scales = _plane_views(out, geometry)
    groups, step = geometry.logical_groups, _rows_per_block(geometry)
    for r0 in range(0, geometry.rows, step):
        codes, scale16 = _quantize_block(array[r0 : r0 + step], geometry)
        r1 = r0 + codes.shape[0]
        scales[r0:r1, :groups] = scale16.view(np.uint16)
        _pack_codes(codes, geometry, base[r0:r1, :groups], high[r0:r1, :groups])
    return out


def _quantize_block(block: np.ndarray, geometry: RowSplitGeometry) -> tuple[np.ndarray, np.ndarray]:
    """MAXABS_F16_RECIP_RNE_V1 (§2.7) on a block of rows: int8 codes [n,groups,G] and float16 scales [n,groups]."""
    quant, rows, cols = geometry.quant, block.shape[0], geometry.cols
    x = np.empty((rows, geometry.logical_groups * quant.group), dtype=np.float32)
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, rejected just below
        x[:, :cols] = block  # the source rounded to fp32; columns past K are zero before grouping
    x[:, cols:] = 0
    x = x.reshape(rows, geometry.logical_groups, quant.group)
    amax = np.abs(x).max(axis=2)  # max propagates NaN, so a non-finite source shows up here
    if not np.isfinite(amax).all():
        raise QuantizationError("non-finite", "quantized tensors need finite values")
    with np.errstate(over="ignore"):
        scale16 = (amax / np.float32(quant.qmax)).astype(np.float16)  # fp32 division, then fp16 RNE
    if not np.isfinite(scale16).all():
        raise QuantizationError("scale-range", f"a group's max |x| / {quant.qmax} overflows binary16")
    nonzero = amax > 0
    scale16[nonzero & (scale16 == 0)] = np.float16(2.0**-24)  # smallest subnormal: the group must not vanish
    scale32 = scale16.astype(np.float32)
    inv32 = np.divide(np.float32(1), scale32, out=np.zeros_like(scale32), where=nonzero)  # all-zero groups: codes 0
    np.multiply(x, inv32[..., None], out=x)
    np.rint(x, out=x)  # round half to even
    np.clip(x, quant.qmin, quant.qmax, out=x)
    return x.astype(np.int8), scale16


def _pack_codes(codes: np.ndarray, geometry: RowSplitGeometry, base: np.ndarray, high: np.ndarray) -> None:
    """Write int8 codes [n,groups,G] into the base and high plane views [n,groups,B] / [n,groups,H]."""
    quant = geometry.quant
    lanes = codes.view(np.uint8)  # two's complement: the low `bits` bits are q mod 2^bits
    if quant.base_bits == 8:
        base[...] = lanes
        return
    np.bitwise_or(lanes[..., 0::2] & 0x0F, (lanes[..., 1::2] & 0x0F) << 4, out=base)  # even lane = low nibble
    high_bits = quant.bits - 4
    if not high_bits:
        return
    # The high plane is a lane-major bit stream, LSB first: lane i's bits 4.. land at stream bit i*high_bits.
    lanes_per_byte = 8 // high_bits
    above = ((lanes >> 4) & ((1 << high_bits) - 1)).reshape(codes.shape[:2] + (-1, lanes_per_byte))
    packed = above[..., 0].copy()
    for lane in range(1, lanes_per_byte):
        packed |= above[..., lane] << (lane * high_bits)
    high[...] = packed


def _decode_row_split(data: np.ndarray, geometry: RowSplitGeometry, start: int, count: int) -> np.ndarray:
    quant, groups = geometry.quant, geometry.groups_per_row
    out = np.empty((count, geometry.cols), dtype=np.float32)
    for r0 in range(start, start + count, _rows_per_block(geometry)):
        r1 = min(start + count, r0 + _rows_per_block(geometry))
        rows = r1 - r0
        base = data[r0 * geometry.base_row_bytes : r1 * geometry.base_row_bytes]
        high_at = geometry.high_offset + r0 * geometry.high_row_bytes
        high = data[high_at : high_at + rows * geometry.high_row_bytes]
        scale_at = geometry.scale_offset + r0 * geometry.scale_row_bytes
        scales = data[scale_at : scale_at + rows * geometry.scale_row_bytes].view("<f2").reshape(rows, groups)
        codes = _unpack_codes(
            base.reshape(rows, groups, quant.base_group_bytes)[:, : geometry.logical_groups],
            high.reshape(rows, groups, quant.high_group_bytes)[:, : geometry.logical_groups],
            geometry,
        )
        scale32 = _checked_scales(scales[:, : geometry.logical_groups])
        values = codes.astype(np.float32)
        np.multiply(values, scale32[..., None], out=values)
        out[r0 - start : r1 - start] = values.reshape(rows, -1)[:, : geometry.cols]
    return out


def _checked_scales(scales: np.ndarray) -> np.ndarray:
    scale32 = scales.astype(np.float32)
    if not (np.isfinite(scale32) & (scale32 >= 0)).all():
        raise QuantizationError("bad-scale", "a group scale is negative, infinite or NaN")
    return scale32


def _unpack_codes(base: np.ndarray, high: np.ndarray, geometry: RowSplitGeometry) -> np.ndarray:
    """int8 codes [n,groups,G] from base [n,groups,B] and high [n,groups,H] plane bytes (inverse of _pack_codes)."""
    quant = geometry.quant
    if quant.base_bits == 8:
        codes = base.view(np.int8)
        if (codes == -128).any():
            raise QuantizationError("illegal-code", "W8 code 0x80 (-128) is forbidden")
        return codes
    lanes = np.empty(base.shape[:2] + (quant.group,), dtype=np.uint8)
    lanes[..., 0::2] = base & 0x0F
    lanes[..., 1::2] = base >> 4
    high_bits = quant.bits - 4
    if high_bits:
        lanes_per_byte = 8 // high_bits
        above = np.empty(high.shape + (lanes_per_byte,), dtype=np.uint8)
        for lane in range(lanes_per_byte):
            above[..., lane] = (high >> (lane * high_bits)) & ((1 << high_bits) - 1)
        lanes |= above.reshape(lanes.shape) << 4
    # Sign-extend the low `bits` bits: move them to the top of the byte, then shift back arithmetically.
    shift = 8 - quant.bits
    return (lanes << shift).view(np.int8) >> shift


def concat_rows(fmt: str, parts: list[tuple[tuple[int, ...], np.ndarray]]) -> tuple[tuple[int, int], np.ndarray]:
    """The payload of the row-wise concatenation of several `fmt` tensors with the same column count, without
    decoding: contiguous formats concatenate their words; row-split payloads concatenate plane by plane (each
    plane is row-major, so the base, high and scale planes of the parts follow each other within the new planes).
    `parts` are (shape, payload uint8) pairs; returns (shape, payload)."""
    cols = {shape[1] for shape, _ in parts}
    if len(cols) != 1 or any(len(shape) != 2 for shape, _ in parts):
        raise ArtifactUsageError("concat-shape", f"row concatenation needs [N, K] parts with one K, got "
                                 f"{[list(shape) for shape, _ in parts]}")
    shape = (sum(shape[0] for shape, _ in parts), cols.pop())
    if fmt not in QUANT_FORMATS:
        return shape, np.concatenate([np.asarray(payload, dtype=np.uint8).reshape(-1) for _, payload in parts])
    whole = row_split_geometry(fmt, shape)
    out = np.zeros(whole.total_bytes, dtype=np.uint8)
    row = 0
    for part_shape, payload in parts:
        g = row_split_geometry(fmt, part_shape)
        data = np.asarray(payload, dtype=np.uint8).reshape(-1)
        rows = part_shape[0]
        for plane_at, part_at, row_bytes in ((0, 0, g.base_row_bytes),
                                            (whole.high_offset, g.high_offset, g.high_row_bytes),
                                            (whole.scale_offset, g.scale_offset, g.scale_row_bytes)):
            size = rows * row_bytes
            start = plane_at + row * row_bytes
            out[start : start + size] = data[part_at : part_at + size]
        row += rows
    return shape, out
