"""The §4.8 sampling pipeline and its counter-based RNG."""

import math

import numpy as np
import pytest

from ninfer.engine.sampler import (Purpose, Sampler, SamplingParams, SamplingParamsError, splitmix64,
                                   top_candidates, uniform)


def test_splitmix64_matches_the_published_sequence():
    # SplitMix64 seeded with 0: the first two outputs of the reference generator.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_uniform_is_24_bit_deterministic_and_keyed_by_every_input():
    u = uniform(7, 100, Purpose.DECODE)
    assert u == uniform(7, 100, Purpose.DECODE)
    assert 0.0 <= u < 1.0 and (u * (1 << 24)).is_integer()
    others = {uniform(8, 100, Purpose.DECODE), uniform(7, 101, Purpose.DECODE), uniform(7, 100, Purpose.BONUS)}
    assert u not in others
    # Only the low 32 bits of the position take part.
    assert uniform(7, 5, Purpose.DECODE) == uniform(7, 5 + (1 << 32), Purpose.DECODE)


def test_uniform_is_close_to_uniform():
    draws = np.array([uniform(123, p, Purpose.DECODE) for p in range(20000)])
    assert abs(draws.mean() - 0.5) < 0.01
    assert abs(np.mean(draws < 0.1) - 0.1) < 0.01


def test_greedy_takes_the_lowest_id_among_equal_maxima_and_ignores_padding_rows():
    logits = np.array([0.0, 3.0, 1.0, 3.0, 9.0], dtype=np.float32)
    sampler = Sampler(SamplingParams.greedy(), vocab_ids=4)  # row 4 is a padding row
    assert sampler.sample(logits, 0, Purpose.DECODE) == 1


def test_top_candidates_order_ties_by_id():
    logits = np.array([1.0, 5.0, 5.0, 2.0, 5.0, 0.0], dtype=np.float32)
    assert top_candidates(logits, 4).tolist() == [1, 2, 4, 3]
    assert top_candidates(logits, 2).tolist() == [1, 2]


def test_never_samples_outside_the_top_20_even_when_top_k_is_off():
    logits = np.zeros(100, dtype=np.float32)
    logits[:30] = np.linspace(1.0, 0.9, 30)  # 30 nearly equal leaders
    for top_k in (0, 50):
        sampler = Sampler(SamplingParams(temperature=2.0, top_k=top_k, top_p=1.0, presence_penalty=0.0), 100)
        picks = {sampler.sample(logits, p, Purpose.DECODE) for p in range(3000)}
        assert picks <= set(range(20)) and len(picks) == 20


def test_min_p_cuts_at_the_first_weight_below_its_fraction_of_the_best():
    logits = np.log(np.array([1.0, 0.5, 0.2, 0.1], dtype=np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1.0, min_p=0.3, presence_penalty=0.0), 4)
    picks = {sampler.sample(logits, p, Purpose.DECODE) for p in range(2000)}
    assert picks == {0, 1}


def test_top_p_keeps_the_shortest_prefix_reaching_the_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32)
    logits = np.log(probs)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.8, presence_penalty=0.0), 4)
    counts = np.bincount([sampler.sample(logits, p, Purpose.DECODE) for p in range(8000)], minlength=4)
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / counts.sum() - 0.5 / 0.8) < 0.02


def test_sampled_frequencies_follow_the_tempered_distribution():
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    t = 0.7
    expected = np.exp(logits / t) / np.exp(logits / t).sum()
    sampler = Sampler(SamplingParams(temperature=t, top_p=1.0, presence_penalty=0.0), 4)
    counts = np.bincount([sampler.sample(logits, p, Purpose.DECODE) for p in range(20000)], minlength=4)
    assert np.allclose(counts / counts.sum(), expected, atol=0.015)


def test_penalties_count_only_generated_tokens():
    logits = np.array([1.0, 0.9, -5.0], dtype=np.float32)
    params = SamplingParams(temperature=0.05, top_p=1.0, presence_penalty=2.0, frequency_penalty=0.0, seed=3)
    sampler = Sampler(params, 3)
    first = sampler.sample(logits, 0, Purpose.PREFILL)
    assert first == 0
    # Token 0 now carries the presence penalty, so token 1 leads by a wide margin at this temperature.
    assert sampler.sample(logits, 1, Purpose.DECODE) == 1


def test_same_seed_same_tokens_other_seed_other_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=500).astype(np.float32)

    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed, presence_penalty=0.0), 500)
        return [s.sample(logits, p, Purpose.DECODE) for p in range(50)]

    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.parametrize("field,value", [("temperature", 2.5), ("temperature", math.nan), ("top_p", 1.5),
                                         ("min_p", -0.1), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
                                         ("top_k", -1), ("seed", -1), ("seed", 1 << 64)])
def test_out_of_range_parameters_are_rejected_by_name(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("top_k", [0, 1, 5, 20, 50])
def test_sampling_from_the_top_twenty_equals_sampling_from_the_logits(top_k):
    """The CUDA runner hands the sampler the 20 best penalised candidates; every draw must equal the full path."""
    from ninfer.engine.sampler import TOP_K_CAP, top_candidates

    rng = np.random.default_rng(top_k)
    for trial in range(40):
        params = SamplingParams(temperature=float(rng.uniform(0.2, 1.5)), top_k=top_k,
                                top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05])),
                                presence_penalty=float(rng.choice([0.0, 0.7])),
                                frequency_penalty=float(rng.choice([0.0, 0.3])), seed=trial)
        full, top = Sampler(params, 300), Sampler(params, 300)
        for position in range(6):
            logits = rng.standard_normal(310).astype(np.float32) * 3
            logits[rng.integers(0, 300, 5)] = logits[:300].max()  # ties at the top
            x = logits[:300] - np.float32(params.presence_penalty) * (top._counts > 0) \
                - np.float32(params.frequency_penalty) * top._counts
            x = x.astype(np.float32)
            ids = top_candidates(x, TOP_K_CAP)
            want = full.sample(logits, position, Purpose.DECODE)
            assert top.sample_top(ids, x[ids], position, Purpose.DECODE) == want
