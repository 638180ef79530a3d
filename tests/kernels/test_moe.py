"""moe.py: twins vs cpu/moe.py (route_top_k, the sparse_moe composition), grouping twins, GPU parity (gpu marker)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from ninfer.backends.cpu import moe as cpu_moe  # noqa: E402
from ninfer.backends.cpu.ops import linear  # noqa: E402
from ninfer.kernels_numba import elementwise as ew  # noqa: E402
from ninfer.kernels_numba import moe  # noqa: E402


def rel_l2(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


ROUTE_CASES = [(1, 8, 2), (5, 8, 2), (8, 256, 8), (48, 256, 8), (3, 200, 8), (7, 64, 4), (2, 40, 32)]


# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("rows,experts,k", ROUTE_CASES)
def test_route_reference_is_cpu_route_sorted_by_id(rows, experts, k):
    rng = np.random.default_rng(rows * experts)
    logits = rand(rng, rows, experts, scale=2.0)
    ids, w = moe.route_top_k_reference(logits, k)
    cids, cw = cpu_moe.route_top_k(logits, k)
    assert np.all(np.diff(ids, axis=1) > 0)
    for r in range(rows):
        np.testing.assert_array_equal(ids[r], np.sort(cids[r]))
        np.testing.assert_array_equal(w[r], cw[r][np.argsort(cids[r])])
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-5)


def test_route_reference_ties_go_to_lower_ids():
    logits = np.zeros((2, 16), dtype=np.float32)
    logits[1, [3, 9, 12]] = 1.0
    ids, w = moe.route_top_k_reference(logits, 4)
    np.testing.assert_array_equal(ids[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(ids[1], [0, 3, 9, 12])
    np.testing.assert_allclose(w[0], 0.25)


def _moe_weights(rng, hidden, experts, inter, shared_inter):
    return cpu_moe.MoeWeights(
        router=rand(rng, experts, hidden, scale=0.3), shared_gate=rand(rng, hidden, scale=0.2),
        routed_gate_up=rand(rng, experts, 2 * inter, hidden, scale=0.2),
        routed_down=rand(rng, experts, hidden, inter, scale=0.2),
        shared_gate_up=rand(rng, 2 * shared_inter, hidden, scale=0.2),
        shared_down=rand(rng, hidden, shared_inter, scale=0.2))


def _twin_moe(x, w, k):
    """sparse_moe composed from the twins, both routes: decode (per-slot, moe_combine) and prefill (grouped)."""
    rows, hidden = x.shape
    experts = w.router.shape[0]
    ids, weights = moe.route_top_k_reference(linear(x, w.router), k)
    # decode route: per-slot experts
    gate_up = np.stack([np.stack([linear(x[r:r + 1], w.routed_gate_up[ids[r, s]])[0] for s in range(k)])
                        for r in range(rows)])
    hid = ew.silu_mul_slots_reference(gate_up)
    down = np.stack([np.stack([linear(hid[r, s][None], w.routed_down[ids[r, s]])[0] for s in range(k)])
                     for r in range(rows)])
    shared_inter = w.shared_gate_up.shape[0] // 2
    sh = linear(ew.silu_mul_rows_reference(linear(x, w.shared_gate_up)), w.shared_down)
    gate = linear(x, w.shared_gate[None, :])
    zero = np.zeros_like(x)
    decode = moe.moe_combine_reference(down, weights, ew.sigmoid_gate_add_reference(zero, sh, gate))
    # prefill route: grouped by expert, bf16 GEMM inputs and outputs (the grouped GEMM's)
    counts, offsets, slot_of, position_of = moe.moe_group_reference(ids, experts)
    xs = bf16_bits_to_f32(moe.moe_gather_reference(x, slot_of, k))
    permuted = np.zeros((rows * k, hidden), dtype=np.uint16)
    for e in range(experts):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            act = ew.silu_mul_bf16_rows_reference(f32_to_bf16_bits(linear(xs[lo:hi], w.routed_gate_up[e])))
            permuted[lo:hi] = f32_to_bf16_bits(linear(bf16_bits_to_f32(act), w.routed_down[e]))
    prefill = moe.moe_scatter_combine_reference(permuted, position_of, weights, k,
                                                ew.sigmoid_gate_add_reference(zero, sh, gate))
    assert shared_inter
    return decode, prefill


@pytest.mark.parametrize("rows,hidden,experts,k", [(1, 64, 8, 2), (7, 64, 8, 2), (5, 48, 16, 4)])
def test_twin_composition_matches_cpu_sparse_moe(rows, hidden, experts, k):
    rng = np.random.default_rng(rows + experts)
    w = _moe_weights(rng, hidden, experts, 32, 32)
    x = rand(rng, rows, hidden)
    want = cpu_moe.sparse_moe(x, w, k)
    decode, prefill = _twin_moe(x, w, k)
    assert rel_l2(decode, want) < 1e-5
    assert rel_l2(prefill, want) < 1e-2  # bf16 rounding of the GEMM inputs and outputs


@pytest.mark.parametrize("rows,experts,k", [(1, 8, 2), (9, 8, 2), (100, 256, 8)])
def test_group_reference(rows, experts, k):
    rng = np.random.default_rng(rows)
    ids = np.sort(np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)]), axis=1).astype(np.int32)
    counts, offsets, slot_of, position_of = moe.moe_group_reference(ids, experts)
    assert offsets[-1] == rows * k and np.all(np.diff(offsets) == counts)
    flat = ids.reshape(-1)
    for e in range(experts):
        seg = slot_of[offsets[e]:offsets[e + 1]]
        assert np.all(flat[seg] == e) and np.all(np.diff(seg) > 0)
    np.testing.assert_array_equal(slot_of[position_of], np.arange(rows * k))
    x = rand(rng, rows, 10)
    np.testing.assert_array_equal(moe.moe_gather_reference(x, slot_of, k), f32_to_bf16_bits(x[slot_of // k]))


# ------------------------------------------------------------------------------------------------ GPU


def _cuda():
    from ninfer.kernels_numba.numba_setup import cuda
    return cuda


def _route_gpu(logits, k, stream, programmatic=False):
    cuda = _cuda()
    rows = logits.shape[0]
    d_ids = cuda.to_device(np.full((rows, k), -7, dtype=np.int32), stream=stream)
    d_w = cuda.to_device(np.full((rows, k), np.nan, dtype=np.float32), stream=stream)
    moe.route_top_k(cuda.to_device(logits, stream=stream), k, d_ids, d_w, stream=stream, programmatic=programmatic)
    ids, w = d_ids.copy_to_host(stream=stream), d_w.copy_to_host(stream=stream)
    stream.synchronize()
    return ids, w


@pytest.mark.gpu
@pytest.mark.parametrize("programmatic", [False, True])
@pytest.mark.parametrize("rows,experts,k", ROUTE_CASES)
def test_gpu_route_top_k(rows, experts, k, programmatic):
    stream = _cuda().stream()
    rng = np.random.default_rng(11)
    logits = rand(rng, rows, experts, scale=2.0)
    logits[0, : min(experts, 12)] = 0.5  # ties
    if rows > 1:  # a row of three levels: every pick a tie the lower id wins
        logits[1] = rng.integers(0, 3, experts).astype(np.float32)
    ids, w = _route_gpu(logits, k, stream, programmatic)
    want_ids, want_w = moe.route_top_k_reference(logits, k)
    np.testing.assert_array_equal(ids, want_ids)
    assert rel_l2(w, want_w) < 1e-5
    for r in {0, rows - 1}:
        one_ids, one_w = _route_gpu(logits[r:r + 1].copy(), k, stream)
        np.testing.assert_array_equal(one_ids[0], ids[r])
        np.testing.assert_array_equal(one_w[0], w[r])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,slots,hidden", [(1, 2, 64), (8, 8, 2048), (13, 8, 2048), (3, 2, 7)])
def test_gpu_moe_combine(rows, slots, hidden):
    """The decode combine: the twin's sums, and a row's bits whatever rows share the launch."""
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(12)
    eo, w, res = rand(rng, rows, slots, hidden), rand(rng, rows, slots), rand(rng, rows, hidden)
    d_res = cuda.to_device(res, stream=stream)
    moe.moe_combine(cuda.to_device(eo, stream=stream), cuda.to_device(w, stream=stream), d_res, stream=stream)
    got = d_res.copy_to_host(stream=stream)
    stream.synchronize()
    assert rel_l2(got, moe.moe_combine_reference(eo, w, res)) < 1e-5
    # batch invariance
    d_one = cuda.to_device(res[-1:].copy(), stream=stream)
    moe.moe_combine(cuda.to_device(eo[-1:].copy(), stream=stream), cuda.to_device(w[-1:].copy(), stream=stream),
                    d_one, stream=stream)
    one = d_one.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(one[0], got[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,experts,k,hidden", [(1, 8, 2, 64), (9, 8, 2, 64), (300, 256, 8, 2048),
                                                   (8192, 256, 8, 64), (5, 16, 4, 5)])
def test_gpu_moe_group_and_gather(rows, experts, k, hidden):
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(13)
    ids = np.sort(np.argsort(rng.random((rows, experts)), axis=1)[:, :k], axis=1).astype(np.int32)
    ids[: rows // 2, :] = np.arange(k, dtype=np.int32)  # a crowded expert
    n = rows * k
    d = [cuda.to_device(a, stream=stream) for a in (ids, np.full(experts, -1, np.int32),
                                                      np.full(experts + 1, -1, np.int32), np.full(n, -1, np.int32),
                                                      np.full(n, -1, np.int32))]
    block_counts = cuda.to_device(np.full((-(-rows // moe.GROUP_ROWS), experts), -1, np.int32), stream=stream)
    moe.moe_group(d[0], d[1], d[2], d[3], experts=experts, position_of=d[4], block_counts=block_counts,
                  stream=stream)
    got = [a.copy_to_host(stream=stream) for a in d[1:]]
    stream.synchronize()
    for g, want in zip(got, moe.moe_group_reference(ids, experts)):
        np.testing.assert_array_equal(g, want)
    x = rand(rng, rows, hidden)
    d_out = cuda.to_device(np.full((n, hidden), 0xFFFF, np.uint16), stream=stream)
    moe.moe_gather(cuda.to_device(x, stream=stream), d[3], k, d_out, stream=stream)
    out = d_out.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(out, moe.moe_gather_reference(x, got[2], k))
    d_out2 = cuda.to_device(np.full((n, hidden), 0xFFFF, np.uint16), stream=stream)
    moe.moe_gather(cuda.to_device(x, stream=stream), d[3], k, d_out2, position_of=d[4], stream=stream)
    out2 = d_out2.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(out2, out)


def test_route_top_k_checks_the_expert_columns():
    with pytest.raises(ValueError, match="logit columns"):
        moe.route_top_k(np.zeros((2, 9), np.float32), 2, np.zeros((2, 2), np.int32), np.zeros((2, 2), np.float32),
                        stream=0, experts=10)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5])
def test_gpu_router_and_shared_gate_share_one_logit_row(rows):
    """The router and the shared expert's gate come out of one GEMV: route_top_k reads the first E columns only (a
    gate logit above every router logit is not an expert) and sigmoid_gate_add reads column E through a view."""
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(rows)
    experts, k, hidden = 256, 8, 96
    logits = rand(rng, rows, experts + 1, scale=2.0)
    logits[:, experts] = 50.0
    d_logits = cuda.to_device(logits, stream=stream)
    d_ids = cuda.to_device(np.full((rows, k), -7, np.int32), stream=stream)
    d_w = cuda.to_device(np.full((rows, k), np.nan, np.float32), stream=stream)
    moe.route_top_k(d_logits, k, d_ids, d_w, stream=stream, experts=experts)
    residual, delta = rand(rng, rows, hidden), rand(rng, rows, hidden)
    d_residual = cuda.to_device(residual, stream=stream)
    ew.sigmoid_gate_add(d_residual, cuda.to_device(delta, stream=stream), d_logits[:, experts:], stream=stream)
    ids, w, got = (a.copy_to_host(stream=stream) for a in (d_ids, d_w, d_residual))
    stream.synchronize()
    want_ids, want_w = moe.route_top_k_reference(logits[:, :experts], k)
    np.testing.assert_array_equal(ids, want_ids)
    assert rel_l2(w, want_w) < 1e-5
    assert rel_l2(got, ew.sigmoid_gate_add_reference(residual, delta, logits[:, experts:])) < 1e-6


def test_the_combine_twin_adds_the_gated_shared_expert_after_the_routed_sum():
    rng = np.random.default_rng(13)
    eo, w, res = rand(rng, 3, 4, 40), rand(rng, 3, 4), rand(rng, 3, 40)
    shared, gate = rand(rng, 3, 40), rand(rng, 3, 2, scale=4.0)
    np.testing.assert_array_equal(moe.moe_combine_reference(eo, w, res, shared, gate[:, 1:]),
                                  ew.sigmoid_gate_add_reference(moe.moe_combine_reference(eo, w, res), shared,
                                                                gate[:, 1:]))
    with pytest.raises(ValueError, match="together"):
        moe.moe_combine(eo, w, res, stream=0, shared_out=shared)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,slots,hidden", [(1, 8, 2048), (5, 8, 300)])
def test_gpu_combine_with_the_shared_expert_is_the_two_launches_bitwise(rows, slots, hidden):
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(14)
    eo, w, res = rand(rng, rows, slots, hidden), rand(rng, rows, slots), rand(rng, rows, hidden)
    shared, logits = rand(rng, rows, hidden), rand(rng, rows, 264, scale=4.0)
    d_eo, d_w, d_shared, d_logits = (cuda.to_device(a, stream=stream) for a in (eo, w, shared, logits))
    fused, apart = cuda.to_device(res, stream=stream), cuda.to_device(res, stream=stream)
    moe.moe_combine(d_eo, d_w, fused, stream=stream, shared_out=d_shared, gate_logit=d_logits[:, 256:257])
    moe.moe_combine(d_eo, d_w, apart, stream=stream)
    ew.sigmoid_gate_add(apart, d_shared, d_logits[:, 256:257], stream=stream)
    got, want = fused.copy_to_host(stream=stream), apart.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(got, want)
    assert rel_l2(got, moe.moe_combine_reference(eo, w, res, shared, logits[:, 256:257])) < 1e-6



def test_scatter_combine_twin_is_the_decode_combine_of_the_bf16_values():
    """The prefill's grouped GEMM leaves bf16 expert outputs: combined as their exact fp32 values, in slot order."""
    rng = np.random.default_rng(21)
    rows, slots, hidden, experts = 6, 4, 40, 12
    ids = np.sort(np.stack([rng.choice(experts, slots, replace=False) for _ in range(rows)]), axis=1).astype(np.int32)
    _, _, slot_of, position_of = moe.moe_group_reference(ids, experts)
    eo = f32_to_bf16_bits(rand(rng, rows, slots, hidden))
    w, res = rand(rng, rows, slots), rand(rng, rows, hidden)
    np.testing.assert_array_equal(
        moe.moe_scatter_combine_reference(eo.reshape(rows * slots, hidden)[slot_of], position_of, w, slots, res),
        moe.moe_combine_reference(bf16_bits_to_f32(eo), w, res))


