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


def test_word_fill_reference_keeps_and_sets_bits():
    from ninfer.kernels_numba.fill import fill_words_reference

    words = fill_words_reference(100_000, seed=5)
    assert words.dtype == np.uint32 and len(np.unique(words)) > 99_000  # 32 random bits a word
    assert np.array_equal(words, fill_words_reference(100_000, seed=5))
    masked = fill_words_reference(100_000, seed=5, keep=0x07FF07FF, set_bits=0x10001000)
    assert np.array_equal(masked, (words & np.uint32(0x07FF07FF)) | np.uint32(0x10001000))


def test_random_tensor_core_planes_have_the_repacks_sizes_and_scales_in_range():
    """The device's random weights (quant_mma.random_quant_mma_weight) allocate what `repack_quant_mma` makes, and
    their scale words hold two binary16 values in [2^-11, 2^-9)."""
    from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32
    from ninfer.kernels_numba.fill import fill_words_reference, random_quant_payload
    from ninfer.kernels_numba.quant_mma import (RANDOM_SCALE_KEEP, RANDOM_SCALE_SET, plane_words,
                                                repack_quant_mma)

    for fmt in (Q4G64, Q5G64, Q6G64, W8G32):
        for shape in ((32, 128), (48, 64), (40, 192)):
            planes = repack_quant_mma(fmt, shape, random_quant_payload(fmt, shape, seed=1))
            assert {name: plane.size for name, plane in planes.items()} == plane_words(fmt, shape), (fmt, shape)
            assert all(plane.dtype == np.uint32 for plane in planes.values())
    scales = fill_words_reference(10_000, seed=2, keep=RANDOM_SCALE_KEEP, set_bits=RANDOM_SCALE_SET)
    values = scales.view(np.float16).astype(np.float32)
    assert values.min() >= 2.0 ** -11 and values.max() < 2.0 ** -9


@pytest.mark.gpu
def test_device_word_fill_equals_reference():
    from ninfer.kernels_numba.fill import fill_words, fill_words_reference
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    out = cuda.device_array(300_001, dtype=np.uint32)
    fill_words(out, seed=13, keep=0x07FF07FF, set_bits=0x10001000, stream=stream)
    stream.synchronize()
    assert np.array_equal(out.copy_to_host(), fill_words_reference(300_001, seed=13, keep=0x07FF07FF,
                                                                   set_bits=0x10001000))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S"])
def test_a_random_device_weight_multiplies_to_finite_bounded_rows(fmt):
    """A benchmark's random tensor-core weight is a valid matrix for the decode GEMV: finite outputs of the size a
    sum of K products of |x| <= 1, |code| <= 128 and scales < 2^-9 allows."""
    from ninfer.kernels_numba import quant_mma
    from ninfer.kernels_numba.numba_setup import cuda

    N, K = 64, 512
    weight = quant_mma.random_quant_mma_weight(fmt, (N, K), seed=3)
    assert weight.nbytes == 4 * sum(quant_mma.plane_words(fmt, (N, K)).values())
    x = np.random.default_rng(0).uniform(-1, 1, (1, K)).astype(np.float32)
    y = cuda.device_array((1, N), np.float32)
    xf = cuda.device_array(quant_mma.x_sets(1) * quant_mma.x_fragment_words(K), np.uint32)
    quant_mma.x_fragments(cuda.to_device(x), xf, stream=0)
    quant_mma.linear_quant_mma(xf, weight, y, stream=0)
    values = y.copy_to_host()
    assert np.all(np.isfinite(values)) and 0 < np.abs(values).max() <= K * 128 * 2.0 ** -9
