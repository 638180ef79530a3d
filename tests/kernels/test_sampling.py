"""sampling.py: twins vs engine/sampler.py (argmax ties, candidates with ties and penalties, the draw over the
candidates), the draw in the CUDA simulator, GPU parity (gpu)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.engine.sampler import TOP_K_CAP, Sampler, SamplingParams  # noqa: E402
from ninfer.kernels_numba import sampling  # noqa: E402

VOCAB_IDS, WIDTH = 248077, 248320


def _logits(rng, rows, width, *, ties=True):
    x = (rng.standard_normal((rows, width)) * 3).astype(np.float32)
    if ties:
        x = np.round(x * 4) / 4  # many exact ties
        x[:, 5] = x.max() + 1  # ... and among the very best
        x[:, 17] = x.max()
        x[:, min(100, width - 1)] = x.max()
    return x.astype(np.float32)


def _counts(rng, lanes, width):
    counts = np.zeros((lanes, width), dtype=np.int32)
    hot = rng.integers(0, width, (lanes, 60))
    for lane in range(lanes):
        np.add.at(counts[lane], hot[lane], rng.integers(1, 4, 60))
    counts[:, 5] = 3  # penalise a best one
    return counts


# ------------------------------------------------------------------------------------------------ CPU


def test_the_draws_twin_is_the_host_sampler_draw_for_draw():
    """sample_candidates' twin picks what Sampler.sample_top picks from the same candidates (so the device draw,
    bitwise its twin, serves the runner's sampled rows as the host sampler did), and counts what it counts."""
    from ninfer.engine.sampler import Purpose, effective_top_k
    from tests.support.simulated_kernels import sample_candidates_case

    rng = np.random.default_rng(7)
    agreed = 0
    for _ in range(40):
        ids, values, params, row_lane = sample_candidates_case(rng, 12, 500)
        out, counts = np.full(12, -1, np.int32), np.zeros((12, 500), np.int32)
        sampling.sample_candidates_reference(ids, values, params, row_lane, counts, out)
        for r in range(12):
            field = dict(zip(sampling.SAMPLE_FIELDS, params[:, r].tolist()))
            flags = field["sample_flags"]
            if not flags & sampling.SAMPLED:
                assert out[r] == -1  # greedy rows are left to the argmax
                continue
            temperature, top_p, min_p = np.array([field["temperature"], field["top_p"], field["min_p"]],
                                                 np.int32).view(np.float32).tolist()
            top_k = field["top_k"]
            params_r = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                      presence_penalty=1.0 if flags & sampling.COUNTED else 0.0,
                                      seed=(field["seed_high"] & 0xFFFFFFFF) << 32 | (field["seed_low"] & 0xFFFFFFFF))
            assert effective_top_k(top_k) == top_k
            sampler = Sampler(params_r, 500)
            token = sampler.sample_top(ids[r], values[r], field["sample_position"] & 0xFFFFFFFF,
                                       Purpose((flags >> 8) & 0xFF))
            assert out[r] == token
            assert counts[r].sum() == (1 if flags & sampling.COUNTED else 0)
            agreed += 1
    assert agreed == 40 * 10


def test_verify_row_counts_in_cuda_simulator():
    """Each verify row's penalty counts (its lane's plus its segment's drafts before it) equal the twin in numba's
    CUDA simulator (`simulated_kernels.verify_counts`)."""
    from tests.support.simulated_kernels import run

    assert "ok verify_counts" in run("verify_counts").splitlines()


def test_the_draw_in_cuda_simulator():
    """The device draw (a thread a row) equals its twin bit for bit in numba's CUDA simulator
    (`simulated_kernels.sample_candidates`)."""
    from tests.support.simulated_kernels import run

    assert [line for line in run("sample_candidates").splitlines() if line.startswith("ok sample")] == [
        "ok sample_candidates 12 500", "ok sample_candidates 6 7"]


