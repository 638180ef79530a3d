"""Gated DeltaNet kernels: NumPy twins vs the CPU GatedDeltaNet math (CPU), kernels vs twins (GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.backends.cpu.ops import linear  # noqa: E402
from ninfer.kernels_numba import gdn  # noqa: E402
from ninfer.kernels_numba.common import tf32_round_host  # noqa: E402
from ninfer.models.base import DictWeights  # noqa: E402
from ninfer.models.qwen3_6 import GatedDeltaNet, GdnState, MixerRows  # noqa: E402

F32 = np.float32
EPS = 1e-6


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _dims(qk_heads=2, v_heads=6, k_dim=16, v_dim=16, hidden=64, conv_kernel=4):
    qkw, vw = qk_heads * k_dim, v_heads * v_dim
    return SimpleNamespace(hidden=hidden, gdn_qk_heads=qk_heads, gdn_v_heads=v_heads, gdn_k_dim=k_dim,
                           gdn_v_dim=v_dim, conv_kernel=conv_kernel, rms_eps=EPS, gdn_qk_width=qkw, gdn_v_width=vw,
                           gdn_conv_channels=2 * qkw + vw)


def _layer(rng, d):
    c, vw, h, hv = d.gdn_conv_channels, d.gdn_v_width, d.hidden, d.gdn_v_heads
    w = {
        "g/query_key_value_z": rng.standard_normal((c + vw, h), dtype=F32) * F32(0.15),
        "g/a_b_projection": rng.standard_normal((2 * hv, h), dtype=F32) * F32(0.15),
        "g/convolution": rng.standard_normal((d.conv_kernel, c), dtype=F32) * F32(0.5),
        "g/a_log": rng.uniform(-1.5, 0.5, hv).astype(F32),
        "g/dt_bias": rng.standard_normal(hv, dtype=F32) * F32(0.5),
        "g/norm": (1.0 + 0.2 * rng.standard_normal(d.gdn_v_dim)).astype(F32),
        "g/output": rng.standard_normal((h, vw), dtype=F32) * F32(0.1),
    }
    return GatedDeltaNet(d, DictWeights(w), "g/", fused=True)


# (lane, rows, record): listed in an order different from the row order on purpose.
MIX = [(3, 37, 0), (0, 1, 0), (4, 6, 1), (1, 4, 1), (2, 1, 1)]


def _segments(mix, order=None):
    """seg arrays for `mix`, rows laid out in `order` (indices into mix) so the row layout differs from the segment
    listing."""
    order = list(range(len(mix))) if order is None else order
    first = {}
    row = 0
    for i in order:
        first[i] = row
        row += mix[i][1]
    seg_lane = np.array([m[0] for m in mix], np.int32)
    seg_row = np.array([first[i] for i in range(len(mix))], np.int32)
    seg_count = np.array([m[1] for m in mix], np.int32)
    seg_record = np.array([m[2] for m in mix], np.int32)
    return seg_lane, seg_row, seg_count, seg_record, row


class _Pipeline:
    """The four twins chained like the engine will chain the kernels."""

    def __init__(self, layer, d, lanes, max_cols):
        self.layer, self.d = layer, d
        self.conv_state = np.zeros((lanes, d.conv_kernel - 1, d.gdn_conv_channels), F32)
        self.ssm_state = np.zeros((lanes, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim), F32)
        self.conv_columns = np.full((lanes, max_cols, d.conv_kernel - 1, d.gdn_conv_channels), np.nan, F32)
        self.ssm_columns = np.full((lanes, max_cols, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim), np.nan, F32)

    def __call__(self, h, seg_lane, seg_row, seg_count, seg_record):
        d, layer = self.d, self.layer
        rows, c = h.shape[0], d.gdn_conv_channels
        hq, hv, dk, dv = d.gdn_qk_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim
        projected = linear(h, layer.in_proj)
        ab = linear(h, layer.ab_proj)
        mixed = np.full((rows, c), np.nan, F32)
        gdn.gdn_conv_reference(projected, layer.conv, self.conv_state, self.conv_columns, seg_lane, seg_row,
                               seg_count, seg_record, mixed, channels=c)
        q = np.empty((rows, hq, dk), F32)
        k = np.empty((rows, hq, dk), F32)
        log_decay = np.empty((rows, hv), F32)
        beta = np.empty((rows, hv), F32)
        gdn.gdn_gates_reference(mixed, ab, layer.neg_a.astype(F32), layer.dt_bias, q, k, log_decay, beta,
                                qk_heads=hq, v_heads=hv, k_dim=dk)
        out = np.full((rows, hv, dv), np.nan, F32)
        gdn.gdn_recurrent_reference(q, k, mixed, log_decay, beta, self.ssm_state, self.ssm_columns, seg_lane, seg_row,
                                    seg_count, seg_record, out, qk_heads=hq, v_heads=hv, k_dim=dk, v_dim=dv,
                                    channels_qk=2 * hq * dk)
        result = np.full((rows, hv * dv), np.nan, F32)
        gdn.gdn_output_reference(out, projected, layer.norm, result, v_heads=hv, v_dim=dv, z_offset=c, eps=d.rms_eps)
        return linear(result, layer.output)


@pytest.mark.parametrize("shape", [dict(), dict(v_heads=4), dict(qk_heads=2, v_heads=2, k_dim=32, v_dim=8)])
def test_twins_match_the_cpu_gated_deltanet_on_a_segment_mix(shape):
    rng = np.random.default_rng(1)
    d = _dims(**shape)
    layer = _layer(rng, d)
    lanes = 5
    seg_lane, seg_row, seg_count, seg_record, rows = _segments(MIX, order=[1, 3, 0, 4, 2])
    # Non-zero starting states, identical for both sides.
    start_states = [GdnState(conv=rng.standard_normal((d.conv_kernel - 1, d.gdn_conv_channels), dtype=F32),
                             recurrent=rng.standard_normal((d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim),
                                                           dtype=F32) * F32(0.1)) for _ in range(lanes)]
    h = rng.standard_normal((rows, d.hidden), dtype=F32)

    pipeline = _Pipeline(layer, d, lanes, max_cols=8)
    for lane, st in enumerate(start_states):
        pipeline.conv_state[lane], pipeline.ssm_state[lane] = st.conv, st.recurrent
    got = pipeline(h, seg_lane, seg_row, seg_count, seg_record)

    states = [st.copy() for st in start_states]
    parts = [MixerRows(rows=slice(int(seg_row[s]), int(seg_row[s] + seg_count[s])), state=states[int(seg_lane[s])],
                       record_columns=bool(seg_record[s])) for s in range(len(MIX))]
    want, columns = layer(h, parts, np.zeros(0))
    assert _rel(got, want) < 1e-5
    for s, part in enumerate(parts):
        lane = int(seg_lane[s])
        np.testing.assert_allclose(pipeline.conv_state[lane], states[lane].conv, rtol=0, atol=0)
        assert _rel(pipeline.ssm_state[lane], states[lane].recurrent) < 1e-5
        if part.record_columns:
            count = int(seg_count[s])
            np.testing.assert_array_equal(pipeline.conv_columns[lane, :count], columns[s].conv)
            # the recurrence records every row but the last, whose state is the running one
            assert _rel(pipeline.ssm_columns[lane, :count - 1], columns[s].recurrent[:count - 1]) < 1e-5
            assert np.isnan(pipeline.ssm_columns[lane, count - 1:]).all()
        else:
            assert np.isnan(pipeline.conv_columns[lane]).all() and np.isnan(pipeline.ssm_columns[lane]).all()


def test_twin_state_carries_across_launches():
    """Prefill 100 rows then 5 single-row launches == one 105-row segment."""
    rng = np.random.default_rng(2)
    d = _dims()
    layer = _layer(rng, d)
    h = rng.standard_normal((105, d.hidden), dtype=F32)
    one = np.array([0], np.int32)
    whole = _Pipeline(layer, d, 1, 1)
    want = whole(h, one * 0, one * 0, np.array([105], np.int32), one * 0)
    split = _Pipeline(layer, d, 1, 1)
    parts = [split(h[:100], one * 0, one * 0, np.array([100], np.int32), one * 0)]
    for t in range(100, 105):
        parts.append(split(h[t:t + 1], one * 0, one * 0, np.array([1], np.int32), one * 0))
    assert _rel(np.concatenate(parts), want) < 1e-5
    np.testing.assert_array_equal(split.conv_state, whole.conv_state)
    assert _rel(split.ssm_state, whole.ssm_state) < 1e-5


def _gates_case(rng, rows=9, hq=2, hv=4, dk=32):
    mixed = rng.standard_normal((rows, 2 * hq * dk + hv * 16), dtype=F32)
    return dict(mixed=mixed, ab=rng.standard_normal((rows, 2 * hv), dtype=F32),
                neg_a=-np.exp(rng.uniform(-1, 1, hv)).astype(F32), dt_bias=rng.standard_normal(hv, dtype=F32),
                heads=dict(qk_heads=hq, v_heads=hv, k_dim=dk))


def _gates_twin(case, tf32):
    rows, heads = case["mixed"].shape[0], case["heads"]
    outs = [np.full((rows, heads["qk_heads"], heads["k_dim"]), np.nan, F32) for _ in range(2)]
    outs += [np.full((rows, heads["v_heads"]), np.nan, F32) for _ in range(2)]
    gdn.gdn_gates_reference(case["mixed"], case["ab"], case["neg_a"], case["dt_bias"], *outs, tf32=tf32, **heads)
    return outs


def test_gates_tf32_rounds_q_and_k_only():
    """tf32=True (the chunked prefill's operands): q and k are the fp32 results rounded to TF32, bit for bit; the
    decays and betas are unchanged."""
    case = _gates_case(np.random.default_rng(4))
    exact, rounded = _gates_twin(case, False), _gates_twin(case, True)
    for got, want in zip(rounded[:2], exact[:2]):
        np.testing.assert_array_equal(got, tf32_round_host(want))
        assert (got.view(np.uint32) & 0x1FFF == 0).all() and not np.array_equal(got, want)
    for got, want in zip(rounded[2:], exact[2:]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_gates_kernel_tf32_rounds_its_own_results():
    """The gates kernel with tf32: q and k are the kernel's own fp32 results rounded to TF32, bit for bit (and those
    within fp32 rounding of the twin); decays and betas the same bits either way."""
    from ninfer.kernels_numba.numba_setup import cuda

    case = _gates_case(np.random.default_rng(5), rows=37, hq=16, hv=32, dk=128)
    stream = cuda.stream()
    inputs = [cuda.to_device(case[n], stream=stream) for n in ("mixed", "ab", "neg_a", "dt_bias")]
    got = {}
    for tf32 in (False, True):
        outputs = [cuda.to_device(np.full(a.shape, np.nan, F32), stream=stream) for a in _gates_twin(case, tf32)]
        gdn.gdn_gates(*inputs, *outputs, stream=stream, tf32=tf32, **case["heads"])
        got[tf32] = [a.copy_to_host(stream=stream) for a in outputs]
        stream.synchronize()
    for have, want in zip(got[False], _gates_twin(case, False)):
        assert _rel(have, want) < 1e-6
    for have, want in zip(got[True][:2], got[False][:2]):
        np.testing.assert_array_equal(have, tf32_round_host(want))
    for have, want in zip(got[True][2:], got[False][2:]):
        np.testing.assert_array_equal(have, want)


def test_gates_twin_vs_float64_formula():
    rng = np.random.default_rng(3)
    rows, hq, hv, dk = 7, 2, 6, 16
    mixed = rng.standard_normal((rows, 2 * hq * dk + hv * 16), dtype=F32) * F32(3)
    ab = rng.standard_normal((rows, 2 * hv), dtype=F32) * F32(10)  # crosses the softplus threshold
    neg_a = -np.exp(rng.uniform(-1, 1, hv)).astype(F32)
    dt_bias = rng.standard_normal(hv, dtype=F32)
    q, k = np.empty((rows, hq, dk), F32), np.empty((rows, hq, dk), F32)
    g, b = np.empty((rows, hv), F32), np.empty((rows, hv), F32)
    gdn.gdn_gates_reference(mixed, ab, neg_a, dt_bias, q, k, g, b, qk_heads=hq, v_heads=hv, k_dim=dk)
    m = mixed.astype(np.float64)
    qr = m[:, :hq * dk].reshape(rows, hq, dk)
    kr = m[:, hq * dk:2 * hq * dk].reshape(rows, hq, dk)
    q64 = qr / np.sqrt((qr * qr).sum(-1, keepdims=True) + EPS) / np.sqrt(dk)
    k64 = kr / np.sqrt((kr * kr).sum(-1, keepdims=True) + EPS)
    x = ab[:, :hv].astype(np.float64) + dt_bias
    g64 = neg_a * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    b64 = 1 / (1 + np.exp(-ab[:, hv:].astype(np.float64)))
    for got, want in ((q, q64), (k, k64), (g, g64), (b, b64)):
        assert _rel(got, want) < 1e-6


def test_recurrent_twin_vs_float64_formula():
    rng = np.random.default_rng(4)
    hq, hv, dk, dv, rows = 2, 4, 16, 8, 9
    q = rng.standard_normal((rows, hq, dk), dtype=F32) * F32(0.25)
    k = rng.standard_normal((rows, hq, dk), dtype=F32) * F32(0.25)
    mixed = rng.standard_normal((rows, 2 * hq * dk + hv * dv), dtype=F32)
    g = -rng.uniform(0, 1, (rows, hv)).astype(F32)
    b = rng.uniform(0, 1, (rows, hv)).astype(F32)
    state = rng.standard_normal((1, hv, dk, dv), dtype=F32)
    s64 = state[0].astype(np.float64)
    out = np.empty((rows, hv, dv), F32)
    gdn.gdn_recurrent_reference(q, k, mixed, g, b, state, np.zeros((1, 1, hv, dk, dv), F32), np.array([0], np.int32),
                                np.array([0], np.int32), np.array([rows], np.int32), np.array([0], np.int32), out,
                                qk_heads=hq, v_heads=hv, k_dim=dk, v_dim=dv, channels_qk=2 * hq * dk)
    want = np.empty((rows, hv, dv))
    for t in range(rows):
        for h in range(hv):
            kq, qq = k[t, h // 2].astype(np.float64), q[t, h // 2].astype(np.float64)
            v = mixed[t, 2 * hq * dk + h * dv:2 * hq * dk + (h + 1) * dv].astype(np.float64)
            s64[h] *= np.exp(g[t, h])
            u = b[t, h] * (v - s64[h].T @ kq)
            s64[h] += np.outer(kq, u)
            want[t, h] = s64[h].T @ qq
    assert _rel(out, want) < 1e-5
    assert _rel(state[0], s64) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# GPU: kernels vs twins, every output written, batch invariance (bitwise), state carried across launches.


def _gpu_case(rng, d, mix, order, lanes=5, max_cols=8):
    seg_lane, seg_row, seg_count, seg_record, rows = _segments(mix, order)
    c, vw = d.gdn_conv_channels, d.gdn_v_width
    hq, hv, dk, dv = d.gdn_qk_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim
    return dict(
        seg=(seg_lane, seg_row, seg_count, seg_record), rows=rows,
        projected=rng.standard_normal((rows, c + vw), dtype=F32),
        conv_weight=rng.standard_normal((d.conv_kernel, c), dtype=F32) * F32(0.5),
        conv_state=rng.standard_normal((lanes, d.conv_kernel - 1, c), dtype=F32),
        conv_columns=np.full((lanes, max_cols, d.conv_kernel - 1, c), np.nan, F32),
        ab=rng.standard_normal((rows, 2 * hv), dtype=F32) * F32(3),
        neg_a=-np.exp(rng.uniform(-1.5, 0.5, hv)).astype(F32),
        dt_bias=rng.standard_normal(hv, dtype=F32) * F32(0.5),
        ssm_state=rng.standard_normal((lanes, hv, dk, dv), dtype=F32) * F32(0.1),
        ssm_columns=np.full((lanes, max_cols, hv, dk, dv), np.nan, F32),
        norm=(1 + 0.2 * rng.standard_normal(dv)).astype(F32),
        dims=(c, hq, hv, dk, dv),
    )


def _run_gpu(case, d, groups=gdn.REC_DEFAULT_GROUPS, gated=False, projected=None):
    """All four kernels on the GPU; returns host copies of every output and state. `gated`: the recurrence computes
    the gates itself (`gdn_recurrent_gated`, the decode path) and q, k, log_decay, beta stay unwritten.
    `projected` (x fp32 [rows, H], w_ab bf16 [2 Hv, H]): the recurrence computes the a/b projection too
    (`gdn_recurrent_projected`; case["ab"] unread)."""
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()
    c, hq, hv, dk, dv = case["dims"]
    rows = case["rows"]
    dev = {name: cuda.to_device(np.ascontiguousarray(case[name]), stream=stream)
           for name in ("projected", "conv_weight", "conv_state", "conv_columns", "ab", "neg_a", "dt_bias",
                        "ssm_state", "ssm_columns", "norm")}
    seg = [cuda.to_device(a, stream=stream) for a in case["seg"]]

    def nan(*shape):
        return cuda.to_device(np.full(shape, np.nan, F32), stream=stream)

    mixed, q, k = nan(rows, c), nan(rows, hq, dk), nan(rows, hq, dk)
    log_decay, beta, out, result = nan(rows, hv), nan(rows, hv), nan(rows, hv, dv), nan(rows, hv * dv)
    gdn.gdn_conv(dev["projected"], dev["conv_weight"], dev["conv_state"], dev["conv_columns"], *seg, mixed,
                 channels=c, stream=stream)
    heads = dict(qk_heads=hq, v_heads=hv, k_dim=dk, v_dim=dv, channels_qk=2 * hq * dk, stream=stream, groups=groups)
    if projected is not None:
        x, w_ab = (cuda.to_device(a, stream=stream) for a in projected)
        gdn.gdn_recurrent_projected(mixed, x, w_ab, dev["neg_a"], dev["dt_bias"], dev["ssm_state"],
                                    dev["ssm_columns"], *seg, out, **heads)
    elif gated:
        gdn.gdn_recurrent_gated(mixed, dev["ab"], dev["neg_a"], dev["dt_bias"], dev["ssm_state"], dev["ssm_columns"],
                                *seg, out, **heads)
    else:
        gdn.gdn_gates(mixed, dev["ab"], dev["neg_a"], dev["dt_bias"], q, k, log_decay, beta, qk_heads=hq,
                      v_heads=hv, k_dim=dk, stream=stream)
        gdn.gdn_recurrent(q, k, mixed, log_decay, beta, dev["ssm_state"], dev["ssm_columns"], *seg, out, **heads)
    gdn.gdn_output(out, dev["projected"], dev["norm"], result, v_heads=hv, v_dim=dv, z_offset=c, eps=EPS,
                   stream=stream)
    host = {name: arr.copy_to_host(stream=stream) for name, arr in
            dict(mixed=mixed, q=q, k=k, log_decay=log_decay, beta=beta, out=out, result=result,
                 conv_state=dev["conv_state"], conv_columns=dev["conv_columns"], ssm_state=dev["ssm_state"],
                 ssm_columns=dev["ssm_columns"]).items()}
    stream.synchronize()
    return host


def _twin_stages(case, got):
    """Each twin fed the GPU's own inputs for that stage (so each kernel is checked on its own)."""
    c, hq, hv, dk, dv = case["dims"]
    rows = case["rows"]
    seg = case["seg"]
    want = {}
    conv_state, conv_columns = case["conv_state"].copy(), case["conv_columns"].copy()
    mixed = np.full((rows, c), np.nan, F32)
    gdn.gdn_conv_reference(case["projected"], case["conv_weight"], conv_state, conv_columns, *seg, mixed, channels=c)
    want.update(mixed=mixed, conv_state=conv_state, conv_columns=conv_columns)
    q, k = np.empty((rows, hq, dk), F32), np.empty((rows, hq, dk), F32)
    log_decay, beta = np.empty((rows, hv), F32), np.empty((rows, hv), F32)
    gdn.gdn_gates_reference(got["mixed"], case["ab"], case["neg_a"], case["dt_bias"], q, k, log_decay, beta,
                            qk_heads=hq, v_heads=hv, k_dim=dk)
    want.update(q=q, k=k, log_decay=log_decay, beta=beta)
    ssm_state, ssm_columns = case["ssm_state"].copy(), case["ssm_columns"].copy()
    out = np.empty((rows, hv, dv), F32)
    gdn.gdn_recurrent_reference(got["q"], got["k"], got["mixed"], got["log_decay"], got["beta"], ssm_state,
                                ssm_columns, *seg, out, qk_heads=hq, v_heads=hv, k_dim=dk, v_dim=dv,
                                channels_qk=2 * hq * dk)
    want.update(out=out, ssm_state=ssm_state, ssm_columns=ssm_columns)
    result = np.empty((rows, hv * dv), F32)
    gdn.gdn_output_reference(got["out"], case["projected"], case["norm"], result, v_heads=hv, v_dim=dv, z_offset=c,
                             eps=EPS)
    want.update(result=result)
    return want


