"""Kernels run in numba's CUDA simulator against their twins (`tests.support.cuda_simulator` has the stand-ins).

`run(NAME, ...)` runs checks in a subprocess, since NUMBA_ENABLE_CUDASIM must be set before numba is imported; by
hand: `NUMBA_ENABLE_CUDASIM=1 python -m tests.support.simulated_kernels NAME...`. Each check prints `ok NAME ...` per
case; the program prints `SIMULATOR OK` at the end; any mismatch raises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def run(*names: str, timeout: float = 900) -> str:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "tests.support.simulated_kernels", *names], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0 and "SIMULATOR OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _check(name: str, got: np.ndarray, want: np.ndarray, tol: float = 1e-5) -> None:
    assert np.isfinite(got).all(), name
    err = _rel(got, want)
    assert err < tol, (name, err)
    print("ok linear", name, err, flush=True)


def linear() -> None:
    """The SIMT linear kernels (`linear`, `quant_linear`): bf16 GEMV with accumulation and its gathered MoE form,
    every quantized format's GEMV, gathered GEMV and dequantization (bitwise)."""
    from ninfer.artifact import codec
    from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32
    from ninfer.kernels_numba import linear as L
    from ninfer.kernels_numba import quant_linear as Q
    from tests.support import cuda_simulator

    for module in (L, Q):
        cuda_simulator.install(vars(module))
    rng = np.random.default_rng(0)
    with np.errstate(all="ignore"):
        for (m, n, k) in [(1, 20, 64), (3, 17, 320)]:
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = codec.f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32))
            y0 = rng.standard_normal((m, n)).astype(np.float32)
            y = y0.copy()
            L.linear_bf16(x, w, y, stream=0, accumulate=True)
            _check(f"bf16 {m}x{n}x{k}", y, L.linear_bf16_reference(x, w, y0, accumulate=True))
        M, S, E, rpe, k = 1, 2, 3, 20, 64
        ids = np.array([[2, 0]], np.int32)
        w = codec.f32_to_bf16_bits(rng.standard_normal((E * rpe, k)).astype(np.float32))
        x = rng.standard_normal((M, S, k)).astype(np.float32)
        gate_up = rng.standard_normal((M, S, 2 * k)).astype(np.float32)
        # the all-in-flight kernels and the stepping ones (`linear._launch_gathered` picks by K and slots)
        for name, kernels in (("in flight", L.GATHERED_FLIGHT_KERNELS), ("stepping", L.GATHERED_STEPPING_KERNELS)):
            y = np.full((M, S, rpe), np.nan, np.float32)
            L.linear_bf16_gathered(x, w, ids, y, rows_per_expert=rpe, x_per_slot=True, stream=0,
                                   _kernel=kernels[False])
            _check(f"bf16 gathered, {name}", y, L.linear_bf16_gathered_reference(x, w, ids, rows_per_expert=rpe,
                                                                                  x_per_slot=True))
            y = np.full((M, S, rpe), np.nan, np.float32)
            L.linear_bf16_gathered_swiglu(gate_up, w, ids, y, rows_per_expert=rpe, stream=0, _kernel=kernels[True])
            _check(f"bf16 gathered swiglu, {name}", y, L.linear_bf16_gathered_swiglu_reference(
                gate_up, w, ids, rows_per_expert=rpe))
        for fmt in (Q4G64, Q5G64, Q6G64, W8G32):
            for (m, n, k) in [(1, 18, 64), (2, 17, 192)]:
                payload = codec.encode_buffer(rng.standard_normal((n, k)).astype(np.float32), fmt)
                qw = Q.upload_quant_weight(fmt, (n, k), payload)
                x = rng.standard_normal((m, k)).astype(np.float32)
                y = np.full((m, n), np.nan, np.float32)
                Q.linear_quant(x, qw, y, stream=0)
                _check(f"{fmt} {m}x{n}x{k}", y, Q.linear_quant_reference(x, fmt, (n, k), payload))
                out = np.zeros((n, k), np.uint16)
                Q.dequantize_bf16(qw, out, stream=0)
                assert np.array_equal(out, Q.dequantize_bf16_reference(fmt, (n, k), payload)), fmt
            payload = codec.encode_buffer(rng.standard_normal((E * rpe, 64)).astype(np.float32), fmt)
            qw = Q.upload_quant_weight(fmt, (E * rpe, 64), payload)
            x = rng.standard_normal((M, 64)).astype(np.float32)
            y = np.full((M, S, rpe), np.nan, np.float32)
            Q.linear_quant_gathered(x, qw, ids, y, rows_per_expert=rpe, x_per_slot=False, stream=0)
            _check(f"{fmt} gathered", y, Q.linear_quant_gathered_reference(
                x, fmt, (E * rpe, 64), payload, ids, rows_per_expert=rpe, x_per_slot=False))


def linear_mma() -> None:
    """The tensor-core bf16 decode GEMM against its twin: one and several x-row sets (9 rows: an unfilled second set),
    two launches (33 rows: 32 and 1), a partial last row tile, K of 2 blocks (every warp's only step partial) and of
    40 (two full steps of the 8 warps, then a partial one), with accumulation; a row alone equals bitwise the same
    row launched beside others."""
    from ninfer.artifact import codec
    from ninfer.kernels_numba import linear_mma, quant_mma
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(linear_mma))
    cuda_simulator.install(vars(quant_mma))  # the epilogue's helpers
    rng = np.random.default_rng(6)
    for m, n, k in [(1, 24, 128), (9, 40, 2560), (33, 16, 128)]:
        x = codec.f32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
        w = codec.f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        y0 = rng.standard_normal((m, n)).astype(np.float32)
        y = y0.copy()
        linear_mma.linear_bf16_mma(x, w, y, stream=0, accumulate=True)
        _check(f"mma {m}x{n}x{k}", y, linear_mma.linear_bf16_mma_reference(x, w, y0, accumulate=True))
        alone = np.full((1, n), np.nan, np.float32)
        linear_mma.linear_bf16_mma(x[m - 1:], w, alone, stream=0)
        beside = np.full((m, n), np.nan, np.float32)
        linear_mma.linear_bf16_mma(x, w, beside, stream=0)
        np.testing.assert_array_equal(alone[0], beside[m - 1])


def linear_narrow() -> None:
    """The narrow bf16 GEMV (K split over a block's warps) equals its twin in every shape it tiles differently: a
    partial last 256-column step, every warp's four steps (K = 8192), a step past the first warp's (of 8 columns), x
    rows past one tile of 8, 1, 2 and 4 output rows a block (4 past the matrix's last row); a row's bits do not depend
    on the rows launched beside it or on the grid. The fused router GEMV + routing writes the logits, ids and weights of
    the GEMV then `route_top_k`, and leaves its completion counter at zero for the next launch."""
    from ninfer.artifact import codec
    from ninfer.kernels_numba import linear, linear_narrow, moe, sampling
    from tests.support import cuda_simulator

    for module in (linear, linear_narrow, moe, sampling):
        cuda_simulator.install(vars(module))
    rng = np.random.default_rng(5)
    for m, n, k, per_block in [(3, 5, 320, 1), (1, 3, 8192, 2), (9, 11, 264, 4)]:
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = codec.f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32))
        y0 = rng.standard_normal((m, n)).astype(np.float32)
        y = y0.copy()
        linear_narrow.linear_bf16_narrow(x, w, y, stream=0, accumulate=True, rows_per_block=per_block)
        _check(f"narrow {m}x{n}x{k} R={per_block}", y, linear_narrow.linear_bf16_narrow_reference(
            x, w, y0, accumulate=True))  # the launch beside others, then the last row alone, on the other grid
        alone = np.full((1, n), np.nan, np.float32)
        linear_narrow.linear_bf16_narrow(x[m - 1:], w, alone, stream=0, rows_per_block=4 if per_block == 1 else 1)
        beside = np.full((m, n), np.nan, np.float32)
        linear_narrow.linear_bf16_narrow(x, w, beside, stream=0, rows_per_block=4 if per_block == 1 else 1)
        np.testing.assert_array_equal(alone[0], beside[m - 1])
    rows, experts, columns, top = 3, 32, 40, 4
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    w = codec.f32_to_bf16_bits(rng.standard_normal((columns, 64)).astype(np.float32))
    counter = np.zeros(1, np.int32)
    for launch in range(2):
        logits = np.full((rows, columns), np.nan, np.float32)
        ids, weights = np.full((rows, top), -1, np.int32), np.full((rows, top), np.nan, np.float32)
        linear_narrow.linear_bf16_narrow_route(x, w, logits, counter, top, ids, weights, stream=0, experts=experts,
                                               rows_per_block=4)  # 10 blocks: the tail waits for all of them
        want_logits, _, _ = linear_narrow.linear_bf16_narrow_route_reference(x, w, top, experts=experts)
        _check(f"narrow route logits, launch {launch}", logits, want_logits)
        routed_ids, routed_weights = moe.route_top_k_reference(logits[:, :experts], top)
        np.testing.assert_array_equal(ids, routed_ids)
        assert _rel(weights, routed_weights) < 1e-6, _rel(weights, routed_weights)
        assert counter[0] == 0, counter
        print("ok narrow route, launch", launch, flush=True)
        x = x[::-1].copy()


def flash_prefill() -> None:
    """Every head dim, a prefix (first position > 0), partial query and key tiles, one row; rows past `rows` of the
    output untouched; the bf16 copy the fp32 rows' bits, also written alone (one row). Small head counts: a block's
    key tile takes the simulator about a second. (Both outputs are passed: the simulator copies each host argument
    on its own, so an unwritten stand-in viewing `out` would copy its stale bytes back over it.)"""
    from ninfer.artifact.codec import f32_to_bf16_bits
    from ninfer.kernels_numba import attention_flash as flash
    from tests.kernels.test_attention_flash import _case, _exact, _twin
    from tests.support import cuda_simulator

    from ninfer.kernels_numba import common

    for function, _ in flash._KERNELS.values():
        cuda_simulator.install(function.py_func.__globals__)
    cuda_simulator.install(vars(flash))
    cuda_simulator.install(vars(common))  # quad_softmax_step's exp2
    for heads, kv_heads, head_dim, start, rows in [(1, 1, 64, 0, 70), (2, 1, 128, 70, 9), (1, 1, 256, 5, 1)]:
        case = _case(np.random.default_rng(heads + rows), heads, kv_heads, head_dim, start, rows)
        out = np.full((rows + 2, heads * head_dim), np.nan, np.float32)
        out_bf16 = np.full((rows + 2, heads * head_dim), 0x7FC1, np.uint16)
        args = dict(rows=rows, first_position=start, length=case["length"], group=case["group"], stream=0)
        flash.flash_prefill(case["packed"], case["k"], case["v_t"], case["qkgv"], out, out_bf16=out_bf16, **args)
        assert np.isnan(out[rows:]).all() and (out_bf16[rows:] == 0x7FC1).all(), "rows past `rows` were written"
        np.testing.assert_array_equal(out_bf16[:rows], f32_to_bf16_bits(out[:rows]))
        if rows == 1:
            alone = np.full((rows, heads * head_dim), 0x7FC1, np.uint16)
            flash.flash_prefill(case["packed"], case["k"], case["v_t"], case["qkgv"], None, out_bf16=alone, **args)
            np.testing.assert_array_equal(alone, out_bf16[:rows])
        err_twin, err_exact = _rel(out[:rows], _twin(case)), _rel(out[:rows], _exact(case))
        assert err_twin < 1e-4 and err_exact < 1e-2, (heads, kv_heads, head_dim, start, rows, err_twin, err_exact)
        print("ok flash_prefill", heads, kv_heads, head_dim, start, rows, err_twin, flush=True)


