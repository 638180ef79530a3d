"""The gated delta rule in chunks, for prefill (ninfer-facts §3.5 allows it; FLA's chunk_gated_delta_rule is the
reference's). The recurrence (`gdn.gdn_recurrent`) walks a segment's rows one at a time in a few hundred blocks: at
8K rows it costs ~4 ms a layer whatever the GPU does elsewhere. Here a chunk of CHUNK rows is one step of matrix
products on the tensor cores (TF32 operands, fp32 accumulation, the state kept in fp32).

Per chunk of rows 0..n-1 of one v head (q, k already normalised and scaled; G the chunk's cumulative log decay,
E = exp(G), S the state before the chunk):
    A = strict_lower(diag(beta) (K K^T) * exp(G_r - G_s))      T = (I + A)^-1        P = tril((Q K^T) * exp(G_r - G_s))
    U = T diag(beta) (V - diag(E) K S)
    O = diag(E) Q S + P U
    S' = exp(G_last) S + K^T (diag(exp(G_last - G)) U)
which equals the recurrence (S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q) row for row in exact
arithmetic. Every exponent is <= 0 (log decays are <= 0), so nothing overflows.

Two launches (8K rows at the 27B head shapes on the H200, session 23: 0.27 + 0.89 ms a layer, against 4.96 ms
recurrent):
1. `gdn_chunk_prepare_kernel` (segments x chunks x v heads, all in parallel): G (written to `cum`), then K K^T and
   Q K^T on the tensor cores (K and Q staged in shared memory 64 key dims at a time), T by 16-row blocks (each warp
   inverts its diagonal block in registers, then three block rows of 3xTF32 products), and T and P packed into one
   [C, C] matrix per chunk and head: `mats[row a, h, b]` = P[a, b] for b <= a, T[b, a] for b > a.
2. `gdn_chunk_scan_kernel` (segments x v heads x value-column slices of SLICE, 8 warps: 4 16-row tiles of the chunk x
   the slice's two column halves): walks the chunks in order with the slice of S in registers (mma accumulators) and,
   TF32-rounded and transposed, in shared memory as the B operand. The next chunk's K, Q, T / P and V rows are copied
   into (dynamic, > 48 KiB) shared memory with `cp.async` while the current chunk computes: K and T / P double-
   buffered, Q and V as soon as their buffer is read. A block takes an SM to itself and its chunks run one after
   another, so the slice is compiled at 64 and 32 columns and `scan_slice` takes 32 where the 64-column grid would
   fill at most half the SMs (the 35B-A3B's 32 v heads x 2 slices on the H200's 132), else 64 (the 27B's 48 x 2: one
   wave). Every value column's S, U and O come from that column alone through the same products, so both give the
   same bits.

Operands are rounded to TF32 (round to nearest, ties away: `tf32_round`) before each product; the twin
`gdn_chunked_reference` rounds the same values, so kernel and twin differ only in fp32 summation order. Each operand
is rounded once, where it is made: q and k by `gdn.gdn_gates(..., tf32=True)` (so the launcher takes TF32 values;
the twin refuses others), T and P as the prepare kernel writes them, U and the state as the scan stores them. The
scan used to round K, Q, T and P at every use, ~2 instructions an element on its critical path. Against the
fp32 recurrence the TF32 products cost ~1e-3 relative, well inside the bf16 GEMMs' error of the prefill path.

Only segments that do not record per-row states go here (prefill); decode and verify keep the recurrence.
"""

from __future__ import annotations

import functools
import math  # noqa: F401 (templates)

import numpy as np
from llvmlite import ir
from numba import float32, int32, int64, types, uint32, uint64  # noqa: F401 (templates)
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

from ninfer.kernels_numba.async_copy import (copy_async_16, copy_async_commit,  # noqa: F401 (templates)
                                             copy_async_wait_all, shared_address)
from ninfer.kernels_numba.common import (address_of, load_matrix_x4, tf32_round,  # noqa: F401 (templates)
                                         tf32_round_host)
from ninfer.kernels_numba.numba_setup import (COPY_ALIGNMENT, allow_dynamic_shared, cuda,  # noqa: F401
                                             device_function, register_options)  # (COPY_ALIGNMENT, cuda: templates)
from ninfer.kernels_numba.templates import instantiate

F32 = np.float32

CHUNK = 64  # rows per chunk: 4 warps x one 16-row mma tile
THREADS = 128  # prepare: one 16-row tile per warp
PREPARE_PART = 64  # prepare: key dims of K and Q staged in shared memory at a time (two [CHUNK, 68] tiles, 34 KiB)
# the prepare kernel's register cap (`prepare_kernel`): at 96, 5 blocks an SM instead of 4. With K and Q staged
# (session 23, 8K rows, 35B-A3B / 27B): 96 190 / 272 us a layer, 128 200 / 290, 80 (6 blocks) 209 / 284; under 96
# the staging spills 36 bytes (ptxas, sm_90), around its copies only
PREPARE_MAX_REGISTERS = 96
SCAN_THREADS = 256  # scan: 8 warps, (16-row tile, half the slice's columns) each
SLICES = (32, 64)  # value columns per scan block, a compiled variant each (`scan_slice` picks one)
K_DIMS = (16, 32, 64, 128)  # key dims with a compiled variant (the real models: 128)
# [*, SLICE] shared tiles have rows of SP = SLICE + 8 words (72 or 40): the B-fragment reads (word t SP + g) hit 32
# banks (t SP mod 32 = 0, 8, 16, 24) and the rows stay 16-byte aligned for cp.async
SHARED_PAD = 8


# ---- PTX the numba front end does not expose ------------------------------------------------------------------------

@intrinsic
def mma_tf32_m16n8k8(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A . B + C for one warp: A 16x8, B 8x8 (TF32 values held in float32 registers), C/D 16x8 fp32, the PTX
    fragment layouts of `mma.sync.aligned.m16n8k8.row.col` (lane = 4 g + t: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
    a3 (g + 8, t + 4); b0 (k t, n g), b1 (k t + 4, n g); c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t),
    c3 (g + 8, 2t + 1))."""
    signature = types.UniTuple(types.float32, 4)(*(types.float32,) * 10)

    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        operands = [builder.bitcast(a, i32) for a in args[:6]] + list(args[6:])
        function = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
        result = builder.asm(function, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                             "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                             "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", operands, side_effect=False)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)])

    return signature, codegen


@device_function
def mma_tf32x3(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A . B + C (mma m16n8k8 layouts) at about fp32 accuracy from fp32 operands: each split into a TF32 head
    and a TF32 tail (x = head + tail to 2^-22), three TF32 products (tail x head, head x tail, head x head; the tail
    x tail one is below fp32's rounding) into the fp32 accumulators."""
    h0, h1, h2, h3 = tf32_round(a0), tf32_round(a1), tf32_round(a2), tf32_round(a3)
    l0, l1, l2, l3 = tf32_round(a0 - h0), tf32_round(a1 - h1), tf32_round(a2 - h2), tf32_round(a3 - h3)
    bh0, bh1 = tf32_round(b0), tf32_round(b1)
    bl0, bl1 = tf32_round(b0 - bh0), tf32_round(b1 - bh1)
    c0, c1, c2, c3 = mma_tf32_m16n8k8(l0, l1, l2, l3, bh0, bh1, c0, c1, c2, c3)
    c0, c1, c2, c3 = mma_tf32_m16n8k8(h0, h1, h2, h3, bl0, bl1, c0, c1, c2, c3)
    return mma_tf32_m16n8k8(h0, h1, h2, h3, bh0, bh1, c0, c1, c2, c3)


