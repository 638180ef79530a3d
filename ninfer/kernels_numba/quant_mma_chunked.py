"""Prefill MoE expert GEMMs straight from the quantized experts on the tensor cores, over the chunked row layout.

Why: a prefill chunk past SKINNY_ROWS rows multiplies every quantized matrix through cuBLAS from a bf16 copy
(`dequant_ahead`). For the stacked routed experts that copy is most of the work at the server's 1024-row chunks: the
35B-A3B ninfer-v2 writes ~64 GB of bf16 experts a chunk (~27 ms on the H200, against ~12 ms for the expert GEMMs
themselves), and an 8K prompt pays it 8 times (served 8K prefill 545 ms against bf16's 269-311; bench/cuda_notes.md,
sessions 37-38). At ~32 rows an expert the GEMMs are small enough that decoding the codes in registers beside the
mma, as the decode kernels do (`quant_mma`), reads 0.56-1.06 bytes a weight once instead of writing and reading two.

The rows: the MoE prefill's chunked layout (`moe.moe_layout`, `moe.moe_chunk_groups`): expert e's routed rows start
at row starts[e] of the permuted input, in whole chunks of `chunk` rows, chunk i belonging to expert chunk_groups[i].
A block takes CHUNK_ROWS = 32 of a chunk's rows (the mma's N = 8 times 4 fragment sets) and 8 consecutive 16-row
tiles of its expert's weight (`repack_quant_mma` layout), a warp a tile over the whole K. The block's x rows come
to shared memory a 64-column K block at a time (`cp.async`, three stages, one barrier a block; rows past the chunk's
routed ones are zero-filled and their columns dropped) and reach the mma through `ldmatrix`; a warp keeps its tile's
codes two K blocks ahead in registers. A chunk's rows past its expert's count (the last chunk of an expert, and the
surplus chunks of the sync-free layout) cost nothing: a block with no routed row exits, and fragment sets without
one are skipped. Each output is one fp32 chain per K block times the block's scales, rounded once to bf16.

Outputs (bf16 rows at the inputs' permuted positions): plain, y[p, n] = x[p] . W_e[n]; or for a gate|up stored in
`quant_mma.swiglu_order` the down projection's input silu(gate) * up [p, rpe / 2] (no gate|up rows, no silu-mul
launch: a tile's C rows g and g + 8 are gate and up of one unit).
"""

from __future__ import annotations

import numpy as np
from numba import float32, int32, int64, uint16, uint32

from ninfer.kernels_numba.async_copy import copy_async_16, copy_async_commit, copy_async_wait_prior, shared_address
from ninfer.kernels_numba.common import (FULL_MASK, address_of, half_pair_to_f32, load_matrix_x4, load_word_at,
                                         load_words2_at, load_words4_at, pack_bf16x2, silu_times)
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel, register_options
from ninfer.kernels_numba.quant_mma import (BLOCK, FORMAT_BITS, HIGH_WORDS, MAX_X_ROWS, SCALE_WORDS, TILE_ROWS,
                                            QuantMmaWeight, code_fragment, mma_into, offset_pair,
                                            w8_fragments)

CHUNK_ROWS = 32  # x rows a block multiplies: 4 fragment sets
CHUNK_SETS = CHUNK_ROWS // MAX_X_ROWS
B_WORDS = 8 * CHUNK_SETS  # a lane's B-fragment registers of one K block: 2 a k-step and set
WARPS = 8  # a warp a tile: 128 weight rows a block
THREADS = 32 * WARPS  # one 16-byte copy a thread stages a K block of 32 rows x 64 columns
STAGES = 3  # x K blocks in shared memory: the one read, the one landing, the one being issued
# A staged row: 64 bf16 (128 bytes) + 16 bytes of padding, so the 8 rows an ldmatrix phase reads (16 bytes each)
# fall on 32 different banks.
ROW_BYTES = 144
STAGE_BYTES = CHUNK_ROWS * ROW_BYTES
SHARED_BYTES = STAGES * STAGE_BYTES


