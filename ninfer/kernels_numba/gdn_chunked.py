"""The gated delta rule in chunks, for prefill (ninfer-facts §3.5 allows it; FLA's chunk_gated_delta_rule is the
reference's). The recurrence (`gdn.gdn_recurrent`) walks a segment's rows one at a time in a few hundred blocks: at
8K rows it costs ~4 ms a layer whatever the GPU does elsewhere. Here a chunk of CHUNK rows is one step of matrix
products on the tensor cores (TF32 operands, fp32 accumulation, the state kept in fp32).

Per chunk of rows 0..n-1 of one v head (q, k already normalised and scaled; G the chunk's cumulative log decay,
E = exp(G), S the state before the chunk):
    A = strict_lower(diag(beta) (K K^T) * exp(G_r - G_s))      T = (I + A)^-1        P = tril((Q K^T) * exp(G_r - G_s))
    U = T diag(beta) (V - diag(E) K S)
    O = diag(E) Q S + P U
    S' = exp(G_last) S + (diag(exp(G_last - G)) K)^T U
which equals the recurrence (S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q) row for row in exact
arithmetic. Every exponent is <= 0 (log decays are <= 0), so nothing overflows.

Two launches:
1. `gdn_chunk_prepare_kernel` (segments x chunks x v heads, all in parallel): G (written to `cum`), then K K^T and
   Q K^T on the tensor cores, the forward substitution for T, and T and P packed into one [C, C] matrix per chunk and
   head: `mats[row a, h, b]` = P[a, b] for b <= a, T[b, a] for b > a.
2. `gdn_chunk_scan_kernel` (segments x v heads x value-column slices of SLICE): walks the chunks in order with the
   slice of S in registers (mma accumulators) and, TF32-rounded, in shared memory as the B operand.

Operands are rounded to TF32 (round to nearest, ties away: `tf32_round`) before each product; the twin
`gdn_chunked_reference` rounds the same values, so kernel and twin differ only in fp32 summation order. Against the
fp32 recurrence the TF32 products cost ~1e-3 relative, well inside the bf16 GEMMs' error of the prefill path.

Only segments that do not record per-row states go here (prefill); decode and verify keep the recurrence.
"""

from __future__ import annotations

import math  # noqa: F401 (templates)
import re

import numpy as np
from llvmlite import ir
from numba import float32, int32, types, uint32, uint64  # noqa: F401 (templates)
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel  # noqa: F401 (cuda: templates)

F32 = np.float32

CHUNK = 64  # rows per chunk: 4 warps x one 16-row mma tile
THREADS = 128
SLICE = 32  # value columns per scan block: 4 mma n-tiles
K_DIMS = (16, 32, 64, 128)  # key dims with a compiled variant (the real models: 128)
SHARED_PAD = 8  # [*, SLICE] shared tiles have rows of SLICE + 8 words: the B-fragment reads hit 32 banks
TF32_HALF = 0x1000
TF32_MASK = 0xFFFFE000


# ---- PTX the numba front end does not expose ------------------------------------------------------------------------