@device_function
def word_float(word):
    """A float32 held as its bits (a word that ldmatrix brought), as float32: K, Q and the state arrive
    TF32-rounded, so their words are mma operands as they are."""
    return libdevice.int_as_float(int32(word))


# ---- 1. prepare: G, T and P per chunk and v head ------------------------------------------------------------------

_PREPARE_SIG = (float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], float32[:, ::1], int32[::1], int32[::1],
                float32[:, ::1], float32[:, :, ::1], int32, int32)

_PREPARE_SOURCE = """
def gdn_chunk_prepare_kernel_dk{k_dim}(q, k, log_decay, beta, seg_row, seg_count, cum, mats, qk_heads, v_heads):
    # work: a part of the chunk's K and Q rows ([CHUNK, {pp}] each, TF32 values), then A / T as [CHUNK, AP] and a
    # block row's R [16, RS]
    work = cuda.shared.array({work}, float32, alignment=COPY_ALIGNMENT)  # cp.async writes 16-byte pieces
    g_sh = cuda.shared.array(CHUNK, float32)
    b_sh = cuda.shared.array(CHUNK, float32)
    kk = cuda.local.array(32, float32)
    qk = cuda.local.array(32, float32)
    dcol = cuda.local.array(16, float32)  # a column of this warp's diagonal block of T

    seg = cuda.blockIdx.x
    first = cuda.blockIdx.y * CHUNK
    h = cuda.blockIdx.z
    count = seg_count[seg]
    if first >= count:
        return
    n = min(CHUNK, count - first)
    base = seg_row[seg] + first
    hq = h // (v_heads // qk_heads)
    uh = uint64(h)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    g = lane >> 2
    t = lane & 3

    if tid < CHUNK:
        decay = float32(0.0)
        bt = float32(0.0)
        if tid < n:
            decay = log_decay[uint64(base + tid), uh]
            bt = beta[uint64(base + tid), uh]
        g_sh[uint64(tid)] = decay
        b_sh[uint64(tid)] = bt
    cuda.syncthreads()
    if tid == 0:  # the cumulative log decay, in row order (past n it stays at G[n - 1])
        total = float32(0.0)
        for r in range(CHUNK):
            total += g_sh[uint64(r)]
            g_sh[uint64(r)] = total
    cuda.syncthreads()
    if tid < n:
        cum[uint64(base + tid), uh] = g_sh[uint64(tid)]

    # K K^T and Q K^T, rows 16 warp .. 16 warp + 15, the column tiles at or left of the diagonal, over the key dims
    # in parts of {part}: each part's K and Q columns of the chunk's rows are copied into work first ([CHUNK, {pp}]
    # each; rows past n arrive as zeros), all of a part's 16-byte copies in flight together (session 22's ncu: Q's
    # A fragments, read from global memory a k step at a time, were a quarter of the kernel's stalls)
    r0 = warp * 16 + g
    for e in range(32):
        kk[e] = float32(0.0)
        qk[e] = float32(0.0)
    shared = shared_address(address_of(work))
    pr = tid // {part_pieces}  # this thread's first row and 16-byte piece of a part's rows
    pc = 4 * (tid - pr * {part_pieces})
    row_bytes = int64(qk_heads) * ({k_dim} * 4)  # from one row's K (or Q) head to the next row's
    # the thread's first K piece (Q's: the same offset from q); a row past n copies nothing (from the chunk's row 0).
    # The copy loop's trip count is read from the launch (THREADS) so that it stays rolled: unrolled, its 8 source
    # addresses were computed once for both parts and held across the products, and spilled.
    first_piece = address_of(k) + (int64(base + pr) * qk_heads + hq) * ({k_dim} * 4) + pc * 4
    chunk_start = address_of(k) + (int64(base) * qk_heads + hq) * ({k_dim} * 4) + pc * 4
    q_from_k = address_of(q) - address_of(k)
    passes = CHUNK * {part} // 4 // cuda.blockDim.x
    for part in range({parts}):
        if part > 0:
            cuda.syncthreads()  # the part before is read
        source = first_piece + part * ({part} * 4)
        at = shared + uint32((pr * {pp} + pc) * 4)
        r = pr
        for e in range(passes):
            there = r < n
            size = uint32(16) if there else uint32(0)
            from_k = source if there else chunk_start + part * ({part} * 4)
            copy_async_16(at, from_k, size)
            copy_async_16(at + uint32(CHUNK * {pp} * 4), from_k + q_from_k, size)
            source += {rows_per_pass} * row_bytes
            at += uint32({rows_per_pass} * {pp} * 4)
            r += {rows_per_pass}
        copy_async_commit()
        copy_async_wait_all()
        cuda.syncthreads()
        for ks in range({part_ksteps}):
            c0 = ks * 8 + t
            a_at = uint64(r0 * {pp} + c0)
            a0 = work[a_at]
            a1 = work[a_at + uint64(8 * {pp})]
            a2 = work[a_at + uint64(4)]
            a3 = work[a_at + uint64(8 * {pp} + 4)]
            q_at = a_at + uint64(CHUNK * {pp})
            q0 = work[q_at]
            q1 = work[q_at + uint64(8 * {pp})]
            q2 = work[q_at + uint64(4)]
            q3 = work[q_at + uint64(8 * {pp} + 4)]
            for nt in range(8):
                if nt <= 2 * warp + 1:
                    b0 = work[uint64((nt * 8 + g) * {pp} + c0)]
                    b1 = work[uint64((nt * 8 + g) * {pp} + c0 + 4)]
                    kk[4 * nt], kk[4 * nt + 1], kk[4 * nt + 2], kk[4 * nt + 3] = mma_tf32_m16n8k8(
                        a0, a1, a2, a3, b0, b1, kk[4 * nt], kk[4 * nt + 1], kk[4 * nt + 2], kk[4 * nt + 3])
                    qk[4 * nt], qk[4 * nt + 1], qk[4 * nt + 2], qk[4 * nt + 3] = mma_tf32_m16n8k8(
                        q0, q1, q2, q3, b0, b1, qk[4 * nt], qk[4 * nt + 1], qk[4 * nt + 2], qk[4 * nt + 3])
    cuda.syncthreads()  # K is read: work becomes A

    for nt in range(8):
        if nt <= 2 * warp + 1:
            for e in range(4):
                r = r0 + 8 * (e >> 1)
                s = nt * 8 + 2 * t + (e & 1)
                if s <= r:
                    decay = math.exp(g_sh[uint64(r)] - g_sh[uint64(s)])
                    if s < r:
                        work[uint64(r * AP + s)] = b_sh[uint64(r)] * kk[4 * nt + e] * decay
                    if r < n:
                        mats[uint64(base + r), uh, uint64(s)] = tf32_round(qk[4 * nt + e] * decay)
    cuda.syncthreads()

    # T = (I + A)^-1 in place, by 16-row blocks. Each warp inverts its diagonal block, D = (I + A_ii)^-1 (lane j < 16
    # holds column j in registers: D[r, j] = [r == j] - sum_(s < r) A[r, s] D[s, j]); then block rows i = 1, 2, 3 in
    # order: R = A_(i, <i) T_(<i, <i), T_(i, <i) = -D_i R, as 3xTF32 mma products (fp32 to ~2^-22: the scalar loops
    # they replace were 60% of the kernel's instructions, session 22's ncu). T's diagonal stays implicit in `work`.
    if lane < 16:
        diagonal = uint64(warp * 16 * AP + warp * 16)
        for r in unrolled(16):
            total = float32(1.0) if r == lane else float32(0.0)
            for s in unrolled(r):
                total -= work[diagonal + uint64(r * AP + s)] * dcol[s]
            dcol[r] = total
        cuda.syncwarp(0xFFFF)
        for r in unrolled(16):
            if r > lane:
                work[diagonal + uint64(r * AP) + uint64(lane)] = dcol[r]
    cuda.syncthreads()
    for i in unrolled(3):
        # block row I = i + 1 on the tensor cores, 8-column n-tiles shared out to the warps (`_BLOCK_ROW_TILE`)
        # R = A_(I, <I) T~_(<I, <I), T~ being T with its unit diagonal and the zeros above it: a tile's k steps left
        # of its diagonal are zero (skipped), the one on it masked
        for j in unrolled(2):
{r_tile}        cuda.syncthreads()
        # T_(I, <I) = -D~_I R (D~: D_I with its unit diagonal and zeros above it), over R's 16 rows: two k steps
        for j in unrolled(2):
{t_tile}        cuda.syncthreads()

    for e in range(CHUNK * CHUNK // THREADS):
        idx = tid + e * THREADS
        a = idx >> 6
        b = idx & (CHUNK - 1)
        if a < n and b > a:
            value = float32(0.0)
            if b < n:
                value = tf32_round(work[uint64(b * AP + a)])
            mats[uint64(base + a), uh, uint64(b)] = value
"""


