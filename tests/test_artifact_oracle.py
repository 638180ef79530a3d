"""A slow, scalar transcription of ninfer-facts §2.6-2.7, independent of ninfer.artifact.codec.

It uses only Python floats and `struct` for the binary32/binary16 roundings (both round to nearest even), and builds
the row-split-k128-v1 planes bit by bit. Other artifact tests compare the vectorised codec against it.
"""

from __future__ import annotations

import math
import struct

import pytest

# format -> (bits, group, qmin, qmax)
QUANT = {
    "Q4G64_F16S": (4, 64, -8, 7),
    "Q5G64_F16S": (5, 64, -16, 15),
    "Q6G64_F16S": (6, 64, -32, 31),
    "W8G32_F16S": (8, 32, -127, 127),
}


def round_f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def f16_bits(value: float) -> int:
    """binary16 bits of `value` rounded to nearest even; 0x7C00 (inf) when it overflows."""
    try:
        return struct.unpack("<H", struct.pack("<e", value))[0]
    except OverflowError:
        return 0x7C00


def f16_value(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits))[0]


def quantize_group(values: list[float], qmax: int, qmin: int) -> tuple[int, list[int]]:
    """MAXABS_F16_RECIP_RNE_V1 on one group: (binary16 scale bits, codes)."""
    values = [round_f32(v) for v in values]
    amax = max(abs(v) for v in values)
    if amax == 0:
        return 0x0000, [0] * len(values)
    raw32 = round_f32(amax / qmax)
    scale_bits = f16_bits(raw32)
    if scale_bits == 0:
        scale_bits = 0x0001
    if scale_bits >= 0x7C00:
        raise OverflowError("the group's scale is not a finite binary16")
    inv32 = round_f32(1.0 / f16_value(scale_bits))
    return scale_bits, [min(max(round(round_f32(v * inv32)), qmin), qmax) for v in values]


def encode_row_split(rows: list[list[float]], fmt: str) -> bytes:
    """The full row-split-k128-v1 payload of an [N,K] matrix given as nested lists."""
    bits, group, qmin, qmax = QUANT[fmt]
    k = len(rows[0])
    k_pad = -(-k // 128) * 128
    groups_per_row = k_pad // group
    logical_groups = -(-k // group)
    base, high_bits, scales = bytearray(), [], bytearray()
    for row in rows:
        padded = list(row) + [0.0] * (k_pad - k)
        for g in range(groups_per_row):
            if g < logical_groups:
                scale_bits, codes = quantize_group(padded[g * group : (g + 1) * group], qmax, qmin)
            else:
                scale_bits, codes = 0x0000, [0] * group
            scales += struct.pack("<H", scale_bits)
            unsigned = [code % (1 << bits) for code in codes]
            if bits == 8:
                base += bytes(unsigned)
                continue
            for j in range(group // 2):
                base.append((unsigned[2 * j] & 0xF) | ((unsigned[2 * j + 1] & 0xF) << 4))
            group_stream = []
            for u in unsigned:  # lane-major: each lane's bits 4.. in increasing significance
                group_stream += [(u >> b) & 1 for b in range(4, bits)]
            high_bits.append(group_stream)
    high = bytearray()
    for group_stream in high_bits:
        for j in range(0, len(group_stream), 8):
            high.append(sum(bit << i for i, bit in enumerate(group_stream[j : j + 8])))
    high_offset = -(-len(base) // 256) * 256
    scale_offset = high_offset + -(-len(high) // 256) * 256
    payload = bytearray(scale_offset + len(scales))
    payload[: len(base)] = base
    payload[high_offset : high_offset + len(high)] = high
    payload[scale_offset:] = scales
    return bytes(payload)


def dequantize_row_split(payload: bytes, fmt: str, n: int, k: int) -> list[list[float]]:
    """The §2.6 dequantization oracle: fp32(fp16 scale) * fp32(code), reading the planes scalar by scalar."""
    bits, group, _, _ = QUANT[fmt]
    groups_per_row = -(-k // 128) * 128 // group
    base_group = group * (8 if bits == 8 else 4) // 8
    high_group = group * (bits - 4) // 8 if bits < 8 else 0
    high_offset = -(-n * groups_per_row * base_group // 256) * 256
    scale_offset = high_offset + -(-n * groups_per_row * high_group // 256) * 256
    out = []
    for r in range(n):
        row = []
        for c in range(k):
            g, lane = divmod(c, group)
            index = r * groups_per_row + g
            if bits == 8:
                u = payload[index * base_group + lane]
            else:
                u = (payload[index * base_group + lane // 2] >> (4 * (lane % 2))) & 0xF
                for b in range(4, bits):
                    bit_index = lane * (bits - 4) + (b - 4)
                    byte = payload[high_offset + index * high_group + bit_index // 8]
                    u |= ((byte >> (bit_index % 8)) & 1) << b
            code = u - (1 << bits) if u >= 1 << (bits - 1) else u
            scale = f16_value(struct.unpack_from("<H", payload, scale_offset + 2 * index)[0])
            row.append(round_f32(scale * code))
        out.append(row)
    return out


def test_oracle_ties_round_to_even():
    # amax 7 with qmax 7 gives scale exactly 1.0, so codes are rint(x): halves go to the even neighbour.
    scale_bits, codes = quantize_group([7.0, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5] + [0.0] * 57, qmax=7, qmin=-8)
    assert scale_bits == 0x3C00
    assert codes[:7] == [7, 0, 2, 2, 0, -2, -4]


def test_oracle_tiny_group_gets_smallest_subnormal_scale():
    scale_bits, codes = quantize_group([1e-7] + [0.0] * 63, qmax=7, qmin=-8)
    assert scale_bits == 0x0001
    assert codes[0] == 2  # 1e-7 * 2^24 = 1.68 -> 2


def test_oracle_section_2_6_example_size():
    assert len(encode_row_split([[0.0] * 130] * 2, "Q5G64_F16S")) == 528


@pytest.mark.parametrize("fmt", sorted(QUANT))
def test_oracle_round_trip_error_is_at_most_half_a_step(fmt):
    rows = [[math.sin(1.7 * r + 0.31 * c) * (r + 1) for c in range(150)] for r in range(2)]
    decoded = dequantize_row_split(encode_row_split(rows, fmt), fmt, 2, 150)
    _, group, _, qmax = QUANT[fmt]
    for row, back in zip(rows, decoded):
        for g in range(0, 150, group):
            step = max(abs(v) for v in row[g : g + group]) / qmax
            assert all(abs(a - b) <= 0.5 * step * 1.01 for a, b in zip(row[g : g + group], back[g : g + group]))
