"""Decode-time linear layers over the ninfer-v2 quantized formats (Q4G64_F16S, Q5G64_F16S, Q6G64_F16S, W8G32_F16S),
their MoE gathered variant, and dequantize-to-bf16 for the prefill cuBLAS path.

Device layout (`upload_quant_weight` repacks the artifact's `row-split-k128-v1` payload once, at load):
- base: the artifact's base plane as is, uint64 [N, base_row_bytes / 8]. A "segment" is 32 consecutive columns of
  one row: 16 bytes of nibbles (Q4/5/6: byte b = code 2b low nibble | code 2b+1 high nibble) or 32 code bytes (W8).
- high: Q5 uint32 [N, S] (S = K_pad / 32 segments), Q6 uint32 [N, 2 S]; Q4/W8 a 1x1 dummy. The artifact's high
  plane (a lane-major bit stream) is permuted so the high bits of code k = 8 j + 2 i + p (j: 32-bit base word, i: byte,
  p: low/high nibble) sit at bit 8 i + q (Q5, q = 2 j + p) or 8 i + 2 q' (Q6, word j // 2, q' = 2 (j % 2) + p): one
  shift and one mask put them next to the four nibbles of a byte-spread base word.
- scales: the artifact's binary16 scale plane as is, uint16 [N, groups_per_row] (converted in the kernel, exactly).
Decode per code byte: u = code + 2^(bits-1) in [0, 2^bits) via xor, then `byte_perm` builds the float 2^23 + u and
one subtraction gives the code exactly (magic-number int->float). A segment's 32 products are summed in fp32, then
scaled once (acc += partial * scale), in a fixed order: batch invariant like `linear_bf16`.

Geometry: blocks of `warps` (default 8) warps, R output rows per warp; lane l handles segment 32 i + l (1024 columns
per warp step), its loads software-pipelined one step ahead; x is staged in shared memory as fp32, permuted per
segment so a lane's x values for 4 codes are one conflict-free `ld.shared.v4.f32`. M == 1 has its own kernel (1-row
tile); more rows go in tiles of 8. Requirements: K % 32 == 0.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
from numba import float32, int32, uint16, uint32, uint64
from numba.cuda import libdevice

from ninfer.artifact import codec
from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32, row_split_geometry
from ninfer.backends.cpu.ops import linear as cpu_linear
from ninfer.kernels_numba.common import bf16_pair, code_float, warp_sum
from ninfer.kernels_numba.linear import (
    ROW_TILE, WARPS, chunk_columns, gathered_reference, load2, load4, stage_x, store4, store_slot_sums,
)
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel, large_device_function, register_options

QUANT_SPAN = 1024  # columns one warp covers per step (32 lanes x 32-column segments)
QUANT_ROWS_PER_WARP = 2
SEGMENT = 32
FORMAT_IDS = {Q4G64: 4, Q5G64: 5, Q6G64: 6, W8G32: 8}
SCALE_2_112 = float(2.0**112)


@attrs.define(eq=False)
class QuantWeight:
    """A quantized [N, K] matrix on the device in the kernels' layout (see the module docstring)."""

    fmt: str
    shape: tuple[int, int]
    base: object  # uint64 [N, base_row_bytes / 8]
    high: object  # uint32 [N, S] (Q5), [N, 2S] (Q6), [1, 1] dummy otherwise
    scales: object  # uint16 [N, groups_per_row]
    nbytes: int


# ---- host repack --------------------------------------------------------------------------------------------------

