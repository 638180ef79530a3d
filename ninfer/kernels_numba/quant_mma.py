"""Decode-time Q4G64 linear layers on the tensor cores: y[M, N] (+)= x[M, K] @ W^T for M <= 8 rows of x.

Why: the SIMT kernels of `quant_linear` spend about three instructions per weight on decoding and multiplying (byte
select, subtract, FMA), which caps them near a third of the H200's bandwidth. Here one `mma.sync.m16n8k16` (bf16 in,
fp32 accumulate) multiplies a 16x16 block of decoded weights by a 16x8 block of x, and decoding costs a shift, a
LOP3 and one `fma.bf16x2` per PAIR of weights:
- a nibble u (the code + 8, 0..15) OR 0x4300 is the bf16 number 128 + u, exactly (bf16 has 7 mantissa bits);
- fma(128 + u, 1, -136) is the signed code u - 8, exactly; codes times bf16 x are exact in the fp32 accumulator.
The group's fp16 scale multiplies the group's fp32 partial sums (4 mma k-steps) once, as in `quant_linear`. The only
rounding the SIMT kernels do not make is x rounded to bf16, as the bf16 cuBLAS path does.

Layout (`repack_q4_mma`, once at load): the weight is cut into tiles of 16 rows; per (tile, 64-column group) the 32
lanes of a warp hold 4 words each (one 16-byte load per lane, 512 contiguous bytes per warp): word j serves the mma
k-step j, its nibble s + 4 h is the A-fragment register s (rows g / g + 8, columns 2 t (+8) + h; g = lane / 4,
t = lane % 4). Scales follow the same tiling in pairs: word g of [tiles, groups, 8] holds the binary16 scales of rows
g and g + 8. x goes through `x_fragments` once per input: fp32 -> bf16 in B-fragment order, 32 bytes per lane per
group (two 16-byte loads, the same for every tile).

Geometry: a block of WARPS warps owns TILES row tiles; its warps split the K groups (warp w takes groups w, w + WARPS,
...) and their fragments are summed in shared memory in warp order. Each output element is one column of the mma
whatever M is, accumulated in the same order: a row's result does not depend on the other rows in the launch.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
from llvmlite import ir
from numba import float32, int32, types, uint32
from numba.cuda.extending import intrinsic

from ninfer.artifact import codec
from ninfer.artifact.formats import Q4G64, row_split_geometry
from ninfer.kernels_numba.linear import load4
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel
from ninfer.kernels_numba.common import bf16_pair

TILE_ROWS = 16
GROUP = 64
MAX_X_ROWS = 8  # the mma's N dimension
WARPS = 8
TILES = 1
UNROLL = 2
BF16_ONE_PAIR = 0x3F803F80
BF16_MINUS_136_PAIR = 0xC308C308  # -(128 + 8): the magic 128 and the Q4 code offset
BF16_128_PAIR = 0x43004300


@attrs.define(eq=False)
class QuantMmaWeight:
    """A Q4G64 [N, K] matrix on the device in the tensor-core layout (module docstring)."""

    shape: tuple[int, int]
    packed: object  # uint32 [tiles * groups * 32 * 4]
    scales: object  # uint32 [tiles * groups * 8]: binary16 scales of rows (g, g + 8) of the tile
    groups: int
    nbytes: int


# ---- PTX the numba front end does not expose ------------------------------------------------------------------------

@intrinsic
def mma_bf16_m16n8k16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A . B + C for one warp: A 16x16 bf16 (4 registers of bf16 pairs per lane), B 16x8 bf16 (2), C/D 16x8 fp32
    (4 per lane), the PTX fragment layouts of `mma.sync.aligned.m16n8k16.row.col`."""
    signature = types.UniTuple(types.float32, 4)(*(types.uint32,) * 6, *(types.float32,) * 4)

    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        function = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
        result = builder.asm(function, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                             "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                             "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", list(args), side_effect=False)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)])

    return signature, codegen


@intrinsic
def fma_bf16x2(typingctx, a, b, c):
    """a * b + c on two packed bf16 lanes (`fma.rn.bf16x2`, sm_80+)."""
    signature = types.uint32(types.uint32, types.uint32, types.uint32)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        return builder.asm(ir.FunctionType(i32, [i32] * 3), "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", list(args),
                           side_effect=False)

    return signature, codegen


@device_function
def q4_pair(word, s):
    """A-fragment register s (0..3) of a packed word: nibbles s and s + 4 as the bf16 pair of their signed codes."""
    raw = ((word >> uint32(4 * s)) & uint32(0x000F000F)) | uint32(BF16_128_PAIR)
    return fma_bf16x2(raw, uint32(BF16_ONE_PAIR), uint32(BF16_MINUS_136_PAIR))


# ---- host repack --------------------------------------------------------------------------------------------------

def _fragment_offsets() -> tuple[np.ndarray, np.ndarray]:
    """(row, column) inside a (16-row tile, 64-column group) of nibble p of word j of lane l: [32, 4, 8] each."""
    lane, word, nibble = np.meshgrid(np.arange(32), np.arange(4), np.arange(8), indexing="ij")
    g, t = lane // 4, lane % 4
    s, h = nibble % 4, nibble // 4
    rows = g + 8 * (s & 1)
    cols = 16 * word + 2 * t + 8 * (s >> 1) + h
    return rows, cols


def repack_q4_mma(shape: tuple[int, int], payload: np.ndarray) -> dict[str, np.ndarray]:
    """Host arrays of the tensor-core layout from an artifact Q4G64 payload: packed uint32 and scales uint32 (the
    pair a lane needs, rows g and g + 8, in one word)."""
    N, K = (int(v) for v in shape)
    if K % GROUP:
        raise ValueError(f"tensor-core Q4 layers need K % {GROUP} == 0, got {K}")
    geometry = row_split_geometry(Q4G64, (N, K))
    data = np.ascontiguousarray(np.frombuffer(memoryview(payload), dtype=np.uint8))
    groups = K // GROUP
    tiles = -(-N // TILE_ROWS)
    base = data[: N * geometry.base_row_bytes].reshape(N, geometry.groups_per_row, 32)[:, :groups]
    # The artifact's nibbles are two's complement (code mod 16); xor 8 makes them offset binary (code + 8).
    nibbles = np.zeros((tiles * TILE_ROWS, groups, GROUP), np.uint8)  # padding rows: code -8 at scale 0
    nibbles[:N, :, 0::2] = (base & 0x0F) ^ 8
    nibbles[:N, :, 1::2] = (base >> 4) ^ 8
    rows, cols = _fragment_offsets()
    tiled = nibbles.reshape(tiles, TILE_ROWS, groups, GROUP).transpose(0, 2, 1, 3)  # [tiles, groups, 16, 64]
    fragments = tiled[:, :, rows, cols].astype(np.uint32)  # [tiles, groups, 32, 4, 8]
    packed = np.zeros(fragments.shape[:-1], np.uint32)
    for p in range(8):
        packed |= fragments[..., p] << np.uint32(4 * p)
    scales = np.zeros((tiles * TILE_ROWS, groups), np.uint16)
    scales[:N] = data[geometry.scale_offset: geometry.total_bytes].view(np.uint16).reshape(
        N, geometry.groups_per_row)[:, :groups]
    scales = scales.reshape(tiles, 2, 8, groups).transpose(0, 3, 2, 1)  # [tiles, groups, g, (row g, row g + 8)]
    return {"packed": np.ascontiguousarray(packed).reshape(-1),
            "scales": np.ascontiguousarray(scales).reshape(-1).view(np.uint32)}


def upload_q4_mma(shape: tuple[int, int], payload: np.ndarray, *, stream=0) -> QuantMmaWeight:
    planes = repack_q4_mma(shape, payload)
    packed, scales = (cuda.to_device(planes[name], stream=stream) for name in ("packed", "scales"))
    return QuantMmaWeight(tuple(int(v) for v in shape), packed, scales, int(shape[1]) // GROUP,
                          int(planes["packed"].nbytes + planes["scales"].nbytes))


# ---- device code --------------------------------------------------------------------------------------------------

@intrinsic
def half_pair_to_f32(typingctx, word):
    """The two binary16 halves of a word as float32 (low, high): `cvt.f32.f16`, exact (subnormals too)."""
    signature = types.UniTuple(types.float32, 2)(types.uint32)

    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        result = builder.asm(ir.FunctionType(ir.LiteralStructType([f32, f32]), [i32]),
                             "{.reg .f16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi;}",
                             "=f,=f,r", list(args), side_effect=False)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, i) for i in range(2)])

    return signature, codegen