def make_quant_mma_chunked_kernel(bits: int, max_registers: int | None = None):
    """The kernel of one format (module docstring); `swiglu` is an argument (block-uniform), not a variant.
    `max_registers`: a register cap (bench/moe_chunked.py times what more blocks an SM give)."""
    HW = HIGH_WORDS[bits]
    SW = SCALE_WORDS[bits]
    MINUS = offset_pair(1 << (bits - 1)) if bits != 8 else offset_pair(8)  # W8: the high nibble's offset
    MINUS_LOW = offset_pair(0)
    ACC = 4 * CHUNK_SETS
    # bytes of a (tile, block) slot in each plane, for one lane (`repack_quant_mma`)
    BASE_SLOT = 32 * 4 * 4
    HIGH_SLOT = 32 * HW * 4
    SCALE_SLOT = SW * 8 * 4

    @device_function
    def block_at(w_at, h_at, s_at, q):
        """A lane's code words, high-plane words (zeros past the format's) and first / last scale words of K block
        q of its tile, from the tile's block-0 addresses (raw loads: one multiply-add a plane a block)."""
        q64 = int64(q)
        w0, w1, w2, w3 = load_words4_at(w_at + q64 * BASE_SLOT)
        h0 = uint32(0)
        h1 = uint32(0)
        h2 = uint32(0)
        h3 = uint32(0)
        if bits == 5:
            h0 = load_word_at(h_at + q64 * HIGH_SLOT)
        elif bits == 6:
            h0, h1 = load_words2_at(h_at + q64 * HIGH_SLOT)
        elif bits == 8:
            h0, h1, h2, h3 = load_words4_at(h_at + q64 * HIGH_SLOT)
        s0 = load_word_at(s_at + q64 * SCALE_SLOT)
        s1 = load_word_at(s_at + q64 * SCALE_SLOT + 32 * (SW - 1))
        return w0, w1, w2, w3, h0, h1, h2, h3, s0, s1

    @kernel((uint16[:, ::1], uint32[::1], uint32[::1], uint32[::1], int32[::1], int32[::1], int32[::1],
             uint32[:, ::1], int32, int32, int32, int32), fastmath=False, **register_options(max_registers))
    def quant_mma_chunked_kernel(x, base, high, scales, chunk_groups, offsets, starts, y, blocks, rpe, chunk, swiglu):
        """Block (tile group, piece): rows piece * 32 .. + 31 of x (bf16 [rows, K]) times tiles 8 group .. of
        expert chunk_groups[piece // (chunk / 32)]; y (bf16 pairs [rows, N / 2]) as the module docstring says."""
        sh = cuda.shared.array(0, uint32)
        pieces = chunk // CHUNK_ROWS
        piece = int32(cuda.blockIdx.y)
        c = piece // pieces
        e = chunk_groups[c]
        first = c * chunk - starts[e] + (piece - c * pieces) * CHUNK_ROWS  # inside expert e's rows
        rows = int32(min(CHUNK_ROWS, offsets[e + 1] - offsets[e] - first))
        if rows <= 0:  # block-uniform: no barrier waits for it
            return
        sets = (rows + int32(MAX_X_ROWS - 1)) >> int32(3)  # fragment sets of 8 rows
        row0 = piece * CHUNK_ROWS  # the block's rows of x and y
        tid = int32(cuda.threadIdx.x)
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        expert_tiles = rpe >> 4
        tile = int32(cuda.blockIdx.x) * WARPS + warp  # inside the expert; past its last, a warp reloads the last
        slot0 = int64(e * expert_tiles + min(tile, expert_tiles - 1)) * int64(blocks)  # (tile, block 0)
        w_at = address_of(base) + slot0 * BASE_SLOT + lane * 16
        h_at = address_of(high) + slot0 * HIGH_SLOT + lane * (HW * 4)
        s_at = address_of(scales) + slot0 * SCALE_SLOT + g * 4

        shared = shared_address(address_of(sh))
        # thread (row r, 16-byte piece p) stages x[row0 + r, 64 q + 8 p ..] of every K block q
        r = tid >> 3
        copy_to = shared + uint32(r * ROW_BYTES + (tid & 7) * 16)
        copy_from = address_of(x) + (int64(row0 + r) * int64(x.shape[1]) + (tid & 7) * 8) * 2
        copy_bytes = uint32(16) if r < rows else uint32(0)
        # ldmatrix rows: lane l gives row l % 8 of matrix l // 8 = (k-step 2 jj + (l >> 4), half (l >> 3) & 1)
        read_at = shared + uint32((lane & 7) * ROW_BYTES + (lane >> 3) * 16)

        copy_async_16(copy_to, copy_from, copy_bytes)  # the first two K blocks' x (K has at least one)
        copy_async_commit()
        if blocks > 1:
            copy_async_16(copy_to + uint32(STAGE_BYTES), copy_from + BLOCK * 2, copy_bytes)
        copy_async_commit()
        minus = uint32(MINUS)
        minus_low = uint32(MINUS_LOW)
        acc = cuda.local.array(ACC, float32)
        chain = cuda.local.array(ACC, float32)
        chain_low = cuda.local.array(ACC, float32)  # W8: the low nibbles' chain
        xb = cuda.local.array(B_WORDS, uint32)  # xb[8 s + 2 j + h]: b_h of k-step j, set s
        wd = cuda.local.array(4, uint32)  # the block's code words (k-steps 0..3) and high-plane words
        hd = cuda.local.array(4, uint32)
        for a in range(ACC):
            acc[a] = float32(0.0)
        last = int32(blocks - 1)
        n0, n1, n2, n3, nh0, nh1, nh2, nh3, ns0, ns1 = block_at(w_at, h_at, s_at, int32(0))
        m0, m1, m2, m3, mh0, mh1, mh2, mh3, ms0, ms1 = block_at(w_at, h_at, s_at, min(int32(1), last))
        # the stages (byte offsets) block q reads and block q + 2 is copied into: q % 3 and (q + 2) % 3
        read_stage = uint32(0)
        write_stage = uint32(2 * STAGE_BYTES)
        q = int32(0)
        while q < blocks:
            wd[0], wd[1], wd[2], wd[3], hd[0], hd[1], hd[2], hd[3], sc0, sc1 = (n0, n1, n2, n3, nh0, nh1, nh2, nh3,
                                                                                ns0, ns1)
            n0, n1, n2, n3, nh0, nh1, nh2, nh3, ns0, ns1 = m0, m1, m2, m3, mh0, mh1, mh2, mh3, ms0, ms1
            ahead = int32(q + 2)  # (int32 arithmetic: numba widens int32 sums to int64)
            m0, m1, m2, m3, mh0, mh1, mh2, mh3, ms0, ms1 = block_at(w_at, h_at, s_at, min(ahead, last))
            copy_async_wait_prior()  # x of block q landed (q + 1's may be in flight)
            cuda.syncthreads()  # ... for every thread; and every warp is done reading block q - 1's stage
            if ahead < blocks:  # into the stage block q - 1 used
                copy_async_16(copy_to + write_stage, copy_from + int64(ahead) * (BLOCK * 2), copy_bytes)
            copy_async_commit()  # (empty past the last block: the wait above counts groups)
            stage = read_at + read_stage
            read_stage = uint32(0) if read_stage == uint32(2 * STAGE_BYTES) else read_stage + uint32(STAGE_BYTES)
            write_stage = uint32(0) if write_stage == uint32(2 * STAGE_BYTES) else write_stage + uint32(STAGE_BYTES)
            for s in range(CHUNK_SETS):
                if s < sets:
                    at = stage + uint32(s * MAX_X_ROWS * ROW_BYTES)
                    xb[8 * s], xb[8 * s + 1], xb[8 * s + 2], xb[8 * s + 3] = load_matrix_x4(at)
                    xb[8 * s + 4], xb[8 * s + 5], xb[8 * s + 6], xb[8 * s + 7] = load_matrix_x4(at + uint32(64))
            if bits == 8:
                for k in range(2):  # two 32-column scale groups, two k-steps each
                    for a in range(ACC):
                        chain[a] = float32(0.0)
                        chain_low[a] = float32(0.0)
                    for jj in range(2):
                        j = 2 * k + jj
                        a0, a1, a2, a3, e0, e1, e2, e3 = w8_fragments(hd[j], wd[j], minus, minus_low)
                        for s in range(CHUNK_SETS):
                            if s < sets:
                                b0 = xb[8 * s + 2 * j]
                                b1 = xb[8 * s + 2 * j + 1]
                                mma_into(chain, 4 * s, a0, a1, a2, a3, b0, b1)
                                mma_into(chain_low, 4 * s, e0, e1, e2, e3, b0, b1)
                    s_lo, s_hi = half_pair_to_f32(sc0 if k == 0 else sc1)
                    for a in range(ACC):
                        scale = s_hi if (a & 3) >= 2 else s_lo
                        acc[a] += scale * (float32(16.0) * chain[a] + chain_low[a])
            else:
                for a in range(ACC):
                    chain[a] = float32(0.0)
                for j in range(4):
                    a0, a1, a2, a3 = code_fragment(wd[j], hd[0], hd[1], j, bits, minus)
                    for s in range(CHUNK_SETS):
                        if s < sets:
                            mma_into(chain, 4 * s, a0, a1, a2, a3, xb[8 * s + 2 * j], xb[8 * s + 2 * j + 1])
                s_lo, s_hi = half_pair_to_f32(sc0)
                for a in range(ACC):
                    acc[a] += (s_hi if (a & 3) >= 2 else s_lo) * chain[a]
            q = int32(q + 1)

        # C of set s: acc[4 s + i] = tile row g (+ 8 for i >= 2) by x row 8 s + 2 t (+ 1 for odd i). Lanes of even g
        # write the bf16 pair of output columns (g, g + 1) of their rows, g + 1's values from lane + 4.
        valid = tile < expert_tiles
        for s in range(CHUNK_SETS):
            if s < sets:
                if swiglu != 0:  # rows g / g + 8: gate / up of unit 8 tile + g
                    v0 = silu_times(acc[4 * s], acc[4 * s + 2])
                    v1 = silu_times(acc[4 * s + 1], acc[4 * s + 3])
                    p0 = cuda.shfl_sync(FULL_MASK, v0, (lane + 4) & 31)
                    p1 = cuda.shfl_sync(FULL_MASK, v1, (lane + 4) & 31)
                    column = (tile * 8 + g) >> 1
                    m = 8 * s + 2 * t
                    if valid and (g & 1) == 0:
                        if m < rows:
                            y[row0 + m, column] = pack_bf16x2(v0, p0)
                        if m + 1 < rows:
                            y[row0 + m + 1, column] = pack_bf16x2(v1, p1)
                else:
                    p0 = cuda.shfl_sync(FULL_MASK, acc[4 * s], (lane + 4) & 31)
                    p1 = cuda.shfl_sync(FULL_MASK, acc[4 * s + 1], (lane + 4) & 31)
                    p2 = cuda.shfl_sync(FULL_MASK, acc[4 * s + 2], (lane + 4) & 31)
                    p3 = cuda.shfl_sync(FULL_MASK, acc[4 * s + 3], (lane + 4) & 31)
                    column = (tile * TILE_ROWS + g) >> 1
                    m = 8 * s + 2 * t
                    if valid and (g & 1) == 0:
                        if m < rows:
                            y[row0 + m, column] = pack_bf16x2(acc[4 * s], p0)
                            y[row0 + m, column + 4] = pack_bf16x2(acc[4 * s + 2], p2)
                        if m + 1 < rows:
                            y[row0 + m + 1, column] = pack_bf16x2(acc[4 * s + 1], p1)
                            y[row0 + m + 1, column + 4] = pack_bf16x2(acc[4 * s + 3], p3)

    return quant_mma_chunked_kernel