def _high_permutation(bits: int) -> np.ndarray:
    """dest[b] = the artifact stream position (within a segment) of the high bits that land at new bit-slot b."""
    if bits == 5:  # 32 slots of 1 bit: slot 8 i + 2 j + p holds code 8 j + 2 i + p
        dest = np.empty(32, np.int64)
        for j in range(4):
            for i in range(4):
                for p in range(2):
                    dest[8 * i + 2 * j + p] = 8 * j + 2 * i + p
        return dest
    # Q6: 32 slots of 2 bits over two words; word w = j // 2, slot (in 2-bit units) 16 w + 4 i + 2 (j % 2) + p
    dest = np.empty(32, np.int64)
    for j in range(4):
        for i in range(4):
            for p in range(2):
                dest[16 * (j // 2) + 4 * i + 2 * (j % 2) + p] = 8 * j + 2 * i + p
    return dest


def repack_quant(fmt: str, shape: tuple[int, int], payload: np.ndarray) -> dict[str, np.ndarray]:
    """Host planes of the device layout: base uint64 [N, B/8], high uint32, scales uint16 [N, groups]."""
    geometry = row_split_geometry(fmt, tuple(shape))
    quant = geometry.quant
    N = geometry.rows
    data = np.ascontiguousarray(np.frombuffer(memoryview(payload), dtype=np.uint8))
    assert data.size == geometry.total_bytes, (data.size, geometry.total_bytes)
    base = data[: N * geometry.base_row_bytes].view(np.uint64).reshape(N, geometry.base_row_bytes // 8)
    scales = data[geometry.scale_offset: geometry.total_bytes].view(np.uint16).reshape(N, geometry.groups_per_row)
    segments = geometry.groups_per_row * quant.group // SEGMENT
    high_bits = quant.bits - quant.base_bits
    if high_bits == 0:
        high = np.zeros((1, 1), np.uint32)
    else:
        raw = data[geometry.high_offset: geometry.high_offset + N * geometry.high_row_bytes]
        # bytes per segment: 4 (Q5) or 8 (Q6); unpack LSB-first to one bit per element
        seg_bytes = SEGMENT * high_bits // 8
        stream = np.unpackbits(raw.reshape(N, segments, seg_bytes), axis=2, bitorder="little")
        stream = stream.reshape(N, segments, SEGMENT, high_bits)  # [.., code, bit]
        dest = _high_permutation(quant.bits)
        permuted = stream[:, :, dest, :].reshape(N, segments, seg_bytes * 8)
        high = np.packbits(permuted, axis=2, bitorder="little").reshape(N, -1).view(np.uint32)
        high = np.ascontiguousarray(high)
    return {"base": np.ascontiguousarray(base), "high": high, "scales": np.ascontiguousarray(scales)}


def upload_quant_weight(fmt: str, shape: tuple[int, int], payload: np.ndarray, *, stream=0) -> QuantWeight:
    """Repack an artifact payload (uint8) and copy it to the device (load time: allocates and copies)."""
    if fmt not in FORMAT_IDS:
        raise ValueError(f"not a quantized format: {fmt}")
    N, K = int(shape[0]), int(shape[1])
    if K % SEGMENT:
        raise ValueError(f"quantized linear kernels need K % 32 == 0, got {K}")
    return upload_quant_planes(fmt, (N, K), repack_quant(fmt, (N, K), payload), stream=stream)


def upload_quant_planes(fmt: str, shape: tuple[int, int], planes: dict[str, np.ndarray], *, stream=0) -> QuantWeight:
    """Copy already repacked host planes (`repack_quant`) to the device: benchmarks that upload the same random
    payload for many tensors repack it once."""
    arrays = {name: cuda.to_device(value, stream=stream) for name, value in planes.items()}
    nbytes = sum(int(value.nbytes) for value in planes.values())
    return QuantWeight(fmt, tuple(shape), arrays["base"], arrays["high"], arrays["scales"], nbytes)


# ---- device code --------------------------------------------------------------------------------------------------

@device_function
def half_bits_to_f32(h):
    """A non-negative binary16 (bits) as float32, exactly (subnormals too: no flush-to-zero here)."""
    return libdevice.int_as_float(int32((uint32(h) & uint32(0x7FFF)) << uint32(13))) * float32(SCALE_2_112)


@device_function
def nibble_word(b0, b1, j, p):
    """Nibbles p of 32-bit base word j (0..3) of a segment held as two uint64, spread one per byte."""
    if j == 0:
        w = uint32(b0 & uint64(0xFFFFFFFF))
    elif j == 1:
        w = uint32(b0 >> uint64(32))
    elif j == 2:
        w = uint32(b1 & uint64(0xFFFFFFFF))
    else:
        w = uint32(b1 >> uint64(32))
    if p == 1:
        w = w >> uint32(4)
    return w & uint32(0x0F0F0F0F)


@device_function
def spread_high(h0, h1, j, p, bits):
    """High bits of the 4 codes of nibble word (j, p) placed at bits 4.. of each byte."""
    if bits == 5:
        q = 2 * j + p
        if q <= 4:
            hb = h0 << uint32(4 - q)
        else:
            hb = h0 >> uint32(q - 4)
        return hb & uint32(0x10101010)
    hw = h0 if j < 2 else h1
    q2 = 2 * (2 * (j % 2) + p)
    if q2 <= 4:
        hb = hw << uint32(4 - q2)
    else:
        hb = hw >> uint32(q2 - 4)
    return hb & uint32(0x30303030)


@large_device_function
def code_bytes(bits, b0, b1, b2, b3, h0, h1, v):
    """Slot v (0..7) of a segment as a word of four unsigned code bytes (code + 2^(bits-1)). Q: slot v = 2 j + p
    holds codes 8 j + 2 i + p (i = byte); W8: slot v holds codes 4 v + i (b0..b3 are the four uint64 words)."""
    if bits == 8:
        if v == 0:
            w = uint32(b0 & uint64(0xFFFFFFFF))
        elif v == 1:
            w = uint32(b0 >> uint64(32))
        elif v == 2:
            w = uint32(b1 & uint64(0xFFFFFFFF))
        elif v == 3:
            w = uint32(b1 >> uint64(32))
        elif v == 4:
            w = uint32(b2 & uint64(0xFFFFFFFF))
        elif v == 5:
            w = uint32(b2 >> uint64(32))
        elif v == 6:
            w = uint32(b3 & uint64(0xFFFFFFFF))
        else:
            w = uint32(b3 >> uint64(32))
        return w ^ uint32(0x80808080)
    j = v >> 1
    p = v & 1
    nib = nibble_word(b0, b1, j, p)
    if bits == 4:
        return nib ^ uint32(0x08080808)
    if bits == 5:
        return (nib | spread_high(h0, h1, j, p, 5)) ^ uint32(0x10101010)
    return (nib | spread_high(h0, h1, j, p, 6)) ^ uint32(0x20202020)


@device_function
def stage_x_quant(xs, x, row0, rows, c0, width, kc, bits):
    """x[row0 + m, c0 + c] into xs[m * kc + v * (kc / 8) + 4 * seg + e], seg = c // 32 and (v, e) the slot and
    component of column c % 32 in its segment (see `code_bytes`): Q formats v = 2 (r // 8) + r % 2, e = (r % 8) // 2;
    W8 v = r // 4, e = r % 4."""
    stage_x(xs, x, row0, rows, c0, width, kc, bits)


@large_device_function
def load_segment(base, high, n, s, bits):
    """(b0, b1, b2, b3, h0, h1) of segment s of row n."""
    B8 = base.shape[1]
    if bits == 8:
        b0, b1 = load2(base, n * B8 + 4 * s)
        b2, b3 = load2(base, n * B8 + 4 * s + 2)
        return b0, b1, b2, b3, uint32(0), uint32(0)
    b0, b1 = load2(base, n * B8 + 2 * s)
    H = high.shape[1]
    if bits == 5:
        return b0, b1, uint64(0), uint64(0), high[n, s], uint32(0)
    if bits == 6:
        h0, h1 = load2(high, n * H + 2 * s)
        return b0, b1, uint64(0), uint64(0), h0, h1
    return b0, b1, uint64(0), uint64(0), uint32(0), uint32(0)


def _offset(bits: int) -> float:
    return float(2**23 + 2 ** (bits - 1))


def make_slot(bits: int, R: int, MT: int):
    """FMAs of code slot v (a literal at each call site, so the bit selection folds) for R weight rows and up to 8
    x rows: part[m * R + r] += sum_i code(r, v, i) * x[m, slot v component i]."""

    @large_device_function
    def slot(v, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset):
        cw = cuda.local.array(R, uint32)
        for r in range(R):
            cw[r] = code_bytes(bits, b0[r], b1[r], b2[r], b3[r], h0[r], h1[r], v)
        for m in range(MT):
            if m < mt:
                xa, xb, xc, xd = load4(xs, m * kc + v * slot_stride + xo)
                for r in range(R):
                    p = part[m * R + r]
                    p += code_float(cw[r], 0, offset) * xa
                    p += code_float(cw[r], 1, offset) * xb
                    p += code_float(cw[r], 2, offset) * xc
                    p += code_float(cw[r], 3, offset) * xd
                    part[m * R + r] = p

    return slot


def make_linear_quant_kernel(bits: int, R: int, MT: int = ROW_TILE, max_registers: int | None = None):
    """Quantized GEMV for one format with R rows per warp and x-row tiles of MT (compile-time constants; MT=1 is
    the M == 1 fast path). Segment loads are software-pipelined one warp step ahead."""
    ACC = MT * R
    slot = make_slot(bits, R, MT)
    SEG_PER_GROUP_SHIFT = 0 if bits == 8 else 1
    OFFSET = _offset(bits)

    @kernel((float32[:, ::1], uint64[:, ::1], uint32[:, ::1], uint16[:, ::1], float32[:, ::1], int32, int32),
            fastmath=False, **register_options(max_registers))
    def linear_quant_kernel(x, base, high, scales, y, accumulate, kc):
        xs = cuda.shared.array(0, float32)
        M = x.shape[0]
        K = x.shape[1]
        N = y.shape[1]
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        n0 = (cuda.blockIdx.x * (cuda.blockDim.x >> 5) + warp) * R
        slot_stride = kc >> 3
        offset = float32(OFFSET)
        acc = cuda.local.array(ACC, float32)
        part = cuda.local.array(ACC, float32)
        b0 = cuda.local.array(R, uint64)
        b1 = cuda.local.array(R, uint64)
        b2 = cuda.local.array(R, uint64)
        b3 = cuda.local.array(R, uint64)
        h0 = cuda.local.array(R, uint32)
        h1 = cuda.local.array(R, uint32)
        s16 = cuda.local.array(R, uint32)
        nb0 = cuda.local.array(R, uint64)
        nb1 = cuda.local.array(R, uint64)
        nb2 = cuda.local.array(R, uint64)
        nb3 = cuda.local.array(R, uint64)
        nh0 = cuda.local.array(R, uint32)
        nh1 = cuda.local.array(R, uint32)
        ns16 = cuda.local.array(R, uint32)
        rows = cuda.local.array(R, int32)
        for r in range(R):
            rows[r] = min(n0 + r, N - 1)
        for t0 in range(0, M, MT):
            mt = min(MT, M - t0)
            for a in range(ACC):
                acc[a] = float32(0.0)
            for c0 in range(0, K, kc):
                width = min(kc, K - c0)
                seg = lane
                if n0 < N and seg * 32 < width:
                    s = (c0 >> 5) + seg
                    for r in range(R):
                        nb0[r], nb1[r], nb2[r], nb3[r], nh0[r], nh1[r] = load_segment(base, high, rows[r], s, bits)
                        ns16[r] = scales[rows[r], s >> SEG_PER_GROUP_SHIFT]
                cuda.syncthreads()
                stage_x_quant(xs, x, t0, mt, c0, width, kc, bits)
                cuda.syncthreads()
                if n0 < N:
                    while seg * 32 < width:
                        for r in range(R):
                            b0[r] = nb0[r]
                            b1[r] = nb1[r]
                            b2[r] = nb2[r]
                            b3[r] = nb3[r]
                            h0[r] = nh0[r]
                            h1[r] = nh1[r]
                            s16[r] = ns16[r]
                        sn = seg + 32
                        if sn * 32 < width:
                            s = (c0 >> 5) + sn
                            for r in range(R):
                                nb0[r], nb1[r], nb2[r], nb3[r], nh0[r], nh1[r] = load_segment(base, high, rows[r], s,
                                                                                              bits)
                                ns16[r] = scales[rows[r], s >> SEG_PER_GROUP_SHIFT]
                        for a in range(ACC):
                            part[a] = float32(0.0)
                        xo = seg << 2
                        slot(0, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset)
                        slot(1, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset)
                        slot(2, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset)
                        slot(3, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset)
                        slot(4, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset)
                        slot(5, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset)
                        slot(6, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset)
                        slot(7, part, xs, xo, slot_stride, mt, kc, b0, b1, b2, b3, h0, h1, offset)
                        for r in range(R):
                            scale = half_bits_to_f32(s16[r])
                            for m in range(MT):
                                if m < mt:
                                    acc[m * R + r] += part[m * R + r] * scale
                        seg = sn
            if n0 < N:
                for m in range(MT):
                    if m < mt:
                        for r in range(R):
                            total = warp_sum(acc[m * R + r])
                            n = n0 + r
                            if lane == 0 and n < N:
                                if accumulate != 0:
                                    y[t0 + m, n] += total
                                else:
                                    y[t0 + m, n] = total

    return linear_quant_kernel


def make_linear_quant_gathered_kernel(bits: int, R: int):
    slot = make_slot(bits, R, 1)
    SEG_PER_GROUP_SHIFT = 0 if bits == 8 else 1
    OFFSET = _offset(bits)

    @kernel((float32[:, ::1], uint64[:, ::1], uint32[:, ::1], uint16[:, ::1], int32[::1], float32[:, ::1], int32,
             int32, int32), fastmath=False)
    def linear_quant_gathered_kernel(x, base, high, scales, ids, y, rpe, xdiv, kc):
        xs = cuda.shared.array(0, float32)
        K = x.shape[1]
        j = cuda.blockIdx.y
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        n0 = (cuda.blockIdx.x * (cuda.blockDim.x >> 5) + warp) * R
        row_base = ids[j] * rpe
        xrow = j // xdiv
        slot_stride = kc >> 3
        offset = float32(OFFSET)
        acc = cuda.local.array(R, float32)
        part = cuda.local.array(R, float32)
        b0 = cuda.local.array(R, uint64)
        b1 = cuda.local.array(R, uint64)
        b2 = cuda.local.array(R, uint64)
        b3 = cuda.local.array(R, uint64)
        h0 = cuda.local.array(R, uint32)
        h1 = cuda.local.array(R, uint32)
        s16 = cuda.local.array(R, uint32)
        nb0 = cuda.local.array(R, uint64)
        nb1 = cuda.local.array(R, uint64)
        nb2 = cuda.local.array(R, uint64)
        nb3 = cuda.local.array(R, uint64)
        nh0 = cuda.local.array(R, uint32)
        nh1 = cuda.local.array(R, uint32)
        ns16 = cuda.local.array(R, uint32)
        rows = cuda.local.array(R, int32)
        for r in range(R):
            acc[r] = float32(0.0)
            rows[r] = row_base + min(n0 + r, rpe - 1)
        for c0 in range(0, K, kc):
            width = min(kc, K - c0)
            seg = lane
            if n0 < rpe and seg * 32 < width:
                s = (c0 >> 5) + seg
                for r in range(R):
                    nb0[r], nb1[r], nb2[r], nb3[r], nh0[r], nh1[r] = load_segment(base, high, rows[r], s, bits)
                    ns16[r] = scales[rows[r], s >> SEG_PER_GROUP_SHIFT]
            cuda.syncthreads()
            stage_x_quant(xs, x, xrow, 1, c0, width, kc, bits)
            cuda.syncthreads()
            if n0 < rpe:
                while seg * 32 < width:
                    for r in range(R):
                        b0[r] = nb0[r]
                        b1[r] = nb1[r]
                        b2[r] = nb2[r]
                        b3[r] = nb3[r]
                        h0[r] = nh0[r]
                        h1[r] = nh1[r]
                        s16[r] = ns16[r]
                        part[r] = float32(0.0)
                    sn = seg + 32
                    if sn * 32 < width:
                        s = (c0 >> 5) + sn
                        for r in range(R):
                            nb0[r], nb1[r], nb2[r], nb3[r], nh0[r], nh1[r] = load_segment(base, high, rows[r], s,
                                                                                          bits)
                            ns16[r] = scales[rows[r], s >> SEG_PER_GROUP_SHIFT]
                    xo = seg << 2
                    slot(0, part, xs, xo, slot_stride, 1, kc, b0, b1, b2, b3, h0, h1, offset)
                    slot(1, part, xs, xo, slot_stride, 1, kc, b0, b1, b2, b3, h0, h1, offset)
                    slot(2, part, xs, xo, slot_stride, 1, kc, b0, b1, b2, b3, h0, h1, offset)
                    slot(3, part, xs, xo, slot_stride, 1, kc, b0, b1, b2, b3, h0, h1, offset)
                    slot(4, part, xs, xo, slot_stride, 1, kc, b0, b1, b2, b3, h0, h1, offset)
                    slot(5, part, xs, xo, slot_stride, 1, kc, b0, b1, b2, b3, h0, h1, offset)
                    slot(6, part, xs, xo, slot_stride, 1, kc, b0, b1, b2, b3, h0, h1, offset)
                    slot(7, part, xs, xo, slot_stride, 1, kc, b0, b1, b2, b3, h0, h1, offset)
                    for r in range(R):
                        acc[r] += part[r] * half_bits_to_f32(s16[r])
                    seg = sn
        if n0 < rpe:
            store_slot_sums(acc, R, y, j, n0, rpe)

    return linear_quant_gathered_kernel


def make_dequantize_kernel(bits: int):
    SEG_PER_GROUP_SHIFT = 0 if bits == 8 else 1
    OFFSET = _offset(bits)

    @kernel((uint64[:, ::1], uint32[:, ::1], uint16[:, ::1], uint32[:, ::1]), fastmath=False)
    def dequantize_kernel(base, high, scales, out):
        """out (uint32 pairs of bf16, [N, K/2]); one thread per (row, segment)."""
        N = out.shape[0]
        S = out.shape[1] >> 4  # 16 pairs per segment
        t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if t >= N * S:
            return
        n = t // S
        s = t - n * S
        offset = float32(OFFSET)
        b0, b1, b2, b3, h0, h1 = load_segment(base, high, n, s, bits)
        scale = half_bits_to_f32(scales[n, s >> SEG_PER_GROUP_SHIFT])
        flat = n * out.shape[1] + s * 16  # pair index of the segment's first two columns
        for v in range(0, 8, 2):
            cw0 = code_bytes(bits, b0, b1, b2, b3, h0, h1, v)
            cw1 = code_bytes(bits, b0, b1, b2, b3, h0, h1, v + 1)
            if bits == 8:  # slots v, v+1: codes 4v .. 4v+7 -> pairs 2v .. 2v+3
                p0 = bf16_pair(code_float(cw0, 0, offset) * scale, code_float(cw0, 1, offset) * scale)
                p1 = bf16_pair(code_float(cw0, 2, offset) * scale, code_float(cw0, 3, offset) * scale)
                p2 = bf16_pair(code_float(cw1, 0, offset) * scale, code_float(cw1, 1, offset) * scale)
                p3 = bf16_pair(code_float(cw1, 2, offset) * scale, code_float(cw1, 3, offset) * scale)
                store4(out, flat + 2 * v, p0, p1, p2, p3)
            else:  # slots 2j (even codes), 2j+1 (odd codes): pair 4j + i = codes 8j+2i, 8j+2i+1
                p0 = bf16_pair(code_float(cw0, 0, offset) * scale, code_float(cw1, 0, offset) * scale)
                p1 = bf16_pair(code_float(cw0, 1, offset) * scale, code_float(cw1, 1, offset) * scale)
                p2 = bf16_pair(code_float(cw0, 2, offset) * scale, code_float(cw1, 2, offset) * scale)
                p3 = bf16_pair(code_float(cw0, 3, offset) * scale, code_float(cw1, 3, offset) * scale)
                store4(out, flat + 2 * v, p0, p1, p2, p3)

    return dequantize_kernel


# Row tiles compiled per format: 1 (M == 1), 2 (M == 2) and 4 (M >= 3, in tiles of 4). Wider tiles need more
# registers than they save in weight reads (the 8-row tile ran 5x slower per launch than the 1-row one on the H200).
QUANT_TILES = (1, 2, 4)
LINEAR_QUANT_KERNELS_BY_TILE = {tile: {bits: make_linear_quant_kernel(bits, QUANT_ROWS_PER_WARP, tile)
                                       for bits in (4, 5, 6, 8)} for tile in QUANT_TILES}
LINEAR_QUANT_KERNELS_M1 = LINEAR_QUANT_KERNELS_BY_TILE[1]


def quant_tile(rows: int) -> int:
    """The row tile the launcher uses for `rows` x rows."""
    return next((tile for tile in QUANT_TILES if rows <= tile), QUANT_TILES[-1])
GATHERED_QUANT_KERNELS = {bits: make_linear_quant_gathered_kernel(bits, QUANT_ROWS_PER_WARP) for bits in (4, 5, 6, 8)}
DEQUANTIZE_KERNELS = {bits: make_dequantize_kernel(bits) for bits in (4, 5, 6, 8)}


# ---- launchers ----------------------------------------------------------------------------------------------------

def linear_quant(x, qw: QuantWeight, y, *, stream, accumulate: bool = False,
                 rows_per_warp: int = QUANT_ROWS_PER_WARP, warps: int = WARPS,
                 _kernel=None) -> None:
    """y[M, N] (+)= x[M, K] @ W^T for a QuantWeight W [N, K]; same contract as `linear_bf16`. Capture-safe."""
    M, K = x.shape
    N = y.shape[1]
    assert (N, K) == tuple(qw.shape) and y.shape[0] == M, (x.shape, qw.shape, y.shape)
    if M == 0:
        return
    rows = quant_tile(M)
    kc = chunk_columns(rows, K, QUANT_SPAN)
    fn = _kernel if _kernel is not None else LINEAR_QUANT_KERNELS_BY_TILE[rows][FORMAT_IDS[qw.fmt]]
    blocks = math.ceil(N / (warps * rows_per_warp))
    fn[blocks, 32 * warps, stream, rows * kc * 4](x, qw.base, qw.high, qw.scales, y, int32(1 if accumulate else 0),
                                               int32(kc))


def linear_quant_gathered(x, qw: QuantWeight, expert_ids, y, *, rows_per_expert: int, x_per_slot: bool, stream,
                          rows_per_warp: int = QUANT_ROWS_PER_WARP, warps: int = WARPS,
                 _kernel=None) -> None:
    """Same contract as `linear_bf16_gathered` over a QuantWeight [E * rows_per_expert, K]."""
    M, S = expert_ids.shape
    K = x.shape[2] if x_per_slot else x.shape[1]
    rpe = int(rows_per_expert)
    assert qw.shape[1] == K and qw.shape[0] % rpe == 0 and y.shape == (M, S, rpe)
    if M * S == 0:
        return
    x2 = x.reshape(M * S, K) if x_per_slot else x
    y2 = y.reshape(M * S, rpe)
    ids = expert_ids.reshape(M * S)
    kc = chunk_columns(1, K, QUANT_SPAN)
    fn = _kernel if _kernel is not None else GATHERED_QUANT_KERNELS[FORMAT_IDS[qw.fmt]]
    blocks = math.ceil(rpe / (warps * rows_per_warp))
    fn[(blocks, M * S), 32 * warps, stream, kc * 4](x2, qw.base, qw.high, qw.scales, ids, y2, int32(rpe),
                                                 int32(1 if x_per_slot else S), int32(kc))


def dequantize_bf16(qw: QuantWeight, out, *, stream) -> None:
    """out[N, K] (uint16 bf16 bits, C-contiguous) = bf16(code * scale), exactly the codec's decode rounded to bf16."""
    N, K = qw.shape
    assert tuple(out.shape) == (N, K)
    out32 = out.view(np.uint32)  # [N, K/2]; K % 32 == 0
    threads = 256
    blocks = math.ceil(N * (K // SEGMENT) / threads)
    DEQUANTIZE_KERNELS[FORMAT_IDS[qw.fmt]][blocks, threads, stream](qw.base, qw.high, qw.scales, out32)


# ---- NumPy twins --------------------------------------------------------------------------------------------------

def dequantize_f32_reference(fmt: str, shape: tuple[int, int], payload: np.ndarray) -> np.ndarray:
    return codec.decode(np.asarray(payload, np.uint8), fmt, tuple(shape))


def dequantize_bf16_reference(fmt: str, shape: tuple[int, int], payload: np.ndarray) -> np.ndarray:
    return codec.f32_to_bf16_bits(dequantize_f32_reference(fmt, shape, payload))


def linear_quant_reference(x: np.ndarray, fmt: str, shape: tuple[int, int], payload: np.ndarray,
                           y: np.ndarray | None = None, *, accumulate: bool = False) -> np.ndarray:
    out = cpu_linear(np.asarray(x, np.float32), dequantize_f32_reference(fmt, shape, payload))
    if accumulate:
        out = np.asarray(y, np.float32) + out
    return out.astype(np.float32)


def linear_quant_gathered_reference(x: np.ndarray, fmt: str, shape: tuple[int, int], payload: np.ndarray,
                                    expert_ids: np.ndarray, *, rows_per_expert: int, x_per_slot: bool) -> np.ndarray:
    return gathered_reference(x, dequantize_f32_reference(fmt, shape, payload), expert_ids,
                              rows_per_expert=rows_per_expert, x_per_slot=x_per_slot)


def decode_repacked_reference(fmt: str, shape: tuple[int, int], planes: dict[str, np.ndarray]) -> np.ndarray:
    """NumPy emulation of the kernels' decode from the repacked planes (same bit operations): fp32 [N, K]. Tests
    compare it with `codec.decode` to pin the repack and the device bit tricks without a GPU."""
    N, K = shape
    bits = FORMAT_IDS[fmt]
    S = K // SEGMENT
    base = planes["base"].view(np.uint32)  # [N, B/4] little-endian words
    scales16 = planes["scales"]
    h = scales16.astype(np.uint32) & 0x7FFF
    scale32 = ((h << 13).view(np.float32) * np.float32(2.0**112)).astype(np.float32)
    out = np.empty((N, K), np.float32)
    half = 2 ** (bits - 1)
    for s in range(S):
        sc = scale32[:, s if bits == 8 else s // 2]
        for v in range(8):
            if bits == 8:
                u = base[:, 8 * s + v] ^ np.uint32(0x80808080)
                cols = [32 * s + 4 * v + i for i in range(4)]
            else:
                j, p = v >> 1, v & 1
                nib = (base[:, 4 * s + j] >> np.uint32(4 * p)) & np.uint32(0x0F0F0F0F)
                if bits == 4:
                    u = nib ^ np.uint32(0x08080808)
                elif bits == 5:
                    q = 2 * j + p
                    hw = planes["high"][:, s]
                    hb = (hw << np.uint32(4 - q)) if q <= 4 else (hw >> np.uint32(q - 4))
                    u = (nib | (hb & np.uint32(0x10101010))) ^ np.uint32(0x10101010)
                else:
                    hw = planes["high"][:, 2 * s + j // 2]
                    q2 = 2 * (2 * (j % 2) + p)
                    hb = (hw << np.uint32(4 - q2)) if q2 <= 4 else (hw >> np.uint32(q2 - 4))
                    u = (nib | (hb & np.uint32(0x30303030))) ^ np.uint32(0x20202020)
                cols = [32 * s + 8 * j + 2 * i + p for i in range(4)]
            for i in range(4):
                byte = (u >> np.uint32(8 * i)) & np.uint32(0xFF)
                magic = (np.uint32(0x4B000000) | byte).view(np.float32)
                code = magic - np.float32(2**23 + half)
                out[:, cols[i]] = code * sc
    return out