FRAGMENT_WORDS = 8 * 32  # x fragment words per 64-column group: 32 lanes x (4 k-steps x 2 registers)


def x_fragment_words(K: int) -> int:
    return K // GROUP * FRAGMENT_WORDS


@kernel((float32[:, ::1], uint32[::1]), fastmath=False)
def _x_fragments_kernel(x, out):
    """out[(q * 32 + lane) * 8 + 2 j + b] = the bf16 pair x[g, 64 q + 16 j + 2 t + 8 b (+1)] (0 for g >= M)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= out.shape[0]:
        return
    q = i >> 8
    lane = (i >> 3) & 31
    j = (i >> 1) & 3
    b = i & 1
    g = lane >> 2
    col = q * GROUP + 16 * j + 2 * (lane & 3) + 8 * b
    word = uint32(0)
    if g < x.shape[0]:
        word = bf16_pair(x[g, col], x[g, col + 1])
    out[i] = word


def x_fragments(x, out, *, stream) -> None:
    """x (fp32 [M <= 8, K]) rounded to bf16 into the mma B-fragment order `linear_q4_mma` reads (out: uint32
    [x_fragment_words(K)]). One launch serves every tensor-core layer that reads the same x."""
    M, K = x.shape
    if M > MAX_X_ROWS or out.shape[0] < x_fragment_words(K):
        raise ValueError(f"x fragments: x{tuple(x.shape)} (M <= 8) into {out.shape[0]} words")
    words = x_fragment_words(K)
    _x_fragments_kernel[math.ceil(words / 256), 256, stream](x, out[:words])


def make_q4_mma_kernel(tiles: int = TILES, warps: int = WARPS, unroll: int = UNROLL):
    """`tiles` row tiles per block, `warps` warps splitting the groups, `unroll` groups per warp step whose loads are
    all issued before the first mma of the step (bytes in flight hide the memory latency)."""
    ACC = 4 * tiles
    WORDS = 4 * tiles * unroll
    SCALES = tiles * unroll
    XS = 8 * unroll

    @kernel((uint32[::1], uint32[::1], uint32[::1], float32[:, ::1], int32, int32), fastmath=False)
    def q4_mma_kernel(xf, packed, scales, y, groups, accumulate):
        """xf: x fragments (`x_fragments`); scales: the (row g, row g + 8) binary16 pairs [tiles, groups, 8]."""
        partials = cuda.shared.array(0, float32)
        M = y.shape[0]
        N = int32(y.shape[1])
        lane = int32(cuda.threadIdx.x & 31)
        warp = int32(cuda.threadIdx.x >> 5)
        g = lane >> 2
        t = lane & 3
        tile0 = int32(cuda.blockIdx.x) * tiles
        total_tiles = (N + 15) >> 4
        acc = cuda.local.array(ACC, float32)
        words = cuda.local.array(WORDS, uint32)
        scale_pairs = cuda.local.array(SCALES, uint32)
        xs = cuda.local.array(XS, uint32)
        for a in range(ACC):
            acc[a] = float32(0.0)
        for q0 in range(warp, groups, warps * unroll):
            for u in range(unroll):  # every load of the step first
                q = min(q0 + u * warps, groups - 1)
                for r in range(tiles):
                    at = min(tile0 + r, total_tiles - 1) * groups + q
                    w0 = 4 * (r * unroll + u)
                    words[w0], words[w0 + 1], words[w0 + 2], words[w0 + 3] = load4(packed, (at * 32 + lane) * 4)
                    scale_pairs[r * unroll + u] = scales[at * 8 + g]
                x0 = (q * 32 + lane) * 8
                xs[8 * u], xs[8 * u + 1], xs[8 * u + 2], xs[8 * u + 3] = load4(xf, x0)
                xs[8 * u + 4], xs[8 * u + 5], xs[8 * u + 6], xs[8 * u + 7] = load4(xf, x0 + 4)
            for u in range(unroll):
                if q0 + u * warps < groups:
                    for r in range(tiles):
                        c0 = float32(0.0)
                        c1 = float32(0.0)
                        c2 = float32(0.0)
                        c3 = float32(0.0)
                        for j in range(4):
                            w = words[4 * (r * unroll + u) + j]
                            c0, c1, c2, c3 = mma_bf16_m16n8k16(q4_pair(w, 0), q4_pair(w, 1), q4_pair(w, 2),
                                                               q4_pair(w, 3), xs[8 * u + 2 * j], xs[8 * u + 2 * j + 1],
                                                               c0, c1, c2, c3)
                        s_lo, s_hi = half_pair_to_f32(scale_pairs[r * unroll + u])
                        acc[4 * r] += s_lo * c0
                        acc[4 * r + 1] += s_lo * c1
                        acc[4 * r + 2] += s_hi * c2
                        acc[4 * r + 3] += s_hi * c3
        for a in range(ACC):
            partials[(warp * ACC + a) * 32 + lane] = acc[a]
        cuda.syncthreads()
        if warp == 0:
            for a in range(ACC):
                total = float32(0.0)
                for w in range(warps):
                    total += partials[(w * ACC + a) * 32 + lane]
                r = a >> 2
                i = a & 3
                n = (tile0 + r) * 16 + g + 8 * (i >> 1)
                m = 2 * t + (i & 1)
                if m < M and n < N and tile0 + r < total_tiles:
                    if accumulate != 0:
                        y[m, n] += total
                    else:
                        y[m, n] = total

    return q4_mma_kernel


Q4_MMA_KERNEL = make_q4_mma_kernel()


def linear_q4_mma(xf, qw: QuantMmaWeight, y, *, stream, accumulate: bool = False, _kernel=None,
                  tiles: int = TILES, warps: int = WARPS) -> None:
    """y[M, N] (+)= x[M, K] @ W^T, M = y.shape[0] <= 8, x given as its fragments (`x_fragments`). Capture-safe."""
    M, N = y.shape
    K = qw.shape[1]
    if N != qw.shape[0] or M > MAX_X_ROWS or xf.shape[0] < x_fragment_words(K):
        raise ValueError(f"tensor-core Q4 linear: W{qw.shape} y{tuple(y.shape)} (M <= 8), {xf.shape[0]} x words")
    if M == 0:
        return
    fn = _kernel if _kernel is not None else Q4_MMA_KERNEL
    blocks = math.ceil(math.ceil(N / TILE_ROWS) / tiles)
    fn[blocks, 32 * warps, stream, warps * 4 * tiles * 32 * 4](xf, qw.packed, qw.scales, y, int32(qw.groups),
                                                              int32(1 if accumulate else 0))


# ---- NumPy twins ---------------------------------------------------------------------------------------------------

def x_fragments_reference(x: np.ndarray) -> np.ndarray:
    """`x_fragments` on the host: uint32 [x_fragment_words(K)]."""
    M, K = x.shape
    bits = np.zeros((MAX_X_ROWS, K), np.uint32)
    bits[:M] = codec.f32_to_bf16_bits(np.asarray(x, np.float32))
    lane, j, b = np.meshgrid(np.arange(32), np.arange(4), np.arange(2), indexing="ij")
    g, cols = lane // 4, 16 * j + 2 * (lane % 4) + 8 * b  # [32, 4, 2]
    q = np.arange(K // GROUP)[:, None, None, None] * GROUP
    words = bits[g, q + cols] | (bits[g, q + cols + 1] << np.uint32(16))  # [groups, 32, 4, 2]
    return words.reshape(-1)


def linear_q4_mma_reference(x_bf16: np.ndarray, shape: tuple[int, int], payload: np.ndarray,
                            y: np.ndarray | None = None, *, accumulate: bool = False) -> np.ndarray:
    """fp32 y of bf16 x times the codec's exact fp32 decode (float64 sums: the kernel's order is its own)."""
    weights = codec.decode(np.asarray(payload, np.uint8), Q4G64, tuple(shape)).astype(np.float64)
    product = (codec.bf16_bits_to_f32(x_bf16).astype(np.float64) @ weights.T).astype(np.float32)
    if y is None or not accumulate:
        return product
    return (y + product).astype(np.float32)
