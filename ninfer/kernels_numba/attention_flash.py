"""Prefill attention in one kernel (flash attention on the bf16 tensor cores), with the output gate applied.

The cuBLAS path (`attention_gemm`) writes every score to memory, reads it back for the softmax, and writes the
probabilities again: at 8K tokens that traffic, not the FLOPs, is most of its time (27B: ~200 ms of a 0.97 s prefill).
Here a block keeps BR queries of one query head in shared memory and walks the visible keys in tiles of BC: scores,
an online softmax and P V stay on chip (FlashAttention-2's schedule), and only the gated output is written.

Per query head h = b * group + g (KV head b) and query i (position first_position + i), keys j <= first_position + i:
    out[i, h*D : (h+1)*D] = (sum_j softmax_j(q_i . k_j) v_j) * sigmoid(gate[i, h])
with q the packed bf16 queries (`pack_queries`: scale folded in), k and v bf16 (`gather_kv`; v transposed, so the
P V operand pairs are contiguous). Scores and the softmax are fp32; P is rounded to bf16 for the P V product (as the
cuBLAS path rounds its probabilities), with the running max and sum kept in fp32. The twin `flash_prefill_reference`
walks the same tiles with the same roundings, so kernel and twin differ only in fp32 summation order and the last
bits of exp (the kernel's `ex2.approx` of x log2 e).

Layout: 4 warps, warp w owns query rows 16w..16w+15 of the block (mma m16n8k16: lane 4 gq + t holds rows gq and
gq + 8). Shared memory (dynamic) holds the Q tile [BR, D] and the K tile [BC, D] as bf16 pair words with rows of
D/2 + WORD_PAD words, and the V^T tile [D, BC] with rows of BC/2 + WORD_PAD words: the 8 rows an `ldmatrix` phase
reads fall in distinct banks. Tiles arrive by `cp.async` (rows past the keys or queries arrive as zeros and are
masked).

Instructions, not the tensor cores, bound a loop like this one (2 blocks of 4 warps an SM): at ~10 instructions an
mma (32-bit fragment loads with 64-bit shared indices, the mask on every tile, software bf16 rounding, a rolled copy
loop dividing its index) the kernel ran at ~128 TFLOP/s on the H200's 8K prefill. So fragments come by `ldmatrix`
(Q's A fragment and two n-tiles of K or V^T an instruction), P is packed by `cvt.rn.bf16x2`, only tiles that reach
past the block's first query or the keys' end are masked, the O rescale is skipped when no row's max moved, and each
thread's tile copies are one piece of every n-th row from addresses set once: ~5 instructions an mma. A 128-row
variant (8 warps, one block an SM, half the tile copies) gave the same bits and ran 15% slower (H200, session 21).
Session 23 (35B-A3B shape, 8K rows): 2616 us; the heaviest query tiles first and ex2 weights, 2315; the epilogue's
gate loads in flight together instead of one latency each, 1886 (292 TFLOP/s).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, int64, uint16, uint32, uint64  # noqa: F401 (templates)
from numba.cuda import libdevice  # noqa: F401 (templates)

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.backends.cpu import ops
from ninfer.kernels_numba.async_copy import (copy_async_16, copy_async_commit,  # noqa: F401 (templates)
                                             copy_async_wait_prior, shared_address)
from ninfer.kernels_numba.common import (FULL_MASK, LOG2E, address_of, bf16_pair, bf16_target,  # noqa: F401
                                         exp2_approx, load_matrix_x4, pack_bf16x2, quad_softmax_step, quad_sum,
                                         sigmoid_f32, store_words2_at)  # (templates)
from ninfer.kernels_numba.linear import load4, store4  # noqa: F401 (templates)
from ninfer.kernels_numba.numba_setup import allow_dynamic_shared, cuda  # noqa: F401 (cuda: templates)
from ninfer.kernels_numba.templates import instantiate
from ninfer.kernels_numba.quant_mma import mma_bf16_m16n8k16  # noqa: F401 (templates)

F32 = np.float32

BR = 64  # queries per block: 4 warps x 16 rows
BC = 64  # keys per tile
FLASH_THREADS = 128
GATE_BATCH = 8  # the epilogue's 16-byte gate loads in flight a thread
WORD_PAD = 4
HEAD_DIMS = (64, 128, 256)  # head dims with a compiled variant (Qwen3.6: 256)

_SIG = (uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, :, ::1], float32[:, ::1], float32[:, ::1], int32,
        uint16[:, ::1], int32, int32, int32, int32, int32)

_SOURCE = """
def flash_prefill_kernel_d{d}(packed, keys, values_t, qkgv, out, write_f32, out_bf16, write_bf16, rows,
                              first_position, length, group):
    sh = cuda.shared.array(0, uint32)
    o = cuda.local.array({o_regs}, float32)  # O rows gq, gq + 8 of the warp's 16, mma C layout over D / 8 n-tiles
    s = cuda.local.array(32, float32)  # scores, then P, of the key tile: 8 n-tiles

    # heaviest first: the blocks launch in index order, x fastest, so every head's last query tile (the most keys)
    # starts in the first wave and the grid ends on the short first tiles, not on a tail of long ones
    g = cuda.blockIdx.x
    b = cuda.blockIdx.y
    tile = cuda.gridDim.z - 1 - cuda.blockIdx.z
    kv_heads = keys.shape[0]
    heads = kv_heads * group
    h = b * group + g
    i0 = tile * BR
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    gq = lane >> 2
    t = lane & 3
    r_lo = warp * 16 + gq
    r_hi = r_lo + 8
    shared = shared_address(address_of(sh))
    packed_at = address_of(packed)
    keys_at = address_of(keys)
    values_at = address_of(values_t)
    packed_rows = int64(packed.shape[1])
    key_rows = int64(keys.shape[1])
    stride_v = int64(values_t.shape[2])
    # A thread's tile copies (`_K_TILE`, `_V_TILE`): the same 16-byte piece of every {k_rows_per_pass}th K row and
    # of every {v_dims_per_pass}th V^T row, so its addresses are set once and each copy adds a constant.
    k_r0 = tid // {row_pieces}
    k_dst = shared + uint32((K_OFF + k_r0 * QW + 4 * (tid % {row_pieces})) * 4)
    k_src = keys_at + (b * key_rows * {d} + 8 * (tid % {row_pieces})) * 2
    v_p = tid % (BC // 8)
    v_dst = shared + uint32((V_OFF + (tid // (BC // 8)) * VW + 4 * v_p) * 4)
    v_src = values_at + (b * {d} + tid // (BC // 8)) * stride_v * 2
    v_pass_bytes = stride_v * (2 * {v_dims_per_pass})
    last_query = min(i0 + BR, rows) - 1
    key_end = min(first_position + last_query + 1, length)
    tiles = (key_end + BC - 1) // BC

    for e in range(BR * {row_pieces} // FLASH_THREADS):  # the Q tile
        idx = tid + e * FLASH_THREADS
        r = idx // {row_pieces}
        p = idx - r * {row_pieces}
        row = int64(g * rows + min(i0 + r, rows - 1))
        size = uint32(16) if i0 + r < rows else uint32(0)
        copy_async_16(shared + uint32((Q_OFF + r * QW + 4 * p) * 4),
                      packed_at + ((b * packed_rows + row) * {d} + 8 * p) * 2, size)
    copy_async_commit()

    for e in unrolled({o_regs}):
        o[e] = float32(0.0)
    m_lo = float32(-math.inf)
    m_hi = float32(-math.inf)
    l_lo = float32(0.0)
    l_hi = float32(0.0)
    # ldmatrix row addresses (bytes): lane l gives row l % 8 of matrix l // 8. For Q (the A fragments) matrices are
    # rows 0-7 / 8-15 x columns 0-7 / 8-15 of the warp's k-step; for K and V^T (B fragments of n-tiles 2p, 2p + 1)
    # rows are the n-tile's keys (dims) and the two 16-byte halves of the k-step.
    m_row = (lane & 7) + ((lane >> 4) << 3)
    m_half = ((lane >> 3) & 1) << 2
    q_lds = shared + uint32(4 * (Q_OFF + (warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * QW + ((lane >> 4) << 2)))
    k_lds = shared + uint32(4 * (K_OFF + m_row * QW + m_half))
    v_lds = shared + uint32(4 * (V_OFF + m_row * VW + m_half))
    pos_lo = first_position + i0 + r_lo
    pos_hi = first_position + i0 + r_hi

    # K and V of a tile arrive one copy group each, a stage apart: K(t + 1) loads during tile t's softmax and P V,
    # V(t + 1) during tile t + 1's scores. Groups in commit order: Q, K(0), V(0), then K(t + 1) and V(t + 1) in tile t
    # (empty past the last tile), so "all but the newest group landed" is always the operand about to be read.
    # (Issuing K(t + 1) behind the barrier before P V instead, three barriers a tile, ran 5% slower: session 23.)
{k_first}    copy_async_commit()
{v_first}    copy_async_commit()
    for kt in range(tiles):
        j0 = kt * BC
        copy_async_wait_prior()  # K(kt) (and Q) landed; V(kt) may be in flight
        cuda.syncthreads()

        # S = Q K^T over the tile's 8 key n-tiles
        for e in unrolled(32):
            s[e] = float32(0.0)
        for ks in range({d} // 16):
            a0, a1, a2, a3 = load_matrix_x4(q_lds + uint32(32 * ks))
            for pn in unrolled(4):
                b0, b1, c0, c1 = load_matrix_x4(k_lds + uint32(pn * 64 * QW + 32 * ks))
                s[8 * pn], s[8 * pn + 1], s[8 * pn + 2], s[8 * pn + 3] = mma_bf16_m16n8k16(
                    a0, a1, a2, a3, b0, b1, s[8 * pn], s[8 * pn + 1], s[8 * pn + 2], s[8 * pn + 3])
                s[8 * pn + 4], s[8 * pn + 5], s[8 * pn + 6], s[8 * pn + 7] = mma_bf16_m16n8k16(
                    a0, a1, a2, a3, c0, c1, s[8 * pn + 4], s[8 * pn + 5], s[8 * pn + 6], s[8 * pn + 7])

        cuda.syncthreads()  # every warp has read K(kt): its buffer takes K(kt + 1)
        if kt + 1 < tiles:
{k_next}        copy_async_commit()

        # mask (only a tile that reaches past the block's first query or the keys' end), then the online softmax
        # of rows lo and hi (a row's 4 lanes meet by shuffles)
        if j0 + BC - 1 > first_position + i0 or j0 + BC > length:
            for nt in unrolled(8):
                for e in unrolled(4):
                    j = j0 + nt * 8 + 2 * t + (e & 1)
                    if j > (pos_lo if e < 2 else pos_hi) or j >= length:
                        s[4 * nt + e] = float32(-math.inf)
        # each row's maximum as a tree (depth 4, not a chain of 16: the chain's FMNMX were the top stalls after the
        # epilogue's, session 23); max is exact, so the order changes no bit
        top_lo = max(max(max(s[0], s[1]), max(s[4], s[5])), max(max(s[8], s[9]), max(s[12], s[13])))
        top_lo = max(top_lo, max(max(max(s[16], s[17]), max(s[20], s[21])), max(max(s[24], s[25]), max(s[28], s[29]))))
        top_hi = max(max(max(s[2], s[3]), max(s[6], s[7])), max(max(s[10], s[11]), max(s[14], s[15])))
        top_hi = max(top_hi, max(max(max(s[18], s[19]), max(s[22], s[23])), max(max(s[26], s[27]), max(s[30], s[31]))))
        # a row with no visible key yet keeps m = -inf: nothing to rescale, and its P is all zeros. e^x = 2^(x log2 e):
        # one fma and one ex2 a weight
        new_lo, new_hi, keep_lo, keep_hi, base_lo, base_hi = quad_softmax_step(top_lo, top_hi, m_lo, m_hi)
        sum_lo = float32(0.0)
        sum_hi = float32(0.0)
        for nt in unrolled(8):
            for e in unrolled(4):
                if e < 2:
                    s[4 * nt + e] = exp2_approx(s[4 * nt + e] * LOG2E - base_lo)
                    sum_lo += s[4 * nt + e]
                else:
                    s[4 * nt + e] = exp2_approx(s[4 * nt + e] * LOG2E - base_hi)
                    sum_hi += s[4 * nt + e]
        l_lo = l_lo * keep_lo + quad_sum(sum_lo)
        l_hi = l_hi * keep_hi + quad_sum(sum_hi)
        m_lo = new_lo
        m_hi = new_hi
        if keep_lo != float32(1.0) or keep_hi != float32(1.0):  # the max moved (a warp skips it when no row's did)
            for nt in unrolled({n_tiles}):
                o[4 * nt] *= keep_lo
                o[4 * nt + 1] *= keep_lo
                o[4 * nt + 2] *= keep_hi
                o[4 * nt + 3] *= keep_hi

        # O += P V: P from the score registers (two key n-tiles make one k-step), V^T pairs from shared
        copy_async_wait_prior()  # V(kt) landed; K(kt + 1) may be in flight
        cuda.syncthreads()
        for kk in unrolled(4):
            a0 = pack_bf16x2(s[8 * kk], s[8 * kk + 1])
            a1 = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
            a2 = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
            a3 = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
            for pn in unrolled({n_pairs}):
                b0, b1, c0, c1 = load_matrix_x4(v_lds + uint32(pn * 64 * VW + 32 * kk))
                o[8 * pn], o[8 * pn + 1], o[8 * pn + 2], o[8 * pn + 3] = mma_bf16_m16n8k16(
                    a0, a1, a2, a3, b0, b1, o[8 * pn], o[8 * pn + 1], o[8 * pn + 2], o[8 * pn + 3])
                o[8 * pn + 4], o[8 * pn + 5], o[8 * pn + 6], o[8 * pn + 7] = mma_bf16_m16n8k16(
                    a0, a1, a2, a3, c0, c1, o[8 * pn + 4], o[8 * pn + 5], o[8 * pn + 6], o[8 * pn + 7])
        cuda.syncthreads()  # every warp has read V(kt): its buffer takes V(kt + 1)
        if kt + 1 < tiles:
{v_next}        copy_async_commit()

    # O / l through shared memory (the tiles are read), then gated and written 16 bytes a thread, coalesced. The
    # gate loads go out GATE_BATCH at a time before any is used: one at a time, each waited out its global latency
    # (a fifth of the kernel's stall samples, session 23's ncu). Rows past `rows` load row rows - 1, unused.
    inverse_lo = float32(1.0) / l_lo
    inverse_hi = float32(1.0) / l_hi
    cuda.syncthreads()
    o_lo = uint64(r_lo * OW + 2 * t)
    o_hi = uint64(r_hi * OW + 2 * t)
    for nt in unrolled({n_tiles}):
        sh[o_lo + uint64(nt * 8)] = uint32(libdevice.float_as_int(o[4 * nt] * inverse_lo))
        sh[o_lo + uint64(nt * 8 + 1)] = uint32(libdevice.float_as_int(o[4 * nt + 1] * inverse_lo))
        sh[o_hi + uint64(nt * 8)] = uint32(libdevice.float_as_int(o[4 * nt + 2] * inverse_hi))
        sh[o_hi + uint64(nt * 8 + 1)] = uint32(libdevice.float_as_int(o[4 * nt + 3] * inverse_hi))
    cuda.syncthreads()
    gates = cuda.local.array({gate_words}, float32)
    gate_at = int64((heads + kv_heads) * {d} + h * {d})
    gate_stride = int64(qkgv.shape[1])
    out_stride = int64(out.shape[1])
    bf16_base = address_of(out_bf16)
    bf16_stride = int64(out_bf16.shape[1])
    valid = min(BR, rows - i0)
    for batch in range({gate_passes}):
        for e in unrolled({gate_batch}):
            idx = tid + FLASH_THREADS * (batch * GATE_BATCH + e)
            r = idx // ({d} // 4)
            gates[4 * e], gates[4 * e + 1], gates[4 * e + 2], gates[4 * e + 3] = load4(
                qkgv, int64(i0 + min(r, valid - 1)) * gate_stride + gate_at + 4 * (idx - r * ({d} // 4)))
        for e in unrolled({gate_batch}):
            idx = tid + FLASH_THREADS * (batch * GATE_BATCH + e)
            r = idx // ({d} // 4)
            dim = 4 * (idx - r * ({d} // 4))
            if r < valid:
                w0, w1, w2, w3 = load4(sh, r * OW + dim)
                y0 = libdevice.int_as_float(int32(w0)) * sigmoid_f32(gates[4 * e])
                y1 = libdevice.int_as_float(int32(w1)) * sigmoid_f32(gates[4 * e + 1])
                y2 = libdevice.int_as_float(int32(w2)) * sigmoid_f32(gates[4 * e + 2])
                y3 = libdevice.int_as_float(int32(w3)) * sigmoid_f32(gates[4 * e + 3])
                if write_f32 != 0:
                    store4(out, int64(i0 + r) * out_stride + h * {d} + dim, y0, y1, y2, y3)
                if write_bf16 != 0:
                    store_words2_at(bf16_base + (int64(i0 + r) * bf16_stride + h * {d} + dim) * 2,
                                    bf16_pair(y0, y1), bf16_pair(y2, y3))
"""


# The copies of one K tile [BC, D] (keys {first}..) and one V^T tile [D, BC], as template lines (`_tile_loads`).
_K_TILE = """
k_row = {first} + k_r0
for e in unrolled({k_passes}):
    copy_async_16(k_dst + uint32(e * {k_rows_per_pass} * QW * 4),
                  k_src + int64(min(k_row + {k_rows_per_pass} * e, length - 1)) * ({d} * 2),
                  uint32(16) if k_row + {k_rows_per_pass} * e < length else uint32(0))
"""
_V_TILE = """
v_j = {first} + 8 * v_p
v_size = uint32(min(max(length - v_j, 0), 8) * 2)
v_at = v_src + int64(v_j if v_j < length else 0) * 2
for e in unrolled({v_passes}):
    copy_async_16(v_dst + uint32(e * {v_dims_per_pass} * VW * 4), v_at + e * v_pass_bytes, v_size)
"""


def _tile_loads(template: str, first: str, indent: int, sizes: dict[str, int]) -> str:
    """`template`'s lines for the tile whose first key is the expression `first`, indented `indent` spaces."""
    lines = template.format(first=first, **sizes).strip("\n").splitlines()
    return "".join(" " * indent + line + "\n" for line in lines)


def _layout(d: int) -> dict[str, int]:
    qw, vw = d // 2 + WORD_PAD, BC // 2 + WORD_PAD
    words = (BR + BC) * qw + d * vw
    # the epilogue's O rows [BR, OW] (fp32 bits) reuse the tiles' space; OW = D + 4 keeps its rows 16-byte aligned
    # for the vector reads
    assert BR * (d + 4) <= words
    return dict(QW=qw, VW=vw, OW=d + 4, Q_OFF=0, K_OFF=BR * qw, V_OFF=(BR + BC) * qw, SHARED_BYTES=4 * words)


def _make_kernel(d: int):
    row_pieces = d // 8  # 16-byte pieces of a K row
    sizes = dict(d=d, o_regs=d // 2, n_tiles=d // 8, n_pairs=d // 16, row_pieces=row_pieces,
                 gate_passes=BR * d // (4 * FLASH_THREADS * GATE_BATCH), gate_batch=GATE_BATCH,
                 gate_words=4 * GATE_BATCH,
                 k_rows_per_pass=FLASH_THREADS // row_pieces, k_passes=BC * row_pieces // FLASH_THREADS,
                 v_dims_per_pass=FLASH_THREADS // (BC // 8), v_passes=d * (BC // 8) // FLASH_THREADS)
    sizes.update(k_first=_tile_loads(_K_TILE, "0", 4, sizes), v_first=_tile_loads(_V_TILE, "0", 4, sizes),
                 k_next=_tile_loads(_K_TILE, "j0 + BC", 12, sizes), v_next=_tile_loads(_V_TILE, "j0 + BC", 12, sizes))
    layout = _layout(d)
    return instantiate(_SOURCE, f"flash_prefill_kernel_d{d}", _SIG, globals(), sizes, layout), layout["SHARED_BYTES"]


_KERNELS = {d: _make_kernel(d) for d in HEAD_DIMS}


def flash_prefill(packed, keys, values_t, qkgv, out, *, rows: int, first_position: int, length: int, group: int,
                  stream, out_bf16=None) -> None:
    """Gated causal attention of `rows` queries (positions first_position..) over keys 0..length-1, into out fp32
    [>= rows, Hq * D] (rows 0..rows-1 written). packed: uint16 [Hkv, group * rows', D] from `pack_queries` (query i of
    head g at row g * rows + i); keys: uint16 [Hkv, >= length, D]; values_t: uint16 [Hkv, D, stride >= length]
    (`gather_kv(..., transposed=True)`; stride a multiple of 8); qkgv: the attention projection (gate columns).
    With `out_bf16` (uint16 [>= rows, Hq * D]) also the bf16 bits of the same values; `out` None then writes those
    alone (the output projection's cuBLAS input: no fp32 rows and no conversion launch)."""
    kv_heads, _, d = keys.shape
    if d not in _KERNELS:
        raise ValueError(f"flash_prefill has no variant for head_dim={d}")
    if out is None and out_bf16 is None:
        raise ValueError("flash_prefill needs an fp32 out, a bf16 out or both")
    if values_t.shape[2] % 8:
        raise ValueError(f"values_t rows must be a multiple of 8 keys long (16-byte copies), got {values_t.shape[2]}")
    if rows == 0:
        return
    function, shared_bytes = _KERNELS[d]
    allow_dynamic_shared(function, _SIG, shared_bytes)
    written = qkgv if out is None else out  # the projection stands in for an fp32 out not asked for (never written)
    function[(group, kv_heads, (rows + BR - 1) // BR), FLASH_THREADS, stream, shared_bytes](
        packed, keys, values_t, qkgv, written, np.int32(out is not None), *bf16_target(written, out_bf16),
        np.int32(rows), np.int32(first_position), np.int32(length), np.int32(group))


def flash_prefill_reference(packed, keys, values_t, qkgv, out, *, rows: int, first_position: int, length: int,
                            group: int) -> np.ndarray:
    """The twin: the same query blocks and key tiles, the same online softmax, P rounded to bf16 for P V."""
    kv_heads, _, d = keys.shape
    heads = kv_heads * group
    for b in range(kv_heads):
        k_all = bf16_bits_to_f32(keys[b, :length]).astype(np.float64)
        v_all = bf16_bits_to_f32(values_t[b, :, :length]).T.astype(np.float64)  # [length, D]
        for g in range(group):
            h = b * group + g
            q_all = bf16_bits_to_f32(packed[b, g * rows:(g + 1) * rows]).astype(np.float64)
            gate = qkgv[:rows, (heads + kv_heads) * d + h * d:(heads + kv_heads) * d + (h + 1) * d]
            for i0 in range(0, rows, BR):
                q = q_all[i0:i0 + BR]
                n = len(q)
                positions = first_position + i0 + np.arange(n)
                key_end = min(int(positions[-1]) + 1, length)
                m = np.full(n, -np.inf, F32)
                total = np.zeros(n, F32)
                o = np.zeros((n, d), F32)
                for j0 in range(0, key_end, BC):
                    j = j0 + np.arange(BC)
                    k = np.zeros((BC, d))
                    v = np.zeros((BC, d))
                    k[: min(BC, length - j0)] = k_all[j0:j0 + BC]
                    v[: min(BC, length - j0)] = v_all[j0:j0 + BC]
                    scores = (q @ k.T).astype(F32)
                    scores[(j[None, :] > positions[:, None]) | (j[None, :] >= length)] = -np.inf
                    new = np.maximum(m, scores.max(axis=1))
                    seen = new != -np.inf
                    keep = np.where(seen, np.exp(m - np.where(seen, new, 0)), 1).astype(F32)
                    p = np.exp(scores - np.where(seen, new, 0)[:, None]).astype(F32)
                    total = (total * keep + p.sum(axis=1, dtype=F32)).astype(F32)
                    p_bf16 = bf16_bits_to_f32(f32_to_bf16_bits(p)).astype(np.float64)
                    o = (o * keep[:, None] + (p_bf16 @ v).astype(F32)).astype(F32)
                    m = new
                out[i0:i0 + n, h * d:(h + 1) * d] = o / total[:, None] * ops.sigmoid(gate[i0:i0 + n])
    return out


def flash_prefill_bf16_reference(packed, keys, values_t, qkgv, out_bf16, **kwargs) -> np.ndarray:
    """The twin of `flash_prefill(out=None, out_bf16=...)`: the fp32 twin's rows as bf16 bits."""
    rows = kwargs["rows"]
    values = flash_prefill_reference(packed, keys, values_t, qkgv, np.zeros((rows, out_bf16.shape[1]), F32),
                                     **kwargs)
    out_bf16[:rows] = f32_to_bf16_bits(values)
    return out_bf16
