"""Device helpers every kernel shares: bf16 bit conversions, warp and block reductions, launch geometry.

bf16 tensors are stored as uint16 bit patterns (the artifact's words); activations are fp32. Conversions are bit
operations, so they match `ninfer.artifact.codec` exactly (round to nearest even, NaN stays NaN).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import float32, int32, int64, types, uint32, uint64
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

from ninfer.kernels_numba.numba_setup import cuda, device_function

WARP = 32
FULL_MASK = 0xFFFFFFFF


@device_function
def bf16_to_f32(bits):
    """A bf16 bit pattern (any unsigned integer holding it in its low 16 bits) as float32."""
    return libdevice.int_as_float(int32(uint32(bits) << uint32(16)))


@device_function
def bf16_hi_to_f32(word):
    """The bf16 in the HIGH half of a uint32 word as float32 (the odd element of a little-endian pair)."""
    return libdevice.int_as_float(int32(uint32(word) & uint32(0xFFFF0000)))


@device_function
def f32_to_bf16(value):
    """float32 -> bf16 bits (uint32 holding 16 bits), round to nearest even; NaN stays a quiet NaN."""
    bits = uint32(libdevice.float_as_int(float32(value)))
    if (bits & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return (bits >> uint32(16)) | uint32(0x0040)
    return (bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) >> uint32(16)


TF32_HALF = 0x1000
TF32_MASK = 0xFFFFE000


@device_function
def tf32_round(value):
    """float32 rounded to TF32 (10 mantissa bits; to nearest, ties away from zero), as a float32. Rounding is
    idempotent: a TF32 value comes back unchanged, so operands rounded where they are made need no rounding where the
    tensor cores take them."""
    bits = (uint32(libdevice.float_as_int(float32(value))) + uint32(TF32_HALF)) & uint32(TF32_MASK)
    return libdevice.int_as_float(int32(bits))


def tf32_round_host(values: np.ndarray) -> np.ndarray:
    """`tf32_round` on the host: the same bits."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(TF32_HALF)) & np.uint32(TF32_MASK)).view(np.float32)


@device_function
def code_float(u, i, offset):
    """Byte i of u (an unsigned code) as float32 minus `offset` (2^23 + code offset): the signed code, exactly. The
    byte becomes the low mantissa bits of 2^23 (one byte_perm) and one subtraction removes 2^23 and the offset:
    no integer-to-float conversion, which runs at a quarter of the FP32 rate."""
    return libdevice.int_as_float(int32(libdevice.byte_perm(int32(u), int32(0x4B000000), int32(0x7650 | i)))) - offset


@device_function
def flat_row_piece(pieces):
    """(row, piece) of this thread in a flat 1-D grid over rows of `pieces` pieces each (a row past the array's last
    means no work): the 16-byte-access kernels' mapping, whatever the row length."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    r = i // pieces
    return r, i - r * pieces


@device_function
def bf16_pair(low, high):
    """Two float32 as the bf16 pair of one little-endian word (low in bits 0..15), each rounded to nearest even."""
    return uint32(f32_to_bf16(low)) | (uint32(f32_to_bf16(high)) << uint32(16))


@device_function
def warp_sum(value):
    for offset in (16, 8, 4, 2, 1):
        value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
    return value


@device_function
def block_sum(value, buf):
    """Sum of `value` over the block (any size that is a multiple of 32), the same in every thread, in a fixed order:
    each warp's sum, then the warps' in warp order (buf: shared [32]). Ends on a barrier, so buf may be reused."""
    value = warp_sum(value)
    t = cuda.threadIdx.x
    if (t & 31) == 0:
        buf[t >> 5] = value
    cuda.syncthreads()
    total = float32(0.0)
    for w in range(cuda.blockDim.x >> 5):
        total += buf[w]
    cuda.syncthreads()
    return total


@intrinsic
def warp_max_u32(typingctx, value):
    """The largest of the warp's uint32 values, to every lane, in one `redux.sync.max.u32` (sm_80+: the reduction
    unit answers once where a butterfly takes five dependent shuffles). All 32 lanes must call it."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        return builder.asm(ir.FunctionType(i32, [i32]), "redux.sync.max.u32 $0, $1, -1;", "=r,r", list(args),
                           side_effect=True)

    return types.uint32(types.uint32), codegen


@device_function
def warp_max(value):
    for offset in (16, 8, 4, 2, 1):
        other = cuda.shfl_xor_sync(FULL_MASK, value, offset)
        value = max(value, other)
    return value


