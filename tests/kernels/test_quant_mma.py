"""Tensor-core Q4G64 decode linear: the repacked fragment layout checked on the CPU against the codec, the kernel on a
GPU against its twin (bf16 x, exact fp32 weights), with accumulation and batch invariance."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact import codec  # noqa: E402
from ninfer.artifact.formats import Q4G64  # noqa: E402
from ninfer.kernels_numba import quant_mma as QM  # noqa: E402


def _payload(rng, shape):
    w = rng.standard_normal(shape).astype(np.float32) * 0.05
    w[0, :64] = 0.0  # an all-zero group
    return codec.encode_buffer(w, Q4G64)


def _unpack(planes, shape) -> np.ndarray:
    """The fp32 matrix the tensor-core layout encodes, read back through the fragment offsets."""
    N, K = shape
    groups, tiles = K // QM.GROUP, -(-N // QM.TILE_ROWS)
    packed = planes["packed"].reshape(tiles, groups, 32, 4)
    nibbles = np.stack([(packed >> np.uint32(4 * p)) & np.uint32(15) for p in range(8)], axis=-1)
    rows, cols = QM._fragment_offsets()
    codes = np.zeros((tiles, groups, QM.TILE_ROWS, QM.GROUP), np.float32)
    codes[:, :, rows, cols] = nibbles.astype(np.float32) - 8.0
    pairs = planes["scales"].view(np.float16).reshape(tiles, groups, 8, 2).astype(np.float32)
    scales = np.concatenate([pairs[..., 0], pairs[..., 1]], axis=-1)  # rows g, then rows g + 8
    values = codes * scales[..., None]
    return values.transpose(0, 2, 1, 3).reshape(tiles * QM.TILE_ROWS, K)[:N]


@pytest.mark.parametrize("shape", [(16, 64), (33, 192), (5, 128), (70, 1024)])
def test_the_fragment_layout_holds_exactly_the_codec_weights(shape):
    payload = _payload(np.random.default_rng(shape[0]), shape)
    got = _unpack(QM.repack_q4_mma(shape, payload), shape)
    np.testing.assert_array_equal(got, codec.decode(payload, Q4G64, shape))


def test_k_must_be_whole_groups():
    with pytest.raises(ValueError, match="K % 64"):
        QM.repack_q4_mma((16, 96), _payload(np.random.default_rng(0), (16, 96)))


def test_the_twin_rounds_x_to_bf16_and_accumulates():
    rng = np.random.default_rng(1)
    shape = (20, 128)
    payload = _payload(rng, shape)
    x = codec.f32_to_bf16_bits(rng.standard_normal((3, 128)).astype(np.float32))
    want = codec.bf16_bits_to_f32(x).astype(np.float64) @ codec.decode(payload, Q4G64, shape).T.astype(np.float64)
    np.testing.assert_allclose(QM.linear_q4_mma_reference(x, shape, payload), want, rtol=1e-6, atol=1e-7)
    y0 = rng.standard_normal((3, 20)).astype(np.float32)
    np.testing.assert_allclose(QM.linear_q4_mma_reference(x, shape, payload, y0, accumulate=True), y0 + want,
                               rtol=1e-6, atol=1e-6)


def test_x_fragments_hold_each_lanes_b_registers():
    x = np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32)
    words = QM.x_fragments_reference(x).reshape(2, 32, 4, 2)
    bits = codec.f32_to_bf16_bits(x)
    lane, q, j, b = 9, 1, 2, 1  # g = 2, t = 1: columns 64 + 32 + 2 + 8 (+1)
    assert words[q, lane, j, b] == bits[2, 106] | (np.uint32(bits[2, 107]) << 16)
    assert not words[:, 12:].any()  # lanes of rows g >= M hold zeros


def _run(x, qw, y0=None, accumulate=False):
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    y = y0 if y0 is not None else np.full((x.shape[0], qw.shape[0]), np.nan, np.float32)
    dy = cuda.to_device(y, stream=stream)
    xf = cuda.device_array(QM.x_fragment_words(x.shape[1]), np.uint32, stream=stream)
    QM.x_fragments(cuda.to_device(x, stream=stream), xf, stream=stream)
    np.testing.assert_array_equal(xf.copy_to_host(stream=stream), QM.x_fragments_reference(x))
    QM.linear_q4_mma(xf, qw, dy, stream=stream, accumulate=accumulate)
    out = dy.copy_to_host(stream=stream)
    stream.synchronize()
    return out


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 33, 192), (8, 70, 1024), (2, 130, 2048), (5, 40, 5120),
                                   (1, 20, 17408), (8, 5120, 512)])
def test_q4_mma_gpu_matches_the_twin(m, n, k):
    rng = np.random.default_rng(m + n + k)
    payload = _payload(rng, (n, k))
    qw = QM.upload_q4_mma((n, k), payload)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x_bf16 = codec.f32_to_bf16_bits(x)
    got = _run(x, qw)
    assert np.isfinite(got).all()
    assert _rel(got, QM.linear_q4_mma_reference(x_bf16, (n, k), payload)) < 1e-5
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    got_acc = _run(x, qw, y0, accumulate=True)
    assert _rel(got_acc, QM.linear_q4_mma_reference(x_bf16, (n, k), payload, y0, accumulate=True)) < 1e-5
    for i in sorted({0, m // 2, m - 1}):  # a row's bits do not depend on the rows beside it
        assert np.array_equal(_run(x[i:i + 1], qw)[0], got[i])