GPU_SHAPES = [dict(), dict(v_heads=4), dict(qk_heads=2, v_heads=2, k_dim=32, v_dim=8),
              dict(qk_heads=16, v_heads=48, k_dim=128, v_dim=128, hidden=5120),
              dict(qk_heads=16, v_heads=32, k_dim=128, v_dim=128, hidden=2048)]


def _check_against_twins(case, got, mix):
    want = _twin_stages(case, got)
    tolerance = dict(mixed=1e-6, q=1e-6, k=1e-6, log_decay=1e-6, beta=1e-6, out=2e-5, result=1e-5,
                     conv_state=0, ssm_state=2e-5)
    for name, tol in tolerance.items():
        assert not np.isnan(got[name]).any(), f"{name} has unwritten elements"
        assert _rel(got[name], want[name]) <= tol, (name, _rel(got[name], want[name]))
    seg_lane, _, seg_count, seg_record = case["seg"]
    for s in range(len(mix)):
        lane, count = int(seg_lane[s]), int(seg_count[s])
        # the conv records every row of a recording segment, the recurrence every row but the last
        for name, tol, recorded in (("conv_columns", 0, count), ("ssm_columns", 2e-5, count - 1)):
            g, w = got[name][lane], want[name][lane]
            if seg_record[s]:
                assert not np.isnan(g[:recorded]).any()
                assert _rel(g[:recorded], w[:recorded]) <= tol, (name, s)
                assert np.isnan(g[recorded:]).all()
            else:
                assert np.isnan(g).all()