QUANT_MMA_CHUNKED_KERNELS = {bits: make_quant_mma_chunked_kernel(bits) for bits in (4, 5, 6, 8)}


def check_chunked_shapes(x_shape: tuple[int, int], qw: QuantMmaWeight, y_shape: tuple[int, int], *,
                         rows_per_expert: int, chunk: int, chunks: int, swiglu: bool) -> None:
    """The ValueError of `linear_quant_mma_chunked` (and its host twin) for shapes it cannot run."""
    (rows, K), (N, K_w), rpe = x_shape, qw.shape, int(rows_per_expert)
    width = rpe // 2 if swiglu else rpe
    problems = []
    if K != K_w or K % BLOCK:
        problems.append(f"x has {K} columns, the weight {K_w} (a multiple of {BLOCK})")
    if rpe <= 0 or rpe % TILE_ROWS or N % rpe:
        problems.append(f"rows_per_expert {rpe} must be a multiple of {TILE_ROWS} dividing the {N} stacked rows")
    if swiglu and qw.swiglu_rows != rpe:
        problems.append(f"the SwiGLU output needs the experts stored in swiglu_order of {rpe} rows, not "
                        f"{qw.swiglu_rows}")
    if not swiglu and qw.swiglu_rows:
        problems.append("experts stored in swiglu_order give the SwiGLU output only")
    if chunk <= 0 or chunk % CHUNK_ROWS:
        problems.append(f"chunk {chunk} must be a positive multiple of {CHUNK_ROWS}")
    elif chunks * chunk > rows:
        problems.append(f"{chunks} chunks of {chunk} rows pass x's {rows} rows")
    if tuple(y_shape) != (rows, width):
        problems.append(f"y{tuple(y_shape)} is not [{rows}, {width}] bf16")
    if problems:
        raise ValueError("tensor-core chunked expert GEMM: " + "; ".join(problems))


