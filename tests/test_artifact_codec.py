"""ninfer.artifact.codec against §2.5-2.7: round trips, golden bytes from the scalar oracle, hand-built bit layouts."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ninfer.artifact import codec
from ninfer.artifact.errors import ArtifactError, ArtifactUsageError
from ninfer.artifact.formats import BF16, FP32, I32, Q4G64, Q5G64, Q6G64, W8G32, encoded_size
from tests.test_artifact_oracle import QUANT, dequantize_row_split, encode_row_split

QUANTIZED = (Q4G64, Q5G64, Q6G64, W8G32)
SHAPES_2D = [(1, 1), (1, 64), (3, 130), (2, 127), (5, 200), (4, 256), (2, 33), (7, 385)]


def bf16_exact(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random float32 values that bf16 represents exactly (so the round trip must be lossless)."""
    values = rng.standard_normal(shape).astype(np.float32) * 10
    return (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


# --- contiguous formats ---------------------------------------------------------------------------------------------


RANK_16 = (2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 1, 3)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4), (1,) * 16, RANK_16])
def test_contiguous_round_trips_are_exact(shape):
    rng = np.random.default_rng(len(shape))
    floats = rng.standard_normal(shape).astype(np.float32)
    assert np.array_equal(codec.decode(codec.encode(floats, FP32), FP32, shape), floats)
    exact = bf16_exact(rng, shape)
    assert np.array_equal(codec.decode(codec.encode(exact, BF16), BF16, shape), exact)
    ints = rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64)
    back = codec.decode(codec.encode(ints, I32), I32, shape)
    assert back.dtype == np.int32 and np.array_equal(back, ints)


def test_contiguous_bytes_are_little_endian_c_order():
    array = np.array([[1.0, 2.0], [3.0, -1.0]], dtype=np.float32)
    assert codec.encode(array, FP32) == struct.pack("<4f", 1.0, 2.0, 3.0, -1.0)
    assert codec.encode(array, BF16) == struct.pack("<4H", 0x3F80, 0x4000, 0x4040, 0xBF80)
    assert codec.encode(np.array([1, -2], dtype=np.int64), I32) == struct.pack("<2i", 1, -2)


def test_bf16_rounds_to_nearest_even():
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0xFF800000], dtype=np.uint32)
    expected = np.array([0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0xFF80], dtype=np.uint16)
    assert np.array_equal(codec.f32_to_bf16_bits(bits.view(np.float32)), expected)


def test_bf16_keeps_nan_a_nan():
    bits = codec.f32_to_bf16_bits(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(codec.bf16_bits_to_f32(bits)).all()


def test_bf16_from_float64_rounds_through_float32():
    values = np.array([1.0 + 2.0**-8, 3.14159], dtype=np.float64)
    assert np.array_equal(codec.encode(values, BF16), codec.encode(values.astype(np.float32), BF16))


def test_i32_rejects_out_of_range_and_float_input():
    with pytest.raises(ArtifactError) as err:
        codec.encode(np.array([2**31]), I32)
    assert err.value.rule == "out-of-range" and err.value.object_name is None
    with pytest.raises(ArtifactError) as err:
        codec.encode(np.array([1.0]), I32)
    assert err.value.rule == "dtype"


def test_float_formats_reject_integer_input():
    for fmt in (BF16, FP32, Q4G64):
        with pytest.raises(ArtifactError) as err:
            codec.encode(np.ones((1, 4), dtype=np.int32), fmt)
        assert err.value.rule == "dtype"


# --- quantized formats ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("shape", SHAPES_2D)
def test_quantized_encoder_matches_the_scalar_transcription(fmt, shape):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    array = rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-3, 1.0, 300.0], size=(shape[0], 1))
    array[0, : min(shape[1], 70)] = 0.0  # an all-zero group, and a group that is partly zero
    encoded = codec.encode(array, fmt)
    assert len(encoded) == encoded_size(fmt, shape)
    assert encoded == encode_row_split(array.tolist(), fmt)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_encoder_edge_values_match_the_scalar_transcription(fmt):
    _, group, _, qmax = QUANT[fmt]
    groups = [
        [qmax, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5, 3.5],  # scale exactly 1: ties round to even
        [1e-7, -3e-8, 1e-30],  # the scale rounds to binary16 zero -> 0x0001
        [60000.0 * qmax / 2, -1.0],  # a scale near the top of binary16
        [np.float32(1.4e-45)],  # the smallest float32 subnormal
        [-qmax * 1.0, qmax * 1.0],
    ]
    rows = [np.pad(np.array(g, dtype=np.float32), (0, group - len(g))) for g in groups]
    array = np.stack(rows)
    assert codec.encode(array, fmt) == encode_row_split(array.tolist(), fmt)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("shape", SHAPES_2D)
