"""Gated DeltaNet kernels (ninfer-facts §3.5): causal conv + state, q/k L2 norm + gates, the gated delta rule
recurrence, and the gated output RMSNorm. All math fp32; the CPU backend (`ninfer.backends.cpu.gdn`, `ops`) is the
reference, and each launcher has a NumPy twin `<launcher>_reference` computing the same function in place.

Work is organised by SEGMENTS: a segment is `seg_count[s]` consecutive rows starting at `seg_row[s]` that belong to
lane `seg_lane[s]` (decode: 1 row; MTP verify: k+1 rows; prefill: up to 8192 rows). A lane appears in at most one
segment per launch (its state is read at the start and written at the end of the launch). `seg_record[s] == 1` asks
for the state after the rows of the segment in the column buffers, t = row index inside the segment: the conv's after
every row (`conv_columns[lane, t]`, at least the segment's count of them), the recurrence's after every row but the
last (`ssm_columns[lane, t]`, t < count - 1), which the running state holds: a verify's selection never copies it,
and on the 27B it is 3 MB a layer a lane. Rows not covered by a segment are not written.

Batch invariance: every output element is computed by one thread (or one fixed group of lanes) with a fixed order of
operations that depends only on its own segment, never on the number of rows/segments in the launch or the grid.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, int64, uint16, uint64  # noqa: F401 (uint64: templates)

from ninfer.backends.cpu.gdn import causal_conv, conv_histories, gated_delta_rule
from ninfer.backends.cpu.ops import l2_normalize, rms_norm, sigmoid, silu, softplus
from ninfer.kernels_numba.common import (FULL_MASK, WARP, address_of, bf16_pair, bf16_target,  # noqa: F401
                                         blocks_for, f32_to_bf16, fragment_target, sigmoid_f32, store_words2_at,
                                         tf32_round, tf32_round_host, warp_sum)  # (FULL_MASK: templates)
from ninfer.kernels_numba.linear import (bf16_bits_to_f32, fma_bf16x8, load2, load4,  # noqa: F401 (templates)
                                         store4)
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel
from ninfer.kernels_numba.programmatic import (allow_dependents, launch,  # noqa: F401 (wait_for_prior_grids:
                                               wait_for_prior_grids)  # templates)
from ninfer.kernels_numba.quant_mma import check_fragment_output, fragment_half

F32 = np.float32

L2_EPS = 1e-6  # l2_normalize's eps (a sum, not a mean)
SOFTPLUS_THRESHOLD = 20.0

# ---------------------------------------------------------------------------------------------------------------
# shared device helpers




@device_function
def _softplus(x):
    if x > float32(SOFTPLUS_THRESHOLD):
        return x
    return float32(math.log1p(math.exp(x)))


# ---------------------------------------------------------------------------------------------------------------
# 1. causal conv + SiLU, carried state, recorded histories

CONV_TAPS = 4  # Qwen3.6's conv kernel (every model, the tiny test models too)
CONV_THREADS = 128  # channels per block (threadIdx.x)
# threads a block along rows (threadIdx.y): at 72 registers a 128 x 4 block fits once an SM (16 warps); 128 x 1
# blocks fit 7 times. H200, 8K-row prefill conv (bench/kernel_gdn.py): 35B-A3B 457 -> 280 us a layer, 27B 569 -> 349
# (2 rows a block: 313, 391)
CONV_ROWS = 1
CONV_FAST_ROWS = 8  # rows per thread in big launches
CONV_FAST_LOADS = CONV_FAST_ROWS + 3
CONV_FAST_MIN_ROWS = 256  # launches with at least this many rows use CONV_FAST_ROWS rows per thread

_CONV_SIG = (float32[:, ::1], float32[:, ::1], float32[:, :, ::1], float32[:, :, :, ::1], int32[::1], int32[::1],
             int32[::1], int32[::1], float32[:, ::1], int32, int32)


@device_function
def conv_silu(w0, w1, w2, w3, e0, e1, e2, e3):
    """`causal_conv`'s order (w0*e0, then + w_j*e_j, each a fused multiply-add), then SiLU. The FMAs are explicit:
    left to NVVM's contraction, `w0*e0 + w1*e1` fused either product depending on the code around it, and the
    conv's row path and 8-row path differed in the last bit (session 28)."""
    acc = w0 * e0
    acc = cuda.fma(w1, e1, acc)
    acc = cuda.fma(w2, e2, acc)
    acc = cuda.fma(w3, e3, acc)
    return acc * sigmoid_f32(acc)


@device_function
def _fast_segment(seg_row, seg_count, r0, rows_per_thread, rows):
    """The segment whose rows t >= 3 hold all CONV_FAST_ROWS rows from r0 (the conv kernels' fast path), or -1."""
    s = -1
    if rows_per_thread == CONV_FAST_ROWS and r0 + CONV_FAST_ROWS <= rows:
        for i in range(seg_row.shape[0]):
            first = seg_row[i]
            if first + 3 <= r0 and r0 + CONV_FAST_ROWS <= first + seg_count[i]:
                s = i
    return s


@device_function
def _segment_of(seg_row, seg_count, r):
    """The segment holding row r, or -1."""
    s = -1
    for i in range(seg_row.shape[0]):
        first = seg_row[i]
        if first <= r and r < first + seg_count[i]:
            s = i
    return s


@device_function
def _conv_row_segment(seg_row, seg_count, r):
    """The segment whose conv row r computes, or -1: rows 1 and 2 of a segment are its row 0's (they read the old
    state), and a row outside every segment is nobody's."""
    s = _segment_of(seg_row, seg_count, r)
    if s >= 0 and (r - seg_row[s] == 1 or r - seg_row[s] == 2):
        s = -1
    return s


@device_function
def _conv_one_row(projected, w0, w1, w2, w3, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out,
                  r, c):
    """Row r, channel c. Rows t >= 3 of a segment read their 4 inputs from `projected`; the thread of row 0 computes
    rows 0..2 (they read the old state) and then rewrites the state, so nothing else reads it."""
    s = _conv_row_segment(seg_row, seg_count, r)
    if s < 0:
        return
    start = seg_row[s]
    t = r - start
    lane = seg_lane[s]
    record = seg_record[s]
    if t >= 3:
        e0 = projected[r - 3, c]
        e1 = projected[r - 2, c]
        e2 = projected[r - 1, c]
        e3 = projected[r, c]
        out[r, c] = conv_silu(w0, w1, w2, w3, e0, e1, e2, e3)
        if record != 0:
            conv_columns[lane, t, 0, c] = e1
            conv_columns[lane, t, 1, c] = e2
            conv_columns[lane, t, 2, c] = e3
        return
    # t == 0: extended = old state (3) ++ the first rows (up to 3) ++ (for the new state) the last 3 rows.
    count = seg_count[s]
    x0 = conv_state[lane, 0, c]
    x1 = conv_state[lane, 1, c]
    x2 = conv_state[lane, 2, c]
    x3 = projected[start, c]
    x4 = projected[start + 1, c] if count > 1 else float32(0.0)
    x5 = projected[start + 2, c] if count > 2 else float32(0.0)
    out[start, c] = conv_silu(w0, w1, w2, w3, x0, x1, x2, x3)
    if count > 1:
        out[start + 1, c] = conv_silu(w0, w1, w2, w3, x1, x2, x3, x4)
    if count > 2:
        out[start + 2, c] = conv_silu(w0, w1, w2, w3, x2, x3, x4, x5)
    if record != 0:
        conv_columns[lane, 0, 0, c] = x1
        conv_columns[lane, 0, 1, c] = x2
        conv_columns[lane, 0, 2, c] = x3
        if count > 1:
            conv_columns[lane, 1, 0, c] = x2
            conv_columns[lane, 1, 1, c] = x3
            conv_columns[lane, 1, 2, c] = x4
        if count > 2:
            conv_columns[lane, 2, 0, c] = x3
            conv_columns[lane, 2, 1, c] = x4
            conv_columns[lane, 2, 2, c] = x5
    if count == 1:
        conv_state[lane, 0, c] = x1
        conv_state[lane, 1, c] = x2
        conv_state[lane, 2, c] = x3
    elif count == 2:
        conv_state[lane, 0, c] = x2
        conv_state[lane, 1, c] = x3
        conv_state[lane, 2, c] = x4
    else:
        end = start + count
        conv_state[lane, 0, c] = projected[end - 3, c]
        conv_state[lane, 1, c] = projected[end - 2, c]
        conv_state[lane, 2, c] = projected[end - 1, c]


