"""Decode-time bf16 linear layers on the tensor cores: y[M, N] (+)= x[M, K] @ W^T for up to 32 rows of x, W the
artifact's bf16 matrix [N, K] as stored (cuBLAS reads the same buffer at prefill), x its bf16 copy [M, K].

Why: cuBLAS is fast at decode, but it picks its kernel (and so a row's summation order) from the shape, so batch
invariance pads every decode call to the decode rows (32 when serving 8 lanes with MTP k = 3), and the padded GEMM is
slower than cuBLAS's GEMV at one row (27B bf16 B=1 step: 15.32 ms padded, 14.97 unpadded, results/cuda_model_27b_bf16_
session29.json). The SIMT skinny kernels (`linear`) are batch invariant by construction but compute-bound past a
few rows. Here one `mma.sync.m16n8k16` multiplies 16 weight rows by 8 x rows, so a launch reads each weight once for
any row count, computes only the rows it has, and gives a row the same bits alone or inside a batch.

Where it stands (H200, bench/linear_mma.py, results/linear_mma_session34.json; the 27B's six decode shapes summed,
us at 1 / 4 / 8 / 32 rows): this geometry 291 / 303 / 310 / 579, the best of the eight geometries timed at each row
count 279 / 281 / 282 / 432, cuBLAS unpadded 263 / 265 / 267 / 271 and padded to 32 rows 270 (at 32 rows each warp
re-reads x for every set beside its weights). Per shape it wins only where cuBLAS
leaves SMs idle (the 5120-row down and out projections: 320 row tiles). So it is an option (`Capacity.decode_linear`
"mma", and a candidate of the "auto" tuning), not the default: whole 27B steps, B=1 15.78 ms against cuBLAS's 15.48
(results/cuda_model_27b_bf16_linear_mma_v1_session34.json, its first geometry).

No repacking: a lane loads 16 bytes (8 bf16, one `ld.global.v4`) of weight row g and of row g + 8 (g = lane / 4) at
columns 8 t .. 8 t + 7 of a 32-column half (t = lane % 4), and the same 16 bytes of x row g. A dot product may take
its columns in any order, so the mma's k index is a permutation of the columns: in k-step j (0, 1) of a half, the
A registers are the row-g and row-g+8 words 2 j and 2 j + 1 (columns 8 t + 4 j .. + 3, as k 2 t, 2 t + 1, 2 t + 8,
2 t + 9) and the B registers the x row's words 2 j and 2 j + 1 (the same columns). Every column of the half is in
exactly one (t, j).

Geometry: a block of WARPS warps owns one 16-row tile; warp w takes the 64-column blocks w, w + WARPS, ... in steps
of UNROLL blocks whose weights load during the step before (the first step's before `wait_for_prior_grids`: under a
programmatic launch they stream in while the kernel before finishes). The warps' C fragments meet in shared memory
and are added in warp order. An output is one column of the mma accumulated in a fixed order, whatever M, the sets
(8 x rows each) or the grid: a row's result does not depend on the other rows. Rows of x past M (the lanes of an
unfilled set) read row M - 1 into columns that are dropped; tiles past N read row N - 1, likewise.

Requirements: K % 64 == 0 (the artifact's K are multiples of 64), C-contiguous arrays, 16-byte aligned rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, int64, uint16, uint32

from ninfer.artifact.codec import bf16_bits_to_f32
from ninfer.kernels_numba.common import address_of, load_words4_at, load_words4_streaming_at
from ninfer.kernels_numba.numba_setup import cuda, kernel, large_device_function
from ninfer.kernels_numba.programmatic import allow_dependents, launch, wait_for_prior_grids
from ninfer.kernels_numba.quant_mma import (MAX_X_ROWS, ROW_SETS, TILE_ROWS, make_store_sums, make_warps_sum,
                                            mma_bf16_m16n8k16, partials_bytes, x_sets)

WARPS = 8
UNROLL = 2
# Measured on the H200 (bench/linear_mma.py, results/linear_mma_session34.json: 8 geometries at the 27B's decode
# shapes, rows 1 / 4 / 8 / 32): alone, x a step ahead was the best single geometry at 4 and 8 rows and within 1% of
# the best at 1, but inside whole 27B steps it lost (B=1 16.18 ms against 15.78 with x loaded in its own step,
# cuBLAS 15.06 / 15.48 on those machines; results/cuda_model_27b_bf16_attention_prologue_session34.json). The warps
# fix a row's summation order (they split K); the rest does not.
X_AHEAD = False
BLOCK = 64  # columns per block: two 32-column halves, 4 mma k-steps
BLOCK_BYTES = 2 * BLOCK
HALF_BYTES = BLOCK_BYTES // 2
LAUNCH_ROWS = MAX_X_ROWS * ROW_SETS  # x rows one launch takes
WEIGHTS, X = 1, 2  # `load_step` parts


def make_linear_bf16_mma_kernel(sets: int, warps: int = WARPS, unroll: int = UNROLL, x_ahead: bool = X_AHEAD,
                                streaming: bool = False):
    """The kernel for `sets` x-row sets (x row m: mma column m % 8 of set m // 8): each weight fragment is loaded
    once and multiplied by every set. `x_ahead`: a step's x words load with its weights, during the step before
    (else during its own step); `streaming`: weights through `load_words4_streaming_at` (no L1 allocation)."""
    ACC = 4 * sets
    WORDS = 16 * unroll  # words[16 u + 8 h + 4 r + i]: word i of row g (r = 0) or g + 8 (r = 1), half h, block u
    XS = 8 * unroll * sets if x_ahead else 1  # xs[8 (u sets + s) + 4 h + i]: word i of set s's x row, half h
    store_sums = make_store_sums(1, sets)
    warps_sum = make_warps_sum(ACC, warps)

    @large_device_function
    def load_step(words, xs, row_lo, row_hi, x_rows, q0, blocks, part):
        """The words of the step whose first block is q0 (blocks past the last clamped onto it: loaded, never
        summed): `part` WEIGHTS, X (with `x_ahead`) or both."""
        for u in range(unroll):
            at = int64(min(q0 + u * warps, blocks - 1)) * BLOCK_BYTES
            for h in range(2):
                w0 = 16 * u + 8 * h
                if part & WEIGHTS and streaming:
                    words[w0], words[w0 + 1], words[w0 + 2], words[w0 + 3] = load_words4_streaming_at(
                        row_lo + at + h * HALF_BYTES)
                    words[w0 + 4], words[w0 + 5], words[w0 + 6], words[w0 + 7] = load_words4_streaming_at(
                        row_hi + at + h * HALF_BYTES)
                elif part & WEIGHTS:
                    words[w0], words[w0 + 1], words[w0 + 2], words[w0 + 3] = load_words4_at(
                        row_lo + at + h * HALF_BYTES)
                    words[w0 + 4], words[w0 + 5], words[w0 + 6], words[w0 + 7] = load_words4_at(
                        row_hi + at + h * HALF_BYTES)
                if x_ahead and part & X:
                    for s in range(sets):
                        x0 = 8 * (u * sets + s) + 4 * h
                        xs[x0], xs[x0 + 1], xs[x0 + 2], xs[x0 + 3] = load_words4_at(x_rows[s] + at + h * HALF_BYTES)

    @large_device_function
    def step_sums(acc, words, xs, x_rows, q0, blocks):
        """Add the step's blocks (those that exist) to acc, for every set."""
        x_now = cuda.local.array(4, uint32)
        for u in range(unroll):
            q = q0 + u * warps
            if q < blocks:
                at = int64(q) * BLOCK_BYTES
                for h in range(2):
                    w0 = 16 * u + 8 * h
                    for s in range(sets):
                        if x_ahead:
                            x0 = 8 * (u * sets + s) + 4 * h
                            for i in range(4):
                                x_now[i] = xs[x0 + i]
                        else:
                            x_now[0], x_now[1], x_now[2], x_now[3] = load_words4_at(x_rows[s] + at + h * HALF_BYTES)
                        for j in range(2):
                            acc[4 * s], acc[4 * s + 1], acc[4 * s + 2], acc[4 * s + 3] = mma_bf16_m16n8k16(
                                words[w0 + 2 * j], words[w0 + 4 + 2 * j], words[w0 + 2 * j + 1],
                                words[w0 + 4 + 2 * j + 1], x_now[2 * j], x_now[2 * j + 1],
                                acc[4 * s], acc[4 * s + 1], acc[4 * s + 2], acc[4 * s + 3])

    @kernel((uint16[:, ::1], uint16[:, ::1], float32[:, ::1], int32), fastmath=False)
    def linear_bf16_mma_kernel(x, w, y, accumulate):
        allow_dependents()
        partials = cuda.shared.array(0, float32)
        lane = int32(cuda.threadIdx.x & 31)
        warp = int32(cuda.threadIdx.x >> 5)
        g, t = lane >> 2, lane & 3
        M, N = int32(y.shape[0]), int32(y.shape[1])
        row_bytes = int64(w.shape[1]) * 2
        blocks = int32(w.shape[1] // BLOCK)
        first_row = int32(cuda.blockIdx.x) * TILE_ROWS
        lane_column = int64(16 * t)
        row_lo = address_of(w) + int64(min(first_row + g, N - 1)) * row_bytes + lane_column
        row_hi = address_of(w) + int64(min(first_row + g + 8, N - 1)) * row_bytes + lane_column
        x_rows = cuda.local.array(sets, int64)
        for s in range(sets):
            x_rows[s] = address_of(x) + int64(min(MAX_X_ROWS * s + g, M - 1)) * row_bytes + lane_column
        acc = cuda.local.array(ACC, float32)
        for a in range(ACC):
            acc[a] = float32(0.0)
        words = cuda.local.array(WORDS, uint32)
        next_words = cuda.local.array(WORDS, uint32)
        xs = cuda.local.array(XS, uint32)
        next_xs = cuda.local.array(XS, uint32)
        q0 = warp
        stride = warps * unroll
        if q0 < blocks:  # the weights are no earlier kernel's output: they may stream in before the wait
            load_step(words, xs, row_lo, row_hi, x_rows, q0, blocks, WEIGHTS)
        wait_for_prior_grids()
        if q0 < blocks:
            load_step(words, xs, row_lo, row_hi, x_rows, q0, blocks, X)
        while q0 < blocks:
            load_step(next_words, next_xs, row_lo, row_hi, x_rows, q0 + stride, blocks, WEIGHTS | X)
            step_sums(acc, words, xs, x_rows, q0, blocks)
            for i in range(WORDS):
                words[i] = next_words[i]
            for i in range(XS):
                xs[i] = next_xs[i]
            q0 += stride
        warps_sum(acc, partials, warp, lane)
        store_sums(y, acc, first_row, N, accumulate)

    return linear_bf16_mma_kernel


LINEAR_BF16_MMA_KERNELS = {sets: make_linear_bf16_mma_kernel(sets) for sets in range(1, ROW_SETS + 1)}


def check_shapes(x_shape: tuple, w_shape: tuple, y_shape: tuple) -> None:
    """The ValueError of `linear_bf16_mma` (and its host twin) for shapes it cannot multiply."""
    (M, N), (wn, K) = y_shape, w_shape
    if wn != N or x_shape[1] != K or x_shape[0] < M or K % BLOCK or K == 0:
        raise ValueError(f"tensor-core bf16 linear: x{tuple(x_shape)} W{tuple(w_shape)} y{tuple(y_shape)} "
                         f"(x rows >= y rows, K a positive multiple of {BLOCK})")


def linear_bf16_mma(x, w, y, *, stream, accumulate: bool = False, programmatic: bool = False,
                    _kernel=None, warps: int = WARPS) -> None:
    """y[M, N] (+)= x[:M] @ W^T, x and W bf16 bits (uint16), y fp32; launches of up to LAUNCH_ROWS rows, each
    reading the weights once. Row m's result is the same whatever M. Capture-safe. `programmatic`: a programmatic
    dependent launch (module `programmatic`). (`_kernel` with its `warps`: a variant from
    `make_linear_bf16_mma_kernel`, for benchmarks and tests.)"""
    check_shapes(x.shape, w.shape, y.shape)
    M, N = y.shape
    for first in range(0, M, LAUNCH_ROWS):
        last = min(M, first + LAUNCH_ROWS)
        sets = x_sets(last - first)
        fn = _kernel if _kernel is not None else LINEAR_BF16_MMA_KERNELS[sets]
        launch(fn, math.ceil(N / TILE_ROWS), 32 * warps, stream, partials_bytes(1, warps, sets), x[first:last], w,
               y[first:last], int32(1 if accumulate else 0), programmatic=programmatic)


def linear_bf16_mma_reference(x: np.ndarray, w: np.ndarray, y: np.ndarray | None = None, *,
                              accumulate: bool = False) -> np.ndarray:
    """NumPy twin: x[:M] (bf16 bits) @ W^T (bf16 bits) in float64, rounded to fp32 (the kernel accumulates in fp32:
    equal within its rounding), added to y when `accumulate`. M = y's rows when y is given, else x's."""
    rows = x.shape[0] if y is None else y.shape[0]
    product = bf16_bits_to_f32(x[:rows]).astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T
    if accumulate:
        product = product + y
    return product.astype(np.float32)
