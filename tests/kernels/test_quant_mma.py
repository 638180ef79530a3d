"""Tensor-core quantized decode linear (Q4/Q5/Q6 G64, W8 G32) and its gathered MoE variant: the repacked fragment
layout and the twins checked on the CPU against the codec, the kernels on a GPU against their twins (bf16 x, exact
fp32 weights), with accumulation and batch invariance."""

from __future__ import annotations

import functools

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


def _expert_ids(rng, rows, slots, experts):
    """Distinct experts per row, as top-k routing picks them (rows may share experts)."""
    return np.stack([rng.permutation(experts)[:slots] for _ in range(rows)]).astype(np.int32)


def test_slot_fragments_are_each_slots_x_fragments():
    x = np.random.default_rng(3).standard_normal((3, 4, 128)).astype(np.float32)
    sets = QM.x_slot_fragments_reference(x).reshape(4, QM.x_fragment_words(128))
    for s in range(4):
        np.testing.assert_array_equal(sets[s], QM.x_fragments_reference(x[:, s]))
    bits = codec.f32_to_bf16_bits(x)
    lane, q, j, b = 9, 1, 2, 1  # g = 2, t = 1: columns 64 + 32 + 2 + 8 (+1), as in the plain fragments
    assert sets[3].reshape(2, 32, 4, 2)[q, lane, j, b] == bits[2, 3, 106] | (np.uint32(bits[2, 3, 107]) << 16)
    np.testing.assert_array_equal(QM.x_from_slot_fragments(QM.x_slot_fragments_reference(x), 3, 4, 128),
                                  QM.bf16_rounded(x))


def _gathered_problem(seed: int, fmt: str, *, experts: int, rpe: int, K: int, M: int, S: int, x_per_slot: bool):
    """A stacked expert matrix [experts * rpe, K] (shape, payload), expert ids [M, S] and x ([M, S, K] per slot)."""
    rng = np.random.default_rng(seed)
    shape = (experts * rpe, K)
    payload = _payload(rng, shape, fmt)
    ids = _expert_ids(rng, M, S, experts)
    x = rng.standard_normal((M, S, K) if x_per_slot else (M, K)).astype(np.float32)
    return shape, payload, ids, x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("x_per_slot", [False, True])