@kernel(_CONV_SIG)
def _gdn_conv_kernel(projected, weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out,
                     channels, rows_per_thread):
    """A thread handles `rows_per_thread` consecutive rows of one channel. With CONV_FAST_ROWS rows that all lie in
    one segment at t >= 3, it loads the 3 + CONV_FAST_ROWS inputs at once; otherwise row by row. Both paths compute
    each output with the same arithmetic, so the path taken never changes a result."""
    c = cuda.blockIdx.x * CONV_THREADS + cuda.threadIdx.x
    r0 = (cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y) * rows_per_thread
    rows = projected.shape[0]
    if c >= channels or r0 >= rows:
        return
    w0 = weight[0, c]
    w1 = weight[1, c]
    w2 = weight[2, c]
    w3 = weight[3, c]
    s = _fast_segment(seg_row, seg_count, r0, rows_per_thread, rows)
    if s >= 0:
        # unsigned indices (r0 >= 3 here): signed ones cost each access numba's negative-index wrap
        first_row = uint64(r0 - 3)
        column = uint64(c)
        e = cuda.local.array(CONV_FAST_LOADS, float32)
        for j in range(CONV_FAST_LOADS):
            e[j] = projected[first_row + uint64(j), column]
        for j in range(CONV_FAST_ROWS):
            out[first_row + uint64(j + 3), column] = conv_silu(w0, w1, w2, w3, e[j], e[j + 1], e[j + 2], e[j + 3])
        if seg_record[s] != 0:
            lane = seg_lane[s]
            t0 = r0 - seg_row[s]
            for j in range(CONV_FAST_ROWS):
                conv_columns[lane, t0 + j, 0, c] = e[j + 1]
                conv_columns[lane, t0 + j, 1, c] = e[j + 2]
                conv_columns[lane, t0 + j, 2, c] = e[j + 3]
        return
    for r in range(r0, min(r0 + rows_per_thread, rows)):
        _conv_one_row(projected, w0, w1, w2, w3, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record,
                      out, r, c)


