"""Quantized decode linear kernels (Q4/Q5/Q6 G64, W8 G32, row-split-k128-v1): repack + bit tricks checked on the CPU
against the codec, kernels checked on a GPU against the twins."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact import codec  # noqa: E402
from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32  # noqa: E402
from ninfer.kernels_numba import quant_linear as Q  # noqa: E402

FORMATS = [Q4G64, Q5G64, Q6G64, W8G32]
SHAPES = [(8, 64), (5, 96), (33, 128), (7, 192), (16, 256), (3, 5120)]


def _payload(rng, shape, fmt):
    w = rng.standard_normal(shape).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # an all-zero segment
    return codec.encode_buffer(w, fmt)


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_repacked_decode_equals_codec(fmt, shape):
    rng = np.random.default_rng(shape[0] * 7 + shape[1])
    payload = _payload(rng, shape, fmt)
    planes = Q.repack_quant(fmt, shape, payload)
    want = codec.decode(payload, fmt, shape)
    got = Q.decode_repacked_reference(fmt, shape, planes)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_extreme_codes_and_subnormal_scales(fmt):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 128)).astype(np.float32)
    w[1] *= 1e-6  # tiny groups: subnormal binary16 scales
    w[2, ::2] = 1.0
    w[2, 1::2] = -1.0  # codes at +-qmax
    payload = codec.encode_buffer(w, fmt)
    got = Q.decode_repacked_reference(fmt, (4, 128), Q.repack_quant(fmt, (4, 128), payload))
    assert np.array_equal(got, codec.decode(payload, fmt, (4, 128)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_twins(fmt):
    rng = np.random.default_rng(11)
    shape = (40, 192)
    payload = _payload(rng, shape, fmt)
    wf = codec.decode(payload, fmt, shape).astype(np.float64)
    x = rng.standard_normal((3, 192)).astype(np.float32)
    assert _rel(Q.linear_quant_reference(x, fmt, shape, payload), x.astype(np.float64) @ wf.T) < 1e-5
    y0 = rng.standard_normal((3, 40)).astype(np.float32)
    got = Q.linear_quant_reference(x, fmt, shape, payload, y0, accumulate=True)
    assert _rel(got, y0 + x.astype(np.float64) @ wf.T) < 1e-5
    bf = Q.dequantize_bf16_reference(fmt, shape, payload)
    assert bf.dtype == np.uint16 and np.array_equal(bf, codec.f32_to_bf16_bits(wf.astype(np.float32)))
    ids = np.array([[0, 3], [1, 1]], np.int32)
    g = Q.linear_quant_gathered_reference(x[:2], fmt, shape, payload, ids, rows_per_expert=10, x_per_slot=False)
    assert _rel(g[1, 0], wf[10:20] @ x[1].astype(np.float64)) < 1e-5


# ---- GPU ----------------------------------------------------------------------------------------------------------

def _run_linear(x, qw, y0=None, accumulate=False):
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    y = y0 if y0 is not None else np.full((x.shape[0], qw.shape[0]), np.nan, np.float32)
    dy = cuda.to_device(y, stream=stream)
    Q.linear_quant(cuda.to_device(x, stream=stream), qw, dy, stream=stream, accumulate=accumulate)
    out = dy.copy_to_host(stream=stream)
    stream.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (3, 33, 192), (8, 70, 1024), (9, 130, 2048), (17, 40, 5120),
                                   (48, 16, 256), (2, 20, 17408)])
def test_linear_quant_gpu(fmt, m, n, k):
    rng = np.random.default_rng(m + n + k)
    payload = _payload(rng, (n, k), fmt)
    qw = Q.upload_quant_weight(fmt, (n, k), payload)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = _run_linear(x, qw)
    assert np.isfinite(got).all()
    assert _rel(got, Q.linear_quant_reference(x, fmt, (n, k), payload)) < 1e-5
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    got_acc = _run_linear(x, qw, y0, accumulate=True)
    assert _rel(got_acc, Q.linear_quant_reference(x, fmt, (n, k), payload, y0, accumulate=True)) < 1e-5
    for i in sorted({0, m // 2, m - 1}):
        assert np.array_equal(_run_linear(x[i:i + 1], qw)[0], got[i])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("per_slot", [False, True])
def test_linear_quant_gathered_gpu(fmt, per_slot):
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(5)
    M, S, E, rpe, K = 2, 8, 12, 96, 512
    payload = _payload(rng, (E * rpe, K), fmt)
    qw = Q.upload_quant_weight(fmt, (E * rpe, K), payload)
    ids = rng.integers(0, E, (M, S)).astype(np.int32)
    x = rng.standard_normal((M, S, K) if per_slot else (M, K)).astype(np.float32)
    stream = cuda.stream()
    dy = cuda.to_device(np.full((M, S, rpe), np.nan, np.float32), stream=stream)
    Q.linear_quant_gathered(cuda.to_device(x, stream=stream), qw, cuda.to_device(ids, stream=stream), dy,
                            rows_per_expert=rpe, x_per_slot=per_slot, stream=stream)
    got = dy.copy_to_host(stream=stream)
    stream.synchronize()
    assert np.isfinite(got).all()
    want = Q.linear_quant_gathered_reference(x, fmt, (E * rpe, K), payload, ids, rows_per_expert=rpe,
                                             x_per_slot=per_slot)
    assert _rel(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(8, 64), (33, 192), (70, 1024), (5, 5120)])
def test_dequantize_bf16_gpu(fmt, shape):
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(shape[0] + shape[1])
    payload = _payload(rng, shape, fmt)
    qw = Q.upload_quant_weight(fmt, shape, payload)
    stream = cuda.stream()
    out = cuda.to_device(np.full(shape, 0xFFFF, np.uint16), stream=stream)
    Q.dequantize_bf16(qw, out, stream=stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    assert np.array_equal(got, Q.dequantize_bf16_reference(fmt, shape, payload))
