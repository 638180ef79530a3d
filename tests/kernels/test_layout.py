import numpy as np
import pytest

from ninfer.kernels_numba.layout import (concat_columns, concat_columns_reference, gather_rows,
                                         gather_rows_reference)


def test_references():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), -np.arange(4, dtype=np.float32).reshape(2, 2)
    assert concat_columns_reference(a, b).tolist() == [[0, 1, 2, 0, -1], [3, 4, 5, -2, -3]]
    assert gather_rows_reference(a, np.array([1, 1, 0])).tolist() == [[3, 4, 5], [3, 4, 5], [0, 1, 2]]


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
    stream.synchronize()
    assert np.array_equal(out.copy_to_host(), concat_columns_reference(a, b))
    assert np.array_equal(gathered.copy_to_host(), gather_rows_reference(a, index))