def gdn_conv(projected, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out, *,
             channels, stream, row_threads=CONV_ROWS, quads=None):
    """out[r, :C] = silu(causal depthwise conv of projected[:, :C] with carried state); updates conv_state in place;
    records the history after each row of recording segments into conv_columns[lane, t] ([K-1, C]). K must be 4.
    `row_threads`: threads a block along rows; `quads`: 4 channels a thread (`_gdn_conv_quads_kernel`, the same
    bits; C and the row lengths a multiple of 4). None takes it wherever the widths allow: on the H200 it ran
    0.85 of copy against the scalar kernel's 0.73 at both models' 8K prefill (bench/kernel_gdn.py, session 21)."""
    if conv_weight.shape[0] != CONV_TAPS:
        raise ValueError(f"gdn_conv supports a {CONV_TAPS}-tap conv, got {conv_weight.shape[0]}")
    quads_fit = _quads_fit(projected, conv_weight, conv_state, conv_columns, out, channels)
    if quads is None:
        quads = quads_fit
    if quads and not quads_fit:
        raise ValueError(f"gdn_conv's 4-channel variant needs channels, row lengths and the weight's, state's and "
                         f"histories' widths multiples of 4 and equal to the channels ({channels}, "
                         f"{projected.shape[1]}, {out.shape[1]}, {conv_weight.shape[1]}, {conv_state.shape[2]}, "
                         f"{conv_columns.shape[3]})")
    grid, per_thread = _conv_grid(projected.shape[0], channels // 4 if quads else channels, row_threads)
    function = _gdn_conv_quads_kernel if quads else _gdn_conv_kernel
    function[grid, (CONV_THREADS, row_threads), stream](projected, conv_weight, conv_state, conv_columns, seg_lane,
                                                        seg_row, seg_count, seg_record, out, np.int32(channels),
                                                        np.int32(per_thread))


def _quads_fit(projected, conv_weight, conv_state, conv_columns, out, channels: int) -> bool:
    """Whether the 4-channel kernel takes these widths: channels, row lengths and the weight's, state's and
    histories' widths multiples of 4 and equal to the channels."""
    return not (channels % 4 or projected.shape[1] % 4 or out.shape[1] % 4 or conv_weight.shape[1] != channels
                or conv_state.shape[2] != channels or conv_columns.shape[3] != channels)


def _conv_grid(rows: int, threads_across: int, row_threads: int) -> tuple[tuple[int, int], int]:
    """(grid, rows a thread) of a conv launch over `threads_across` channel threads (a channel or 4 each)."""
    per_thread = CONV_FAST_ROWS if rows >= CONV_FAST_MIN_ROWS else 1
    return (blocks_for(threads_across, CONV_THREADS), blocks_for(rows, row_threads * per_thread)), per_thread


def gdn_conv_reference(projected, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record,
                       out, *, channels):
    for s in range(len(seg_lane)):
        lane, start, count = int(seg_lane[s]), int(seg_row[s]), int(seg_count[s])
        x = projected[start:start + count, :channels]
        if seg_record[s]:
            conv_columns[lane, :count] = conv_histories(x, conv_state[lane])
        y, conv_state[lane] = causal_conv(x, conv_state[lane], conv_weight)
        out[start:start + count] = silu(y)


# The chunked prefill's conv with the q/k L2 norm of `gdn_gates` in the same pass (`gdn_conv_normed`): a warp of the
# 4-channel kernel holds one 128-dim q or k head of a row (lane l: dims 4l..4l+3, as a gates warp holds it), so the
# head's sum of squares is the gates kernel's warp sum, and the normalised, TF32-rounded q and k go straight to their
# arrays instead of through `mixed` and back (two passes of 2 x [R, Hqk * Dk] fp32: ~90 us a layer of the 35B-A3B's
# 8K prefill). The decays and betas stay with `gdn_gates(..., norms=False)`.

_CONV_QUADS_SIG = _CONV_SIG + (float32[:, :, ::1], float32[:, :, ::1], int32)


@device_function
def _store_normed(y0, y1, y2, y3, row, c, q_out, k_out, qk_width):
    """Channels c..c+3 of a conv output row, lanes of a warp holding one q or k head: `_gdn_gates_kernel`'s norm
    (sum of squares in its order, its warp sum; q also scaled by 1/sqrt(Dk)), TF32-rounded, into q_out or k_out."""
    total = warp_sum(((y0 * y0 + y1 * y1) + y2 * y2) + y3 * y3)
    denom = math.sqrt(total + float32(L2_EPS))
    if c < qk_width:
        scale = float32(NORMED_Q_SCALE)
        store4(q_out, row * qk_width + c, tf32_round((y0 / denom) * scale), tf32_round((y1 / denom) * scale),
               tf32_round((y2 / denom) * scale), tf32_round((y3 / denom) * scale))
    else:
        store4(k_out, row * qk_width + c - qk_width, tf32_round(y0 / denom), tf32_round(y1 / denom),
               tf32_round(y2 / denom), tf32_round(y3 / denom))


@device_function
def _store_normed_row(out, row, c, q_out, k_out, qk_width):
    """`_store_normed` of the conv output row this thread wrote to `out`."""
    y0, y1, y2, y3 = load4(out, int64(row) * out.shape[1] + c)
    _store_normed(y0, y1, y2, y3, int64(row), c, q_out, k_out, qk_width)


@device_function
def _silu_quad(w0, w1, w2, w3, e0, e1, e2, e3):
    """`conv_silu` of 4 channels: wj and ej are 4-tuples (tap j's weights, input j's values, one a channel)."""
    return (conv_silu(w0[0], w1[0], w2[0], w3[0], e0[0], e1[0], e2[0], e3[0]),
            conv_silu(w0[1], w1[1], w2[1], w3[1], e0[1], e1[1], e2[1], e3[1]),
            conv_silu(w0[2], w1[2], w2[2], w3[2], e0[2], e1[2], e2[2], e3[2]),
            conv_silu(w0[3], w1[3], w2[3], w3[3], e0[3], e1[3], e2[3], e3[3]))


@device_function
def _store_quad(array, at, v):
    store4(array, at, v[0], v[1], v[2], v[3])


@device_function
def _conv_row_quads(projected, weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out, r,
                    c):
    """`_conv_one_row` of channels c..c+3 at once: the same arithmetic a channel (the same bits), every load and
    store a 16-byte vector. Decode runs this path (a segment's row 0): channel by channel it was four chains of
    dependent loads in turn, ~7 us a 35B-A3B decode layer (session 27's profile)."""
    s = _conv_row_segment(seg_row, seg_count, r)
    if s < 0:
        return
    start = seg_row[s]
    t = r - start
    width = int64(weight.shape[1])
    w0 = load4(weight, c)
    w1 = load4(weight, width + c)
    w2 = load4(weight, 2 * width + c)
    w3 = load4(weight, 3 * width + c)
    lane = int64(seg_lane[s])
    record = seg_record[s]
    stride = int64(projected.shape[1])
    out_stride = int64(out.shape[1])
    history = int64(conv_columns.shape[1]) * 3  # conv_columns [lanes, steps, 3, C]: a lane's rows of C
    if t >= 3:
        at = int64(r) * stride + c
        e1 = load4(projected, at - 2 * stride)
        e2 = load4(projected, at - stride)
        e3 = load4(projected, at)
        _store_quad(out, int64(r) * out_stride + c, _silu_quad(w0, w1, w2, w3, load4(projected, at - 3 * stride),
                                                               e1, e2, e3))
        if record != 0:
            at = (lane * history + int64(t) * 3) * width + c
            _store_quad(conv_columns, at, e1)
            _store_quad(conv_columns, at + width, e2)
            _store_quad(conv_columns, at + 2 * width, e3)
        return
    # t == 0: extended = old state (3) ++ the first rows (up to 3) ++ (for the new state) the last 3 rows.
    count = seg_count[s]
    state = lane * 3 * width + c
    x0 = load4(conv_state, state)
    x1 = load4(conv_state, state + width)
    x2 = load4(conv_state, state + 2 * width)
    at = int64(start) * stride + c
    zero = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
    x3 = load4(projected, at)
    x4 = load4(projected, at + stride) if count > 1 else zero
    x5 = load4(projected, at + 2 * stride) if count > 2 else zero
    row = int64(start) * out_stride + c
    _store_quad(out, row, _silu_quad(w0, w1, w2, w3, x0, x1, x2, x3))
    if count > 1:
        _store_quad(out, row + out_stride, _silu_quad(w0, w1, w2, w3, x1, x2, x3, x4))
    if count > 2:
        _store_quad(out, row + 2 * out_stride, _silu_quad(w0, w1, w2, w3, x2, x3, x4, x5))
    if record != 0:
        at = lane * history * width + c
        _store_quad(conv_columns, at, x1)
        _store_quad(conv_columns, at + width, x2)
        _store_quad(conv_columns, at + 2 * width, x3)
        if count > 1:
            _store_quad(conv_columns, at + 3 * width, x2)
            _store_quad(conv_columns, at + 4 * width, x3)
            _store_quad(conv_columns, at + 5 * width, x4)
        if count > 2:
            _store_quad(conv_columns, at + 6 * width, x3)
            _store_quad(conv_columns, at + 7 * width, x4)
            _store_quad(conv_columns, at + 8 * width, x5)
    if count == 1:
        _store_quad(conv_state, state, x1)
        _store_quad(conv_state, state + width, x2)
        _store_quad(conv_state, state + 2 * width, x3)
    elif count == 2:
        _store_quad(conv_state, state, x2)
        _store_quad(conv_state, state + width, x3)
        _store_quad(conv_state, state + 2 * width, x4)
    else:
        end = int64(start + count) * stride + c
        _store_quad(conv_state, state, load4(projected, end - 3 * stride))
        _store_quad(conv_state, state + width, load4(projected, end - 2 * stride))
        _store_quad(conv_state, state + 2 * width, load4(projected, end - stride))


@device_function
def _conv_quads(projected, weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out, channels,
                rows_per_thread, q_out, k_out, qk_width):
    """A thread of the 4-channel conv (`_gdn_conv_quads_kernel`). With qk_width > 0 (`_gdn_conv_normed_kernel`; 0:
    q_out / k_out unused), in the warps of q and k channels (c < 2 qk_width) each row is then normalised into q_out /
    k_out. Fast-path rows skip `out` there; other rows write it as the conv does and normalise what this thread
    wrote: row r for t >= 3, rows 0..2 of a segment from its row 0 (their thread, as `_conv_one_row` computes them).
    Every branch around a warp sum is warp-uniform: a warp shares its rows, and its 128 channels one head."""
    c = (cuda.blockIdx.x * CONV_THREADS + cuda.threadIdx.x) * 4
    r0 = (cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y) * rows_per_thread
    rows = projected.shape[0]
    if c >= channels or r0 >= rows:
        return
    normed = c < 2 * qk_width
    width = channels
    w00, w01, w02, w03 = load4(weight, c)
    w10, w11, w12, w13 = load4(weight, width + c)
    w20, w21, w22, w23 = load4(weight, 2 * width + c)
    w30, w31, w32, w33 = load4(weight, 3 * width + c)
    s = _fast_segment(seg_row, seg_count, r0, rows_per_thread, rows)
    if s >= 0:
        stride = int64(projected.shape[1])
        out_stride = int64(out.shape[1])
        e0 = cuda.local.array(CONV_FAST_LOADS, float32)
        e1 = cuda.local.array(CONV_FAST_LOADS, float32)
        e2 = cuda.local.array(CONV_FAST_LOADS, float32)
        e3 = cuda.local.array(CONV_FAST_LOADS, float32)
        for j in range(CONV_FAST_LOADS):
            e0[j], e1[j], e2[j], e3[j] = load4(projected, (int64(r0 - 3) + j) * stride + c)
        for j in range(CONV_FAST_ROWS):
            y0 = conv_silu(w00, w10, w20, w30, e0[j], e0[j + 1], e0[j + 2], e0[j + 3])
            y1 = conv_silu(w01, w11, w21, w31, e1[j], e1[j + 1], e1[j + 2], e1[j + 3])
            y2 = conv_silu(w02, w12, w22, w32, e2[j], e2[j + 1], e2[j + 2], e2[j + 3])
            y3 = conv_silu(w03, w13, w23, w33, e3[j], e3[j + 1], e3[j + 2], e3[j + 3])
            if normed:
                _store_normed(y0, y1, y2, y3, int64(r0) + j, c, q_out, k_out, qk_width)
            else:
                store4(out, (int64(r0) + j) * out_stride + c, y0, y1, y2, y3)
        if seg_record[s] != 0:
            lane = int64(seg_lane[s])
            t0 = int64(r0 - seg_row[s])
            steps = int64(conv_columns.shape[1])
            for j in range(CONV_FAST_ROWS):
                at = ((lane * steps + t0 + j) * 3) * width + c
                store4(conv_columns, at, e0[j + 1], e1[j + 1], e2[j + 1], e3[j + 1])
                store4(conv_columns, at + width, e0[j + 2], e1[j + 2], e2[j + 2], e3[j + 2])
                store4(conv_columns, at + 2 * width, e0[j + 3], e1[j + 3], e2[j + 3], e3[j + 3])
        return
    for r in range(r0, min(r0 + rows_per_thread, rows)):
        _conv_row_quads(projected, weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out, r,
                        c)
        if normed:
            seg = _segment_of(seg_row, seg_count, r)
            if seg >= 0:
                t = r - seg_row[seg]
                if t >= 3:
                    _store_normed_row(out, r, c, q_out, k_out, qk_width)
                elif t == 0:
                    for j in range(min(seg_count[seg], 3)):
                        _store_normed_row(out, r + j, c, q_out, k_out, qk_width)


@kernel(_CONV_SIG)
def _gdn_conv_quads_kernel(projected, weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record,
                           out, channels, rows_per_thread):
    """`_gdn_conv_kernel` with 4 consecutive channels a thread: the fast path's rows, weights, outputs and recorded
    histories move as 16-byte vectors (the scalar kernel is issue-bound at ~0.73 of copy on the 35B-A3B's 8K
    prefill); every value is the same arithmetic, so the same bits. Other rows take the scalar path a channel at a
    time. Channels and every row length a multiple of 4 (`gdn_conv` checks). (conv_state stands in for the q / k
    arrays `_conv_quads` never writes without norms.)"""
    _conv_quads(projected, weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out, channels,
                rows_per_thread, conv_state, conv_state, int32(0))


@kernel(_CONV_QUADS_SIG)
def _gdn_conv_normed_kernel(projected, weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record,
                            out, channels, rows_per_thread, q_out, k_out, qk_width):
    """`_gdn_conv_quads_kernel` with q and k normalised in its pass (`gdn_conv_normed`)."""
    _conv_quads(projected, weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out, channels,
                rows_per_thread, q_out, k_out, qk_width)


def gdn_conv_normed(projected, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out,
                    q_out, k_out, *, channels, qk_heads, k_dim, stream):
    """`gdn_conv`, then `gdn_gates(..., tf32=True)`'s q_out / k_out ([R, Hqk, Dk]) from its output in the same pass;
    `out`'s q and k columns are then left unspecified (the v columns are the conv's). The decays and betas come
    from `gdn_gates(..., norms=False)`. Takes Dk = MAX_HEAD_DIM (a warp a head) and the 4-channel kernel's widths
    with channels a multiple of it (`conv_normed_fits`)."""
    if not conv_normed_fits(projected, conv_weight, conv_state, conv_columns, out, channels=channels, k_dim=k_dim):
        raise ValueError(f"gdn_conv_normed takes k_dim {MAX_HEAD_DIM}, channels a multiple of it, and the 4-channel "
                         f"conv's widths; got k_dim {k_dim}, channels {channels}")
    grid, per_thread = _conv_grid(projected.shape[0], channels // 4, CONV_ROWS)
    _gdn_conv_normed_kernel[grid, (CONV_THREADS, CONV_ROWS), stream](
        projected, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, out,
        np.int32(channels), np.int32(per_thread), q_out, k_out, np.int32(qk_heads * k_dim))


def conv_normed_fits(projected, conv_weight, conv_state, conv_columns, out, *, channels: int, k_dim: int) -> bool:
    """Whether `gdn_conv_normed` takes these shapes."""
    return (k_dim == MAX_HEAD_DIM and channels % MAX_HEAD_DIM == 0
            and _quads_fit(projected, conv_weight, conv_state, conv_columns, out, channels))


def gdn_conv_normed_reference(projected, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count,
                              seg_record, out, q_out, k_out, *, channels, qk_heads, k_dim):
    gdn_conv_reference(projected, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record,
                       out, channels=channels)
    width = qk_heads * k_dim
    rows = out.shape[0]
    q_out[:] = tf32_round_host(l2_normalize(out[:, :width].reshape(rows, qk_heads, k_dim), L2_EPS)
                               * F32(1.0 / np.sqrt(k_dim)))
    k_out[:] = tf32_round_host(l2_normalize(out[:, width:2 * width].reshape(rows, qk_heads, k_dim), L2_EPS))


# ---------------------------------------------------------------------------------------------------------------
# 2. q/k L2 norm (q scaled by 1/sqrt(Dk)) and the gates

GATES_WARPS = 8
PER_LANE = 4  # head dims up to 4 * 32 = 128: a lane holds 4 consecutive dims (one 16-byte load), a warp a head
MAX_HEAD_DIM = PER_LANE * WARP
# q's 1/sqrt(Dk) at Dk = MAX_HEAD_DIM as the gates kernel computes it (fp32 sqrt, then fp32 divide: the same bits):
# `gdn_conv_normed` takes it as a constant instead of a sqrt and a divide each row of each thread
NORMED_Q_SCALE = float(F32(1.0) / np.sqrt(F32(MAX_HEAD_DIM)))

_GATES_SIG = (float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], float32[:, :, ::1], float32[:, :, ::1],
              float32[:, ::1], float32[:, ::1], int32, int32, int32, int32, int32)


@kernel(_GATES_SIG)
def _gdn_gates_kernel(mixed, ab, neg_a, dt_bias, q_out, k_out, log_decay, beta, qk_heads, v_heads, k_dim, tf32,
                      norms):
    """A warp a (row, task) of a flat grid: tasks 0 .. 2 Hqk - 1 normalise a q or k head (a lane's 4 consecutive
    dims by one 16-byte load and store; 4-byte accesses a lane and a block a row ran at ~0.5 of copy on the 35B-A3B's
    8K prefill), task 2 Hqk writes the row's decays and betas (the only task without `norms`)."""
    tasks = 2 * qk_heads + 1 if norms else 1
    item = cuda.blockIdx.x * GATES_WARPS + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    row = item // tasks
    w = item - row * tasks + (0 if norms else 2 * qk_heads)
    if row >= mixed.shape[0]:
        return
    if w < 2 * qk_heads:  # warp-uniform branch
        which = w // qk_heads
        head = w - which * qk_heads
        live = lane * PER_LANE < k_dim
        x0 = x1 = x2 = x3 = float32(0.0)
        if live:
            x0, x1, x2, x3 = load4(mixed, row * mixed.shape[1] + (which * qk_heads + head) * k_dim + lane * PER_LANE)
        total = warp_sum(((x0 * x0 + x1 * x1) + x2 * x2) + x3 * x3)
        denom = math.sqrt(total + float32(L2_EPS))
        if live:
            at = (row * qk_heads + head) * k_dim + lane * PER_LANE
            if which == 0:
                scale = float32(1.0) / math.sqrt(float32(k_dim))
                y0, y1, y2, y3 = (x0 / denom) * scale, (x1 / denom) * scale, (x2 / denom) * scale, (x3 / denom) * scale
            else:
                y0, y1, y2, y3 = x0 / denom, x1 / denom, x2 / denom, x3 / denom
            if tf32:
                y0, y1, y2, y3 = tf32_round(y0), tf32_round(y1), tf32_round(y2), tf32_round(y3)
            if which == 0:
                store4(q_out, at, y0, y1, y2, y3)
            else:
                store4(k_out, at, y0, y1, y2, y3)
    else:
        for h in range(lane, v_heads, WARP):
            log_decay[row, h] = neg_a[h] * _softplus(ab[row, h] + dt_bias[h])
            beta[row, h] = sigmoid_f32(ab[row, v_heads + h])


def gdn_gates(mixed, ab, neg_a, dt_bias, q_out, k_out, log_decay, beta, *, qk_heads, v_heads, k_dim, stream,
              tf32=False, norms=True):
    """q_out/k_out [R, Hqk, Dk] = l2norm(q|k head) (q * 1/sqrt(Dk)); log_decay = neg_a * softplus(a + dt_bias),
    beta = sigmoid(b), each [R, Hv], from ab [R, 2*Hv] = a | b. Dk a multiple of 4, at most MAX_HEAD_DIM; mixed's
    rows a multiple of 4 long (16-byte loads). `tf32`: q and k rounded to TF32 (`common.tf32_round`), the operands
    `gdn_chunked` takes; without it they are the fp32 values `gdn_recurrent` (and the gated recurrence) use.
    `norms=False`: only the decays and betas (q and k came from `gdn_conv_normed`)."""
    if k_dim > MAX_HEAD_DIM or k_dim % PER_LANE or mixed.shape[1] % PER_LANE:
        raise ValueError(f"gdn_gates takes k_dim <= {MAX_HEAD_DIM}, a multiple of {PER_LANE}, and rows of a "
                         f"multiple of {PER_LANE}; got k_dim {k_dim}, rows of {mixed.shape[1]}")
    rows = mixed.shape[0]
    if rows:
        warps = rows * (2 * qk_heads + 1 if norms else 1)
        _gdn_gates_kernel[blocks_for(warps, GATES_WARPS), GATES_WARPS * WARP, stream](
            mixed, ab, neg_a, dt_bias, q_out, k_out, log_decay, beta, np.int32(qk_heads), np.int32(v_heads),
            np.int32(k_dim), np.int32(bool(tf32)), np.int32(bool(norms)))


def gdn_gates_reference(mixed, ab, neg_a, dt_bias, q_out, k_out, log_decay, beta, *, qk_heads, v_heads, k_dim,
                        tf32=False, norms=True):
    rows = mixed.shape[0]
    width = qk_heads * k_dim
    rounded = tf32_round_host if tf32 else np.asarray
    if norms:
        q_out[:] = rounded(l2_normalize(mixed[:, :width].reshape(rows, qk_heads, k_dim), L2_EPS)
                           * F32(1.0 / np.sqrt(k_dim)))
        k_out[:] = rounded(l2_normalize(mixed[:, width:2 * width].reshape(rows, qk_heads, k_dim), L2_EPS))
    log_decay[:] = neg_a * softplus(ab[:, :v_heads] + dt_bias)
    beta[:] = sigmoid(ab[:, v_heads:2 * v_heads])


# ---------------------------------------------------------------------------------------------------------------
# 3. the gated delta rule, recurrent form
#
# Block = REC_COLS value columns of one v head of one segment, G key groups (G/2 warps). In a warp, lane = g * (32/G)
# + c: 32/G consecutive columns x G key groups; the thread (g, c) keeps state rows i = ii * G + g (ii < Dk/G) of its
# column in registers. The reductions over Dk are a fixed in-thread order (two interleaved partial sums) then an
# xor-butterfly over the G groups. Rows are staged in shared memory REC_CHUNK at a time, double-buffered: the global
# loads of the next chunk are issued into registers before the current chunk is computed.

REC_COLS = 16  # value columns per block
REC_CHUNK = 8  # rows staged per shared-memory buffer
REC_GROUP_CHOICES = (4, 8)
REC_DEFAULT_GROUPS = 4

_REC_SIG = (float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1],
            float32[:, :, :, ::1], float32[:, :, :, :, ::1], int32[::1], int32[::1], int32[::1], int32[::1],
            float32[:, :, ::1], int32, int32, int32, int32)
