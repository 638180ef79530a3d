"""Gated full attention kernels: NumPy twins vs the CPU model (GatedAttention over PagedLayerKV), GPU parity."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact.codec import f32_to_bf16_bits  # noqa: E402
from ninfer.backends.cpu import ops  # noqa: E402
from ninfer.backends.cpu.paged_kv import PagedKVView, PagedLayerKV, int8_group  # noqa: E402
from ninfer.kernels_numba import attention as A  # noqa: E402
from ninfer.models.qwen3_6 import GatedAttention, MixerRows  # noqa: E402

F32 = np.float32

# (heads, kv_heads, head_dim, rotary_dim, sections)
TINY = [(4, 2, 64, 16, (3, 3, 2)), (4, 1, 32, 8, (2, 1, 1))]
REAL = [(24, 4, 256, 64, (11, 11, 10)), (16, 2, 256, 64, (11, 11, 10))]


def _weights(cfg, rng):
    heads, kv_heads, d, rotary, sections = cfg
    return (rng.standard_normal(d).astype(F32) * F32(0.3), rng.standard_normal(d).astype(F32) * F32(0.3),
            ops.rope_inv_freq(rotary, 1e7 if d == 256 else 1e4))


def _pools(pages, page_tokens, kv_heads, d, dtype):
    shape = (pages, page_tokens, kv_heads, d)
    if dtype == "bf16":
        return np.zeros(shape, np.uint16), np.zeros(shape, np.uint16), None, None
    sshape = shape[:-1] + (d // int8_group(d),)
    return np.zeros(shape, np.int8), np.zeros(shape, np.int8), np.zeros(sshape, np.uint16), np.zeros(sshape, np.uint16)


def _random_pools(rng, pages, page_tokens, kv_heads, d, dtype):
    shape = (pages, page_tokens, kv_heads, d)
    if dtype == "bf16":
        return (f32_to_bf16_bits(rng.standard_normal(shape).astype(F32)),
                f32_to_bf16_bits(rng.standard_normal(shape).astype(F32)), None, None)
    sshape = shape[:-1] + (d // int8_group(d),)

    def scales():
        return (rng.uniform(0.002, 0.03, sshape)).astype(np.float16).view(np.uint16)

    return (rng.integers(-127, 128, shape).astype(np.int8), rng.integers(-127, 128, shape).astype(np.int8),
            scales(), scales())


def _gated_attention(cfg, q_norm, k_norm, eps):
    heads, kv_heads, d, _, _ = cfg
    qw, kvw = heads * d, kv_heads * d
    width = 2 * qw + 2 * kvw
    output = np.zeros((width, qw), F32)
    output[:qw] = np.eye(qw, dtype=F32)
    store = {"a.query_key_gate_value": np.eye(width, dtype=F32), "a.query_norm": q_norm, "a.key_norm": k_norm,
             "a.output": output}
    dims = SimpleNamespace(hidden=width, q_width=qw, kv_width=kvw, head_dim=d, attn_heads=heads, kv_heads=kv_heads,
                           rms_eps=eps)
    return GatedAttention(dims, SimpleNamespace(get=store.__getitem__), "a.", fused=True)


# ------------------------------------------------------------------------------------------------------------------
# CPU: twins against the CPU model


@pytest.mark.parametrize("cfg", TINY + REAL[:1])
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_twins_match_cpu_gated_attention_over_paged_kv(cfg, dtype):
    rng = np.random.default_rng(1)
    heads, kv_heads, d, rotary, sections = cfg
    q_norm, k_norm, inv_freq = _weights(cfg, rng)
    eps = 1e-6
    page_tokens, pages = 4, 12
    width = 2 * (heads + kv_heads) * d
    layer = PagedLayerKV(pages, page_tokens, kv_heads, d, dtype)
    table = rng.permutation(pages).astype(np.int32)
    page_tables = table[None, :]
    model = _gated_attention(cfg, q_norm, k_norm, eps)
    k_pool, v_pool, k_scale, v_scale = _pools(pages, page_tokens, kv_heads, d, dtype)
    length = 0
    for count in (7, 1, 3, 1):  # a prefill chunk, a decode row, a verify block, a decode row
        qkgv = rng.standard_normal((count, width)).astype(F32)
        positions = np.stack([np.arange(length, length + count) + 3 * a for a in range(3)]).astype(np.int32)
        angles = ops.mrope_angles(positions, inv_freq, sections)
        view = PagedKVView(layer, table, length)
        expected = model(qkgv, [MixerRows(slice(0, count), view)], angles)[0][:, :heads * d]
        row_lane = np.zeros(count, np.int32)
        row_pos = np.arange(length, length + count, dtype=np.int32)
        q = np.full((count, heads, d), np.nan, F32)
        A.attention_prepare_reference(qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, page_tables,
                                      k_pool, v_pool, k_scale, v_scale, q, heads=heads, kv_heads=kv_heads,
                                      head_dim=d, rotary_dim=rotary, sections=sections, eps=eps)
        # the pool holds exactly what PagedLayerKV.write stored
        np.testing.assert_array_equal(k_pool, layer._k)
        np.testing.assert_array_equal(v_pool, layer._v)
        if dtype == "int8":
            np.testing.assert_array_equal(k_scale, layer._k_scale.view(np.uint16))
            np.testing.assert_array_equal(v_scale, layer._v_scale.view(np.uint16))
        out = np.full((count, heads * d), np.nan, F32)
        A.attention_decode_reference(q, qkgv, page_tables, row_lane, row_pos, k_pool, v_pool, k_scale, v_scale, out,
                                     heads=heads, kv_heads=kv_heads, head_dim=d)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        out2 = np.full((count, heads * d), np.nan, F32)
        A.attention_prefill_reference(q, qkgv, page_tables, 0, length, count, k_pool, v_pool, k_scale, v_scale, out2,
                                      heads=heads, kv_heads=kv_heads, head_dim=d)
        np.testing.assert_allclose(out2, expected, rtol=1e-5, atol=1e-6)
        length += count


def test_a_padded_row_gets_its_q_and_writes_no_kv():
    """A row with row_pos < 0 (a prefill chunk padded to its bucket) is normed and rotated like any row, and leaves
    every pool untouched."""
    rng = np.random.default_rng(6)
    cfg = TINY[0]
    heads, kv_heads, d, rotary, sections = cfg
    q_norm, k_norm, inv_freq = _weights(cfg, rng)
    for dtype in ("bf16", "int8"):
        pools = _pools(4, 4, kv_heads, d, dtype)
        before = [None if p is None else p.copy() for p in pools]
        qkgv = rng.standard_normal((2, 2 * (heads + kv_heads) * d)).astype(F32)
        positions = np.zeros((3, 2), np.int32)
        dims = dict(heads=heads, kv_heads=kv_heads, head_dim=d, rotary_dim=rotary, sections=sections, eps=1e-6)
        q = A.attention_prepare_reference(qkgv, q_norm, k_norm, inv_freq, positions, np.zeros(2, np.int32),
                                          np.array([-1, -1], np.int32), np.zeros((1, 4), np.int32), *pools,
                                          np.full((2, heads, d), np.nan, F32), **dims)
        alone = A.attention_prepare_reference(qkgv, q_norm, k_norm, inv_freq, positions, np.zeros(2, np.int32),
                                              np.array([0, 1], np.int32), np.zeros((1, 4), np.int32),
                                              *_pools(4, 4, kv_heads, d, dtype), np.full((2, heads, d), np.nan, F32),
                                              **dims)
        np.testing.assert_array_equal(q, alone)
        for got, want in zip(pools, before):
            if want is not None:
                np.testing.assert_array_equal(got, want)


def test_decode_twin_against_float64_formula():
    rng = np.random.default_rng(2)
    heads, kv_heads, d = 4, 2, 32
    k_pool, v_pool, _, _ = _random_pools(rng, 6, 4, kv_heads, d, "bf16")
    page_tables = np.stack([rng.permutation(6)[:3], rng.permutation(6)[:3]]).astype(np.int32)
    rows = 3
    row_lane = np.array([0, 1, 1], np.int32)
    row_pos = np.array([0, 5, 11], np.int32)
    q = rng.standard_normal((rows, heads, d)).astype(F32)
    qkgv = rng.standard_normal((rows, 2 * (heads + kv_heads) * d)).astype(F32)
    out = A.attention_decode_reference(q, qkgv, page_tables, row_lane, row_pos, k_pool, v_pool, None, None,
                                       np.zeros((rows, heads * d), F32), heads=heads, kv_heads=kv_heads, head_dim=d)
    kf = (k_pool.astype(np.uint32) << 16).view(F32).astype(np.float64)
    vf = (v_pool.astype(np.uint32) << 16).view(F32).astype(np.float64)
    for r in range(rows):
        for h in range(heads):
            keys = [(page_tables[row_lane[r], j // 4], j % 4) for j in range(row_pos[r] + 1)]
            kk = np.array([kf[p, o, h // 2] for p, o in keys])
            vv = np.array([vf[p, o, h // 2] for p, o in keys])
            s = kk @ q[r, h].astype(np.float64) / np.sqrt(d)
            w = np.exp(s - s.max())
            g = qkgv[r, (heads + kv_heads) * d + h * d:(heads + kv_heads) * d + (h + 1) * d].astype(np.float64)
            ref = (w / w.sum()) @ vv / (1 + np.exp(-g))
            np.testing.assert_allclose(out[r, h * d:(h + 1) * d], ref, rtol=2e-5, atol=1e-6)


def test_decode_partials_shape():
    assert A.decode_partials_shape(8, 24, 256) == (8, 24, A.DEFAULT_SPLITS, 258)
    assert A.decode_partials_shape(8, 24, 256, 5) == (8, 24, 5, 258)
    assert A.decode_partials_shape(8, 24, 256, A.MAX_SPLITS) == (8, 24, 256, 258)
    for splits in (0, A.MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="splits"):
            A.decode_partials_shape(8, 24, 256, splits)


def test_a_split_takes_at_least_its_floor_of_keys():
    # (the device function's Python body) 1000 keys in 64 splits: 16 keys each; a floor of 100 keys: 100 (10
    # splits); floors and shares round up to 4 keys
    assert [A.split_keys.py_func(1000, 64, floor) for floor in (0, 16, 100, 101)] == [16, 16, 100, 104]
    assert A.split_keys.py_func(1, 64, 0) == 4 and A.split_keys.py_func(1, 64, 256) == 256
    with pytest.raises(ValueError, match="fewest keys a split takes must be >= 0, got -1"):
        A.check_min_split_keys(-1)


def test_models_take_256_blocks_a_row_within_32_to_64_splits():
    # the 27B's 4 kv heads, the 35B-A3B's 2, a one-kv-head model, eight and sixteen kv heads
    assert [A.row_splits(kv_heads) for kv_heads in (4, 2, 1, 8, 16)] == [64, 64, 64, 32, 32]


# ------------------------------------------------------------------------------------------------------------------
# GPU


def _rel(a, b):
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))


def _dev(cuda, *arrays):
    return [None if a is None else cuda.to_device(np.ascontiguousarray(a)) for a in arrays]


def _decode_gpu(cuda, q, qkgv, tables, lanes, pos, pools, heads, kv_heads, d, splits,
                min_split_keys=0, tensor_cores=True):
    stream = cuda.stream()
    dq, dg, dt, dl, dp = _dev(cuda, q, qkgv, tables, lanes, pos)
    dk, dv, dks, dvs = _dev(cuda, *pools)
    out = cuda.to_device(np.full((q.shape[0], heads * d), np.nan, F32))
    partials = cuda.to_device(np.full(A.decode_partials_shape(q.shape[0], heads, d, splits), np.nan, F32))
    A.attention_decode(dq, dg, dt, dl, dp, dk, dv, dks, dvs, out, partials, heads=heads, kv_heads=kv_heads,
                       head_dim=d, stream=stream, min_split_keys=min_split_keys, tensor_cores=tensor_cores)
    stream.synchronize()
    return out.copy_to_host()


def _long_rows(seed, cfg, dtype, last_pos):
    """Two lanes of 32 pages of 64 tokens and 4 rows on them, of 1, 96, 2000 and last_pos + 1 keys: (q, qkgv,
    tables, row_lane, row_pos, pools)."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, d, _, _ = cfg
    pools = _random_pools(rng, 40, 64, kv_heads, d, dtype)
    tables = np.stack([rng.permutation(40)[:32] for _ in range(2)]).astype(np.int32)
    q = rng.standard_normal((4, heads, d)).astype(F32)
    qkgv = rng.standard_normal((4, 2 * (heads + kv_heads) * d)).astype(F32)
    return q, qkgv, tables, np.array([0, 1, 0, 1], np.int32), np.array([0, 95, 1999, last_pos], np.int32), pools


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", REAL)
@pytest.mark.parametrize("dtype,tensor_cores", [("bf16", True), ("bf16", False), ("int8", True),
                                                ("int8", False)])
