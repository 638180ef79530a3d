"""The tensor-core bf16 decode GEMM: CPU checks of the twin and the launcher's shape checks, the real kernel in the
CUDA simulator, GPU checks against the twin (every row count up to two launches, bitwise batch invariance,
accumulation, a programmatic launch)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from ninfer.kernels_numba import linear_mma as LM  # noqa: E402


def _bf16(rng, shape, scale=1.0):
    return f32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * scale)


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def test_the_twin_multiplies_the_bf16_values_and_accumulates():
    rng = np.random.default_rng(1)
    x, w = _bf16(rng, (5, 128)), _bf16(rng, (24, 128), 0.05)
    exact = bf16_bits_to_f32(x).astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T
    assert _rel(LM.linear_bf16_mma_reference(x, w), exact) < 1e-7
    y0 = rng.standard_normal((3, 24)).astype(np.float32)
    got = LM.linear_bf16_mma_reference(x, w, y0, accumulate=True)  # y's rows: the first three of x
    assert got.shape == (3, 24) and _rel(got, exact[:3] + y0) < 1e-7


@pytest.mark.parametrize("x_shape,w_shape,y_shape", [((2, 96), (16, 96), (2, 16)), ((1, 128), (16, 128), (2, 16)),
                                                     ((2, 128), (16, 64), (2, 16)), ((2, 128), (16, 128), (2, 8))])
def test_shapes_it_cannot_multiply_are_refused_before_launch(x_shape, w_shape, y_shape):
    with pytest.raises(ValueError, match="tensor-core bf16 linear"):
        LM.linear_bf16_mma(np.zeros(x_shape, np.uint16), np.zeros(w_shape, np.uint16), np.zeros(y_shape, np.float32),
                           stream=0)


def test_a_launch_takes_four_sets_of_eight_rows():
    assert LM.LAUNCH_ROWS == 32 and sorted(LM.LINEAR_BF16_MMA_KERNELS) == [1, 2, 3, 4]


@pytest.mark.slow
def test_kernel_in_cuda_simulator():
    """One and several sets, two launches, partial tiles and steps, accumulation, batch invariance
    (`simulated_kernels.linear_mma`)."""
    from tests.support.simulated_kernels import run

    out = run("linear_mma").splitlines()
    assert len([line for line in out if line.startswith("ok linear mma")]) == 3


# ---- GPU ----------------------------------------------------------------------------------------------------------

def _gpu(x, w, y0=None, *, rows=None, accumulate=False, programmatic=False):
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    rows = x.shape[0] if rows is None else rows
    y = y0.copy() if y0 is not None else np.full((rows, w.shape[0]), np.nan, np.float32)
    dy = cuda.to_device(y, stream=stream)
    LM.linear_bf16_mma(cuda.to_device(x, stream=stream), cuda.to_device(w, stream=stream), dy, stream=stream,
                       accumulate=accumulate, programmatic=programmatic)
    out = dy.copy_to_host(stream=stream)
    stream.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 5120, 6144), (4, 6144, 5120), (8, 1040, 17408), (9, 264, 2048),
                                   (32, 2048, 512), (40, 24, 64), (3, 7, 192)])
def test_gpu_matches_the_twin(m, n, k):
    rng = np.random.default_rng(m + n + k)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (n, k), 0.05)
    got = _gpu(x, w)
    assert np.isfinite(got).all() and _rel(got, LM.linear_bf16_mma_reference(x, w)) < 1e-5
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    got_acc = _gpu(x, w, y0, accumulate=True, programmatic=True)
    assert _rel(got_acc, LM.linear_bf16_mma_reference(x, w, y0, accumulate=True)) < 1e-5


@pytest.mark.gpu
def test_gpu_rows_have_the_same_bits_whatever_the_batch():
    """Every row count from 1 to 33 (one to four sets, then two launches): each row equals bitwise the row computed
    alone, and x rows past y's are never read into it."""
    rng = np.random.default_rng(7)
    x, w = _bf16(rng, (33, 5120)), _bf16(rng, (136, 5120), 0.05)
    alone = np.vstack([_gpu(x[i:i + 1], w) for i in range(33)])
    for m in range(1, 34):
        garbage = x.copy()
        garbage[m:] = 0x7FC0  # NaN: a row past m that leaked into the sums would show
        np.testing.assert_array_equal(_gpu(garbage, w, rows=m), alone[:m], err_msg=f"{m} rows")