@pytest.mark.parametrize("rows,width,vocab", [(1, 64, 50), (3, 1000, 1000), (2, 5000, 4097)])
def test_argmax_reference_matches_sampler(rows, width, vocab):
    rng = np.random.default_rng(rows)
    x = _logits(rng, rows, width)
    x[0, vocab:] = 1e9  # beyond vocab_ids: ignored
    sampler = Sampler(SamplingParams.greedy(), vocab)
    got = sampling.argmax_rows_reference(x, vocab)
    assert [int(v) for v in got] == [sampler.argmax(x[r]) for r in range(rows)]


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.0), (1.5, 0.0), (0.0, 0.7), (-1.0, 0.3), (0.25, -2.0)])
def test_top_candidates_reference_matches_sampler(presence, frequency):
    rng = np.random.default_rng(7)
    rows, width, vocab = 3, 3000, 2900
    x = _logits(rng, rows, width)
    counts = _counts(rng, 2, vocab)
    row_lane = np.array([1, 0, 1], dtype=np.int32)
    pres = np.full(rows, presence, dtype=np.float32)
    freq = np.full(rows, frequency, dtype=np.float32)
    ids, values = sampling.top_candidates_rows_reference(x, vocab, counts, row_lane, pres, freq)
    for r in range(rows):
        s = Sampler(SamplingParams(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0, presence_penalty=presence,
                                   frequency_penalty=frequency), vocab)
        s._counts[:] = counts[row_lane[r]]
        want_ids, _ = s.candidates(x[r])
        np.testing.assert_array_equal(ids[r], want_ids)
        pen = sampling.penalised_row(x[r, :vocab], counts[row_lane[r]], presence, frequency)
        np.testing.assert_array_equal(values[r], pen[want_ids])
        assert np.all(np.diff(values[r]) <= 0)


def test_top_candidates_reference_small_vocab():
    x = np.arange(12, dtype=np.float32)[None, :]
    ids, values = sampling.top_candidates_rows_reference(x, 7, np.zeros((1, 7), np.int32), np.zeros(1, np.int32),
                                                         np.zeros(1, np.float32), np.zeros(1, np.float32))
    np.testing.assert_array_equal(ids[0, :7], np.arange(6, -1, -1))
    assert np.all(ids[0, 7:] == -1) and np.all(np.isneginf(values[0, 7:]))


def test_count_tokens_reference():
    counts = np.zeros((3, 10), dtype=np.int32)
    out = sampling.count_tokens_reference(counts, [0, 2, 2, 1], [4, 9, 9, 1], [1, 1, 1, 0])
    assert out[0, 4] == 1 and out[2, 9] == 2 and out.sum() == 3


# ------------------------------------------------------------------------------------------------ GPU


def _cuda():
    from ninfer.kernels_numba.numba_setup import cuda
    return cuda


def _argmax_gpu(x, vocab, stream):
    cuda = _cuda()
    d_out = cuda.to_device(np.full(x.shape[0], -5, np.int32), stream=stream)
    sampling.argmax_rows(cuda.to_device(x, stream=stream), vocab, d_out, stream=stream,
                         scratch=sampling.sampling_scratch(x.shape[0], vocab))
    out = d_out.copy_to_host(stream=stream)
    stream.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,vocab", [(1, WIDTH, VOCAB_IDS), (8, WIDTH, VOCAB_IDS), (48, 4096, 4096),
                                              (3, 1000, 999), (5, 64, 13)])
def test_gpu_argmax_rows(rows, width, vocab):
    stream = _cuda().stream()
    rng = np.random.default_rng(21)
    x = _logits(rng, rows, width)
    x[:, vocab:] = 1e30
    if rows > 2:
        x[1, :] = -np.inf
        x[2, vocab - 1] = 1e20
    out = _argmax_gpu(x, vocab, stream)
    np.testing.assert_array_equal(out, sampling.argmax_rows_reference(x, vocab))
    for r in {0, rows - 1}:
        np.testing.assert_array_equal(_argmax_gpu(x[r:r + 1].copy(), vocab, stream)[0], out[r])


def _top_gpu(x, vocab, counts, row_lane, pres, freq, stream, scratch=None):
    cuda = _cuda()
    rows = x.shape[0]
    d_ids = cuda.to_device(np.full((rows, TOP_K_CAP), -5, np.int32), stream=stream)
    d_val = cuda.to_device(np.full((rows, TOP_K_CAP), np.nan, np.float32), stream=stream)
    sampling.top_candidates_rows(*[cuda.to_device(a, stream=stream) for a in (x,)], vocab,
                                 *[cuda.to_device(a, stream=stream) for a in (counts, row_lane, pres, freq)],
                                 d_ids, d_val, stream=stream, scratch=scratch)
    ids, vals = d_ids.copy_to_host(stream=stream), d_val.copy_to_host(stream=stream)
    stream.synchronize()
    return ids, vals


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,vocab", [(1, WIDTH, VOCAB_IDS), (8, WIDTH, VOCAB_IDS), (48, 5000, 4999),
                                              (3, 64, 13)])
