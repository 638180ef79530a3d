"""Decode-time quantized linear layers on the tensor cores: y[M, N] (+)= x[M, K] @ W^T for M <= 8 rows of x, for
the ninfer-v2 formats Q4G64, Q5G64, Q6G64 and W8G32.

Why: the SIMT kernels of `quant_linear` spend about three instructions per weight on decoding and multiplying (byte
select, subtract, FMA), which caps them near a third of the H200's bandwidth. Here one `mma.sync.m16n8k16` (bf16 in,
fp32 accumulate) multiplies a 16x16 block of decoded weights by a 16x8 block of x, and decoding costs a shift, a
LOP3 and one `fma.bf16x2` per PAIR of weights:
- an unsigned code u = code + 2^(bits-1) below 128, OR 0x4300, is the bf16 number 128 + u, exactly (bf16 has 7
  mantissa bits); fma(128 + u, 1, -(128 + 2^(bits-1))) is the signed code, exactly. Q5/Q6 OR their high bits (a
  separate plane, arranged so one shift and mask put them at bits 4..5 of both halves) into the nibble pair first.
- W8 codes need 8 bits: u = 16 h + l is split into two nibble planes, each decoded as above (h with offset 8, l with
  offset 0); two mma chains give C_h and C_l, and the exact code sum is 16 C_h + C_l.
Codes times bf16 x are exact in the fp32 accumulator; a group's fp16 scale multiplies its fp32 partial sums once, as
in `quant_linear`. The only rounding the SIMT kernels do not make is x rounded to bf16, as the bf16 cuBLAS path does.

Layout (`repack_quant_mma`, once at load): the weight is cut into tiles of 16 rows and blocks of 64 columns; per
(tile, block) the 32 lanes of a warp hold 4 nibble words each (one 16-byte load per lane, 512 contiguous bytes per
warp): word j serves the mma k-step j, its nibble s + 4 h is the A-fragment register s (rows g / g + 8, columns
2 t (+8) + h; g = lane / 4, t = lane % 4). A second plane per lane holds the high bits (Q5: 1 word, Q6: 2, W8: 4
nibble words of h). Scales follow the same tiling in pairs: a word holds the binary16 scales of rows g and g + 8 (W8:
two words per block, one per 32-column group). x goes through `x_fragments` once per input: fp32 -> bf16 in
B-fragment order, 32 bytes per lane per block (two 16-byte loads, the same for every tile).

Geometry: a block of WARPS warps owns TILES row tiles; its warps split the K blocks (warp w takes blocks w, w + WARPS,
...) and their fragments are summed in shared memory in warp order. Each output element is one column of the mma
whatever M is, accumulated in the same order: a row's result does not depend on the other rows in the launch.

MoE decode (`linear_quant_mma_gathered`): a stacked expert matrix [E * rpe, K] repacked whole is also the layout of
each expert when rpe % 16 == 0 (expert e's rows are tiles e * rpe / 16 onwards). Block (tile group, slot s, row m)
does the same per-block work (`make_tile_sums`) over the tiles of expert ids[m, s], with the fragments of x [M, K]
(`x_fragments`: every slot of row m reads row m) or, when each slot has its own input x [M, S, K], with fragment set
s of `x_slot_fragments`; it keeps mma column m and drops the others (decode is bound by the weight bytes, not the
tensor cores). A slot's result equals bitwise `linear_quant_mma` of its row on its expert's rows.

Split projections (`linear_quant_mma_pair`): a projection stored as two row blocks in two formats runs as one launch
whose blocks each take a tile of one part; bitwise the two single launches side by side.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
from llvmlite import ir
from numba import float32, int32, int64, types, uint32
from numba.cuda.extending import intrinsic

from ninfer.artifact import codec
from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32
from ninfer.kernels_numba.common import (FULL_MASK, address_of, bf16_hi_to_f32, bf16_pair, bf16_to_f32,
                                         half_pair_to_f32, load_word_at, load_words2_at, load_words4_at, pack_bf16x2,
                                         silu_times, store_words4_at)
from ninfer.kernels_numba.linear import gathered_reference, load2, load4
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel, large_device_function, register_options
from ninfer.kernels_numba.programmatic import allow_dependents, launch, wait_for_prior_grids

TILE_ROWS = 16
BLOCK = 64  # columns per (tile, block) fragment set: 4 mma k-steps
MAX_X_ROWS = 8  # the mma's N dimension: x rows per fragment set
# Fragment sets (8 x rows each) one plain launch multiplies by each decoded weight fragment: rows 9..8 ROW_SETS (MTP
# verify at batch >= 3, short prefill chunks) then read the weights once instead of once per 8 rows. On the H200 at
# M = 32 (4 sets, Q4): down 5120x17408 60.3 us against 88.8 for four one-set launches, query_key 7168x5120 27.1
# against 35.6, gate_up 34816x5120 131 against 136; at M = 16 no slower (bench/results/quant_gemv_session6.json).
ROW_SETS = 4
WARPS = 8
TILES = 1
UNROLL = 2
FORMAT_BITS = {Q4G64: 4, Q5G64: 5, Q6G64: 6, W8G32: 8}
HIGH_WORDS = {4: 1, 5: 1, 6: 2, 8: 4}  # high-plane words per lane per (tile, block); Q4 keeps a 1-word dummy
SCALE_WORDS = {4: 1, 5: 1, 6: 1, 8: 2}  # scale pairs per lane per (tile, block)
WEIGHTS, X = 1, 2  # `make_tile_sums`' load_step parts
BF16_ONE_PAIR = 0x3F803F80
BF16_128_PAIR = 0x43004300


def offset_pair(offset: int) -> int:
    """The bf16 pair of -(128 + offset) (offset < 128: exact)."""
    bits = int(codec.f32_to_bf16_bits(np.array([-(128.0 + offset)], np.float32))[0])
    return bits | (bits << 16)


@attrs.define(eq=False)
class QuantMmaWeight:
    """A quantized [N, K] matrix on the device in the tensor-core layout (module docstring)."""

    fmt: str
    shape: tuple[int, int]
    base: object  # uint32 [tiles * blocks * 32 * 4]: nibble words
    high: object  # uint32 [tiles * blocks * 32 * HIGH_WORDS]
    scales: object  # uint32 [tiles * blocks * SCALE_WORDS * 8]: binary16 scales of rows (g, g + 8)
    blocks: int
    nbytes: int
    # SwiGLU gate|up blocks of this many rows stored tile-interleaved (`swiglu_order`), 0: rows in their own order
    swiglu_rows: int = 0
    tensor_core = True  # `Linear` routes decode rows of this weight to `linear_quant_mma`


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


@intrinsic
def and_or(typingctx, a, b, c):
    """(a & b) | c in one `lop3.b32` (LUT 0xEA). ptxas keeps `x & mask | magic` with two immediates as two LOP3s
    (a SASS LOP3 takes one immediate), and those are a quarter of the decode's instructions."""
    signature = types.uint32(types.uint32, types.uint32, types.uint32)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        return builder.asm(ir.FunctionType(i32, [i32] * 3), "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                           list(args), side_effect=False)

    return signature, codegen


@device_function
def nibble_pair(word, s, minus_pair):
    """A-fragment register s (0..3) of a nibble word: nibbles s and s + 4 as the bf16 pair of their codes, offset
    by `minus_pair` (the bf16 pair of -(128 + code offset))."""
    raw = and_or(word >> uint32(4 * s), uint32(0x000F000F), uint32(BF16_128_PAIR))
    return fma_bf16x2(raw, uint32(BF16_ONE_PAIR), minus_pair)


@device_function
def high_magic(h0, h1, j, s, bits):
    """The bf16 pair 128 + (bits 4.. of the two codes of register s of k-step j), those bits in place (bits 4..5 and
    20..21) for a nibble pair to be OR-ed in."""
    if bits == 5:  # code (j, s, half) keeps its bit 4 at bit 16 half + 4 j + s
        shift = 4 * j + s
        hb = h0 << uint32(4 - shift) if shift <= 4 else h0 >> uint32(shift - 4)
        return and_or(hb, uint32(0x00100010), uint32(BF16_128_PAIR))
    # Q6: word j // 2, bits 16 half + 2 (4 (j % 2) + s) .. + 1
    word = h0 if j < 2 else h1
    shift = 2 * (4 * (j % 2) + s)
    hb = word << uint32(4 - shift) if shift <= 4 else word >> uint32(shift - 4)
    return and_or(hb, uint32(0x00300030), uint32(BF16_128_PAIR))


@device_function
def load_high_words(high, lane_slot, bits):
    """The high-plane words of one lane's (tile, block) `lane_slot`: 1 (Q5), 2 (Q6) or 4 (W8); zeros past them."""
    h0 = uint32(0)
    h1 = uint32(0)
    h2 = uint32(0)
    h3 = uint32(0)
    if bits == 5:
        h0 = high[lane_slot]
    elif bits == 6:
        h0, h1 = load2(high, lane_slot * 2)
    elif bits == 8:
        h0, h1, h2, h3 = load4(high, lane_slot * 4)
    return h0, h1, h2, h3


@device_function
def code_pair(word, h0, h1, j, s, bits, minus_pair):
    """Register s of k-step j for Q4/Q5/Q6: the bf16 pair of two signed codes."""
    magic = uint32(BF16_128_PAIR) if bits == 4 else high_magic(h0, h1, j, s, bits)
    raw = and_or(word >> uint32(4 * s), uint32(0x000F000F), magic)
    return fma_bf16x2(raw, uint32(BF16_ONE_PAIR), minus_pair)


@device_function
def code_fragment(word, h0, h1, j, bits, minus_pair):
    """The A fragment (4 registers) of k-step j for Q4/Q5/Q6 (`code_pair` of each register)."""
    return (code_pair(word, h0, h1, j, 0, bits, minus_pair), code_pair(word, h0, h1, j, 1, bits, minus_pair),
            code_pair(word, h0, h1, j, 2, bits, minus_pair), code_pair(word, h0, h1, j, 3, bits, minus_pair))


@device_function
def w8_fragments(high_word, low_word, minus_pair, minus_low):
    """The two A fragments of a W8 k-step: its high nibbles' (offset 8) and its low nibbles' (offset 0), 8
    registers; the exact code is 16 high + low."""
    return (nibble_pair(high_word, 0, minus_pair), nibble_pair(high_word, 1, minus_pair),
            nibble_pair(high_word, 2, minus_pair), nibble_pair(high_word, 3, minus_pair),
            nibble_pair(low_word, 0, minus_low), nibble_pair(low_word, 1, minus_low),
            nibble_pair(low_word, 2, minus_low), nibble_pair(low_word, 3, minus_low))


@device_function
def mma_into(chain, c, a0, a1, a2, a3, b0, b1):
    """chain[c..c+3] (a local array's C quad of one mma) += A . B: the tensor-core kernels' accumulate step."""
    chain[c], chain[c + 1], chain[c + 2], chain[c + 3] = mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, chain[c],
                                                                           chain[c + 1], chain[c + 2], chain[c + 3])


