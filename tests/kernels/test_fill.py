import numpy as np
import pytest

from ninfer.kernels_numba.fill import fill_uniform, fill_uniform_reference


def test_reference_is_uniform_in_range_and_reproducible():
    a = fill_uniform_reference(100_000, np.float32, seed=3, scale=0.5)
    assert np.all(np.abs(a) <= 0.5) and abs(float(a.mean())) < 0.01 and 0.28 < float(a.std()) < 0.295  # 0.5 / sqrt(3)
    assert np.array_equal(a, fill_uniform_reference(100_000, np.float32, seed=3, scale=0.5))
    assert not np.array_equal(a, fill_uniform_reference(100_000, np.float32, seed=4, scale=0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_device_fill_equals_reference(dtype):
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    out = cuda.device_array(300_001, dtype=dtype)
    fill_uniform(out, seed=11, scale=0.02, stream=stream)
    stream.synchronize()
    assert np.array_equal(out.copy_to_host(), fill_uniform_reference(300_001, dtype, seed=11, scale=0.02))