# One warp's n-tile of a block row's products (template pieces, `i` and `j` literal once unrolled): block row
# I = i + 1 has 2 I tiles of 8 columns; warp w takes tile w, and at I = 3 warps 0-2 take tiles w and 5 - w (each
# tile's R costs its k steps right of the diagonal: 6 + 1, 5 + 2, 4 + 3).
_BLOCK_ROW_TILE = """
            nt = warp if j == 0 else 2 * (i + 1) - 1 - warp
            if (warp < (3 if i == 2 else 2 * (i + 1))) if j == 0 else (i == 2 and warp < 3):
                acc0 = float32(0.0)
                acc1 = float32(0.0)
                acc2 = float32(0.0)
                acc3 = float32(0.0)
{body}"""

_R_TILE_BODY = """
                for ks in range(2 * (i + 1)):
                    if ks >= nt:
                        a_at = uint64((16 * (i + 1) + g) * AP + ks * 8 + t)
                        s0 = ks * 8 + t
                        c = nt * 8 + g
                        b0 = work[uint64(s0 * AP + c)]
                        b1 = work[uint64((s0 + 4) * AP + c)]
                        if ks == nt:  # T~[s, c]: 1 at s == c, 0 above (work holds other values there)
                            b0 = b0 if s0 > c else (float32(1.0) if s0 == c else float32(0.0))
                            b1 = b1 if s0 + 4 > c else (float32(1.0) if s0 + 4 == c else float32(0.0))
                        acc0, acc1, acc2, acc3 = mma_tf32x3(
                            work[a_at], work[a_at + uint64(8 * AP)], work[a_at + uint64(4)],
                            work[a_at + uint64(8 * AP + 4)], b0, b1, acc0, acc1, acc2, acc3)
                r_at = uint64(SCRATCH + g * RS + nt * 8 + 2 * t)
                work[r_at] = acc0
                work[r_at + uint64(1)] = acc1
                work[r_at + uint64(8 * RS)] = acc2
                work[r_at + uint64(8 * RS + 1)] = acc3
"""

_T_TILE_BODY = """
                for ks in unrolled(2):
                    d_at = uint64((16 * (i + 1) + g) * AP + 16 * (i + 1) + ks * 8 + t)
                    b = ks * 8 + t
                    a0 = work[d_at] if b < g else (float32(1.0) if b == g else float32(0.0))
                    a1 = work[d_at + uint64(8 * AP)] if b < g + 8 else (float32(1.0) if b == g + 8 else float32(0.0))
                    a2 = work[d_at + uint64(4)] if b + 4 < g else (float32(1.0) if b + 4 == g else float32(0.0))
                    a3 = work[d_at + uint64(8 * AP + 4)] if b + 4 < g + 8 else (
                        float32(1.0) if b + 4 == g + 8 else float32(0.0))
                    r_at = uint64(SCRATCH + (ks * 8 + t) * RS + nt * 8 + g)
                    acc0, acc1, acc2, acc3 = mma_tf32x3(a0, a1, a2, a3, work[r_at], work[r_at + uint64(4 * RS)],
                                                        acc0, acc1, acc2, acc3)
                t_at = uint64((16 * (i + 1) + g) * AP + nt * 8 + 2 * t)
                work[t_at] = -acc0
                work[t_at + uint64(1)] = -acc1
                work[t_at + uint64(8 * AP)] = -acc2
                work[t_at + uint64(8 * AP + 1)] = -acc3
"""


# ---- 2. scan: the chunks in order, state slice in registers --------------------------------------------------------

_SCAN_SIG = (float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1],
             float32[:, :, ::1], float32[:, :, :, ::1], int32[::1], int32[::1], int32[::1], float32[:, :, ::1], int32,
             int32, int32, int32)

# Copies of a chunk's rows into shared memory (`cp.async`, 16 bytes a piece), each issued as soon as the buffer it
# fills is free; `nxt` is the chunk, `buf` the K / T-P buffer. A full chunk (every row there, and the slice's columns
# all inside v_dim) takes the fast form: a thread's pieces sit a fixed number of rows apart, so each copy is its
# first source address plus a multiple of one per-thread stride (the general form's 64-bit clamps cost ~25
# instructions a copy, a sixth of a chunk's instructions). A chunk's last rows otherwise take the general form:
# rows past the chunk's end arrive as zeros.
_COPY_PIECES = """
            if {full}:
                at = {source} + (int64(nb) * {row_words} + {head_words}) * 4 + {name}_src
                for e in range({pieces}):
                    copy_async_16(shared + uint32(({dst}) * 4) + {name}_dst + uint32(e * {row_step} * {pitch} * 4),
                                  at + e * {name}_stride, uint32(16))
            else:
                for e in range({pieces}):
                    idx = tid + e * SCAN_THREADS
                    r = idx // {row_pieces}
                    p = idx - r * {row_pieces}
                    row = int64(nb + min(r, nn - 1))
                    size = uint32(16) if r < nn{columns_there} else uint32(0)
                    copy_async_16(shared + uint32(({dst} + r * {pitch} + 4 * p) * 4),
                                  {source} + (row * {row_words} + {head_words} + {column}) * 4, size)
"""

