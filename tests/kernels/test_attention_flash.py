"""Flash prefill attention: its twin vs exact causal GQA attention (CPU), the kernel vs the twin (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from ninfer.backends.cpu import ops  # noqa: E402
from ninfer.kernels_numba import attention_flash as flash  # noqa: E402
from ninfer.kernels_numba.attention_gemm import pack_queries_reference  # noqa: E402

SHAPES = [(4, 2, 64), (24, 4, 256), (16, 2, 256), (8, 8, 128)]  # (heads, kv_heads, head_dim)


def _case(rng, heads, kv_heads, head_dim, start, rows, stride_pad=8):
    """bf16 K / V for keys 0..start+rows-1 ([Hkv, length, D] and V^T [Hkv, D, stride]), fp32 queries and the
    projection row holding the gate columns."""
    length = start + rows
    k = f32_to_bf16_bits(rng.standard_normal((kv_heads, length, head_dim)).astype(np.float32))
    v = f32_to_bf16_bits(rng.standard_normal((kv_heads, length, head_dim)).astype(np.float32))
    stride = -(-length // 8) * 8 + stride_pad
    v_t = np.zeros((kv_heads, head_dim, stride), np.uint16)
    v_t[:, :, :length] = v.transpose(0, 2, 1)
    q = (rng.standard_normal((rows, heads, head_dim)) * 2).astype(np.float32)
    qkgv = rng.standard_normal((rows, (2 * heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    packed = pack_queries_reference(q, first=0, rows=rows, group=heads // kv_heads, scale=head_dim ** -0.5,
                                    kv_heads=kv_heads)
    return dict(q=q, k=k, v=v, v_t=v_t, qkgv=qkgv, packed=packed, length=length, start=start, rows=rows,
                group=heads // kv_heads)


def _twin(case):
    heads, d = case["q"].shape[1], case["q"].shape[2]
    out = np.full((case["rows"], heads * d), np.nan, np.float32)
    return flash.flash_prefill_reference(case["packed"], case["k"], case["v_t"], case["qkgv"], out,
                                         rows=case["rows"], first_position=case["start"], length=case["length"],
                                         group=case["group"])


def _exact(case):
    rows, heads, d = case["q"].shape
    kv_heads = case["k"].shape[0]
    q = bf16_bits_to_f32(case["packed"]).reshape(kv_heads, case["group"], rows, d).transpose(2, 0, 1, 3)
    keys = bf16_bits_to_f32(case["k"]).transpose(1, 0, 2)
    values = bf16_bits_to_f32(case["v"]).transpose(1, 0, 2)
    attended = ops.causal_gqa_attention(q.reshape(rows, heads, d), keys, values, case["start"], 1.0)
    gate = case["qkgv"][:, (heads + kv_heads) * d:(2 * heads + kv_heads) * d]
    return attended.reshape(rows, -1) * ops.sigmoid(gate)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("start,rows", [(0, 70), (0, 64), (130, 33), (5, 1)])
def test_twin_is_gated_causal_gqa_attention(heads, kv_heads, head_dim, start, rows):
    """Online softmax over 64-key tiles with P rounded to bf16: within bf16 error of exact attention."""
    case = _case(np.random.default_rng(heads + start + rows), heads, kv_heads, head_dim, start, rows)
    assert _rel(_twin(case), _exact(case)) < 1e-2


@pytest.mark.slow
def test_kernel_matches_the_twin_in_the_cuda_simulator():
    """The kernel's own source (index arithmetic, tile copies, masks, online softmax, epilogue) run thread by thread
    with the mma, shuffles and cp.async emulated: every head dim, a prefix, partial tiles; and gather_kv's
    transposed V, which feeds it (about 25 s)."""
    from tests.support.simulated_kernels import run

    out = run("gather_kv", "flash_prefill")
    assert "ok gather_kv" in out and out.count("ok flash_prefill") == 3


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("start,rows", [(0, 70), (130, 33), (0, 200), (5, 1)])
def test_kernel_matches_the_twin(heads, kv_heads, head_dim, start, rows):
    """The kernel against its twin (the same tiles and roundings: fp32 summation order and exp's last bit apart),
    rows past `rows` of out untouched."""
    from ninfer.kernels_numba.numba_setup import cuda

    case = _case(np.random.default_rng(7 + heads + rows), heads, kv_heads, head_dim, start, rows)
    stream = cuda.stream()
    out = cuda.to_device(np.full((rows + 3, heads * head_dim), np.nan, np.float32))
    flash.flash_prefill(*(cuda.to_device(case[n]) for n in ("packed", "k", "v_t", "qkgv")), out, rows=rows,
                        first_position=start, length=case["length"], group=case["group"], stream=stream)
    stream.synchronize()
    got = out.copy_to_host()
    assert np.isnan(got[rows:]).all()
    assert _rel(got[:rows], _twin(case)) < 2e-3
    assert _rel(got[:rows], _exact(case)) < 1e-2


@pytest.mark.gpu
def test_kernel_bf16_output_is_the_fp32_output_rounded():
    """out None with out_bf16 (the prefill's form, read by the output projection's cuBLAS GEMM): the bf16 bits of
    what the fp32 launch writes, rows past `rows` untouched, and the projection (the fp32 stand-in) unchanged."""
    from ninfer.kernels_numba.numba_setup import cuda

    heads, kv_heads, head_dim, rows = 4, 2, 256, 70
    case = _case(np.random.default_rng(11), heads, kv_heads, head_dim, 0, rows)
    stream = cuda.stream()
    inputs = [cuda.to_device(case[n]) for n in ("packed", "k", "v_t", "qkgv")]
    args = dict(rows=rows, first_position=0, length=case["length"], group=case["group"], stream=stream)
    out = cuda.to_device(np.full((rows, heads * head_dim), np.nan, np.float32))
    flash.flash_prefill(*inputs, out, **args)
    blank = np.full((rows + 2, heads * head_dim), 0x7FC1, np.uint16)
    out_bf16 = cuda.to_device(blank)
    flash.flash_prefill(*inputs, None, out_bf16=out_bf16, **args)
    stream.synchronize()
    got = out_bf16.copy_to_host()
    np.testing.assert_array_equal(got[:rows], f32_to_bf16_bits(out.copy_to_host()))
    np.testing.assert_array_equal(got[rows:], blank[rows:])
    np.testing.assert_array_equal(inputs[3].copy_to_host(), case["qkgv"])


def test_needs_an_output():
    case = _case(np.random.default_rng(0), 4, 2, 64, 0, 8)
    with pytest.raises(ValueError, match="needs an fp32 out"):
        flash.flash_prefill(case["packed"], case["k"], case["v_t"], case["qkgv"], None, rows=8, first_position=0,
                            length=8, group=2, stream=0)


def test_bf16_twin_is_the_fp32_twin_rounded():
    case = _case(np.random.default_rng(5), 4, 2, 64, 0, 9)
    args = dict(rows=9, first_position=0, length=case["length"], group=case["group"])
    want = flash.flash_prefill_reference(case["packed"], case["k"], case["v_t"], case["qkgv"],
                                         np.zeros((9, 256), np.float32), **args)
    got = flash.flash_prefill_bf16_reference(case["packed"], case["k"], case["v_t"], case["qkgv"],
                                             np.zeros((9, 256), np.uint16), **args)
    np.testing.assert_array_equal(got, f32_to_bf16_bits(want))


def test_rejects_value_rows_that_break_the_16_byte_copies():
    case = _case(np.random.default_rng(0), 4, 2, 64, 0, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        flash.flash_prefill(case["packed"], case["k"], case["v_t"][:, :, :13], case["qkgv"],
                            np.zeros((8, 256), np.float32), rows=8, first_position=0, length=8, group=2, stream=0)