def _check_invariance(case, d, mix, mixed_run, groups):
    """Each segment computed alone (its rows at row 0, one segment in the launch) equals, bitwise, the same segment
    inside the mixed launch: outputs, states and recorded columns."""
    seg_lane, seg_row, seg_count, seg_record = case["seg"]
    for s in range(len(mix)):
        lane, first, count = int(seg_lane[s]), int(seg_row[s]), int(seg_count[s])
        rows = slice(first, first + count)
        alone = dict(case)
        alone["seg"] = (np.array([lane], np.int32), np.array([0], np.int32), np.array([count], np.int32),
                        np.array([seg_record[s]], np.int32))
        alone["rows"] = count
        alone["projected"] = case["projected"][rows].copy()
        alone["ab"] = case["ab"][rows].copy()
        got = _run_gpu(alone, d, groups)
        for name in ("mixed", "q", "k", "log_decay", "beta", "out", "result"):
            np.testing.assert_array_equal(got[name], mixed_run[name][rows], err_msg=f"{name} segment {s}")
        for name in ("conv_state", "ssm_state"):
            np.testing.assert_array_equal(got[name][lane], mixed_run[name][lane], err_msg=f"{name} segment {s}")
        if seg_record[s]:
            for name in ("conv_columns", "ssm_columns"):
                np.testing.assert_array_equal(got[name][lane, :count], mixed_run[name][lane, :count])