def test_gpu_decode_with_a_split_floor_matches_twin_and_is_batch_invariant(cfg, dtype, tensor_cores):
    """attention_decode with at least 64 or 256 keys a split (64 splits at most): the twin's result, and a row alone
    the same bits as in the batch (the tensor-core kernel, bf16 or INT8 pools, or the staged one)."""
    from ninfer.kernels_numba.numba_setup import cuda
    heads, kv_heads, d, _, _ = cfg
    q, qkgv, tables, row_lane, row_pos, pools = _long_rows(5, cfg, dtype, 700)
    want = A.attention_decode_reference(q, qkgv, tables, row_lane, row_pos, *pools, np.zeros((4, heads * d), F32),
                                        heads=heads, kv_heads=kv_heads, head_dim=d)
    for floor in (64, 256):
        got = _decode_gpu(cuda, q, qkgv, tables, row_lane, row_pos, pools, heads, kv_heads, d, 64,
                          min_split_keys=floor, tensor_cores=tensor_cores)
        assert _rel(got, want) < 1e-5, (floor, _rel(got, want))
        alone = _decode_gpu(cuda, q[2:3], qkgv[2:3], tables, row_lane[2:3], row_pos[2:3], pools, heads, kv_heads, d,
                            64, min_split_keys=floor, tensor_cores=tensor_cores)
        np.testing.assert_array_equal(alone[0], got[2])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", REAL)
