"""The chunked gated delta rule: its twin vs the recurrence (CPU), the kernels vs the twin and vs the recurrent kernel
(GPU)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.kernels_numba import gdn, gdn_chunked  # noqa: E402
from ninfer.kernels_numba.common import tf32_round_host  # noqa: E402

F32 = np.float32
CHUNK = gdn_chunked.CHUNK


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _case(rng, *, qk_heads, v_heads, k_dim, v_dim, mix, lanes=4, decay=0.5):
    """Inputs shaped as gdn_gates(tf32=True) leaves them: q and k L2-normalised (q scaled by k_dim^-0.5) and
    rounded to TF32, log decays <= 0, beta in (0, 1). `mix`: (lane, rows) per segment, rows laid out in order."""
    counts = np.array([c for _, c in mix], np.int32)
    rows = int(counts.sum())
    q = rng.standard_normal((rows, qk_heads, k_dim)).astype(F32)
    k = rng.standard_normal((rows, qk_heads, k_dim)).astype(F32)
    q = tf32_round_host(q / np.linalg.norm(q, axis=-1, keepdims=True) * k_dim ** -0.5)
    k = tf32_round_host(k / np.linalg.norm(k, axis=-1, keepdims=True))
    return dict(
        q=q, k=k, mixed=rng.standard_normal((rows, 2 * qk_heads * k_dim + v_heads * v_dim)).astype(F32),
        log_decay=-rng.uniform(0, decay, (rows, v_heads)).astype(F32),
        beta=rng.uniform(0, 1, (rows, v_heads)).astype(F32),
        ssm_state=(rng.standard_normal((lanes, v_heads, k_dim, v_dim)) * 0.3).astype(F32),
        seg_lane=np.array([lane for lane, _ in mix], np.int32), seg_count=counts,
        seg_row=np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32), rows=rows,
        heads=dict(qk_heads=qk_heads, v_heads=v_heads, k_dim=k_dim, v_dim=v_dim, channels_qk=2 * qk_heads * k_dim))


def _recurrent(case):
    state = case["ssm_state"].copy()
    out = np.full((case["rows"], case["heads"]["v_heads"], case["heads"]["v_dim"]), np.nan, F32)
    columns = np.zeros((1, 1) + state.shape[1:], F32)
    gdn.gdn_recurrent_reference(case["q"], case["k"], case["mixed"], case["log_decay"], case["beta"], state, columns,
                                case["seg_lane"], case["seg_row"], case["seg_count"],
                                np.zeros(len(case["seg_lane"]), np.int32), out, **case["heads"])
    return out, state


def _chunked_twin(case):
    heads, rows = case["heads"], case["rows"]
    state = case["ssm_state"].copy()
    out = np.full((rows, heads["v_heads"], heads["v_dim"]), np.nan, F32)
    cum = np.full((rows, heads["v_heads"]), np.nan, F32)
    mats = np.full((rows, heads["v_heads"], CHUNK), np.nan, F32)
    gdn_chunked.gdn_chunked_reference(case["q"], case["k"], case["mixed"], case["log_decay"], case["beta"], state,
                                      case["seg_lane"], case["seg_row"], case["seg_count"], out, cum, mats,
                                      rows=rows, **heads)
    return out, state, cum, mats


def test_tf32_round_is_to_nearest_ties_away():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)
    values = np.array([one + ulp / 4, one + ulp / 2, one + ulp * 3 / 4, -(one + ulp / 2), 3e38, 0.0], F32)
    got = tf32_round_host(values)
    assert list(got[:4]) == [one, one + ulp, one + ulp, -(one + ulp)]
    assert (got.view(np.uint32) & 0x1FFF == 0).all()
    assert got[5] == 0


@pytest.mark.parametrize("mix", [[(1, 150), (0, 64), (2, 5)], [(3, 64 * 3)], [(0, 1)]])
@pytest.mark.parametrize("shape", [dict(qk_heads=2, v_heads=4, k_dim=32, v_dim=16),
                                   dict(qk_heads=1, v_heads=2, k_dim=16, v_dim=8)])
def test_twin_equals_the_recurrence_up_to_tf32(mix, shape):
    """The chunk formulas with TF32 operands: ~5e-4 from the fp32 recurrence (outputs and carried state), across
    partial chunks, several segments and lanes; lanes without a segment keep their state."""
    case = _case(np.random.default_rng(len(mix)), mix=mix, **shape)
    want_out, want_state = _recurrent(case)
    out, state, _, _ = _chunked_twin(case)
    assert _rel(out, want_out) < 2e-3
    assert _rel(state, want_state) < 2e-3
    untouched = sorted(set(range(4)) - {lane for lane, _ in mix})
    assert np.array_equal(state[untouched], case["ssm_state"][untouched])


def test_twin_refuses_q_or_k_that_are_not_tf32_values():
    """The kernels take q and k as TF32 operands unrounded (the tensor cores would truncate anything else): the twin,
    which states their contract, refuses other values with a typed error naming the tensor."""
    case = _case(np.random.default_rng(6), qk_heads=1, v_heads=2, k_dim=16, v_dim=8, mix=[(0, 10)])
    for name in ("q", "k"):
        bad = dict(case, **{name: case[name] + np.float32(1e-6)})
        with pytest.raises(ValueError, match=f"TF32 values of {name}"):
            _chunked_twin(bad)


def test_twin_formulas_are_the_recurrence_without_rounding(monkeypatch):
    """With TF32 rounding switched off the chunk formulas agree with the recurrence to fp32 rounding."""
    monkeypatch.setattr(gdn_chunked, "tf32_round_host", lambda x: np.asarray(x, F32))
    case = _case(np.random.default_rng(7), qk_heads=2, v_heads=4, k_dim=32, v_dim=16, mix=[(0, 200), (1, 63)])
    want_out, want_state = _recurrent(case)
    out, state, _, _ = _chunked_twin(case)
    assert _rel(out, want_out) < 2e-6
    assert _rel(state, want_state) < 2e-6


def test_the_scan_slice_halves_where_the_wide_grid_fills_at_most_half_the_sms():
    """H200 (132 SMs) at 8K rows: the 35B-A3B's 32 v heads x 2 slices (64 blocks) take 32 columns, the 27B's 48 x 2
    (96 blocks: a second wave at 32) keep 64; the bound itself, and a GPU unknown (0 SMs) keeps 64."""
    assert gdn_chunked.scan_slice(32 * 2, 132) == 32
    assert gdn_chunked.scan_slice(48 * 2, 132) == 64
    assert gdn_chunked.scan_slice(66, 132) == 32
    assert gdn_chunked.scan_slice(67, 132) == 64
    assert gdn_chunked.scan_slice(1, 0) == 64
    assert set(gdn_chunked.SLICES) == {32, 64}


@pytest.mark.slow
def test_kernels_match_the_twin_in_the_cuda_simulator():
    """Both kernels' own source run thread by thread with the TF32 mma, warp barriers and cp.async emulated: tiles,
    the blockwise inversion, the packed T / P, the scan across chunks, segments and heads, at both slice widths."""
    from tests.support.simulated_kernels import run

    assert "ok gdn_chunked" in run("gdn_chunked")


# ---------------------------------------------------------------------------------------------------------------
# GPU

GPU_SHAPES = [dict(qk_heads=2, v_heads=4, k_dim=32, v_dim=16), dict(qk_heads=1, v_heads=2, k_dim=16, v_dim=8),
              dict(qk_heads=2, v_heads=4, k_dim=64, v_dim=40),
              dict(qk_heads=16, v_heads=48, k_dim=128, v_dim=128), dict(qk_heads=16, v_heads=32, k_dim=128, v_dim=128)]


def _run_gpu(case, recurrent=False, multiprocessors=None):
    """`multiprocessors`: what the chunked launcher is told the GPU has (default: the GPU's own count)."""
    from ninfer.kernels_numba.numba_setup import cuda

    if multiprocessors is None:
        multiprocessors = cuda.get_current_device().MULTIPROCESSOR_COUNT
    stream = cuda.stream()
    heads, rows = case["heads"], case["rows"]
    dev = {name: cuda.to_device(np.ascontiguousarray(case[name]), stream=stream)
           for name in ("q", "k", "mixed", "log_decay", "beta", "ssm_state", "seg_lane", "seg_row", "seg_count")}
    out = cuda.to_device(np.full((rows, heads["v_heads"], heads["v_dim"]), np.nan, F32), stream=stream)
    cum = cuda.to_device(np.full((rows, heads["v_heads"]), np.nan, F32), stream=stream)
    mats = cuda.to_device(np.full((rows, heads["v_heads"], CHUNK), np.nan, F32), stream=stream)
    seg = (dev["seg_lane"], dev["seg_row"], dev["seg_count"])
    if recurrent:
        columns = cuda.to_device(np.zeros((1, 1) + case["ssm_state"].shape[1:], F32), stream=stream)
        record = cuda.to_device(np.zeros(len(case["seg_lane"]), np.int32), stream=stream)
        gdn.gdn_recurrent(dev["q"], dev["k"], dev["mixed"], dev["log_decay"], dev["beta"], dev["ssm_state"], columns,
                          *seg, record, out, stream=stream, **heads)
    else:
        gdn_chunked.gdn_chunked(dev["q"], dev["k"], dev["mixed"], dev["log_decay"], dev["beta"], dev["ssm_state"],
                                *seg, out, cum, mats, rows=rows, multiprocessors=multiprocessors, stream=stream,
                                **heads)
    got = [a.copy_to_host(stream=stream) for a in (out, dev["ssm_state"], cum, mats)]
    stream.synchronize()
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s['v_heads']}x{s['k_dim']}x{s['v_dim']}")
def test_kernels_match_the_twin(shape):
    """Outputs, carried state, G and the packed T / P within fp32 summation-order error of the twin (the same TF32
    operands); every row of every segment written, nothing else."""
    case = _case(np.random.default_rng(11), mix=[(1, 150), (0, 64), (3, 5)], **shape)
    out, state, cum, mats = _run_gpu(case)
    want_out, want_state, want_cum, want_mats = _chunked_twin(case)
    assert not np.isnan(out).any()
    assert _rel(cum, want_cum) < 1e-6
    written = ~np.isnan(want_mats)
    assert np.array_equal(~np.isnan(mats), written)
    assert _rel(mats[written], want_mats[written]) < 1e-4
    assert _rel(out, want_out) < 1e-4
    assert _rel(state, want_state) < 1e-4
    assert np.array_equal(state[2], case["ssm_state"][2])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[3:], ids=["27b", "35b"])