@pytest.mark.gpu
@pytest.mark.parametrize("groups", gdn.REC_GROUP_CHOICES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["tiny-dense", "tiny-moe", "narrow-v", "27b", "35b"])
def test_gpu_kernels_match_twins(shape, groups):
    """Each kernel against its twin; and the decode path's gated recurrence (one launch) gives the gates and
    recurrence launches' outputs, states and recorded columns bit for bit."""
    rng = np.random.default_rng(10)
    d = _dims(**shape)
    case = _gpu_case(rng, d, MIX, order=[1, 3, 0, 4, 2])
    plain = _run_gpu(case, d, groups)
    _check_against_twins(case, plain, MIX)
    gated = _run_gpu(case, d, groups, gated=True)
    for name in ("mixed", "out", "result", "ssm_state", "ssm_columns", "conv_state"):
        np.testing.assert_array_equal(gated[name], plain[name], err_msg=name)
    assert np.isnan(gated["q"]).all() and np.isnan(gated["log_decay"]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("groups", gdn.REC_GROUP_CHOICES)
@pytest.mark.parametrize("shape,hidden", [(GPU_SHAPES[0], 136), (GPU_SHAPES[3], 5120), (GPU_SHAPES[4], 2048)],
                         ids=["tiny-dense", "27b", "35b"])
def test_gpu_projected_recurrence_is_the_gated_one_on_its_projection(shape, hidden, groups):
    """The recurrence that computes the a/b projection itself against the gated recurrence fed that projection
    (the twin's fp32 dot products): outputs, states and recorded columns within fp32 rounding of the sums' order."""
    from ninfer.artifact.codec import f32_to_bf16_bits
    from ninfer.kernels_numba.linear import bf16_bits_to_f32

    rng = np.random.default_rng(12)
    d = _dims(**shape)
    case = _gpu_case(rng, d, MIX, order=[1, 3, 0, 4, 2])
    x = rng.standard_normal((case["rows"], hidden), dtype=F32)
    w_ab = f32_to_bf16_bits(rng.standard_normal((2 * d.gdn_v_heads, hidden), dtype=F32) * F32(hidden ** -0.5))
    case["ab"] = (x.astype(np.float64) @ bf16_bits_to_f32(w_ab).astype(np.float64).T).astype(F32)
    want = _run_gpu(case, d, groups, gated=True)
    got = _run_gpu(case, d, groups, projected=(x, w_ab))
    for name in ("out", "result", "ssm_state"):
        assert _rel(got[name], want[name]) < 2e-5, name
    recorded = ~np.isnan(want["ssm_columns"])
    np.testing.assert_array_equal(recorded, ~np.isnan(got["ssm_columns"]))
    assert _rel(got["ssm_columns"][recorded], want["ssm_columns"][recorded]) < 2e-5


def test_projected_recurrence_in_cuda_simulator():
    """gdn_recurrent_projected run thread by thread against its twin (`simulated_kernels.gdn_recurrent_projected`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("gdn_recurrent_projected").splitlines()
                if line.startswith("ok gdn_recurrent_projected")]) == len(gdn.REC_GROUP_CHOICES)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", gdn.REC_GROUP_CHOICES)
@pytest.mark.parametrize("shape", GPU_SHAPES[:1] + GPU_SHAPES[3:4], ids=["tiny-dense", "27b"])
def test_gpu_batch_invariance(shape, groups):
    rng = np.random.default_rng(11)
    d = _dims(**shape)
    case = _gpu_case(rng, d, MIX, order=[1, 3, 0, 4, 2])
    _check_invariance(case, d, MIX, _run_gpu(case, d, groups), groups)


# >= gdn.CONV_FAST_MIN_ROWS rows in all: the conv takes its many-rows-per-thread path here, and the row-by-row path
# when each segment runs alone (so the invariance check also shows the two paths agree bitwise).
BIG_MIX = [(0, 200, 1), (1, 1, 0), (2, 60, 0), (3, 6, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("groups", gdn.REC_GROUP_CHOICES)
def test_gpu_big_launch_matches_twins_and_is_batch_invariant(groups):
    assert sum(m[1] for m in BIG_MIX) >= gdn.CONV_FAST_MIN_ROWS
    rng = np.random.default_rng(13)
    d = _dims()
    case = _gpu_case(rng, d, BIG_MIX, order=[1, 0, 3, 2], max_cols=200)
    got = _run_gpu(case, d, groups)
    _check_against_twins(case, got, BIG_MIX)
    _check_invariance(case, d, BIG_MIX, got, groups)


@pytest.mark.gpu
@pytest.mark.parametrize("row_threads,quads", [(2, False), (4, False), (gdn.CONV_ROWS, True)])
def test_gpu_conv_block_shape_changes_no_bit(row_threads, quads):
    """gdn_conv's threads a block along rows and its 4-channel variant are launch choices (bench/kernel_gdn.py times
    them): outputs, state and recorded columns equal those of the default launch bitwise, on both the
    many-rows-per-thread and row paths."""
    from ninfer.kernels_numba.numba_setup import cuda

    case = _gpu_case(np.random.default_rng(14), _dims(), BIG_MIX, order=[1, 0, 3, 2], max_cols=200)
    c = case["dims"][0]
    stream = cuda.stream()
    results = []
    for threads, variant in ((gdn.CONV_ROWS, False), (row_threads, quads)):
        dev = {name: cuda.to_device(np.ascontiguousarray(case[name]), stream=stream)
               for name in ("projected", "conv_weight", "conv_state", "conv_columns")}
        mixed = cuda.to_device(np.full((case["rows"], c), np.nan, F32), stream=stream)
        gdn.gdn_conv(dev["projected"], dev["conv_weight"], dev["conv_state"], dev["conv_columns"],
                     *[cuda.to_device(a, stream=stream) for a in case["seg"]], mixed, channels=c, stream=stream,
                     row_threads=threads, quads=variant)
        results.append([a.copy_to_host(stream=stream) for a in (mixed, dev["conv_state"], dev["conv_columns"])])
    stream.synchronize()
    assert not np.isnan(results[0][0]).any()
    for default, other in zip(*results):
        np.testing.assert_array_equal(other, default)


@pytest.mark.gpu
def test_gpu_state_carries_across_launches():
    """Prefill 100 rows then 5 single-row launches == one 105-row segment (fp32 tolerance)."""
    rng = np.random.default_rng(12)
    d = _dims()
    whole = _gpu_case(rng, d, [(0, 105, 0)], None, lanes=1, max_cols=1)
    want = _run_gpu(whole, d)
    state = dict(whole)
    outs = []
    for first, count in [(0, 100)] + [(t, 1) for t in range(100, 105)]:
        step = dict(state)
        step["seg"] = (np.array([0], np.int32), np.array([0], np.int32), np.array([count], np.int32),
                       np.array([0], np.int32))
        step["rows"] = count
        step["projected"] = whole["projected"][first:first + count].copy()
        step["ab"] = whole["ab"][first:first + count].copy()
        got = _run_gpu(step, d)
        outs.append(got["result"])
        state["conv_state"], state["ssm_state"] = got["conv_state"], got["ssm_state"]
    assert _rel(np.concatenate(outs), want["result"]) < 1e-5
    np.testing.assert_array_equal(state["conv_state"], want["conv_state"])
    assert _rel(state["ssm_state"], want["ssm_state"]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_output_writes_x_fragments(rows):
    """gdn_output's tensor-core x fragments are those of its fp32 result, rows past `rows` untouched."""
    from ninfer.kernels_numba import quant_mma as qm
    from ninfer.kernels_numba.numba_setup import cuda

    hv, dv, c = 4, 128, 64
    rng = np.random.default_rng(21)
    out = rng.standard_normal((rows, hv, dv)).astype(F32)
    projected = rng.standard_normal((rows, c + hv * dv)).astype(F32)
    norm = rng.standard_normal(dv).astype(F32)
    held = np.full(qm.x_fragment_words(hv * dv), 0xDEADBEEF, np.uint32)
    stream = cuda.stream()
    dev = [cuda.to_device(a, stream=stream) for a in (out, projected, norm, np.zeros((rows, hv * dv), F32), held)]
    gdn.gdn_output(*dev[:4], v_heads=hv, v_dim=dv, z_offset=c, eps=EPS, stream=stream, result_fragments=dev[4])
    result, fragments = dev[3].copy_to_host(stream=stream), dev[4].copy_to_host(stream=stream)
    stream.synchronize()
    want = held.copy()
    qm.write_fragment_rows_reference(want, result)
    np.testing.assert_array_equal(fragments, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 300])