def gather_kv() -> None:
    """K / V gathered from a paged pool, bf16 and INT8, plain and transposed (the flash path's V^T): bitwise the
    twin's, keys past `length` untouched; a length inside the first 64-key tile and one past it, a second lane.
    Then `pack_queries` against its twin."""
    from ninfer.kernels_numba import attention_gemm
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(attention_gemm))
    rng = np.random.default_rng(2)
    for pages, page_tokens, kv_heads, head_dim, length, lane in [(4, 4, 2, 64, 9, 0), (5, 16, 1, 128, 70, 1)]:
        tables = np.stack([rng.permutation(pages), rng.permutation(pages)]).astype(np.int32)
        bf16_pool = rng.integers(0, 1 << 15, (pages, page_tokens, kv_heads, head_dim), dtype=np.uint16)
        int8_pool = rng.integers(-127, 128, (pages, page_tokens, kv_heads, head_dim), dtype=np.int8)
        scales = np.float16(rng.uniform(0.01, 0.1, (pages, page_tokens, kv_heads, head_dim // 32))).view(np.uint16)
        stride = -(-length // 8) * 8 + 8
        for pool, pool_scales in ((bf16_pool, None), (int8_pool, scales)):
            want = attention_gemm.gather_kv_reference(tables, lane, length, pool, pool_scales)
            for transposed in (False, True):
                shape = (kv_heads, head_dim, stride) if transposed else (kv_heads, stride, head_dim)
                out = np.full(shape, 0xABCD, np.uint16)
                attention_gemm.gather_kv(tables, lane, length, pool, pool_scales, out, stream=0,
                                         transposed=transposed)
                got = out[:, :, :length].transpose(0, 2, 1) if transposed else out[:, :length]
                rest = out[:, :, length:] if transposed else out[:, length:]
                assert np.array_equal(got, want), (pool.dtype, transposed, length)
                assert (rest == 0xABCD).all(), (pool.dtype, transposed, length)
    print("ok gather_kv", flush=True)
    for kv_heads, group, head_dim, first, rows in [(2, 2, 64, 3, 5), (1, 3, 128, 0, 4)]:
        q = rng.standard_normal((first + rows + 2, kv_heads * group, head_dim)).astype(np.float32)
        packed = np.zeros((kv_heads, group * rows, head_dim), np.uint16)
        attention_gemm.pack_queries(q, packed, first=first, rows=rows, group=group, scale=0.125, stream=0)
        want = attention_gemm.pack_queries_reference(q, first=first, rows=rows, group=group, scale=0.125,
                                                     kv_heads=kv_heads)
        assert np.array_equal(packed, want), (kv_heads, group, head_dim, first, rows)
    print("ok pack_queries", flush=True)


def gdn_chunked() -> None:
    """Prepare and scan kernels against the twin: two segments (a full and a partial chunk, then a short one) on two
    of three lanes, two v heads sharing a qk head; the third lane's state untouched. The scan at 64 and at 32 value
    columns a block (the second from the first's G and T / P), the same bits (at 32 the slice fills v_dim: the full
    chunk's copies all take the fast form). Then the prepare kernel alone at key dim 128 (its K and Q staged in two
    parts)."""
    from ninfer.kernels_numba import gdn_chunked as chunked
    from tests.kernels.test_gdn_chunked import CHUNK, _case, _chunked_twin
    from tests.support import cuda_simulator

    for k_dim, scans in chunked._SCANS.items():
        cuda_simulator.install(chunked.prepare_kernel(k_dim, chunked.PREPARE_MAX_REGISTERS).py_func.__globals__)
        for scan, _ in scans.values():
            cuda_simulator.install(scan.py_func.__globals__)
    cuda_simulator.install(vars(chunked))
    heads = dict(qk_heads=1, v_heads=2, k_dim=16, v_dim=32)
    case = _case(np.random.default_rng(3), mix=[(1, 70), (0, 5)], lanes=3, **heads)
    rows = case["rows"]
    want_out, want_state, want_cum, want_mats = _chunked_twin(case)
    written = ~np.isnan(want_mats)
    results = {}
    prepare = chunked.gdn_chunk_prepare

    def prepared(q, k, log_decay, beta, seg_row, seg_count, cum, mats, **_) -> None:
        """The first run's G and T / P, checked against the twin: the same inputs, the prepare kernel's bits (its
        second launch was a sixth of this check)."""
        np.copyto(cum, results[64][2])
        np.copyto(mats, results[64][3])

    for multiprocessors in (0, 8):  # 2 segments x 2 heads = 4 blocks at 64 columns: none of 0 SMs, half of 8
        state = case["ssm_state"].copy()
        out = np.full((rows, 2, 32), np.nan, np.float32)
        cum = np.full((rows, 2), np.nan, np.float32)
        mats = np.full((rows, 2, CHUNK), np.nan, np.float32)
        chunked.gdn_chunk_prepare = prepared if results else prepare
        try:
            chunked.gdn_chunked(case["q"], case["k"], case["mixed"], case["log_decay"], case["beta"], state,
                                case["seg_lane"], case["seg_row"], case["seg_count"], out, cum, mats, rows=rows,
                                channels_qk=2 * 16, multiprocessors=multiprocessors, stream=0, **heads)
        finally:
            chunked.gdn_chunk_prepare = prepare
        assert np.array_equal(~np.isnan(mats), written), "packed T / P written where the twin writes nothing"
        errors = [_rel(cum, want_cum), _rel(mats[written], want_mats[written]), _rel(out, want_out),
                  _rel(state, want_state)]
        assert max(errors) < 1e-4, errors
        assert np.array_equal(state[2], case["ssm_state"][2]), "a lane without a segment changed"
        columns = chunked.scan_slice(4, multiprocessors)
        results[columns] = out, state, cum, mats
        print("ok gdn_chunked slice", columns, *errors, flush=True)
    assert sorted(results) == [32, 64]
    assert np.array_equal(results[32][0], results[64][0]) and np.array_equal(results[32][1], results[64][1])
    # the prepare kernel at the real key dim: K and Q staged in two parts of 64 dims (16 above took one)
    wide = dict(qk_heads=1, v_heads=2, k_dim=128, v_dim=8)
    case = _case(np.random.default_rng(5), mix=[(0, 70)], lanes=1, **wide)
    _, _, want_cum, want_mats = _chunked_twin(case)
    cum = np.full((70, 2), np.nan, np.float32)
    mats = np.full((70, 2, CHUNK), np.nan, np.float32)
    chunked.gdn_chunk_prepare(case["q"], case["k"], case["log_decay"], case["beta"], case["seg_row"],
                              case["seg_count"], cum, mats, rows=70, qk_heads=1, v_heads=2, k_dim=128, stream=0)
    written = ~np.isnan(want_mats)
    assert np.array_equal(~np.isnan(mats), written), "packed T / P written where the twin writes nothing (dk 128)"
    errors = [_rel(cum, want_cum), _rel(mats[written], want_mats[written])]
    assert max(errors) < 1e-4, errors
    print("ok gdn_chunked prepare dk128", *errors, flush=True)
    print("ok gdn_chunked", flush=True)


def gdn_recurrent_gated() -> None:
    """The gated recurrence (gdn_gates' norms and gates done by the recurrent kernel) against the gates kernel then
    the plain recurrent kernel, bit for bit, and the twin: a 1-row decode segment and an 11-row recording one (two
    staged chunks, the second partial) on two of three lanes, two v heads sharing a qk head, key groups 4 and 8."""
    from ninfer.kernels_numba import gdn
    from tests.support import cuda_simulator

    for table in (gdn._RECURRENT_KERNELS, gdn._GATED_RECURRENT_KERNELS):
        for function, _ in table.values():
            cuda_simulator.install(function.py_func.__globals__)
    cuda_simulator.install(vars(gdn))
    rng = np.random.default_rng(9)
    hq, hv, dk, dv, lanes = 1, 2, 16, 16, 3
    heads = dict(qk_heads=hq, v_heads=hv, k_dim=dk, v_dim=dv, channels_qk=2 * hq * dk)
    seg = (np.array([2, 0], np.int32), np.array([0, 1], np.int32), np.array([1, 11], np.int32),
           np.array([0, 1], np.int32))
    rows = 12
    mixed = rng.standard_normal((rows, 2 * hq * dk + hv * dv)).astype(np.float32)
    ab = rng.standard_normal((rows, 2 * hv)).astype(np.float32)
    neg_a = -rng.uniform(0.5, 2.0, hv).astype(np.float32)
    dt_bias = rng.standard_normal(hv).astype(np.float32)
    state0 = (rng.standard_normal((lanes, hv, dk, dv)) * 0.1).astype(np.float32)
    for groups in gdn.REC_GROUP_CHOICES:
        results = []
        for gated in (True, False):
            state = state0.copy()
            columns = np.full((lanes, rows, hv, dk, dv), np.nan, np.float32)
            out = np.full((rows, hv, dv), np.nan, np.float32)
            if gated:
                gdn.gdn_recurrent_gated(mixed, ab, neg_a, dt_bias, state, columns, *seg, out, stream=0,
                                        groups=groups, **heads)
            else:
                q, k = np.empty((rows, hq, dk), np.float32), np.empty((rows, hq, dk), np.float32)
                log_decay, beta = np.empty((rows, hv), np.float32), np.empty((rows, hv), np.float32)
                gdn.gdn_gates(mixed, ab, neg_a, dt_bias, q, k, log_decay, beta, qk_heads=hq, v_heads=hv, k_dim=dk,
                              stream=0)
                gdn.gdn_recurrent(q, k, mixed, log_decay, beta, state, columns, *seg, out, stream=0, groups=groups,
                                  **heads)
            results.append((out, state, columns))
        for got, plain in zip(*results):
            np.testing.assert_array_equal(got, plain)
        want_state, want_columns = state0.copy(), np.full((lanes, rows, hv, dk, dv), np.nan, np.float32)
        want_out = np.full((rows, hv, dv), np.nan, np.float32)
        gdn.gdn_recurrent_gated_reference(mixed, ab, neg_a, dt_bias, want_state, want_columns, *seg, want_out,
                                          **heads)
        out, state, columns = results[0]
        # the recording segment's first 10 rows are recorded; its last row's state is the running state
        errors = [_rel(out, want_out), _rel(state, want_state), _rel(columns[0, :10], want_columns[0, :10])]
        assert max(errors) < 1e-5 and np.array_equal(state[1], state0[1]), errors
        assert np.isnan(columns[0, 10:]).all() and np.isnan(want_columns[0, 10:]).all()
        print("ok gdn_recurrent_gated", groups, *errors, flush=True)


def gdn_recurrent_projected() -> None:
    """The projected recurrence (the a/b projection of the normed rows computed by the recurrent kernel) against
    its twin: a 1-row decode segment and an 11-row recording one (two staged chunks) on two of three lanes, a hidden
    width past a block's 8-column groups with a partial pass (1040 = 130 groups), key groups 4 and 8."""
    from ninfer.artifact import codec
    from ninfer.kernels_numba import gdn
    from tests.support import cuda_simulator

    for function, _ in gdn._PROJECTED_RECURRENT_KERNELS.values():
        cuda_simulator.install(function.py_func.__globals__)
    cuda_simulator.install(vars(gdn))
    rng = np.random.default_rng(10)
    hq, hv, dk, dv, lanes, hidden = 1, 2, 16, 16, 3, 1040
    heads = dict(qk_heads=hq, v_heads=hv, k_dim=dk, v_dim=dv, channels_qk=2 * hq * dk)
    seg = (np.array([2, 0], np.int32), np.array([0, 1], np.int32), np.array([1, 11], np.int32),
           np.array([0, 1], np.int32))
    rows = 12
    mixed = rng.standard_normal((rows, 2 * hq * dk + hv * dv)).astype(np.float32)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w_ab = codec.f32_to_bf16_bits((rng.standard_normal((2 * hv, hidden)) * 0.03).astype(np.float32))
    neg_a = -rng.uniform(0.5, 2.0, hv).astype(np.float32)
    dt_bias = rng.standard_normal(hv).astype(np.float32)
    state0 = (rng.standard_normal((lanes, hv, dk, dv)) * 0.1).astype(np.float32)
    for groups in gdn.REC_GROUP_CHOICES:
        state = state0.copy()
        columns = np.full((lanes, rows, hv, dk, dv), np.nan, np.float32)
        out = np.full((rows, hv, dv), np.nan, np.float32)
        gdn.gdn_recurrent_projected(mixed, x, w_ab, neg_a, dt_bias, state, columns, *seg, out, stream=0,
                                    groups=groups, **heads)
        want_state, want_columns = state0.copy(), np.full((lanes, rows, hv, dk, dv), np.nan, np.float32)
        want_out = np.full((rows, hv, dv), np.nan, np.float32)
        gdn.gdn_recurrent_projected_reference(mixed, x, w_ab, neg_a, dt_bias, want_state, want_columns, *seg,
                                              want_out, **heads)
        # the recording segment's first 10 rows are recorded; its last row's state is the running state
        errors = [_rel(out, want_out), _rel(state, want_state), _rel(columns[0, :10], want_columns[0, :10])]
        assert max(errors) < 1e-5 and np.array_equal(state[1], state0[1]), errors
        assert np.isnan(columns[0, 10:]).all() and np.isnan(want_columns[0, 10:]).all()
        print("ok gdn_recurrent_projected", groups, *errors, flush=True)


def quant_mma() -> None:
    """The tensor-core quantized decode kernels of every format against their twins: x fragments, the plain GEMV
    with one and two fragment sets and accumulation (a partial row tile; one x row, whose lanes read narrow x), over
    a K of 2 blocks (every warp's only step partial) and of 40 (Q4, one x row: two full steps, then a partial one)
    or 20 (full steps, their scales loaded a step ahead, then a partial one), the gathered MoE GEMV with shared and
    per-slot x, and the dequantization for prefill (bitwise: Q4 in one, two and five blocks split every way, the
    others in five blocks split the default way). The simulator runs a lane a thread, so its cost is lanes times
    steps: what no format changes (x_fragments past K = 128, how the dequantization splits a tile's blocks) runs
    once, not once a format."""
    from ninfer.artifact import codec
    from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32
    from ninfer.kernels_numba import quant_linear
    from ninfer.kernels_numba import quant_mma as qm
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(qm))
    rng = np.random.default_rng(5)
    for fmt in (Q4G64, Q5G64, Q6G64, W8G32):
        # 40 blocks: 2 full steps and a partial one; 20: 1 and 1. Two sets over many steps are the same code in
        # every format (Q4's alone).
        long_k = ((1, 2560), (9, 1280)) if fmt == Q4G64 else ((1, 1280),)
        for rows, k in ((1, 128), (3, 128), (9, 128)) + long_k:
            shape = (24, k)
            payload = codec.encode_buffer(rng.standard_normal(shape).astype(np.float32) * 0.05, fmt)
            weight = qm.upload_quant_mma(fmt, shape, payload)
            x = rng.standard_normal((rows, shape[1])).astype(np.float32)
            fragments = np.zeros(qm.x_sets(rows) * qm.x_fragment_words(shape[1]), np.uint32)
            # x_fragments' words depend on no format, and on K only by their block (index / 256): the kernel at
            # K = 128 and over the 20 blocks of two sets, the twin's words for the other long K
            if k == 128 or rows > qm.MAX_X_ROWS:
                qm.x_fragments(x, fragments, stream=0)
                assert np.array_equal(fragments, qm.x_fragments_reference(x)[:fragments.size]), (fmt, rows)
            else:
                fragments[:] = qm.x_fragments_reference(x)[:fragments.size]
            y0 = rng.standard_normal((rows, shape[0])).astype(np.float32)
            y = y0.copy()
            qm.linear_quant_mma(fragments, weight, y, stream=0, accumulate=True)
            want = qm.linear_quant_mma_reference(x, fmt, shape, payload, y0, accumulate=True)
            assert _rel(y, want) < 1e-5, (fmt, rows, k, _rel(y, want))
        shape = (24, 128)
        payload = codec.encode_buffer(rng.standard_normal(shape).astype(np.float32) * 0.05, fmt)
        weight = qm.upload_quant_mma(fmt, shape, payload)
        # one block (a warp reloads it past the end), two and five blocks; how a tile's blocks split into warps' runs
        # is the same arithmetic in every format: past Q4, five blocks in the default runs (3 and 2) only
        for columns in (64, 128, 320) if fmt == Q4G64 else (320,):
            part = (shape[0], columns)
            part_payload = codec.encode_buffer(rng.standard_normal(part).astype(np.float32) * 0.05, fmt)
            blocks = columns // 64
            default = qm.dequantize_parts(-(-shape[0] // qm.TILE_ROWS), blocks)
            # a warp a tile, the default split (asked for as None), and runs of 2 (five blocks: 2, 2, 1) or 1
            for parts in dict.fromkeys((1, default, min(blocks, 3), blocks) if fmt == Q4G64 else (default,)):
                out = np.zeros(part, np.uint16)
                qm.dequantize_mma_bf16(qm.upload_quant_mma(fmt, part, part_payload), out, stream=0,
                                       parts=None if parts == default else parts)
                assert np.array_equal(out, quant_linear.dequantize_bf16_reference(fmt, part, part_payload)), (
                    fmt, columns, parts)
            if fmt != Q4G64:
                continue
            out = np.zeros(part, np.uint16)  # 64-thread blocks (a block past the tiles' warps)
            qm.dequantize_mma_bf16(qm.upload_quant_mma(fmt, part, part_payload), out, stream=0, threads=64,
                                   _kernel=qm.make_dequantize_mma_kernel(qm.FORMAT_BITS[fmt], 64))
            assert np.array_equal(out, quant_linear.dequantize_bf16_reference(fmt, part, part_payload)), (
                fmt, columns, "64 threads")
        experts, rpe, slots, rows = 3, 16, 2, 2
        stacked = (experts * rpe, 128)
        payload = codec.encode_buffer(rng.standard_normal(stacked).astype(np.float32) * 0.05, fmt)
        weight = qm.upload_quant_mma(fmt, stacked, payload)
        ids = np.array([[2, 0], [1, 2]], np.int32)
        for per_slot in (False, True):
            x = rng.standard_normal((rows, slots, 128) if per_slot else (rows, 128)).astype(np.float32)
            if per_slot:
                fragments = np.zeros(slots * qm.x_fragment_words(128), np.uint32)
                qm.x_slot_fragments(x, fragments, stream=0)
            else:
                fragments = np.zeros(qm.x_fragment_words(128), np.uint32)
                qm.x_fragments(x, fragments, stream=0)
            y = np.full((rows, slots, rpe), np.nan, np.float32)
            qm.linear_quant_mma_gathered(fragments, weight, ids, y, rows_per_expert=rpe, x_per_slot=per_slot,
                                         stream=0)
            want = qm.linear_quant_mma_gathered_reference(x, fmt, stacked, payload, ids, rows_per_expert=rpe,
                                                          x_per_slot=per_slot)
            assert _rel(y, want) < 1e-5, (fmt, per_slot, _rel(y, want))
        print("ok quant_mma", fmt, flush=True)
    # A split projection in one launch (Q4 rows beside Q5 rows, partial last tiles in both): bitwise the two
    # single-format launches side by side
    parts = []
    for fmt, rows_of_part in ((Q4G64, 20), (Q5G64, 24)):
        payload = codec.encode_buffer(rng.standard_normal((rows_of_part, 128)).astype(np.float32) * 0.05, fmt)
        parts.append(qm.upload_quant_mma(fmt, (rows_of_part, 128), payload))
    for rows in (3, 9):
        x = rng.standard_normal((rows, 128)).astype(np.float32)
        fragments = np.zeros(qm.x_sets(rows) * qm.x_fragment_words(128), np.uint32)
        qm.x_fragments(x, fragments, stream=0)
        y = np.full((rows, 44), np.nan, np.float32)
        qm.linear_quant_mma_pair(fragments, parts[0], parts[1], y, stream=0)
        singles = [np.full((rows, part.shape[0]), np.nan, np.float32) for part in parts]
        for part, single in zip(parts, singles):
            qm.linear_quant_mma(fragments, part, single, stream=0)
        assert np.array_equal(y, np.hstack(singles)), rows
    print("ok quant_mma pair", flush=True)


def quant_mma_swiglu() -> None:
    """Gate|up weights stored in swiglu_order: the plain GEMV's SwiGLU epilogue (1 and 2 fragment sets) and the
    gathered one (three experts, two slots) write the x fragments that the unpermuted weight's GEMV then the
    silu-mul kernels write, bit for bit (Q4); dequantization gives the rows back in their original order (Q4 and
    W8)."""
    from ninfer.artifact import codec
    from ninfer.artifact.formats import Q4G64, W8G32
    from ninfer.kernels_numba import elementwise, quant_linear
    from ninfer.kernels_numba import quant_mma as qm
    from ninfer.kernels_numba.numba_setup import cuda
    from tests.support import cuda_simulator

    for module in (elementwise, qm):
        cuda_simulator.install(vars(module))
    rng = np.random.default_rng(11)
    inter, k = 64, 128
    for fmt in (Q4G64, W8G32):
        # the epilogues are the same code in every format: Q4's alone; every format's rows come back in order
        epilogues = fmt == Q4G64
        shape = (2 * inter, k)
        payload = codec.encode_buffer(rng.standard_normal(shape).astype(np.float32) * 0.05, fmt)
        if epilogues:
            plain = qm.upload_quant_mma(fmt, shape, payload)
            stored = qm.upload_quant_mma(fmt, shape, payload, swiglu_rows=2 * inter)
        for rows in (3, 10) if epilogues else ():
            x = rng.standard_normal((rows, k)).astype(np.float32)
            xf = np.zeros(qm.x_sets(rows) * qm.x_fragment_words(k), np.uint32)
            qm.x_fragments(x, xf, stream=0)
            words = qm.x_sets(rows) * qm.x_fragment_words(inter)
            fused = np.zeros(words, np.uint32)
            qm.linear_quant_mma_swiglu(xf, stored, np.zeros((rows, 2 * inter), np.float32), fused, stream=0)
            gate_up = np.zeros((rows, 2 * inter), np.float32)
            qm.linear_quant_mma(xf, plain, gate_up, stream=0)
            act = cuda.to_device(np.zeros((rows, inter), np.float32))  # (a host array and its bf16 view, both
            want = np.zeros(words, np.uint32)  # kernel arguments, would each be copied back, the view last)
            if rows <= qm.MAX_X_ROWS:
                elementwise.silu_mul_rows(gate_up, act, stream=0, out_fragments=want)
            else:
                elementwise.silu_mul_rows(gate_up, act, stream=0)
                qm.x_fragments(act, want, stream=0)
            assert np.count_nonzero(want) > words // 8  # every row written (rows past M stay zero)
            np.testing.assert_array_equal(fused, want, err_msg=f"{fmt} rows {rows}")
        experts, slots, rows = 3, 2, 2
        stacked = (experts * 2 * inter, k)
        payload = codec.encode_buffer(rng.standard_normal(stacked).astype(np.float32) * 0.05, fmt)
        stored = qm.upload_quant_mma(fmt, stacked, payload, swiglu_rows=2 * inter)
        if epilogues:
            plain = qm.upload_quant_mma(fmt, stacked, payload)
            ids = np.array([[2, 0], [1, 2]], np.int32)
            x = rng.standard_normal((rows, k)).astype(np.float32)
            xf = np.zeros(qm.x_fragment_words(k), np.uint32)
            qm.x_fragments(x, xf, stream=0)
            fused = np.zeros(slots * qm.x_fragment_words(inter), np.uint32)
            shape_only = np.zeros((rows, slots, 2 * inter), np.float32)
            qm.linear_quant_mma_gathered_swiglu(xf, stored, ids, shape_only, fused, rows_per_expert=2 * inter,
                                                stream=0)
            gate_up = np.zeros((rows, slots, 2 * inter), np.float32)
            qm.linear_quant_mma_gathered(xf, plain, ids, gate_up, rows_per_expert=2 * inter, x_per_slot=False,
                                         stream=0)
            want = np.zeros_like(fused)
            elementwise.silu_mul_slots(gate_up, cuda.to_device(np.zeros((rows, slots, inter), np.float32)), stream=0,
                                       out_fragments=want)
            assert np.count_nonzero(want) > want.size // 8
            np.testing.assert_array_equal(fused, want, err_msg=f"{fmt} gathered")
        # against the host twin of the unpermuted weight (`quant_mma` checks the kernel on that one)
        back = np.zeros(stacked, np.uint16)
        qm.dequantize_mma_bf16(stored, back, stream=0)
        np.testing.assert_array_equal(back, quant_linear.dequantize_bf16_reference(fmt, stacked, payload),
                                      err_msg=f"{fmt} dequantized")
        print("ok quant_mma_swiglu", fmt, flush=True)


def quant_mma_chunked_case(rng, fmt: str, *, counts, chunk: int, rpe: int, k: int, swiglu: bool,
                           upload: bool = True) -> dict:
    """One chunked expert GEMM's launch arguments and its twin's output: `counts` routed rows an expert in the
    chunked layout of `chunk` rows (moe_layout's twin places them) plus one surplus chunk (the sync-free layout's),
    x rows nothing routes NaN, y's rows the sentinel 0xFFFF; `want` is y after the twin, `payload` the experts'
    codec bytes, `weight` their tensor-core upload (`upload`: needs a GPU or the simulator)."""
    from ninfer.artifact import codec
    from ninfer.kernels_numba import moe
    from ninfer.kernels_numba import quant_mma as qm
    from ninfer.kernels_numba import quant_mma_chunked as qc

    experts = len(counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    info, starts = moe.moe_layout_reference(offsets, choice="chunked", chunk=chunk, room=1 << 20, max_chunks=1 << 20)
    chunks = int(info[2]) + 1
    chunk_groups = np.full(chunks, experts - 1, np.int32)
    for e, (start, count) in enumerate(zip(starts.tolist(), counts)):
        chunk_groups[start // chunk:start // chunk + -(-count // chunk)] = e
    rows = chunks * chunk
    x = np.full((rows, k), 0x7FC0, np.uint16)  # NaN: no routed row reads these
    for e, count in enumerate(counts):
        x[starts[e]:starts[e] + count] = codec.f32_to_bf16_bits(rng.standard_normal((count, k)).astype(np.float32))
    stacked = (experts * rpe, k)
    payload = codec.encode_buffer(rng.standard_normal(stacked).astype(np.float32) * 0.05, fmt)
    weight = qm.upload_quant_mma(fmt, stacked, payload, swiglu_rows=rpe if swiglu else 0) if upload else None
    width = rpe // 2 if swiglu else rpe
    y = np.full((rows, width), 0xFFFF, np.uint16)
    want = y.copy()
    qc.linear_quant_mma_chunked_reference(x, codec.decode(payload, fmt, stacked), chunk_groups, offsets, starts, want,
                                          rows_per_expert=rpe, chunk=chunk, chunks=chunks, swiglu=swiglu)
    return dict(x=x, weight=weight, chunk_groups=chunk_groups, offsets=offsets, starts=starts.astype(np.int32), y=y,
                want=want, payload=payload, rows_per_expert=rpe, chunk=chunk, chunks=chunks, swiglu=swiglu)


def check_chunked_output(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """Routed rows within bf16 rounding of the twin (sums in another order may round a value the other way), every
    other row untouched."""
    from ninfer.artifact.codec import bf16_bits_to_f32

    untouched = want == 0xFFFF
    assert np.array_equal(got[untouched], want[untouched]), name
    g, w = bf16_bits_to_f32(got[~untouched]), bf16_bits_to_f32(want[~untouched])
    assert np.isfinite(g).all() and g.size, name
    assert np.abs(g - w).max() <= 2 ** -7 * np.abs(w).max(), (name, float(np.abs(g - w).max()))
    assert _rel(g, w) < 4e-3, (name, _rel(g, w))


def quant_mma_chunked() -> None:
    """The prefill's chunked expert GEMM from quantized experts against its twin: experts with 5, 40, 0 and 33 routed
    rows in chunks of 32 (a chunk of 5 rows: one fragment set; 40: a full piece and one of 8; no chunk; a piece of
    one row) and a surplus chunk, over K of 4 blocks (the three x stages wrap; the weights' two-ahead ring clamps):
    plain outputs of 2 tiles an expert (warps past them store nothing) and Q4's SwiGLU output in chunks of 64 (two
    pieces a chunk). Every format's decode once; the rest is format-independent code, run for Q4."""
    from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32
    from ninfer.kernels_numba import quant_mma as qm
    from ninfer.kernels_numba import quant_mma_chunked as qc
    from tests.support import cuda_simulator

    for module in (qm, qc):
        cuda_simulator.install(vars(module))
    rng = np.random.default_rng(12)
    cases = [(Q4G64, 32, 32, 256, False), (Q4G64, 64, 128, 128, True)] + [
        (fmt, 32, 32, 128, False) for fmt in (Q5G64, Q6G64, W8G32)]
    for fmt, chunk, rpe, k, swiglu in cases:
        case = quant_mma_chunked_case(rng, fmt, counts=[5, 40, 0, 33], chunk=chunk, rpe=rpe, k=k, swiglu=swiglu)
        want = case.pop("want")
        del case["payload"]
        qc.linear_quant_mma_chunked(case.pop("x"), case.pop("weight"), case.pop("chunk_groups"), case.pop("offsets"),
                                    case.pop("starts"), case["y"], **{k: v for k, v in case.items() if k != "y"},
                                    stream=0)
        check_chunked_output(case["y"], want, f"{fmt} chunk {chunk} swiglu {swiglu}")
        print("ok quant_mma_chunked", fmt, chunk, "swiglu" if swiglu else "plain", flush=True)


def attention_prepare_case(cfg, dtype, seed=4):
    """Inputs of one prepare launch (5 rows over 2 lanes, page boundaries crossed, and a padded row: no KV), for the
    simulator and by hand."""
    from tests.kernels.test_attention import _pools, _weights

    rng = np.random.default_rng(seed)
    heads, kv_heads, d, rotary, sections = cfg
    q_norm, k_norm, inv_freq = _weights(cfg, rng)
    pages, page_tokens = 8, 64
    row_pos = np.array([3, 63, 64, 65, 200, -1], np.int32)
    positions = np.stack([row_pos, row_pos + 7, row_pos * 2]).astype(np.int32)
    args = dict(qkgv=rng.standard_normal((6, 2 * (heads + kv_heads) * d)).astype(np.float32), q_norm=q_norm,
                k_norm=k_norm, inv_freq=inv_freq, positions=positions,
                row_lane=np.array([0, 1, 1, 1, 0, 1], np.int32),
                row_pos=row_pos, page_tables=np.stack([rng.permutation(pages)[:4] for _ in range(2)]).astype(np.int32))
    return args, _pools(pages, page_tokens, kv_heads, d, dtype)


def attention_prepare() -> None:
    """The prepare kernel (a warp per row and head: norms, partial MRoPE, the KV append, int8 scales) against its
    twin for the tiny and a reduced real head geometry, bf16 and int8 pools: q within fp32 rounding, V bitwise, K
    within one bf16 or int8 step, the scales bitwise."""
    from ninfer.kernels_numba import attention
    from ninfer.kernels_numba.numba_setup import cuda
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(attention))  # the per-head-dim kernels' globals are the module's
    for cfg in [(4, 2, 64, 16, (3, 3, 2)), (4, 1, 32, 8, (2, 1, 1)), (3, 1, 256, 64, (11, 11, 10))]:
        heads, kv_heads, d, rotary, sections = cfg
        for dtype in ("bf16", "int8"):
            args, pools = attention_prepare_case(cfg, dtype)
            _, want_pools = attention_prepare_case(cfg, dtype)
            dims = dict(heads=heads, kv_heads=kv_heads, head_dim=d, rotary_dim=rotary, sections=sections, eps=1e-6)
            want = attention.attention_prepare_reference(*args.values(), *want_pools,
                                                         np.zeros((6, heads, d), np.float32), **dims)
            got = np.full((6, heads, d), np.nan, np.float32)
            # device arrays: a bf16 launch passes each pool twice (as its unused scale too), and host arrays would
            # be copied back twice, the second copy undoing the first
            device_pools = [None if p is None else cuda.to_device(p) for p in pools]
            attention.attention_prepare(*args.values(), *device_pools, got, stream=0, **dims)
            pools = [None if p is None else p.copy_to_host() for p in device_pools]
            assert np.isfinite(got).all() and _rel(got, want) < 1e-5, (cfg, dtype, _rel(got, want))
            np.testing.assert_array_equal(pools[1], want_pools[1])
            assert np.abs(pools[0].astype(int) - want_pools[0].astype(int)).max() <= 1, (cfg, dtype)
            if dtype == "int8":
                np.testing.assert_array_equal(pools[3], want_pools[3])
            print("ok attention_prepare", cfg, dtype, flush=True)


def _decode_matches_twin(attention, rng, pools, tables, row_lane, row_pos, *, heads, kv_heads, head_dim,
                         splits, min_split_keys=0, out_bf16=None, out_fragments=None,
                         tensor_cores=True) -> np.ndarray:
    """attention_decode over `splits` splits equals its exact twin (random q and gate rows); returns its output."""
    from ninfer.kernels_numba.numba_setup import cuda

    rows, d = row_lane.shape[0], head_dim
    q = rng.standard_normal((rows, heads, d)).astype(np.float32)
    qkgv = rng.standard_normal((rows, 2 * (heads + kv_heads) * d)).astype(np.float32)
    dims = dict(heads=heads, kv_heads=kv_heads, head_dim=d)
    want = attention.attention_decode_reference(q, qkgv, tables, row_lane, row_pos, *pools,
                                                np.zeros((rows, heads * d), np.float32), **dims)
    # out on the simulator's device: the combine's stand-ins for an absent bf16 copy or fragments are views of out,
    # and a host array would be copied back once for each, the views' stale copies last
    out = cuda.to_device(np.full((rows, heads * d), np.nan, np.float32))
    partials = np.full(attention.decode_partials_shape(rows, heads, d, splits), np.nan, np.float32)
    attention.attention_decode(q, qkgv, tables, row_lane, row_pos, *pools, out, partials, stream=0,
                               min_split_keys=min_split_keys, out_bf16=out_bf16, out_fragments=out_fragments,
                               tensor_cores=tensor_cores, **dims)
    out = out.copy_to_host()
    assert np.isfinite(out).all() and _rel(out, want) < 1e-5, (heads, d, splits, _rel(out, want))
    return out


def attention_decode() -> None:
    """The split decode kernel and the combine against the exact twin on a tiny head geometry with 96 splits a row,
    rows of 1 and 150 keys (38 splits: the combine's lanes hold several splits each), then 8 splits of at least 60
    keys, rows of 1, 150 and 400 keys, over pages of 16 tokens (the head_dim 256 kernel: `attention_decode_staged`),
    the combine also writing its bf16 copy and x fragments of the output, bitwise the host twin's conversions of it.
    (Each split is a block of 128 simulated threads, empty ones too: at 96 splits the row of 400 keys, 50 splits,
    showed what the row of 150 does at three times the cost.)"""
    from ninfer.artifact.codec import f32_to_bf16_bits
    from ninfer.backends.cuda import host_kernels
    from ninfer.kernels_numba import attention
    from ninfer.kernels_numba.quant_mma import x_fragment_words
    from tests.kernels.test_attention import _random_pools
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(attention))
    rng = np.random.default_rng(6)
    heads, kv_heads, d, splits = 4, 2, 32, 96
    pools = _random_pools(rng, 32, 16, kv_heads, d, "bf16")
    tables = np.stack([rng.permutation(32)[:26] for _ in range(2)]).astype(np.int32)
    _decode_matches_twin(attention, rng, pools, tables, np.array([0, 1], np.int32), np.array([0, 149], np.int32),
                         heads=heads, kv_heads=kv_heads, head_dim=d, splits=splits)
    print("ok attention_decode", heads, kv_heads, d, splits, "floor", 0, flush=True)
    # then 8 splits at least 60 keys each: 1, 3 and 7 splits of 60 keys where the shares would be 4, 20 and 52; the
    # combine's bf16 copy and fragments with them (the output above was the combine's without)
    bf16 = np.zeros((3, heads * d), np.uint16)
    fragments = np.zeros(x_fragment_words(heads * d), np.uint32)
    out = _decode_matches_twin(attention, rng, pools, tables, np.array([0, 1, 0], np.int32),
                               np.array([0, 149, 399], np.int32), heads=heads, kv_heads=kv_heads, head_dim=d,
                               splits=8, min_split_keys=60, out_bf16=bf16, out_fragments=fragments)
    print("ok attention_decode", heads, kv_heads, d, 8, "floor", 60, flush=True)
    want_bf16, want_fragments = np.zeros_like(bf16), np.zeros_like(fragments)
    host_kernels._bf16_copy(out, want_bf16)
    host_kernels._fragment_rows(out, want_fragments)
    np.testing.assert_array_equal(bf16, want_bf16)
    np.testing.assert_array_equal(bf16, f32_to_bf16_bits(out))
    np.testing.assert_array_equal(fragments, want_fragments)
    print("ok attention_decode bf16 copy and x fragments", flush=True)


def attention_decode_staged() -> None:
    """The head_dim 256 decode kernel (K/V tiles through shared memory) and the combine against the exact twin, 2 q
    heads a kv head, pages of 16 tokens: bf16 and int8 KV, rows of 1 and 101 keys in one split (4 tiles: the 3-stage
    ring turns and the last tile is partial); int8 KV, rows of 1 and 70 keys in 2 splits (the second split starts
    mid-page, its last step runs past the row's end)."""
    from ninfer.kernels_numba import attention
    from tests.kernels.test_attention import _random_pools
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(attention))
    rng = np.random.default_rng(8)
    for dtype, row_pos, splits in (("bf16", [0, 100], 1), ("int8", [0, 100], 1), ("int8", [0, 69], 2)):
        pools = _random_pools(rng, 8, 16, 1, 256, dtype)
        _decode_matches_twin(attention, rng, pools, rng.permutation(8)[None, :7].astype(np.int32),
                             np.array([0, 0], np.int32), np.array(row_pos, np.int32), heads=2, kv_heads=1,
                             head_dim=256, splits=splits, tensor_cores=False)
        print("ok attention_decode_staged", dtype, splits, flush=True)


def attention_decode_mma() -> None:
    """The tensor-core decode kernel (`attention_decode_mma`) and the combine against the exact twin, INT8 KV over
    pages of 16 and 32 tokens and bf16 KV over pages of 16: 6 q heads a kv head (5 rows a block, the second m16
    tile in use), a verify run of 6 rows on lane 0 (a block of 5 and one of 1) after a row of lane 1, in 2 splits
    (rows of different lengths cut at different keys: per-row masks inside a tile); then one row of the run alone:
    bitwise its value in the batch.
    (The GPU tests take more splits, floors and the real shapes.)"""
    from ninfer.kernels_numba import attention, attention_decode_mma
    from tests.kernels.test_attention import _random_pools
    from tests.support import cuda_simulator

    from ninfer.kernels_numba import common

    cuda_simulator.install(vars(attention))
    cuda_simulator.install(vars(attention_decode_mma))
    cuda_simulator.install(vars(common))  # quad_softmax_step's exp2
    rng = np.random.default_rng(9)
    tables = np.stack([rng.permutation(12)[:10] for _ in range(2)]).astype(np.int32)
    row_lane = np.array([1, 0, 0, 0, 0, 0, 0], np.int32)
    row_pos = np.array([40, 95, 96, 97, 98, 99, 100], np.int32)
    # INT8-G64 pools first (codes turned into bf16 in shared memory, K scales a 64-dim group, V scales in P), then
    # bf16 ones, whose run the row-alone check below repeats
    for page_tokens in (16, 32):  # a page a key's read, or one a tile (pages of whole tiles)
        pages = 12 * 16 // page_tokens
        int8_pools = _random_pools(rng, pages, page_tokens, 1, 256, "int8")
        int8_tables = np.stack([rng.permutation(pages)[:pages - 2] for _ in range(2)]).astype(np.int32)
        _decode_matches_twin(attention, rng, int8_pools, int8_tables, row_lane, row_pos, heads=6, kv_heads=1,
                             head_dim=256, splits=2)
        print("ok attention_decode_mma int8", page_tokens, flush=True)
    pools = _random_pools(rng, 12, 16, 1, 256, "bf16")
    for splits, floor in ((2, 0),):
        state = rng.bit_generator.state
        got = _decode_matches_twin(attention, rng, pools, tables, row_lane, row_pos, heads=6, kv_heads=1,
                                   head_dim=256, splits=splits, min_split_keys=floor)
        print("ok attention_decode_mma", splits, "floor", floor, flush=True)
    rng.bit_generator.state = state  # the same q and gate rows: the last case's row 4 alone
    q = rng.standard_normal((7, 6, 256)).astype(np.float32)
    qkgv = rng.standard_normal((7, 2 * 7 * 256)).astype(np.float32)
    from ninfer.kernels_numba.numba_setup import cuda

    out = cuda.to_device(np.full((1, 6 * 256), np.nan, np.float32))
    partials = np.full(attention.decode_partials_shape(1, 6, 256, 2), np.nan, np.float32)
    attention.attention_decode(q[4:5], qkgv[4:5], tables, row_lane[4:5], row_pos[4:5], *pools, out, partials,
                               stream=0, heads=6, kv_heads=1, head_dim=256)
    np.testing.assert_array_equal(out.copy_to_host()[0], got[4])
    print("ok attention_decode_mma row alone", flush=True)


def elementwise() -> None:
    """silu_mul_to_bf16_rows (16-byte loads by address, 8-byte stores): bitwise its twin, a partial column tile;
    silu_mul_bf16_rows' 16-byte kernel bitwise its word kernel (the same arithmetic), both within fp32 rounding of
    the twin; sigmoid_gate_add's 4-column kernel bitwise its column kernel; add_slices_rms_norm_rows bitwise
    add_rms_norm_rows of the slices' sum."""
    from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
    from ninfer.kernels_numba import elementwise as ew
    from ninfer.kernels_numba.numba_setup import cuda
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(ew))
    for rows, width in [(2, 8), (3, 264)]:
        gate_up = np.random.default_rng(width).standard_normal((rows, 2 * width)).astype(np.float32) * 4
        out = np.full((rows, width), 0x7FC1, np.uint16)
        ew.silu_mul_to_bf16_rows(gate_up, out, stream=0)
        np.testing.assert_array_equal(out, ew.silu_mul_to_bf16_rows_reference(gate_up))
        print("ok elementwise silu_mul_to_bf16", rows, width, flush=True)
    for rows, width in [(3, 8), (2, 24)]:  # 16-byte path (widths of 8k), then the word kernel on the same values
        gate_up = f32_to_bf16_bits(np.random.default_rng(width).standard_normal((rows, 2 * width)).astype(np.float32))
        quads = np.full((rows, width), 0x7FC1, np.uint16)
        ew.silu_mul_bf16_rows(gate_up, quads, stream=0)
        words = np.full((rows, width), 0x7FC1, np.uint16)
        ew._silu_mul_bf16_kernel[(rows, 1), 32](gate_up.view(np.uint32), words.view(np.uint32))
        np.testing.assert_array_equal(quads, words)
        assert _rel(bf16_bits_to_f32(quads), bf16_bits_to_f32(ew.silu_mul_bf16_rows_reference(gate_up))) < 1e-5
        print("ok silu_mul_bf16", rows, width, flush=True)
    for rows, width in [(3, 8), (2, 6)]:  # 4 columns a thread (the gate logits a strided view), then one a thread
        rng = np.random.default_rng(width)
        residual, delta = (rng.standard_normal((rows, width)).astype(np.float32) for _ in range(2))
        logits = rng.standard_normal((rows, 3)).astype(np.float32)
        gate = cuda.to_device(logits)[:, 2:]  # a device view, as the model's router logits' last column
        got = cuda.to_device(residual)
        ew.sigmoid_gate_add(got, cuda.to_device(delta), gate, stream=0)
        columns = cuda.to_device(residual)
        ew._sigmoid_gate_add_kernel[(rows, 1), 32](columns, cuda.to_device(delta), gate)
        got, columns = got.copy_to_host(), columns.copy_to_host()
        np.testing.assert_array_equal(got, columns)
        assert _rel(got, ew.sigmoid_gate_add_reference(residual, delta, logits[:, 2:])) < 1e-6
        print("ok sigmoid_gate_add", rows, width, flush=True)
    for slices in (1, 4):  # the split-K slices added to the residual in order, then the norm: add_rms_norm's bits
        rng = np.random.default_rng(slices)
        residual, weight = rng.standard_normal((2, 264)).astype(np.float32), rng.standard_normal(264).astype(np.float32)
        partials = rng.standard_normal((slices, 4, 264)).astype(np.float32)
        total = partials[0, :2].copy()
        for s in range(1, slices):
            total = total + partials[s, :2]
        got_residual, want_residual = residual.copy(), residual.copy()
        got, want = np.zeros((2, 264), np.float32), np.zeros((2, 264), np.float32)
        ew.add_slices_rms_norm_rows(partials, got_residual, weight, got, eps=1e-6, offset=True, stream=0)
        ew.add_rms_norm_rows(want_residual, total, weight, want, eps=1e-6, offset=True, stream=0)
        np.testing.assert_array_equal(got_residual, want_residual)
        np.testing.assert_array_equal(got, want)
        print("ok add_slices_rms_norm", slices, flush=True)


def gdn_output() -> None:
    """gdn_output with and without its fp32 result: the same bf16 bits, the fp32 within rounding of the twin; v_dim
    64 (a lane's strided dims) and 128 (the vector kernel: a lane's 4 consecutive dims)."""
    from ninfer.artifact.codec import f32_to_bf16_bits
    from ninfer.kernels_numba import gdn
    from ninfer.kernels_numba.numba_setup import cuda
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(gdn))
    for dv in (64, 128):
        rows, hv, c = 3, 2, 32
        rng = np.random.default_rng(5)
        out = rng.standard_normal((rows, hv, dv)).astype(np.float32)
        projected = rng.standard_normal((rows, c + hv * dv)).astype(np.float32)
        norm = rng.standard_normal(dv).astype(np.float32)
        want = np.empty((rows, hv * dv), np.float32)
        gdn.gdn_output_reference(out, projected, norm, want, v_heads=hv, v_dim=dv, z_offset=c, eps=1e-6)
        copies = []
        for result in (cuda.to_device(np.full((rows, hv * dv), np.nan, np.float32)), None):
            bf16 = cuda.to_device(np.full((rows, hv * dv), 0x7FC1, np.uint16))
            gdn.gdn_output(cuda.to_device(out), cuda.to_device(projected), cuda.to_device(norm), result, v_heads=hv,
                           v_dim=dv, z_offset=c, eps=1e-6, stream=0, result_bf16=bf16)
            copies.append(bf16.copy_to_host())
            if result is not None:
                assert _rel(result.copy_to_host(), want) < 1e-6
                np.testing.assert_array_equal(copies[0], f32_to_bf16_bits(result.copy_to_host()))
        np.testing.assert_array_equal(copies[1], copies[0])
        print("ok gdn_output bf16 alone", dv, flush=True)


def moe_combine_norm() -> None:
    """The decode combine fused with the next RMSNorm equals moe_combine then rms_norm_rows bit for bit (residual,
    fp32 rows, bf16 copy, x fragments) with 8 and 2 slots and threads past the row's end, and a row whose norm
    threads take 4 vectors each across two warps (1024 wide: 256 combine threads, 64 norm threads); and the twin."""
    from ninfer.kernels_numba import elementwise, moe
    from ninfer.kernels_numba.numba_setup import cuda
    from ninfer.kernels_numba.quant_mma import x_fragment_words
    from tests.support import cuda_simulator

    for module in (elementwise, moe):
        cuda_simulator.install(vars(module))
    rng = np.random.default_rng(10)
    for rows, slots, width in [(3, 8, 192), (2, 2, 128), (1, 2, 1024)]:
        expert_out = rng.standard_normal((rows, slots, width)).astype(np.float32)
        weights = rng.dirichlet(np.ones(slots), rows).astype(np.float32)
        residual = rng.standard_normal((rows, width)).astype(np.float32)
        shared_out = rng.standard_normal((rows, width)).astype(np.float32)
        logits = rng.standard_normal((rows, 3)).astype(np.float32)
        gate_logit = cuda.to_device(logits)[:, 1:2]  # a column of the router's logits, as the model passes it
        norm = rng.standard_normal(width).astype(np.float32)
        results = []
        for fused in (True, False):
            x = residual.copy()
            out = np.full((rows, width), np.nan, np.float32)
            bf16 = np.zeros((rows, width), np.uint16)
            fragments = np.zeros(x_fragment_words(width), np.uint32)
            norm_args = dict(eps=1e-6, offset=True, stream=0, out_bf16=bf16, out_fragments=fragments)
            if fused:
                moe.moe_combine_rms_norm(expert_out, weights, x, shared_out, gate_logit, norm, out, **norm_args)
            else:
                moe.moe_combine(expert_out, weights, x, stream=0, shared_out=shared_out, gate_logit=gate_logit)
                elementwise.rms_norm_rows(x, norm, out, **norm_args)
            results.append((x, out, bf16, fragments))
        for got, plain in zip(*results):
            np.testing.assert_array_equal(got, plain)
        want_x, want_out = moe.moe_combine_rms_norm_reference(expert_out, weights, residual, shared_out,
                                                              logits[:, 1:2], norm, eps=1e-6, offset=True)
        errors = [_rel(results[0][0], want_x), _rel(results[0][1], want_out)]
        assert max(errors) < 1e-6, errors
        print("ok moe_combine_norm", rows, slots, width, *errors, flush=True)


def moe_route() -> None:
    """route_top_k (a warp a row: softmax, top-k by repeated warp maxima, ids ranked among the chosen lanes) equals
    its twin: ids exactly, weights within fp32 rounding; k < 8 and logit columns past the experts included."""
    from ninfer.kernels_numba import moe, sampling
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(moe))
    cuda_simulator.install(vars(sampling))  # warp_max_u64's reductions
    rng = np.random.default_rng(0)
    for rows, columns, experts, k, levels in [(3, 256, 256, 8, 0), (5, 64, 64, 4, 0), (2, 257, 256, 8, 0),
                                              (4, 256, 256, 8, 3)]:
        logits = rng.standard_normal((rows, columns)).astype(np.float32)
        if levels:  # a few distinct logits: every pick is a tie the lower id wins
            logits = rng.integers(0, levels, (rows, columns)).astype(np.float32)
        ids, weights = np.full((rows, k), -1, np.int32), np.full((rows, k), np.nan, np.float32)
        moe.route_top_k(logits, k, ids, weights, stream=0, experts=experts)
        want_ids, want_weights = moe.route_top_k_reference(logits[:, :experts], k)
        np.testing.assert_array_equal(ids, want_ids)
        assert _rel(weights, want_weights) < 1e-6, (rows, columns, k, _rel(weights, want_weights))
        print("ok moe_route", rows, columns, k, flush=True)


def moe_padded() -> None:
    """moe_pad_positions and the scatter through its positions (8 columns a thread for widths of 8k, column pairs,
    single columns for an odd width) equal their twins; padding rows keep their contents; the combine back (8
    columns a thread, or a column kernel) bitwise the column kernel, within fp32 rounding of its twin; with the
    shared expert's gated output, bitwise the combine and then sigmoid_gate_add."""
    from ninfer.kernels_numba import elementwise as ew
    from ninfer.kernels_numba import moe
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(moe))
    cuda_simulator.install(vars(ew))
    rng = np.random.default_rng(1)
    for rows, experts, k, hidden in [(7, 8, 2, 6), (5, 16, 4, 5), (6, 8, 2, 16)]:  # the last: 16-byte kernels
        ids = np.sort(np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)]), axis=1).astype(np.int32)
        counts, offsets, _, position_of = moe.moe_group_reference(ids, experts)
        largest = int(counts.max())
        starts = (np.arange(experts) * largest).astype(np.int32)
        padded = np.full(rows * k, -1, np.int32)
        moe.moe_pad_positions(ids, position_of, offsets, starts, padded, stream=0)
        np.testing.assert_array_equal(padded, moe.moe_pad_positions_reference(ids, position_of, offsets, starts))
        x = rng.standard_normal((rows, hidden)).astype(np.float32)
        blank = np.full((experts * largest, hidden), 0x7FC1, np.uint16)
        out = blank.copy()
        moe.moe_gather(x, None, k, out, position_of=padded, stream=0)
        np.testing.assert_array_equal(out, moe.moe_scatter_rows_reference(x, padded, k, blank))
        residual = rng.standard_normal((rows, hidden)).astype(np.float32)
        weights = rng.random((rows, k)).astype(np.float32)
        combined = residual.copy()
        moe.moe_scatter_combine(out, None, weights, k, combined, position_of=padded, stream=0)
        columns = residual.copy()  # the column kernel, which widths not of 8k take
        moe._moe_scatter_combine_kernel[(rows, 1), 32](out, padded, weights, columns)
        np.testing.assert_array_equal(combined, columns)
        want = moe.moe_scatter_combine_reference(out, padded, weights, k, residual)
        assert _rel(combined, want) < 1e-6, _rel(combined, want)
        # with the shared expert's gated output in the same pass: bitwise the combine, then sigmoid_gate_add
        shared = rng.standard_normal((rows, hidden)).astype(np.float32)
        gate_logit = rng.standard_normal((rows, 1)).astype(np.float32)  # (the simulator copies contiguous arrays)
        gated = residual.copy()
        moe.moe_scatter_combine(out, None, weights, k, gated, position_of=padded, stream=0, shared_out=shared,
                                gate_logit=gate_logit)
        ew.sigmoid_gate_add(combined, shared, gate_logit, stream=0)
        np.testing.assert_array_equal(gated, combined)
        print("ok moe_padded", rows, experts, k, hidden, flush=True)