@device_function
def sigmoid_f32(x):
    """Split by sign like `ops.sigmoid`, so exp never overflows: 1 / (1 + exp(-x)) for x >= 0, else e / (1 + e)
    with e = exp(x). Written without a branch (one exp of -|x|, the numerator selected), the same bits: as two
    branches, a warp whose lanes' signs differ ran both (the prefill conv was issue-bound on them)."""
    e = math.exp(-abs(x))
    numerator = float32(1.0) if x >= float32(0.0) else e
    return numerator / (float32(1.0) + e)


@device_function
def silu_times(gate, up):
    """silu(gate) * up: the arithmetic every silu-mul shares (elementwise's kernels, the SwiGLU epilogues of
    `quant_mma`, `linear`'s staging), so their bitwise equalities hold by construction."""
    return (gate * sigmoid_f32(gate)) * up


# ---- raw global addresses ----------------------------------------------------------------------------------------
# Array indexing makes numba compute each address from the index (sign extension, multiply, add: all 64-bit), and
# the clamped indices of a streaming loop keep LLVM from turning that into pointer increments. A kernel that streams
# a matrix takes the array's address once and adds byte offsets itself: one 64-bit add per stream per step, and
# constant offsets fold into the load instruction.

@intrinsic
def address_of(typingctx, array):
    """The device address of an array's first element, as int64."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return int64(array), codegen


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


@intrinsic
def exp2_approx(typingctx, x):
    """2**x by `ex2.approx.ftz.f32` (2 ulp; -inf gives 0, subnormal results flush to 0): one instruction where
    `math.exp` calls libdevice's range-reduced expf (~8). For softmax weights, with log2(e) folded into one fma."""
    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        return builder.asm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f", list(args),
                           side_effect=False)

    return float32(float32), codegen


@intrinsic
def pack_bf16x2(typingctx, low, high):
    """`bf16_pair` in one instruction (`cvt.rn.bf16x2.f32`: round to nearest even, the same bits for every non-NaN
    value; a NaN becomes the canonical one), for hot loops whose values are never NaN (softmax weights)."""
    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        # the instruction packs its first source into the HIGH half
        return builder.asm(ir.FunctionType(i32, [f32, f32]), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f",
                           list(args), side_effect=False)

    return uint32(float32, float32), codegen


@intrinsic
def load_matrix_x4(typingctx, shared):
    """`ldmatrix.sync.aligned.m8n8.x4.shared.b16`: four 8 x 8 matrices of 16-bit elements from shared memory, one
    instruction for what takes four 32-bit loads (the mma fragment loads of a tile). Lanes 8m..8m+7 give the 32-bit
    shared addresses of matrix m's rows (16 bytes each, 16-byte aligned); lane 4g + t gets, in word m, elements 2t
    and 2t + 1 of row g of matrix m: the A fragment of m16n8k16 (matrices: rows 0-7 / 8-15 x columns 0-7 / 8-15) or
    the B fragments of two n-tiles (rows = n, 16-byte row pieces = k)."""
    signature = types.UniTuple(uint32, 4)(uint32)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        result = builder.asm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]),
                             "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                             list(args), side_effect=True)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)])

    return signature, codegen


@intrinsic
def load_matrix_x4_trans(typingctx, shared):
    """`ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`: `load_matrix_x4` with each 8 x 8 matrix transposed on the
    way: lane 4g + t gets, in word m, elements g of rows 2t (low half) and 2t + 1 (high half) of matrix m. From rows
    stored k-major (a V tile: a key a row, its head dims along it) that is the B fragment of m16n8k16 with k = the
    rows and n = the columns: matrices (rows 0-7, 8-15) x (columns 0-7, 8-15) give b0, b1 of two n-tiles."""
    signature = types.UniTuple(uint32, 4)(uint32)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        result = builder.asm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]),
                             "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
                             "=r,=r,=r,=r,r", list(args), side_effect=True)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)])

    return signature, codegen


def _make_global_load(count: int):
    @intrinsic
    def load_words(typingctx, address):
        """`count` uint32 words at a global byte address aligned to 4 * count bytes, as one load."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            value_type = i32 if count == 1 else ir.VectorType(i32, count)
            pointer = builder.inttoptr(args[0], value_type.as_pointer(1))  # addrspace 1: ld.global
            value = builder.load(pointer, align=4 * count)
            if count == 1:
                return value
            values = [builder.extract_element(value, ir.Constant(i32, i)) for i in range(count)]
            return context.make_tuple(builder, sig.return_type, values)

        result = uint32 if count == 1 else types.UniTuple(uint32, count)
        return result(int64), codegen

    return load_words


load_word_at = _make_global_load(1)
load_words2_at = _make_global_load(2)
load_words4_at = _make_global_load(4)


@intrinsic
def load_words4_streaming_at(typingctx, address):
    """`load_words4_at` for data read once (decode weights): `ld.global.nc.L1::no_allocate`, so the stream does not
    push the data a block reads again (its activations) out of L1."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        result = builder.asm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)]),
                             "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];",
                             "=r,=r,=r,=r,l", list(args), side_effect=False)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)])

    return types.UniTuple(uint32, 4)(int64), codegen


