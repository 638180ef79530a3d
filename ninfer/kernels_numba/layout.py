"""Data movement kernels the model glue needs: joining two row blocks side by side, gathering rows by an index held
on the device (so graph-captured steps can pick rows chosen by earlier kernels), keeping a decode step's rows per
lane, and restoring lanes' states from their verify columns for every layer in one launch."""

from __future__ import annotations

import numpy as np
from numba import float32, int32

from ninfer.kernels_numba.common import blocks_for
from ninfer.kernels_numba.numba_setup import cuda, kernel

THREADS = 256


@kernel((float32[:, ::1], float32[:, ::1], float32[:, ::1]))
def _concat_columns(left, right, out):
    row = cuda.blockIdx.x  # rows on grid x: y and z stop at 65,535 blocks, a prefill chunk may not
    width = left.shape[1]
    for col in range(cuda.threadIdx.x + cuda.blockIdx.y * cuda.blockDim.x, out.shape[1],
                     cuda.gridDim.y * cuda.blockDim.x):
        out[row, col] = left[row, col] if col < width else right[row, col - width]


def concat_columns(left, right, out, *, stream) -> None:
    """out[r] = left[r] | right[r]: fp32 [R, A] and [R, B] into [R, A + B]."""
    rows = out.shape[0]
    if rows:
        _concat_columns[(rows, blocks_for(out.shape[1], THREADS)), THREADS, stream](left, right, out)