def _padded_layout(rng, rows, experts, k):
    ids = np.sort(np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)]), axis=1).astype(np.int32)
    counts, offsets, slot_of, position_of = moe.moe_group_reference(ids, experts)
    largest = int(counts.max())
    return ids, counts, offsets, slot_of, position_of, largest


def _chunk_starts(counts, chunk):
    """Each expert's first row when every expert's rows fill whole chunks of `chunk` rows."""
    return (np.concatenate([[0], np.cumsum(-(-counts // chunk))[:-1]]) * chunk).astype(np.int32)


@pytest.mark.parametrize("layout", ["padded", "chunks of 4"])
@pytest.mark.parametrize("rows,experts,k", [(1, 8, 2), (9, 8, 2), (100, 16, 4)])
def test_placed_positions_give_each_expert_its_rows_from_its_start(layout, rows, experts, k):
    """moe_pad_positions: expert e's rows at starts[e] + their rank, in moe_group's order (starts e * P, or whole
    chunks per expert); the scatter through them fills those rows alone, and the combine through them equals the
    combine of the contiguous layout."""
    rng = np.random.default_rng(rows + experts)
    ids, counts, offsets, slot_of, position_of, largest = _padded_layout(rng, rows, experts, k)
    starts = (np.arange(experts) * largest).astype(np.int32) if layout == "padded" else _chunk_starts(counts, 4)
    total = experts * largest if layout == "padded" else int(starts[-1] + 4 * -(-counts[-1] // 4))
    placed = moe.moe_pad_positions_reference(ids, position_of, offsets, starts)
    flat = ids.reshape(-1)
    np.testing.assert_array_equal(placed - starts[flat], position_of - offsets[flat])
    assert np.all(placed - starts[flat] < counts[flat]) and placed.max() < total
    x = rand(rng, rows, 10)
    blank = np.full((total, 10), 0x7FC1, np.uint16)
    scattered = moe.moe_scatter_rows_reference(x, placed, k, blank)
    np.testing.assert_array_equal(scattered[placed], moe.moe_gather_reference(x, slot_of, k)[position_of])
    untouched = np.setdiff1d(np.arange(total), placed)
    assert np.all(scattered[untouched] == 0x7FC1)
    contiguous = moe.moe_scatter_rows_reference(x, position_of, k, np.zeros((rows * k, 10), np.uint16))
    np.testing.assert_array_equal(contiguous, moe.moe_gather_reference(x, slot_of, k))
    w, res = rand(rng, rows, k), rand(rng, rows, 10)
    np.testing.assert_array_equal(moe.moe_scatter_combine_reference(scattered, placed, w, k, res),
                                  moe.moe_scatter_combine_reference(contiguous, position_of, w, k, res))


def test_scatter_of_bf16_rows_copies_their_bits_and_needs_the_positions():
    """moe_gather from rows already in bf16 (the norm's copy) writes what it writes from their fp32 values; the
    slot-order form (no positions) takes fp32 rows only."""
    rng = np.random.default_rng(8)
    rows, k = 6, 2
    x = rand(rng, rows, 10)
    position_of = rng.permutation(rows * k).astype(np.int32)
    blank = np.full((rows * k, 10), 0x7FC1, np.uint16)
    np.testing.assert_array_equal(moe.moe_scatter_rows_reference(f32_to_bf16_bits(x), position_of, k, blank),
                                  moe.moe_scatter_rows_reference(x, position_of, k, blank))
    with pytest.raises(ValueError, match="position_of"):
        moe.moe_gather(f32_to_bf16_bits(x), np.zeros(rows * k, np.int32), k, blank, stream=0)


def test_pad_positions_checks_its_shapes():
    with pytest.raises(ValueError, match="R\\*S positions"):
        moe.moe_pad_positions(np.zeros((3, 2), np.int32), np.zeros(5, np.int32), np.zeros(9, np.int32),
                              np.zeros(8, np.int32), np.zeros(5, np.int32), stream=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,experts,k,hidden", [(9, 8, 2, 64), (300, 256, 8, 2048), (37, 16, 4, 5)])
def test_gpu_pad_positions_and_padded_gather(rows, experts, k, hidden):
    """The device's placed positions (chunks of 8 rows per expert) and the scatter through them (pairs of columns,
    and single ones for an odd width) equal their twins, the rows between untouched."""
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(rows * k)
    ids, counts, offsets, slot_of, position_of, _ = _padded_layout(rng, rows, experts, k)
    starts = _chunk_starts(counts, 8)
    d_placed = cuda.to_device(np.full(rows * k, -1, np.int32), stream=stream)
    moe.moe_pad_positions(cuda.to_device(ids, stream=stream), cuda.to_device(position_of, stream=stream),
                          cuda.to_device(offsets, stream=stream), cuda.to_device(starts, stream=stream), d_placed,
                          stream=stream)
    placed = d_placed.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(placed, moe.moe_pad_positions_reference(ids, position_of, offsets, starts))
    x = rand(rng, rows, hidden)
    blank = np.full((int(starts[-1]) + 8 * -(-int(counts[-1]) // 8), hidden), 0x7FC1, np.uint16)
    d_out = cuda.to_device(blank, stream=stream)
    moe.moe_gather(cuda.to_device(x, stream=stream), slot_of, k, d_out, position_of=d_placed, stream=stream)
    out = d_out.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(out, moe.moe_scatter_rows_reference(x, placed, k, blank))
    # from the rows' bf16 bits (the prefill norm's copy): the same rows, the rest untouched
    d_from_bits = cuda.to_device(blank, stream=stream)
    moe.moe_gather(cuda.to_device(f32_to_bf16_bits(x), stream=stream), slot_of, k, d_from_bits, position_of=d_placed,
                   stream=stream)
    from_bits = d_from_bits.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(from_bits, out)


@pytest.mark.gpu
@pytest.mark.parametrize("experts,step", [(8, 1), (256, 1), (256, 32)])
def test_gpu_layout_chunk_groups_and_addresses(experts, step):
    """On the device: moe_layout's chunked layout of skewed counts (empty experts too), moe_chunk_groups' map with
    the step's surplus, and chunk_addresses' table from it, each equal to its twin."""
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(experts + step)
    counts = rng.integers(0, 400, experts).astype(np.int32)
    counts[::5] = 0
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    room = int(offsets[-1]) + experts * 128 + 4096
    d_info, d_starts = cuda.to_device(np.full(moe.LAYOUT_INFO, -1, np.int32)), cuda.to_device(
        np.full(experts, -1, np.int32))
    d_offsets, d_groups = cuda.to_device(offsets), cuda.to_device(np.full(9000, -1, np.int32))
    moe.moe_layout(d_offsets, d_info, d_starts, choice="chunked", chunk=128, room=room, max_chunks=8192,
                   stream=stream)
    moe.moe_chunk_groups(d_info, d_offsets, d_starts, d_groups, chunk=128, step=step, room=room, stream=stream)
    info, starts, groups = (a.copy_to_host(stream=stream) for a in (d_info, d_starts, d_groups))
    stream.synchronize()
    want_info, want_starts = moe.moe_layout_reference(offsets, choice="chunked", chunk=128, room=room,
                                                      max_chunks=8192)
    want_groups = np.full(9000, -1, np.int32)
    moe.moe_chunk_groups_reference(want_info, offsets, want_starts, want_groups, chunk=128, step=step, room=room)
    np.testing.assert_array_equal(info, want_info)
    np.testing.assert_array_equal(starts, want_starts)
    np.testing.assert_array_equal(groups, want_groups)
    used = moe.stepped_chunks(int(info[2]), step, room, 128)
    assert info[0] == moe.LAYOUT_CHUNKED and (groups >= 0).sum() == used and used % step == 0
    d_table = cuda.to_device(np.zeros(3 * used, np.uint64))
    addresses = dict(w_address=1 << 40, x_address=3 << 40, y_address=5 << 40, n=1024, k=2048, chunk=128)
    moe.chunk_addresses(d_groups, d_table, chunks=used, stream=stream, **addresses)
    table = d_table.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(table, moe.chunk_addresses_reference(groups[:used], **addresses))


def test_chunk_addresses_checks_its_table():
    with pytest.raises(ValueError, match="3 table entries each"):
        moe.chunk_addresses(np.zeros(4, np.int32), np.zeros(11, np.uint64), chunks=4, w_address=0, x_address=0,
                            y_address=0, n=8, k=8, chunk=16, stream=0)
    with pytest.raises(ValueError, match="from 4 groups"):
        moe.chunk_addresses(np.zeros(4, np.int32), np.zeros(15, np.uint64), chunks=5, w_address=0, x_address=0,
                            y_address=0, n=8, k=8, chunk=16, stream=0)


def test_scatter_combine_takes_bf16_outputs_only():
    with pytest.raises(ValueError, match="bf16"):
        moe.moe_scatter_combine(np.zeros((4, 8), np.float32), np.zeros(4, np.int32), np.zeros((2, 2), np.float32),
                                2, np.zeros((2, 8), np.float32), position_of=np.zeros(4, np.int32), stream=0)


def test_scatter_combine_takes_the_shared_output_and_its_gate_together():
    with pytest.raises(ValueError, match="together"):
        moe.moe_scatter_combine(np.zeros((4, 8), np.uint16), np.zeros(4, np.int32), np.zeros((2, 2), np.float32),
                                2, np.zeros((2, 8), np.float32), position_of=np.zeros(4, np.int32), stream=0,
                                shared_out=np.zeros((2, 8), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,slots,hidden", [(1, 8, 2048), (37, 8, 2048), (5, 4, 100), (3, 2, 7)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_gpu_scatter_combine_of_bf16_outputs_is_the_decode_combine_bitwise(rows, slots, hidden, with_shared):
    """bf16 permuted expert outputs (the grouped GEMM's): the same bits as moe_combine of their fp32 values; with the
    gated shared expert in the same pass (16-byte kernel, or the column kernel and sigmoid_gate_add) the same bits as
    the decode combine that takes it, gate logits a column of the router's."""
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(22 + rows)
    experts = 64
    ids = np.sort(np.stack([rng.choice(experts, slots, replace=False) for _ in range(rows)]), axis=1).astype(np.int32)
    eo = f32_to_bf16_bits(rand(rng, rows, slots, hidden))
    w, res = rand(rng, rows, slots), rand(rng, rows, hidden)
    gated = {}
    if with_shared:
        logits = cuda.to_device(rand(rng, rows, experts + 1), stream=stream)
        gated = dict(shared_out=cuda.to_device(rand(rng, rows, hidden), stream=stream),
                     gate_logit=logits[:, experts:experts + 1])
    d_res = cuda.to_device(res, stream=stream)
    moe.moe_combine(cuda.to_device(bf16_bits_to_f32(eo), stream=stream), cuda.to_device(w, stream=stream), d_res,
                    stream=stream, **gated)
    want = d_res.copy_to_host(stream=stream)
    _, _, slot_of, position_of = moe.moe_group_reference(ids, experts)
    d_res2 = cuda.to_device(res, stream=stream)
    moe.moe_scatter_combine(cuda.to_device(eo.reshape(rows * slots, hidden)[slot_of].copy(), stream=stream),
                            cuda.to_device(slot_of, stream=stream), cuda.to_device(w, stream=stream), slots, d_res2,
                            position_of=cuda.to_device(position_of, stream=stream), stream=stream, **gated)
    got = d_res2.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(got, want)


def test_route_kernel_in_cuda_simulator():
    """route_top_k's kernel run thread by thread against its twin (`simulated_kernels.moe_route`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("moe_route").splitlines() if line.startswith("ok moe_route")]) == 4


def test_combine_norm_kernel_in_cuda_simulator():
    """The decode combine fused with the next RMSNorm, thread by thread: bit for bit moe_combine then rms_norm_rows
    (`simulated_kernels.moe_combine_norm`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("moe_combine_norm").splitlines() if line.startswith("ok moe_combine_norm")]) == 3


@pytest.mark.parametrize("width,threads", [(64, 32), (192, 64), (1024, 256), (2048, 512), (4096, 1024), (5120, 1024),
                                           (16384, 1024)])
def test_the_combine_norm_takes_a_thread_a_vector_and_covers_the_row(width, threads):
    """combine_norm_threads: a 16-byte vector a thread in whole warps, at most 1024 threads of at most NORM_VECTORS
    vectors each, never fewer than the norm's own threads (whose sum of squares runs inside the block)."""
    assert moe.combine_norm_threads(width) == threads
    assert threads >= ew.norm_threads(width) and threads * ew.NORM_VECTORS * 4 >= width


def test_the_combine_norm_refuses_a_row_the_norm_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 4 and at most"):
        moe.combine_norm_threads(ew.NORM_MAX_WIDTH + 4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,slots,hidden", [(1, 8, 2048), (8, 8, 2048), (3, 2, 64), (40, 8, 2048)])
def test_gpu_combine_norm_equals_combine_then_norm(rows, slots, hidden):
    """moe_combine_rms_norm writes moe_combine's residual and rms_norm_rows' rows, bf16 copy and x fragments (up to
    8 rows) bit for bit, the gate logit a column of the router's logits as in the model."""
    from ninfer.kernels_numba.quant_mma import x_fragment_words

    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(14)
    eo, w, res = rand(rng, rows, slots, hidden), rand(rng, rows, slots), rand(rng, rows, hidden)
    shared, logits, norm = rand(rng, rows, hidden), rand(rng, rows, 9), rand(rng, hidden)
    results = []
    for fused in (True, False):
        x = cuda.to_device(res, stream=stream)
        out = cuda.to_device(np.full((rows, hidden), np.nan, np.float32), stream=stream)
        bf16 = cuda.to_device(np.zeros((rows, hidden), np.uint16), stream=stream)
        fragments = (cuda.to_device(np.zeros(x_fragment_words(hidden), np.uint32), stream=stream)
                     if rows <= 8 and hidden % 64 == 0 else None)
        gate = cuda.to_device(logits, stream=stream)[:, 8:9]
        args = dict(eps=1e-6, offset=True, stream=stream, out_bf16=bf16, out_fragments=fragments)
        d_eo, d_w, d_shared = (cuda.to_device(a, stream=stream) for a in (eo, w, shared))
        if fused:
            moe.moe_combine_rms_norm(d_eo, d_w, x, d_shared, gate, cuda.to_device(norm, stream=stream), out, **args)
        else:
            moe.moe_combine(d_eo, d_w, x, stream=stream, shared_out=d_shared, gate_logit=gate)
            ew.rms_norm_rows(x, cuda.to_device(norm, stream=stream), out, **args)
        results.append([a.copy_to_host(stream=stream) for a in (x, out, bf16) + ((fragments,) if fragments else ())])
        stream.synchronize()
    for got, plain in zip(*results):
        np.testing.assert_array_equal(got, plain)
    want_x, want_out = moe.moe_combine_rms_norm_reference(eo, w, res, shared, logits[:, 8:9], norm, eps=1e-6,
                                                          offset=True)
    assert rel_l2(results[0][0], want_x) < 1e-5 and rel_l2(results[0][1], want_out) < 1e-5


@pytest.mark.gpu
def test_gpu_combine_norm_wide_after_narrow_launches():
    """A kernel's dynamic shared ceiling only rises: a 2048-wide combine + norm after a 64-wide one (which needs less
    shared memory) still launches and matches its twin (once it failed with CUDA_ERROR_INVALID_VALUE)."""
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(15)
    for hidden in (2048, 64, 2048):
        eo, w, res = rand(rng, 9, 8, hidden), rand(rng, 9, 8), rand(rng, 9, hidden)
        shared, logits, norm = rand(rng, 9, hidden), rand(rng, 9, 3), rand(rng, hidden)
        x = cuda.to_device(res, stream=stream)
        out = cuda.device_array((9, hidden), np.float32, stream=stream)
        moe.moe_combine_rms_norm(*(cuda.to_device(a, stream=stream) for a in (eo, w)), x,
                                 cuda.to_device(shared, stream=stream), cuda.to_device(logits, stream=stream)[:, 2:3],
                                 cuda.to_device(norm, stream=stream), out, eps=1e-6, offset=True, stream=stream)
        want_x, want_out = moe.moe_combine_rms_norm_reference(eo, w, res, shared, logits[:, 2:3], norm, eps=1e-6,
                                                              offset=True)
        assert rel_l2(x.copy_to_host(stream=stream), want_x) < 1e-5
        assert rel_l2(out.copy_to_host(stream=stream), want_out) < 1e-5


def test_padded_layout_kernels_in_cuda_simulator():
    """moe_pad_positions, the padded scatter and the combine back run thread by thread against their twins, in their
    16-byte and narrower forms (`simulated_kernels.moe_padded`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("moe_padded").splitlines() if line.startswith("ok moe_padded")]) == 3


@pytest.mark.slow
def test_layout_kernel_in_cuda_simulator():
    """moe_layout's block (its scans, the rule, each layout's starts) thread by thread against its twin, the 16
    cases of `simulated_kernels.MOE_LAYOUT_CASES` (`simulated_kernels.moe_layout`)."""
    from tests.support.simulated_kernels import run

    assert "ok moe_layout 16" in run("moe_layout")


@pytest.mark.slow
def test_group_kernels_in_cuda_simulator():
    """moe_group's block histogram and stable placement thread by thread against the twin: two blocks of rows, and
    more experts than a block has threads (`simulated_kernels.moe_group`, about a minute)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("moe_group").splitlines() if line.startswith("ok moe_group")]) == 2
