"""The tensor-core prefill attention glue: its twins compose to causal GQA attention, and the kernels equal the twins."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.backends.cpu import ops
from ninfer.backends.cpu.paged_kv import quantize_int8
from ninfer.kernels_numba.attention_gemm import (causal_softmax_reference, gather_kv_reference,
                                                 pack_queries_reference, unpack_gated_reference)

SHAPES = [(4, 2, 64), (24, 4, 256), (16, 2, 256)]  # (heads, kv_heads, head_dim): tiny, 27B, 35B-A3B


def paged_case(rng, heads, kv_heads, head_dim, start, count, *, int8=False):
    """A lane whose pages are scattered through a pool, holding keys 0..start+count-1."""
    length = start + count
    pages = -(-length // 64) + 1
    table = rng.permutation(pages * 2)[:pages].astype(np.int32)[None, :]
    k = rng.standard_normal((length, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((length, kv_heads, head_dim)).astype(np.float32)
    shape = (pages * 2, 64, kv_heads, head_dim)
    pools = []
    for values in (k, v):
        where = table[0, np.arange(length) // 64], np.arange(length) % 64
        if int8:
            pool, scales = np.zeros(shape, np.int8), np.zeros(shape[:-1] + (head_dim // 64,), np.uint16)
            codes, s = quantize_int8(values, 64)
            pool[where], scales[where] = codes, s.view(np.uint16)
        else:
            pool, scales = np.zeros(shape, np.uint16), None
            pool[where] = f32_to_bf16_bits(values)
        pools.append((pool, scales))
    q = rng.standard_normal((count, heads, head_dim)).astype(np.float32)
    qkgv = rng.standard_normal((count, (2 * heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    return table, pools, q, qkgv


def composed_reference(table, pools, q, qkgv, start, block):
    count, heads, head_dim = q.shape
    kv_heads = pools[0][0].shape[2]
    group, length = heads // kv_heads, start + count
    keys = gather_kv_reference(table, 0, length, *pools[0])
    values = gather_kv_reference(table, 0, length, *pools[1])
    out = np.full((count, heads * head_dim), np.nan, np.float32)
    for first in range(0, count, block):
        n = min(block, count - first)
        visible = start + first + n
        packed = pack_queries_reference(q, first=first, rows=n, group=group, scale=1 / np.sqrt(head_dim),
                                        kv_heads=kv_heads)
        scores = np.matmul(bf16_bits_to_f32(packed), bf16_bits_to_f32(keys[:, :visible]).transpose(0, 2, 1))
        probs = causal_softmax_reference(scores, rows=n, first_position=start + first)
        attended = np.matmul(bf16_bits_to_f32(probs), bf16_bits_to_f32(values[:, :visible]))
        unpack_gated_reference(attended, qkgv, out, first=first, rows=n, group=group)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("start,count,block", [(0, 70, 70), (0, 70, 16), (130, 33, 8)])
def test_the_composed_twins_are_causal_gqa_attention(heads, kv_heads, head_dim, start, count, block):
    rng = np.random.default_rng(heads + start + block)
    table, pools, q, qkgv = paged_case(rng, heads, kv_heads, head_dim, start, count)
    got = composed_reference(table, pools, q, qkgv, start, block)
    keys = bf16_bits_to_f32(gather_kv_reference(table, 0, start + count, *pools[0])).transpose(1, 0, 2)
    values = bf16_bits_to_f32(gather_kv_reference(table, 0, start + count, *pools[1])).transpose(1, 0, 2)
    want = ops.causal_gqa_attention(q, keys, values, start, 1 / np.sqrt(head_dim)).reshape(count, -1)
    gate = qkgv[:, (heads + kv_heads) * head_dim : (2 * heads + kv_heads) * head_dim]
    want = want * ops.sigmoid(gate)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # bf16 queries and probabilities


def test_int8_gather_dequantizes_then_rounds_to_bf16():
    rng = np.random.default_rng(5)
    table, pools, *_ = paged_case(rng, 4, 2, 64, 10, 20, int8=True)
    pool, scales = pools[0]
    got = gather_kv_reference(table, 0, 30, pool, scales)
    page, offset = table[0, 17 // 64], 17 % 64
    want = f32_to_bf16_bits(pool[page, offset].astype(np.float32)
                            * np.repeat(scales[page, offset].view(np.float16).astype(np.float32), 64, axis=-1))
    assert np.array_equal(got[:, 17], want)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("int8", [False, True])
def test_device_kernels_equal_their_twins(heads, kv_heads, head_dim, int8):
    from ninfer.kernels_numba.attention_gemm import causal_softmax, gather_kv, pack_queries, unpack_gated
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(11)
    start, count, group = 70, 45, heads // kv_heads
    table, pools, q, qkgv = paged_case(rng, heads, kv_heads, head_dim, start, count, int8=int8)
    stream = cuda.stream()
    length = start + count
    for pool, scales in pools:
        out = cuda.to_device(np.full((kv_heads, length + 3, head_dim), 0xFFFF, np.uint16))
        gather_kv(cuda.to_device(table), 0, length, cuda.to_device(pool),
                  None if scales is None else cuda.to_device(scales), out, stream=stream)
        stream.synchronize()
        want = gather_kv_reference(table, 0, length, pool, scales)
        assert np.array_equal(out.copy_to_host()[:, :length], want)
        stride = -(-length // 8) * 8 + 8  # V^T rows: a multiple of 8 keys, past the lane's length
        turned = cuda.to_device(np.full((kv_heads, head_dim, stride), 0xFFFF, np.uint16))
        gather_kv(cuda.to_device(table), 0, length, cuda.to_device(pool),
                  None if scales is None else cuda.to_device(scales), turned, stream=stream, transposed=True)
        stream.synchronize()
        host = turned.copy_to_host()
        assert np.array_equal(host[:, :, :length].transpose(0, 2, 1), want) and (host[:, :, length:] == 0xFFFF).all()
    packed = cuda.to_device(np.zeros((kv_heads, group * 20, head_dim), np.uint16))
    pack_queries(cuda.to_device(q), packed, first=7, rows=20, group=group, scale=0.125, stream=stream)
    stream.synchronize()
    assert np.array_equal(packed.copy_to_host(),
                          pack_queries_reference(q, first=7, rows=20, group=group, scale=0.125, kv_heads=kv_heads))
    scores = rng.standard_normal((kv_heads, group * 20, start + 27)).astype(np.float32) * 4
    probs = cuda.to_device(np.full(scores.shape, 0xFFFF, np.uint16))
    causal_softmax(cuda.to_device(scores), probs, rows=20, first_position=start + 7, stream=stream)
    stream.synchronize()
    got = bf16_bits_to_f32(probs.copy_to_host())
    want = bf16_bits_to_f32(causal_softmax_reference(scores, rows=20, first_position=start + 7))
    assert np.abs(got - want).max() <= 2 ** -8 * max(1.0, float(want.max()))  # one bf16 step at most
    attended = rng.standard_normal((kv_heads, group * 20, head_dim)).astype(np.float32)
    out = cuda.to_device(np.full((count, heads * head_dim), np.nan, np.float32))
    unpack_gated(cuda.to_device(attended), cuda.to_device(qkgv), out, first=7, rows=20, group=group, stream=stream)
    stream.synchronize()
    want_out = unpack_gated_reference(attended, qkgv, np.full((count, heads * head_dim), np.nan, np.float32),
                                      first=7, rows=20, group=group)
    np.testing.assert_allclose(out.copy_to_host()[7:27], want_out[7:27], rtol=1e-6, atol=1e-6)
    assert np.isnan(out.copy_to_host()[:7]).all() and np.isnan(out.copy_to_host()[27:]).all()


@pytest.mark.gpu
def test_causal_softmax_register_and_streaming_rows_give_the_same_bits():
    """Rows of up to REGISTER_KEYS keys are held in registers, longer ones are streamed three times: the same row
    through both paths gives the same bits, and both agree with the twin."""
    from ninfer.kernels_numba.attention_gemm import REGISTER_KEYS, causal_softmax
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(3)
    long_keys = REGISTER_KEYS + 8
    scores = rng.standard_normal((2, 3, long_keys)).astype(np.float32) * 4
    first = REGISTER_KEYS - 2  # row i sees keys 0..REGISTER_KEYS - 2 + i
    stream = cuda.stream()
    got = {}
    for keys in (REGISTER_KEYS, long_keys):
        part = np.ascontiguousarray(scores[:, :, :keys])
        probs = cuda.to_device(np.full(part.shape, 0xFFFF, np.uint16))
        causal_softmax(cuda.to_device(part), probs, rows=3, first_position=first, stream=stream)
        stream.synchronize()
        got[keys] = probs.copy_to_host()
        want = causal_softmax_reference(part, rows=3, first_position=first)
        assert np.abs(bf16_bits_to_f32(got[keys]) - bf16_bits_to_f32(want)).max() <= 2 ** -8
    # rows 0 and 1 see the same keys either way (row 2 sees one more key in the long row)
    assert np.array_equal(got[REGISTER_KEYS][:, :2], got[long_keys][:, :2, :REGISTER_KEYS])
    assert not got[long_keys][:, :2, REGISTER_KEYS:].any()