def test_gpu_output_bf16_alone_is_the_bf16_copy_of_the_full_path(rows):
    """gdn_output with no fp32 result (the output projection's cuBLAS GEMM reads only the bf16 copy) writes the same
    bf16 bits as with one, and every element of them."""
    from ninfer.kernels_numba.numba_setup import cuda

    hv, dv, c = 4, 128, 64
    rng = np.random.default_rng(22)
    out = rng.standard_normal((rows, hv, dv)).astype(F32)
    projected = rng.standard_normal((rows, c + hv * dv)).astype(F32)
    norm = rng.standard_normal(dv).astype(F32)
    stream = cuda.stream()
    dev = [cuda.to_device(a, stream=stream) for a in (out, projected, norm)]
    copies = []
    for result in (cuda.to_device(np.zeros((rows, hv * dv), F32), stream=stream), None):
        bf16 = cuda.to_device(np.full((rows, hv * dv), 0x7FC1, np.uint16), stream=stream)
        gdn.gdn_output(*dev, result, v_heads=hv, v_dim=dv, z_offset=c, eps=EPS, stream=stream, result_bf16=bf16)
        copies.append(bf16.copy_to_host(stream=stream))
    stream.synchronize()
    np.testing.assert_array_equal(copies[1], copies[0])
    assert not (copies[1] == 0x7FC1).any()