def test_gpu_decode_writes_the_bf16_copy_and_x_fragments_of_its_output(cfg):
    """With out_bf16 and out_fragments the combine writes the output projection's inputs: bitwise the host twin's
    conversions of the fp32 output it wrote, which is the same with or without them."""
    from ninfer.backends.cuda import host_kernels
    from ninfer.kernels_numba.numba_setup import cuda
    from ninfer.kernels_numba.quant_mma import x_fragment_words

    heads, kv_heads, d, _, _ = cfg
    q, qkgv, tables, row_lane, row_pos, pools = _long_rows(3, cfg, "bf16", 700)
    plain = _decode_gpu(cuda, q, qkgv, tables, row_lane, row_pos, pools, heads, kv_heads, d, 64)
    stream = cuda.stream()
    args = _dev(cuda, q, qkgv, tables, row_lane, row_pos) + _dev(cuda, *pools)
    out = cuda.to_device(np.full((4, heads * d), np.nan, F32))
    partials = cuda.to_device(np.zeros(A.decode_partials_shape(4, heads, d, 64), F32))
    bf16 = cuda.to_device(np.zeros((4, heads * d), np.uint16))
    fragments = cuda.to_device(np.zeros(x_fragment_words(heads * d), np.uint32))
    A.attention_decode(*args, out, partials, heads=heads, kv_heads=kv_heads, head_dim=d, stream=stream,
                       out_bf16=bf16, out_fragments=fragments)
    stream.synchronize()
    got = out.copy_to_host()
    np.testing.assert_array_equal(got, plain)
    want_bf16, want_fragments = np.zeros((4, heads * d), np.uint16), np.zeros(x_fragment_words(heads * d), np.uint32)
    host_kernels._bf16_copy(got, want_bf16)
    host_kernels._fragment_rows(got, want_fragments)
    np.testing.assert_array_equal(bf16.copy_to_host(), want_bf16)
    np.testing.assert_array_equal(fragments.copy_to_host(), want_fragments)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", REAL)