def _store_codegen(count: int):
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        if count == 1:
            value = args[1]
        else:
            value = ir.Constant(ir.VectorType(i32, count), None)
            for i in range(count):
                value = builder.insert_element(value, args[1 + i], ir.Constant(i32, i))
        builder.store(value, builder.inttoptr(args[0], value.type.as_pointer(1)), align=4 * count)
        return context.get_dummy_value()

    return codegen


@intrinsic
def store_word_at(typingctx, address, w0):
    """Store a uint32 word at a global byte address (4-byte aligned)."""
    return types.void(int64, uint32), _store_codegen(1)


@intrinsic
def store_words2_at(typingctx, address, w0, w1):
    """Store two uint32 words at a global byte address aligned to 8 bytes, as one store."""
    return types.void(int64, uint32, uint32), _store_codegen(2)


@intrinsic
def store_words4_at(typingctx, address, w0, w1, w2, w3):
    """Store four uint32 words at a global byte address aligned to 16 bytes, as one store."""
    return types.void(int64, uint32, uint32, uint32, uint32), _store_codegen(4)


GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


@device_function
def mix64(z):
    """splitmix64's finaliser of a 64-bit state (the fills' hash of (seed, index); the sampler's RNG)."""
    z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
    return z ^ (z >> uint64(31))


def blocks_for(items: int, per_block: int) -> int:
    return max(1, math.ceil(items / per_block))


def fragment_target(out, fragments) -> tuple:
    """(array, flag) for a kernel's optional tensor-core x fragments (uint32 words, written as bf16 halves): without
    them, `out` viewed as flat uint16 stands in (never written)."""
    if fragments is None:
        return out.reshape(-1).view(np.uint16), np.int32(0)
    return fragments.view(np.uint16), np.int32(1)


def bf16_target(out, out_bf16) -> tuple:
    """(array, flag) for a kernel's optional bf16 copy: without one, `out` viewed as uint16 stands in (never
    written, and no allocation, which graph capture forbids)."""
    if out_bf16 is None:
        return out.reshape(out.shape[0], -1).view(np.uint16), np.int32(0)
    return out_bf16.reshape(out_bf16.shape[0], -1), np.int32(1)


LOG2E = float32(math.log2(math.e))


@device_function
def quad_softmax_step(top_lo, top_hi, m_lo, m_hi):
    """The online softmax's rescale for the two rows a lane holds in an mma C layout (rows gq and gq + 8, the 4
    lanes of a quad sharing them), from the lane's own maxima of a new tile: (new max lo, hi; the factor the old
    sums and accumulators keep, lo, hi; the exp2 base of the weights, lo, hi), a weight being
    exp2(s * LOG2E - base). A row with no visible key yet keeps max -inf: factor 1, base 0 (its weights exp2(-inf)
    = 0). The flash prefill and the tensor-core decode kernels share it."""
    top_lo = max(top_lo, cuda.shfl_xor_sync(FULL_MASK, top_lo, 1))
    top_lo = max(top_lo, cuda.shfl_xor_sync(FULL_MASK, top_lo, 2))
    top_hi = max(top_hi, cuda.shfl_xor_sync(FULL_MASK, top_hi, 1))
    top_hi = max(top_hi, cuda.shfl_xor_sync(FULL_MASK, top_hi, 2))
    new_lo = max(m_lo, top_lo)
    new_hi = max(m_hi, top_hi)
    keep_lo = exp2_approx((m_lo - new_lo) * LOG2E) if new_lo != float32(-math.inf) else float32(1.0)
    keep_hi = exp2_approx((m_hi - new_hi) * LOG2E) if new_hi != float32(-math.inf) else float32(1.0)
    base_lo = new_lo * LOG2E if new_lo != float32(-math.inf) else float32(0.0)
    base_hi = new_hi * LOG2E if new_hi != float32(-math.inf) else float32(0.0)
    return new_lo, new_hi, keep_lo, keep_hi, base_lo, base_hi


@device_function
def quad_sum(value):
    """The sum of a value over the 4 lanes of a quad (butterfly: every lane gets the same bits)."""
    value += cuda.shfl_xor_sync(FULL_MASK, value, 1)
    return value + cuda.shfl_xor_sync(FULL_MASK, value, 2)