def test_gpu_top_candidates_rows(rows, width, vocab):
    stream = _cuda().stream()
    rng = np.random.default_rng(22)
    x = _logits(rng, rows, width)
    counts = _counts(rng, 4, vocab)
    row_lane = rng.integers(0, 4, rows).astype(np.int32)
    pres = rng.choice([0.0, 1.0, -0.5, 1.5], rows).astype(np.float32)
    freq = rng.choice([0.0, 0.3, -1.0], rows).astype(np.float32)
    ids, vals = _top_gpu(x, vocab, counts, row_lane, pres, freq, stream)  # default (cached) scratch
    want_ids, want_vals = sampling.top_candidates_rows_reference(x, vocab, counts, row_lane, pres, freq)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(vals, want_vals)
    for r in {0, rows - 1}:
        one = _top_gpu(x[r:r + 1].copy(), vocab, counts, row_lane[r:r + 1].copy(), pres[r:r + 1].copy(),
                       freq[r:r + 1].copy(), stream, scratch=sampling.sampling_scratch(1, vocab))
        np.testing.assert_array_equal(one[0][0], ids[r])
        np.testing.assert_array_equal(one[1][0], vals[r])


@pytest.mark.gpu
@pytest.mark.parametrize("valid_dtype", [np.int32, np.uint8])
def test_gpu_count_tokens(valid_dtype):
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(23)
    counts = rng.integers(0, 3, (4, 1000)).astype(np.int32)
    lanes = rng.integers(0, 4, 300).astype(np.int32)
    tokens = rng.integers(0, 20, 300).astype(np.int32)  # many duplicates
    valid = (rng.random(300) < 0.7).astype(valid_dtype)
    d = cuda.to_device(counts, stream=stream)
    sampling.count_tokens(d, *[cuda.to_device(a, stream=stream) for a in (lanes, tokens, valid)], stream=stream)
    got = d.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(got, sampling.count_tokens_reference(counts, lanes, tokens, valid))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(12, 500), (64, VOCAB_IDS), (6, 7)])
def test_gpu_sample_candidates(rows, vocab):
    """The device draw equals its twin (the host sampler's functions) bit for bit over many seeds and parameter
    mixes: each weight's exp in float64 rounded once to fp32 on both sides (a double rounding could split them
    about once in 10^8 weights)."""
    from tests.support.simulated_kernels import sample_candidates_case

    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(rows)
    for _ in range(20):
        ids, values, params, row_lane = sample_candidates_case(rng, rows, vocab)
        counts = np.zeros((rows, vocab), np.int32)
        out = np.full(rows, -7, np.int32)
        d_counts, d_out = cuda.to_device(counts, stream=stream), cuda.to_device(out, stream=stream)
        sampling.sample_candidates(*[cuda.to_device(a, stream=stream) for a in (ids, values, params, row_lane)],
                                   d_counts, d_out, stream=stream)
        got_out, got_counts = d_out.copy_to_host(stream=stream), d_counts.copy_to_host(stream=stream)
        stream.synchronize()
        sampling.sample_candidates_reference(ids, values, params, row_lane, counts, out)
        np.testing.assert_array_equal(got_out, out)
        np.testing.assert_array_equal(got_counts, counts)


@pytest.mark.gpu
def test_gpu_verify_counts():
    """Each verify row's penalty counts at the real vocabulary: its lane's counts plus its segment's drafts before
    it (segments of 1, 4 and 16 rows), equal to the twin."""
    cuda = _cuda()
    stream = cuda.stream()
    rng = np.random.default_rng(31)
    seg_count = np.array([1, 4, 16], np.int32)
    seg_row = np.array([0, 1, 5], np.int32)
    rows = int(seg_count.sum())
    row_lane = np.repeat(np.array([2, 0, 1], np.int32), seg_count)
    token_ids = rng.integers(0, VOCAB_IDS, rows).astype(np.int32)
    token_ids[3] = token_ids[2]
    counts = _counts(rng, 3, VOCAB_IDS)
    out = cuda.device_array((rows, VOCAB_IDS), np.int32, stream=stream)
    sampling.verify_counts(*[cuda.to_device(a, stream=stream) for a in (counts, row_lane, token_ids, seg_row,
                                                                         seg_count)],
                           out, vocab_ids=VOCAB_IDS, stream=stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(got, sampling.verify_counts_reference(counts, row_lane, token_ids, seg_row,
                                                                        seg_count, rows=rows, vocab_ids=VOCAB_IDS))