@pytest.mark.parametrize("dtype,tensor_cores", [("bf16", True), ("bf16", False), ("int8", True),
                                                ("int8", False)])
def test_gpu_head_dim_256_decode_matches_twin_at_every_split_count(cfg, dtype, tensor_cores):
    """The head_dim 256 kernel (K/V tiles through shared memory) at the real shapes against the exact twin, rows of
    1 to 2000 keys: one split (63 tiles in a block), the model's splits and the most splits (a few keys a block)."""
    from ninfer.kernels_numba.numba_setup import cuda
    heads, kv_heads, d, _, _ = cfg
    q, qkgv, tables, row_lane, row_pos, pools = _long_rows(11, cfg, dtype, 1000)
    want = A.attention_decode_reference(q, qkgv, tables, row_lane, row_pos, *pools, np.zeros((4, heads * d), F32),
                                        heads=heads, kv_heads=kv_heads, head_dim=d)
    for splits in (1, A.row_splits(kv_heads), A.MAX_SPLITS):
        got = _decode_gpu(cuda, q, qkgv, tables, row_lane, row_pos, pools, heads, kv_heads, d, splits,
                          tensor_cores=tensor_cores)
        assert np.isfinite(got).all() and _rel(got, want) < 1e-5, (splits, _rel(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TINY + REAL)
@pytest.mark.parametrize("dtype,tensor_cores", [("bf16", True), ("bf16", False), ("int8", True),
                                                ("int8", False)])
def test_gpu_decode_matches_twin_and_is_batch_invariant(cfg, dtype, tensor_cores):
    """Rows of three lanes, one a verify run of 6 (the tensor-core kernel serves up to 5 of a 27B lane's rows a
    block): the twin's result at 1 to 256 splits, and rows alone (one of them from inside the run) bitwise as in the
    batch."""
    from ninfer.kernels_numba.numba_setup import cuda
    rng = np.random.default_rng(3)
    heads, kv_heads, d, _, _ = cfg
    page_tokens, pages, max_pages = 64, 40, 12
    pools = _random_pools(rng, pages, page_tokens, kv_heads, d, dtype)
    tables = np.stack([rng.permutation(pages)[:max_pages] for _ in range(3)]).astype(np.int32)
    # lanes of different lengths crossing page boundaries, plus a verify block (lane 2, consecutive positions)
    row_lane = np.array([0, 1, 2, 2, 2, 2, 2, 2, 1], np.int32)
    row_pos = np.array([0, 63, 700, 701, 702, 703, 704, 705, 129], np.int32)
    rows = len(row_lane)
    q = rng.standard_normal((rows, heads, d)).astype(F32)
    qkgv = rng.standard_normal((rows, 2 * (heads + kv_heads) * d)).astype(F32)
    want = A.attention_decode_reference(q, qkgv, tables, row_lane, row_pos, *pools, np.zeros((rows, heads * d), F32),
                                        heads=heads, kv_heads=kv_heads, head_dim=d)
    for splits in (1, 7, A.DEFAULT_SPLITS, A.MAX_SPLITS):
        got = _decode_gpu(cuda, q, qkgv, tables, row_lane, row_pos, pools, heads, kv_heads, d, splits,
                          tensor_cores=tensor_cores)
        assert np.isfinite(got).all()
        assert _rel(got, want) < 1e-5, _rel(got, want)
        # one row alone: bitwise the same
        for r in (0, 4, 7, 8):
            alone = _decode_gpu(cuda, q[r:r + 1], qkgv[r:r + 1], tables, row_lane[r:r + 1], row_pos[r:r + 1], pools,
                                heads, kv_heads, d, splits, tensor_cores=tensor_cores)
            np.testing.assert_array_equal(alone[0], got[r])


def test_decode_kernels_with_more_than_32_splits_in_cuda_simulator():
    """The split decode kernel and the combine run thread by thread against the exact twin with 96 splits a row
    (the combine's lanes hold several splits each), then 8 splits with a floor of 60 keys a split
    (`simulated_kernels.attention_decode`)."""
    from tests.support.simulated_kernels import run

    assert [line for line in run("attention_decode").splitlines() if line.startswith("ok attention_decode")] == [
        "ok attention_decode 4 2 32 96 floor 0", "ok attention_decode 4 2 32 8 floor 60",
        "ok attention_decode bf16 copy and x fragments"]


def test_head_dim_256_decode_kernel_in_cuda_simulator():
    """The head_dim 256 decode kernel (the real models'; K/V tiles through shared memory), run thread by thread
    against the exact twin with bf16 and int8 KV over 4 tiles and with int8 KV in 2 splits
    (`simulated_kernels.attention_decode_staged`)."""
    from tests.support.simulated_kernels import run

    lines = run("attention_decode_staged").splitlines()
    assert [line for line in lines if line.startswith("ok attention_decode_")] == [
        "ok attention_decode_staged bf16 1", "ok attention_decode_staged int8 1", "ok attention_decode_staged int8 2"]


def test_tensor_core_decode_kernel_in_cuda_simulator():
    """The tensor-core decode kernel (INT8 and bf16 pools) and the combine run thread by thread against the exact
    twin: a verify run of 6
    rows in blocks of 5 and 1, rows cut at different keys, and a row alone bitwise as in the batch
    (`simulated_kernels.attention_decode_mma`)."""
    from tests.support.simulated_kernels import run

    assert [line for line in run("attention_decode_mma").splitlines() if line.startswith("ok ")] == [
        "ok attention_decode_mma int8 16", "ok attention_decode_mma int8 32", "ok attention_decode_mma 2 floor 0",
        "ok attention_decode_mma row alone"]


def test_prepare_kernel_in_cuda_simulator():
    """The prepare kernel (a warp per row and head) run thread by thread against its twin, bf16 and int8 pools, the
    tiny head dims and 256 (`simulated_kernels.attention_prepare`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("attention_prepare").splitlines()
                if line.startswith("ok attention_prepare")]) == 6


def _prepare_gpu(cuda, cfg, qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, tables, pools, eps):
    heads, kv_heads, d, rotary, sections = cfg
    stream = cuda.stream()
    dev = _dev(cuda, qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, tables)
    dpools = _dev(cuda, *pools)
    q_out = cuda.to_device(np.full((qkgv.shape[0], heads, d), np.nan, F32))
    A.attention_prepare(*dev, *dpools, q_out, heads=heads, kv_heads=kv_heads, head_dim=d, rotary_dim=rotary,
                        sections=sections, eps=eps, stream=stream)
    stream.synchronize()
    return q_out.copy_to_host(), [None if p is None else p.copy_to_host() for p in dpools]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TINY + REAL)
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_gpu_prepare_matches_twin(cfg, dtype):
    from ninfer.kernels_numba.numba_setup import cuda
    rng = np.random.default_rng(4)
    heads, kv_heads, d, rotary, sections = cfg
    q_norm, k_norm, inv_freq = _weights(cfg, rng)
    pages, page_tokens = 8, 64
    rows = 6
    tables = np.stack([rng.permutation(pages)[:4] for _ in range(2)]).astype(np.int32)
    row_lane = np.array([0, 1, 1, 1, 0, 1], np.int32)
    row_pos = np.array([3, 63, 64, 65, 200, -1], np.int32)  # the last: a padded prefill row, its q only
    positions = np.stack([row_pos, row_pos + 7, row_pos * 2]).astype(np.int32)
    width = 2 * (heads + kv_heads) * d

    # (1) random inputs: q within fp32 rounding of the twin; V bitwise; K within one bf16 / int8 step
    qkgv = rng.standard_normal((rows, width)).astype(F32)
    want_pools = _pools(pages, page_tokens, kv_heads, d, dtype)
    want_q = A.attention_prepare_reference(qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, tables,
                                           *want_pools, np.zeros((rows, heads, d), F32), heads=heads,
                                           kv_heads=kv_heads, head_dim=d, rotary_dim=rotary, sections=sections,
                                           eps=1e-6)
    got_q, got_pools = _prepare_gpu(cuda, cfg, qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, tables,
                                    _pools(pages, page_tokens, kv_heads, d, dtype), 1e-6)
    assert np.isfinite(got_q).all()
    assert _rel(got_q, want_q) < 1e-5
    np.testing.assert_array_equal(got_pools[1], want_pools[1])  # V
    if dtype == "int8":
        np.testing.assert_array_equal(got_pools[3], want_pools[3])
        assert np.abs(got_pools[0].astype(int) - want_pools[0].astype(int)).max() <= 1
    else:
        assert np.abs(got_pools[0].astype(int) - want_pools[0].astype(int)).max() <= 1

    # (2) inputs whose norm and rope are exact in any order (|k| constant, positions 0): K bitwise too
    qkgv[:, heads * d:(heads + kv_heads) * d] = np.where(rng.random((rows, kv_heads * d)) < 0.5, -0.5, 0.5)
    zero = np.zeros_like(positions)
    want_pools = _pools(pages, page_tokens, kv_heads, d, dtype)
    A.attention_prepare_reference(qkgv, q_norm, k_norm, inv_freq, zero, row_lane, row_pos, tables, *want_pools,
                                  np.zeros((rows, heads, d), F32), heads=heads, kv_heads=kv_heads, head_dim=d,
                                  rotary_dim=rotary, sections=sections, eps=1e-6)
    _, got_pools = _prepare_gpu(cuda, cfg, qkgv, q_norm, k_norm, inv_freq, zero, row_lane, row_pos, tables,
                                _pools(pages, page_tokens, kv_heads, d, dtype), 1e-6)
    for got, want in zip(got_pools, want_pools):
        if want is not None:
            np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TINY + REAL)
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_gpu_prefill_matches_twin_and_decode(cfg, dtype):
    from ninfer.kernels_numba.numba_setup import cuda
    rng = np.random.default_rng(5)
    heads, kv_heads, d, _, _ = cfg
    page_tokens, pages = 64, 16
    pools = _random_pools(rng, pages, page_tokens, kv_heads, d, dtype)
    tables = np.stack([rng.permutation(pages)[:10] for _ in range(2)]).astype(np.int32)
    stream = cuda.stream()
    dt, *dpools = _dev(cuda, tables, *pools)
    for kv_start, count in ((0, 150), (77, 64), (300, 1), (130, 200)):
        q = rng.standard_normal((count, heads, d)).astype(F32)
        qkgv = rng.standard_normal((count, 2 * (heads + kv_heads) * d)).astype(F32)
        want = A.attention_prefill_reference(q, qkgv, tables, 1, kv_start, count, *pools,
                                             np.zeros((count, heads * d), F32), heads=heads, kv_heads=kv_heads,
                                             head_dim=d)
        dq, dg = _dev(cuda, q, qkgv)
        out = cuda.to_device(np.full((count, heads * d), np.nan, F32))
        A.attention_prefill(dq, dg, dt, 1, kv_start, count, *dpools, out, heads=heads, kv_heads=kv_heads, head_dim=d,
                            stream=stream)
        stream.synchronize()
        got = out.copy_to_host()
        assert np.isfinite(got).all()
        assert _rel(got, want) < 1e-5, _rel(got, want)
        pos = np.arange(kv_start, kv_start + count, dtype=np.int32)
        dec = _decode_gpu(cuda, q, qkgv, tables, np.ones(count, np.int32), pos, pools, heads, kv_heads, d,
                          A.DEFAULT_SPLITS)
        assert _rel(got, dec) < 1e-5
        np.testing.assert_allclose(got, dec, rtol=1e-4, atol=1e-5)


def _pipeline_matches_cpu_model(cfg, dtype, prepare, decode, prefill, to_host):
    """Drive prepare + prefill / decode through a prefill chunk, decode rows and a verify block of one sequence and
    compare with the CPU GatedAttention over PagedLayerKV (projections set to identity)."""
    rng = np.random.default_rng(6)
    heads, kv_heads, d, rotary, sections = cfg
    q_norm, k_norm, inv_freq = _weights(cfg, rng)
    eps, page_tokens, pages = 1e-6, 64, 6
    width = 2 * (heads + kv_heads) * d
    layer = PagedLayerKV(pages, page_tokens, kv_heads, d, dtype)
    table = rng.permutation(pages).astype(np.int32)
    model = _gated_attention(cfg, q_norm, k_norm, eps)
    pools = _pools(pages, page_tokens, kv_heads, d, dtype)
    state = prepare("init", pools)
    length = 0
    for count, mode in ((70, "prefill"), (1, "decode"), (6, "decode"), (64, "prefill"), (1, "decode")):
        qkgv = rng.standard_normal((count, width)).astype(F32)
        positions = np.stack([np.arange(length, length + count)] * 3).astype(np.int32)
        angles = ops.mrope_angles(positions, inv_freq, sections)
        expected = model(qkgv, [MixerRows(slice(0, count), PagedKVView(layer, table, length))], angles)[0]
        expected = expected[:, :heads * d]
        row_lane = np.zeros(count, np.int32)
        row_pos = np.arange(length, length + count, dtype=np.int32)
        q = prepare(state, (qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, table[None, :].copy()))
        if mode == "prefill":
            got = prefill(state, q, qkgv, length, count)
        else:
            got = decode(state, q, qkgv, row_lane, row_pos)
        got = to_host(got)
        assert np.isfinite(got).all()
        assert _rel(got, expected) < 1e-2, (mode, _rel(got, expected))
        length += count


class _TwinPipeline:
    """The pipeline on the NumPy twins (runs on CPU; validates the pipeline test itself)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def prepare(self, state, args):
        heads, kv_heads, d, rotary, sections = self.cfg
        if state == "init":
            self.pools = args
            return self
        qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, tables = args
        self.tables = tables
        return A.attention_prepare_reference(qkgv, q_norm, k_norm, inv_freq, positions, row_lane, row_pos, tables,
                                             *self.pools, np.zeros((qkgv.shape[0], heads, d), F32), heads=heads,
                                             kv_heads=kv_heads, head_dim=d, rotary_dim=rotary, sections=sections,
                                             eps=1e-6)

    def decode(self, state, q, qkgv, row_lane, row_pos):
        heads, kv_heads, d, _, _ = self.cfg
        return A.attention_decode_reference(q, qkgv, self.tables, row_lane, row_pos, *self.pools,
                                            np.zeros((q.shape[0], heads * d), F32), heads=heads, kv_heads=kv_heads,
                                            head_dim=d)

    def prefill(self, state, q, qkgv, kv_start, count):
        heads, kv_heads, d, _, _ = self.cfg
        return A.attention_prefill_reference(q, qkgv, self.tables, 0, kv_start, count, *self.pools,
                                             np.zeros((count, heads * d), F32), heads=heads, kv_heads=kv_heads,
                                             head_dim=d)


class _GpuPipeline(_TwinPipeline):
    def __init__(self, cfg, cuda):
        super().__init__(cfg)
        self.cuda, self.stream = cuda, cuda.stream()

    def prepare(self, state, args):
        heads, kv_heads, d, rotary, sections = self.cfg
        if state == "init":
            self.pools = _dev(self.cuda, *args)
            return self
        dev = _dev(self.cuda, *args)
        self.tables = dev[-1]
        q = self.cuda.to_device(np.full((args[0].shape[0], heads, d), np.nan, F32))
        A.attention_prepare(*dev, *self.pools, q, heads=heads, kv_heads=kv_heads, head_dim=d, rotary_dim=rotary,
                            sections=sections, eps=1e-6, stream=self.stream)
        return q

    def decode(self, state, q, qkgv, row_lane, row_pos):
        heads, kv_heads, d, _, _ = self.cfg
        dg, dl, dp = _dev(self.cuda, qkgv, row_lane, row_pos)
        out = self.cuda.to_device(np.full((q.shape[0], heads * d), np.nan, F32))
        partials = self.cuda.device_array(A.decode_partials_shape(q.shape[0], heads, d), np.float32)
        A.attention_decode(q, dg, self.tables, dl, dp, *self.pools, out, partials, heads=heads, kv_heads=kv_heads,
                           head_dim=d, stream=self.stream)
        return out

    def prefill(self, state, q, qkgv, kv_start, count):
        heads, kv_heads, d, _, _ = self.cfg
        (dg,) = _dev(self.cuda, qkgv)
        out = self.cuda.to_device(np.full((count, heads * d), np.nan, F32))
        A.attention_prefill(q, dg, self.tables, 0, kv_start, count, *self.pools, out, heads=heads, kv_heads=kv_heads,
                            head_dim=d, stream=self.stream)
        return out


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_twin_pipeline_matches_cpu_model(dtype):
    cfg = TINY[0]
    twin = _TwinPipeline(cfg)
    _pipeline_matches_cpu_model(cfg, dtype, twin.prepare, twin.decode, twin.prefill, lambda a: a)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TINY + REAL)
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_gpu_pipeline_matches_cpu_model(cfg, dtype):
    from ninfer.kernels_numba.numba_setup import cuda
    gpu = _GpuPipeline(cfg, cuda)

    def to_host(array):
        gpu.stream.synchronize()
        return array.copy_to_host()

    _pipeline_matches_cpu_model(cfg, dtype, gpu.prepare, gpu.decode, gpu.prefill, to_host)