# ---- host repack --------------------------------------------------------------------------------------------------

def _fragment_offsets() -> tuple[np.ndarray, np.ndarray]:
    """(row, column) inside a (16-row tile, 64-column block) of nibble p of word j of lane l: [32, 4, 8] each."""
    lane, word, nibble = np.meshgrid(np.arange(32), np.arange(4), np.arange(8), indexing="ij")
    g, t = lane // 4, lane % 4
    s, h = nibble % 4, nibble // 4
    rows = g + 8 * (s & 1)
    cols = 16 * word + 2 * t + 8 * (s >> 1) + h
    return rows, cols


def _nibble_words(fragments: np.ndarray) -> np.ndarray:
    """[..., 4, 8] nibbles -> [..., 4] words (nibble p at bits 4 p)."""
    words = np.zeros(fragments.shape[:-1], np.uint32)
    for p in range(8):
        words |= (fragments[..., p].astype(np.uint32) & np.uint32(15)) << np.uint32(4 * p)
    return words


def _high_words(fragments: np.ndarray, bits: int) -> np.ndarray:
    """[..., 4 (j), 8 (p)] unsigned codes -> the high plane words per lane (see `high_magic`)."""
    above = (fragments.astype(np.uint32) >> np.uint32(4))
    j = np.arange(4)[:, None]
    s, half = np.arange(8)[None, :] % 4, np.arange(8)[None, :] // 4
    if bits == 5:
        positions = 16 * half + 4 * j + s  # [4, 8]
        return np.bitwise_or.reduce((above & 1) << positions.astype(np.uint32), axis=(-2, -1))[..., None]
    positions = (16 * half + 2 * (4 * (j % 2) + s)).astype(np.uint32)
    words = [np.bitwise_or.reduce(((above & 3) << positions)[..., 2 * w : 2 * w + 2, :], axis=(-2, -1))
             for w in range(2)]
    return np.stack(words, axis=-1)


