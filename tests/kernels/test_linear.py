"""bf16 decode linear kernels: CPU checks of the NumPy twins, GPU checks of the kernels against them."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact.codec import f32_to_bf16_bits  # noqa: E402
from ninfer.kernels_numba import linear as L  # noqa: E402

SHAPES = [(1, 64, 64), (3, 96, 128), (5, 200, 256), (8, 33, 192), (13, 70, 512), (1, 300, 5120)]


def _weights(rng, n, k):
    return f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * 0.05)


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16_twin_matches_float64(m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = _weights(rng, n, k)
    exact = x.astype(np.float64) @ L.bf16_bits_to_f32(w).astype(np.float64).T
    assert _rel(L.linear_bf16_reference(x, w), exact) < 1e-5
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    assert _rel(L.linear_bf16_reference(x, w, y0, accumulate=True), exact + y0) < 1e-5


@pytest.mark.parametrize("per_slot", [False, True])
def test_bf16_gathered_twin(per_slot):
    rng = np.random.default_rng(7)
    M, S, E, rpe, K = 3, 4, 6, 40, 128
    w = _weights(rng, E * rpe, K)
    ids = rng.integers(0, E, (M, S)).astype(np.int32)
    x = rng.standard_normal((M, S, K) if per_slot else (M, K)).astype(np.float32)
    got = L.linear_bf16_gathered_reference(x, w, ids, rows_per_expert=rpe, x_per_slot=per_slot)
    wf = L.bf16_bits_to_f32(w).astype(np.float64)
    for m in range(M):
        for s in range(S):
            e = ids[m, s]
            row = (x[m, s] if per_slot else x[m]).astype(np.float64)
            assert _rel(got[m, s], wf[e * rpe:(e + 1) * rpe] @ row) < 1e-5


def test_chunk_columns_are_span_multiples():
    for rows in range(1, 9):
        for k in (64, 256, 5120, 17408):
            kc = L.chunk_columns(rows, k, 256)
            assert kc % 256 == 0 and kc >= 256 and rows * kc * 4 <= max(L.SHARED_BUDGET, rows * 256 * 4)


# ---- GPU ----------------------------------------------------------------------------------------------------------

def _gpu_linear(x, w, y0=None, accumulate=False):
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    dx, dw = cuda.to_device(x, stream=stream), cuda.to_device(w, stream=stream)
    y = y0 if y0 is not None else np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    dy = cuda.to_device(y, stream=stream)
    L.linear_bf16(dx, dw, dy, stream=stream, accumulate=accumulate)
    out = dy.copy_to_host(stream=stream)
    stream.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", SHAPES + [(9, 257, 2048), (17, 64, 17408), (48, 130, 1024), (64, 40, 256)])
def test_linear_bf16_gpu(m, n, k):
    rng = np.random.default_rng(m + n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = _weights(rng, n, k)
    got = _gpu_linear(x, w)
    assert np.isfinite(got).all()
    assert _rel(got, L.linear_bf16_reference(x, w)) < 1e-5
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    got_acc = _gpu_linear(x, w, y0, accumulate=True)
    assert _rel(got_acc, L.linear_bf16_reference(x, w, y0, accumulate=True)) < 1e-5
    # batch invariance: every row alone equals, bitwise, the same row in the full launch
    for i in sorted({0, m // 2, m - 1}):
        assert np.array_equal(_gpu_linear(x[i:i + 1], w)[0], got[i])


@pytest.mark.gpu
@pytest.mark.parametrize("per_slot", [False, True])
@pytest.mark.parametrize("M,S,E,rpe,K", [(1, 8, 16, 64, 256), (3, 2, 5, 40, 128), (2, 8, 32, 1024, 2048),
                                         (1, 4, 6, 48, 2304)])
def test_linear_bf16_gathered_gpu(per_slot, M, S, E, rpe, K):
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(M * S + rpe)
    w = _weights(rng, E * rpe, K)
    ids = rng.integers(0, E, (M, S)).astype(np.int32)
    x = rng.standard_normal((M, S, K) if per_slot else (M, K)).astype(np.float32)
    stream = cuda.stream()
    dy = cuda.to_device(np.full((M, S, rpe), np.nan, np.float32), stream=stream)
    L.linear_bf16_gathered(cuda.to_device(x, stream=stream), cuda.to_device(w, stream=stream),
                           cuda.to_device(ids, stream=stream), dy, rows_per_expert=rpe, x_per_slot=per_slot,
                           stream=stream)
    got = dy.copy_to_host(stream=stream)
    stream.synchronize()
    assert np.isfinite(got).all()
    assert _rel(got, L.linear_bf16_gathered_reference(x, w, ids, rows_per_expert=rpe, x_per_slot=per_slot)) < 1e-5
    # the gathered result for (m, s) equals bitwise a plain linear_bf16 of that row on that expert (same order)
    e = int(ids[0, 0])
    row = x[0, 0] if per_slot else x[0]
    plain = _gpu_linear(row[None, :], w[e * rpe:(e + 1) * rpe])[0]
    assert np.array_equal(plain, got[0, 0])
    # the all-in-flight kernel (where K fits it) and the stepping one give the same bits whatever the slots
    kernels = [L.GATHERED_STEPPING_KERNELS[False]]
    if K <= 256 * L.GATHERED_FLIGHT[False][1]:
        kernels.append(L.GATHERED_FLIGHT_KERNELS[False])
    for kernel in kernels:
        dy = cuda.to_device(np.full((M, S, rpe), np.nan, np.float32), stream=stream)
        L.linear_bf16_gathered(cuda.to_device(x, stream=stream), cuda.to_device(w, stream=stream),
                               cuda.to_device(ids, stream=stream), dy, rows_per_expert=rpe, x_per_slot=per_slot,
                               stream=stream, _kernel=kernel)
        assert np.array_equal(dy.copy_to_host(stream=stream), got)


@pytest.mark.gpu
@pytest.mark.parametrize("M,S,E,rpe,K", [(1, 8, 16, 2048, 512), (3, 2, 5, 40, 128), (2, 8, 32, 64, 2048)])
def test_linear_bf16_gathered_swiglu_gpu(M, S, E, rpe, K):
    """The down projection with silu(gate) * up staged in its launch equals, bitwise, `silu_mul_slots` and then the
    plain gathered GEMV (the two launches it replaces), and the twin within fp32 rounding."""
    from ninfer.kernels_numba.elementwise import silu_mul_slots
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(M * S + rpe + K)
    w = _weights(rng, E * rpe, K)
    ids = rng.integers(0, E, (M, S)).astype(np.int32)
    gate_up = rng.standard_normal((M, S, 2 * K)).astype(np.float32)
    stream = cuda.stream()
    d_gate_up, dw, d_ids = (cuda.to_device(a, stream=stream) for a in (gate_up, w, ids))
    fused, separate = (cuda.to_device(np.full((M, S, rpe), np.nan, np.float32), stream=stream) for _ in range(2))
    L.linear_bf16_gathered_swiglu(d_gate_up, dw, d_ids, fused, rows_per_expert=rpe, stream=stream)
    act = cuda.to_device(np.full((M, S, K), np.nan, np.float32), stream=stream)
    silu_mul_slots(d_gate_up, act, stream=stream)
    L.linear_bf16_gathered(act, dw, d_ids, separate, rows_per_expert=rpe, x_per_slot=True, stream=stream)
    got, want = fused.copy_to_host(stream=stream), separate.copy_to_host(stream=stream)
    stream.synchronize()
    assert np.isfinite(got).all() and np.array_equal(got, want)
    # the stepping kernel gives the same bits as the all-in-flight one the launch takes where K fits it
    stepping = cuda.to_device(np.full((M, S, rpe), np.nan, np.float32), stream=stream)
    L.linear_bf16_gathered_swiglu(d_gate_up, dw, d_ids, stepping, rows_per_expert=rpe, stream=stream,
                                  _kernel=L.GATHERED_STEPPING_KERNELS[True])
    assert np.array_equal(stepping.copy_to_host(stream=stream), got)
    assert _rel(got, L.linear_bf16_gathered_swiglu_reference(gate_up, w, ids, rows_per_expert=rpe)) < 1e-5


# ---- CPU: the real kernels run in numba's CUDA simulator -----------------------------------------------------------


@pytest.mark.slow
def test_kernels_in_cuda_simulator():
    """The kernels' Python source run thread by thread with tests.support.cuda_simulator's stand-ins (vector
    loads/stores, libdevice bit casts/byte_perm, the warp butterfly summed in lane order: within fp32 tolerance of
    the twins, not bitwise): staging permutations, software pipelining, tails and the quantized bit decoding of every
    format, on machines without a GPU (`simulated_kernels.linear`)."""
    from tests.support.simulated_kernels import run

    gathered = [line for line in run("linear").splitlines() if line.startswith("ok linear") and "gathered" in line]
    # bf16 and bf16 with SwiGLU staging, each all-in-flight and stepping, and the four quantized formats
    assert len(gathered) == 8