def test_kernels_match_the_recurrent_kernel_at_model_shapes(shape):
    """A 1,000-row prefill at the real head shapes: within TF32 error (2e-3) of the recurrent kernel."""
    case = _case(np.random.default_rng(12), mix=[(0, 1000)], lanes=1, decay=0.1, **shape)
    out, state, _, _ = _run_gpu(case)
    want_out, want_state, _, _ = _run_gpu(case, recurrent=True)
    assert _rel(out, want_out) < 2e-3
    assert _rel(state, want_state) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [GPU_SHAPES[4], dict(qk_heads=2, v_heads=4, k_dim=64, v_dim=80),
                                   dict(qk_heads=2, v_heads=4, k_dim=32, v_dim=40)], ids=["35b", "64x80", "32x40"])
def test_both_scan_slices_give_the_same_bits(shape):
    """The scan at 32 value columns a block (a GPU with SMs to spare) and at 64 (none): each column's products are the
    same, so outputs and carried states are equal bit for bit, also where v_dim leaves a partial slice; and both
    within fp32 summation-order error of the twin."""
    case = _case(np.random.default_rng(13), mix=[(1, 150), (0, 64), (3, 5)], **shape)
    blocks_at_64 = 3 * shape["v_heads"] * ((shape["v_dim"] + 63) // 64)
    assert gdn_chunked.scan_slice(blocks_at_64, 0) == 64 and gdn_chunked.scan_slice(blocks_at_64, 1 << 20) == 32
    narrow_out, narrow_state, _, _ = _run_gpu(case, multiprocessors=1 << 20)
    wide_out, wide_state, _, _ = _run_gpu(case, multiprocessors=0)
    assert not np.isnan(narrow_out).any()
    assert np.array_equal(narrow_out, wide_out)
    assert np.array_equal(narrow_state, wide_state)
    want_out, want_state, _, _ = _chunked_twin(case)
    assert _rel(narrow_out, want_out) < 1e-4
    assert _rel(narrow_state, want_state) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [96, 80])