# the gated form: (mixed, ab, neg_a, dt_bias) in place of (q, k, mixed, log_decay, beta)
_REC_GATED_SIG = (float32[:, ::1], float32[:, ::1], float32[::1], float32[::1]) + _REC_SIG[5:]
# the projected form: (mixed, x, w_ab, neg_a, dt_bias), x the fp32 normed rows, w_ab's bf16 rows as uint64 words
_REC_PROJECTED_SIG = (float32[:, ::1], float32[:, ::1], uint64[:, ::1], float32[::1], float32[::1]) + _REC_SIG[5:]

_REC_LOAD = """
        for e in range({pf}):
            idx = tid + e * {threads}
            r = idx // {k_dim}
            i = idx - r * {k_dim}
            if nxt + r < count:
{load_qk}
        for e in range({pv}):
            idx = tid + e * {threads}
            r = idx // REC_COLS
            cc = idx - r * REC_COLS
            if nxt + r < count and col0 + cc < v_dim:
                pv[e] = mixed[uint64(start + nxt + r), uint64(v_base + cc)]
{load_gates}
"""

# q and k rows as gdn_gates writes them, or (gated) raw from the conv output, normalised once staged
_QK_PLAIN = """                pk[e] = k[uint64(start + nxt + r), uint64(hq), uint64(i)]
                pq[e] = q[uint64(start + nxt + r), uint64(hq), uint64(i)]"""