@intrinsic
def mma_tf32_m16n8k8(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A . B + C for one warp: A 16x8, B 8x8 (TF32 values held in float32 registers), C/D 16x8 fp32, the PTX
    fragment layouts of `mma.sync.aligned.m16n8k8.row.col` (lane = 4 g + t: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
    a3 (g + 8, t + 4); b0 (k t, n g), b1 (k t + 4, n g); c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1))."""
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
def tf32_round(value):
    """float32 rounded to TF32 (10 mantissa bits; to nearest, ties away from zero), as a float32."""
    bits = (uint32(libdevice.float_as_int(float32(value))) + uint32(TF32_HALF)) & uint32(TF32_MASK)
    return libdevice.int_as_float(int32(bits))


def tf32_round_host(values: np.ndarray) -> np.ndarray:
    """`tf32_round` on the host: the same bits."""
    bits = np.ascontiguousarray(values, dtype=F32).view(np.uint32)
    return ((bits + np.uint32(TF32_HALF)) & np.uint32(TF32_MASK)).view(F32)


# ---- 1. prepare: G, T and P per chunk and v head ------------------------------------------------------------------

_PREPARE_SIG = (float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], float32[:, ::1], int32[::1], int32[::1],
                float32[:, ::1], float32[:, :, ::1], int32, int32)

_PREPARE_SOURCE = """
def gdn_chunk_prepare_kernel_dk{k_dim}(q, k, log_decay, beta, seg_row, seg_count, cum, mats, qk_heads, v_heads):
    # work: the chunk's K rows [CHUNK, {kp}] (TF32), then A / T as [CHUNK, CHUNK + 1]
    work = cuda.shared.array({work}, float32)
    g_sh = cuda.shared.array(CHUNK, float32)
    b_sh = cuda.shared.array(CHUNK, float32)
    red = cuda.shared.array(THREADS, float32)
    kk = cuda.local.array(32, float32)
    qk = cuda.local.array(32, float32)

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
    uhq = uint64(hq)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    g = lane >> 2
    t = lane & 3

    for e in range({k_loads}):
        idx = tid + e * THREADS
        r = idx // {k_dim}
        i = idx - r * {k_dim}
        value = float32(0.0)
        if r < n:
            value = k[uint64(base + r), uhq, uint64(i)]
        work[r * {kp} + i] = tf32_round(value)
    if tid < CHUNK:
        decay = float32(0.0)
        bt = float32(0.0)
        if tid < n:
            decay = log_decay[uint64(base + tid), uh]
            bt = beta[uint64(base + tid), uh]
        g_sh[tid] = decay
        b_sh[tid] = bt
    cuda.syncthreads()
    if tid == 0:  # the cumulative log decay, in row order (past n it stays at G[n - 1])
        total = float32(0.0)
        for r in range(CHUNK):
            total += g_sh[r]
            g_sh[r] = total
    cuda.syncthreads()
    if tid < n:
        cum[uint64(base + tid), uh] = g_sh[tid]

    # K K^T and Q K^T, rows 16 warp .. 16 warp + 15, the column tiles at or left of the diagonal
    r0 = warp * 16 + g
    for e in range(32):
        kk[e] = float32(0.0)
        qk[e] = float32(0.0)
    for ks in range({ksteps}):
        c0 = ks * 8 + t
        a0 = work[r0 * {kp} + c0]
        a1 = work[(r0 + 8) * {kp} + c0]
        a2 = work[r0 * {kp} + c0 + 4]
        a3 = work[(r0 + 8) * {kp} + c0 + 4]
        q0 = float32(0.0)
        q1 = float32(0.0)
        q2 = float32(0.0)
        q3 = float32(0.0)
        if r0 < n:
            q0 = tf32_round(q[uint64(base + r0), uhq, uint64(c0)])
            q2 = tf32_round(q[uint64(base + r0), uhq, uint64(c0 + 4)])
        if r0 + 8 < n:
            q1 = tf32_round(q[uint64(base + r0 + 8), uhq, uint64(c0)])
            q3 = tf32_round(q[uint64(base + r0 + 8), uhq, uint64(c0 + 4)])
        for nt in range(8):
            if nt <= 2 * warp + 1:
                b0 = work[(nt * 8 + g) * {kp} + c0]
                b1 = work[(nt * 8 + g) * {kp} + c0 + 4]
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
                    decay = math.exp(g_sh[r] - g_sh[s])
                    if s < r:
                        work[r * AP + s] = b_sh[r] * kk[4 * nt + e] * decay
                    if r < n:
                        mats[uint64(base + r), uh, uint64(s)] = qk[4 * nt + e] * decay
    cuda.syncthreads()

    # T = (I + A)^-1 in place, row by row: T[r, j] = -(A[r, j] + sum_(j < s < r) A[r, s] T[s, j]); two partial sums
    col = tid & (CHUNK - 1)
    part = tid >> 6
    for r in range(1, n):
        total = float32(0.0)
        if col < r:
            if part == 0:
                total = work[r * AP + col]
            s = col + 1 + part
            while s < r:
                total += work[r * AP + s] * work[s * AP + col]
                s += 2
        red[tid] = total
        cuda.syncthreads()
        if part == 0 and col < r:
            work[r * AP + col] = -(red[tid] + red[tid + CHUNK])
        cuda.syncthreads()

    for e in range(CHUNK * CHUNK // THREADS):
        idx = tid + e * THREADS
        a = idx >> 6
        b = idx & (CHUNK - 1)
        if a < n and b > a:
            value = float32(0.0)
            if b < n:
                value = work[b * AP + a]
            mats[uint64(base + a), uh, uint64(b)] = value
"""


# ---- 2. scan: the chunks in order, state slice in registers --------------------------------------------------------

_SCAN_SIG = (float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1],
             float32[:, :, ::1], float32[:, :, :, ::1], int32[::1], int32[::1], int32[::1], float32[:, :, ::1], int32,
             int32, int32, int32)

_SCAN_SOURCE = """
def gdn_chunk_scan_kernel_dk{k_dim}(q, k, mixed, beta, cum, mats, ssm_state, seg_lane, seg_row, seg_count, out,
                                   qk_heads, v_heads, v_dim, channels_qk):
    s_sh = cuda.shared.array({s_words}, float32)  # the state slice [Dk, SLICE], TF32
    y_sh = cuda.shared.array({y_words}, float32)  # diag(beta) (V - diag(E) K S), TF32
    u_sh = cuda.shared.array({y_words}, float32)  # U = T Y, TF32
    e_sh = cuda.shared.array(CHUNK, float32)  # exp(G_r)
    w_sh = cuda.shared.array(CHUNK, float32)  # exp(G_last - G_r), 0 past n
    b_sh = cuda.shared.array(CHUNK, float32)  # beta, 0 past n
    sacc = cuda.local.array({sacc}, float32)  # this warp's state tiles (mma C layout), fp32
    acc = cuda.local.array(16, float32)
    frag = cuda.local.array({frag}, float32)  # a step's A fragments, loaded before its first mma
    pfrag = cuda.local.array({pfrag}, float32)

    seg = cuda.blockIdx.x
    h = cuda.blockIdx.y
    col0 = cuda.blockIdx.z * SLICE
    slot = uint64(seg_lane[seg])
    start = seg_row[seg]
    count = seg_count[seg]
    hq = h // (v_heads // qk_heads)
    uh = uint64(h)
    uhq = uint64(hq)
    v_base = channels_qk + h * v_dim + col0
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    g = lane >> 2
    t = lane & 3
    r0 = warp * 16 + g

    for e in range({k_dim} * SLICE // THREADS):
        idx = tid + e * THREADS
        i = idx // SLICE
        c = idx - i * SLICE
        value = float32(0.0)
        if col0 + c < v_dim:
            value = ssm_state[slot, uh, uint64(i), uint64(col0 + c)]
        s_sh[i * SP + c] = value
    cuda.syncthreads()
    for jj in unrolled({sj}):
        mt = warp + 4 * jj
        if mt < {mtiles}:
            for nt in range(4):
                for e in range(4):
                    sacc[16 * jj + 4 * nt + e] = s_sh[(mt * 16 + g + 8 * (e >> 1)) * SP + nt * 8 + 2 * t + (e & 1)]
    cuda.syncthreads()
    for e in range({k_dim} * SLICE // THREADS):
        idx = tid + e * THREADS
        i = idx // SLICE
        c = idx - i * SLICE
        s_sh[i * SP + c] = tf32_round(s_sh[i * SP + c])

    chunks = (count + CHUNK - 1) // CHUNK
    for chunk in range(chunks):
        base = start + chunk * CHUNK
        n = min(CHUNK, count - chunk * CHUNK)
        if tid < CHUNK:
            last = cum[uint64(base + n - 1), uh]
            if tid < n:
                here = cum[uint64(base + tid), uh]
                e_sh[tid] = math.exp(here)
                w_sh[tid] = math.exp(last - here)
                b_sh[tid] = beta[uint64(base + tid), uh]
            else:
                e_sh[tid] = math.exp(last)
                w_sh[tid] = float32(0.0)
                b_sh[tid] = float32(0.0)
        cuda.syncthreads()

        # X = K S; Y = diag(beta) (V - diag(E) X). Loads are unconditional (clamped rows, masked after) and all issued
        # before the first mma, so a step waits on memory once.
        lo = uint64(base + min(r0, n - 1))
        hi = uint64(base + min(r0 + 8, n - 1))
        for ks in range({ksteps}):
            c0 = uint64(ks * 8 + t)
            frag[4 * ks] = k[lo, uhq, c0]
            frag[4 * ks + 1] = k[hi, uhq, c0]
            frag[4 * ks + 2] = k[lo, uhq, c0 + uint64(4)]
            frag[4 * ks + 3] = k[hi, uhq, c0 + uint64(4)]
        for e in range(16):
            acc[e] = float32(0.0)
        for ks in range({ksteps}):
            c0 = ks * 8 + t
            a0 = tf32_round(frag[4 * ks]) if r0 < n else float32(0.0)
            a1 = tf32_round(frag[4 * ks + 1]) if r0 + 8 < n else float32(0.0)
            a2 = tf32_round(frag[4 * ks + 2]) if r0 < n else float32(0.0)
            a3 = tf32_round(frag[4 * ks + 3]) if r0 + 8 < n else float32(0.0)
            for nt in range(4):
                b0 = s_sh[c0 * SP + nt * 8 + g]
                b1 = s_sh[(c0 + 4) * SP + nt * 8 + g]
                acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3] = mma_tf32_m16n8k8(
                    a0, a1, a2, a3, b0, b1, acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3])
        for nt in range(4):
            for e in range(4):
                r = r0 + 8 * (e >> 1)
                c = nt * 8 + 2 * t + (e & 1)
                v = float32(0.0)
                if r < n and col0 + c < v_dim:
                    v = mixed[uint64(base + r), uint64(v_base + c)]
                y_sh[r * SP + c] = tf32_round(b_sh[r] * (v - e_sh[r] * acc[4 * nt + e]))
        cuda.syncthreads()

        # U = T Y (T unit lower triangular: the column tiles at or left of the diagonal; T[r, s] = mats[s, r])
        rlo = uint64(min(r0, CHUNK - 1))
        rhi = uint64(min(r0 + 8, CHUNK - 1))
        for ks in range(CHUNK // 8):
            s0 = min(ks * 8 + t, n - 1)
            s4 = min(ks * 8 + t + 4, n - 1)
            frag[4 * ks] = mats[uint64(base + s0), uh, rlo]
            frag[4 * ks + 1] = mats[uint64(base + s0), uh, rhi]
            frag[4 * ks + 2] = mats[uint64(base + s4), uh, rlo]
            frag[4 * ks + 3] = mats[uint64(base + s4), uh, rhi]
        for e in range(16):
            acc[e] = float32(0.0)
        for ks in range(CHUNK // 8):
            if ks < 2 * warp + 2:
                s0 = ks * 8 + t
                a0 = float32(1.0) if s0 == r0 else float32(0.0)
                a1 = float32(1.0) if s0 == r0 + 8 else float32(0.0)
                a2 = float32(1.0) if s0 + 4 == r0 else float32(0.0)
                a3 = float32(1.0) if s0 + 4 == r0 + 8 else float32(0.0)
                if s0 < r0 and r0 < n:
                    a0 = tf32_round(frag[4 * ks])
                if s0 < r0 + 8 and r0 + 8 < n:
                    a1 = tf32_round(frag[4 * ks + 1])
                if s0 + 4 < r0 and r0 < n:
                    a2 = tf32_round(frag[4 * ks + 2])
                if s0 + 4 < r0 + 8 and r0 + 8 < n:
                    a3 = tf32_round(frag[4 * ks + 3])
                for nt in range(4):
                    b0 = y_sh[s0 * SP + nt * 8 + g]
                    b1 = y_sh[(s0 + 4) * SP + nt * 8 + g]
                    acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3] = mma_tf32_m16n8k8(
                        a0, a1, a2, a3, b0, b1, acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3])
        for nt in range(4):
            for e in range(4):
                u_sh[(r0 + 8 * (e >> 1)) * SP + nt * 8 + 2 * t + (e & 1)] = tf32_round(acc[4 * nt + e])
        cuda.syncthreads()

        # O = diag(E) Q S + P U (P[r, s] = mats[r, s], s <= r)
        for ks in range({ksteps}):
            c0 = uint64(ks * 8 + t)
            frag[4 * ks] = q[lo, uhq, c0]
            frag[4 * ks + 1] = q[hi, uhq, c0]
            frag[4 * ks + 2] = q[lo, uhq, c0 + uint64(4)]
            frag[4 * ks + 3] = q[hi, uhq, c0 + uint64(4)]
        for ks in range(CHUNK // 8):
            s0 = uint64(ks * 8 + t)
            pfrag[4 * ks] = mats[lo, uh, s0]
            pfrag[4 * ks + 1] = mats[hi, uh, s0]
            pfrag[4 * ks + 2] = mats[lo, uh, s0 + uint64(4)]
            pfrag[4 * ks + 3] = mats[hi, uh, s0 + uint64(4)]
        for e in range(16):
            acc[e] = float32(0.0)
        for ks in range({ksteps}):
            c0 = ks * 8 + t
            a0 = tf32_round(frag[4 * ks]) if r0 < n else float32(0.0)
            a1 = tf32_round(frag[4 * ks + 1]) if r0 + 8 < n else float32(0.0)
            a2 = tf32_round(frag[4 * ks + 2]) if r0 < n else float32(0.0)
            a3 = tf32_round(frag[4 * ks + 3]) if r0 + 8 < n else float32(0.0)
            for nt in range(4):
                b0 = s_sh[c0 * SP + nt * 8 + g]
                b1 = s_sh[(c0 + 4) * SP + nt * 8 + g]
                acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3] = mma_tf32_m16n8k8(
                    a0, a1, a2, a3, b0, b1, acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3])
        for nt in range(4):
            for e in range(4):
                acc[4 * nt + e] *= e_sh[r0 + 8 * (e >> 1)]
        for ks in range(CHUNK // 8):
            if ks < 2 * warp + 2:
                s0 = ks * 8 + t
                a0 = tf32_round(pfrag[4 * ks]) if s0 <= r0 and r0 < n else float32(0.0)
                a1 = tf32_round(pfrag[4 * ks + 1]) if s0 <= r0 + 8 and r0 + 8 < n else float32(0.0)
                a2 = tf32_round(pfrag[4 * ks + 2]) if s0 + 4 <= r0 and r0 < n else float32(0.0)
                a3 = tf32_round(pfrag[4 * ks + 3]) if s0 + 4 <= r0 + 8 and r0 + 8 < n else float32(0.0)
                for nt in range(4):
                    b0 = u_sh[s0 * SP + nt * 8 + g]
                    b1 = u_sh[(s0 + 4) * SP + nt * 8 + g]
                    acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3] = mma_tf32_m16n8k8(
                        a0, a1, a2, a3, b0, b1, acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3])
        for nt in range(4):
            for e in range(4):
                r = r0 + 8 * (e >> 1)
                c = nt * 8 + 2 * t + (e & 1)
                if r < n and col0 + c < v_dim:
                    out[uint64(base + r), uh, uint64(col0 + c)] = acc[4 * nt + e]
        cuda.syncthreads()  # S (shared) is read for this chunk

        # S = exp(G_last) S + (diag(exp(G_last - G)) K)^T U
        decay = e_sh[CHUNK - 1]
        for jj in unrolled({sj}):
            mt = warp + 4 * jj
            if mt < {mtiles}:
                m = mt * 16 + g
                for ks in range(CHUNK // 8):
                    s0 = min(ks * 8 + t, n - 1)
                    s4 = min(ks * 8 + t + 4, n - 1)
                    pfrag[4 * ks] = k[uint64(base + s0), uhq, uint64(m)]
                    pfrag[4 * ks + 1] = k[uint64(base + s0), uhq, uint64(m + 8)]
                    pfrag[4 * ks + 2] = k[uint64(base + s4), uhq, uint64(m)]
                    pfrag[4 * ks + 3] = k[uint64(base + s4), uhq, uint64(m + 8)]
                for e in range(16):
                    sacc[16 * jj + e] *= decay
                for ks in range(CHUNK // 8):
                    s0 = ks * 8 + t
                    a0 = tf32_round(pfrag[4 * ks] * w_sh[s0])
                    a1 = tf32_round(pfrag[4 * ks + 1] * w_sh[s0])
                    a2 = tf32_round(pfrag[4 * ks + 2] * w_sh[s0 + 4])
                    a3 = tf32_round(pfrag[4 * ks + 3] * w_sh[s0 + 4])
                    for nt in range(4):
                        b0 = u_sh[s0 * SP + nt * 8 + g]
                        b1 = u_sh[(s0 + 4) * SP + nt * 8 + g]
                        x = 16 * jj + 4 * nt
                        sacc[x], sacc[x + 1], sacc[x + 2], sacc[x + 3] = mma_tf32_m16n8k8(
                            a0, a1, a2, a3, b0, b1, sacc[x], sacc[x + 1], sacc[x + 2], sacc[x + 3])
                for nt in range(4):
                    for e in range(4):
                        s_sh[(m + 8 * (e >> 1)) * SP + nt * 8 + 2 * t + (e & 1)] = tf32_round(
                            sacc[16 * jj + 4 * nt + e])
        cuda.syncthreads()

    for jj in unrolled({sj}):
        mt = warp + 4 * jj
        if mt < {mtiles}:
            for nt in range(4):
                for e in range(4):
                    c = col0 + nt * 8 + 2 * t + (e & 1)
                    if c < v_dim:
                        ssm_state[slot, uh, uint64(mt * 16 + g + 8 * (e >> 1)), uint64(c)] = sacc[16 * jj + 4 * nt + e]
"""

SP = SLICE + SHARED_PAD
AP = CHUNK + 1  # A / T rows in shared memory: the forward substitution's column reads hit distinct banks


def _unroll(source: str) -> str:
    """Writes out each `for NAME in unrolled(COUNT):` loop of an instantiated source COUNT times with NAME a literal:
    LLVM left the state-tile loop rolled, which put the tiles (`sacc`) in local memory."""
    lines, out, i = source.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        head = re.fullmatch(r"( *)for (\w+) in unrolled\((\d+)\):", line)
        if head is None:
            out.append(line)
            i += 1
            continue
        indent, name, count = len(head.group(1)), head.group(2), int(head.group(3))
        body = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i][4:])
            i += 1
        for value in range(count):
            out += [re.sub(rf"\b{name}\b", str(value), b) for b in body]
    return "\n".join(out)


def _instantiate(source: str, name: str, signature: tuple, sizes: dict):
    """numba needs register-array and shared-array sizes as literals, so each key dim gets its own source."""
    namespace = dict(globals())
    exec(compile(_unroll(source.format(**sizes)), f"<{name}>", "exec"), namespace)  # noqa: S102  (our template, literal sizes)
    function = namespace[name]
    function.__module__ = __name__
    return kernel(signature)(function)


def _make_kernels(k_dim: int):
    kp = k_dim + 4  # K rows in shared memory: the A- and B-fragment reads hit distinct banks
    mtiles = k_dim // 16
    sizes = dict(k_dim=k_dim, kp=kp, work=max(CHUNK * kp, CHUNK * AP), k_loads=CHUNK * k_dim // THREADS,
                 s_words=k_dim * SP, y_words=CHUNK * SP, pfrag=4 * CHUNK // 8, ksteps=k_dim // 8, frag=max(4 * k_dim // 8, 4 * CHUNK // 8), mtiles=mtiles, sj=(mtiles + 3) // 4, sacc=16 * ((mtiles + 3) // 4))
    prepare = _instantiate(_PREPARE_SOURCE, f"gdn_chunk_prepare_kernel_dk{k_dim}", _PREPARE_SIG, sizes)
    scan = _instantiate(_SCAN_SOURCE, f"gdn_chunk_scan_kernel_dk{k_dim}", _SCAN_SIG, sizes)
    return prepare, scan


_KERNELS = {dk: _make_kernels(dk) for dk in K_DIMS}


def gdn_chunked(q, k, mixed, log_decay, beta, ssm_state, seg_lane, seg_row, seg_count, out, cum, mats, *, rows,
                qk_heads, v_heads, k_dim, v_dim, channels_qk, stream):
    """`gdn.gdn_recurrent` for segments that do not record per-row states, in chunks of CHUNK rows (module
    docstring). `rows` bounds every segment's count; `cum` [>= rows, Hv] and `mats` [>= rows, Hv, CHUNK] are
    workspace (G and the packed T / P of each chunk). k_dim must be 16, 32, 64 or 128."""
    if k_dim not in _KERNELS:
        raise ValueError(f"gdn_chunked has no variant for k_dim={k_dim}")
    segments = seg_lane.shape[0]
    if segments == 0 or rows == 0:
        return
    prepare, scan = _KERNELS[k_dim]
    prepare[(segments, (rows + CHUNK - 1) // CHUNK, v_heads), THREADS, stream](
        q, k, log_decay, beta, seg_row, seg_count, cum, mats, np.int32(qk_heads), np.int32(v_heads))
    scan[(segments, v_heads, (v_dim + SLICE - 1) // SLICE), THREADS, stream](
        q, k, mixed, beta, cum, mats, ssm_state, seg_lane, seg_row, seg_count, out, np.int32(qk_heads),
        np.int32(v_heads), np.int32(v_dim), np.int32(channels_qk))


# ---- NumPy twin ------------------------------------------------------------------------------------------------------

def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An mma product: TF32 operands (already rounded), exact products, fp32 result."""
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(F32)


def _prepare_chunk(k: np.ndarray, q: np.ndarray, log_decay: np.ndarray, beta: np.ndarray):
    """G, T and P of one chunk of one head, as `gdn_chunk_prepare_kernel` forms them."""
    n = len(k)
    kt, qt = tf32_round_host(k), tf32_round_host(q)
    cum = np.cumsum(log_decay.astype(F32), dtype=F32)
    on_or_below = np.tril(np.ones((n, n), bool))
    decay = np.exp(np.where(on_or_below, cum[:, None] - cum[None, :], F32(0))).astype(F32)
    below = np.tril(on_or_below, -1)
    a = np.where(below, beta.astype(F32)[:, None] * _product(kt, kt.T) * decay, F32(0)).astype(F32)
    p = np.where(on_or_below, _product(qt, kt.T) * decay, F32(0)).astype(F32)
    inverse = np.eye(n, dtype=F32)
    for r in range(1, n):  # T[r, :r] = -A[r, :r] T[:r, :r] (T unit lower triangular)
        inverse[r, :r] = -(a[r, :r] @ inverse[:r, :r])
    return cum, inverse, p


def gdn_chunked_reference(q, k, mixed, log_decay, beta, ssm_state, seg_lane, seg_row, seg_count, out, cum, mats, *,
                          rows, qk_heads, v_heads, k_dim, v_dim, channels_qk):
    """The twin of `gdn_chunked`: the same chunk formulas with the same TF32-rounded operands (`mats` receives the
    packed T / P, `cum` the cumulative log decay)."""
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
                packed[:, :n] = np.where(np.triu(np.ones((n, n), bool), 1), inverse.T, p)
                mats[rs, h] = packed
                e = np.exp(g).astype(F32)
                w = np.exp(g[-1] - g).astype(F32)
                st = tf32_round_host(state)
                kt, qt = tf32_round_host(kc), tf32_round_host(qc)
                y = tf32_round_host(b[:, None] * (v - e[:, None] * _product(kt, st)))
                u = tf32_round_host(_product(tf32_round_host(inverse), y))
                out[rs, h] = e[:, None] * _product(qt, st) + _product(tf32_round_host(p), u)
                k_scaled = tf32_round_host(kc * w[:, None])
                state = (np.exp(g[-1]).astype(F32) * state + _product(k_scaled.T, u)).astype(F32)
            ssm_state[lane, h] = state