def test_quantized_decode_matches_the_dequantization_oracle(fmt, shape):
    rng = np.random.default_rng(7 + shape[1])
    array = rng.standard_normal(shape).astype(np.float32)
    payload = codec.encode(array, fmt)
    decoded = codec.decode(payload, fmt, shape)
    assert decoded.dtype == np.float32 and decoded.shape == shape
    assert np.array_equal(decoded, np.array(dequantize_row_split(payload, fmt, *shape), dtype=np.float32))
    _, group, _, qmax = QUANT[fmt]
    padded = np.pad(array, ((0, 0), (0, -shape[1] % group))).reshape(shape[0], -1, group)
    step = np.repeat(np.abs(padded).max(axis=2) / qmax, group, axis=1)[:, : shape[1]]
    assert (np.abs(decoded - array) <= 0.5 * step * 1.002).all()


def test_q5_bit_layout_by_hand():
    codes = np.zeros(64, dtype=np.float32)
    codes[[0, 1, 2, 3, 9]] = [15, -15, 1, -1, -2]  # amax 15 = qmax: scale exactly 1.0, codes are the values
    payload = codec.encode(codes[None, :], Q5G64)
    # [1,64]: K_pad 128, 2 groups; base 64 B, high 16 B at 256, scales 4 B at 512
    assert len(payload) == 516
    base, high, scales = payload[:64], payload[256:272], payload[512:]
    # u = q mod 32: 15=01111, -15=10001, 1=00001, -1=11111, -2=11110; even lane in the low nibble
    assert base[:5] == bytes([0x1F, 0xF1, 0x00, 0x00, 0xE0]) and not any(base[5:])
    # bit i of high byte j = bit 4 of lane 8j+i: lanes 1 and 3 in byte 0, lane 9 in byte 1
    assert high[:2] == bytes([0x0A, 0x02]) and not any(high[2:])
    assert scales == bytes([0x00, 0x3C, 0x00, 0x00])  # 1.0 then a padding group with scale 0x0000
    assert not any(payload[64:256]) and not any(payload[272:512])


def test_q6_bit_layout_by_hand():
    codes = np.zeros(64, dtype=np.float32)
    codes[[0, 1, 2, 3]] = [31, -31, 16, -1]
    payload = codec.encode(codes[None, :], Q6G64)
    assert len(payload) == 256 + 256 + 4
    base, high = payload[:64], payload[256:288]
    # u = q mod 64: 31=011111, -31=100001, 16=010000, -1=111111
    assert base[:2] == bytes([0x1F, 0xF0]) and not any(base[2:])
    # lane i puts bit 4 then bit 5 at stream bits 2i, 2i+1: (1,0) (0,1) (1,0) (1,1) -> 0b11_01_10_01
    assert high[0] == 0xD9 and not any(high[1:])