def concat_columns_reference(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    return np.concatenate([left, right], axis=1).astype(np.float32)


@kernel((float32[:, ::1], int32[::1], float32[:, ::1]))
def _gather_rows(source, index, out):
    row = cuda.blockIdx.x  # as in _concat_columns
    src = index[row]
    for col in range(cuda.threadIdx.x + cuda.blockIdx.y * cuda.blockDim.x, out.shape[1],
                     cuda.gridDim.y * cuda.blockDim.x):
        out[row, col] = source[src, col]


def gather_rows(source, index, out, *, stream) -> None:
    """out[r] = source[index[r]] for fp32 rows; `index` int32 [R] on the device."""
    rows = out.shape[0]
    if rows:
        _gather_rows[(rows, blocks_for(out.shape[1], THREADS)), THREADS, stream](source, index, out)


def gather_rows_reference(source: np.ndarray, index: np.ndarray) -> np.ndarray:
    return source[index].astype(np.float32)


@kernel((float32[:, ::1], float32[:, ::1], int32[::1], float32[:, ::1]))
def _gather_two_sources(first, second, index, out):
    row = cuda.blockIdx.x  # as in _concat_columns
    src = index[row]
    for col in range(cuda.threadIdx.x + cuda.blockIdx.y * cuda.blockDim.x, out.shape[1],
                     cuda.gridDim.y * cuda.blockDim.x):
        out[row, col] = first[src, col] if src >= 0 else second[-1 - src, col]


def gather_two_sources(first, second, index, out, *, stream) -> None:
    """out[r] = first[index[r]] where index[r] >= 0, else second[-1 - index[r]] (fp32 rows; `index` int32 [R] on
    the device): the MTP head's input rows, from the last forward's output or from lanes' tails."""
    rows = out.shape[0]
    if rows:
        _gather_two_sources[(rows, blocks_for(out.shape[1], THREADS)), THREADS, stream](first, second, index, out)


def gather_two_sources_reference(first: np.ndarray, second: np.ndarray, index: np.ndarray) -> np.ndarray:
    index = np.asarray(index)
    return np.where((index >= 0)[:, None], first[np.maximum(index, 0)], second[np.maximum(-1 - index, 0)]).astype(
        np.float32)


@kernel((float32[:, ::1], int32[::1], int32[::1], int32[::1], float32[:, ::1], float32[:, :, ::1]))
def _keep_segment_rows(final, seg_lane, seg_row, seg_count, tails, columns):
    segment = cuda.blockIdx.x
    lane, first, count = seg_lane[segment], seg_row[segment], seg_count[segment]
    for col in range(cuda.threadIdx.x + cuda.blockIdx.y * cuda.blockDim.x, final.shape[1],
                     cuda.gridDim.y * cuda.blockDim.x):
        if count == 1:
            tails[lane, col] = final[first, col]
        else:
            for c in range(count):
                columns[lane, c, col] = final[first + c, col]


def keep_segment_rows(final, seg_lane, seg_row, seg_count, tails, columns, *, stream) -> None:
    """What a decode step keeps of its output rows, per segment b (lane seg_lane[b], rows seg_row[b] ..
    + seg_count[b] - 1 of `final` [R, H]): one row: the lane's tail (tails [lanes, H]); a verify segment's rows: the
    lane's verify columns (columns [lanes, C, H]). In the step's graph, where the host made a device copy a lane
    after reading the step's tokens."""
    segments = seg_lane.shape[0]
    if segments:
        _keep_segment_rows[(segments, blocks_for(final.shape[1], THREADS)), THREADS, stream](
            final, seg_lane, seg_row, seg_count, tails, columns)


def keep_segment_rows_reference(final, seg_lane, seg_row, seg_count, tails, columns) -> None:
    """The twin, in place."""
    for lane, first, count in zip(np.asarray(seg_lane).tolist(), np.asarray(seg_row).tolist(),
                                  np.asarray(seg_count).tolist()):
        if count == 1:
            tails[lane] = final[first]
        else:
            columns[lane, :count] = final[first:first + count]


@kernel((float32[:, ::1], int32[::1], int32[::1], int32[::1], float32[:, :, ::1]))
def _copy_segments(source, seg_lane, seg_row, seg_count, slots):
    segment = cuda.blockIdx.x
    lane, first, count = seg_lane[segment], seg_row[segment], seg_count[segment]
    for col in range(cuda.threadIdx.x + cuda.blockIdx.y * cuda.blockDim.x, source.shape[1],
                     cuda.gridDim.y * cuda.blockDim.x):
        for c in range(count):
            slots[lane, c, col] = source[first + c, col]


def copy_segments(source, seg_lane, seg_row, seg_count, slots, *, stream) -> None:
    """slots[seg_lane[b], :seg_count[b]] = source[seg_row[b] : + seg_count[b]] for every segment b (source [R, W],
    slots [lanes, C, W]): a step's rows into per-lane slots inside its graph (the DFlash drafter's pending
    features), where the host made a device copy a lane."""
    segments = seg_lane.shape[0]
    if segments:
        _copy_segments[(segments, blocks_for(source.shape[1], THREADS)), THREADS, stream](
            source, seg_lane, seg_row, seg_count, slots)


def copy_segments_reference(source, seg_lane, seg_row, seg_count, slots) -> None:
    """The twin, in place."""
    for lane, first, count in zip(np.asarray(seg_lane).tolist(), np.asarray(seg_row).tolist(),
                                  np.asarray(seg_count).tolist()):
        slots[lane, :count] = source[first:first + count]


SELECT_BLOCKS = 64  # blocks a (layer, lane) pair: a 27B GDN state (3 MB) is 48 floats a thread


@kernel((float32[:, :, ::1], float32[:, :, :, ::1], int32[::1], int32[::1]))
def _select_columns(live, columns, lanes, chosen):
    pick = cuda.blockIdx.y
    column = chosen[pick]
    if column < 0:
        return
    layer, lane = cuda.blockIdx.z, lanes[pick]
    for i in range(cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x, live.shape[2],
                   cuda.gridDim.x * cuda.blockDim.x):
        live[layer, lane, i] = columns[layer, lane, column, i]


def select_columns(live, columns, lanes, chosen, *, stream) -> None:
    """live[l, lanes[p]] = columns[l, lanes[p], chosen[p]] for every layer l and pick p with chosen[p] >= 0: fp32
    live [L, lanes, N] and columns [L, lanes, C, N], int32 picks on the device (-1: leave the lane's state), each lane
    at most once."""
    picks = lanes.shape[0]
    if picks and live.shape[0] and live.shape[2]:
        grid = (min(SELECT_BLOCKS, blocks_for(live.shape[2], THREADS)), picks, live.shape[0])
        _select_columns[grid, THREADS, stream](live, columns, lanes, chosen)


def select_columns_reference(live: np.ndarray, columns: np.ndarray, lanes: np.ndarray,
                             chosen: np.ndarray) -> np.ndarray:
    out = live.copy()
    for lane, column in zip(lanes, chosen):
        if column >= 0:
            out[:, lane] = columns[:, lane, column]
    return out
