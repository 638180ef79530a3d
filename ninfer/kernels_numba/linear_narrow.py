"""Decode GEMVs of narrow bf16 matrices (a few hundred output rows: the MoE router, the Gated DeltaNet a/b
projection), and the router's GEMV fused with the expert routing.

`linear_bf16_narrow`: y[M, N] (+)= x[M, K] @ w[N, K]^T, w bf16 bits, x/y fp32, M <= SKINNY_ROWS.
Why not `linear.linear_bf16` or cuBLAS: a 257 x 2048 router is 1 MB, 0.2 us of DRAM time, yet both take ~6.7 us on
the H200 (35B-A3B decode: 70 such launches a step, 471 us). The skinny kernel gives each warp whole rows, so a
narrow matrix fills a few blocks that each walk K in a chain of dependent loads; cuBLAS's GEMV is no better.
Here a block owns R output rows and splits K (at most NARROW_MAX_K) over its NARROW_WARPS warps: warp w takes the
256-column steps w, w + 8, w + 16, w + 24, lane l the 8 columns 8 l of each, and every weight load is issued before
the first multiply, so a block waits for about one DRAM round trip. x rows come in tiles of NARROW_X_ROWS
(blockIdx.y), each read straight from global memory (L2-resident activations).

Summation order of y[m, n], whatever M, the tile or the grid: each lane sums its steps in ascending order (8
products each, in column order), a fixed xor butterfly sums the warp, then the warps' sums in warp order: a row's
result is bitwise independent of the rows beside it (batch invariance up to SKINNY_ROWS, like the quantized
kernels).

`linear_bf16_narrow_route`: the same GEMV into the router logits, then the block that finishes last (a counter in
device memory, reset by that block for the next launch: graph replays need no host patch) runs
`moe.route_top_k`'s per-row routing on the finished logits, one warp a row (up to FUSED_ROUTE_ROWS rows). One
launch instead of two; the routing's arithmetic is `moe.route_row`'s, so ids and weights equal `route_top_k`'s on
the same logits.

Requirements: K % 8 == 0, K <= NARROW_MAX_K, arrays C-contiguous, 16-byte aligned rows (K % 8 == 0 does it for x
and w).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, int64, uint64

from ninfer.kernels_numba.common import blocks_for, warp_sum
from ninfer.kernels_numba.linear import fma_bf16x8, linear_bf16_reference, load2, load4
from ninfer.kernels_numba.moe import check_route, route_row, route_top_k_reference
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel

NARROW_WARPS = 8  # warps a block, splitting K between them
NARROW_STEPS = 4  # 256-column steps a warp holds in registers
NARROW_MAX_K = NARROW_WARPS * NARROW_STEPS * 256  # 8192: every weight of a block's rows loaded at once
NARROW_X_ROWS = 8  # x rows a block multiplies (blockIdx.y walks the tiles)
NARROW_SPAN = 256  # columns a warp step covers (32 lanes x 8 bf16)
# Output rows a block: the fewest of NARROW_ROWS_PER_BLOCK that keep the grid within NARROW_BLOCKS blocks, half the
# H200's 132 SMs: every weight load is in flight at once anyway, and the rest of the GPU stays with the work beside
# it (session 13's fused router, ~130 blocks, slowed the shared expert on the side stream). 8 rows a block would
# spill (255 registers: a lane holds 4 steps of every row's weights).
NARROW_ROWS_PER_BLOCK = (1, 2, 4)
NARROW_BLOCKS = 66
NARROW_MAX_ROWS = 512  # the widest matrix Linear sends here (wider ones fill the GPU through the other kernels)
# x rows the fused routing takes: one warp of the last block a row. Past it the rows would queue on its warps
# (~1.5 us a row) while route_top_k spreads them over blocks.
FUSED_ROUTE_ROWS = NARROW_WARPS

_GEMV_ARGS = (float32[:, ::1], uint64[:, ::1], float32[:, ::1], int32)
_ROUTE_ARGS = (int32[::1], int32, int32, int32[:, ::1], float32[:, ::1])


def make_linear_narrow_kernel(R: int, route: bool):
    """The narrow GEMV with R output rows a block; `route`: the fused routing tail (extra arguments: the completion
    counter, experts, top_k, expert ids and weights)."""
    ACC = NARROW_X_ROWS * R
    LOADS = NARROW_STEPS * R

    @device_function
    def body(x, w, y, accumulate):
        sums = cuda.shared.array((NARROW_WARPS, ACC), float32)
        t = cuda.threadIdx.x
        lane, warp = t & 31, t >> 5
        K, N, K4 = x.shape[1], y.shape[1], w.shape[1]
        n0 = cuda.blockIdx.x * R
        row0 = cuda.blockIdx.y * NARROW_X_ROWS
        rows = min(NARROW_X_ROWS, x.shape[0] - row0)
        wa = cuda.local.array(LOADS, uint64)
        wb = cuda.local.array(LOADS, uint64)
        rowoff = cuda.local.array(R, int64)
        part = cuda.local.array(R, float32)
        for r in range(R):
            rowoff[r] = min(n0 + r, N - 1) * K4  # rows past N read row N-1 and store nothing
        for i in range(NARROW_STEPS):  # every weight load first
            c = (warp + NARROW_WARPS * i) * NARROW_SPAN + lane * 8
            if c < K:
                for r in range(R):
                    wa[i * R + r], wb[i * R + r] = load2(w, rowoff[r] + (c >> 2))
        for m in range(rows):  # the steps' loop is unrolled (the weights stay in registers), the rows' is not
            for r in range(R):
                part[r] = float32(0.0)
            p = (row0 + m) * K + lane * 8
            for i in range(NARROW_STEPS):
                c = (warp + NARROW_WARPS * i) * NARROW_SPAN
                if c + lane * 8 < K:
                    x0, x1, x2, x3 = load4(x, p + c)
                    x4, x5, x6, x7 = load4(x, p + c + 4)
                    for r in range(R):
                        part[r] = fma_bf16x8(part[r], wa[i * R + r], wb[i * R + r], x0, x1, x2, x3, x4, x5, x6, x7)
            for r in range(R):
                total = warp_sum(part[r])
                if lane == 0:
                    sums[warp, m * R + r] = total
        cuda.syncthreads()
        if t < rows * R:
            m, r = t // R, t % R
            n = n0 + r
            total = sums[0, t]
            for v in range(1, NARROW_WARPS):
                total += sums[v, t]
            if n < N:
                if accumulate != 0:
                    y[row0 + m, n] += total
                else:
                    y[row0 + m, n] = total

    if not route:
        @kernel(_GEMV_ARGS, fastmath=False)
        def linear_narrow_kernel(x, w, y, accumulate):
            body(x, w, y, accumulate)

        return linear_narrow_kernel

    @kernel(_GEMV_ARGS + _ROUTE_ARGS, fastmath=False)
    def linear_narrow_route_kernel(x, w, y, accumulate, counter, n_exp, top_k, expert_ids, weights):
        body(x, w, y, accumulate)
        last = cuda.shared.array(1, int32)
        cuda.threadfence()  # this block's logits are visible device-wide before it counts itself done
        cuda.syncthreads()
        t = cuda.threadIdx.x
        if t == 0:
            done = cuda.atomic.add(counter, 0, 1)
            last[0] = 1 if done == cuda.gridDim.x * cuda.gridDim.y - 1 else 0
        cuda.syncthreads()
        if last[0] != 0:  # every block's logits are written: route each row, one warp a row
            cuda.threadfence()
            if (t >> 5) < y.shape[0]:
                route_row(y, t >> 5, n_exp, top_k, expert_ids, weights, t & 31)
            if t == 0:
                counter[0] = 0  # ready for the next launch (a graph replays the same counter)

    return linear_narrow_route_kernel


_KERNELS = {(r, route): make_linear_narrow_kernel(r, route) for r in NARROW_ROWS_PER_BLOCK for route in (False, True)}


def narrow_rows_per_block(rows: int) -> int:
    """Output rows a block for a matrix of `rows` rows (see NARROW_BLOCKS)."""
    return next((r for r in NARROW_ROWS_PER_BLOCK if -(-rows // r) <= NARROW_BLOCKS), NARROW_ROWS_PER_BLOCK[-1])


def _launch(x, w, y, route: bool, *extra, stream, rows_per_block: int | None) -> None:
    M, K = x.shape
    N = y.shape[1]
    w64 = w.view(np.uint64) if w.dtype == np.uint16 else w
    if K % 8 or K > NARROW_MAX_K or w64.shape != (N, K // 4) or y.shape[0] != M:
        raise ValueError(f"narrow GEMV needs x [M, K], w [N, K] bf16, y [M, N], K % 8 == 0, K <= {NARROW_MAX_K}; "
                         f"got x {x.shape}, w {w.shape} {w.dtype}, y {y.shape}")
    r = rows_per_block or narrow_rows_per_block(N)
    grid = (blocks_for(N, r), math.ceil(M / NARROW_X_ROWS))
    _KERNELS[(r, route)][grid, 32 * NARROW_WARPS, stream](x, w64, y, *extra)


def linear_bf16_narrow(x, w, y, *, stream, accumulate: bool = False, rows_per_block: int | None = None) -> None:
    """y[M, N] (+)= x[M, K] @ w[N, K]^T (w uint16 bf16 bits or its uint64 view; x, y fp32). No allocation, no sync:
    capture-safe. Meant for N <= NARROW_MAX_ROWS; correct for any N (K <= NARROW_MAX_K). `rows_per_block` (one of
    NARROW_ROWS_PER_BLOCK; by default from N) changes the grid, never the bits."""
    if x.shape[0] and y.shape[1]:
        _launch(x, w, y, False, int32(1 if accumulate else 0), stream=stream, rows_per_block=rows_per_block)


def check_fused_route(top_k: int, experts: int, logits_shape: tuple[int, int]) -> None:
    """The ValueError of `linear_bf16_narrow_route` (and its host twin): `route_top_k`'s, and at most
    FUSED_ROUTE_ROWS rows."""
    rows, columns = logits_shape
    check_route(top_k, experts, columns)
    if rows > FUSED_ROUTE_ROWS:
        raise ValueError(f"the fused routing takes at most {FUSED_ROUTE_ROWS} rows, got {rows}")


def linear_bf16_narrow_route(x, w, logits, counter, top_k: int, expert_ids, weights, *, stream, experts: int,
                             rows_per_block: int | None = None) -> None:
    """logits = x @ w^T (the router's rows, then any more such as the shared expert's gate), then
    `route_top_k(logits, top_k, expert_ids, weights, experts=experts)` in the same launch. `counter`: int32 [1]
    device memory, zero before the first launch (each launch leaves it zero); launches sharing one must not run
    concurrently. At most FUSED_ROUTE_ROWS rows."""
    check_fused_route(top_k, experts, logits.shape)
    if logits.shape[0]:
        _launch(x, w, logits, True, int32(0), counter, int32(experts), int32(top_k), expert_ids, weights,
                stream=stream, rows_per_block=rows_per_block)


# ---- NumPy twins --------------------------------------------------------------------------------------------------

def linear_bf16_narrow_reference(x: np.ndarray, w: np.ndarray, y: np.ndarray | None = None, *,
                                 accumulate: bool = False) -> np.ndarray:
    """fp32 twin of `linear_bf16_narrow` (the product `linear_bf16` computes, in another summation order)."""
    return linear_bf16_reference(x, w, y, accumulate=accumulate)


def linear_bf16_narrow_route_reference(x: np.ndarray, w: np.ndarray, top_k: int, *, experts: int
                                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits, expert ids, weights) of `linear_bf16_narrow_route`."""
    logits = linear_bf16_reference(x, w)
    ids, weights = route_top_k_reference(logits[:, :experts], top_k)
    return logits, ids, weights