_QK_GATED = """                pk[e] = mixed[uint64(start + nxt + r), uint64(k_channel + i)]
                pq[e] = mixed[uint64(start + nxt + r), uint64(q_channel + i)]"""
_GATES_PLAIN = """        if tid < REC_CHUNK and nxt + tid < count:
            pg = math.exp(log_decay[start + nxt + tid, h])
            pb = beta[start + nxt + tid, h]"""
# gdn_gates' arithmetic for this row and head (log decay, then its exp here, as the plain form reads it)
_GATES_GATED = """        if tid < REC_CHUNK and nxt + tid < count:
            pg = math.exp(neg_a[h] * _softplus(ab[start + nxt + tid, h] + dt_bias[h]))
            pb = sigmoid_f32(ab[start + nxt + tid, v_heads + h])"""
# (projected) the a / b projection of the chunk's rows for this head by the whole block: a thread's 8-column
# groups t, t + threads, ... of x . w_ab[h] and x . w_ab[Hv + h] in order, the warp's butterfly, then the warps' in
# order; then gdn_gates' arithmetic on them. Every thread runs it (barrier inside). The groups go PROJ_UNROLL a pass
# with every load of the pass issued before its first product: one L2 round trip a pass (the loop a group at a time
# took one a group, ten on the 27B's 5120 columns: the step lost 0.09 ms).
PROJ_UNROLL = 4


def _projection_pass(threads: int) -> str:
    """One pass of `_GATES_PROJECTED`'s dot products: groups gi + u * threads, u < PROJ_UNROLL. Every load is
    unconditional (a group past the row reads the last one again; its products are skipped), so ptxas issues them
    all before the first product instead of branching around some (which kept a group's products ahead of the next
    group's loads). Signed group indices: numba turns int64-with-uint64 arithmetic into float64."""
    loads, products = [], []
    for u in range(PROJ_UNROLL):
        at = f"g{u}"
        loads.append(
            f"                {at} = min(gi + {u * threads}, x_groups - 1)\n"
            f"                x{u}_0, x{u}_1, x{u}_2, x{u}_3 = load4(x, x_at + uint64(8 * {at}))\n"
            f"                x{u}_4, x{u}_5, x{u}_6, x{u}_7 = load4(x, x_at + uint64(8 * {at} + 4))\n"
            f"                a{u}_0, a{u}_1 = load2(w_ab, a_at + uint64(2 * {at}))\n"
            f"                b{u}_0, b{u}_1 = load2(w_ab, b_at + uint64(2 * {at}))\n")
        xs = ", ".join(f"x{u}_{j}" for j in range(8))
        guard, indent = ("", "                ") if u == 0 else (
            f"                if gi + {u * threads} < x_groups:\n", "                    ")
        products.append(f"{guard}{indent}sa = fma_bf16x8(sa, a{u}_0, a{u}_1, {xs})\n"
                        f"{indent}sb = fma_bf16x8(sb, b{u}_0, b{u}_1, {xs})\n")
    return "".join(loads) + "".join(products) + f"                gi += {PROJ_UNROLL * threads}\n"


_GATES_PROJECTED = """        for rr in range(min(REC_CHUNK, count - nxt)):
            x_at = uint64(start + nxt + rr) * x_width
            x_groups = int64(x_width // uint64(8))
            sa = float32(0.0)
            sb = float32(0.0)
            gi = int64(tid)
            while gi < x_groups:
{projection_pass}            sa = warp_sum(sa)
            sb = warp_sum(sb)
            if lane == 0:
                ab_sh[(tid // WARP) * 2 * REC_CHUNK + 2 * rr] = sa
                ab_sh[(tid // WARP) * 2 * REC_CHUNK + 2 * rr + 1] = sb
        cuda.syncthreads()
        if tid < REC_CHUNK and nxt + tid < count:
            sa = float32(0.0)
            sb = float32(0.0)
            for wv in range({warps}):
                sa += ab_sh[wv * 2 * REC_CHUNK + 2 * tid]
                sb += ab_sh[wv * 2 * REC_CHUNK + 2 * tid + 1]
            pg = math.exp(neg_a[h] * _softplus(sa + dt_bias[h]))
            pb = sigmoid_f32(sb)"""
# gdn_gates' L2 norms of the staged rows' q and k (a warp a row's q or k, a lane its 4 consecutive dims: the same
# sums, butterfly and roundings, so the same bits), between the staging barrier and one more
_NORMALIZE = """
        for item in range(tid // WARP, 2 * min(REC_CHUNK, count - base), {threads} // WARP):
            at = uint64(off + (item >> 1) * {k_dim} + 4 * lane)
            live = 4 * lane < {k_dim}
            x0 = x1 = x2 = x3 = float32(0.0)
            if live:
                if (item & 1) == 0:
                    x0, x1, x2, x3 = q_sh[at], q_sh[at + uint64(1)], q_sh[at + uint64(2)], q_sh[at + uint64(3)]
                else:
                    x0, x1, x2, x3 = k_sh[at], k_sh[at + uint64(1)], k_sh[at + uint64(2)], k_sh[at + uint64(3)]
            denom = math.sqrt(warp_sum(((x0 * x0 + x1 * x1) + x2 * x2) + x3 * x3) + float32(L2_EPS))
            scale = float32(1.0) / math.sqrt(float32({k_dim}))
            if live:
                if (item & 1) == 0:
                    q_sh[at] = (x0 / denom) * scale
                    q_sh[at + uint64(1)] = (x1 / denom) * scale
                    q_sh[at + uint64(2)] = (x2 / denom) * scale
                    q_sh[at + uint64(3)] = (x3 / denom) * scale
                else:
                    k_sh[at] = x0 / denom
                    k_sh[at + uint64(1)] = x1 / denom
                    k_sh[at + uint64(2)] = x2 / denom
                    k_sh[at + uint64(3)] = x3 / denom
        cuda.syncthreads()
"""