def linear_quant_mma_chunked(x, qw: QuantMmaWeight, chunk_groups, offsets, starts, y, *, rows_per_expert: int,
                             chunk: int, chunks: int, swiglu: bool, stream, _kernel=None) -> None:
    """The MoE prefill's expert GEMMs over the chunked layout (module docstring), straight from the quantized
    stacked experts qw [E * rpe, K]: for each of the first `chunks` chunks i (expert e = chunk_groups[i]) and each of
    its rows p that holds a routed row (p - starts[e] below expert e's count, offsets[e + 1] - offsets[e]),
    y[p] = bf16(x[p] @ W_e^T) (y uint16 [rows, rpe]), or with `swiglu` (qw stored in swiglu_order)
    y[p] = bf16(silu(gate) * up) (y uint16 [rows, rpe / 2]). x uint16 [rows, K] (bf16 bits); chunk_groups, offsets
    (int32 [E + 1]) and starts (int32 [E]) on the device, as moe_layout and moe_chunk_groups write them. Other rows of
    y keep their contents. Capture-safe. (`_kernel`: a variant from `make_quant_mma_chunked_kernel`, for
    benchmarks.)"""
    check_chunked_shapes(x.shape, qw, y.shape, rows_per_expert=rows_per_expert, chunk=chunk, chunks=chunks,
                         swiglu=swiglu)
    if chunks == 0:
        return
    groups = -(-(int(rows_per_expert) // TILE_ROWS) // WARPS)
    function = _kernel if _kernel is not None else QUANT_MMA_CHUNKED_KERNELS[FORMAT_BITS[qw.fmt]]
    function[(groups, chunks * (chunk // CHUNK_ROWS)), THREADS, stream, SHARED_BYTES](
        x, qw.base, qw.high, qw.scales, chunk_groups, offsets, starts, y.view(np.uint32), np.int32(qw.blocks),
        np.int32(rows_per_expert), np.int32(chunk), np.int32(1 if swiglu else 0))


# ---- NumPy twin ----------------------------------------------------------------------------------------------------

def chunked_rows(chunk_groups: np.ndarray, offsets: np.ndarray, starts: np.ndarray, *, chunk: int,
                 chunks: int) -> list[tuple[int, int, int]]:
    """(expert, first row, routed rows) of each of the first `chunks` chunks that holds routed rows."""
    counts = np.diff(np.asarray(offsets, np.int64))
    found = []
    for i, e in enumerate(np.asarray(chunk_groups)[:chunks].tolist()):
        inside = i * chunk - int(starts[e])
        rows = min(chunk, int(counts[e]) - inside)
        if rows > 0:
            found.append((e, i * chunk, rows))
    return found


def linear_quant_mma_chunked_reference(x: np.ndarray, weights: np.ndarray, chunk_groups: np.ndarray,
                                       offsets: np.ndarray, starts: np.ndarray, y: np.ndarray, *,
                                       rows_per_expert: int, chunk: int, chunks: int, swiglu: bool) -> None:
    """`linear_quant_mma_chunked` on the host, in place: x uint16 [rows, K] (bf16 bits), weights the stacked experts'
    exact fp32 decode in their original row order [E * rpe, K] (gate rows then up rows an expert), y uint16; float64
    sums (the kernel's order is its own) rounded to fp32, then to bf16 once."""
    from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
    from ninfer.kernels_numba.elementwise import silu_mul_rows_reference

    rpe = int(rows_per_expert)
    for e, first, rows in chunked_rows(chunk_groups, offsets, starts, chunk=chunk, chunks=chunks):
        xs = bf16_bits_to_f32(x[first:first + rows]).astype(np.float64)
        product = (xs @ weights[e * rpe:(e + 1) * rpe].astype(np.float64).T).astype(np.float32)
        if swiglu:
            product = silu_mul_rows_reference(product)
        y[first:first + rows] = f32_to_bf16_bits(product)


__all__ = ["CHUNK_ROWS", "check_chunked_shapes", "chunked_rows", "linear_quant_mma_chunked",
           "linear_quant_mma_chunked_reference", "make_quant_mma_chunked_kernel"]