def test_decoding_hand_built_codes_including_the_most_negative():
    payload = bytearray(516)
    payload[0] = 0x00  # lanes 0,1 low nibbles 0
    payload[256] = 0b0000_0011  # Q5: lanes 0 and 1 have bit 4 set -> u = 16 -> -16
    payload[512:514] = struct.pack("<e", 0.5)
    decoded = codec.decode(bytes(payload), Q5G64, (1, 64))
    assert decoded[0, :3].tolist() == [-8.0, -8.0, 0.0]
    payload[256:272] = bytes([0b0000_0110]) + bytes(15)  # Q6 reading: lane0 bit5, lane1 bit4
    decoded = codec.decode(bytes(payload), Q6G64, (1, 64))
    assert decoded[0, :2].tolist() == [-16.0, 8.0]  # u=32 -> -32, u=16 -> 16; times 0.5


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_padding_lanes_and_padding_groups_are_zero(fmt):
    _, group, _, _ = QUANT[fmt]
    k = group + 5  # two logical groups, the second with 5 real lanes; K_pad 128 adds padding groups
    array = np.full((2, k), 3.0, dtype=np.float32)
    payload = codec.encode(array, fmt)
    groups_per_row = 128 // group
    scale_offset = len(payload) - 2 * 2 * groups_per_row
    scales = np.frombuffer(payload[scale_offset:], dtype="<u2").reshape(2, groups_per_row)
    assert (scales[:, :2] != 0).all() and (scales[:, 2:] == 0).all()
    # re-decoding the padded width shows code 0 beyond column k
    decoded_padded = np.array(dequantize_row_split(payload, fmt, 2, 128))
    assert (decoded_padded[:, k:] == 0).all()


def test_non_finite_input_is_rejected_without_an_object_name():
    for bad in (np.nan, np.inf, -np.inf):
        array = np.zeros((2, 64), dtype=np.float32)
        array[1, 3] = bad
        with pytest.raises(ArtifactError) as err:
            codec.encode(array, Q4G64)
        assert err.value.rule == "non-finite" and err.value.object_name is None


def test_float64_overflowing_float32_is_non_finite():
    with pytest.raises(ArtifactError) as err:
        codec.encode(np.array([[1e300]]), Q6G64)
    assert err.value.rule == "non-finite"


def test_scale_overflowing_binary16_is_rejected():
    with pytest.raises(ArtifactError) as err:
        codec.encode(np.array([[1e6]], dtype=np.float32), Q4G64)
    assert err.value.rule == "scale-range"


def test_quantized_needs_rank_two():
    with pytest.raises(ArtifactError) as err:
        codec.encode(np.zeros(64, dtype=np.float32), Q4G64)
    assert err.value.rule == "rank"


def test_w8_code_0x80_is_rejected_on_decode():
    payload = bytearray(codec.encode(np.ones((1, 32), dtype=np.float32), W8G32))
    payload[3] = 0x80
    with pytest.raises(ArtifactError) as err:
        codec.decode(bytes(payload), W8G32, (1, 32))
    assert err.value.rule == "illegal-code"


def test_nan_scale_is_rejected_on_decode():
    payload = bytearray(codec.encode(np.ones((1, 64), dtype=np.float32), Q4G64))
    payload[-4:-2] = struct.pack("<H", 0x7E00)
    with pytest.raises(ArtifactError) as err:
        codec.decode(bytes(payload), Q4G64, (1, 64))
    assert err.value.rule == "bad-scale"


def test_decode_checks_the_payload_size():
    with pytest.raises(ArtifactError) as err:
        codec.decode(b"\x00" * 10, FP32, (2,))
    assert err.value.rule == "bytes-mismatch"


