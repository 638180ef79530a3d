"""Gated full attention (Qwen3.6 §3.4) on the GPU: prepare (q/k offset RMSNorm + partial interleaved MRoPE + KV
append into the paged pool, bf16 or INT8-G64), flash-decoding paged attention for decode/verify rows, and a tiled
online-softmax prefill kernel; both attention paths fuse the sigmoid output gate.

Layouts (see tests/kernels/test_attention.py for executable contracts):
- `qkgv` fp32 [R, 2*Hq*D + 2*Hkv*D]: column blocks q | k | gate | v.
- pools [pages, page_tokens, Hkv, D] uint16 (bf16 bits) or int8 codes; INT8 scales [pages, page_tokens, Hkv, D/group]
  uint16 (fp16 bits), group = min(64, D). page_tokens is read from the pool's shape.
- `q` fp32 [R, Hq, D] (what attention_prepare writes), `out` fp32 [R, Hq*D].
Limits: D a multiple of 32 and <= 256; Hq/Hkv <= 8.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int8, int32, int64, uint16, uint32, uint64
from numba.cuda import libdevice

from ninfer.backends.cpu import ops
from ninfer.backends.cpu.paged_kv import dequantize_int8, int8_group, quantize_int8
from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.kernels_numba.common import (FULL_MASK, address_of, bf16_hi_to_f32, bf16_pair, bf16_target, bf16_to_f32,
                                         block_sum, blocks_for, code_float, f32_to_bf16, fragment_target,
                                         half_pair_to_f32, pack_bf16x2, sigmoid_f32, store_word_at, warp_max,
                                         warp_sum)
from ninfer.kernels_numba.async_copy import (copy_async_8, copy_async_16, copy_async_commit, copy_async_wait_prior,
                                             shared_address)
from ninfer.kernels_numba.linear import load4, store4
from ninfer.kernels_numba.numba_setup import allow_dynamic_shared, cuda, device_function, kernel
from ninfer.kernels_numba.quant_mma import check_fragment_output, fragment_half

F32 = np.float32
MAX_E = 8  # head dims per lane in the decode kernel (D <= 256)
MAX_G = 8  # q heads per kv head
DECODE_WARPS = 4
MAX_GE = MAX_G * MAX_E
NEG_INF = -math.inf

f32_1d = float32[::1]
f32_2d = float32[:, ::1]
f32_3d = float32[:, :, ::1]
f32_4d = float32[:, :, :, ::1]
i32_1d = int32[::1]
i32_2d = int32[:, ::1]
u16_4d = uint16[:, :, :, ::1]
i8_4d = int8[:, :, :, ::1]


# ---------------------------------------------------------------------------------------------------------------
# device helpers


@device_function
def f32_to_f16_bits(value):
    """float32 -> IEEE half bits (uint32 holding 16 bits), round to nearest even, like numpy's astype(float16)."""
    bits = uint32(libdevice.float_as_int(float32(value)))
    sign = (bits >> uint32(16)) & uint32(0x8000)
    mag = bits & uint32(0x7FFFFFFF)
    if mag > uint32(0x7F800000):  # NaN
        return sign | uint32(0x7E00)
    if mag >= uint32(0x477FF000):  # rounds to >= 65520: inf
        return sign | uint32(0x7C00)
    if mag >= uint32(0x38800000):  # normal half (>= 2^-14)
        # rebias exponent 127 -> 15 and round the 13 dropped mantissa bits to nearest even
        rounded = mag + uint32(0xFFF) + ((mag >> uint32(13)) & uint32(1))
        return sign | ((rounded - uint32(0x38000000)) >> uint32(13))
    if mag < uint32(0x33000000):  # below half of the smallest subnormal (2^-25): zero
        return sign
    # subnormal half: value = m * 2^-24 with m = rne(x * 2^24) (exact scaling, exact rint)
    m = uint32(libdevice.rintf(libdevice.int_as_float(int32(mag)) * float32(16777216.0)))
    return sign | m


@device_function
def f16_bits_to_f32(h):
    h = uint32(h)
    sign = (h & uint32(0x8000)) << uint32(16)
    exp = (h >> uint32(10)) & uint32(0x1F)
    mant = h & uint32(0x3FF)
    if exp == uint32(0):
        value = float32(mant) * float32(5.960464477539063e-08)  # 2^-24, exact
        return -value if sign else value
    if exp == uint32(31):
        return libdevice.int_as_float(int32(sign | uint32(0x7F800000) | (mant << uint32(13))))
    return libdevice.int_as_float(int32(sign | ((exp + uint32(112)) << uint32(23)) | (mant << uint32(13))))