_CHUNK_ROWS = """
            nb = start + nxt * CHUNK
            nn = min(CHUNK, count - nxt * CHUNK)
"""

_SCALARS = """
            copy_async_commit()
            if tid < CHUNK:
                p_last = cum[uint64(nb + nn - 1), uh]
                p_cum = cum[uint64(nb + min(tid, nn - 1)), uh]
                p_beta = beta[uint64(nb + min(tid, nn - 1)), uh]
"""


def _copies(k_dim: int) -> dict[str, str]:
    """The scan's copy blocks (template pieces, formatted): K with T / P (and the chunk's scalars), Q, V. The fast
    form's per-thread offsets `{name}_src`, `{name}_dst` and `{name}_stride` are set before the chunk loop."""
    kp, k_pieces = k_dim + 4, CHUNK * k_dim // 4 // SCAN_THREADS

    def rows(name, source, dst, full="nn == CHUNK", columns_there="", column="4 * p", **layout):
        return _COPY_PIECES.format(name=name, source=source, dst=dst, full=full, columns_there=columns_there,
                                   column=column, **layout).lstrip("\n")

    k_layout = dict(row_words=f"qk_heads * {k_dim}", head_words=f"hq * {k_dim}", pieces=k_pieces,
                    row_pieces=k_dim // 4, row_step="K_ROW_STEP", pitch=kp)
    chunk_rows = _CHUNK_ROWS.lstrip("\n")
    return dict(
        copy_km=chunk_rows + rows("k", "k_at", "buf * K_SIZE", **k_layout) + rows(
            "m", "mats_at", "M_OFF + buf * M_SIZE", row_words="v_heads * CHUNK", head_words="h * CHUNK",
            pieces="M_PIECES", row_pieces="M_ROW_PIECES", row_step="M_ROW_STEP", pitch="MP") + _SCALARS.lstrip("\n"),
        copy_q=chunk_rows + rows("k", "q_at", "Q_OFF", **k_layout) + "            copy_async_commit()\n",
        copy_v=chunk_rows + rows("v", "mixed_at", "Y_OFF", full="nn == CHUNK and v_left >= SLICE",
                                 columns_there=" and 4 * p < v_left", column="min(4 * p, v_left - 4)",
                                 row_words="channels", head_words="v_base", pieces="V_PIECES",
                                 row_pieces="V_ROW_PIECES", row_step="V_ROW_STEP", pitch="SP")
        + "            copy_async_commit()\n")


# One k step of the state products K S and Q S (`ks` an expression of kk), accumulating into the named arrays. S is
# held transposed ([SLICE, kp]: a value column's key dims in a row), so one ldmatrix brings the B fragments of two
# n-tiles (b0 and b1 of each), as it brings K's and Q's A fragments (session 22's ncu: this step waited most on the
# shared-memory pipe, two 4-byte loads a fragment).
_STATE_STEP = """
            w0, w1, w2, w3 = load_matrix_x4(ka + uint32(({ks}) * 32))
            a0, a1, a2, a3 = word_float(w0), word_float(w1), word_float(w2), word_float(w3)
            w0, w1, w2, w3 = load_matrix_x4(qa + uint32(({ks}) * 32))
            q0, q1, q2, q3 = word_float(w0), word_float(w1), word_float(w2), word_float(w3)
            for pair in unrolled({pairs}):
                # S^T rows n0 + 16 pair ..: n-tiles 2 pair, 2 pair + 1
                s0, s1, s2, s3 = load_matrix_x4(sb + uint32(pair * 16 * {kp} * 4 + ({ks}) * 32))
                for half in unrolled(2):
                    nt = 2 * pair + half
                    b0 = word_float(s0 if half == 0 else s2)
                    b1 = word_float(s1 if half == 0 else s3)
                    {acc}[4 * nt], {acc}[4 * nt + 1], {acc}[4 * nt + 2], {acc}[4 * nt + 3] = mma_tf32_m16n8k8(
                        a0, a1, a2, a3, b0, b1, {acc}[4 * nt], {acc}[4 * nt + 1], {acc}[4 * nt + 2],
                        {acc}[4 * nt + 3])
                    {acc_o}[4 * nt], {acc_o}[4 * nt + 1], {acc_o}[4 * nt + 2], {acc_o}[4 * nt + 3] = (
                        mma_tf32_m16n8k8(q0, q1, q2, q3, b0, b1, {acc_o}[4 * nt], {acc_o}[4 * nt + 1],
                                         {acc_o}[4 * nt + 2], {acc_o}[4 * nt + 3]))
"""

# U = T Y (T[r, s] = mats[s, r], unit diagonal) and O += P U (P[r, s] = mats[r, s], s <= r) walk the k steps at or
# left of a warp's diagonal 16-row tile. Left of it every (r, s) of the fragment has s < r: the loads need no mask
# (session 22: the masks on every k step were most of those steps' instructions, and the last row tile's warps, with
# four k-step pairs, set the pace of each phase). On it, T's entries on or past the diagonal are the unit diagonal
# and zeros, P's past it zeros (the packed matrix holds the other factor there).
_T_LOADS = """
                ks = {ks}
                a0 = sh[ta + uint64(ks * 8 * MP)]
                a1 = sh[ta + uint64(ks * 8 * MP + 8)]
                a2 = sh[ta + uint64((ks * 8 + 4) * MP)]
                a3 = sh[ta + uint64((ks * 8 + 4) * MP + 8)]
"""

_T_LOADS_DIAGONAL = """
                ks = {ks}
                s0 = ks * 8 + t
                a0 = sh[ta + uint64(ks * 8 * MP)] if s0 < r0 else (float32(1.0) if s0 == r0 else float32(0.0))
                a1 = sh[ta + uint64(ks * 8 * MP + 8)] if s0 < r0 + 8 else (
                    float32(1.0) if s0 == r0 + 8 else float32(0.0))
                a2 = sh[ta + uint64((ks * 8 + 4) * MP)] if s0 + 4 < r0 else (
                    float32(1.0) if s0 + 4 == r0 else float32(0.0))
                a3 = sh[ta + uint64((ks * 8 + 4) * MP + 8)] if s0 + 4 < r0 + 8 else (
                    float32(1.0) if s0 + 4 == r0 + 8 else float32(0.0))
"""

_P_LOADS = """
                ks = {ks}
                a0 = sh[pa + uint64(ks * 8)]
                a1 = sh[pa + uint64(ks * 8 + 8 * MP)]
                a2 = sh[pa + uint64(ks * 8 + 4)]
                a3 = sh[pa + uint64(ks * 8 + 8 * MP + 4)]
"""

_P_LOADS_DIAGONAL = """
                ks = {ks}
                s0 = ks * 8 + t
                a0 = sh[pa + uint64(ks * 8)] if s0 <= r0 else float32(0.0)
                a1 = sh[pa + uint64(ks * 8 + 8 * MP)] if s0 <= r0 + 8 else float32(0.0)
                a2 = sh[pa + uint64(ks * 8 + 4)] if s0 + 4 <= r0 else float32(0.0)
                a3 = sh[pa + uint64(ks * 8 + 8 * MP + 4)] if s0 + 4 <= r0 + 8 else float32(0.0)
"""

# the products of one of those k steps, with B from the [*, SP] block at {b_off} (Y for U, U for O)
_TRIANGLE_PRODUCTS = """
                for nt in range({ntiles}):
                    b0 = sh[col_frag + uint64({b_off} + ks * 8 * SP + nt * 8)]
                    b1 = sh[col_frag + uint64({b_off} + (ks * 8 + 4) * SP + nt * 8)]
                    {acc}[4 * nt], {acc}[4 * nt + 1], {acc}[4 * nt + 2], {acc}[4 * nt + 3] = mma_tf32_m16n8k8(
                        a0, a1, a2, a3, b0, b1, {acc}[4 * nt], {acc}[4 * nt + 1], {acc}[4 * nt + 2], {acc}[4 * nt + 3])
"""


def _steps(ntiles: int, kp: int) -> dict[str, str]:
    """The scan's k-step bodies, even and odd, for `ntiles` n-tiles a warp (template pieces, already formatted):
    the state products, and U = T Y and O += P U left of (`_left`) and on the warp's diagonal tile."""
    pieces = {}
    for parity, ks, acc, acc_o in (("even", "2 * kk", "acc", "acc_o"), ("odd", "2 * kk + 1", "acc2", "acc_o2")):
        pieces[f"state_step_{parity}"] = _STATE_STEP.format(ks=ks, acc=acc, acc_o=acc_o, pairs=ntiles // 2,
                                                             kp=kp).lstrip("\n")
        t_products = _TRIANGLE_PRODUCTS.format(b_off="Y_OFF", acc=acc, ntiles=ntiles)
        p_products = _TRIANGLE_PRODUCTS.format(b_off="U_OFF", acc="acc_o" if parity == "even" else "acc2",
                                               ntiles=ntiles)
        for name, loads, products in (("t", _T_LOADS, t_products), ("p", _P_LOADS, p_products)):
            diagonal = _T_LOADS_DIAGONAL if name == "t" else _P_LOADS_DIAGONAL
            pieces[f"{name}_step_{parity}_left"] = (loads.format(ks=ks) + products).lstrip("\n")
            pieces[f"{name}_step_{parity}"] = (diagonal.format(ks=ks) + products).lstrip("\n")
    return pieces


_SCAN_SOURCE = """
def gdn_chunk_scan_kernel_dk{k_dim}_s{slice}(q, k, mixed, beta, cum, mats, ssm_state, seg_lane, seg_row, seg_count,
                                          out, qk_heads, v_heads, v_dim, channels_qk):
    # One dynamic shared array (past the 48 KiB static limit), laid out as: K chunk rows [CHUNK, {kp}] twice (this
    # chunk's and the next one's), Q rows [CHUNK, {kp}], the packed T / P [CHUNK, MP] twice, V then Y [CHUNK, SP],
    # the state slice transposed [SLICE, {kp}] (TF32), U and diag(exp(G_last - G)) U [CHUNK, SP] (the second the
    # state update's B operand, scaled once a chunk instead of K at each of its uses), and exp(G), exp(G_last - G),
    # beta [CHUNK] each. K, Q and T / P arrive TF32-rounded and are operands as loaded. Shared indices are unsigned
    # (numba adds negative-index arithmetic to signed ones) and built from per-thread bases plus literal offsets,
    # which fold into the load instructions once the k-step loops are written out.
    sh = cuda.shared.array(0, float32)
    sacc = cuda.local.array({sacc}, float32)  # this warp's state tiles (mma C layout), fp32
    # two accumulators a product (even and odd k steps): two dependent mma chains of half the length (the scan waited
    # on each mma's result before the next; ncu's top stall)
    acc = cuda.local.array({tile}, float32)
    acc_o = cuda.local.array({tile}, float32)
    acc2 = cuda.local.array({tile}, float32)
    acc_o2 = cuda.local.array({tile}, float32)
    p_last = float32(0.0)
    p_cum = float32(0.0)
    p_beta = float32(0.0)

    seg = cuda.blockIdx.x
    h = cuda.blockIdx.y
    col0 = cuda.blockIdx.z * SLICE
    slot = uint64(seg_lane[seg])
    start = seg_row[seg]
    count = seg_count[seg]
    hq = h // (v_heads // qk_heads)
    uh = uint64(h)
    v_base = channels_qk + h * v_dim + col0
    v_left = v_dim - col0  # columns of this slice that exist (a multiple of 4)
    channels = mixed.shape[1]
    shared = shared_address(address_of(sh))
    k_at = address_of(k)
    q_at = address_of(q)
    mats_at = address_of(mats)
    mixed_at = address_of(mixed)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    g = lane >> 2
    t = lane & 3
    mw = warp & 3  # the warp's 16-row tile of the chunk
    n0 = (warp >> 2) * {warp_cols}  # and its half of the slice's columns ({ntiles} mma n-tiles)
    r0 = mw * 16 + g
    # this lane's ldmatrix row of a [CHUNK, {kp}] row block's A fragments (bytes): matrices 0-3 are rows 0-7 / 8-15
    # of the warp's tile x words 0-3 / 4-7 of the k step, which lands a0..a3 of mma m16n8k8's TF32 layout
    row_matrix = uint32(((mw * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * {kp} + 4 * (lane >> 4)) * 4)
    # and its ldmatrix row of S^T for the B fragments of n-tiles 2p, 2p + 1 (matrices: n-tile 2p k 0-3 / 4-7, n-tile
    # 2p + 1 k 0-3 / 4-7 of the k step)
    sb = shared + uint32((S_OFF + (n0 + 8 * (lane >> 4) + (lane & 7)) * {kp} + 4 * ((lane >> 3) & 1)) * 4)
    col_frag = uint64(t * SP + n0 + g)  # B fragment (t, n0 + g) of a [*, SP] block
    t_frag = uint64(t * MP + r0)  # T[r0, t] = mats[t, r0]
    p_frag = uint64(r0 * MP + t)  # P[r0, t]
    c_frag = uint64(r0 * SP + n0 + 2 * t)  # C fragment (r0, n0 + 2t) of a [*, SP] block
    # the fast copies' per-thread pieces (first row, 16-byte piece of it) of K / Q, T / P and V rows: byte offsets
    # from the chunk's first row in global memory and from the tile in shared memory, and the global stride between
    # a thread's consecutive pieces
    kr = tid // {k_row_pieces}
    k_src = int64(kr * qk_heads * {k_dim} + 4 * (tid - kr * {k_row_pieces})) * 4
    k_dst = uint32((kr * {kp} + 4 * (tid - kr * {k_row_pieces})) * 4)
    k_stride = int64(K_ROW_STEP * qk_heads * {k_dim} * 4)
    mr = tid // M_ROW_PIECES
    m_src = int64(mr * v_heads * CHUNK + 4 * (tid - mr * M_ROW_PIECES)) * 4
    m_dst = uint32((mr * MP + 4 * (tid - mr * M_ROW_PIECES)) * 4)
    m_stride = int64(M_ROW_STEP * v_heads * CHUNK * 4)
    vr = tid // V_ROW_PIECES
    v_src = (int64(vr) * channels + 4 * (tid - vr * V_ROW_PIECES)) * 4
    v_dst = uint32((vr * SP + 4 * (tid - vr * V_ROW_PIECES)) * 4)
    v_stride = int64(V_ROW_STEP) * channels * 4

    for e in range({k_dim} * SLICE // SCAN_THREADS):
        idx = tid + e * SCAN_THREADS
        i = idx // SLICE
        c = idx - i * SLICE
        value = float32(0.0)
        if c < v_left:
            value = ssm_state[slot, uh, uint64(i), uint64(col0 + c)]
        sh[uint64(S_OFF + c * {kp} + i)] = value
    cuda.syncthreads()
    for jj in unrolled({sj}):
        mt = mw + 4 * jj
        if mt < {mtiles}:
            for nt in range({ntiles}):
                for e in range(4):
                    sacc[{tile} * jj + 4 * nt + e] = sh[uint64(S_OFF + (n0 + nt * 8 + 2 * t + (e & 1)) * {kp}
                                                               + mt * 16 + g + 8 * (e >> 1))]
    cuda.syncthreads()
    for e in range({k_dim} * SLICE // SCAN_THREADS):
        at = uint64(S_OFF + (tid + e * SCAN_THREADS) % SLICE * {kp} + (tid + e * SCAN_THREADS) // SLICE)
        sh[at] = tf32_round(sh[at])

    chunks = (count + CHUNK - 1) // CHUNK
    for chunk in range(chunks):
        base = start + chunk * CHUNK
        n = min(CHUNK, count - chunk * CHUNK)
        cur = chunk & 1
        k_off = uint64(cur * K_SIZE)
        m_off = uint64(M_OFF + cur * M_SIZE)
        if chunk == 0:  # later chunks' rows were copied while the chunk before them computed
            nxt = 0
            buf = 0
{copy_km}{copy_q}{copy_v}
        copy_async_wait_all()
        if tid < CHUNK:
            sh[uint64(E_OFF + tid)] = math.exp(p_cum if tid < n else p_last)
            sh[uint64(W_OFF + tid)] = math.exp(p_last - p_cum) if tid < n else float32(0.0)
            sh[uint64(B_OFF + tid)] = p_beta if tid < n else float32(0.0)
        cuda.syncthreads()
        if chunk + 1 < chunks:
            nxt = chunk + 1
            buf = 1 - cur
{copy_km}
        # X = K S and Q S; Y = diag(beta) (V - diag(E) X), in place of V
        for e in range({tile}):
            acc[e] = float32(0.0)
            acc_o[e] = float32(0.0)
            acc2[e] = float32(0.0)
            acc_o2[e] = float32(0.0)
        ka = shared + uint32(k_off * 4) + row_matrix  # the K and Q A fragments by ldmatrix, 4 words an instruction
        qa = shared + uint32(Q_OFF * 4) + row_matrix
        for kk in range({ksteps} // 2):  # even k steps into acc / acc_o, odd ones into acc2 / acc_o2
{state_step_even}{state_step_odd}        for e in range({tile}):
            acc[e] += acc2[e]
            acc_o[e] += acc_o2[e]
        for nt in range({ntiles}):
            for e in range(4):
                r = uint64(r0 + 8 * (e >> 1))
                at = c_frag + uint64(Y_OFF + 8 * (e >> 1) * SP + nt * 8 + (e & 1))
                sh[at] = tf32_round(sh[uint64(B_OFF) + r] * (sh[at] - sh[uint64(E_OFF) + r] * acc[4 * nt + e]))
        cuda.syncthreads()
        if chunk + 1 < chunks:
{copy_q}
        # U = T Y (T unit lower triangular, T[r, s] = mats[s, r]: the column tiles at or left of the diagonal)
        for e in range({tile}):
            acc[e] = float32(0.0)
            acc2[e] = float32(0.0)
        ta = m_off + t_frag
        for kk in range({chunk_ksteps} // 2):
            if kk < mw:  # k steps left of the diagonal tile, then on it; even into acc, odd into acc2
{t_step_even_left}{t_step_odd_left}            elif kk == mw:
{t_step_even}{t_step_odd}        for e in range({tile}):
            acc[e] += acc2[e]
        for nt in range({ntiles}):
            for e in range(4):
                u = tf32_round(acc[4 * nt + e])
                sh[c_frag + uint64(U_OFF + 8 * (e >> 1) * SP + nt * 8 + (e & 1))] = u
                sh[c_frag + uint64(UW_OFF + 8 * (e >> 1) * SP + nt * 8 + (e & 1))] = tf32_round(
                    sh[uint64(W_OFF + r0 + 8 * (e >> 1))] * u)
        cuda.syncthreads()
        if chunk + 1 < chunks:
{copy_v}
        # O = diag(E) Q S + P U (P[r, s] = mats[r, s], s <= r)
        for nt in range({ntiles}):
            for e in range(4):
                acc_o[4 * nt + e] *= sh[uint64(E_OFF + r0 + 8 * (e >> 1))]
        for e in range({tile}):
            acc2[e] = float32(0.0)
        pa = m_off + p_frag
        for kk in range({chunk_ksteps} // 2):
            if kk < mw:  # even k steps into acc_o, odd into acc2
{p_step_even_left}{p_step_odd_left}            elif kk == mw:
{p_step_even}{p_step_odd}        for e in range({tile}):
            acc_o[e] += acc2[e]
        for nt in range({ntiles}):
            for e in range(4):
                r = r0 + 8 * (e >> 1)
                c = n0 + nt * 8 + 2 * t + (e & 1)
                if r < n and c < v_left:
                    out[uint64(base + r), uh, uint64(col0 + c)] = acc_o[4 * nt + e]

        # S = exp(G_last) S + K^T (diag(exp(G_last - G)) U), into the registers; shared S is still read above
        decay = sh[uint64(E_OFF + CHUNK - 1)]
        for jj in unrolled({sj}):
            mt = mw + 4 * jj
            if mt < {mtiles}:
                kt = k_off + uint64(t * {kp} + mt * 16 + g)  # K[t, m]: the transposed A fragment
                for e in range({tile}):
                    sacc[{tile} * jj + e] *= decay
                for ks in range({chunk_ksteps}):
                    a0 = sh[kt + uint64(ks * 8 * {kp})]
                    a1 = sh[kt + uint64(ks * 8 * {kp} + 8)]
                    a2 = sh[kt + uint64((ks * 8 + 4) * {kp})]
                    a3 = sh[kt + uint64((ks * 8 + 4) * {kp} + 8)]
                    for nt in range({ntiles}):
                        b0 = sh[col_frag + uint64(UW_OFF + ks * 8 * SP + nt * 8)]
                        b1 = sh[col_frag + uint64(UW_OFF + (ks * 8 + 4) * SP + nt * 8)]
                        x = {tile} * jj + 4 * nt
                        sacc[x], sacc[x + 1], sacc[x + 2], sacc[x + 3] = mma_tf32_m16n8k8(
                            a0, a1, a2, a3, b0, b1, sacc[x], sacc[x + 1], sacc[x + 2], sacc[x + 3])
        cuda.syncthreads()  # every read of this chunk's shared rows and S is done
        for jj in unrolled({sj}):
            mt = mw + 4 * jj
            if mt < {mtiles}:
                for nt in range({ntiles}):
                    for e in range(4):
                        sh[uint64(S_OFF + (n0 + nt * 8 + 2 * t + (e & 1)) * {kp} + mt * 16 + g + 8 * (e >> 1))] = (
                            tf32_round(sacc[{tile} * jj + 4 * nt + e]))

    for jj in unrolled({sj}):
        mt = mw + 4 * jj
        if mt < {mtiles}:
            for nt in range({ntiles}):
                for e in range(4):
                    c = n0 + nt * 8 + 2 * t + (e & 1)
                    if c < v_left:
                        ssm_state[slot, uh, uint64(mt * 16 + g + 8 * (e >> 1)), uint64(col0 + c)] = sacc[
                            {tile} * jj + 4 * nt + e]
"""


AP = CHUNK + 1  # A / T rows in shared memory: the forward substitution's column reads hit distinct banks
RS = 3 * 16 + 1  # rows of a block row's R = A_(i, <i) T_(<i, <i) (up to 48 columns)
SCRATCH = CHUNK * AP  # R's offset in the prepare kernel's shared memory
MP = CHUNK + 4  # packed T / P rows in the scan's shared memory: row and column fragment reads hit 32 banks
M_ROW_PIECES = CHUNK // 4  # 16-byte pieces of a packed T / P row
M_PIECES = CHUNK * M_ROW_PIECES // SCAN_THREADS  # T / P pieces per scan thread and chunk
M_ROW_STEP = SCAN_THREADS // M_ROW_PIECES  # rows between a scan thread's T / P pieces


def scan_slice(blocks_at_64: int, multiprocessors: int) -> int:
    """The scan's value columns per block (SLICES) for a launch of `blocks_at_64` blocks at 64 columns on a GPU of
    `multiprocessors` SMs. A scan block walks its chunks one after another and takes an SM to itself (~224 KiB of
    shared memory at 64 columns, ~184 KiB at 32), so a grid smaller than the GPU leaves SMs idle for the whole scan:
    the 35B-A3B's 8K prefill (32 v heads x 2 slices = 64 blocks) ran on half the H200's 132 SMs, 1.2 ms a layer (128
    chunks at ~9.4 us). 32 columns double the blocks with the same chunk loop and half the products each; past half
    the SMs (the 27B's 48 x 2 = 96 blocks) the doubled grid would take a second wave."""
    return 32 if 2 * blocks_at_64 <= multiprocessors else 64


def _scan_layout(k_dim: int, columns: int, sp: int) -> dict[str, int]:
    """Word offsets of the scan's dynamic shared array (see its source) for slices of `columns` value columns and
    [*, SLICE] rows of `sp` words, and its size in bytes."""
    kp = k_dim + 4
    sizes = dict(K_OFF=2 * CHUNK * kp, Q_OFF=CHUNK * kp, M_OFF=2 * CHUNK * MP, Y_OFF=CHUNK * sp, S_OFF=columns * kp,
                 U_OFF=CHUNK * sp, UW_OFF=CHUNK * sp, E_OFF=CHUNK, W_OFF=CHUNK, B_OFF=CHUNK)
    layout, words = {}, 0
    for name, size in sizes.items():
        layout[name] = words
        words += size
    layout.update(K_SIZE=CHUNK * kp, M_SIZE=CHUNK * MP, SCAN_SHARED_BYTES=4 * words)
    return layout


def _sizes(k_dim: int) -> dict:
    """Both kernels' template sizes for `k_dim`."""
    kp = k_dim + 4  # K rows in shared memory: the A- and B-fragment reads hit distinct banks (16-byte aligned rows)
    mtiles = k_dim // 16
    part = min(k_dim, PREPARE_PART)  # the prepare kernel's key dims a copy of K and Q rows
    pp = part + 4  # their rows in work: fragment reads hit distinct banks, rows stay 16-byte aligned
    sizes = dict(k_dim=k_dim, kp=kp, work=max(2 * CHUNK * pp, SCRATCH + 16 * RS), part=part, parts=k_dim // part,
                 pp=pp, part_pieces=part // 4, rows_per_pass=THREADS * 4 // part,
                 part_ksteps=part // 8, k_row_pieces=k_dim // 4, ksteps=k_dim // 8, chunk_ksteps=CHUNK // 8,
                 mtiles=mtiles, sj=(mtiles + 3) // 4)
    sizes.update(_copies(k_dim))
    sizes.update(r_tile=_BLOCK_ROW_TILE.format(body=_R_TILE_BODY.lstrip("\n")).lstrip("\n"),
                 t_tile=_BLOCK_ROW_TILE.format(body=_T_TILE_BODY.lstrip("\n")).lstrip("\n"))
    return sizes


@functools.cache
def prepare_kernel(k_dim: int, max_registers: int | None = None):
    """The prepare kernel for `k_dim`, compiled with at most `max_registers` registers a thread (None: as ptxas
    chooses: 111 with K and Q staged, 4 blocks an SM); a cap is the way to more blocks (the same arithmetic, so the
    same bits)."""
    return instantiate(_PREPARE_SOURCE, f"gdn_chunk_prepare_kernel_dk{k_dim}", _PREPARE_SIG, globals(),
                       _sizes(k_dim), options=register_options(max_registers))


def _make_kernels(k_dim: int):
    """{slice: (scan kernel, its dynamic shared bytes)} for each of SLICES, for `k_dim`."""
    sizes = _sizes(k_dim)
    scans = {}
    for columns in SLICES:
        ntiles = columns // 16  # a warp's mma n-tiles: half the slice's columns, 8 each
        variant = dict(sizes, slice=columns, warp_cols=columns // 2, ntiles=ntiles, tile=4 * ntiles,
                       sacc=4 * ntiles * sizes["sj"], **_steps(ntiles, sizes["kp"]))
        sp = columns + SHARED_PAD
        constants = dict(_scan_layout(k_dim, columns, sp), SLICE=columns, SP=sp, V_ROW_PIECES=columns // 4,
                         V_PIECES=CHUNK * columns // 4 // SCAN_THREADS, V_ROW_STEP=SCAN_THREADS * 4 // columns,
                         K_ROW_STEP=SCAN_THREADS * 4 // k_dim)
        scan = instantiate(_SCAN_SOURCE, f"gdn_chunk_scan_kernel_dk{k_dim}_s{columns}", _SCAN_SIG, globals(),
                           variant, constants)
        scans[columns] = scan, constants["SCAN_SHARED_BYTES"]
    return scans


# both kernels registered at import (CI compiles every registered kernel to PTX); other caps only where asked for
_SCANS = {dk: _make_kernels(dk) for dk in K_DIMS}
for _k_dim in K_DIMS:
    prepare_kernel(_k_dim, PREPARE_MAX_REGISTERS)


def gdn_chunk_prepare(q, k, log_decay, beta, seg_row, seg_count, cum, mats, *, rows, qk_heads, v_heads, k_dim,
                      stream, max_registers=PREPARE_MAX_REGISTERS):
    """The chunked rule's first launch (`gdn_chunked` runs it before the scan): G into `cum`, the packed T / P into
    `mats`, for every chunk of every segment. `max_registers` picks `prepare_kernel`'s register cap."""
    segments = seg_row.shape[0]
    if segments == 0 or rows == 0:
        return
    prepare_kernel(k_dim, max_registers)[(segments, (rows + CHUNK - 1) // CHUNK, v_heads), THREADS, stream](
        q, k, log_decay, beta, seg_row, seg_count, cum, mats, np.int32(qk_heads), np.int32(v_heads))


def gdn_chunked(q, k, mixed, log_decay, beta, ssm_state, seg_lane, seg_row, seg_count, out, cum, mats, *, rows,
                qk_heads, v_heads, k_dim, v_dim, channels_qk, multiprocessors, stream):
    """`gdn.gdn_recurrent` for segments that do not record per-row states, in chunks of CHUNK rows (module
    docstring). `rows` bounds every segment's count; `cum` [>= rows, Hv] and `mats` [>= rows, Hv, CHUNK] are
    workspace (G and the packed T / P of each chunk, TF32-rounded). q and k must hold TF32 values
    (`gdn.gdn_gates(..., tf32=True)`): the tensor cores would truncate others. k_dim must be 16, 32, 64 or 128.
    `multiprocessors`: the GPU's SM count, which picks the scan's slice (`scan_slice`; the results are the same bits
    either way)."""
    if k_dim not in _SCANS:
        raise ValueError(f"gdn_chunked has no variant for k_dim={k_dim}")
    if v_dim % 4 or channels_qk % 4 or mixed.shape[1] % 4:
        raise ValueError("gdn_chunked copies 16-byte pieces: v_dim, channels_qk and mixed's row length must be "
                         f"multiples of 4 (got {v_dim}, {channels_qk}, {mixed.shape[1]})")
    segments = seg_lane.shape[0]
    if segments == 0 or rows == 0:
        return
    scans = _SCANS[k_dim]
    columns = scan_slice(segments * v_heads * ((v_dim + 63) // 64), multiprocessors)
    scan, shared_bytes = scans[columns]
    allow_dynamic_shared(scan, _SCAN_SIG, shared_bytes)
    gdn_chunk_prepare(q, k, log_decay, beta, seg_row, seg_count, cum, mats, rows=rows, qk_heads=qk_heads,
                      v_heads=v_heads, k_dim=k_dim, stream=stream)
    scan[(segments, v_heads, (v_dim + columns - 1) // columns), SCAN_THREADS, stream, shared_bytes](
        q, k, mixed, beta, cum, mats, ssm_state, seg_lane, seg_row, seg_count, out, np.int32(qk_heads),
        np.int32(v_heads), np.int32(v_dim), np.int32(channels_qk))


# ---- NumPy twin ------------------------------------------------------------------------------------------------------

def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An mma product: TF32 operands (already rounded), exact products, fp32 result."""
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(F32)


def _prepare_chunk(k: np.ndarray, q: np.ndarray, log_decay: np.ndarray, beta: np.ndarray):
    """G, T and P of one chunk of one head, as `gdn_chunk_prepare_kernel` forms them (k and q: TF32 values)."""
    n = len(k)
    cum = np.cumsum(log_decay.astype(F32), dtype=F32)
    on_or_below = np.tril(np.ones((n, n), bool))
    decay = np.exp(np.where(on_or_below, cum[:, None] - cum[None, :], F32(0))).astype(F32)
    below = np.tril(on_or_below, -1)
    a = np.where(below, beta.astype(F32)[:, None] * _product(k, k.T) * decay, F32(0)).astype(F32)
    p = np.where(on_or_below, _product(q, k.T) * decay, F32(0)).astype(F32)
    inverse = np.eye(n, dtype=F32)
    for r in range(1, n):  # T[r, :r] = -A[r, :r] T[:r, :r] (T unit lower triangular)
        inverse[r, :r] = -(a[r, :r] @ inverse[:r, :r])
    return cum, inverse, p


def gdn_chunked_reference(q, k, mixed, log_decay, beta, ssm_state, seg_lane, seg_row, seg_count, out, cum, mats, *,
                          rows, qk_heads, v_heads, k_dim, v_dim, channels_qk):
    """The twin of `gdn_chunked`: the same chunk formulas with the same TF32-rounded operands (`mats` receives the
    packed T / P, `cum` the cumulative log decay). q and k must hold TF32 values in the segments' rows, as the
    kernels require (rows outside every segment, a padded prefill chunk's padding, are not read)."""
    read = [row for first, count in zip(np.asarray(seg_row).tolist(), np.asarray(seg_count).tolist())
            for row in range(first, first + count)]
    for name, values in (("q", q[read]), ("k", k[read])):
        if not np.array_equal(tf32_round_host(values), values):
            raise ValueError(f"gdn_chunked takes TF32 values of {name} (gdn_gates(..., tf32=True) makes them)")
    repeat = v_heads // qk_heads
    for s in range(len(seg_lane)):
        lane, start, count = int(seg_lane[s]), int(seg_row[s]), int(seg_count[s])
        for h in range(v_heads):
            hq = h // repeat
            state = ssm_state[lane, h].astype(F32)
            for first in range(0, count, CHUNK):
                n = min(CHUNK, count - first)
                rs = slice(start + first, start + first + n)
                kc, qc = k[rs, hq].astype(F32), q[rs, hq].astype(F32)
                v = mixed[rs, channels_qk + h * v_dim:channels_qk + (h + 1) * v_dim].astype(F32)
                b = beta[rs, h].astype(F32)
                g, inverse, p = _prepare_chunk(kc, qc, log_decay[rs, h], b)
                cum[rs, h] = g
                packed = np.zeros((n, CHUNK), F32)  # columns past n: T entries of padding rows, zero
                packed[:, :n] = tf32_round_host(np.where(np.triu(np.ones((n, n), bool), 1), inverse.T, p))
                mats[rs, h] = packed
                e = np.exp(g).astype(F32)
                w = np.exp(g[-1] - g).astype(F32)
                st = tf32_round_host(state)
                y = tf32_round_host(b[:, None] * (v - e[:, None] * _product(kc, st)))
                u = tf32_round_host(_product(tf32_round_host(inverse), y))
                out[rs, h] = e[:, None] * _product(qc, st) + _product(tf32_round_host(p), u)
                u_scaled = tf32_round_host(w[:, None] * u)
                state = (np.exp(g[-1]).astype(F32) * state + _product(kc.T, u_scaled)).astype(F32)
            ssm_state[lane, h] = state
