"""The narrow bf16 decode GEMV and its router + routing form: CPU checks of the twins and of the real kernels in the
CUDA simulator, GPU checks against the twins (bitwise batch invariance, routing equal to route_top_k's)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact.codec import f32_to_bf16_bits  # noqa: E402
from ninfer.kernels_numba import linear_narrow as LN  # noqa: E402
from ninfer.kernels_numba.linear import bf16_bits_to_f32  # noqa: E402
from ninfer.kernels_numba.moe import route_top_k_reference  # noqa: E402


def _weights(rng, n, k):
    return f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * 0.05)


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def test_route_twin_is_the_gemv_then_route_top_k():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w = _weights(rng, 72, 256)
    logits, ids, weights = LN.linear_bf16_narrow_route_reference(x, w, 8, experts=64)
    exact = x.astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T
    assert _rel(logits, exact) < 1e-5
    want_ids, want_weights = route_top_k_reference(logits[:, :64], 8)
    assert np.array_equal(ids, want_ids) and np.array_equal(weights, want_weights)
    assert (np.diff(ids, axis=1) > 0).all() and np.allclose(weights.sum(axis=1), 1.0)


def test_blocks_stay_within_half_the_gpu():
    assert [LN.narrow_rows_per_block(n) for n in (40, 64, 96, 264, 512)] == [1, 1, 2, 4, 4]


def test_launch_rejects_shapes_it_cannot_tile():
    with pytest.raises(ValueError, match="K % 8 == 0"):
        LN.linear_bf16_narrow(np.zeros((1, 12), np.float32), np.zeros((3, 12), np.uint16),
                              np.zeros((1, 3), np.float32), stream=0)
    with pytest.raises(ValueError, match="routing supports"):
        LN.linear_bf16_narrow_route(np.zeros((1, 64), np.float32), np.zeros((8, 64), np.uint16),
                                    np.zeros((1, 8), np.float32), np.zeros(1, np.int32), 9, np.zeros((1, 9), np.int32),
                                    np.zeros((1, 9), np.float32), stream=0, experts=8)
    with pytest.raises(ValueError, match="at most 8 rows"):
        LN.linear_bf16_narrow_route(np.zeros((9, 64), np.float32), np.zeros((8, 64), np.uint16),
                                    np.zeros((9, 8), np.float32), np.zeros(1, np.int32), 2, np.zeros((9, 2), np.int32),
                                    np.zeros((9, 2), np.float32), stream=0, experts=8)


@pytest.mark.slow
def test_kernels_in_cuda_simulator():
    """Partial steps, several chunks and x tiles, both grids, batch invariance and the routing tail with its counter,
    in numba's CUDA simulator (`simulated_kernels.linear_narrow`)."""
    from tests.support.simulated_kernels import run

    out = run("linear_narrow").splitlines()
    assert len([line for line in out if line.startswith("ok linear narrow")]) == 5
    assert len([line for line in out if line.startswith("ok narrow route")]) == 2


# ---- GPU ----------------------------------------------------------------------------------------------------------

def _gpu_narrow(x, w, y0=None, accumulate=False, rows_per_block=None):
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    y = y0 if y0 is not None else np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    dy = cuda.to_device(y, stream=stream)
    LN.linear_bf16_narrow(cuda.to_device(x, stream=stream), cuda.to_device(w, stream=stream), dy, stream=stream,
                          accumulate=accumulate, rows_per_block=rows_per_block)
    out = dy.copy_to_host(stream=stream)
    stream.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 257, 2048), (8, 264, 2048), (1, 64, 2048), (3, 96, 5120), (64, 40, 256),
                                   (17, 513, 8192), (5, 3, 64)])
def test_narrow_gpu(m, n, k):
    rng = np.random.default_rng(m + n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = _weights(rng, n, k)
    got = _gpu_narrow(x, w)
    assert np.isfinite(got).all() and _rel(got, LN.linear_bf16_narrow_reference(x, w)) < 1e-5
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    got_acc = _gpu_narrow(x, w, y0, accumulate=True)
    assert _rel(got_acc, LN.linear_bf16_narrow_reference(x, w, y0, accumulate=True)) < 1e-5
    # batch invariance: a row alone, on either grid, equals bitwise the same row launched beside the others
    for i in sorted({0, m // 2, m - 1}):
        for per_block in LN.NARROW_ROWS_PER_BLOCK:
            assert np.array_equal(_gpu_narrow(x[i:i + 1], w, rows_per_block=per_block)[0], got[i])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,experts,columns,k", [(1, 256, 264, 8), (8, 256, 264, 8), (5, 128, 136, 8),
                                                    (3, 64, 64, 4)])
def test_narrow_route_gpu(rows, experts, columns, k):
    """The fused launch writes the narrow GEMV's logits bitwise and route_top_k's ids and weights of them, twice in
    a row on one counter (left at zero)."""
    from ninfer.kernels_numba.moe import route_top_k
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(rows + experts)
    w = _weights(rng, columns, 2048)
    stream = cuda.stream()
    counter = cuda.to_device(np.zeros(1, np.int32), stream=stream)
    for launch in range(2):
        x = rng.standard_normal((rows, 2048)).astype(np.float32)
        logits = cuda.to_device(np.full((rows, columns), np.nan, np.float32), stream=stream)
        ids = cuda.to_device(np.full((rows, k), -1, np.int32), stream=stream)
        weights = cuda.to_device(np.full((rows, k), np.nan, np.float32), stream=stream)
        LN.linear_bf16_narrow_route(cuda.to_device(x, stream=stream), cuda.to_device(w, stream=stream), logits,
                                    counter, k, ids, weights, stream=stream, experts=experts)
        want_ids = cuda.to_device(np.full((rows, k), -1, np.int32), stream=stream)
        want_weights = cuda.to_device(np.full((rows, k), np.nan, np.float32), stream=stream)
        route_top_k(logits, k, want_ids, want_weights, stream=stream, experts=experts)
        got_logits = logits.copy_to_host(stream=stream)
        stream.synchronize()
        assert np.array_equal(got_logits, _gpu_narrow(x, w))
        assert np.array_equal(ids.copy_to_host(), want_ids.copy_to_host())
        assert np.array_equal(weights.copy_to_host(), want_weights.copy_to_host())
        assert counter.copy_to_host()[0] == 0, launch