# --- row views and blocking -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED + (BF16, FP32, I32))
def test_rows_equal_slices_of_the_full_decode(fmt):
    rng = np.random.default_rng(3)
    shape = (9, 150) if fmt in QUANTIZED else (9, 3, 5)
    array = rng.integers(-100, 100, size=shape) if fmt == I32 else rng.standard_normal(shape).astype(np.float32)
    payload = codec.encode(array, fmt)
    full = codec.decode(payload, fmt, shape)
    for start, count in [(0, 9), (0, 1), (4, 3), (8, 1), (5, 0)]:
        assert np.array_equal(codec.decode_rows(payload, fmt, shape, start, count), full[start : start + count])


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_rows_read_only_their_own_spans(fmt):
    shape = (6, 200)
    payload = codec.encode(np.random.default_rng(5).standard_normal(shape).astype(np.float32), fmt)
    expected = codec.decode(payload, fmt, shape)[2:4]
    # Poison every byte outside rows 2..3's three spans (NaN-like 0xFF scales, 0x80 codes would both be rejected).
    _, group, _, _ = QUANT[fmt]
    groups = 256 // group
    base_row, high_row = groups * 32, groups * (QUANT[fmt][0] - 4) * group // 8 if fmt != W8G32 else 0
    high_offset = -(-6 * base_row // 256) * 256
    scale_offset = high_offset + -(-6 * high_row // 256) * 256
    keep = np.zeros(len(payload), dtype=bool)
    keep[2 * base_row : 4 * base_row] = True
    keep[high_offset + 2 * high_row : high_offset + 4 * high_row] = True
    keep[scale_offset + 2 * 2 * groups : scale_offset + 4 * 2 * groups] = True
    poisoned = np.where(keep, np.frombuffer(payload, dtype=np.uint8), 0xFF).astype(np.uint8)
    assert np.array_equal(codec.decode_rows(poisoned.tobytes(), fmt, shape, 2, 2), expected)


def test_row_range_is_checked():
    payload = codec.encode(np.zeros((3, 4), dtype=np.float32), FP32)
    for start, count in [(-1, 1), (2, 2), (0, -1)]:
        with pytest.raises(ArtifactError) as err:
            codec.decode_rows(payload, FP32, (3, 4), start, count)
        assert err.value.rule == "row-range"


@pytest.mark.parametrize("fmt", QUANTIZED + (BF16,))
def test_small_processing_blocks_give_identical_results(fmt, monkeypatch):
    shape = (37, 300)
    array = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    payload = codec.encode(array, fmt)
    decoded = codec.decode(payload, fmt, shape)
    monkeypatch.setattr(codec, "BLOCK_ELEMENTS", 1000)  # several rows per block, ragged last block
    assert codec.encode(array, fmt) == payload
    assert np.array_equal(codec.decode(payload, fmt, shape), decoded)
    assert np.array_equal(codec.decode_rows(payload, fmt, shape, 5, 20), decoded[5:25])


@pytest.mark.parametrize("fmt", [BF16, FP32])
def test_contiguous_payloads_stream_in_blocks_with_identical_bytes(monkeypatch, fmt):
    array = np.random.default_rng(5).normal(size=(7, 9)).astype(np.float32)
    whole = codec.encode(array, fmt)
    monkeypatch.setattr(codec, "BLOCK_ELEMENTS", 10)
    pieces = [bytes(p) for p in codec.encode_chunks(array, fmt)]
    assert len(pieces) == 7 and b"".join(pieces) == whole


@pytest.mark.parametrize("fmt", ["Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S", "BF16", "FP32"])
def test_concat_rows_equals_encoding_the_concatenated_matrix(fmt):
    rng = np.random.default_rng(7)
    parts = [rng.standard_normal((rows, 200)).astype(np.float32) for rows in (37, 5, 64)]
    shape, payload = codec.concat_rows(fmt, [(p.shape, codec.encode_buffer(p, fmt)) for p in parts])
    assert shape == (106, 200)
    assert np.array_equal(payload, codec.encode_buffer(np.concatenate(parts), fmt))


def test_concat_rows_rejects_mismatched_columns():
    a, b = np.zeros((2, 64), np.float32), np.zeros((2, 128), np.float32)
    with pytest.raises(ArtifactUsageError):
        codec.concat_rows("BF16", [(a.shape, codec.encode_buffer(a, "BF16")), (b.shape, codec.encode_buffer(b, "BF16"))])