_RECURRENT_SOURCE = """
def gdn_recurrent_kernel_dk{k_dim}_g{groups}{suffix}({inputs}, ssm_state, ssm_columns, seg_lane,
                                            seg_row, seg_count, seg_record, out, qk_heads, v_heads, v_dim,
                                            channels_qk):
    k_sh = cuda.shared.array({stage2}, float32)
    q_sh = cuda.shared.array({stage2}, float32)
    v_sh = cuda.shared.array({vstage2}, float32)
    g_sh = cuda.shared.array({chunk2}, float32)
    b_sh = cuda.shared.array({chunk2}, float32)
{projected_setup}    st = cuda.local.array({ni}, float32)
    kk = cuda.local.array({ni}, float32)
    pk = cuda.local.array({pf}, float32)
    pq = cuda.local.array({pf}, float32)
    pv = cuda.local.array({pv}, float32)
    pg = float32(0.0)
    pb = float32(0.0)

    seg = cuda.blockIdx.x
    h = cuda.blockIdx.y
    col0 = cuda.blockIdx.z * REC_COLS
    tid = cuda.threadIdx.x
    lane = tid % WARP
    g = lane // {per_warp}
    c = (tid // WARP) * {per_warp} + lane % {per_warp}
    col = col0 + c
    active = col < v_dim
    slot = seg_lane[seg]
    start = seg_row[seg]
    count = seg_count[seg]
    record = seg_record[seg]
    hq = h // (v_heads // qk_heads)
    v_base = channels_qk + h * v_dim + col0
    q_channel = hq * {k_dim}
    k_channel = (channels_qk >> 1) + hq * {k_dim}
{projected_rows}
    uslot = uint64(slot)
    uh = uint64(h)
    ucol = uint64(col)
    for ii in range({ni}):
        st[ii] = ssm_state[uslot, uh, uint64(ii * {groups} + g), ucol] if active else float32(0.0)
    # launched programmatically, the state (no other kernel of the step touches it) is in flight while the conv
    # before finishes; its outputs (q, k, v, the gates) are read only past this
    wait_for_prior_grids()

    chunks = (count + REC_CHUNK - 1) // REC_CHUNK
    if chunks > 0:
        nxt = 0
{load}
    for chunk in range(chunks):
        buf = chunk & 1
        base = chunk * REC_CHUNK
        off = buf * {stage}
        for e in range({pf}):
            k_sh[uint64(off + tid + e * {threads})] = pk[e]
            q_sh[uint64(off + tid + e * {threads})] = pq[e]
        for e in range({pv}):
            v_sh[uint64(buf * {vstage} + tid + e * {threads})] = pv[e]
        if tid < REC_CHUNK:
            g_sh[buf * REC_CHUNK + tid] = pg
            b_sh[buf * REC_CHUNK + tid] = pb
        cuda.syncthreads()
{normalize}        if chunk + 1 < chunks:
            nxt = base + REC_CHUNK
{load}
        n = min(REC_CHUNK, count - base)
        for r in range(n):
            # Unsigned indices: numba adds negative-index wraparound arithmetic to every signed index.
            decay = g_sh[uint64(buf * REC_CHUNK + r)]
            kb = uint64(off + r * {k_dim} + g)
            p0 = float32(0.0)
            p1 = float32(0.0)
            for ii in range({half}):
                k0 = k_sh[kb + uint64((2 * ii) * {groups})]
                k1 = k_sh[kb + uint64((2 * ii + 1) * {groups})]
                kk[2 * ii] = k0
                kk[2 * ii + 1] = k1
                s0 = st[2 * ii] * decay
                s1 = st[2 * ii + 1] * decay
                st[2 * ii] = s0
                st[2 * ii + 1] = s1
                p0 += s0 * k0
                p1 += s1 * k1
            pred = p0 + p1
{reduce_pred}
            u = b_sh[uint64(buf * REC_CHUNK + r)] * (v_sh[uint64(buf * {vstage} + r * REC_COLS + c)] - pred)
            o0 = float32(0.0)
            o1 = float32(0.0)
            for ii in range({half}):
                s0 = st[2 * ii] + kk[2 * ii] * u
                s1 = st[2 * ii + 1] + kk[2 * ii + 1] * u
                st[2 * ii] = s0
                st[2 * ii + 1] = s1
                o0 += s0 * q_sh[kb + uint64((2 * ii) * {groups})]
                o1 += s1 * q_sh[kb + uint64((2 * ii + 1) * {groups})]
            o = o0 + o1
{reduce_o}
            if active:
                if g == 0:
                    out[start + base + r, h, col] = o
                if record != 0 and base + r + 1 < count:  # the last row's state is the running state
                    for ii in range({ni}):
                        ssm_columns[uslot, uint64(base + r), uh, uint64(ii * {groups} + g), ucol] = st[ii]

    if active:
        for ii in range({ni}):
            ssm_state[uslot, uh, uint64(ii * {groups} + g), ucol] = st[ii]
"""