# moe_layout's cases, (counts, choice, room) per expert count. Each launch is a block of 1024 simulated threads, so
# instead of 6 rooms under every pattern (36 launches, most outcomes repeated): at 256 experts every pattern laid out
# padded (the scan of the largest count) and chunked (the scan of the chunks), at 8 (fewer than a warp) the uneven
# patterns; over both, every choice, auto choosing padded (rows == room) and chunked (padding past PADDED_LIMIT), and
# grouped where the rows do not fit (padded, chunked, auto either way) or chosen.
MOE_LAYOUT_CASES = {
    256: (("balanced", "padded", "ample"), ("balanced", "chunked", "ample"), ("balanced", "auto", "under routed"),
          ("skewed", "padded", "ample"), ("skewed", "auto", "twice routed"), ("skewed", "chunked", "under chunked"),
          ("skewed", "grouped", "ample"), ("crowded", "padded", "ample"), ("crowded", "auto", "40 an expert"),
          ("crowded", "auto", "routed")),
    8: (("balanced", "auto", "routed"), ("skewed", "auto", "twice routed"), ("skewed", "padded", "ample"),
        ("crowded", "chunked", "ample"), ("crowded", "padded", "ample"), ("crowded", "padded", "under padded")),
}


def moe_layout() -> None:
    """moe_layout's one block (scans of the experts' chunks and counts) against its twin: balanced, skewed and
    crowded counts, 8 and 256 experts, every choice and every outcome of the rule (`MOE_LAYOUT_CASES`); then
    moe_chunk_groups (steps 1 and 7) and chunk_addresses on its output."""
    from ninfer.kernels_numba import moe
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(moe))
    rng = np.random.default_rng(2)
    cases = 0
    outcomes = set()
    for experts in (8, 256):
        patterns = {"balanced": np.full(experts, 20), "skewed": rng.integers(0, 300, experts),
                    "crowded": np.eye(1, experts, 3)[0] * 900}
        for pattern, choice, room_name in MOE_LAYOUT_CASES[experts]:
            counts = patterns[pattern]
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            routed = int(offsets[-1])
            room = {"ample": 10 ** 6, "routed": routed, "under routed": routed - 1, "twice routed": 2 * routed,
                    "40 an expert": 40 * experts, "under padded": experts * int(counts.max()) - 1,
                    "under chunked": 128 * int((-(-counts // 128)).sum()) - 1}[room_name]
            info = np.full(moe.LAYOUT_INFO, -1, np.int32)
            starts = np.full(experts, -1, np.int32)
            moe.moe_layout(offsets, info, starts, choice=choice, chunk=128, room=room, max_chunks=8192, stream=0)
            want_info, want_starts = moe.moe_layout_reference(offsets, choice=choice, chunk=128, room=room,
                                                              max_chunks=8192)
            np.testing.assert_array_equal(info, want_info)
            np.testing.assert_array_equal(starts, want_starts)
            outcomes.add((experts, pattern, choice, int(info[0])))
            # the chunked layout's chunk -> expert map (another layout leaves it alone), its step's surplus,
            # and the pointer-array GEMM's address table from it
            for step in (1, 7):
                groups, want_groups = np.full(9000, -1, np.int32), np.full(9000, -1, np.int32)
                moe.moe_chunk_groups(info, offsets, starts, groups, chunk=128, step=step, room=room, stream=0)
                moe.moe_chunk_groups_reference(info, offsets, starts, want_groups, chunk=128, step=step,
                                               room=room)
                np.testing.assert_array_equal(groups, want_groups)
                assert (want_groups >= 0).sum() == (0 if info[0] != moe.LAYOUT_CHUNKED else moe.stepped_chunks(
                    int(info[2]), step, room, 128))
            used = groups[groups >= 0]
            table = np.zeros(3 * len(used) + 5, np.uint64)
            addresses = dict(w_address=1 << 40, x_address=3 << 40, y_address=5 << 40, n=48, k=64, chunk=128)
            moe.chunk_addresses(groups, table, chunks=len(used), stream=0, **addresses)
            np.testing.assert_array_equal(table[:3 * len(used)], moe.chunk_addresses_reference(used, **addresses))
            assert not table[3 * len(used):].any()
            cases += 1
    # the coverage MOE_LAYOUT_CASES promises
    layouts = {(experts, pattern, layout) for experts, pattern, _, layout in outcomes}
    assert all({(experts, pattern, moe.LAYOUT_PADDED), (experts, pattern, moe.LAYOUT_CHUNKED)} <= layouts
               for experts, pattern in ((256, "balanced"), (256, "skewed"), (256, "crowded"), (8, "skewed"),
                                        (8, "crowded"))), layouts
    chosen = {(choice, layout) for *_, choice, layout in outcomes}
    assert {("auto", moe.LAYOUT_PADDED), ("auto", moe.LAYOUT_CHUNKED)} | {
        (choice, moe.LAYOUT_GROUPED) for choice in moe.LAYOUT_CODES} <= chosen, chosen
    print("ok moe_layout", cases, flush=True)


def quant_mma_conv() -> None:
    """The in-projection GEMV with the conv in its epilogue, one format (W8) and a Q4 | Q5 pair, the conv's channels
    ending inside a tile, over decode-shaped segments (a step's rows, MTP verify rows recording their histories) and
    over more segments than one pass of a block's threads: bitwise the GEMV (`linear_quant_mma` / `_pair`) then
    `gdn_conv` (products, conv outputs, state, histories)."""
    from ninfer.artifact import codec
    from ninfer.artifact.formats import Q4G64, Q5G64, W8G32
    from ninfer.kernels_numba import gdn, quant_mma_conv
    from ninfer.kernels_numba import quant_mma as qm
    from tests.support import cuda_simulator

    for module in (qm, gdn, quant_mma_conv):
        cuda_simulator.install(vars(module))
    rng = np.random.default_rng(17)
    k = 128
    many = quant_mma_conv.SEGMENT_PASS + 3
    for blocks, channels, counts in ((((W8G32, 40),), 28, None), (((Q4G64, 20), (Q5G64, 24)), 30, None),
                                     (((W8G32, 16),), 16, [1] * many)):
        parts = []
        for fmt, rows_of_part in blocks:
            payload = codec.encode_buffer(rng.standard_normal((rows_of_part, k)).astype(np.float32) * 0.05, fmt)
            parts.append(qm.upload_quant_mma(fmt, (rows_of_part, k), payload))
        n = sum(part.shape[0] for part in parts)
        rows, seg, _, weight, state0, blank = _decode_conv_case(rng, channels)
        if counts is not None:  # one row a lane, more lanes than a pass
            rows, lanes = len(counts), len(counts)
            seg = (np.arange(lanes, dtype=np.int32)[::-1].copy(), np.arange(lanes, dtype=np.int32),
                   np.ones(lanes, np.int32), (np.arange(lanes) % 2).astype(np.int32))
            state0 = rng.standard_normal((lanes, gdn.CONV_TAPS - 1, channels)).astype(np.float32)
            blank = np.full((lanes, 1, gdn.CONV_TAPS - 1, channels), np.nan, np.float32)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        fragments = np.zeros(qm.x_sets(rows) * qm.x_fragment_words(k), np.uint32)
        qm.x_fragments(x, fragments, stream=0)
        results = []
        for fused in (True, False):
            y, mixed = np.full((rows, n), np.nan, np.float32), np.full((rows, channels), np.nan, np.float32)
            state, columns = state0.copy(), blank.copy()
            if fused:
                quant_mma_conv.linear_quant_mma_conv(fragments, tuple(parts), y, weight, state, columns, *seg, mixed,
                                                     channels=channels, stream=0)
            else:
                if len(parts) == 2:
                    qm.linear_quant_mma_pair(fragments, parts[0], parts[1], y, stream=0)
                else:
                    qm.linear_quant_mma(fragments, parts[0], y, stream=0)
                gdn.gdn_conv(y, weight, state, columns, *seg, mixed, channels=channels, stream=0, quads=False)
            results.append((y, mixed, state, columns))
        for name, got, want in zip(("y", "mixed", "state", "histories"), *results):
            np.testing.assert_array_equal(got, want, err_msg=f"{blocks} {name}")
        assert not np.isnan(results[0][1]).any()
        print("ok quant_mma_conv", "+".join(fmt for fmt, _ in blocks), rows, "rows", flush=True)


def _conv_case(rng, channels: int, lanes: int = 3):
    """The conv checks' inputs: a recording segment long enough for the 8-row fast path, a short one after it."""
    from ninfer.kernels_numba import gdn

    rows = gdn.CONV_FAST_MIN_ROWS + 14
    seg = (np.array([2, 0], np.int32), np.array([0, rows - 9], np.int32), np.array([rows - 9, 9], np.int32),
           np.array([1, 0], np.int32))
    projected = rng.standard_normal((rows, channels + 4)).astype(np.float32)
    weight = (rng.standard_normal((gdn.CONV_TAPS, channels)) * 0.5).astype(np.float32)
    state0 = rng.standard_normal((lanes, gdn.CONV_TAPS - 1, channels)).astype(np.float32)
    return rows, seg, projected, weight, state0, np.full((lanes, rows, gdn.CONV_TAPS - 1, channels), np.nan,
                                                        np.float32)


def _decode_conv_case(rng, channels: int):
    """Decode-shaped conv inputs: one segment a lane of 1, 2, 3 and 1 rows (a step, MTP verify rows), the 2- and
    3-row ones recording their histories."""
    from ninfer.kernels_numba import gdn

    counts = np.array([1, 2, 3, 1], np.int32)
    rows, lanes = int(counts.sum()), len(counts)
    seg = (np.array([3, 0, 2, 1], np.int32), np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32), counts,
           np.array([0, 1, 1, 0], np.int32))
    projected = rng.standard_normal((rows, channels + 4)).astype(np.float32)
    weight = (rng.standard_normal((gdn.CONV_TAPS, channels)) * 0.5).astype(np.float32)
    state0 = rng.standard_normal((lanes, gdn.CONV_TAPS - 1, channels)).astype(np.float32)
    return rows, seg, projected, weight, state0, np.full((lanes, 3, gdn.CONV_TAPS - 1, channels), np.nan,
                                                        np.float32)


def gdn_conv_quads() -> None:
    """The conv with 4 channels a thread against the scalar kernel, bit for bit (outputs, carried state, recorded
    histories), and the twin: a recording segment long enough for the 8-row fast path, a short one after it; then
    decode-shaped segments (`_decode_conv_case`)."""
    from ninfer.kernels_numba import gdn
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(gdn))
    channels = 8
    for case in (_conv_case, _decode_conv_case):
        _conv_quads_match(gdn, channels, *case(np.random.default_rng(8), channels))
    print("ok gdn_conv_quads", flush=True)


def _conv_quads_match(gdn, channels, rows, seg, projected, weight, state0, blank) -> None:
    results = []
    for quads in (False, True):
        state, columns = state0.copy(), blank.copy()
        out = np.full((rows, channels), np.nan, np.float32)
        gdn.gdn_conv(projected, weight, state, columns, *seg, out, channels=channels, stream=0, quads=quads)
        results.append((out, state, columns))
    for scalar, quads in zip(*results):
        np.testing.assert_array_equal(quads, scalar)
    state, columns = state0.copy(), blank.copy()
    want = np.full((rows, channels), np.nan, np.float32)
    gdn.gdn_conv_reference(projected, weight, state, columns, *seg, want, channels=channels)
    assert _rel(results[1][0], want) < 1e-6 and np.array_equal(results[1][1], state), _rel(results[1][0], want)
    recorded = ~np.isnan(columns)
    np.testing.assert_array_equal(np.isnan(results[1][2]), ~recorded)
    np.testing.assert_allclose(results[1][2][recorded], columns[recorded], rtol=0, atol=0)


def gdn_conv_normed() -> None:
    """The conv with q and k normalised in its pass against the 4-channel conv and then the gates (TF32), bit for
    bit (q, k, the v columns, carried state, recorded histories): fast-path rows, a recording segment's first rows
    and a short segment after it, as in gdn_conv_quads; one q, one k and one v head of 128 dims."""
    from ninfer.kernels_numba import gdn
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(gdn))
    k_dim = gdn.MAX_HEAD_DIM
    channels = 3 * k_dim
    rows, seg, projected, weight, state0, blank = _conv_case(np.random.default_rng(9), channels)
    results = []
    for fused in (False, True):
        state, columns = state0.copy(), blank.copy()
        out = np.full((rows, channels), np.nan, np.float32)
        q, k = (np.full((rows, 1, k_dim), np.nan, np.float32) for _ in range(2))
        if fused:
            gdn.gdn_conv_normed(projected, weight, state, columns, *seg, out, q, k, channels=channels, qk_heads=1,
                                k_dim=k_dim, stream=0)
        else:
            gdn.gdn_conv(projected, weight, state, columns, *seg, out, channels=channels, stream=0, quads=True)
            ab = np.zeros((rows, 2), np.float32)
            one = np.zeros(1, np.float32)
            gdn.gdn_gates(out, ab, one, one, q, k, np.zeros((rows, 1), np.float32), np.zeros((rows, 1), np.float32),
                          qk_heads=1, v_heads=1, k_dim=k_dim, stream=0, tf32=True)
        results.append((q, k, out[:, 2 * k_dim:], state, columns))
    for separate, fused in zip(*results):
        np.testing.assert_array_equal(fused, separate)
    print("ok gdn_conv_normed", flush=True)


def moe_group() -> None:
    """moe_group's block histogram and stable placement against the twin: rows over two blocks (a partial second),
    a crowded expert, and more experts than a block has threads (two passes of the offsets' scan)."""
    from ninfer.kernels_numba import moe
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(moe))
    rng = np.random.default_rng(5)
    for rows, experts, k in [(moe.GROUP_ROWS + 9, 6, 2), (7, moe.GROUP_THREADS + 4, 3)]:
        ids = np.sort(np.argsort(rng.random((rows, experts)), axis=1)[:, :k], axis=1).astype(np.int32)
        ids[: rows // 2, :] = np.arange(k, dtype=np.int32)  # a crowded expert
        blocks = -(-rows // moe.GROUP_ROWS)
        got = [np.full(experts, -1, np.int32), np.full(experts + 1, -1, np.int32), np.full(rows * k, -1, np.int32),
               np.full(rows * k, -1, np.int32)]
        moe.moe_group(ids, got[0], got[1], got[2], experts=experts, position_of=got[3],
                      block_counts=np.full((blocks + 1, experts), -1, np.int32), stream=0)
        for g, want in zip(got, moe.moe_group_reference(ids, experts)):
            np.testing.assert_array_equal(g, want)
        print("ok moe_group", rows, experts, k, flush=True)


def select_columns() -> None:
    """select_columns' grid (layers on z, picks on y, a grid-stride loop on x) against its twin, bit for bit: more
    elements than one pass of its blocks covers, a kept lane (-1) and an unlisted one; keep_segment_rows,
    gather_two_sources and copy_segments likewise."""
    from ninfer.kernels_numba import layout

    rng = np.random.default_rng(3)
    live = rng.standard_normal((2, 3, layout.SELECT_BLOCKS * layout.THREADS + 5)).astype(np.float32)
    columns = rng.standard_normal((2, 3, 2) + live.shape[2:]).astype(np.float32)
    lanes, chosen = np.array([2, 0], np.int32), np.array([1, -1], np.int32)
    got = live.copy()
    layout.select_columns(got, columns, lanes, chosen, stream=0)
    assert np.array_equal(got, layout.select_columns_reference(live, columns, lanes, chosen))
    print("ok select_columns", flush=True)
    # keep_segment_rows: one-row segments into tails, verify segments into their lanes' columns, a row wider than a
    # block's threads
    final = rng.standard_normal((5, layout.THREADS + 3)).astype(np.float32)
    segments = (np.array([1, 0, 2], np.int32), np.array([0, 1, 4], np.int32), np.array([1, 3, 1], np.int32))
    tails = np.full((3, final.shape[1]), np.nan, np.float32)
    kept = np.full((3, 3, final.shape[1]), np.nan, np.float32)
    want_tails, want_kept = tails.copy(), kept.copy()
    layout.keep_segment_rows(final, *segments, tails, kept, stream=0)
    layout.keep_segment_rows_reference(final, *segments, want_tails, want_kept)
    np.testing.assert_array_equal(tails, want_tails)
    np.testing.assert_array_equal(kept, want_kept)
    print("ok keep_segment_rows", flush=True)
    index = np.array([-3, 4, 0, -1], np.int32)  # gather_two_sources: tails (negative) and final rows
    out = np.full((4, final.shape[1]), np.nan, np.float32)
    layout.gather_two_sources(final, want_tails, index, out, stream=0)
    np.testing.assert_array_equal(out, layout.gather_two_sources_reference(final, want_tails, index))
    print("ok gather_two_sources", flush=True)
    slots, want_slots = kept.copy(), kept.copy()  # copy_segments: every segment into its lane's slots
    layout.copy_segments(final, *segments, slots, stream=0)
    layout.copy_segments_reference(final, *segments, want_slots)
    np.testing.assert_array_equal(slots, want_slots)
    print("ok copy_segments", flush=True)


def sample_candidates_case(rng: np.random.Generator, rows: int, vocab: int) -> tuple:
    """Candidates and sampling parameters for `sample_candidates`: rows of every kind (greedy, plain, top_k under
    20, min_p and top_p cuts, penalties counted, a vocabulary under 20 that pads ids with -1), one row a lane."""
    from ninfer.engine.sampler import TOP_K_CAP, Purpose, effective_top_k
    from ninfer.kernels_numba.sampling import SAMPLE_FIELDS, sample_parameters

    ids = np.full((rows, TOP_K_CAP), -1, np.int32)
    values = np.full((rows, TOP_K_CAP), -np.inf, np.float32)
    real = min(vocab, TOP_K_CAP)
    for r in range(rows):
        ids[r, :real] = rng.permutation(vocab)[:real]
        values[r, :real] = np.sort(rng.standard_normal(real).astype(np.float32) * 3)[::-1]
    params = np.zeros((len(SAMPLE_FIELDS), rows), np.int32)
    settings = [None, (1.0, 0, 1.0, 0.0, False), (0.6, 5, 0.95, 0.0, True), (0.7, 20, 0.8, 0.05, True),
                (1.3, 0, 0.5, 0.2, False), (0.2, 3, 1.0, 0.9, True)]
    for r in range(rows):
        setting = settings[r % len(settings)]
        if setting is None:  # a greedy row: out keeps its argmax
            continue
        temperature, top_k, top_p, min_p, counted = setting
        fields = sample_parameters(temperature=temperature, top_k=effective_top_k(top_k), top_p=top_p, min_p=min_p,
                                   seed=int(rng.integers(0, 2**63)) * 2 + r, position=int(rng.integers(0, 2**32)),
                                   purpose=Purpose.DECODE if r % 2 else Purpose.PREFILL, counted=counted)
        params[:, r] = [fields[name] for name in SAMPLE_FIELDS]
    return ids, values, params, np.arange(rows, dtype=np.int32)


def sample_candidates() -> None:
    """The sampler's last steps on the device (a thread a row) equal the host sampler's own functions bit for bit:
    tokens, greedy rows untouched, penalty counts of the counted rows; over many seeds and parameter mixes."""
    from ninfer.kernels_numba import sampling
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(sampling))
    rng = np.random.default_rng(0)
    for rows, vocab in ((12, 500), (6, 7)):
        for _ in range(3):
            ids, values, params, row_lane = sample_candidates_case(rng, rows, vocab)
            out, counts = np.full(rows, -7, np.int32), np.zeros((rows, vocab), np.int32)
            sampling.sample_candidates(ids, values, params, row_lane, counts, out, stream=0)
            want_out, want_counts = np.full(rows, -7, np.int32), np.zeros((rows, vocab), np.int32)
            sampling.sample_candidates_reference(ids, values, params, row_lane, want_counts, want_out)
            np.testing.assert_array_equal(out, want_out)
            np.testing.assert_array_equal(counts, want_counts)
        print("ok sample_candidates", rows, vocab, flush=True)


def verify_counts() -> None:
    """Each verify row's penalty counts (its lane's, plus its segment's drafts before it) equal the twin: segments of
    1, 4 and 16 rows (DFlash's longest), repeated drafts, a draft counted twice in a later column."""
    from ninfer.kernels_numba import sampling
    from tests.support import cuda_simulator

    cuda_simulator.install(vars(sampling))
    rng = np.random.default_rng(3)
    vocab = 2100  # two blocks, the second partial
    seg_count = np.array([1, 4, 16], np.int32)
    seg_row = np.array([0, 1, 5], np.int32)
    rows = int(seg_count.sum())
    row_lane = np.repeat(np.array([2, 0, 1], np.int32), seg_count)
    token_ids = rng.integers(0, 40, rows).astype(np.int32)
    token_ids[3] = token_ids[2]  # the same draft twice in one round
    counts = rng.integers(0, 3, (3, vocab)).astype(np.int32)
    out = np.full((rows, vocab), -1, np.int32)
    sampling.verify_counts(counts, row_lane, token_ids, seg_row, seg_count, out, vocab_ids=vocab, stream=0)
    want = sampling.verify_counts_reference(counts, row_lane, token_ids, seg_row, seg_count, rows=rows,
                                            vocab_ids=vocab)
    np.testing.assert_array_equal(out, want)
    assert (want[4] - counts[0]).sum() == 3 and (want[20] - counts[1]).sum() == 15
    print("ok verify_counts", flush=True)


CHECKS = {"linear": linear, "linear_mma": linear_mma, "linear_narrow": linear_narrow, "flash_prefill": flash_prefill,
          "gather_kv": gather_kv,
          "gdn_chunked": gdn_chunked, "gdn_recurrent_gated": gdn_recurrent_gated,
          "gdn_recurrent_projected": gdn_recurrent_projected, "quant_mma": quant_mma,
          "quant_mma_swiglu": quant_mma_swiglu, "quant_mma_chunked": quant_mma_chunked, "elementwise": elementwise,
          "attention_prepare": attention_prepare,
          "attention_decode": attention_decode, "attention_decode_staged": attention_decode_staged,
          "attention_decode_mma": attention_decode_mma,
          "moe_combine_norm": moe_combine_norm, "moe_route": moe_route, "gdn_output": gdn_output,
          "moe_padded": moe_padded, "moe_layout": moe_layout, "moe_group": moe_group,
          "gdn_conv_quads": gdn_conv_quads, "gdn_conv_normed": gdn_conv_normed, "quant_mma_conv": quant_mma_conv,
          "select_columns": select_columns, "sample_candidates": sample_candidates,
          "verify_counts": verify_counts}

if __name__ == "__main__":
    for name in sys.argv[1:]:
        CHECKS[name]()
    print("SIMULATOR OK")