def swiglu_order(rows: int) -> np.ndarray:
    """The original row of each stored row of a SwiGLU gate|up block of `rows` rows (gate rows, then the up rows of
    the same units): each 16-row tile holds 8 units' gate rows then their up rows, so a lane's mma accumulators hold
    gate and up of one unit and the GEMV's epilogue can write silu(gate) * up (`linear_quant_mma_swiglu`)."""
    if rows % (2 * TILE_ROWS):
        raise ValueError(f"a SwiGLU gate|up block needs rows % {2 * TILE_ROWS} == 0, got {rows}")
    stored = np.arange(rows)
    tile, inside = stored // TILE_ROWS, stored % TILE_ROWS
    return np.where(inside < 8, 8 * tile + inside, rows // 2 + 8 * tile + inside - 8)


def swiglu_rows_order(N: int, swiglu_rows: int) -> np.ndarray:
    """`swiglu_order` of every gate|up block of an [N, K] matrix (a stack of experts' blocks, or one)."""
    if N % swiglu_rows:
        raise ValueError(f"{N} rows are not whole SwiGLU blocks of {swiglu_rows}")
    return (np.arange(N // swiglu_rows)[:, None] * swiglu_rows + swiglu_order(swiglu_rows)[None, :]).reshape(-1)


def repack_quant_mma(fmt: str, shape: tuple[int, int], payload: np.ndarray, *,
                     swiglu_rows: int = 0) -> dict[str, np.ndarray]:
    """Host planes of the tensor-core layout from an artifact payload: base and high uint32 words, scale pairs.
    `swiglu_rows`: the rows stored in `swiglu_rows_order` (gate|up blocks of that many rows)."""
    bits = FORMAT_BITS[fmt]
    N, K = (int(v) for v in shape)
    if K % BLOCK:
        raise ValueError(f"tensor-core quantized layers need K % {BLOCK} == 0, got {K}")
    codes, scales16 = codec.quantized_codes(payload, fmt, (N, K))
    if swiglu_rows:
        order = swiglu_rows_order(N, swiglu_rows)
        codes, scales16 = codes[order], scales16[order]
    blocks, tiles = K // BLOCK, -(-N // TILE_ROWS)
    unsigned = np.zeros((tiles * TILE_ROWS, K), np.uint8)  # padding rows: any code, at scale 0
    unsigned[:N] = (codes[:, :K].astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    rows, cols = _fragment_offsets()
    tiled = unsigned.reshape(tiles, TILE_ROWS, blocks, BLOCK).transpose(0, 2, 1, 3)  # [tiles, blocks, 16, 64]
    fragments = tiled[:, :, rows, cols]  # [tiles, blocks, 32, 4, 8]
    base = _nibble_words(fragments)
    if bits == 4:
        high = np.zeros((1,), np.uint32)
    elif bits == 8:
        high = _nibble_words(fragments >> 4)
    else:
        high = _high_words(fragments, bits)
    per_group = 2 if bits == 8 else 1  # scale groups per 64-column block
    scales = np.zeros((tiles * TILE_ROWS, blocks * per_group), np.uint16)
    scales[:N] = scales16[:, : blocks * per_group]
    # [tiles, blocks, group in block, g, (row g, row g + 8)]
    scales = scales.reshape(tiles, 2, 8, blocks, per_group).transpose(0, 3, 4, 2, 1)
    return {"base": np.ascontiguousarray(base).reshape(-1), "high": np.ascontiguousarray(high).reshape(-1),
            "scales": np.ascontiguousarray(scales).reshape(-1).view(np.uint32)}


def upload_quant_mma(fmt: str, shape: tuple[int, int], payload: np.ndarray, *, stream=0,
                     swiglu_rows: int = 0) -> QuantMmaWeight:
    return upload_quant_mma_planes(fmt, shape, repack_quant_mma(fmt, shape, payload, swiglu_rows=swiglu_rows),
                                   stream=stream, swiglu_rows=swiglu_rows)


def upload_quant_mma_planes(fmt: str, shape: tuple[int, int], planes: dict[str, np.ndarray], *,
                            stream=0, swiglu_rows: int = 0) -> QuantMmaWeight:
    """Copy already repacked planes (`repack_quant_mma`, with the same `swiglu_rows`) to the device (benchmarks
    repack one payload once)."""
    arrays = {name: cuda.to_device(value, stream=stream) for name, value in planes.items()}
    return QuantMmaWeight(fmt, tuple(int(v) for v in shape), arrays["base"], arrays["high"], arrays["scales"],
                          int(shape[1]) // BLOCK, int(sum(value.nbytes for value in planes.values())),
                          int(swiglu_rows))


def plane_words(fmt: str, shape: tuple[int, int]) -> dict[str, int]:
    """The uint32 words of each plane `repack_quant_mma` makes for an [N, K] matrix."""
    bits, tiles, blocks = FORMAT_BITS[fmt], -(-int(shape[0]) // TILE_ROWS), int(shape[1]) // BLOCK
    return {"base": tiles * blocks * 32 * 4, "high": 1 if bits == 4 else tiles * blocks * 32 * HIGH_WORDS[bits],
            "scales": tiles * blocks * SCALE_WORDS[bits] * 8}


# binary16 scales in [2^-11, 2^-9) (about the 5e-4..2e-3 the benchmarks' host payloads draw): exponent field 4 or 5,
# any mantissa, in each half of a scale-pair word
RANDOM_SCALE_KEEP, RANDOM_SCALE_SET = 0x07FF07FF, 0x10001000


def random_quant_mma_weight(fmt: str, shape: tuple[int, int], *, seed: int, stream=0,
                            swiglu_rows: int = 0) -> QuantMmaWeight:
    """A quantized matrix of random codes and scales generated on the device in the tensor-core layout (benchmarks
    at the real shapes: the 35B-A3B's stacked experts took ~60 s of host repacking a build). Rows must fill whole
    tiles (the repack gives padding rows scale 0). Random codes have no row order, so `swiglu_rows` only records
    which launchers take the matrix."""
    from ninfer.kernels_numba.fill import fill_words

    N, K = (int(v) for v in shape)
    if K % BLOCK or N % TILE_ROWS:
        raise ValueError(f"random tensor-core weights need K % {BLOCK} == 0 and N % {TILE_ROWS} == 0, got {shape}")
    planes = {name: cuda.device_array(words, np.uint32, stream=stream)
              for name, words in plane_words(fmt, shape).items()}
    for offset, (name, plane) in enumerate(planes.items()):
        scales = name == "scales"
        fill_words(plane, seed=seed * 3 + offset, keep=RANDOM_SCALE_KEEP if scales else 0xFFFFFFFF,
                   set_bits=RANDOM_SCALE_SET if scales else 0, stream=stream)
    return QuantMmaWeight(fmt, (N, K), planes["base"], planes["high"], planes["scales"], K // BLOCK,
                          int(sum(plane.nbytes for plane in planes.values())), int(swiglu_rows))


# ---- device code --------------------------------------------------------------------------------------------------

FRAGMENT_WORDS = 8 * 32  # x fragment words per 64-column block: 32 lanes x (4 k-steps x 2 registers)
FRAGMENT_HALVES_PER_COLUMN = 2 * FRAGMENT_WORDS // BLOCK  # a set's bf16 halves per x column (rows 0..7)


def x_fragment_words(K: int) -> int:
    return K // BLOCK * FRAGMENT_WORDS


@device_function
def fragment_source(i):
    """(row g, column c) of word i of a fragment set: the bf16 pair x[g, c], x[g, c + 1], with
    i = (q * 32 + lane) * 8 + 2 j + b and c = 64 q + 16 j + 2 t + 8 b."""
    q = i >> 8
    lane = (i >> 3) & 31
    j = (i >> 1) & 3
    b = i & 1
    return lane >> 2, q * BLOCK + 16 * j + 2 * (lane & 3) + 8 * b


@device_function
def fragment_half(g, c):
    """Where x[g, c] goes in a fragment set, as the index of a bf16 half (uint16) of the words: the inverse of
    `fragment_source` (word i holds x[g, c] and x[g, c + 1] for even c, low half first). Lets a kernel that produces
    x write the fragments itself (`fragment_target`), saving the `x_fragments` launch."""
    q = c >> 6
    j = (c >> 4) & 3
    b = (c >> 3) & 1
    t = (c >> 1) & 3
    return ((((q * 32 + g * 4 + t) << 3) + 2 * j + b) << 1) + (c & 1)


def check_fragment_output(rows: int, width: int, fragments, sets: int = 1) -> None:
    """The ValueError of a producer asked to write x fragments for [rows, width] (`sets` sets, one per slot)."""
    if rows > MAX_X_ROWS or width % BLOCK or fragments.shape[0] < sets * x_fragment_words(width):
        raise ValueError(f"x fragments of {rows} rows x {width} ({sets} set(s); at most {MAX_X_ROWS} rows, width % "
                         f"{BLOCK} == 0) into {fragments.shape[0]} words")


@kernel((float32[:, ::1], uint32[::1]), fastmath=False)
def _x_fragments_kernel(x, out):
    """out[i] = the bf16 pair of `fragment_source` of word i of set i // set_words (x rows 8 set .. 8 set + 7; 0 for
    rows >= M)."""
    allow_dependents()  # the projection that reads them may start loading its weights (`programmatic`)
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= out.shape[0]:
        return
    set_words = int32(x.shape[1] * (FRAGMENT_WORDS // BLOCK))
    fragment_set = int32(i) // set_words
    g, col = fragment_source(int32(i) - fragment_set * set_words)
    row = fragment_set * MAX_X_ROWS + g
    word = uint32(0)
    if row < x.shape[0]:
        word = bf16_pair(x[row, col], x[row, col + 1])
    out[i] = word


@kernel((float32[:, :, ::1], uint32[::1]), fastmath=False)
def _x_slot_fragments_kernel(x, out):
    """Set s = blockIdx.y of out (its x_fragment_words(K) words) from x[:, s, :], as `_x_fragments_kernel`."""
    slot = cuda.blockIdx.y
    set_words = x.shape[2] * (FRAGMENT_WORDS // BLOCK)
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= set_words:
        return
    g, col = fragment_source(i)
    word = uint32(0)
    if g < x.shape[0]:
        word = bf16_pair(x[g, slot, col], x[g, slot, col + 1])
    out[slot * set_words + i] = word


def x_sets(rows: int) -> int:
    """Fragment sets (8 x rows each) that hold `rows` rows (at least one)."""
    return max(1, -(-int(rows) // MAX_X_ROWS))


def x_fragments(x, out, *, stream) -> None:
    """x (fp32 [M, K]) rounded to bf16 into the mma B-fragment order `linear_quant_mma` reads: set s (x rows 8 s ..
    8 s + 7) at word s * x_fragment_words(K) (out: uint32 [x_sets(M) * x_fragment_words(K)]). One launch serves
    every tensor-core layer that reads the same x."""
    M, K = x.shape
    words = x_sets(M) * x_fragment_words(K)
    if K % BLOCK or out.shape[0] < words:
        raise ValueError(f"x fragments: x{tuple(x.shape)} (K % {BLOCK} == 0) into {out.shape[0]} words ({words} "
                         f"needed)")
    _x_fragments_kernel[math.ceil(words / 256), 256, stream](x, out[:words])


def x_slot_fragments(x, out, *, stream) -> None:
    """x (fp32 [M <= 8, S, K]: an input per (row, slot), the MoE down projection's) into S fragment sets one after
    another, set s those of x[:, s, :] (`x_fragments` order): what `linear_quant_mma_gathered` reads with
    x_per_slot (out: uint32 [S * x_fragment_words(K)])."""
    M, S, K = x.shape
    words = x_fragment_words(K)
    if M > MAX_X_ROWS or K % BLOCK or out.shape[0] < S * words:
        raise ValueError(f"x slot fragments: x{tuple(x.shape)} (M <= 8, K % {BLOCK} == 0) into {out.shape[0]} "
                         f"words ({S * words} needed)")
    if M * S == 0:
        return
    _x_slot_fragments_kernel[(math.ceil(words / 256), S), 256, stream](x, out[: S * words])


def make_tile_sums(bits: int, tiles: int, warps: int, unroll: int, sets: int = 1):
    """The work of one block that the plain and the gathered kernels share: `tiles` row tiles from `first_tile` times
    `sets` x-fragment sets (8 x rows each, one after another) from word `x_base`, summed into warp 0's `acc`
    (acc[4 (s tiles + r) + i]: C register i of tile r for set s; the other warps' acc are their own partial sums).
    Each weight fragment is decoded once and multiplied by every set: a set's sums are those a one-set block gives.
    Tiles past `last_tile` reload it, so every load stays inside the matrix (or inside one expert's rows); the
    caller drops their sums. Warp w takes the K blocks w, w + warps, ..., `unroll` blocks per step whose loads are
    all issued before the step's first mma; the warps' sums meet in `partials` (shared, warps * 4 * tiles * sets * 32
    floats) and are added in warp order.

    Loads go through raw addresses (`address_of`): a block q of the weight planes, of the scales and of the x
    fragments sits q times a fixed stride past the warp's first, so a step costs one add per stream and the unrolled
    blocks are constant offsets. A step's codes and scales load during the step before it; a block past the last
    (a warp's partial last step, the step after it) is clamped onto the last one: loaded, never summed."""
    ACC = 4 * tiles * sets
    HW = HIGH_WORDS[bits]
    SW = SCALE_WORDS[bits]
    WORDS = 4 * tiles * unroll
    HIGHS = HW * tiles * unroll
    SCALES = SW * tiles * unroll
    XS = 8 * unroll * sets  # xs[8 (u sets + s) + w]: word w of block u's fragments of set s
    CHAIN = 4 * sets  # an mma chain's C registers, per set
    warps_sum = make_warps_sum(ACC, warps)
    MINUS = offset_pair(1 << (bits - 1)) if bits != 8 else offset_pair(8)  # W8: the high nibble's offset
    MINUS_LOW = offset_pair(0)
    # bytes per K block of each stream, for one lane's slot of a (tile, block)
    BASE_BLOCK = 32 * 4 * 4  # 32 lanes x 4 words
    HIGH_BLOCK = 32 * HW * 4
    SCALE_BLOCK = SW * 8 * 4
    X_BLOCK = FRAGMENT_WORDS * 4

    @large_device_function
    def load_step(words, highs, xs, tile_base, tile_high, x_lane, set_bytes, q0, blocks, clamp, part):
        """The loads of the step whose first block is q0 (block u: q0 + u * warps, clamped to the last one when
        `clamp`): `part` WEIGHTS (the code planes), X (x fragments) or both (WEIGHTS | X)."""
        for u in range(unroll):
            q = q0 + u * warps
            if clamp:
                q = min(q, blocks - 1)
            q64 = int64(q)
            for r in range(tiles if part & WEIGHTS else 0):
                w0 = 4 * (r * unroll + u)
                words[w0], words[w0 + 1], words[w0 + 2], words[w0 + 3] = load_words4_at(
                    tile_base[r] + q64 * BASE_BLOCK)
                if bits != 4:
                    h0 = HW * (r * unroll + u)
                    at = tile_high[r] + q64 * HIGH_BLOCK
                    if bits == 5:
                        highs[h0] = load_word_at(at)
                    elif bits == 6:
                        highs[h0], highs[h0 + 1] = load_words2_at(at)
                    else:
                        highs[h0], highs[h0 + 1], highs[h0 + 2], highs[h0 + 3] = load_words4_at(at)
            for t in range(sets if part & X else 0):  # block q's x fragments of every set
                at = x_lane + t * set_bytes + q64 * X_BLOCK
                x0 = 8 * (u * sets + t)
                xs[x0], xs[x0 + 1], xs[x0 + 2], xs[x0 + 3] = load_words4_at(at)
                xs[x0 + 4], xs[x0 + 5], xs[x0 + 6], xs[x0 + 7] = load_words4_at(at + 16)

    @device_function
    def load_scales(scale_pairs, tile_scale, q0, blocks):
        """The scale pairs of the step whose first block is q0 (blocks past the last clamped onto it)."""
        for u in range(unroll):
            q64 = int64(min(q0 + u * warps, blocks - 1))
            for r in range(tiles):
                for k in range(SW):
                    scale_pairs[SW * (r * unroll + u) + k] = load_word_at(tile_scale[r] + q64 * SCALE_BLOCK + 32 * k)

    @large_device_function
    def step_sums(acc, words, highs, scale_pairs, xs, q0, blocks):
        """Add the step's blocks (those that exist) to acc: per tile and block, the mma chain of its k-steps times
        the block's scales, for each set (the A fragment of a k-step decoded once)."""
        minus = uint32(MINUS)
        minus_low = uint32(MINUS_LOW)
        chain = cuda.local.array(CHAIN, float32)
        chain_low = cuda.local.array(CHAIN, float32)  # W8: the low nibbles' chain
        for u in range(unroll):
            if q0 + u * warps < blocks:
                for r in range(tiles):
                    w0 = 4 * (r * unroll + u)
                    h0 = HW * (r * unroll + u)
                    if bits == 8:
                        for k in range(2):  # two 32-column scale groups, two k-steps each
                            for c in range(CHAIN):
                                chain[c] = float32(0.0)
                                chain_low[c] = float32(0.0)
                            for jj in range(2):
                                j = 2 * k + jj
                                a0, a1, a2, a3, e0, e1, e2, e3 = w8_fragments(highs[h0 + j], words[w0 + j], minus,
                                                                              minus_low)
                                for t in range(sets):
                                    b0 = xs[8 * (u * sets + t) + 2 * j]
                                    b1 = xs[8 * (u * sets + t) + 2 * j + 1]
                                    mma_into(chain, 4 * t, a0, a1, a2, a3, b0, b1)
                                    mma_into(chain_low, 4 * t, e0, e1, e2, e3, b0, b1)
                            s_lo, s_hi = half_pair_to_f32(scale_pairs[SW * (r * unroll + u) + k])
                            for t in range(sets):
                                a = 4 * (t * tiles + r)
                                acc[a] += s_lo * (float32(16.0) * chain[4 * t] + chain_low[4 * t])
                                acc[a + 1] += s_lo * (float32(16.0) * chain[4 * t + 1] + chain_low[4 * t + 1])
                                acc[a + 2] += s_hi * (float32(16.0) * chain[4 * t + 2] + chain_low[4 * t + 2])
                                acc[a + 3] += s_hi * (float32(16.0) * chain[4 * t + 3] + chain_low[4 * t + 3])
                    else:
                        for c in range(CHAIN):
                            chain[c] = float32(0.0)
                        hw0 = uint32(0)
                        hw1 = uint32(0)
                        if bits == 5:
                            hw0 = highs[h0]
                        elif bits == 6:
                            hw0 = highs[h0]
                            hw1 = highs[h0 + 1]
                        for j in range(4):
                            a0, a1, a2, a3 = code_fragment(words[w0 + j], hw0, hw1, j, bits, minus)
                            for t in range(sets):
                                mma_into(chain, 4 * t, a0, a1, a2, a3, xs[8 * (u * sets + t) + 2 * j],
                                         xs[8 * (u * sets + t) + 2 * j + 1])
                        s_lo, s_hi = half_pair_to_f32(scale_pairs[SW * (r * unroll + u)])
                        for t in range(sets):
                            a = 4 * (t * tiles + r)
                            acc[a] += s_lo * chain[4 * t]
                            acc[a + 1] += s_lo * chain[4 * t + 1]
                            acc[a + 2] += s_hi * chain[4 * t + 2]
                            acc[a + 3] += s_hi * chain[4 * t + 3]

    @large_device_function
    def tile_sums(acc, partials, xf, x_base, x_lane_index, base, high, scales, first_tile, last_tile, blocks):
        lane = int32(cuda.threadIdx.x & 31)
        warp = int32(cuda.threadIdx.x >> 5)
        g = lane >> 2
        words = cuda.local.array(WORDS, uint32)
        highs = cuda.local.array(HIGHS, uint32)
        scale_pairs = cuda.local.array(SCALES, uint32)
        next_scales = cuda.local.array(SCALES, uint32)
        xs = cuda.local.array(XS, uint32)
        tile_base = cuda.local.array(tiles, int64)  # block 0 of tile r, this lane's slot
        tile_high = cuda.local.array(tiles, int64)
        tile_scale = cuda.local.array(tiles, int64)
        for r in range(tiles):
            at = int64(min(first_tile + r, last_tile)) * int64(blocks)  # (tile, block 0)
            tile_base[r] = address_of(base) + at * BASE_BLOCK + lane * 16
            tile_high[r] = address_of(high) + at * HIGH_BLOCK + lane * (HW * 4)
            tile_scale[r] = address_of(scales) + at * SCALE_BLOCK + g * 4
        x_lane = address_of(xf) + int64(x_base) * 4 + x_lane_index * 32
        set_bytes = int64(blocks) * X_BLOCK  # one fragment set (8 x rows) of K
        for a in range(ACC):
            acc[a] = float32(0.0)
        q0 = warp
        stride = warps * unroll
        # A step's codes and scales load during the step before it (all steps clamped, the blocks past the last
        # never summed): the step's arithmetic then overlaps the next step's DRAM round trip (H200, M = 1: 27B down
        # 20.4 -> 18.7 us, 35B-A3B lm head 201 -> 190; same bits). Loaded with its own step, a scale load was
        # placed by ptxas after the step's first mma, a second round trip a step.
        next_words = cuda.local.array(WORDS, uint32)
        next_highs = cuda.local.array(HIGHS, uint32)
        if q0 < blocks:  # the first step's weights stream in while the kernels before this one finish
            load_scales(scale_pairs, tile_scale, q0, blocks)
            load_step(words, highs, xs, tile_base, tile_high, x_lane, set_bytes, q0, blocks, True, WEIGHTS)
        wait_for_prior_grids()  # x, the expert ids and y are theirs until they complete (a programmatic launch)
        while q0 < blocks:
            load_scales(next_scales, tile_scale, q0 + stride, blocks)
            load_step(next_words, next_highs, xs, tile_base, tile_high, x_lane, set_bytes, q0 + stride, blocks,
                      True, WEIGHTS)
            load_step(words, highs, xs, tile_base, tile_high, x_lane, set_bytes, q0, blocks, True, X)
            step_sums(acc, words, highs, scale_pairs, xs, q0, blocks)
            for i in range(WORDS):
                words[i] = next_words[i]
            for i in range(HIGHS):
                highs[i] = next_highs[i]
            for i in range(SCALES):
                scale_pairs[i] = next_scales[i]
            q0 += stride
        warps_sum(acc, partials, warp, lane)

    return tile_sums


def make_warps_sum(count: int, warps: int):
    """The meeting of a block's warps over `count` fp32 accumulators a lane (acc): each warp's go to `partials`
    (shared, warps * count * 32 floats), then warp 0's become their sum in warp order (a fixed order: the same bits
    whatever else the block computed). Sizes are closure constants, so the loops unroll and acc stays in registers."""
    @device_function
    def warps_sum(acc, partials, warp, lane):
        for a in range(count):
            partials[(warp * count + a) * 32 + lane] = acc[a]
        cuda.syncthreads()
        if warp == 0:
            for a in range(count):
                total = float32(0.0)
                for w in range(warps):
                    total += partials[(w * count + a) * 32 + lane]
                acc[a] = total

    return warps_sum


@device_function
def x_fragment_lane(rows):
    """The lane whose x-fragment words this lane loads when the launch keeps only x rows below `rows`: row g sits in
    lanes 4 g .. 4 g + 3 (the B fragment's column), so rows 0..P-1 (P the power of two >= rows) are lanes below 4 P,
    and a lane above reads lane (lane mod 4 P)'s words into an mma column that is dropped. At M = 1 a warp then
    reads 128 bytes of x a K block instead of 1 KB: on the H200 a chained weight stream with the full x fragments
    ran 17.9 us at the 27B down shape, with the narrow ones 15.9 (bench/results/dram_streams_session14.json).
    More than 8 rows (several fragment sets): every lane its own."""
    span = int32(4)
    while span < 4 * rows and span < 32:
        span *= 2
    return int32(cuda.threadIdx.x) & (span - 1)


@device_function
def c_position(a, lane):
    """(row inside the block's tiles, x column) of warp 0's sum acc[a] (mma C layout: register i of tile a // 4
    holds row g (+8 for i >= 2), column 2 t (+1 for odd i))."""
    return (a >> 2) * TILE_ROWS + (lane >> 2) + 8 * ((a & 3) >> 1), 2 * (lane & 3) + (a & 1)


def make_store_sums(tiles: int, sets: int):
    """The epilogue of the plain and pair kernels: warp 0 writes (or adds, `accumulate`) its summed C registers for
    output rows first_row.. (the block's tiles) and every x row of the `sets` fragment sets, rows past `end` and x
    rows past y's dropped."""
    TILE_ACC = 4 * tiles
    ACC = TILE_ACC * sets

    @large_device_function
    def store_sums(y, acc, first_row, end, accumulate):
        if cuda.threadIdx.x < 32:
            lane = int32(cuda.threadIdx.x)
            for a in range(ACC):
                row, column = c_position(a % TILE_ACC, lane)
                m = MAX_X_ROWS * (a // TILE_ACC) + column
                n = first_row + row
                if m < y.shape[0] and n < end:
                    if accumulate != 0:
                        y[m, n] += acc[a]
                    else:
                        y[m, n] = acc[a]

    return store_sums


@device_function
def store_swiglu_pair(act, word_base, g, m, unit, value):
    """Warp 0's SwiGLU epilogue: lanes of even g write the bf16 pair (unit, unit + 1) of x row m, the second value
    from lane + 4 (g + 1) by a shuffle every lane of the warp takes part in; `act` are x fragment words."""
    partner = cuda.shfl_sync(FULL_MASK, value, (int32(cuda.threadIdx.x) + 4) & 31)
    if (g & 1) == 0 and m >= 0:
        act[word_base + (fragment_half(m, unit) >> 1)] = bf16_pair(value, partner)


def partials_bytes(tiles: int, warps: int, sets: int = 1) -> int:
    """Shared memory where a block's warps meet (`make_tile_sums`)."""
    return warps * 4 * tiles * sets * 32 * 4


def make_quant_mma_kernel(bits: int, tiles: int = TILES, warps: int = WARPS, unroll: int = UNROLL,
                          sets: int = 1):
    """The kernel for one format: `tiles` row tiles per block, `warps` warps splitting the K blocks, `unroll` K
    blocks per warp step whose loads are all issued before the first mma of the step, for up to 8 `sets` x rows
    (x row m: column m % 8 of set m // 8)."""
    TILE_ACC = 4 * tiles
    ACC = TILE_ACC * sets
    tile_sums = make_tile_sums(bits, tiles, warps, unroll, sets)
    store_sums = make_store_sums(tiles, sets)

    @kernel((uint32[::1], uint32[::1], uint32[::1], uint32[::1], float32[:, ::1], int32, int32, uint32[::1], int32),
            fastmath=False)
    def quant_mma_kernel(xf, base, high, scales, y, blocks, accumulate, act, act_words):
        """xf: x fragments (`x_fragments`); base/high/scales: the planes of `repack_quant_mma`. act_words > 0 (one
        tile a block, a weight stored in `swiglu_order`): instead of y, silu(gate) * up of every unit into the x
        fragments `act` (act_words a set), y's shape giving the rows and 2 x the units."""
        allow_dependents()
        partials = cuda.shared.array(0, float32)
        N = int32(y.shape[1])
        tile0 = int32(cuda.blockIdx.x) * tiles
        acc = cuda.local.array(ACC, float32)
        tile_sums(acc, partials, xf, int32(0), x_fragment_lane(int32(y.shape[0])), base, high, scales, tile0,
                  ((N + 15) >> 4) - 1, blocks)
        if act_words == 0:
            store_sums(y, acc, tile0 * TILE_ROWS, N, accumulate)
        elif cuda.threadIdx.x < 32:
            lane = int32(cuda.threadIdx.x)
            g, t = lane >> 2, lane & 3
            for a in range(0, ACC, 4):  # per fragment set: C rows g (gate) and g + 8 (up) of unit 8 tile0 + g
                first = MAX_X_ROWS * (a // 4)  # x rows 2 t and 2 t + 1 of the set
                for e in range(2):
                    row = 2 * t + e
                    store_swiglu_pair(act, (a // 4) * act_words, g, row if first + row < y.shape[0] else -1,
                                      tile0 * 8 + g, silu_times(acc[a + e], acc[a + 2 + e]))

    return quant_mma_kernel


def make_quant_mma_gathered_kernel(bits: int, tiles: int = TILES, warps: int = WARPS, unroll: int = UNROLL,
                                   max_registers: int | None = None):
    """The MoE decode kernel for one format (`linear_quant_mma_gathered`): block (tile group, slot, row) runs
    `make_tile_sums` over the tiles of expert ids[row, slot] and keeps the mma column of x row `row`.
    `max_registers`: a register cap (at 64 an SM holds 4 blocks of 8 warps instead of 3)."""
    ACC = 4 * tiles
    tile_sums = make_tile_sums(bits, tiles, warps, unroll)

    @kernel((uint32[::1], uint32[::1], uint32[::1], uint32[::1], int32[:, ::1], float32[:, :, ::1], int32, int32,
             uint32[::1], int32), fastmath=False, **register_options(max_registers))
    def quant_mma_gathered_kernel(xf, base, high, scales, ids, y, blocks, x_set_words, act, act_words):
        """y[row, slot, n] = x(row, slot) . W[ids[row, slot] * rpe + n] (rpe = y.shape[2], a multiple of 16: an
        expert's rows are whole tiles of the stacked layout); x(row, slot) is column `row` of fragment set
        slot * x_set_words (0: one set that every slot shares). act_words > 0 (experts stored in `swiglu_order`):
        instead of y, silu(gate) * up of every unit into row `row` of fragment set `slot` of `act`."""
        allow_dependents()
        wait_for_prior_grids()  # the router wrote ids: no weight address is known before it completes
        partials = cuda.shared.array(0, float32)
        slot = int32(cuda.blockIdx.y)
        row = int32(cuda.blockIdx.z)
        rpe = int32(y.shape[2])
        expert_tiles = rpe >> 4
        tile0 = int32(cuda.blockIdx.x) * tiles  # inside the expert
        expert_tile0 = ids[row, slot] * expert_tiles
        acc = cuda.local.array(ACC, float32)
        x_lane_index = (int32(cuda.threadIdx.x) & 3) | (row << 2)  # every column a copy of x row `row`'s
        tile_sums(acc, partials, xf, slot * x_set_words, x_lane_index, base, high, scales, expert_tile0 + tile0,
                  expert_tile0 + expert_tiles - 1, blocks)
        if act_words != 0:
            if cuda.threadIdx.x < 32:
                lane = int32(cuda.threadIdx.x)
                odd = (row & 1) != 0  # C column 2 t + 1 holds x row `row` in lanes t = row // 2
                value = silu_times(acc[1] if odd else acc[0], acc[3] if odd else acc[2])
                store_swiglu_pair(act, slot * act_words, lane >> 2, row if (lane & 3) == (row >> 1) else -1,
                                  tile0 * 8 + (lane >> 2), value)
        elif cuda.threadIdx.x < 32:
            lane = int32(cuda.threadIdx.x)
            for a in range(ACC):
                tile_row, m = c_position(a, lane)
                n = tile0 * TILE_ROWS + tile_row
                if m == row and n < rpe:
                    y[row, slot, n] = acc[a]

    return quant_mma_gathered_kernel


def make_quant_mma_pair_kernel(bits_a: int, bits_b: int, sets: int = 1):
    """One launch for a projection stored as two row blocks in two formats (`SplitMatrix`: the 27B ninfer-v2 recipe
    keeps query|key in Q4 and gate|value or value|z in Q5), both read from the same x fragments: blocks below the
    first part's tile count run its `make_tile_sums`, the others the second's, and each writes its rows' columns of
    y. Every output is the same code and order as `linear_quant_mma` of its part (the same bits), without the second
    launch, its scratch and the join."""
    ACC = 4 * sets
    sums_a = make_tile_sums(bits_a, 1, WARPS, UNROLL, sets)
    sums_b = make_tile_sums(bits_b, 1, WARPS, UNROLL, sets)
    store_sums = make_store_sums(1, sets)

    @kernel((uint32[::1],) * 7 + (float32[:, ::1], int32, int32), fastmath=False)
    def quant_mma_pair_kernel(xf, base_a, high_a, scales_a, base_b, high_b, scales_b, y, blocks, rows_a):
        """y[:, :rows_a] = x W_a^T, y[:, rows_a:] = x W_b^T (planes of `repack_quant_mma` each)."""
        allow_dependents()
        partials = cuda.shared.array(0, float32)
        N = int32(y.shape[1])
        tiles_a = (rows_a + 15) >> 4
        tile = int32(cuda.blockIdx.x)
        acc = cuda.local.array(ACC, float32)
        x_lane_index = x_fragment_lane(int32(y.shape[0]))
        if tile < tiles_a:  # block-uniform: the barriers inside the sums see every thread of the block
            sums_a(acc, partials, xf, int32(0), x_lane_index, base_a, high_a, scales_a, tile, tiles_a - 1, blocks)
            first = tile * TILE_ROWS
            end = rows_a
        else:
            sums_b(acc, partials, xf, int32(0), x_lane_index, base_b, high_b, scales_b, tile - tiles_a,
                   ((N - rows_a + 15) >> 4) - 1, blocks)
            first = rows_a + (tile - tiles_a) * TILE_ROWS
            end = N
        store_sums(y, acc, first, end, 0)

    return quant_mma_pair_kernel


QUANT_MMA_KERNELS = {(bits, sets): make_quant_mma_kernel(bits, sets=sets)
                     for bits in (4, 5, 6, 8) for sets in range(1, ROW_SETS + 1)}
# The MoE decode's gathered expert GEMV: blocks of 4 warps (8 before), a step of 2 K blocks where each warp walks
# at least 4, else 1. H200, Q4, experts cycled past the L2 (results/moe_gathered_sweep_session27.json), us against
# 8 warps x 2: the 35B-A3B's gate|up (32 blocks) 7.9 -> 6.2 at one row, 35.6 -> 26.6 at 8; its down (8 blocks)
# 7.2 -> 4.4 and 39.1 -> 19.4. Half the warps a block, twice the blocks an SM: the 512 / 1024 blocks of one row
# find more SMs and each warp has more loads in flight.
GATHERED_WARPS = 4


def gathered_unroll(blocks: int) -> int:
    """K blocks a gathered warp step loads ahead of its first mma (`make_tile_sums`' unroll)."""
    return 2 if blocks >= 4 * GATHERED_WARPS else 1


QUANT_MMA_GATHERED_KERNELS = {(bits, unroll): make_quant_mma_gathered_kernel(bits, TILES, GATHERED_WARPS, unroll)
                              for bits in (4, 5, 6, 8) for unroll in (1, 2)}


def gathered_kernel(qw: QuantMmaWeight):
    """The gathered kernel of a stacked expert matrix: its format's, at its K blocks' unroll (both gathered
    launchers take it, so the SwiGLU epilogue keeps the plain gathered GEMV's bits)."""
    return QUANT_MMA_GATHERED_KERNELS[FORMAT_BITS[qw.fmt], gathered_unroll(qw.blocks)]


# The format pairs the recipes split projections into (convert/qwen_hf.py: Q4 query|key beside Q5 gate|value and
# value|z); other pairs run as two launches.
QUANT_MMA_PAIR_KERNELS = {(4, 5, sets): make_quant_mma_pair_kernel(4, 5, sets) for sets in range(1, ROW_SETS + 1)}


def linear_quant_mma(xf, qw: QuantMmaWeight, y, *, stream, accumulate: bool = False, programmatic: bool = False,
                     _kernel=None, tiles: int = TILES, warps: int = WARPS, sets: int | None = None) -> None:
    """y[M, N] (+)= x[M, K] @ W^T, M = y.shape[0] <= 8 ROW_SETS, x given as its fragments (`x_fragments`): one
    launch reads the weights once for every set. Row m's result is the same whatever M. Capture-safe.
    `programmatic`: a programmatic dependent launch (module `programmatic`): the first weights load while the kernel
    before finishes. (`_kernel` with its `tiles`, `warps`, `sets`: a variant from `make_quant_mma_kernel`, for
    benchmarks and tests.)"""
    M, N = y.shape
    K = qw.shape[1]
    sets = x_sets(M) if sets is None else sets
    if N != qw.shape[0] or M > MAX_X_ROWS * sets or xf.shape[0] < sets * x_fragment_words(K) or (
            _kernel is None and sets > ROW_SETS):
        raise ValueError(f"tensor-core linear: W{qw.shape} y{tuple(y.shape)} (M <= {MAX_X_ROWS * ROW_SETS}), "
                         f"{xf.shape[0]} x words")
    if M == 0:
        return
    bits = FORMAT_BITS[qw.fmt]
    fn = _kernel if _kernel is not None else QUANT_MMA_KERNELS[bits, sets]
    grid = math.ceil(math.ceil(N / TILE_ROWS) / tiles)
    if qw.swiglu_rows:
        raise ValueError("a weight stored in swiglu_order multiplies through linear_quant_mma_swiglu")
    launch(fn, grid, 32 * warps, stream, partials_bytes(tiles, warps, sets), xf, qw.base, qw.high, qw.scales, y,
           int32(qw.blocks), int32(1 if accumulate else 0), xf, int32(0), programmatic=programmatic)


def check_swiglu_shapes(x_words: int, qw: QuantMmaWeight, y_shape: tuple[int, int], act_words: int) -> None:
    """The ValueError of `linear_quant_mma_swiglu` (and its host twin) for shapes it cannot run."""
    (M, N), K = y_shape, qw.shape[1]
    sets = x_sets(M)
    if (qw.swiglu_rows != N or N != qw.shape[0] or sets > ROW_SETS or x_words < sets * x_fragment_words(K)
            or act_words < sets * x_fragment_words(N // 2) or (N // 2) % BLOCK):
        raise ValueError(f"tensor-core SwiGLU: W{qw.shape} stored in blocks of {qw.swiglu_rows} rows, "
                         f"y{tuple(y_shape)} (M <= {MAX_X_ROWS * ROW_SETS}, N / 2 % {BLOCK} == 0), "
                         f"{x_words} x words, {act_words} act words")


def check_gathered_swiglu(qw: QuantMmaWeight, slots: int, rows_per_expert: int, act_words: int) -> None:
    """The ValueError of `linear_quant_mma_gathered_swiglu` (and its host twin) beyond `check_gathered_shapes`."""
    rpe = int(rows_per_expert)
    if qw.swiglu_rows != rpe or (rpe // 2) % BLOCK or act_words < slots * x_fragment_words(rpe // 2):
        raise ValueError(f"tensor-core gathered SwiGLU: experts of {rpe} rows stored in blocks of {qw.swiglu_rows} "
                         f"(rpe / 2 % {BLOCK} == 0), {act_words} act words for {slots} sets of "
                         f"{x_fragment_words(rpe // 2)}")


def linear_quant_mma_swiglu(xf, qw: QuantMmaWeight, y, act, *, stream, programmatic: bool = False) -> None:
    """act = the x fragments (`x_fragments` layout, one set per 8 rows) of silu(gate) * up [M, N / 2], where
    [gate | up] = x @ W^T for a SwiGLU gate|up weight stored in `swiglu_order` (qw.swiglu_rows == N): the input of
    the down projection, without the gate|up output or a silu-mul launch. y [M, N] gives the shape (not written).
    The bits equal linear_quant_mma of the unpermuted weight then silu_mul_rows' x fragments. Capture-safe."""
    check_swiglu_shapes(xf.shape[0], qw, y.shape, act.shape[0])
    M, N = y.shape
    sets = x_sets(M)
    if M == 0:
        return
    launch(QUANT_MMA_KERNELS[FORMAT_BITS[qw.fmt], sets], -(-N // TILE_ROWS), 32 * WARPS, stream,
           partials_bytes(TILES, WARPS, sets), xf, qw.base, qw.high, qw.scales, y, int32(qw.blocks), int32(0), act,
           int32(x_fragment_words(N // 2)), programmatic=programmatic)


def has_pair_kernel(first: QuantMmaWeight, second: QuantMmaWeight) -> bool:
    """Whether `linear_quant_mma_pair` takes these two row blocks (their formats are a compiled pair)."""
    return (FORMAT_BITS[first.fmt], FORMAT_BITS[second.fmt], 1) in QUANT_MMA_PAIR_KERNELS and (
        first.shape[1] == second.shape[1])


def check_pair_shapes(x_words: int, first: QuantMmaWeight, second: QuantMmaWeight, y_shape: tuple[int, int]) -> None:
    """The ValueError of `linear_quant_mma_pair` (and its host twin) for parts or shapes it cannot run."""
    M, N = y_shape
    sets = x_sets(M)
    if not has_pair_kernel(first, second) or N != first.shape[0] + second.shape[0] or sets > ROW_SETS or (
            x_words < sets * x_fragment_words(first.shape[1])):
        raise ValueError(f"tensor-core pair: W1{first.shape} {first.fmt}, W2{second.shape} {second.fmt}, "
                         f"y{tuple(y_shape)} (M <= {MAX_X_ROWS * ROW_SETS}), {x_words} x words")


def linear_quant_mma_pair(xf, first: QuantMmaWeight, second: QuantMmaWeight, y, *, stream,
                          programmatic: bool = False) -> None:
    """y[M, :N1] = x @ W1^T and y[M, N1:] = x @ W2^T in one launch (`make_quant_mma_pair_kernel`; M <= 8 ROW_SETS),
    x given as its fragments: bitwise two `linear_quant_mma` calls joined side by side. Capture-safe."""
    check_pair_shapes(xf.shape[0], first, second, y.shape)
    M = y.shape[0]
    sets = x_sets(M)
    if M == 0:
        return
    fn = QUANT_MMA_PAIR_KERNELS[FORMAT_BITS[first.fmt], FORMAT_BITS[second.fmt], sets]
    grid = -(-first.shape[0] // TILE_ROWS) + -(-second.shape[0] // TILE_ROWS)
    launch(fn, grid, 32 * WARPS, stream, partials_bytes(1, WARPS, sets), xf, first.base, first.high, first.scales,
           second.base, second.high, second.scales, y, int32(first.blocks), int32(first.shape[0]),
           programmatic=programmatic)


def check_gathered_shapes(x_words: int, weight_shape: tuple[int, int], ids_shape: tuple[int, int],
                          y_shape: tuple[int, ...], *, rows_per_expert: int, x_per_slot: bool) -> None:
    """The ValueError of `linear_quant_mma_gathered` (and its host twin) for shapes it cannot run."""
    (N, K), (M, S), rpe = weight_shape, ids_shape, int(rows_per_expert)
    problems = []
    if M > MAX_X_ROWS:
        problems.append(f"{M} rows of expert ids (at most {MAX_X_ROWS}: the mma's N)")
    if rpe <= 0 or rpe % TILE_ROWS or N % rpe:
        problems.append(f"rows_per_expert {rpe} must be a multiple of {TILE_ROWS} dividing the {N} stacked rows")
    if K % BLOCK:
        problems.append(f"K = {K} must be a multiple of {BLOCK}")
    if tuple(y_shape) != (M, S, rpe):
        problems.append(f"y{tuple(y_shape)} is not [M, S, rows_per_expert] = {(M, S, rpe)}")
    sets = S if x_per_slot else 1
    if x_words < sets * x_fragment_words(K):
        problems.append(f"{x_words} x fragment words, {sets} set(s) of {x_fragment_words(K)} needed")
    if problems:
        raise ValueError("tensor-core gathered linear: " + "; ".join(problems))


def linear_quant_mma_gathered(xf, qw: QuantMmaWeight, expert_ids, y, *, rows_per_expert: int, x_per_slot: bool,
                              stream, programmatic: bool = False, _kernel=None, tiles: int = TILES,
                              warps: int = GATHERED_WARPS) -> None:
    """MoE decode: y[m, s, :] = X(m, s) @ W_e^T, e = expert_ids[m, s] (int32 [M <= 8, S]), W_e = rows e * rpe ..
    (e + 1) * rpe - 1 of the stacked matrix qw [E * rpe, K] (rpe % 16 == 0); y float32 [M, S, rpe]. X(m, s) comes
    as fragments: of x [M, K] (`x_fragments`, every slot of a row reads that row) or, x_per_slot, of x [M, S, K]
    (`x_slot_fragments`, one set per slot). Each (m, s) equals bitwise row m of `linear_quant_mma` on expert e's
    rows at the same geometry (GATHERED_WARPS, `gathered_unroll`), whatever M. Capture-safe. `programmatic`: a
    programmatic dependent launch (its blocks wait for the router's ids, but start while the kernel before
    finishes)."""
    check_gathered_shapes(xf.shape[0], qw.shape, expert_ids.shape, y.shape, rows_per_expert=rows_per_expert,
                          x_per_slot=x_per_slot)
    M, S = expert_ids.shape
    if M * S == 0:
        return
    rpe = int(rows_per_expert)
    if qw.swiglu_rows:
        raise ValueError("experts stored in swiglu_order multiply through linear_quant_mma_gathered_swiglu")
    fn = _kernel if _kernel is not None else gathered_kernel(qw)
    groups = math.ceil(rpe // TILE_ROWS / tiles)
    x_set_words = x_fragment_words(qw.shape[1]) if x_per_slot else 0
    launch(fn, (groups, S, M), 32 * warps, stream, partials_bytes(tiles, warps), xf, qw.base, qw.high, qw.scales,
           expert_ids, y, int32(qw.blocks), int32(x_set_words), xf, int32(0), programmatic=programmatic)


def linear_quant_mma_gathered_swiglu(xf, qw: QuantMmaWeight, expert_ids, y, act, *, rows_per_expert: int, stream,
                                     programmatic: bool = False) -> None:
    """MoE decode, the SwiGLU experts' gate|up: act = the slot x fragments (`x_slot_fragments` layout: set s holds
    rows m of slot s) of silu(gate) * up [M, S, rpe / 2], [gate | up] = x[m] @ W_e^T (x [M, K] as `x_fragments`,
    e = expert_ids[m, s]) for experts stored in `swiglu_order` (qw.swiglu_rows == rpe): the down projection's input
    without the gate|up output or a silu-mul launch. y [M, S, rpe] gives the shape (not written). The bits equal
    linear_quant_mma_gathered of the unpermuted experts then silu_mul_slots' fragments. Capture-safe."""
    check_gathered_shapes(xf.shape[0], qw.shape, expert_ids.shape, y.shape, rows_per_expert=rows_per_expert,
                          x_per_slot=False)
    M, S = expert_ids.shape
    check_gathered_swiglu(qw, S, rows_per_expert, act.shape[0])
    rpe = int(rows_per_expert)
    if M * S == 0:
        return
    launch(gathered_kernel(qw), (rpe // TILE_ROWS, S, M), 32 * GATHERED_WARPS, stream,
           partials_bytes(TILES, GATHERED_WARPS), xf, qw.base, qw.high, qw.scales, expert_ids, y, int32(qw.blocks),
           int32(0), act, int32(x_fragment_words(rpe // 2)), programmatic=programmatic)


DEQUANTIZE_THREADS = 256
# Warps a dequantization launch wants (`dequantize_parts`): ~41 waves of the H200's 132 SMs x 24 resident warps.
# Far more than a wave, because a warp's run is short and a warp ends after it: the H200 sweep over parts
# (results/dequantize_mma_parts_sweep_session27.json, Q4, us) found every best at 40k-260k warps in runs of 2-4
# blocks: stacked 35B-A3B experts gate|up 413 (a warp a tile) / 388 (4 parts) / 365 (8), down 198 / 185 (4), the
# 27B's down 80 (13) / 64 (136), gate|up 159 (2) / 121 (32)
MIN_DEQUANTIZE_WARPS = 131072
MIN_DEQUANTIZE_RUN = 2  # blocks a warp walks at least: runs of one were slower on every shape timed
STAGE_ROW_WORDS = 33  # one staged tile row: 32 words (64 bf16) + 1 word of padding that spreads the writes' banks


@device_function
def _stored_target(tile, row, rows, swiglu_rows):
    """The output row that staged row `row` of `tile` goes to (the inverse of `swiglu_order` within the row's
    gate|up block when swiglu_rows > 0), or -1 past the weight's last row."""
    target = tile * 16 + row
    if target >= rows:
        return int32(-1)
    if swiglu_rows != 0:
        inside = target % swiglu_rows
        target += (8 * (inside >> 4) + (row & 7) + (swiglu_rows >> 1) * (row >> 3)) - inside
    return target


@device_function
def block_words(base, high, scales, slot, lane, g, bits, scale_words):
    """A lane's codes, high-plane words and scale words (the k-steps' first and last) of (tile, block) `slot`."""
    w0, w1, w2, w3 = load4(base, (slot * 32 + lane) * 4)
    h0, h1, h2, h3 = load_high_words(high, slot * 32 + lane, bits)
    return (w0, w1, w2, w3, h0, h1, h2, h3, scales[slot * scale_words * 8 + g],
            scales[(slot * scale_words + scale_words - 1) * 8 + g])


@device_function
def _stage_k_step(stage, into, w, h, hw0, hw1, j, sc0, sc1, bits, minus, minus_low):
    """A lane's 4 pairs of k-step j of a (tile, block) as bf16(code * scale) into the staged tile (`into`: the lane's
    row g, column t of the step). The pairs are converted by `pack_bf16x2`, one instruction for the two roundings
    `bf16_pair` spells in integer steps (~20 instructions a pair): the same bits for every value a codec writes
    (finite fp16 scales times small codes are never NaN)."""
    s_lo, s_hi = half_pair_to_f32(sc1 if bits == 8 and j >= 2 else sc0)
    for s in range(4):
        if bits == 8:
            hi = nibble_pair(h, s, minus)
            lo = nibble_pair(w, s, minus_low)
            first = float32(16.0) * bf16_to_f32(hi) + bf16_to_f32(lo)
            second = float32(16.0) * bf16_hi_to_f32(hi) + bf16_hi_to_f32(lo)
        else:
            pair = code_pair(w, hw0, hw1, j, s, bits, minus)
            first = bf16_to_f32(pair)
            second = bf16_hi_to_f32(pair)
        scale = s_hi if s & 1 else s_lo
        stage[into + 8 * (s & 1) * STAGE_ROW_WORDS + 4 * (s >> 1)] = pack_bf16x2(first * scale, second * scale)


def make_dequantize_mma_kernel(bits: int, threads: int = DEQUANTIZE_THREADS):
    """The dequantization kernel of one format for blocks of `threads` threads (each warp its own staged tile)."""
    SW = SCALE_WORDS[bits]
    STAGE = (threads // 32) * TILE_ROWS * STAGE_ROW_WORDS
    MINUS = offset_pair(1 << (bits - 1)) if bits != 8 else offset_pair(8)
    MINUS_LOW = offset_pair(0)

    @kernel((uint32[::1], uint32[::1], uint32[::1], uint32[:, ::1], int32, int32, int32), fastmath=False)
    def dequantize_mma_kernel(base, high, scales, out, blocks, swiglu_rows, parts):
        """out (bf16 pairs [N, K / 2]) = bf16(code * scale). A warp per 16-row tile and part (`parts` runs of
        ceil(blocks / parts) consecutive blocks of 64 columns: `dequantize_parts`) walks its run of the tile's blocks:
        each lane decodes its 16 pairs of the block into the warp's staged 16 x 64 tile in shared memory,
        then the warp stores the tile's rows as 16-byte vectors (8 lanes a 128-byte row) instead of 16 scattered
        words a lane. The 4 rows a lane stores, their targets (swiglu_rows > 0: back to their original rows,
        `swiglu_order`) and addresses are worked out once a tile, not once a block (a warp a (tile, block) spent
        about half its ~600 instructions there)."""
        stage = cuda.shared.array(STAGE, uint32)
        i = int32(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
        N = int32(out.shape[0])
        if i >= ((N + 15) >> 4) * parts * 32:  # whole warps: the thread count is a multiple of 32
            return
        lane = i & 31
        tile = (i >> 5) // parts
        run = (blocks + parts - 1) // parts
        first_block = ((i >> 5) - tile * parts) * run
        steps = min(blocks - first_block, run)  # this warp's blocks: first_block onwards
        if steps <= 0:  # (a whole warp: no syncwarp waits for it)
            return
        g = lane >> 2
        t = lane & 3
        staged = (int32(cuda.threadIdx.x) >> 5) * (TILE_ROWS * STAGE_ROW_WORDS)
        minus = uint32(MINUS)
        minus_low = uint32(MINUS_LOW)
        column = (lane & 7) * 4
        row_bytes = int64(out.strides[0])
        out_at = address_of(out) + int64(column) * 4 + int64(first_block) * 128  # 64 bf16 columns a block
        target0 = _stored_target(tile, lane >> 3, N, swiglu_rows)
        target1 = _stored_target(tile, 4 + (lane >> 3), N, swiglu_rows)
        target2 = _stored_target(tile, 8 + (lane >> 3), N, swiglu_rows)
        target3 = _stored_target(tile, 12 + (lane >> 3), N, swiglu_rows)
        at0 = out_at + int64(target0) * row_bytes
        at1 = out_at + int64(target1) * row_bytes
        at2 = out_at + int64(target2) * row_bytes
        at3 = out_at + int64(target3) * row_bytes
        from0 = staged + (lane >> 3) * STAGE_ROW_WORDS + column
        first_slot = tile * blocks + first_block  # the warp's first (tile, block) slot of codes, high words, scales
        # The next block's words load while this one decodes and stores: a warp walks its tile's blocks in order,
        # so without them in flight each block waited out a whole load latency (the last block reloads itself
        # rather than branch). Two blocks in flight (80 registers) gave the same bits and ran 4-14% slower (H200,
        # session 21).
        n0, n1, n2, n3, nh0, nh1, nh2, nh3, ns0, ns1 = block_words(base, high, scales, first_slot, lane, g, bits,
                                                                    SW)
        for q in range(steps):
            w0, w1, w2, w3, hw0, hw1, hw2, hw3, sc0, sc1 = n0, n1, n2, n3, nh0, nh1, nh2, nh3, ns0, ns1
            n0, n1, n2, n3, nh0, nh1, nh2, nh3, ns0, ns1 = block_words(
                base, high, scales, first_slot + min(q + 1, steps - 1), lane, g, bits, SW)
            cuda.syncwarp()  # the previous block's rows are stored before the stage is written again
            # one call a k-step with its word as a constant: in a loop over j the selects of w and h and a 64-bit
            # counter stayed in the SASS (ptxas did not unroll it)
            into = staged + g * STAGE_ROW_WORDS + t
            _stage_k_step(stage, into, w0, hw0, hw0, hw1, 0, sc0, sc1, bits, minus, minus_low)
            _stage_k_step(stage, into + 8, w1, hw1, hw0, hw1, 1, sc0, sc1, bits, minus, minus_low)
            _stage_k_step(stage, into + 16, w2, hw2, hw0, hw1, 2, sc0, sc1, bits, minus, minus_low)
            _stage_k_step(stage, into + 24, w3, hw3, hw0, hw1, 3, sc0, sc1, bits, minus, minus_low)
            cuda.syncwarp()
            step = int64(q) * 128  # the block's 64 bf16 columns of a row
            if target0 >= 0:
                store_words4_at(at0 + step, stage[from0], stage[from0 + 1], stage[from0 + 2], stage[from0 + 3])
            if target1 >= 0:
                f = from0 + 4 * STAGE_ROW_WORDS
                store_words4_at(at1 + step, stage[f], stage[f + 1], stage[f + 2], stage[f + 3])
            if target2 >= 0:
                f = from0 + 8 * STAGE_ROW_WORDS
                store_words4_at(at2 + step, stage[f], stage[f + 1], stage[f + 2], stage[f + 3])
            if target3 >= 0:
                f = from0 + 12 * STAGE_ROW_WORDS
                store_words4_at(at3 + step, stage[f], stage[f + 1], stage[f + 2], stage[f + 3])

    return dequantize_mma_kernel


DEQUANTIZE_MMA_KERNELS = {bits: make_dequantize_mma_kernel(bits) for bits in (4, 5, 6, 8)}


def dequantize_parts(tiles: int, blocks: int) -> int:
    """Runs a tile's blocks are split into, one warp each, so that a launch has at least MIN_DEQUANTIZE_WARPS warps:
    a warp walks its blocks one load latency at a time, and with a warp a tile the projections' dequantizations
    (tiles in the hundreds, up to 272 blocks a tile) ran latency-bound on a few warps an SM: on the H200 the
    35B-A3B's GDN out projection (128 tiles of 64 blocks) took 87 us for 25 MB, the 27B's down projection (320
    tiles of 272 blocks) 362 us for 228 MB, against ~2.3 TB/s for the stacked experts (results/
    cuda_model_prefill_session25.json). Each run keeps at least MIN_DEQUANTIZE_RUN blocks. The parts never change a
    value: a block is decoded the same way by any warp."""
    wanted = min(max(1, blocks // MIN_DEQUANTIZE_RUN), max(1, -(-MIN_DEQUANTIZE_WARPS // tiles)))
    return -(-blocks // -(-blocks // wanted))  # whole runs of equal length: no warp without a block


def dequantize_mma_bf16(qw: QuantMmaWeight, out, *, stream, parts: int | None = None, _kernel=None,
                        threads: int = DEQUANTIZE_THREADS) -> None:
    """out[N, K] (uint16 bf16 bits, C-contiguous) = bf16(code * scale): what `quant_linear.dequantize_bf16` gives for
    the artifact layout (the prefill path's cuBLAS operand), rows in their original order whatever the storage's.
    `parts`: the runs each tile's blocks are split into (None: `dequantize_parts`; tests choose their own).
    (`_kernel` with its `threads`: a variant from `make_dequantize_mma_kernel`, for benchmarks.)"""
    N, K = qw.shape
    if tuple(out.shape) != (N, K):
        raise ValueError(f"dequantize into {tuple(out.shape)}, the weight is {qw.shape}")
    tiles = -(-N // TILE_ROWS)
    parts = dequantize_parts(tiles, qw.blocks) if parts is None else parts
    if not 1 <= parts <= qw.blocks:
        raise ValueError(f"a tile of {qw.blocks} blocks splits into 1 to {qw.blocks} parts, not {parts}")
    function = _kernel if _kernel is not None else DEQUANTIZE_MMA_KERNELS[FORMAT_BITS[qw.fmt]]
    function[math.ceil(tiles * parts * 32 / threads), threads, stream](
        qw.base, qw.high, qw.scales, out.view(np.uint32), int32(qw.blocks), int32(qw.swiglu_rows), int32(parts))


# ---- NumPy twins ---------------------------------------------------------------------------------------------------

def x_fragments_reference(x: np.ndarray) -> np.ndarray:
    """`x_fragments` on the host: uint32 [x_sets(M) * x_fragment_words(K)]."""
    M, K = x.shape
    if M > MAX_X_ROWS:
        return np.concatenate([x_fragments_reference(x[first:first + MAX_X_ROWS])
                               for first in range(0, M, MAX_X_ROWS)])
    bits = np.zeros((MAX_X_ROWS, K), np.uint32)
    bits[:M] = codec.f32_to_bf16_bits(np.asarray(x, np.float32))
    lane, j, b = np.meshgrid(np.arange(32), np.arange(4), np.arange(2), indexing="ij")
    g, cols = lane // 4, 16 * j + 2 * (lane % 4) + 8 * b  # [32, 4, 2]
    q = np.arange(K // BLOCK)[:, None, None, None] * BLOCK
    words = bits[g, q + cols] | (bits[g, q + cols + 1] << np.uint32(16))  # [groups, 32, 4, 2]
    return words.reshape(-1)


def write_fragment_rows_reference(fragments: np.ndarray, x: np.ndarray) -> None:
    """What a producer writing x fragments (`fragment_half`) leaves in `fragments` (uint32, in place): rows 0..R-1
    of the set replaced by x [R <= 8, K] rounded to bf16, rows R..7 as they were."""
    rows, K = x.shape
    held = x_from_fragments(fragments, MAX_X_ROWS, K)
    held[:rows] = bf16_rounded(x)
    fragments[: x_fragment_words(K)] = x_fragments_reference(held)


def x_slot_fragments_reference(x: np.ndarray) -> np.ndarray:
    """`x_slot_fragments` on the host: uint32 [S * x_fragment_words(K)], the sets of x[:, s, :] in slot order."""
    return np.concatenate([x_fragments_reference(x[:, s]) for s in range(x.shape[1])])


def x_from_fragments(xf: np.ndarray, rows: int, K: int) -> np.ndarray:
    """The bf16 x (as fp32 [rows, K]) that `x_fragments` wrote into `xf` (the inverse of its twin)."""
    words_per_set = x_fragment_words(K)
    if rows > MAX_X_ROWS:
        return np.concatenate([x_from_fragments(xf[s * words_per_set:], min(MAX_X_ROWS, rows - s * MAX_X_ROWS), K)
                               for s in range(x_sets(rows))])
    words = np.asarray(xf[:words_per_set], np.uint32).reshape(K // BLOCK, 32, 4, 2)
    bits = np.zeros((MAX_X_ROWS, K), np.uint32)
    lane, j, b = np.meshgrid(np.arange(32), np.arange(4), np.arange(2), indexing="ij")
    g, cols = lane // 4, 16 * j + 2 * (lane % 4) + 8 * b
    for q in range(K // BLOCK):
        bits[g, q * BLOCK + cols] = words[q] & np.uint32(0xFFFF)
        bits[g, q * BLOCK + cols + 1] = words[q] >> np.uint32(16)
    return codec.bf16_bits_to_f32(bits[:rows].astype(np.uint16))


def x_from_slot_fragments(xf: np.ndarray, rows: int, slots: int, K: int) -> np.ndarray:
    """The bf16 x (as fp32 [rows, slots, K]) that `x_slot_fragments` wrote into `xf`."""
    words = x_fragment_words(K)
    return np.stack([x_from_fragments(xf[s * words : (s + 1) * words], rows, K) for s in range(slots)], axis=1)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """fp32 x rounded to bf16 (what the x fragments hold), as fp32."""
    return codec.bf16_bits_to_f32(codec.f32_to_bf16_bits(np.asarray(x, np.float32)))


def linear_quant_mma_reference(x: np.ndarray, fmt: str, shape: tuple[int, int], payload: np.ndarray,
                               y: np.ndarray | None = None, *, accumulate: bool = False) -> np.ndarray:
    """fp32 y of x rounded to bf16 times the codec's exact fp32 decode (float64 sums: the kernel's order is its
    own)."""
    weights = codec.decode(np.asarray(payload, np.uint8), fmt, tuple(shape)).astype(np.float64)
    product = (bf16_rounded(x).astype(np.float64) @ weights.T).astype(np.float32)
    if y is None or not accumulate:
        return product
    return (y + product).astype(np.float32)


def linear_quant_mma_gathered_reference(x: np.ndarray, fmt: str, shape: tuple[int, int], payload: np.ndarray,
                                        expert_ids: np.ndarray, *, rows_per_expert: int,
                                        x_per_slot: bool) -> np.ndarray:
    """`linear_quant_mma_gathered` from x itself ([M, K], or [M, S, K] with x_per_slot): y [M, S, rpe] of x rounded
    to bf16 times the codec's exact fp32 decode of each slot's expert (`gathered_reference`)."""
    weights = codec.decode(np.asarray(payload, np.uint8), fmt, tuple(shape))
    return gathered_reference(bf16_rounded(x), weights, expert_ids, rows_per_expert=rows_per_expert,
                              x_per_slot=x_per_slot)