def _make_recurrent_kernel(k_dim: int, groups: int, gated: bool = False, projected: bool = False):
    """One compiled variant per (key dim, key groups, form): numba needs the register-array and shared-array sizes
    as literals, so the source is instantiated with them (closure constants are not literal enough for
    `cuda.shared.array`). `gated`: q, k, the decay and beta from the conv output and the a/b projection (gdn_gates'
    work done in this kernel: one launch fewer a decode layer). `projected` (gated too): the a/b projection itself
    computed here from the normed rows (`gdn_recurrent_projected`)."""
    gated = gated or projected
    threads = REC_COLS * groups  # (32 / groups) columns per warp, REC_COLS columns per block
    per_warp = WARP // groups
    assert k_dim % (2 * groups) == 0 and (REC_CHUNK * k_dim) % threads == 0
    assert (REC_CHUNK * REC_COLS) % threads == 0 and REC_CHUNK <= threads
    ni = k_dim // groups
    offsets = []
    step = per_warp
    while step < WARP:
        offsets.append(step)
        step *= 2

    def butterfly(name):
        return "\n".join(f"            {name} += cuda.shfl_xor_sync(FULL_MASK, {name}, {o})" for o in offsets)

    sizes = dict(k_dim=k_dim, groups=groups, threads=threads, per_warp=per_warp, ni=ni, half=ni // 2,
                 stage=REC_CHUNK * k_dim, stage2=2 * REC_CHUNK * k_dim, vstage=REC_CHUNK * REC_COLS,
                 vstage2=2 * REC_CHUNK * REC_COLS, chunk2=2 * REC_CHUNK, pf=REC_CHUNK * k_dim // threads,
                 pv=REC_CHUNK * REC_COLS // threads)
    sizes["warps"] = threads // WARP
    gates = (_GATES_PROJECTED.format(projection_pass=_projection_pass(threads), **sizes) if projected
             else _GATES_GATED if gated else _GATES_PLAIN)
    load = _REC_LOAD.format(load_qk=_QK_GATED if gated else _QK_PLAIN, load_gates=gates, **sizes)
    suffix = "_projected" if projected else "_gated" if gated else ""
    inputs = ("mixed, x, w_ab, neg_a, dt_bias" if projected else "mixed, ab, neg_a, dt_bias" if gated
              else "q, k, mixed, log_decay, beta")
    setup = f"    ab_sh = cuda.shared.array({2 * REC_CHUNK * threads // WARP}, float32)\n" if projected else ""
    rows = ("    x_width = uint64(x.shape[1])\n    a_at = uint64(h) * (x_width // uint64(4))\n"
            "    b_at = uint64(v_heads + h) * (x_width // uint64(4))\n") if projected else ""
    source = _RECURRENT_SOURCE.format(load=load, reduce_pred=butterfly("pred"), reduce_o=butterfly("o"),
                                      normalize=_NORMALIZE.format(**sizes) if gated else "", suffix=suffix,
                                      inputs=inputs, projected_setup=setup, projected_rows=rows, **sizes)
    name = f"gdn_recurrent_kernel_dk{k_dim}_g{groups}{suffix}"
    namespace = dict(globals())
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102  (our own template, literal sizes only)
    function = namespace[name]
    function.__module__ = __name__
    return kernel(_REC_PROJECTED_SIG if projected else _REC_GATED_SIG if gated else _REC_SIG)(function), threads


# Key dims with a compiled variant: the real models (128) and the tiny test models (16); key groups 4 and 8.
_RECURRENT_KERNELS = {(dk, g): _make_recurrent_kernel(dk, g) for dk in (16, 32, 64, 128) for g in REC_GROUP_CHOICES}
_GATED_RECURRENT_KERNELS = {(dk, g): _make_recurrent_kernel(dk, g, gated=True) for dk in (16, 32, 64, 128)
                            for g in REC_GROUP_CHOICES}
_PROJECTED_RECURRENT_KERNELS = {(dk, g): _make_recurrent_kernel(dk, g, projected=True) for dk in (16, 32, 64, 128)
                                for g in REC_GROUP_CHOICES}


def gdn_recurrent(q, k, mixed, log_decay, beta, ssm_state, ssm_columns, seg_lane, seg_row, seg_count, seg_record,
                  out, *, qk_heads, v_heads, k_dim, v_dim, channels_qk, stream, groups=REC_DEFAULT_GROUPS):
    """Per segment row and v head h (qk head h // (Hv/Hqk), v = mixed[:, channels_qk + h*Dv ...]):
    S = exp(g) S; u = beta (v - S^T k); S += k u^T; out[r, h] = S^T q. Updates ssm_state [lanes, Hv, Dk, Dv] in
    place; records S after each row but the last of recording segments into ssm_columns[lane, t] (the last row's is
    the new ssm_state). `groups` (4 or 8) is the number
    of lanes sharing one value column's Dk reduction; it changes the summation order, so keep it fixed per deployment
    (batch invariance holds for a fixed `groups`). k_dim must be 16, 32, 64 or 128."""
    if (k_dim, groups) not in _RECURRENT_KERNELS:
        raise ValueError(f"gdn_recurrent has no variant for k_dim={k_dim}, groups={groups}")
    function, threads = _RECURRENT_KERNELS[(k_dim, groups)]
    segments = seg_lane.shape[0]
    grid = (segments, v_heads, blocks_for(v_dim, REC_COLS))
    function[grid, threads, stream](
        q, k, mixed, log_decay, beta, ssm_state, ssm_columns, seg_lane, seg_row, seg_count, seg_record, out,
        np.int32(qk_heads), np.int32(v_heads), np.int32(v_dim), np.int32(channels_qk))


def gdn_recurrent_gated(mixed, ab, neg_a, dt_bias, ssm_state, ssm_columns, seg_lane, seg_row, seg_count, seg_record,
                        out, *, qk_heads, v_heads, k_dim, v_dim, channels_qk, stream, groups=REC_DEFAULT_GROUPS,
                        programmatic=False):
    """`gdn_gates` then `gdn_recurrent` in one launch (the decode path): q and k from the conv output `mixed`
    (L2-normalised in the kernel, q scaled by 1/sqrt(Dk)), the decay and beta from ab [R, 2*Hv] = a | b, with
    gdn_gates' arithmetic, so the results equal the two launches' bit for bit. `programmatic`: launched to start
    while the kernel before finishes (`kernels_numba.programmatic`; its state loads before the wait), the same
    bits."""
    if (k_dim, groups) not in _GATED_RECURRENT_KERNELS:
        raise ValueError(f"gdn_recurrent_gated has no variant for k_dim={k_dim}, groups={groups}")
    function, threads = _GATED_RECURRENT_KERNELS[(k_dim, groups)]
    grid = (seg_lane.shape[0], v_heads, blocks_for(v_dim, REC_COLS))
    launch(function, grid, threads, stream, 0, mixed, ab, neg_a, dt_bias, ssm_state, ssm_columns, seg_lane, seg_row,
           seg_count, seg_record, out, np.int32(qk_heads), np.int32(v_heads), np.int32(v_dim),
           np.int32(channels_qk), programmatic=programmatic)


def gdn_recurrent_gated_reference(mixed, ab, neg_a, dt_bias, ssm_state, ssm_columns, seg_lane, seg_row, seg_count,
                                  seg_record, out, *, qk_heads, v_heads, k_dim, v_dim, channels_qk):
    rows = mixed.shape[0]
    q, k = np.empty((rows, qk_heads, k_dim), F32), np.empty((rows, qk_heads, k_dim), F32)
    log_decay, beta = np.empty((rows, v_heads), F32), np.empty((rows, v_heads), F32)
    gdn_gates_reference(mixed, ab, neg_a, dt_bias, q, k, log_decay, beta, qk_heads=qk_heads, v_heads=v_heads,
                        k_dim=k_dim)
    gdn_recurrent_reference(q, k, mixed, log_decay, beta, ssm_state, ssm_columns, seg_lane, seg_row, seg_count,
                            seg_record, out, qk_heads=qk_heads, v_heads=v_heads, k_dim=k_dim, v_dim=v_dim,
                            channels_qk=channels_qk)


def gdn_recurrent_projected(mixed, x, w_ab, neg_a, dt_bias, ssm_state, ssm_columns, seg_lane, seg_row,
                            seg_count, seg_record, out, *, qk_heads, v_heads, k_dim, v_dim, channels_qk, stream,
                            groups=REC_DEFAULT_GROUPS, programmatic=False):
    """`gdn_recurrent_gated` with the a/b projection in the same launch: ab[r] = x[r] @ w_ab^T (x the fp32 normed
    rows [R, H], w_ab the projection's bf16 bits [2 Hv, H], H a multiple of 8), each block computing its head's two
    dot products for its segment's rows. Why: at decode the projection is a 2 Hv-row GEMV (~0.3 MB) whose launch
    sat on the step's critical path (~3 us a GDN layer serially, ~5 beside a tensor-core in-projection that holds
    every SM). For decode and verify rows only: each of a head's blocks reads every row of its segment. fp32 sums
    in a fixed order (a thread's 8-column groups, the warp's butterfly, the warps in order): the same bits for a
    row whatever the batch, and the twin's within fp32 rounding."""
    if (k_dim, groups) not in _PROJECTED_RECURRENT_KERNELS:
        raise ValueError(f"gdn_recurrent_projected has no variant for k_dim={k_dim}, groups={groups}")
    hidden = x.shape[1]
    if hidden % 8 or w_ab.shape != (2 * v_heads, hidden) or x.shape[0] < mixed.shape[0]:
        raise ValueError(f"gdn_recurrent_projected needs x [>= {mixed.shape[0]}, H] and w_ab [{2 * v_heads}, H] with "
                         f"H a multiple of 8; got {tuple(x.shape)} and {tuple(w_ab.shape)}")
    function, threads = _PROJECTED_RECURRENT_KERNELS[(k_dim, groups)]
    grid = (seg_lane.shape[0], v_heads, blocks_for(v_dim, REC_COLS))
    launch(function, grid, threads, stream, 0, mixed, x, w_ab.view(np.uint64), neg_a,
           dt_bias, ssm_state, ssm_columns, seg_lane, seg_row, seg_count, seg_record, out, np.int32(qk_heads),
           np.int32(v_heads), np.int32(v_dim), np.int32(channels_qk), programmatic=programmatic)


def gdn_recurrent_projected_reference(mixed, x, w_ab, neg_a, dt_bias, ssm_state, ssm_columns, seg_lane, seg_row,
                                      seg_count, seg_record, out, *, qk_heads, v_heads, k_dim, v_dim, channels_qk):
    rows = mixed.shape[0]
    ab = np.asarray(x[:rows], np.float64) @ bf16_bits_to_f32(w_ab).astype(np.float64).T
    gdn_recurrent_gated_reference(mixed, ab.astype(F32), neg_a, dt_bias, ssm_state, ssm_columns, seg_lane, seg_row,
                                  seg_count, seg_record, out, qk_heads=qk_heads, v_heads=v_heads, k_dim=k_dim,
                                  v_dim=v_dim, channels_qk=channels_qk)


def gdn_recurrent_reference(q, k, mixed, log_decay, beta, ssm_state, ssm_columns, seg_lane, seg_row, seg_count,
                            seg_record, out, *, qk_heads, v_heads, k_dim, v_dim, channels_qk):
    repeat = v_heads // qk_heads
    for s in range(len(seg_lane)):
        lane, start, count = int(seg_lane[s]), int(seg_row[s]), int(seg_count[s])
        rows = slice(start, start + count)
        v = mixed[rows, channels_qk:channels_qk + v_heads * v_dim].reshape(count, v_heads, v_dim)
        columns = ssm_columns[lane, :count - 1] if seg_record[s] else None
        out[rows], ssm_state[lane] = gated_delta_rule(
            np.repeat(q[rows], repeat, axis=1), np.repeat(k[rows], repeat, axis=1), v, log_decay[rows], beta[rows],
            ssm_state[lane], column_states=columns)


# ---------------------------------------------------------------------------------------------------------------
# 4. gated output norm: rms_norm(o, weight, offset=False) * silu(z)

OUT_WARPS = 4

_OUT_SIG = (float32[:, :, ::1], float32[:, ::1], float32[::1], float32[:, ::1], int32, uint16[:, ::1], int32,
            uint16[::1], int32, int32, int32, int32, float32)


@device_function
def _output_item(v_heads):
    """(row, v head, lane) of this thread in gdn_output's grid (a warp an item; a row past the last: no work)."""
    item = cuda.blockIdx.x * OUT_WARPS + cuda.threadIdx.x // WARP
    row = item // v_heads
    return row, item - row * v_heads, cuda.threadIdx.x % WARP


@kernel(_OUT_SIG)
def _gdn_output_kernel(o, z_source, weight, result, write_f32, result_bf16, write_bf16, fragments, write_fragments,
                       v_heads, v_dim, z_offset, eps):
    allow_dependents()  # the output projection may start loading its weights (`programmatic`)
    row, h, lane = _output_item(v_heads)
    if row >= o.shape[0]:
        return
    x = cuda.local.array(PER_LANE, float32)
    z = cuda.local.array(PER_LANE, float32)
    zb = z_offset + h * v_dim
    for e in range(PER_LANE):
        j = lane + e * WARP
        x[e] = o[row, h, j] if j < v_dim else float32(0.0)
        z[e] = z_source[row, zb + j] if j < v_dim else float32(0.0)
    total = float32(0.0)
    for e in range(PER_LANE):
        total += x[e] * x[e]
    total = warp_sum(total)
    inv = float32(1.0) / math.sqrt(total / float32(v_dim) + eps)
    for e in range(PER_LANE):
        j = lane + e * WARP
        if j < v_dim:
            value = ((x[e] * inv) * weight[j]) * (z[e] * sigmoid_f32(z[e]))
            if write_f32 != 0:
                result[row, h * v_dim + j] = value
            if write_bf16 != 0:
                result_bf16[row, h * v_dim + j] = uint16(f32_to_bf16(value))
            if write_fragments != 0:
                fragments[fragment_half(int32(row), int32(h * v_dim + j))] = uint16(f32_to_bf16(value))


VEC_HEAD_DIM = 4 * WARP  # the real models' v_dim: a lane's 4 consecutive dims in one 16-byte load


@kernel(_OUT_SIG)
def _gdn_output_vec_kernel(o, z_source, weight, result, write_f32, result_bf16, write_bf16, fragments,
                           write_fragments, v_heads, v_dim, z_offset, eps):
    """_gdn_output_kernel for v_dim == VEC_HEAD_DIM: lane L holds dims 4 L .. 4 L + 3 (16-byte loads of o and z,
    16-byte fp32 stores) instead of L, L + 32, ... (4-byte ones: the 8K prefill ran at ~0.45 of copy bandwidth).
    Only the sum of squares' order differs (a lane's partial over consecutive dims)."""
    allow_dependents()
    row, h, lane = _output_item(v_heads)
    if row >= o.shape[0]:
        return
    column = h * VEC_HEAD_DIM + 4 * lane
    x0, x1, x2, x3 = load4(o, (row * v_heads + h) * VEC_HEAD_DIM + 4 * lane)
    z0, z1, z2, z3 = load4(z_source, row * z_source.shape[1] + z_offset + column)
    total = warp_sum(((x0 * x0 + x1 * x1) + x2 * x2) + x3 * x3)
    inv = float32(1.0) / math.sqrt(total / float32(VEC_HEAD_DIM) + eps)
    v0 = ((x0 * inv) * weight[4 * lane]) * (z0 * sigmoid_f32(z0))
    v1 = ((x1 * inv) * weight[4 * lane + 1]) * (z1 * sigmoid_f32(z1))
    v2 = ((x2 * inv) * weight[4 * lane + 2]) * (z2 * sigmoid_f32(z2))
    v3 = ((x3 * inv) * weight[4 * lane + 3]) * (z3 * sigmoid_f32(z3))
    if write_f32 != 0:
        store4(result, row * result.shape[1] + column, v0, v1, v2, v3)
    if write_bf16 != 0:  # one 8-byte store (4 two-byte ones left the 8K prefill at ~0.7 of copy bandwidth)
        store_words2_at(address_of(result_bf16) + (int64(row) * result_bf16.shape[1] + column) * 2,
                        bf16_pair(v0, v1), bf16_pair(v2, v3))
    if write_fragments != 0:
        fragments[fragment_half(int32(row), int32(column))] = uint16(f32_to_bf16(v0))
        fragments[fragment_half(int32(row), int32(column + 1))] = uint16(f32_to_bf16(v1))
        fragments[fragment_half(int32(row), int32(column + 2))] = uint16(f32_to_bf16(v2))
        fragments[fragment_half(int32(row), int32(column + 3))] = uint16(f32_to_bf16(v3))


def gdn_output(out, z_source, norm_weight, result, *, v_heads, v_dim, z_offset, eps, stream, result_bf16=None,
               result_fragments=None):
    """result[r, h*Dv + j] = rms_norm(out[r, h], norm_weight, eps, offset=False)[j] * silu(z_source[r, z_offset +
    h*Dv + j]). With `result_bf16` (uint16 [R, Hv*Dv]) also its bf16 bits, with `result_fragments` its tensor-core x
    fragments (see `elementwise.rms_norm_rows`). `result` None: the bf16 copy alone (a consumer that reads only
    that: the output projection's cuBLAS GEMM), the same bits, without the fp32 writes."""
    if v_dim > MAX_HEAD_DIM:
        raise ValueError(f"gdn_output supports v_dim <= {MAX_HEAD_DIM}, got {v_dim}")
    if result is None and result_bf16 is None:
        raise ValueError("gdn_output needs a result, a bf16 result or both")
    rows = out.shape[0]
    if result_fragments is not None:
        check_fragment_output(rows, v_heads * v_dim, result_fragments)
    written = result if result is not None else result_bf16  # a stand-in for the arrays not asked for
    grid = blocks_for(rows * v_heads, OUT_WARPS)
    # the vector kernel by v_dim and the z columns' alignment only (never by rows: batch invariance)
    vector = v_dim == VEC_HEAD_DIM and z_source.shape[1] % 4 == 0 and z_offset % 4 == 0
    launch = _gdn_output_vec_kernel if vector else _gdn_output_kernel
    launch[grid, OUT_WARPS * WARP, stream](out, z_source, norm_weight, z_source if result is None else result,
                                           np.int32(result is not None), *bf16_target(written, result_bf16),
                                           *fragment_target(written, result_fragments), np.int32(v_heads),
                                           np.int32(v_dim), np.int32(z_offset), np.float32(eps))


def gdn_output_reference(out, z_source, norm_weight, result, *, v_heads, v_dim, z_offset, eps):
    rows = out.shape[0]
    z = z_source[:, z_offset:z_offset + v_heads * v_dim].reshape(rows, v_heads, v_dim)
    result[:] = (rms_norm(out, norm_weight, eps, offset=False) * silu(z)).reshape(rows, v_heads * v_dim)
