"""elementwise.py: NumPy twins vs float64 formulas (CPU), and the kernels vs the twins on a GPU (gpu marker)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from ninfer.kernels_numba import elementwise as ew  # noqa: E402

SHAPES = [(1, 64), (3, 64), (5, 96), (8, 5120), (13, 2048)]


def rel_l2(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ------------------------------------------------------------------------------------------------ CPU: twins


@pytest.mark.parametrize("rows,width", SHAPES)
def test_embed_reference(rows, width):
    rng = np.random.default_rng(rows * 7 + width)
    table = f32_to_bf16_bits(rand(rng, 50, width))
    ids = rng.integers(0, 50, rows).astype(np.int32)
    got = ew.embed_rows_reference(table, ids)
    want = (table[ids].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_references(rows, width, offset):
    rng = np.random.default_rng(rows + width)
    x, d, w = rand(rng, rows, width), rand(rng, rows, width), rand(rng, width, scale=0.1)
    x64 = x.astype(np.float64)
    scale = (1.0 + w.astype(np.float64)) if offset else w.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6) * scale
    assert rel_l2(ew.rms_norm_rows_reference(x, w, eps=1e-6, offset=offset), want) < 1e-6
    new, normed = ew.add_rms_norm_rows_reference(x, d, w, eps=1e-6, offset=offset)
    np.testing.assert_array_equal(new, x + d)
    s64 = (x + d).astype(np.float64)
    want2 = s64 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + 1e-6) * scale
    assert rel_l2(normed, want2) < 1e-6


@pytest.mark.parametrize("slices", [1, 3])
def test_add_slices_reference_is_add_rms_norm_of_the_slices_sum(slices):
    rng = np.random.default_rng(slices)
    rows, width = 3, 96
    x, w = rand(rng, rows, width), rand(rng, width, scale=0.1)
    partials = rand(rng, slices, rows + 2, width)  # rows past the residual's are not read
    total = partials[0, :rows].copy()
    for s in range(1, slices):
        total = total + partials[s, :rows]
    for got, want in zip(ew.add_slices_rms_norm_rows_reference(partials, x, w, eps=1e-6, offset=True),
                         ew.add_rms_norm_rows_reference(x, total, w, eps=1e-6, offset=True)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="partials"):
        ew.add_slices_rms_norm_rows(partials[:, :2], x, w, None, eps=1e-6, offset=True, stream=0,
                                    out_bf16=np.zeros((rows, width), np.uint16))


@pytest.mark.parametrize("rows,width", SHAPES)
def test_silu_mul_reference(rows, width):
    rng = np.random.default_rng(rows)
    gu = rand(rng, rows, 2 * width, scale=3.0)
    g, u = gu[:, :width].astype(np.float64), gu[:, width:].astype(np.float64)
    want = g / (1.0 + np.exp(-g)) * u
    assert rel_l2(ew.silu_mul_rows_reference(gu), want) < 1e-6
    gu3 = gu.reshape(rows, 1, 2 * width)
    np.testing.assert_array_equal(ew.silu_mul_slots_reference(gu3)[:, 0], ew.silu_mul_rows_reference(gu))


def test_silu_mul_bf16_twin_is_the_fp32_math_rounded_once():
    rng = np.random.default_rng(8)
    gu = f32_to_bf16_bits(rand(rng, 5, 2 * 64, scale=3.0))
    got = ew.silu_mul_bf16_rows_reference(gu)
    assert got.dtype == np.uint16 and got.shape == (5, 64)
    g, u = (bf16_bits_to_f32(half).astype(np.float64) for half in (gu[:, :64], gu[:, 64:]))
    want = g / (1.0 + np.exp(-g)) * u
    assert np.all(np.abs(bf16_bits_to_f32(got) - want) <= np.abs(want) * 2.0 ** -8 + 1e-30)


@pytest.mark.parametrize("gate_up,out", [((3, 10), (3, 4)), ((3, 12), (3, 6)), ((2, 16), (3, 8))])
def test_silu_mul_to_bf16_rejects_shapes_it_cannot_vectorize(gate_up, out):
    from ninfer.backends.cuda import host_kernels

    for launcher in (ew.silu_mul_to_bf16_rows, host_kernels.silu_mul_to_bf16_rows):
        with pytest.raises(ValueError, match="silu_mul_to_bf16_rows"):
            launcher(np.zeros(gate_up, np.float32), np.zeros(out, np.uint16), stream=0)


def test_kernels_in_cuda_simulator():
    """The vector-load kernels run thread by thread in numba's simulator (tests.support.cuda_simulator's address
    stand-ins check alignment and bounds): silu_mul_to_bf16_rows equals its twin bitwise, silu_mul_bf16_rows' 16-byte
    kernel its word kernel, sigmoid_gate_add's 4-column kernel its column kernel, add_slices_rms_norm_rows
    add_rms_norm_rows of the slices' sum (`simulated_kernels.elementwise`)."""
    from tests.support.simulated_kernels import run

    lines = run("elementwise").splitlines()
    assert len([line for line in lines if line.startswith("ok elementwise")]) == 2
    assert len([line for line in lines if line.startswith("ok silu_mul_bf16")]) == 2
    assert len([line for line in lines if line.startswith("ok sigmoid_gate_add")]) == 2
    assert len([line for line in lines if line.startswith("ok add_slices_rms_norm")]) == 2


