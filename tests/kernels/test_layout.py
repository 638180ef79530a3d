import numpy as np
import pytest

from ninfer.kernels_numba.layout import (concat_columns, concat_columns_reference, copy_segments,
                                         copy_segments_reference, gather_rows, gather_rows_reference,
                                         gather_two_sources, gather_two_sources_reference, keep_segment_rows,
                                         keep_segment_rows_reference, select_columns, select_columns_reference)


def test_references():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), -np.arange(4, dtype=np.float32).reshape(2, 2)
    assert concat_columns_reference(a, b).tolist() == [[0, 1, 2, 0, -1], [3, 4, 5, -2, -3]]
    assert gather_rows_reference(a, np.array([1, 1, 0])).tolist() == [[3, 4, 5], [3, 4, 5], [0, 1, 2]]
    tails = -np.arange(9, dtype=np.float32).reshape(3, 3)
    assert gather_two_sources_reference(a, tails, np.array([-3, 1, -1, 0])).tolist() == [
        [-6, -7, -8], [3, 4, 5], [0, -1, -2], [0, 1, 2]]


def _selection_case(rng):
    """2 layers x 4 lanes of 3 columns; lane 3 picks column 2, lane 0 column 0, lane 2 is listed but keeps its
    state (-1), lane 1 is not listed."""
    live = rng.standard_normal((2, 4, 700)).astype(np.float32)
    columns = rng.standard_normal((2, 4, 3, 700)).astype(np.float32)
    return live, columns, np.array([3, 0, 2], np.int32), np.array([2, 0, -1], np.int32)


def test_select_columns_reference_restores_only_the_picked_lanes():
    live, columns, lanes, chosen = _selection_case(np.random.default_rng(1))
    got = select_columns_reference(live, columns, lanes, chosen)
    assert np.array_equal(got[:, 3], columns[:, 3, 2]) and np.array_equal(got[:, 0], columns[:, 0, 0])
    assert np.array_equal(got[:, 1:3], live[:, 1:3])


def _segments_case(rng):
    """A step of 7 rows over 4 lanes of 3 verify columns: lane 2 one row (row 0), lane 0 a verify segment of 3 rows
    (1..3), lane 3 one row (4), lane 1 two rows (5..6); tails and columns start as NaN."""
    final = rng.standard_normal((7, 300)).astype(np.float32)
    segments = (np.array([2, 0, 3, 1], np.int32), np.array([0, 1, 4, 5], np.int32), np.array([1, 3, 1, 2], np.int32))
    return final, segments, np.full((4, 300), np.nan, np.float32), np.full((4, 3, 300), np.nan, np.float32)


def test_keep_segment_rows_reference_keeps_tails_and_verify_columns():
    final, segments, tails, columns = _segments_case(np.random.default_rng(2))
    keep_segment_rows_reference(final, *segments, tails, columns)
    assert np.array_equal(tails[2], final[0]) and np.array_equal(tails[3], final[4])
    assert np.isnan(tails[[0, 1]]).all()  # verify segments' tails stay (the column selection sets them)
    assert np.array_equal(columns[0], final[1:4]) and np.array_equal(columns[1, :2], final[5:7])
    assert np.isnan(columns[[2, 3]]).all() and np.isnan(columns[1, 2]).all()


def test_copy_segments_reference_fills_every_segments_lane_slots():
    final, segments, _, slots = _segments_case(np.random.default_rng(3))
    copy_segments_reference(final, *segments, slots)
    assert np.array_equal(slots[2, 0], final[0]) and np.array_equal(slots[0], final[1:4])
    assert np.array_equal(slots[3, 0], final[4]) and np.array_equal(slots[1, :2], final[5:7])
    assert np.isnan(slots[[2, 3], 1:]).all() and np.isnan(slots[1, 2]).all()


def test_select_columns_kernel_in_cuda_simulator():
    from tests.support.simulated_kernels import run

    out = run("select_columns")
    assert all(f"ok {name}" in out for name in ("select_columns", "keep_segment_rows", "gather_two_sources",
                                                "copy_segments"))


@pytest.mark.gpu
def test_device_matches_reference():
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(0)
    stream = cuda.stream()
    a, b = rng.standard_normal((5, 300), np.float32), rng.standard_normal((5, 70), np.float32)
    out = cuda.to_device(np.full((5, 370), np.nan, np.float32))
    concat_columns(cuda.to_device(a), cuda.to_device(b), out, stream=stream)
    index = np.array([4, 0, 0, 2], np.int32)
    gathered = cuda.to_device(np.full((4, 300), np.nan, np.float32))
    gather_rows(cuda.to_device(a), cuda.to_device(index), gathered, stream=stream)
    two = np.array([-2, 3, 0, -1], np.int32)
    gathered_two = cuda.to_device(np.full((4, 300), np.nan, np.float32))
    tails_source = rng.standard_normal((2, 300), np.float32)
    gather_two_sources(cuda.to_device(a), cuda.to_device(tails_source), cuda.to_device(two), gathered_two,
                       stream=stream)
    final, segments, tails, verify = _segments_case(rng)
    slots = verify.copy()
    copied = cuda.to_device(slots)
    copy_segments(cuda.to_device(final), *(cuda.to_device(a) for a in segments), copied, stream=stream)
    copy_segments_reference(final, *segments, slots)
    kept_tails, kept_columns = cuda.to_device(tails), cuda.to_device(verify)
    keep_segment_rows(cuda.to_device(final), *(cuda.to_device(a) for a in segments), kept_tails, kept_columns,
                      stream=stream)
    keep_segment_rows_reference(final, *segments, tails, verify)
    live, columns, lanes, chosen = _selection_case(rng)
    selected = cuda.to_device(live)
    select_columns(selected, cuda.to_device(columns), cuda.to_device(lanes), cuda.to_device(chosen), stream=stream)
    stream.synchronize()
    assert np.array_equal(out.copy_to_host(), concat_columns_reference(a, b))
    assert np.array_equal(gathered.copy_to_host(), gather_rows_reference(a, index))
    assert np.array_equal(selected.copy_to_host(), select_columns_reference(live, columns, lanes, chosen))
    assert np.array_equal(gathered_two.copy_to_host(), gather_two_sources_reference(a, tails_source, two))
    np.testing.assert_array_equal(kept_tails.copy_to_host(), tails)  # (NaN where nothing was kept, on both sides)
    np.testing.assert_array_equal(kept_columns.copy_to_host(), verify)
    np.testing.assert_array_equal(copied.copy_to_host(), slots)
