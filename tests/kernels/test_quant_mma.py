"""Tensor-core quantized decode linear (Q4/Q5/Q6 G64, W8 G32): the repacked fragment layout checked on the CPU
against the codec, the kernels on a GPU against their twin (bf16 x, exact fp32 weights), with accumulation and batch
invariance."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact import codec  # noqa: E402
from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32  # noqa: E402
from ninfer.kernels_numba import quant_mma as QM  # noqa: E402

FORMATS = [Q4G64, Q5G64, Q6G64, W8G32]


def _payload(rng, shape, fmt):
    w = rng.standard_normal(shape).astype(np.float32) * 0.05
    w[0, :64] = 0.0  # an all-zero group
    return codec.encode_buffer(w, fmt)


def _unpack(fmt, planes, shape) -> np.ndarray:
    """The fp32 matrix the tensor-core layout encodes, read back through the fragment offsets."""
    bits = QM.FORMAT_BITS[fmt]
    N, K = shape
    blocks, tiles = K // QM.BLOCK, -(-N // QM.TILE_ROWS)

    def nibbles(words):
        return np.stack([(words >> np.uint32(4 * p)) & np.uint32(15) for p in range(8)], axis=-1)

    unsigned = nibbles(planes["base"].reshape(tiles, blocks, 32, 4))  # [tiles, blocks, 32, 4, 8]
    j = np.arange(4)[:, None]
    s, half = np.arange(8)[None, :] % 4, np.arange(8)[None, :] // 4
    if bits == 8:
        unsigned = unsigned | (nibbles(planes["high"].reshape(tiles, blocks, 32, 4)) << np.uint32(4))
    elif bits == 5:
        high = planes["high"].reshape(tiles, blocks, 32, 1, 1)
        unsigned = unsigned | (((high >> (16 * half + 4 * j + s).astype(np.uint32)) & np.uint32(1)) << np.uint32(4))
    elif bits == 6:
        high = planes["high"].reshape(tiles, blocks, 32, 2)[..., j // 2, None][..., 0, :]  # [.., 32, 4, 1]
        shifts = (16 * half + 2 * (4 * (j % 2) + s)).astype(np.uint32)
        unsigned = unsigned | (((high >> shifts) & np.uint32(3)) << np.uint32(4))
    codes = np.zeros((tiles, blocks, QM.TILE_ROWS, QM.BLOCK), np.float32)
    rows, cols = QM._fragment_offsets()
    codes[:, :, rows, cols] = unsigned.astype(np.float32) - float(1 << (bits - 1))
    per_block = 2 if bits == 8 else 1
    pairs = planes["scales"].view(np.float16).astype(np.float32).reshape(tiles, blocks, per_block, 8, 2)
    scales = np.concatenate([pairs[..., 0], pairs[..., 1]], axis=-1)  # [tiles, blocks, k, 16 rows]
    scales = np.repeat(scales, QM.BLOCK // per_block, axis=2)  # [tiles, blocks, 64 columns, 16 rows]
    values = codes * scales.transpose(0, 1, 3, 2)
    return values.transpose(0, 2, 1, 3).reshape(tiles * QM.TILE_ROWS, K)[:N]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(16, 64), (33, 192), (5, 128), (70, 1024)])
def test_the_fragment_layout_holds_exactly_the_codec_weights(fmt, shape):
    payload = _payload(np.random.default_rng(shape[0]), shape, fmt)
    got = _unpack(fmt, QM.repack_quant_mma(fmt, shape, payload), shape)
    np.testing.assert_array_equal(got, codec.decode(payload, fmt, shape))


def test_extreme_codes_survive_the_layout():
    rng = np.random.default_rng(7)
    for fmt in FORMATS:
        w = rng.choice([-1.0, 1.0], size=(16, 128)).astype(np.float32) * rng.uniform(0.5, 2.0, (16, 1))
        payload = codec.encode_buffer(w, fmt)  # every group spans -max..max: the extreme codes
        got = _unpack(fmt, QM.repack_quant_mma(fmt, (16, 128), payload), (16, 128))
        np.testing.assert_array_equal(got, codec.decode(payload, fmt, (16, 128)))


def test_k_must_be_whole_blocks():
    with pytest.raises(ValueError, match="K % 64"):
        QM.repack_quant_mma(Q4G64, (16, 96), _payload(np.random.default_rng(0), (16, 96), Q4G64))


def test_the_twin_rounds_x_to_bf16_and_accumulates():
    rng = np.random.default_rng(1)
    shape = (20, 128)
    payload = _payload(rng, shape, Q5G64)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    x_bf16 = codec.bf16_bits_to_f32(codec.f32_to_bf16_bits(x)).astype(np.float64)
    want = x_bf16 @ codec.decode(payload, Q5G64, shape).T.astype(np.float64)
    np.testing.assert_allclose(QM.linear_quant_mma_reference(x, Q5G64, shape, payload), want, rtol=1e-6, atol=1e-7)
    y0 = rng.standard_normal((3, 20)).astype(np.float32)
    np.testing.assert_allclose(QM.linear_quant_mma_reference(x, Q5G64, shape, payload, y0, accumulate=True),
                               y0 + want, rtol=1e-6, atol=1e-6)


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
    QM.linear_quant_mma(xf, qw, dy, stream=stream, accumulate=accumulate)
    out = dy.copy_to_host(stream=stream)
    stream.synchronize()
    return out


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 33, 192), (8, 70, 1024), (2, 130, 2048), (5, 40, 5120),
                                   (1, 20, 17408), (8, 5120, 512)])
def test_quant_mma_gpu_matches_the_twin(fmt, m, n, k):
    rng = np.random.default_rng(m + n + k)
    payload = _payload(rng, (n, k), fmt)
    qw = QM.upload_quant_mma(fmt, (n, k), payload)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = _run(x, qw)
    assert np.isfinite(got).all()
    assert _rel(got, QM.linear_quant_mma_reference(x, fmt, (n, k), payload)) < 1e-5
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    got_acc = _run(x, qw, y0, accumulate=True)
    assert _rel(got_acc, QM.linear_quant_mma_reference(x, fmt, (n, k), payload, y0, accumulate=True)) < 1e-5
    for i in sorted({0, m // 2, m - 1}):  # a row's bits do not depend on the rows beside it
        assert np.array_equal(_run(x[i:i + 1], qw)[0], got[i])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(16, 64), (33, 192), (70, 1024), (5, 5120)])
def test_dequantize_mma_gpu_equals_the_codec_rounded_to_bf16(fmt, shape):
    from ninfer.kernels_numba.numba_setup import cuda
    from ninfer.kernels_numba.quant_linear import dequantize_bf16_reference

    payload = _payload(np.random.default_rng(shape[0]), shape, fmt)
    qw = QM.upload_quant_mma(fmt, shape, payload)
    stream = cuda.stream()
    out = cuda.to_device(np.full(shape, 0xFFFF, np.uint16), stream=stream)
    QM.dequantize_mma_bf16(qw, out, stream=stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(got, dequantize_bf16_reference(fmt, shape, payload))