@device_function
def load_kv(pool, scales, page, off, kvh, d, group, quant):
    """One dequantized K or V element (bf16 bits, or int8 code times its fp16 group scale)."""
    if quant:
        return float32(pool[page, off, kvh, d]) * f16_bits_to_f32(scales[page, off, kvh, d // group])
    return bf16_to_f32(pool[page, off, kvh, d])




# ---------------------------------------------------------------------------------------------------------------
# 1. prepare: norms + rope + KV append


@device_function
def head_normalized(rows, r, slot, heads, head_dim, q_norm, k_norm, red, eps):
    """(thread t's value of head `slot` of row r over the head's rms, its norm weight): a q head for slot < heads,
    else kv head slot - heads, whose columns follow the heads * head_dim q columns. A block of head_dim threads;
    red: shared [32]."""
    t = cuda.threadIdx.x
    if slot < heads:
        col = slot * head_dim
        w = q_norm[t]
    else:
        col = heads * head_dim + (slot - heads) * head_dim
        w = k_norm[t]
    x = rows[r, col + t]
    return x * (float32(1.0) / math.sqrt(block_sum(x * x, red) / float32(head_dim) + eps)), w


@device_function
def rotate_half(y, vals, t, pairs, c, sn):
    """Split-half RoPE of element t (< 2 pairs) of a head whose values are in `vals`: t pairs with t +- pairs."""
    if t < pairs:
        return y * c - vals[t + pairs] * sn
    return y * c + vals[t - pairs] * sn


PREPARE_WARPS = 4  # (row, head) items a block of the prepare kernel: one warp each


def _make_prepare_kernel(head_dim: int):
    """The prepare kernel for one head dim: a warp per (row, head slot), lane l holding elements l + 32 e. Slot <
    Hq: a q head; else kv head slot - Hq (k normed and roped, v raw), encoded into its page.

    Why a warp, not a block of head_dim threads: at 8K rows that block and its barriers took 590 us a layer on the
    35B-A3B (0.5 TB/s). The arithmetic is the block version's, in its order: the sum of squares adds the 32-lane
    sums of elements 32 e .. 32 e + 31 in e order, as the block added its warps' sums, and a 64-wide int8 group's
    maximum takes its two 32-element maxima in order."""
    E = head_dim // 32
    GROUP = min(64, head_dim)
    PARTS = GROUP // 32  # 32-element parts of an int8 scale group

    @kernel(_prepare_common + (u16_4d, u16_4d, u16_4d, u16_4d, f32_3d) + _PREPARE_TAIL,
            _prepare_common + (i8_4d, i8_4d, u16_4d, u16_4d, f32_3d) + _PREPARE_TAIL, fastmath=False)
    def prepare_kernel(qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, page_tables, k_pool, v_pool,
                       k_scale, v_scale, q_out, heads, kv_heads, pairs, sec1, sec2, eps, quant):
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        slots = heads + kv_heads
        item = cuda.blockIdx.x * PREPARE_WARPS + warp
        if item >= qkgv.shape[0] * slots:  # warp-uniform
            return
        r = item // slots
        slot = item - r * slots
        is_q = slot < heads
        vals = cuda.shared.array((PREPARE_WARPS, head_dim), float32)
        y = cuda.local.array(E, float32)
        total = float32(0.0)
        for e in range(E):
            y[e] = qkgv[r, slot * head_dim + lane + 32 * e]  # a kv head's k columns follow the q heads'
            total += warp_sum(y[e] * y[e])
        inverse = float32(1.0) / math.sqrt(total / float32(head_dim) + eps)
        for e in range(E):
            d = lane + 32 * e
            w = q_norm[d] if is_q else k_norm[d]
            y[e] = (y[e] * inverse) * (float32(1.0) + w)
            vals[warp, d] = y[e]
        cuda.syncwarp()
        for e in range(E):
            d = lane + 32 * e
            if d < 2 * pairs:
                i = d % pairs
                axis = 0
                if i % 3 == 1 and i < 3 * sec1:
                    axis = 1
                elif i % 3 == 2 and i < 3 * sec2:
                    axis = 2
                angle = float32(positions[axis, r]) * inv_freq[i]
                y[e] = rotate_half(y[e], vals[warp], d, pairs, libdevice.cosf(angle), libdevice.sinf(angle))
        if is_q:
            for e in range(E):
                q_out[r, slot, lane + 32 * e] = y[e]
            return
        kvh = slot - heads
        pos = row_pos[r]
        if pos < 0:  # a padded row of a prefill chunk: no KV (the whole warp leaves)
            return
        page_tokens = k_pool.shape[1]
        page = page_tables[row_lane[r], pos // page_tokens]
        off = pos % page_tokens
        v = cuda.local.array(E, float32)
        for e in range(E):
            v[e] = qkgv[r, (2 * heads + kv_heads + kvh) * head_dim + lane + 32 * e]
        if not quant:
            for e in range(E):
                k_pool[page, off, kvh, lane + 32 * e] = f32_to_bf16(y[e])
                v_pool[page, off, kvh, lane + 32 * e] = f32_to_bf16(v[e])
            return
        part_max = cuda.local.array(E, float32)
        for which in range(2):
            for e in range(E):
                part_max[e] = warp_max(abs(y[e] if which == 0 else v[e]))
            for e in range(E):
                first = (e // PARTS) * PARTS
                amax = part_max[first]
                for j in range(1, PARTS):
                    amax = max(amax, part_max[first + j])
                sbits = f32_to_f16_bits(amax / float32(127.0))
                sw = f16_bits_to_f32(sbits)
                inv_s = float32(0.0)
                if sw != float32(0.0):
                    inv_s = float32(1.0) / sw
                d = lane + 32 * e
                code = libdevice.rintf((y[e] if which == 0 else v[e]) * inv_s)
                code = min(max(code, float32(-127.0)), float32(127.0))
                if which == 0:
                    k_pool[page, off, kvh, d] = int32(code)
                    if d % GROUP == 0:
                        k_scale[page, off, kvh, d // GROUP] = sbits
                else:
                    v_pool[page, off, kvh, d] = int32(code)
                    if d % GROUP == 0:
                        v_scale[page, off, kvh, d // GROUP] = sbits

    return prepare_kernel


_PREPARE_TAIL = (int32, int32, int32, int32, int32, float32, int32)
_prepare_common = (f32_2d, f32_1d, f32_1d, f32_1d, i32_2d, i32_1d, i32_1d, i32_2d)
PREPARE_KERNELS = {head_dim: _make_prepare_kernel(head_dim) for head_dim in range(32, 257, 32)}


def _i32(*values):
    """Scalars as int32 so launches hit the registered signatures."""
    return tuple(np.int32(v) for v in values)


def _check_dims(heads, kv_heads, head_dim):
    if head_dim % 32 or head_dim > 256:
        raise ValueError(f"head_dim must be a multiple of 32 and at most 256, got {head_dim}")
    if heads % kv_heads or heads // kv_heads > MAX_G:
        raise ValueError(f"heads/kv_heads must be an integer <= {MAX_G}, got {heads}/{kv_heads}")


def _quant_args(k_pool, v_pool, k_scale, v_scale):
    quant = k_pool.dtype == np.int8
    if quant:
        if k_scale is None or v_scale is None:
            raise ValueError("an int8 pool needs k_scale and v_scale")
        return 1, k_scale, v_scale
    return 0, k_pool, v_pool  # bf16: the pools stand in for the (unused) scale arguments


def attention_prepare(qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, page_tables, k_pool, v_pool,
                      k_scale, v_scale, q_out, *, heads, kv_heads, head_dim, rotary_dim, sections, eps, stream):
    """One launch: q_out[R, Hq, D] = rope(offset_rmsnorm(q)); pool[row's page, row_pos % page] = encode(rope(norm(k)))
    and encode(v). A row with row_pos < 0 (a padded prefill chunk's padding) writes no KV. bf16 pools: pass k_scale =
    v_scale = None."""
    _check_dims(heads, kv_heads, head_dim)
    rows = qkgv.shape[0]
    if rows == 0:
        return
    quant, ks, vs = _quant_args(k_pool, v_pool, k_scale, v_scale)
    PREPARE_KERNELS[head_dim][blocks_for(rows * (heads + kv_heads), PREPARE_WARPS), PREPARE_WARPS * 32, stream](
        qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, page_tables, k_pool, v_pool, ks, vs, q_out,
        *_i32(heads, kv_heads, rotary_dim // 2, sections[1], sections[2]), np.float32(eps), np.int32(quant))


def _encode_rows(k, v, dtype_int8, group):
    if not dtype_int8:
        return (f32_to_bf16_bits(k), None), (f32_to_bf16_bits(v), None)
    kc, ks = quantize_int8(k, group)
    vc, vs = quantize_int8(v, group)
    return (kc, ks.view(np.uint16)), (vc, vs.view(np.uint16))


def attention_prepare_reference(qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, page_tables, k_pool,
                                v_pool, k_scale, v_scale, q_out, *, heads, kv_heads, head_dim, rotary_dim, sections,
                                eps, stream=None):
    """NumPy twin on host arrays (mutates q_out and the pools); returns q_out."""
    rows = qkgv.shape[0]
    qw, kw = heads * head_dim, kv_heads * head_dim
    q = ops.rms_norm(qkgv[:, :qw].reshape(rows, heads, head_dim), q_norm, eps, offset=True)
    k = ops.rms_norm(qkgv[:, qw:qw + kw].reshape(rows, kv_heads, head_dim), k_norm, eps, offset=True)
    v = qkgv[:, 2 * qw + kw:].reshape(rows, kv_heads, head_dim).astype(F32)
    angles = ops.mrope_angles(positions, inv_freq[: rotary_dim // 2], tuple(sections))
    q, k = ops.apply_rotary(q, angles), ops.apply_rotary(k, angles)
    q_out[...] = q
    page_tokens = k_pool.shape[1]
    quant = k_pool.dtype == np.int8
    group = int8_group(head_dim) if quant else 0
    (kc, ksc), (vc, vsc) = _encode_rows(k, v, quant, group)
    for r in range(rows):
        pos = int(row_pos[r])
        if pos < 0:  # a padded row: no KV
            continue
        page, off = page_tables[row_lane[r], pos // page_tokens], pos % page_tokens
        k_pool[page, off], v_pool[page, off] = kc[r], vc[r]
        if quant:
            k_scale[page, off], v_scale[page, off] = ksc[r], vsc[r]
    return q_out


# ---------------------------------------------------------------------------------------------------------------
# 2. decode: flash-decoding over pages + combine with the gate


# Flash-decoding splits per row: a row's keys are cut into at most this many equal runs (multiples of SPLIT_ALIGN
# keys), whatever its length, so a short context still spreads over many blocks and a long one needs no more
# scratch. A row's split boundaries depend on its own length only: batch invariant. (Splits of a fixed 4 pages left
# 16 blocks busy at 1K context: 175 us per 27B layer on the H200.) The model takes `row_splits`.
DEFAULT_SPLITS = 32
# Splits a row's keys may take: SPLIT_SLOTS a lane when the combine merges them (`merge_partials`). More splits keep
# more blocks streaming a long context (32 splits of a 32K-token row are 1K keys a block, one block a kv head and
# split).
SPLIT_SLOTS = 8
MAX_SPLITS = 32 * SPLIT_SLOTS
SPLIT_ALIGN = 4  # = STEP_KEYS, the keys of one warp step
# Blocks a decode row keeps streaming (kv heads x splits) when the model picks its splits (`row_splits`), up to
# ROW_MAX_SPLITS splits. On the H200, B=1 bf16 decode step with the staged kernel (results/
# cuda_model_staged_session16.json): 27B 1K context 15.61 / 15.62 / 15.78 ms at 32 / 64 / 128 splits, 32K 18.01 /
# 17.10 / 17.43; 35B-A3B 1K 4.07 / 4.07 / 4.11, 32K 5.46 / 4.77 / 4.66. So 64 for both: 128 gained the 35B-A3B 2%
# at 32K and cost it 1% at 1K. (With the register-pipelined kernel before it: 27B best at 32, results/
# cuda_model_splits_session16.json.)
ROW_BLOCKS = 256
ROW_MAX_SPLITS = 64


def row_splits(kv_heads: int) -> int:
    """The splits a model's decode rows take: ROW_BLOCKS blocks a row, between DEFAULT_SPLITS and ROW_MAX_SPLITS."""
    return min(ROW_MAX_SPLITS, max(DEFAULT_SPLITS, ROW_BLOCKS // kv_heads))


def decode_partials_shape(rows, heads, head_dim, splits=DEFAULT_SPLITS):
    """Scratch for attention_decode: per (row, q head, split) the running max, the sum and D accumulators."""
    check_splits(splits)
    return (rows, heads, splits, head_dim + 2)


def check_splits(splits: int) -> None:
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"attention partials hold 1..{MAX_SPLITS} splits per row, got {splits}")


def check_min_split_keys(keys: int) -> None:
    if keys < 0:
        raise ValueError(f"the fewest keys a split takes must be >= 0, got {keys}")


@device_function
def split_keys(length, splits, min_keys):
    """Keys per split for a row of `length` keys: ceil(length / splits), at least `min_keys`, rounded up to
    SPLIT_ALIGN. Both bounds are the same for every row of every batch: a row's splits depend on its length only."""
    per = max((length + splits - 1) // splits, min_keys)
    return (per + SPLIT_ALIGN - 1) // SPLIT_ALIGN * SPLIT_ALIGN


@device_function
def init_online_state(q, r, kvh, group_heads, per_lane, dbase, scale, qv, acc, m, lsum, kx):
    """Row r's scaled queries of the G q heads of kv head `kvh` (this lane's dims) and an empty online softmax."""
    for e in range(MAX_E):
        kx[e] = float32(0.0)
    for g in range(MAX_G):
        m[g] = float32(NEG_INF)
        lsum[g] = float32(0.0)
        for e in range(MAX_E):
            acc[g * MAX_E + e] = float32(0.0)
            qv[g * MAX_E + e] = float32(0.0)
            if g < group_heads and e < per_lane:
                qv[g * MAX_E + e] = q[r, kvh * group_heads + g, dbase + e] * scale


@device_function
def online_scores(qv, kx, m, lsum, ag, pg, group_heads, per_lane):
    """One key (kx, this lane's dims) against the G heads: a warp-wide dot each, folded into the running max and sum;
    ag / pg keep the rescale of the old accumulators and the key's weight for `online_values`."""
    for g in range(MAX_G):
        if g < group_heads:
            dot = float32(0.0)
            for e in range(MAX_E):
                if e < per_lane:
                    dot += qv[g * MAX_E + e] * kx[e]
            dot = warp_sum(dot)
            m_new = max(m[g], dot)
            alpha = math.exp(m[g] - m_new)
            p = math.exp(dot - m_new)
            lsum[g] = lsum[g] * alpha + p
            m[g] = m_new
            ag[g] = alpha
            pg[g] = p


@device_function
def online_values(acc, kx, ag, pg, group_heads):
    """The key's value row (kx) into the G heads' accumulators."""
    for g in range(MAX_G):
        if g < group_heads:
            for e in range(MAX_E):
                acc[g * MAX_E + e] = acc[g * MAX_E + e] * ag[g] + pg[g] * kx[e]


@device_function
def store_block_partials(m, lsum, acc, sm_m, sm_l, sm_acc, partials, r, kvh, split, group_heads, head_dim, per_lane,
                         dbase, warps):
    """The block's warps' states merged in warp order (a warp that saw no key keeps max -inf and is skipped), then
    one partial (max, sum, accumulators) per (row, q head, split). sm_*: shared [warps, MAX_G(, 256)]."""
    tid = cuda.threadIdx.x
    lane = tid % 32
    warp = tid // 32
    for g in range(MAX_G):
        if g < group_heads:
            if lane == 0:
                sm_m[warp, g] = m[g]
                sm_l[warp, g] = lsum[g]
            for e in range(MAX_E):
                if e < per_lane:
                    sm_acc[warp, g, dbase + e] = acc[g * MAX_E + e]
    cuda.syncthreads()
    for idx in range(tid, group_heads * head_dim, warps * 32):
        g = idx // head_dim
        d = idx % head_dim
        mx = float32(NEG_INF)
        for w in range(warps):
            mx = max(mx, sm_m[w, g])
        total_l = float32(0.0)
        total_a = float32(0.0)
        for w in range(warps):
            mw = sm_m[w, g]
            if mw != float32(NEG_INF):
                f = math.exp(mw - mx)
                total_l += sm_l[w, g] * f
                total_a += sm_acc[w, g, d] * f
        h = kvh * group_heads + g
        partials[r, h, split, 2 + d] = total_a
        if d == 0:
            partials[r, h, split, 0] = mx
            partials[r, h, split, 1] = total_l


MERGE_LOADS = 8  # accumulator loads a thread issues together while merging splits


@device_function
def merge_partials(partials, r, h, d, splits):
    """(accumulator d, softmax sum) of row r, q head h over its first `splits` (<= MAX_SPLITS) partials, in split
    order (empty splits, max -inf, skipped). Called by whole warps: lane l loads the max and sum of splits l, l + 32,
    ... (slot i: split l + 32 i), the warp's max is the row's, and each thread then walks the splits in order with
    `MERGE_LOADS` accumulator loads in flight (a chain of one load per split took 9 us at 32 splits)."""
    lane = cuda.threadIdx.x & 31
    last = partials.shape[2] - 1
    m_slots = cuda.local.array(SPLIT_SLOTS, float32)
    l_slots = cuda.local.array(SPLIT_SLOTS, float32)
    f_slots = cuda.local.array(SPLIT_SLOTS, float32)
    m_lane = float32(NEG_INF)
    for i in range(SPLIT_SLOTS):
        m_slots[i] = float32(NEG_INF)
        l_slots[i] = float32(0.0)
        if lane + 32 * i < splits:
            m_slots[i] = partials[r, h, lane + 32 * i, 0]
            l_slots[i] = partials[r, h, lane + 32 * i, 1]
        m_lane = max(m_lane, m_slots[i])
    mx = warp_max(m_lane)
    for i in range(SPLIT_SLOTS):
        f_slots[i] = float32(0.0)
        if m_slots[i] != float32(NEG_INF):
            f_slots[i] = math.exp(m_slots[i] - mx)
    values = cuda.local.array(MERGE_LOADS, float32)
    total_l = float32(0.0)
    total_a = float32(0.0)
    for s0 in range(0, splits, MERGE_LOADS):  # warp-uniform: `splits` is the row's
        f_lane = f_slots[0]  # slot s0 // 32 of every lane (a batch never crosses a multiple of 32)
        l_lane = l_slots[0]
        m_slot = m_slots[0]
        for i in range(1, SPLIT_SLOTS):
            if i == s0 // 32:
                f_lane = f_slots[i]
                l_lane = l_slots[i]
                m_slot = m_slots[i]
        for i in range(MERGE_LOADS):  # in bounds whatever `splits`: unused loads are never summed
            values[i] = partials[r, h, min(s0 + i, last), 2 + d]
        for i in range(MERGE_LOADS):
            s = s0 + i
            f = cuda.shfl_sync(FULL_MASK, f_lane, s & 31)
            l_s = cuda.shfl_sync(FULL_MASK, l_lane, s & 31)
            empty = cuda.shfl_sync(FULL_MASK, m_slot, s & 31) == float32(NEG_INF)
            if s < splits and not empty:
                total_l += l_s * f
                total_a += values[i] * f
    return total_a, total_l


def _decode_split_kernel(q, page_tables, row_lane, row_pos, k_pool, v_pool, k_scale, v_scale, partials,
                         heads, kv_heads, head_dim, quant, min_keys):
    """grid (splits, Hkv, R), block DECODE_WARPS warps; a warp per key, lanes split head_dim, G q heads at once."""
    split = cuda.blockIdx.x
    kvh = cuda.blockIdx.y
    r = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    lane = tid % 32
    warp = tid // 32
    page_tokens = k_pool.shape[1]
    length = row_pos[r] + 1
    chunk = split_keys(length, partials.shape[2], min_keys)
    start = split * chunk
    if start >= length:
        return
    stop = min(start + chunk, length)
    group_heads = heads // kv_heads
    per_lane = head_dim // 32
    dbase = lane * per_lane
    qgroup = min(64, head_dim)
    scale = float32(1.0) / math.sqrt(float32(head_dim))
    qv = cuda.local.array(MAX_GE, float32)
    acc = cuda.local.array(MAX_GE, float32)
    m = cuda.local.array(MAX_G, float32)
    lsum = cuda.local.array(MAX_G, float32)
    kx = cuda.local.array(MAX_E, float32)
    ag = cuda.local.array(MAX_G, float32)
    pg = cuda.local.array(MAX_G, float32)
    init_online_state(q, r, kvh, group_heads, per_lane, dbase, scale, qv, acc, m, lsum, kx)
    lane_id = row_lane[r]
    for key in range(start + warp, stop, DECODE_WARPS):
        page = page_tables[lane_id, key // page_tokens]
        off = key % page_tokens
        for e in range(MAX_E):
            if e < per_lane:
                kx[e] = load_kv(k_pool, k_scale, page, off, kvh, dbase + e, qgroup, quant)
        online_scores(qv, kx, m, lsum, ag, pg, group_heads, per_lane)
        for e in range(MAX_E):
            if e < per_lane:
                kx[e] = load_kv(v_pool, v_scale, page, off, kvh, dbase + e, qgroup, quant)
        online_values(acc, kx, ag, pg, group_heads)
    sm_m = cuda.shared.array((DECODE_WARPS, MAX_G), float32)
    sm_l = cuda.shared.array((DECODE_WARPS, MAX_G), float32)
    sm_acc = cuda.shared.array((DECODE_WARPS, MAX_G, 256), float32)
    store_block_partials(m, lsum, acc, sm_m, sm_l, sm_acc, partials, r, kvh, split, group_heads, head_dim, per_lane,
                         dbase, DECODE_WARPS)


_DECODE_TAIL = (int32, int32, int32, int32, int32)
decode_split_kernel = kernel(
    (f32_3d, i32_2d, i32_1d, i32_1d, u16_4d, u16_4d, u16_4d, u16_4d, f32_4d) + _DECODE_TAIL,
    (f32_3d, i32_2d, i32_1d, i32_1d, i8_4d, i8_4d, u16_4d, u16_4d, f32_4d) + _DECODE_TAIL,
    fastmath=True,
)(_decode_split_kernel)


STEP_KEYS = 4  # keys a warp step of the head_dim 256 kernel


# int8 codes as float32 through `code_float`: each byte plus 128 (the xor of its sign bit) is an unsigned code, then
# 2^23 + 128 comes off. Why: the head_dim 256 kernel's G warps of a kv head each convert the same K and V rows (the
# 35B-A3B's 8), and the integer-to-float conversion runs at a quarter of the FP32 rate. For the same reason a row's
# fp16 group scale (one a lane: its 8 dims lie in one group) multiplies the lane's dot product and the step's weights,
# not each code, and converts by `cvt` (`half_pair_to_f32`).
INT8_SIGN_BITS = 0x80808080
INT8_CODE_OFFSET = float(2 ** 23 + 128)


@device_function
def _bf16_lane(word, i):
    """bf16 element i (0..1) of a uint32 word as float32."""
    if i == 0:
        return bf16_to_f32(word)
    return bf16_hi_to_f32(word)


@device_function
def _step_values(values, words):
    """A step's 4 keys x this lane's 8 dims as fp32 from the bf16 words `_staged_load` read (int8: the codes; their
    scales apply once a dot product in `_step_scores`, and to the step's 4 weights for V)."""
    for j in range(STEP_KEYS):
        for e in range(8):
            values[j * 8 + e] = _bf16_lane(words[4 * j + e // 2], e % 2)


@device_function
def _step_scores(qv, kx, scales, quant, lane, key0, stop):
    """The 4 scores of a step's keys (kx: 4 keys x this lane's 8 dims; int8: codes, times the lane's K scales once a
    dot product) reduced over the warp: a butterfly reduce-scatter, lane L ends with key L // 8's score (-inf past
    the row's end)."""
    vals = cuda.local.array(4, float32)
    for j in range(STEP_KEYS):
        dot = float32(0.0)
        for e in range(8):
            dot += qv[e] * kx[j * 8 + e]
        vals[j] = dot * scales[j] if quant else dot
    # reduce-scatter over offsets 16 and 8, then a plain butterfly
    hi = (lane & 16) != 0
    for i in range(2):
        a = vals[i]
        b = vals[i + 2]
        vals[i] = (b if hi else a) + cuda.shfl_xor_sync(FULL_MASK, a if hi else b, 16)
    hi = (lane & 8) != 0
    a = vals[0]
    b = vals[1]
    s = (b if hi else a) + cuda.shfl_xor_sync(FULL_MASK, a if hi else b, 8)
    s += cuda.shfl_xor_sync(FULL_MASK, s, 4)
    s += cuda.shfl_xor_sync(FULL_MASK, s, 2)
    s += cuda.shfl_xor_sync(FULL_MASK, s, 1)
    if key0 + lane // 8 >= stop:
        s = float32(NEG_INF)
    return s


@device_function
def _step_softmax(s, m_l, l_l):
    """The step's 4 scores (lane L holds key L // 8's) into the warp's online softmax: (the 4 weights, the rescale of
    the old accumulators, the new max, the new sum)."""
    mx = max(s, cuda.shfl_xor_sync(FULL_MASK, s, 8))
    mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 16))
    m_new = max(m_l, mx)
    alpha = math.exp(m_l - m_new)
    p = math.exp(s - m_new)
    p0 = cuda.shfl_sync(FULL_MASK, p, 0)
    p1 = cuda.shfl_sync(FULL_MASK, p, 8)
    p2 = cuda.shfl_sync(FULL_MASK, p, 16)
    p3 = cuda.shfl_sync(FULL_MASK, p, 24)
    return p0, p1, p2, p3, alpha, m_new, l_l * alpha + (((p0 + p1) + p2) + p3)


@device_function
def _step_accumulate(acc, kx, alpha, p0, p1, p2, p3):
    """The step's 4 value rows (kx) weighted into this lane's 8 accumulators."""
    for e in range(8):
        acc[e] = acc[e] * alpha + p0 * kx[e] + p1 * kx[8 + e] + p2 * kx[16 + e] + p3 * kx[24 + e]


@device_function
def _store_step_partials(m_l, l_l, acc, sm_m, sm_l, sm_acc, partials, r, kvh, split, group_heads, key_warps):
    """Merge the states of the key warps of each q head (warp w: head w % G) in warp order, skipping warps that saw no
    key, into the (row, q head, split) partial: max, sum, then the 256 accumulators."""
    tid = cuda.threadIdx.x
    lane = tid % 32
    warp = tid // 32
    if lane == 0:
        sm_m[warp] = m_l
        sm_l[warp] = l_l
    for e in range(8):
        sm_acc[warp, lane * 8 + e] = acc[e]
    cuda.syncthreads()
    for idx in range(tid, group_heads * 256, cuda.blockDim.x):
        gg = idx // 256
        d = idx % 256
        mx = float32(NEG_INF)
        for i in range(key_warps):
            mx = max(mx, sm_m[i * group_heads + gg])
        total_l = float32(0.0)
        total_a = float32(0.0)
        for i in range(key_warps):
            w = i * group_heads + gg
            mw = sm_m[w]
            if mw != float32(NEG_INF):
                f = math.exp(mw - mx)
                total_l += sm_l[w] * f
                total_a += sm_acc[w, d] * f
        hh = kvh * group_heads + gg
        partials[r, hh, split, 2 + d] = total_a
        if d == 0:
            partials[r, hh, split, 0] = mx
            partials[r, hh, split, 1] = total_l


u64_4d = uint64[:, :, :, ::1]


# The head_dim 256 kernel, staged: a block copies STAGE_KEYS keys' K and V rows of its kv head (and their int8
# scales) at a time into shared memory (`cp.async`, STAGES tiles: two in flight while the warps read the third),
# and each warp runs 4-key steps over the tile from there. Why: the register-pipelined kernel it replaced kept its
# loads in registers, so a block had one 4-key step per key warp in flight (4 KiB a 35B-A3B block, G = 8, one key
# warp) and registers allowed one block an SM. On the H200, B=1 / 8, register-pipelined -> staged (results/
# kernel_attention_staged_session16.json, kernel_attention_fast_vs_staged_session17.txt): bf16 KV at 32K context
# 35B-A3B 169 -> 79 us / 1208 -> 434, 27B 178 -> 113 / 1304 -> 766; int8 KV at 32K 35B-A3B 462 -> 162 / 3538 ->
# 1101, 27B 514 -> 249 / 3976 -> 1839; at 1K B=1 about the same (~20 us bf16, ~26 int8).
#
# int8 pools: the G warps of a kv head read the same rows, so a tile's codes are converted once, by the whole block,
# into bf16 rows (exact: a code has at most 8 significant bits) in a buffer after the ring, and the warps step over
# those as over a bf16 tile; the rows' fp16 scales stay in the tile and multiply the lanes' dot products and weights.
STAGE_KEYS = 32
STAGES = 3  # copy_async_wait_prior (all but the newest group landed) is the wait of a 3-stage ring
BF16_ROW_WORDS = 128  # uint32 words of a head_dim 256 row: bf16
INT8_ROW_WORDS = 64  # int8 codes


def stage_layout(quant: bool) -> dict[str, int]:
    """The staged kernel's dynamic shared memory in uint32 words. A tile: the K rows, then the V rows, then from
    SCALES the K rows' int8 scales and the V rows' (4 fp16 a row: 2 words); STAGES tiles of WORDS; int8 pools then
    the converted bf16 K and V rows of one tile at CONVERTED. BYTES in all: bf16 97.5 KiB, int8 81.5 KiB."""
    row_words = INT8_ROW_WORDS if quant else BF16_ROW_WORDS
    scales = 2 * STAGE_KEYS * row_words
    words = scales + 2 * STAGE_KEYS * 2
    converted = STAGES * words
    total = converted + (2 * STAGE_KEYS * BF16_ROW_WORDS if quant else 0)
    return dict(ROW_WORDS=row_words, SCALES=scales, WORDS=words, CONVERTED=converted, BYTES=4 * total)


STAGED_BLOCK_WARPS = 8  # at most G x KW warps a block (KW a power of two): two blocks an SM at <= 128 registers
STAGED_MAX_REGISTERS = 128


def staged_key_warps(group_heads: int) -> int:
    """Key warps a staged block takes for a kv head of `group_heads` q heads: the most of 1, 2, 4, 8 with
    group_heads x KW <= STAGED_BLOCK_WARPS (4 x KW divides STAGE_KEYS: a tile holds whole warp steps)."""
    return max(k for k in (1, 2, 4, 8) if group_heads * k <= STAGED_BLOCK_WARPS or k == 1)


@device_function
def _pool_row(page_tables, lane_id, key, stop, page_tokens):
    """The pool row (page x page_tokens + offset, int64) of the lane's key, or of its last key (stop - 1) for a key
    past the end (whose copy then reads nothing: a valid address all the same)."""
    kept = min(key, stop - 1)
    slot = kept // page_tokens
    return int64(page_tables[lane_id, slot]) * page_tokens + (kept - slot * page_tokens)


@device_function
def _stage_tile(base, k_at, v_at, k_scale_at, v_scale_at, page_tables, lane_id, key_start, stop, page_tokens,
                token_bytes, scale_token_bytes, row_pieces, scales_word, quant):
    """Issue the copies of the tile of keys key_start .. key_start + STAGE_KEYS - 1 into the stage at shared address
    `base`: K rows, then V rows (`row_pieces` 16-byte pieces a row), then (int8) from word `scales_word` the rows'
    8 bytes of scales; keys from `stop` on read nothing and land as zeros."""
    for c in range(cuda.threadIdx.x, STAGE_KEYS * row_pieces, cuda.blockDim.x):
        key = key_start + c // row_pieces
        at = _pool_row(page_tables, lane_id, key, stop, page_tokens) * token_bytes + (c % row_pieces) * 16
        size = uint32(16) if key < stop else uint32(0)
        copy_async_16(base + uint32(c * 16), k_at + at, size)
        copy_async_16(base + uint32((STAGE_KEYS * row_pieces + c) * 16), v_at + at, size)
    if quant:
        for c in range(cuda.threadIdx.x, STAGE_KEYS, cuda.blockDim.x):
            key = key_start + c
            at = _pool_row(page_tables, lane_id, key, stop, page_tokens) * scale_token_bytes
            size = uint32(8) if key < stop else uint32(0)
            copy_async_8(base + uint32(scales_word * 4 + c * 8), k_scale_at + at, size)
            copy_async_8(base + uint32((scales_word + 2 * STAGE_KEYS) * 4 + c * 8), v_scale_at + at, size)


@device_function
def _staged_load(words, scales, sh, row0, scale0, lane, quant):
    """A step's 4 bf16 rows of this lane (row0: the first row's word: the stage's, or the converted tile's for int8),
    16 bytes a row as `_step_values` takes them, and (int8) the rows' fp32 scales of the lane's group (scale0: the
    first row's scales' word in the stage)."""
    for j in range(STEP_KEYS):
        words[4 * j], words[4 * j + 1], words[4 * j + 2], words[4 * j + 3] = load4(
            sh, row0 + j * BF16_ROW_WORDS + lane * 4)
        if quant:
            low, high = half_pair_to_f32(sh[scale0 + j * 2 + lane // 16])
            scales[j] = high if (lane // 8) % 2 else low


@device_function
def _convert_tile(sh, stage, converted):
    """The int8 K and V rows of the stage at word `stage` as bf16 rows at word `converted`, by the whole block: each
    thread takes 16-byte pieces (16 codes) and writes their 8 bf16 pair words."""
    for piece in range(cuda.threadIdx.x, 2 * STAGE_KEYS * INT8_ROW_WORDS // 4, cuda.blockDim.x):
        codes = load4(sh, stage + piece * 4)
        pairs = cuda.local.array(8, uint32)
        for w in range(4):
            biased = codes[w] ^ uint32(INT8_SIGN_BITS)
            for h in range(2):
                pairs[2 * w + h] = pack_bf16x2(code_float(biased, 2 * h, float32(INT8_CODE_OFFSET)),
                                               code_float(biased, 2 * h + 1, float32(INT8_CODE_OFFSET)))
        store4(sh, converted + piece * 8, pairs[0], pairs[1], pairs[2], pairs[3])
        store4(sh, converted + piece * 8 + 4, pairs[4], pairs[5], pairs[6], pairs[7])


STAGED_SIGNATURE = (f32_3d, i32_2d, i32_1d, i32_1d, u64_4d, u64_4d, u16_4d, u16_4d, f32_4d, int32, int32, int32)


def _make_decode_staged_kernel(quant: bool):
    """The staged kernel for int8 pools (`quant`) or bf16 ones: `quant` is a constant of the closure, so each pool
    dtype compiles to its own code (a runtime switch took the bf16 kernel from 104 registers to the 128 cap), with
    its row size and shared layout (`stage_layout`) constants (the tile's divisions become shifts)."""
    layout = stage_layout(quant)
    row_words, stage_words, scales_word, converted = (layout[n] for n in ("ROW_WORDS", "WORDS", "SCALES", "CONVERTED"))
    row_pieces = row_words // 4  # 16-byte copies a head row
    def _decode_staged_kernel(q, page_tables, row_lane, row_pos, k_words, v_words, k_scale, v_scale, partials,
                              heads, kv_heads, min_keys):
        """head_dim == 256. Block = G x KW warps: warp w serves q head w % G over keys start + (w // G)*4 +
        i*4*KW (4 a step, the G warps of a step read the same rows), reading K and V from tiles staged in shared
        memory (`_stage_tile`, a ring of STAGES); lane L owns head dims 8L..8L+7, and a step's 4 dot products are
        reduced by a butterfly reduce-scatter (lane L: key L // 8). Keys past the row's end land as zeros, masked."""
        sh = cuda.shared.array(0, uint32)
        split = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        r = cuda.blockIdx.z
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        group_heads = heads // kv_heads
        h = kvh * group_heads + warp % group_heads
        key_warps = cuda.blockDim.x // (32 * group_heads)
        kw_i = warp // group_heads
        length = row_pos[r] + 1
        chunk = split_keys(length, partials.shape[2], min_keys)
        start = split * chunk
        stop = min(start + chunk, length)
        if start >= stop:
            return
        page_tokens = int32(k_words.shape[1])
        tiles = (stop - start + STAGE_KEYS - 1) // STAGE_KEYS
        qv = cuda.local.array(8, float32)
        acc = cuda.local.array(8, float32)
        kx = cuda.local.array(32, float32)  # 4 keys x 8 dims (K, then V)
        kw = cuda.local.array(16, uint32)  # a step's 4 rows of this lane, as words
        ksc = cuda.local.array(4, float32)
        scale = float32(1.0) / math.sqrt(float32(256.0))
        for e in range(8):  # this lane's 8 dims of q head h, scaled, and zeroed accumulators
            acc[e] = float32(0.0)
            qv[e] = q[r, h, lane * 8 + e] * scale
        m_l = float32(NEG_INF)
        l_l = float32(0.0)
        lane_id = row_lane[r]
        token_bytes = int64(k_words.shape[2] * row_words * 4)
        head_bytes = int64(kvh * row_words * 4)
        k_at = address_of(k_words) + head_bytes
        v_at = address_of(v_words) + head_bytes
        scale_token_bytes = int64(k_scale.shape[2] * k_scale.shape[3] * 2)  # int8: 4 fp16 a kv head
        k_scale_at = address_of(k_scale) + kvh * int64(k_scale.shape[3] * 2)
        v_scale_at = address_of(v_scale) + kvh * int64(v_scale.shape[3] * 2)
        shared = shared_address(address_of(sh))
        # Copy groups in commit order: tiles 0 .. STAGES - 2, then tile t + STAGES - 1 in iteration t (empty past the
        # last tile), so at iteration t "all but the newest group landed" is tile t.
        for t in range(STAGES - 1):
            if t < tiles:
                _stage_tile(shared + uint32(t * stage_words * 4), k_at, v_at, k_scale_at, v_scale_at, page_tables,
                            lane_id, start + t * STAGE_KEYS, stop, page_tokens, token_bytes, scale_token_bytes,
                            row_pieces, scales_word, quant)
            copy_async_commit()
        step_keys = key_warps * STEP_KEYS
        for t in range(tiles):
            copy_async_wait_prior()
            cuda.syncthreads()  # tile t landed for every thread; every warp left tile t - 1, whose stage refills now
            ahead = t + STAGES - 1
            if ahead < tiles:
                _stage_tile(shared + uint32((ahead % STAGES) * stage_words * 4), k_at, v_at, k_scale_at, v_scale_at,
                            page_tables, lane_id, start + ahead * STAGE_KEYS, stop, page_tokens, token_bytes,
                            scale_token_bytes, row_pieces, scales_word, quant)
            copy_async_commit()
            stage = (t % STAGES) * stage_words
            tile_rows = stage  # where the warps read the tile's bf16 rows
            if quant:
                _convert_tile(sh, stage, converted)
                cuda.syncthreads()  # every piece converted (the next iteration's barrier guards the buffer's reuse)
                tile_rows = converted
            key_base = start + t * STAGE_KEYS
            for j0 in range(kw_i * STEP_KEYS, STAGE_KEYS, step_keys):
                key0 = key_base + j0
                if key0 < stop:
                    _staged_load(kw, ksc, sh, tile_rows + j0 * BF16_ROW_WORDS, stage + scales_word + j0 * 2, lane,
                                 quant)
                    _step_values(kx, kw)
                    p0, p1, p2, p3, alpha, m_l, l_l = _step_softmax(
                        _step_scores(qv, kx, ksc, quant, lane, key0, stop), m_l, l_l)
                    _staged_load(kw, ksc, sh, tile_rows + (STAGE_KEYS + j0) * BF16_ROW_WORDS,
                                 stage + scales_word + (STAGE_KEYS + j0) * 2, lane, quant)
                    _step_values(kx, kw)
                    if quant:  # the V rows' scales go into the weights: 4 products a step instead of 32
                        p0, p1, p2, p3 = p0 * ksc[0], p1 * ksc[1], p2 * ksc[2], p3 * ksc[3]
                    _step_accumulate(acc, kx, alpha, p0, p1, p2, p3)
        sm_m = cuda.shared.array(STAGED_BLOCK_WARPS, float32)
        sm_l = cuda.shared.array(STAGED_BLOCK_WARPS, float32)
        sm_acc = cuda.shared.array((STAGED_BLOCK_WARPS, 256), float32)
        _store_step_partials(m_l, l_l, acc, sm_m, sm_l, sm_acc, partials, r, kvh, split, group_heads, key_warps)

    return kernel(STAGED_SIGNATURE, fastmath=True, max_registers=STAGED_MAX_REGISTERS)(_decode_staged_kernel)


DECODE_STAGED_KERNELS = {quant: _make_decode_staged_kernel(quant) for quant in (False, True)}
STAGED_SHARED_BYTES = {quant: stage_layout(quant)["BYTES"] for quant in (False, True)}


@kernel((f32_4d, f32_2d, i32_1d, f32_2d, uint16[:, ::1], int32, uint16[::1], int32, int32, int32, int32, int32),
        fastmath=True)
def decode_combine_kernel(partials, qkgv, row_pos, out, out_bf16, write_bf16, fragments, write_fragments, heads,
                          kv_heads, head_dim, min_keys):
    """grid (R, Hq), block head_dim: merge the row's own (non-empty) splits in order, normalise, multiply by
    sigmoid(gate); with the flags, also the bf16 copy and the x fragments of the row (even lanes store a column
    pair's word, with the odd lane's value by a shuffle: head_dim is a multiple of 32, so a pair shares a warp)."""
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y
    d = cuda.threadIdx.x
    length = row_pos[r] + 1
    chunk = split_keys(length, partials.shape[2], min_keys)
    total_a, total_l = merge_partials(partials, r, h, d, (length + chunk - 1) // chunk)
    gate = qkgv[r, (heads + kv_heads) * head_dim + h * head_dim + d]
    y = (total_a / total_l) * sigmoid_f32(gate)
    c = h * head_dim + d
    out[r, c] = y
    if write_bf16 != 0 or write_fragments != 0:  # the same for the whole block: every lane shuffles
        word = bf16_pair(y, cuda.shfl_xor_sync(FULL_MASK, y, 1))  # even lanes: the next column
        if d % 2 == 0:
            if write_bf16 != 0:
                store_word_at(address_of(out_bf16) + (int64(r) * int64(out_bf16.shape[1]) + int64(c)) * 2, word)
            if write_fragments != 0:
                store_word_at(address_of(fragments) + int64(fragment_half(int32(r), int32(c)) >> 1) * 4, word)


def attention_decode(q, qkgv, page_tables, row_lane, row_pos, k_pool, v_pool, k_scale, v_scale, out, partials, *,
                     heads, kv_heads, head_dim, stream, min_split_keys=0, out_bf16=None, out_fragments=None,
                     tensor_cores=True):
    """out[r, h*D:(h+1)*D] = softmax(q[r,h].K[0..row_pos[r]] / sqrt(D)) V * sigmoid(gate[r, h]) through the row's
    lane page table. Two launches (a row's keys in up to S = partials.shape[2] splits of `split_keys` keys, at least
    `min_split_keys` each, then combine). `partials` from decode_partials_shape(>= R, heads, head_dim, S); blocks
    past a row's last split exit at once. A row's bits depend on its own data, S and min_split_keys only, so keep
    both for every batch size / graph (batch invariance). head_dim 256 (pages of a multiple of STEP_KEYS tokens):
    the kernel that stages K/V tiles in shared memory, or with `tensor_cores` the tensor-core kernel
    (`attention_decode_mma`, bf16 or INT8 pools: a block serves the rows of one lane together; the choice never
    depends on the rows); other head dims: the split kernel. With `out_bf16` (uint16
    [R, Hq*D]) the combine also writes out's bf16 bits, with `out_fragments` (R <= 8) its tensor-core x fragments
    (`quant_mma.x_fragments` of out): the output projection's input without a conversion launch."""
    _check_dims(heads, kv_heads, head_dim)
    check_min_split_keys(min_split_keys)
    rows = q.shape[0]
    if rows == 0:
        return
    quant, ks, vs = _quant_args(k_pool, v_pool, k_scale, v_scale)
    splits = partials.shape[2]
    check_splits(splits)
    if head_dim == 256 and tensor_cores:
        # (imported here: it imports split_keys and _pool_row from this module)
        from ninfer.kernels_numba.attention_decode_mma import decode_mma

        decode_mma(q, page_tables, row_lane, row_pos, k_pool, v_pool, partials, heads=heads, kv_heads=kv_heads,
                   min_split_keys=min_split_keys, stream=stream, k_scale=k_scale, v_scale=v_scale)
    elif head_dim == 256 and k_pool.shape[1] % STEP_KEYS == 0:
        group = heads // kv_heads
        staged_kernel, shared_bytes = DECODE_STAGED_KERNELS[bool(quant)], STAGED_SHARED_BYTES[bool(quant)]
        allow_dynamic_shared(staged_kernel, STAGED_SIGNATURE, shared_bytes)
        staged_kernel[(splits, kv_heads, rows), 32 * group * staged_key_warps(group), stream, shared_bytes](
            q, page_tables, row_lane, row_pos, k_pool.view(np.uint64), v_pool.view(np.uint64), ks, vs, partials,
            *_i32(heads, kv_heads, min_split_keys))
    else:
        decode_split_kernel[(splits, kv_heads, rows), DECODE_WARPS * 32, stream](
            q, page_tables, row_lane, row_pos, k_pool, v_pool, ks, vs, partials,
            *_i32(heads, kv_heads, head_dim, quant, min_split_keys))
    if out_fragments is not None:
        check_fragment_output(rows, heads * head_dim, out_fragments)
    decode_combine_kernel[(rows, heads), head_dim, stream](partials, qkgv, row_pos, out, *bf16_target(out, out_bf16),
                                                           *fragment_target(out, out_fragments),
                                                           *_i32(heads, kv_heads, head_dim, min_split_keys))


def _gather_kv(page_tables, lane, length, k_pool, v_pool, k_scale, v_scale):
    page_tokens = k_pool.shape[1]
    used = -(-length // page_tokens)
    pages = page_tables[lane, :used]

    def gather(store):
        return store[pages].reshape((used * page_tokens,) + store.shape[2:])[:length]

    if k_pool.dtype == np.int8:
        return (dequantize_int8(gather(k_pool), gather(k_scale).view(np.float16)),
                dequantize_int8(gather(v_pool), gather(v_scale).view(np.float16)))
    return bf16_bits_to_f32(gather(k_pool)), bf16_bits_to_f32(gather(v_pool))


def _gate(qkgv, rows, heads, kv_heads, head_dim):
    start = (heads + kv_heads) * head_dim
    return ops.sigmoid(qkgv[rows, start:start + heads * head_dim])


def attention_decode_reference(q, qkgv, page_tables, row_lane, row_pos, k_pool, v_pool, k_scale, v_scale, out,
                               partials=None, *, heads, kv_heads, head_dim, stream=None,
                               min_split_keys=0, tensor_cores=True):
    """NumPy twin: each row attends causally over its lane's keys 0..row_pos; writes and returns out. (Exact math:
    the kernel choice and the splits change nothing here.)"""
    for r in range(q.shape[0]):
        length = int(row_pos[r]) + 1
        k, v = _gather_kv(page_tables, int(row_lane[r]), length, k_pool, v_pool, k_scale, v_scale)
        att = ops.causal_gqa_attention(q[r:r + 1], k, v, length - 1, 1.0 / np.sqrt(head_dim))
        out[r] = att.reshape(-1) * _gate(qkgv, slice(r, r + 1), heads, kv_heads, head_dim)[0]
    return out


# ---------------------------------------------------------------------------------------------------------------
# 3. prefill: query tiles x one q head, online softmax, K/V tiles in shared memory

PF_Q = 64  # queries per block
PF_K = 64  # keys per tile
PF_D = 32  # head dims per QK^T step
PF_V = 16  # keys per PV step
PF_PAD = 65
PF_THREADS = 256
PF_BUF = 2 * PF_D * PF_PAD
PF_PS = PF_K * PF_PAD


def _prefill_kernel(q, qkgv, page_tables, lane, kv_start, count, k_pool, v_pool, k_scale, v_scale, out,
                    heads, kv_heads, head_dim, quant):
    """grid (ceil(count/64), Hq), block 256 = 16 x 16: thread (ty, tx) owns S rows ty*4+i, cols tx+16j and
    O rows ty*4+i, dims tx+16c (c < D/16)."""
    qt = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    tx = tid % 16
    ty = tid // 16
    group_heads = heads // kv_heads
    kvh = h // group_heads
    page_tokens = k_pool.shape[1]
    qgroup = min(64, head_dim)
    scale = float32(1.0) / math.sqrt(float32(head_dim))
    q0 = qt * PF_Q
    buf = cuda.shared.array(PF_BUF, float32)  # Qs[d][row] | Ks[d][key], or Vs[key][dim]
    ps = cuda.shared.array(PF_PS, float32)  # P[key][row]
    tile_page = cuda.shared.array(PF_K, int32)
    tile_off = cuda.shared.array(PF_K, int32)
    oacc = cuda.local.array(64, float32)  # [4 rows][16 dims] (D <= 256)
    sacc = cuda.local.array(16, float32)  # [4 rows][4 keys]
    m = cuda.local.array(4, float32)
    lsum = cuda.local.array(4, float32)
    alph = cuda.local.array(4, float32)
    qreg = cuda.local.array(8, float32)
    kreg = cuda.local.array(8, float32)
    vreg = cuda.local.array(PF_V, float32)
    ndc = head_dim // 16
    for i in range(4):
        m[i] = float32(NEG_INF)
        lsum[i] = float32(0.0)
    for i in range(64):
        oacc[i] = float32(0.0)
    last_q = min(q0 + PF_Q, count) - 1
    key_end = kv_start + last_q + 1  # keys 0..key_end-1 are visible to some row of the tile
    n_tiles = (key_end + PF_K - 1) // PF_K
    for kt in range(n_tiles):
        k0 = kt * PF_K
        for i in range(16):
            sacc[i] = float32(0.0)
        if tid < PF_K:
            key = min(k0 + tid, key_end - 1)
            tile_page[tid] = page_tables[lane, key // page_tokens]
            tile_off[tid] = key % page_tokens
        cuda.syncthreads()
        for dc in range(0, head_dim, PF_D):
            # stage Q[64 rows][32 dims] and K[64 keys][32 dims], transposed, padded: all loads first, then stores
            d = tid % PF_D
            for it in range(8):
                row = tid // PF_D + it * (PF_THREADS // PF_D)
                qrow = min(q0 + row, count - 1)
                qreg[it] = q[qrow, h, dc + d] * scale
                kreg[it] = load_kv(k_pool, k_scale, tile_page[row], tile_off[row], kvh, dc + d, qgroup, quant)
            for it in range(8):
                row = tid // PF_D + it * (PF_THREADS // PF_D)
                buf[d * PF_PAD + row] = qreg[it]
                buf[PF_D * PF_PAD + d * PF_PAD + row] = kreg[it]
            cuda.syncthreads()
            for d in range(PF_D):
                qa0 = buf[d * PF_PAD + ty * 4]
                qa1 = buf[d * PF_PAD + ty * 4 + 1]
                qa2 = buf[d * PF_PAD + ty * 4 + 2]
                qa3 = buf[d * PF_PAD + ty * 4 + 3]
                for j in range(4):
                    kb = buf[PF_D * PF_PAD + d * PF_PAD + tx + 16 * j]
                    sacc[j] += qa0 * kb
                    sacc[4 + j] += qa1 * kb
                    sacc[8 + j] += qa2 * kb
                    sacc[12 + j] += qa3 * kb
            cuda.syncthreads()
        # online softmax per row (the 16 threads of a half-warp share a row set)
        for i in range(4):
            qpos = kv_start + q0 + ty * 4 + i
            for j in range(4):
                if k0 + tx + 16 * j > qpos:
                    sacc[i * 4 + j] = float32(NEG_INF)
        for i in range(4):
            rmax = max(max(sacc[i * 4], sacc[i * 4 + 1]), max(sacc[i * 4 + 2], sacc[i * 4 + 3]))
            rmax = max(rmax, cuda.shfl_xor_sync(FULL_MASK, rmax, 8))
            rmax = max(rmax, cuda.shfl_xor_sync(FULL_MASK, rmax, 4))
            rmax = max(rmax, cuda.shfl_xor_sync(FULL_MASK, rmax, 2))
            rmax = max(rmax, cuda.shfl_xor_sync(FULL_MASK, rmax, 1))
            m_new = max(m[i], rmax)
            alpha = math.exp(m[i] - m_new)
            m[i] = m_new
            rsum = float32(0.0)
            for j in range(4):
                p = math.exp(sacc[i * 4 + j] - m_new)
                sacc[i * 4 + j] = p
                rsum += p
            rsum += cuda.shfl_xor_sync(FULL_MASK, rsum, 8)
            rsum += cuda.shfl_xor_sync(FULL_MASK, rsum, 4)
            rsum += cuda.shfl_xor_sync(FULL_MASK, rsum, 2)
            rsum += cuda.shfl_xor_sync(FULL_MASK, rsum, 1)
            lsum[i] = lsum[i] * alpha + rsum
            alph[i] = alpha
        for i in range(4):
            for j in range(4):
                ps[(tx + 16 * j) * PF_PAD + ty * 4 + i] = sacc[i * 4 + j]
        for i in range(4):
            for c in range(16):
                oacc[i * 16 + c] *= alph[i]
        # O += P V, V staged PF_V keys at a time
        for vk in range(0, PF_K, PF_V):
            cuda.syncthreads()  # ps written / previous V chunk consumed
            if tid < head_dim:
                for kk in range(PF_V):
                    vreg[kk] = load_kv(v_pool, v_scale, tile_page[vk + kk], tile_off[vk + kk], kvh, tid, qgroup,
                                       quant)
                for kk in range(PF_V):
                    buf[kk * head_dim + tid] = vreg[kk]
            cuda.syncthreads()
            for kk in range(PF_V):
                pbase = (vk + kk) * PF_PAD + ty * 4
                p0 = ps[pbase]
                p1 = ps[pbase + 1]
                p2 = ps[pbase + 2]
                p3 = ps[pbase + 3]
                for c in range(16):
                    if c < ndc:
                        vb = buf[kk * head_dim + tx + 16 * c]
                        oacc[c] += p0 * vb
                        oacc[16 + c] += p1 * vb
                        oacc[32 + c] += p2 * vb
                        oacc[48 + c] += p3 * vb
        cuda.syncthreads()
    gate_col = (heads + kv_heads) * head_dim + h * head_dim
    for i in range(4):
        row = q0 + ty * 4 + i
        if row < count:
            inv_l = float32(1.0) / lsum[i]
            for c in range(16):
                if c < ndc:
                    d = tx + 16 * c
                    out[row, h * head_dim + d] = (oacc[i * 16 + c] * inv_l) * sigmoid_f32(qkgv[row, gate_col + d])


_PREFILL_TAIL = (f32_2d, int32, int32, int32, int32)
prefill_kernel = kernel(
    (f32_3d, f32_2d, i32_2d, int32, int32, int32, u16_4d, u16_4d, u16_4d, u16_4d) + _PREFILL_TAIL,
    (f32_3d, f32_2d, i32_2d, int32, int32, int32, i8_4d, i8_4d, u16_4d, u16_4d) + _PREFILL_TAIL,
    fastmath=True,
)(_prefill_kernel)


def attention_prefill(q, qkgv, page_tables, lane, kv_start, count, k_pool, v_pool, k_scale, v_scale, out, *, heads,
                      kv_heads, head_dim, stream):
    """Rows 0..count-1 of one lane: query i sits at KV index kv_start+i and sees keys 0..kv_start+i (already
    appended by attention_prepare). out[i, h*D:(h+1)*D] = attention * sigmoid(gate). One launch."""
    _check_dims(heads, kv_heads, head_dim)
    if count <= 0:
        return
    quant, ks, vs = _quant_args(k_pool, v_pool, k_scale, v_scale)
    prefill_kernel[(-(-count // PF_Q), heads), PF_THREADS, stream](
        q, qkgv, page_tables, *_i32(lane, kv_start, count), k_pool, v_pool, ks, vs, out,
        *_i32(heads, kv_heads, head_dim, quant))


def attention_prefill_reference(q, qkgv, page_tables, lane, kv_start, count, k_pool, v_pool, k_scale, v_scale, out,
                                *, heads, kv_heads, head_dim, stream=None):
    """NumPy twin: causal attention of `count` queries starting at KV index kv_start; writes and returns out."""
    length = kv_start + count
    k, v = _gather_kv(page_tables, int(lane), length, k_pool, v_pool, k_scale, v_scale)
    att = ops.causal_gqa_attention(q[:count], k, v, kv_start, 1.0 / np.sqrt(head_dim))
    out[:count] = att.reshape(count, -1) * _gate(qkgv, slice(0, count), heads, kv_heads, head_dim)
    return out