@pytest.mark.parametrize("gate_up,out", [((3, 10), (3, 4)), ((3, 6), (3, 3))])
def test_silu_mul_bf16_rejects_shapes_it_cannot_pair(gate_up, out):
    with pytest.raises(ValueError, match="silu_mul_bf16_rows"):
        ew.silu_mul_bf16_rows(np.zeros(gate_up, np.uint16), np.zeros(out, np.uint16), stream=0)


def test_to_bf16_reference_rounds_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, 3.0e38], dtype=np.float32)
    got = bf16_bits_to_f32(ew.to_bf16_rows_reference(x[None, :]))[0]
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: rounds to even (1); 1 + 3*2^-8 rounds up to 1 + 2^-6
    np.testing.assert_array_equal(got[:4], np.array([1.0, 1.0, 1.015625, -2.5], dtype=np.float32))
    assert np.isinf(got[4])
    assert abs(float(got[5]) - float(x[5])) <= float(x[5]) * 2.0 ** -8


@pytest.mark.parametrize("rows,width", SHAPES)
def test_sigmoid_gate_add_reference(rows, width):
    rng = np.random.default_rng(width)
    res, d, g = rand(rng, rows, width), rand(rng, rows, width), rand(rng, rows, 3, scale=30.0)
    want = res.astype(np.float64) + d.astype(np.float64) / (1.0 + np.exp(-g[:, :1].astype(np.float64)))
    assert rel_l2(ew.sigmoid_gate_add_reference(res, d, g), want) < 1e-6


# ------------------------------------------------------------------------------------------------ GPU


def _cuda():
    from ninfer.kernels_numba.numba_setup import cuda
    return cuda


def _run(launch, inputs, outputs, stream):
    """inputs/outputs: host arrays; outputs are poisoned copies; returns host results of every array (in + out)."""
    cuda = _cuda()
    dev = [cuda.to_device(a, stream=stream) for a in inputs + outputs]
    launch(*dev, stream=stream)
    host = [d.copy_to_host(stream=stream) for d in dev]
    stream.synchronize()
    return host