def test_output_needs_some_result():
    with pytest.raises(ValueError, match="gdn_output needs"):
        gdn.gdn_output(np.zeros((1, 1, 32), F32), np.zeros((1, 64), F32), np.zeros(32, F32), None, v_heads=1,
                       v_dim=32, z_offset=32, eps=EPS, stream=0)
    from ninfer.backends.cuda import host_kernels

    with pytest.raises(ValueError, match="gdn_output needs"):
        host_kernels.gdn_output(np.zeros((1, 1, 32), F32), np.zeros((1, 64), F32), np.zeros(32, F32), None, v_heads=1,
                                v_dim=32, z_offset=32, eps=EPS, stream=0)


def test_gated_recurrence_in_cuda_simulator():
    """gdn_recurrent_gated run thread by thread: bit for bit gdn_gates then gdn_recurrent, and the twin
    (`simulated_kernels.gdn_recurrent_gated`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("gdn_recurrent_gated").splitlines()
                if line.startswith("ok gdn_recurrent_gated")]) == len(gdn.REC_GROUP_CHOICES)


def test_output_kernel_in_cuda_simulator():
    """gdn_output run thread by thread with and without its fp32 result (`simulated_kernels.gdn_output`)."""
    from tests.support.simulated_kernels import run

    lines = run("gdn_output")
    assert "ok gdn_output bf16 alone 64" in lines and "ok gdn_output bf16 alone 128" in lines


@pytest.mark.slow
def test_conv_quads_kernel_in_cuda_simulator():
    """The 4-channel conv thread by thread against the scalar kernel, bit for bit, on its 8-row fast path with
    recorded histories and on its row path (`simulated_kernels.gdn_conv_quads`, a few seconds)."""
    from tests.support.simulated_kernels import run

    assert "ok gdn_conv_quads" in run("gdn_conv_quads")


def test_conv_normed_kernel_in_cuda_simulator():
    """The conv with q and k normalised in its pass, thread by thread against the 4-channel conv and then the gates
    (TF32), bit for bit on the 8-row fast path and the row path (`simulated_kernels.gdn_conv_normed`, ~20 s)."""
    from tests.support.simulated_kernels import run

    assert "ok gdn_conv_normed" in run("gdn_conv_normed")


def _conv_normed_case(rng, rows, qk_heads=2, v_channels=256):
    k_dim = gdn.MAX_HEAD_DIM
    channels = 2 * qk_heads * k_dim + v_channels
    return dict(projected=rng.standard_normal((rows, channels + 4), dtype=F32),
                weight=(rng.standard_normal((gdn.CONV_TAPS, channels)) * 0.5).astype(F32),
                state=rng.standard_normal((2, gdn.CONV_TAPS - 1, channels), dtype=F32),
                columns=np.zeros((2, 1, gdn.CONV_TAPS - 1, channels), F32),
                seg=(np.array([1], np.int32), np.array([0], np.int32), np.array([rows], np.int32),
                     np.array([0], np.int32)),
                channels=channels, qk_heads=qk_heads, k_dim=k_dim)


def test_conv_normed_twin_is_the_conv_then_the_tf32_gates():
    """The twin: the conv's v columns and state, and the gates' TF32 q and k of the conv's output; the decays and
    betas left to `gdn_gates(norms=False)`, which writes nothing else."""
    case = _conv_normed_case(np.random.default_rng(21), rows=11)
    rows, c, hq, dk = 11, case["channels"], case["qk_heads"], case["k_dim"]
    state, out = case["state"].copy(), np.full((rows, c), np.nan, F32)
    q, k = (np.full((rows, hq, dk), np.nan, F32) for _ in range(2))
    gdn.gdn_conv_normed_reference(case["projected"], case["weight"], state, case["columns"], *case["seg"], out, q, k,
                                  channels=c, qk_heads=hq, k_dim=dk)
    want_state, want_out = case["state"].copy(), np.full((rows, c), np.nan, F32)
    gdn.gdn_conv_reference(case["projected"], case["weight"], want_state, case["columns"], *case["seg"], want_out,
                           channels=c)
    ab, vh = np.random.default_rng(2).standard_normal((rows, 4), dtype=F32), 2
    gates = [np.full((rows, hq, dk), np.nan, F32) for _ in range(2)] + [np.full((rows, vh), np.nan, F32)
                                                                          for _ in range(2)]
    gdn.gdn_gates_reference(want_out, ab, -np.ones(vh, F32), np.zeros(vh, F32), *gates, qk_heads=hq, v_heads=vh,
                            k_dim=dk, tf32=True)
    np.testing.assert_array_equal(out[:, 2 * hq * dk:], want_out[:, 2 * hq * dk:])
    np.testing.assert_array_equal(state, want_state)
    np.testing.assert_array_equal(q, gates[0])
    np.testing.assert_array_equal(k, gates[1])
    decays_only = [np.full((rows, hq, dk), np.nan, F32) for _ in range(2)] + [np.full((rows, vh), np.nan, F32)
                                                                                for _ in range(2)]
    gdn.gdn_gates_reference(want_out, ab, -np.ones(vh, F32), np.zeros(vh, F32), *decays_only, qk_heads=hq,
                            v_heads=vh, k_dim=dk, tf32=True, norms=False)
    assert np.isnan(decays_only[0]).all() and np.isnan(decays_only[1]).all()
    np.testing.assert_array_equal(decays_only[2], gates[2])
    np.testing.assert_array_equal(decays_only[3], gates[3])


def test_conv_normed_takes_only_a_warp_a_head():
    case = _conv_normed_case(np.random.default_rng(3), rows=4)
    out, q = np.zeros((4, case["channels"]), F32), np.zeros((4, 2, 64), F32)
    with pytest.raises(ValueError, match="k_dim 128"):
        gdn.gdn_conv_normed(case["projected"], case["weight"], case["state"], case["columns"], *case["seg"], out, q,
                            q, channels=case["channels"], qk_heads=4, k_dim=64, stream=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [37, gdn.CONV_FAST_MIN_ROWS + 13])
def test_gpu_conv_normed_is_the_conv_then_the_gates(rows):
    """On the GPU, the row path and the 8-row fast path: the v columns and the carried state bit for bit the 4-channel
    conv's; q and k those of the TF32 gates on its output (within TF32 rounding: the two kernels' sums of squares
    may contract differently), and the decays and betas of gates(norms=False) the same bits as gates'."""
    from ninfer.kernels_numba.numba_setup import cuda

    case = _conv_normed_case(np.random.default_rng(rows), rows)
    c, hq, dk, vh = case["channels"], case["qk_heads"], case["k_dim"], 4
    stream = cuda.stream()
    ab = cuda.to_device(np.random.default_rng(1).standard_normal((rows, 2 * vh), dtype=F32), stream=stream)
    neg_a, dt_bias = cuda.to_device(-np.ones(vh, F32), stream=stream), cuda.to_device(np.zeros(vh, F32), stream=stream)
    results = []
    for fused in (False, True):
        dev = {n: cuda.to_device(np.ascontiguousarray(case[n]), stream=stream)
               for n in ("projected", "weight", "state", "columns")}
        seg = [cuda.to_device(a, stream=stream) for a in case["seg"]]
        out = cuda.to_device(np.full((rows, c), np.nan, F32), stream=stream)
        outs = [cuda.to_device(np.full(shape, np.nan, F32), stream=stream)
                for shape in ((rows, hq, dk), (rows, hq, dk), (rows, vh), (rows, vh))]
        if fused:
            gdn.gdn_conv_normed(dev["projected"], dev["weight"], dev["state"], dev["columns"], *seg, out, outs[0],
                                outs[1], channels=c, qk_heads=hq, k_dim=dk, stream=stream)
        else:
            gdn.gdn_conv(dev["projected"], dev["weight"], dev["state"], dev["columns"], *seg, out, channels=c,
                         stream=stream, quads=True)
        gdn.gdn_gates(out, ab, neg_a, dt_bias, *outs, qk_heads=hq, v_heads=vh, k_dim=dk, stream=stream, tf32=True,
                      norms=not fused)
        results.append([a.copy_to_host(stream=stream) for a in (out, dev["state"], *outs)])
    stream.synchronize()
    (out0, state0, q0, k0, d0, b0), (out1, state1, q1, k1, d1, b1) = results
    np.testing.assert_array_equal(out1[:, 2 * hq * dk:], out0[:, 2 * hq * dk:])
    np.testing.assert_array_equal(state1, state0)
    assert _rel(q1, q0) < 1e-4 and _rel(k1, k0) < 1e-4
    np.testing.assert_array_equal(d1, d0)
    np.testing.assert_array_equal(b1, b0)