def test_the_gathered_twin_is_each_slots_expert_product(fmt, x_per_slot):
    rpe, M, S = 32, 3, 2
    shape, payload, ids, x = _gathered_problem(4, fmt, experts=5, rpe=rpe, K=128, M=M, S=S, x_per_slot=x_per_slot)
    got = QM.linear_quant_mma_gathered_reference(x, fmt, shape, payload, ids, rows_per_expert=rpe,
                                                 x_per_slot=x_per_slot)
    weights = codec.decode(payload, fmt, shape).astype(np.float64)
    x_bf16 = codec.bf16_bits_to_f32(codec.f32_to_bf16_bits(x)).astype(np.float64)
    assert got.shape == (M, S, rpe)
    for m in range(M):
        for s in range(S):
            e = ids[m, s]
            want = weights[e * rpe : (e + 1) * rpe] @ (x_bf16[m, s] if x_per_slot else x_bf16[m])
            np.testing.assert_allclose(got[m, s], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_per_slot", [False, True])
def test_the_host_twin_reads_x_back_from_its_fragments(x_per_slot):
    from ninfer.backends.cuda import host_kernels

    rpe, K, M, S = 16, 192, 8, 3
    shape, payload, ids, x = _gathered_problem(5, Q6G64, experts=4, rpe=rpe, K=K, M=M, S=S, x_per_slot=x_per_slot)
    xf = np.zeros(S * QM.x_fragment_words(K), np.uint32)
    (host_kernels.x_slot_fragments if x_per_slot else host_kernels.x_fragments)(x, xf, stream=0)
    y = np.full((M, S, rpe), np.nan, np.float32)
    host_kernels.linear_quant_mma_gathered(xf, host_kernels.upload_quant_mma(Q6G64, shape, payload), ids, y,
                                           rows_per_expert=rpe, x_per_slot=x_per_slot, stream=0)
    np.testing.assert_array_equal(y, QM.linear_quant_mma_gathered_reference(x, Q6G64, shape, payload, ids,
                                                                            rows_per_expert=rpe,
                                                                            x_per_slot=x_per_slot))


@pytest.mark.parametrize("ids_shape,rpe,y_shape,words,match", [
    ((9, 2), 16, (9, 2, 16), 10**6, "at most 8"),
    ((2, 2), 24, (2, 2, 24), 10**6, "multiple of 16"),
    ((2, 2), 48, (2, 2, 48), 10**6, "dividing the 64"),
    ((2, 2), 16, (2, 16), 10**6, r"not \[M, S, rows_per_expert\]"),
    ((2, 2), 16, (2, 2, 16), 511, r"2 set\(s\) of 256"),
])
def test_gathered_shapes_are_checked_before_launch(ids_shape, rpe, y_shape, words, match):
    qw = QM.QuantMmaWeight(Q4G64, (64, 64), None, None, None, 1, 0)
    with pytest.raises(ValueError, match=match):
        QM.linear_quant_mma_gathered(np.zeros(words, np.uint32), qw, np.zeros(ids_shape, np.int32),
                                     np.zeros(y_shape, np.float32), rows_per_expert=rpe, x_per_slot=True, stream=0)


def test_slot_fragments_take_at_most_8_rows_of_whole_blocks():
    for shape in ((9, 2, 64), (2, 2, 96)):
        with pytest.raises(ValueError, match="M <= 8, K % 64 == 0"):
            QM.x_slot_fragments(np.zeros(shape, np.float32), np.zeros(1024, np.uint32), stream=0)


def test_swiglu_order_puts_each_units_gate_and_up_in_one_tile():
    """Stored tile t holds the gate rows of units 8 t .. 8 t + 7 then their up rows, so C rows g and g + 8 of a lane
    are gate and up of one unit; the repacked planes read back as the rows in that order."""
    order = QM.swiglu_order(64)
    assert sorted(order) == list(range(64))
    for tile in range(4):
        gates, ups = order[16 * tile: 16 * tile + 8], order[16 * tile + 8: 16 * tile + 16]
        assert list(gates) == list(range(8 * tile, 8 * tile + 8)) and list(ups - 32) == list(gates)
    stacked = QM.swiglu_rows_order(128, 64)
    assert list(stacked[64:]) == list(order + 64)
    rng = np.random.default_rng(8)
    shape = (128, 128)
    payload = _payload(rng, shape, Q4G64)
    planes = QM.repack_quant_mma(Q4G64, shape, payload, swiglu_rows=64)
    np.testing.assert_array_equal(_unpack(Q4G64, planes, shape), codec.decode(payload, Q4G64, shape)[stacked])
    with pytest.raises(ValueError, match="rows % 32"):
        QM.swiglu_order(48)


def _run(x, qw, y0=None, accumulate=False, kernel=None, **geometry):
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    y = y0 if y0 is not None else np.full((x.shape[0], qw.shape[0]), np.nan, np.float32)
    dy = cuda.to_device(y, stream=stream)
    xf = cuda.device_array(QM.x_fragment_words(x.shape[1]), np.uint32, stream=stream)
    QM.x_fragments(cuda.to_device(x, stream=stream), xf, stream=stream)
    np.testing.assert_array_equal(xf.copy_to_host(stream=stream), QM.x_fragments_reference(x))
    QM.linear_quant_mma(xf, qw, dy, stream=stream, accumulate=accumulate, _kernel=kernel, **geometry)
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
    """Whatever runs a tile's blocks are split into: the default (`dequantize_parts`), a warp a tile, runs of 7
    blocks (5120 columns, 80 blocks: the last run is 3), a warp a block."""
    from ninfer.kernels_numba.numba_setup import cuda
    from ninfer.kernels_numba.quant_linear import dequantize_bf16_reference

    payload = _payload(np.random.default_rng(shape[0]), shape, fmt)
    qw = QM.upload_quant_mma(fmt, shape, payload)
    want = dequantize_bf16_reference(fmt, shape, payload)
    blocks = shape[1] // 64
    stream = cuda.stream()
    for parts in dict.fromkeys((None, 1, -(-blocks // 7), blocks)):
        out = cuda.to_device(np.full(shape, 0xFFFF, np.uint16), stream=stream)
        QM.dequantize_mma_bf16(qw, out, stream=stream, parts=parts)
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(got, want, err_msg=f"parts {parts}")


def test_dequantize_parts_give_every_launch_many_warps_in_runs_of_at_least_two_blocks():
    assert QM.dequantize_parts(16384, 32) == 8  # the 35B-A3B's stacked expert gate|up: runs of 4 blocks
    assert QM.dequantize_parts(32768, 8) == 4  # its stacked expert down: runs of 2
    assert QM.dequantize_parts(128, 64) == 32  # its GDN out projection: runs of 2
    assert QM.dequantize_parts(320, 272) == 136  # the 27B's down projection: runs of 2
    assert QM.dequantize_parts(2176, 80) == 40  # the 27B's gate|up: runs of 2
    assert QM.dequantize_parts(1, 5) == 2 and QM.dequantize_parts(7, 1) == 1 and QM.dequantize_parts(1 << 20, 80) == 1
    for tiles in (1, 3, 100, 4095, 40000):
        for blocks in (1, 2, 3, 5, 64, 97, 272):
            parts = QM.dequantize_parts(tiles, blocks)
            run = -(-blocks // parts)
            assert 1 <= parts <= blocks and (parts - 1) * run < blocks  # every warp has a block
            assert run >= min(QM.MIN_DEQUANTIZE_RUN, blocks)
            assert tiles * parts >= min(QM.MIN_DEQUANTIZE_WARPS, tiles * blocks // QM.MIN_DEQUANTIZE_RUN) // 2


def _run_gathered(x, qw, ids, rpe, x_per_slot, kernel=None, **geometry):
    """The gathered kernel's y, after checking the fragments it read against their twin."""
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    M, S = ids.shape
    K = qw.shape[1]
    xf = cuda.device_array((S if x_per_slot else 1) * QM.x_fragment_words(K), np.uint32, stream=stream)
    if x_per_slot:
        QM.x_slot_fragments(cuda.to_device(x, stream=stream), xf, stream=stream)
        want_xf = QM.x_slot_fragments_reference(x)
    else:
        QM.x_fragments(cuda.to_device(x, stream=stream), xf, stream=stream)
        want_xf = QM.x_fragments_reference(x)
    np.testing.assert_array_equal(xf.copy_to_host(stream=stream), want_xf)
    dy = cuda.to_device(np.full((M, S, rpe), np.nan, np.float32), stream=stream)
    QM.linear_quant_mma_gathered(xf, qw, cuda.to_device(ids, stream=stream), dy, rows_per_expert=rpe,
                                 x_per_slot=x_per_slot, stream=stream, _kernel=kernel, **geometry)
    out = dy.copy_to_host(stream=stream)
    stream.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("x_per_slot", [False, True])
@pytest.mark.parametrize("experts,s,rpe,k", [(6, 4, 48, 192), (16, 8, 128, 1024)])
def test_quant_mma_gathered_gpu_matches_the_twin_and_the_plain_kernel(fmt, m, x_per_slot, experts, s, rpe, k):
    shape, payload, ids, x = _gathered_problem(m + s + rpe + k, fmt, experts=experts, rpe=rpe, K=k, M=m, S=s,
                                               x_per_slot=x_per_slot)
    qw = QM.upload_quant_mma(fmt, shape, payload)
    got = _run_gathered(x, qw, ids, rpe, x_per_slot)
    assert np.isfinite(got).all()
    want = QM.linear_quant_mma_gathered_reference(x, fmt, shape, payload, ids, rows_per_expert=rpe,
                                                  x_per_slot=x_per_slot)
    assert _rel(got, want) < 1e-5
    # bitwise the plain kernel at the gathered geometry on the whole stacked matrix, at the slot's expert rows: same
    # tiles, same order
    plain = functools.partial(_run, qw=qw, kernel=_gathered_geometry_kernel(QM.FORMAT_BITS[fmt], qw.blocks),
                              warps=QM.GATHERED_WARPS)
    plains = [plain(np.ascontiguousarray(x[:, slot])) for slot in range(s)] if x_per_slot else [plain(x)] * s
    for slot, plain in enumerate(plains):
        for row in range(m):
            e = ids[row, slot]
            assert np.array_equal(got[row, slot], plain[row, e * rpe : (e + 1) * rpe]), (row, slot)


def test_fragment_sets_hold_eight_rows_each():
    rng = np.random.default_rng(31)
    x = rng.standard_normal((19, 128)).astype(np.float32)
    words = QM.x_fragments_reference(x)
    assert QM.x_sets(19) == 3 and QM.x_sets(0) == 1
    assert words.shape == (3 * QM.x_fragment_words(128),)
    for s in range(3):
        one = QM.x_fragments_reference(x[8 * s:8 * s + 8])
        np.testing.assert_array_equal(words[s * one.size:(s + 1) * one.size], one)
    np.testing.assert_array_equal(QM.x_from_fragments(words, 19, 128), QM.bf16_rounded(x))


def test_the_host_twin_takes_at_most_one_launchs_rows():
    from ninfer.backends.cuda import host_kernels as hk

    rows = QM.MAX_X_ROWS * QM.ROW_SETS + 1
    payload = _payload(np.random.default_rng(32), (16, 64), QM.Q4G64)
    qw = hk.upload_quant_mma(QM.Q4G64, (16, 64), payload)
    xf = QM.x_fragments_reference(np.ones((rows, 64), np.float32))
    with pytest.raises(ValueError, match="tensor-core linear"):
        hk.linear_quant_mma(xf, qw, np.zeros((rows, 16), np.float32), stream=None)


@functools.lru_cache(maxsize=None)
def _gathered_geometry_kernel(bits, blocks):
    """The plain GEMV at the gathered kernel's geometry (its warps and unroll for `blocks`)."""
    return QM.make_quant_mma_kernel(bits, QM.TILES, QM.GATHERED_WARPS, QM.gathered_unroll(blocks))


@functools.lru_cache(maxsize=None)
def _wide_kernel(bits, sets):
    return QM.make_quant_mma_kernel(bits, sets=sets)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,sets", [(9, 2), (16, 2), (17, 4), (32, 4)])
@pytest.mark.parametrize("n,k", [(70, 1024), (40, 5120)])
def test_wide_kernels_give_each_row_the_bits_of_one_set(fmt, m, sets, n, k):
    """A launch over several fragment sets decodes each weight fragment once for all of them; every row's result is
    bitwise what a one-set launch gives it (and the twin's within float tolerance), accumulation included."""
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(m * sets + n + k)
    payload = _payload(rng, (n, k), fmt)
    qw = QM.upload_quant_mma(fmt, (n, k), payload)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    stream = cuda.stream()
    xf = cuda.device_array(sets * QM.x_fragment_words(k), np.uint32, stream=stream)
    QM.x_fragments(cuda.to_device(x, stream=stream), xf, stream=stream)
    np.testing.assert_array_equal(xf.copy_to_host(stream=stream)[:QM.x_sets(m) * QM.x_fragment_words(k)],
                                  QM.x_fragments_reference(x))
    results = []
    for accumulate in (False, True):
        dy = cuda.to_device(y0 if accumulate else np.full((m, n), np.nan, np.float32), stream=stream)
        QM.linear_quant_mma(xf, qw, dy, stream=stream, accumulate=accumulate,
                            _kernel=_wide_kernel(QM.FORMAT_BITS[fmt], sets), sets=sets)
        results.append(dy.copy_to_host(stream=stream))
    stream.synchronize()
    wide, wide_acc = results
    one_set = np.concatenate([_run(x[first:first + 8], qw) for first in range(0, m, 8)])
    np.testing.assert_array_equal(wide, one_set)
    assert _rel(wide_acc, QM.linear_quant_mma_reference(x, fmt, (n, k), payload, y0, accumulate=True)) < 1e-5


@pytest.mark.slow
def test_kernels_match_their_twins_in_the_cuda_simulator():
    """Every format's x fragments, GEMV (one and two fragment sets, accumulating, one x row; K of 2 and 20 or 40
    blocks), gathered MoE GEMV (shared and per-slot x) and dequantization, and the Q4|Q5 pair launch (bitwise the two
    single launches), their own source run thread by thread with the mma, packed bf16 fma and global loads emulated."""
    from tests.support.simulated_kernels import run

    lines = run("quant_mma").splitlines()
    assert [line for line in lines if line.startswith("ok quant_mma ")] == [
        f"ok quant_mma {fmt}" for fmt in FORMATS] + ["ok quant_mma pair"]


@pytest.mark.slow
def test_swiglu_epilogues_in_the_cuda_simulator():
    """The plain and gathered SwiGLU epilogues and the dequantization of interleaved rows, bit for bit the
    unpermuted GEMVs then the silu-mul kernels (`simulated_kernels.quant_mma_swiglu`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("quant_mma_swiglu").splitlines()
                if line.startswith("ok quant_mma_swiglu")]) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [Q4G64, W8G32])
@pytest.mark.parametrize("m", [1, 8, 20])
@pytest.mark.parametrize("inter,k", [(512, 2048), (1024, 5120)])
def test_swiglu_epilogue_gpu_equals_gemv_then_silu_mul(fmt, m, inter, k):
    """The fused gate|up GEMV writes the x fragments of silu(gate) * up that the unpermuted weight's GEMV then
    silu_mul_rows (and x_fragments past 8 rows) write, bit for bit; the interleaved weight dequantizes to the
    original rows."""
    from ninfer.kernels_numba import elementwise
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(m + inter)
    shape = (2 * inter, k)
    payload = _payload(rng, shape, fmt)
    plain, stored = QM.upload_quant_mma(fmt, shape, payload), QM.upload_quant_mma(fmt, shape, payload,
                                                                                  swiglu_rows=2 * inter)
    stream = cuda.stream()
    x = rng.standard_normal((m, k)).astype(np.float32)
    xf = cuda.device_array(QM.x_sets(m) * QM.x_fragment_words(k), np.uint32, stream=stream)
    QM.x_fragments(cuda.to_device(x, stream=stream), xf, stream=stream)
    words = QM.x_sets(m) * QM.x_fragment_words(inter)
    fused = cuda.to_device(np.zeros(words, np.uint32), stream=stream)
    gate_up = cuda.device_array((m, 2 * inter), np.float32, stream=stream)
    QM.linear_quant_mma_swiglu(xf, stored, gate_up, fused, stream=stream)
    QM.linear_quant_mma(xf, plain, gate_up, stream=stream)
    act = cuda.device_array((m, inter), np.float32, stream=stream)
    want = cuda.to_device(np.zeros(words, np.uint32), stream=stream)
    if m <= QM.MAX_X_ROWS:
        elementwise.silu_mul_rows(gate_up, act, stream=stream, out_fragments=want)
    else:
        elementwise.silu_mul_rows(gate_up, act, stream=stream)
        QM.x_fragments(act, want, stream=stream)
    back = cuda.device_array(shape, np.uint16, stream=stream)
    original = cuda.device_array(shape, np.uint16, stream=stream)
    QM.dequantize_mma_bf16(stored, back, stream=stream)
    QM.dequantize_mma_bf16(plain, original, stream=stream)
    np.testing.assert_array_equal(fused.copy_to_host(stream=stream), want.copy_to_host(stream=stream))
    np.testing.assert_array_equal(back.copy_to_host(stream=stream), original.copy_to_host(stream=stream))
    stream.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gathered_swiglu_epilogue_gpu_equals_gathered_gemv_then_silu_mul(m):
    """The 35B-A3B's experts (512 units, K 2048, 8 slots of 64 experts): the fused gathered gate|up writes each
    slot's activation fragments as the unpermuted gathered GEMV then silu_mul_slots do, bit for bit."""
    from ninfer.kernels_numba import elementwise
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(30 + m)
    experts, slots, inter, k = 64, 8, 512, 2048
    shape = (experts * 2 * inter, k)
    payload = _payload(rng, shape, Q4G64)
    plain = QM.upload_quant_mma(Q4G64, shape, payload)
    stored = QM.upload_quant_mma(Q4G64, shape, payload, swiglu_rows=2 * inter)
    ids = cuda.to_device(_expert_ids(rng, m, slots, experts))
    stream = cuda.stream()
    x = rng.standard_normal((m, k)).astype(np.float32)
    xf = cuda.device_array(QM.x_fragment_words(k), np.uint32, stream=stream)
    QM.x_fragments(cuda.to_device(x, stream=stream), xf, stream=stream)
    words = slots * QM.x_fragment_words(inter)
    fused, want = (cuda.to_device(np.zeros(words, np.uint32), stream=stream) for _ in range(2))
    gate_up = cuda.device_array((m, slots, 2 * inter), np.float32, stream=stream)
    QM.linear_quant_mma_gathered_swiglu(xf, stored, ids, gate_up, fused, rows_per_expert=2 * inter, stream=stream)
    QM.linear_quant_mma_gathered(xf, plain, ids, gate_up, rows_per_expert=2 * inter, x_per_slot=False,
                                 stream=stream)
    elementwise.silu_mul_slots(gate_up, cuda.device_array((m, slots, inter), np.float32, stream=stream),
                               stream=stream, out_fragments=want)
    np.testing.assert_array_equal(fused.copy_to_host(stream=stream), want.copy_to_host(stream=stream))
    stream.synchronize()