def _nan(shape):
    return np.full(shape, np.nan, dtype=np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", SHAPES + [(4, 6)])
def test_gpu_embed_rows(rows, width):
    stream = _cuda().stream()
    rng = np.random.default_rng(1)
    table = f32_to_bf16_bits(rand(rng, 300, width))
    ids = rng.integers(0, 300, rows).astype(np.int32)
    *_, out = _run(lambda t, i, o, stream: ew.embed_rows(t, i, o, stream=stream), [table, ids], [_nan((rows, width))],
                   stream)
    np.testing.assert_array_equal(out, ew.embed_rows_reference(table, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", SHAPES + [(48, 5120), (7, 100)])
@pytest.mark.parametrize("offset", [False, True])
def test_gpu_rms_norm_rows(rows, width, offset):
    stream = _cuda().stream()
    rng = np.random.default_rng(2)
    x, w = rand(rng, rows, width, scale=3.0), rand(rng, width, scale=0.2)

    def launch(x, w, o, stream):
        ew.rms_norm_rows(x, w, o, eps=1e-6, offset=offset, stream=stream)

    *_, out = _run(launch, [x, w], [_nan((rows, width))], stream)
    assert not np.isnan(out).any()
    assert rel_l2(out, ew.rms_norm_rows_reference(x, w, eps=1e-6, offset=offset)) < 1e-5
    for r in {0, rows - 1, rows // 2}:  # batch invariance, bitwise
        *_, one = _run(launch, [x[r:r + 1].copy(), w], [_nan((1, width))], stream)
        np.testing.assert_array_equal(one[0], out[r])


def test_rms_norm_rows_needs_an_output():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="needs an fp32 out"):
        ew.rms_norm_rows(x, np.zeros(8, np.float32), None, eps=1e-6, offset=True, stream=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", [(70, 2048), (3, 5120)])
def test_gpu_rms_norm_rows_bf16_alone_writes_the_same_bits(rows, width):
    """With out None (a prefill norm whose readers are all cuBLAS GEMMs) the bf16 copy is the bits the fp32 run
    writes beside its fp32 rows, and x is left as it was."""
    stream = _cuda().stream()
    rng = np.random.default_rng(5)
    x, w = rand(rng, rows, width, scale=3.0), rand(rng, width, scale=0.2)
    poison = np.full((rows, width), 0xFFFF, np.uint16)

    def both(x, w, o, b, stream):
        ew.rms_norm_rows(x, w, o, eps=1e-6, offset=True, stream=stream, out_bf16=b)

    def alone(x, w, b, stream):
        ew.rms_norm_rows(x, w, None, eps=1e-6, offset=True, stream=stream, out_bf16=b)

    _, _, out, want = _run(both, [x, w], [_nan((rows, width)), poison], stream)
    np.testing.assert_array_equal(want, f32_to_bf16_bits(out))
    x_after, _, got = _run(alone, [x, w], [poison], stream)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(x_after, x)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", [(1, 2048), (8, 2048), (5, 5120)])
@pytest.mark.parametrize("slices", [1, 2, 4, 8])
def test_gpu_add_slices_rms_norm_rows(rows, width, slices):
    """residual += the slices in order, then the norm: bitwise add_rms_norm_rows of the slices' sum (taken in the
    same order), its bf16 copy bitwise that of rms_norm_rows, from partials of more rows than the residual's."""
    stream = _cuda().stream()
    rng = np.random.default_rng(rows + slices)
    res, w = rand(rng, rows, width), rand(rng, width, scale=0.2)
    partials = rand(rng, slices, 8, width)
    total = partials[0, :rows].copy()
    for s in range(1, slices):
        total = total + partials[s, :rows]

    def fused(p, res, w, o, o16, stream):
        ew.add_slices_rms_norm_rows(p, res, w, o, eps=1e-6, offset=True, stream=stream, out_bf16=o16)

    def apart(res, d, w, o, stream):
        ew.add_rms_norm_rows(res, d, w, o, eps=1e-6, offset=True, stream=stream)

    _, new, _, out, out16 = _run(fused, [partials, res, w], [_nan((rows, width)), np.zeros((rows, width), np.uint16)],
                                 stream)
    want_new, _, _, want = _run(apart, [res, total, w], [_nan((rows, width))], stream)
    np.testing.assert_array_equal(new, want_new)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(out16, f32_to_bf16_bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", SHAPES + [(48, 5120)])
@pytest.mark.parametrize("offset", [False, True])
def test_gpu_add_rms_norm_rows(rows, width, offset):
    stream = _cuda().stream()
    rng = np.random.default_rng(3)
    res, d, w = rand(rng, rows, width), rand(rng, rows, width), rand(rng, width, scale=0.2)

    def launch(res, d, w, o, stream):
        ew.add_rms_norm_rows(res, d, w, o, eps=1e-6, offset=offset, stream=stream)

    new, _, _, out = _run(launch, [res, d, w], [_nan((rows, width))], stream)
    want_new, want = ew.add_rms_norm_rows_reference(res, d, w, eps=1e-6, offset=offset)
    np.testing.assert_array_equal(new, want_new)
    assert not np.isnan(out).any()
    assert rel_l2(out, want) < 1e-5
    for r in {0, rows - 1}:
        _, _, _, one = _run(launch, [res[r:r + 1].copy(), d[r:r + 1].copy(), w], [_nan((1, width))], stream)
        np.testing.assert_array_equal(one[0], out[r])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", SHAPES + [(48, 17408), (9, 33)])
def test_gpu_silu_mul(rows, width):
    stream = _cuda().stream()
    rng = np.random.default_rng(4)
    gu = rand(rng, rows, 2 * width, scale=4.0)
    _, out = _run(lambda g, o, stream: ew.silu_mul_rows(g, o, stream=stream), [gu], [_nan((rows, width))], stream)
    assert not np.isnan(out).any()
    assert rel_l2(out, ew.silu_mul_rows_reference(gu)) < 1e-5
    _, one = _run(lambda g, o, stream: ew.silu_mul_rows(g, o, stream=stream), [gu[-1:].copy()], [_nan((1, width))],
                  stream)
    np.testing.assert_array_equal(one[0], out[-1])
    gu3 = rand(rng, rows, 3, 2 * width)
    _, out3 = _run(lambda g, o, stream: ew.silu_mul_slots(g, o, stream=stream), [gu3], [_nan((rows, 3, width))],
                   stream)
    assert not np.isnan(out3).any()
    assert rel_l2(out3, ew.silu_mul_slots_reference(gu3)) < 1e-5
    _, out3b = _run(lambda g, o, stream: ew.silu_mul_rows(g, o, stream=stream), [gu3], [_nan((rows, 3, width))],
                    stream)
    np.testing.assert_array_equal(out3b, out3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", [(1, 512), (37, 512), (300, 64), (2, 17408)])
def test_gpu_silu_mul_bf16_is_the_fp32_kernel_rounded(rows, width):
    """bf16 gate|up in, bf16 out: the fp32 kernel's value on the same (exactly widened) inputs, rounded once."""
    stream = _cuda().stream()
    rng = np.random.default_rng(rows + width)
    gu = f32_to_bf16_bits(rand(rng, rows, 2 * width, scale=4.0))
    _, out = _run(lambda g, o, stream: ew.silu_mul_bf16_rows(g, o, stream=stream), [gu],
                  [np.full((rows, width), 0x7FC1, np.uint16)], stream)
    _, wide = _run(lambda g, o, stream: ew.silu_mul_rows(g, o, stream=stream), [bf16_bits_to_f32(gu)],
                   [_nan((rows, width))], stream)
    np.testing.assert_array_equal(out, f32_to_bf16_bits(wide))
    assert rel_l2(bf16_bits_to_f32(out), bf16_bits_to_f32(ew.silu_mul_bf16_rows_reference(gu))) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", [(1, 512), (37, 516), (300, 64), (3, 17408)])
def test_gpu_silu_mul_to_bf16_is_the_bf16_copy_of_the_fp32_kernel(rows, width):
    """fp32 gate|up in, bf16 out alone (the prefill activation a cuBLAS down projection reads): bitwise the bf16
    copy that silu_mul_rows writes beside its fp32 output, every element written."""
    stream = _cuda().stream()
    rng = np.random.default_rng(rows * width)
    gu = rand(rng, rows, 2 * width, scale=4.0)
    gu[0, :4] = [np.nan, np.inf, -np.inf, 0.0]
    _, out = _run(lambda g, o, stream: ew.silu_mul_to_bf16_rows(g, o, stream=stream), [gu],
                  [np.full((rows, width), 0x7FC1, np.uint16)], stream)
    _, _, copy = _run(lambda g, o, b, stream: ew.silu_mul_rows(g, o, out_bf16=b, stream=stream), [gu],
                      [_nan((rows, width)), np.full((rows, width), 0x7FC1, np.uint16)], stream)
    np.testing.assert_array_equal(out, copy)
    # The device's expf and NumPy's exp differ in the last fp32 bit, which can move a bf16 rounding by one ulp.
    assert rel_l2(bf16_bits_to_f32(out[1:]), bf16_bits_to_f32(ew.silu_mul_to_bf16_rows_reference(gu)[1:])) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", SHAPES + [(3, 7)])
def test_gpu_to_bf16_rows(rows, width):
    stream = _cuda().stream()
    rng = np.random.default_rng(5)
    x = rand(rng, rows, width, scale=100.0)
    x.flat[0] = np.nan
    x.flat[-1] = np.float32(1.00390625)  # a tie
    poison = np.full((rows, width), 0xFFFF, dtype=np.uint16)
    _, out = _run(lambda x, o, stream: ew.to_bf16_rows(x, o, stream=stream), [x], [poison], stream)
    np.testing.assert_array_equal(out, ew.to_bf16_rows_reference(x))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", SHAPES)
def test_gpu_sigmoid_gate_add(rows, width):
    stream = _cuda().stream()
    rng = np.random.default_rng(6)
    res, d, g = rand(rng, rows, width), rand(rng, rows, width), rand(rng, rows, 2, scale=20.0)
    new, _, _ = _run(lambda r, d, g, stream: ew.sigmoid_gate_add(r, d, g, stream=stream), [res, d, g], [], stream)
    assert rel_l2(new, ew.sigmoid_gate_add_reference(res, d, g)) < 1e-5
    one, _, _ = _run(lambda r, d, g, stream: ew.sigmoid_gate_add(r, d, g, stream=stream),
                     [res[-1:].copy(), d[-1:].copy(), g[-1:].copy()], [], stream)
    np.testing.assert_array_equal(one[0], new[-1])


# ------------------------------------------------------------------------------------ tensor-core x fragments

FRAGMENT_SHAPES = [(1, 64), (3, 5120), (8, 2048)]


def _poisoned_fragments(words):
    """A fragment buffer full of a pattern no producer writes: rows the kernel must leave alone keep it."""
    return np.full(words, 0xDEADBEEF, dtype=np.uint32)


def _expected_fragments(held, x):
    from ninfer.kernels_numba import quant_mma as qm

    want = held.copy()
    qm.write_fragment_rows_reference(want, x)
    return want


def test_fragment_rows_twin_writes_only_the_given_rows():
    from ninfer.kernels_numba import quant_mma as qm

    rng = np.random.default_rng(11)
    x = rand(rng, 3, 128)
    held = qm.x_fragments_reference(rand(rng, 8, 128))
    got = _expected_fragments(held, x)
    np.testing.assert_array_equal(qm.x_from_fragments(got, 3, 128), qm.bf16_rounded(x))
    np.testing.assert_array_equal(qm.x_from_fragments(got, 8, 128)[3:], qm.x_from_fragments(held, 8, 128)[3:])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", FRAGMENT_SHAPES)
def test_gpu_rms_norm_writes_x_fragments(rows, width):
    from ninfer.kernels_numba import quant_mma as qm

    stream = _cuda().stream()
    rng = np.random.default_rng(12)
    x, w = rand(rng, rows, width, scale=3.0), rand(rng, width, scale=0.2)
    held = _poisoned_fragments(qm.x_fragment_words(width))

    def launch(x, w, o, f, stream):
        ew.rms_norm_rows(x, w, o, eps=1e-6, offset=True, stream=stream, out_fragments=f)

    *_, out, fragments = _run(launch, [x, w], [_nan((rows, width)), held], stream)
    *_, plain = _run(lambda x, w, o, stream: ew.rms_norm_rows(x, w, o, eps=1e-6, offset=True, stream=stream),
                     [x, w], [_nan((rows, width))], stream)
    np.testing.assert_array_equal(out, plain)  # the fp32 output does not change
    np.testing.assert_array_equal(fragments, _expected_fragments(held, out))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", FRAGMENT_SHAPES)
def test_gpu_silu_mul_writes_x_fragments(rows, width):
    from ninfer.kernels_numba import quant_mma as qm

    stream = _cuda().stream()
    rng = np.random.default_rng(13)
    gu = rand(rng, rows, 2 * width, scale=4.0)
    held = _poisoned_fragments(qm.x_fragment_words(width))
    _, out, fragments = _run(lambda g, o, f, stream: ew.silu_mul_rows(g, o, stream=stream, out_fragments=f), [gu],
                             [_nan((rows, width)), held], stream)
    np.testing.assert_array_equal(fragments, _expected_fragments(held, out))
    slots = 3
    gu3 = rand(rng, rows, slots, 2 * width)
    words = qm.x_fragment_words(width)
    held3 = _poisoned_fragments(slots * words)
    _, out3, fragments3 = _run(lambda g, o, f, stream: ew.silu_mul_slots(g, o, stream=stream, out_fragments=f),
                               [gu3], [_nan((rows, slots, width)), held3], stream)
    for s in range(slots):
        np.testing.assert_array_equal(fragments3[s * words:(s + 1) * words],
                                      _expected_fragments(held3[s * words:(s + 1) * words], out3[:, s]))


def test_row_norms_need_whole_four_column_vectors():
    assert ew.norm_threads(100) == 32
    assert ew.norm_threads(5120) == 320
    with pytest.raises(ValueError, match="multiple of 4"):
        ew.norm_threads(102)


def test_fragment_outputs_refuse_more_rows_than_a_set_holds():
    from ninfer.kernels_numba import quant_mma as qm

    with pytest.raises(ValueError, match="x fragments of 9 rows"):
        qm.check_fragment_output(9, 64, np.zeros(qm.x_fragment_words(64), np.uint32))
    with pytest.raises(ValueError, match="2 set"):
        qm.check_fragment_output(2, 64, np.zeros(qm.x_fragment_words(64), np.uint32), 2)