def test_prepare_register_caps_give_the_same_bits(cap):
    """The prepare kernel under a register cap (more blocks an SM) writes the same G and packed T / P, bit for bit,
    as without one, across partial chunks and segments at the 35B-A3B's head shape."""
    from ninfer.kernels_numba.numba_setup import cuda

    case = _case(np.random.default_rng(14), mix=[(1, 150), (0, 64), (3, 5)], **GPU_SHAPES[4])
    stream = cuda.stream()
    heads, rows = case["heads"], case["rows"]
    dev = {name: cuda.to_device(np.ascontiguousarray(case[name]), stream=stream)
           for name in ("q", "k", "log_decay", "beta", "seg_row", "seg_count")}
    results = []
    for max_registers in (None, cap):
        cum = cuda.to_device(np.full((rows, heads["v_heads"]), np.nan, F32), stream=stream)
        mats = cuda.to_device(np.full((rows, heads["v_heads"], CHUNK), np.nan, F32), stream=stream)
        gdn_chunked.gdn_chunk_prepare(dev["q"], dev["k"], dev["log_decay"], dev["beta"], dev["seg_row"],
                                      dev["seg_count"], cum, mats, rows=rows, qk_heads=heads["qk_heads"],
                                      v_heads=heads["v_heads"], k_dim=heads["k_dim"], stream=stream,
                                      max_registers=max_registers)
        results.append([a.copy_to_host(stream=stream) for a in (cum, mats)])
        stream.synchronize()
    for uncapped, capped in zip(*results):
        np.testing.assert_array_equal(capped, uncapped)
