"""MTP speculative decoding: the §4.7 accept rules, and the engine with --spec mtp on the tiny model (greedy output
identical to plain decoding for k = 1..5, exact commits when a stop cuts a round, counters)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.backends.cpu.runner import build_cpu_runner
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import FinishReason, PreparedPrompt, RequestOptions, StopTokenPolicy
from ninfer.engine.sampler import Purpose, Sampler, SamplingOverrides, SamplingParams, uniform
from ninfer.engine.speculative import SpeculativeCounters, verify_drafts
from ninfer.targets.registry import QWEN_27B_PRESETS
from tests.test_runner_cpu import tiny_qwen

VOCAB = 50


def columns(*rows: dict[int, float]) -> np.ndarray:
    """Verify logits: one row per column, -10 everywhere except the given ids."""
    logits = np.full((len(rows), VOCAB), -10.0, np.float32)
    for row, values in zip(logits, rows):
        for token, value in values.items():
            row[token] = value
    return logits


# ---- accept rules ----

def test_greedy_accepts_while_drafts_are_the_argmax_then_corrects_or_adds_the_bonus():
    logits = columns({3: 1.0}, {4: 1.0}, {5: 1.0}, {6: 1.0})
    sampler = Sampler(SamplingParams.greedy(), VOCAB)
    assert verify_drafts(logits, np.array([3, 4, 5]), sampler, 10) == (3, [3, 4, 5, 6])
    assert verify_drafts(logits, np.array([3, 9, 5]), sampler, 10) == (1, [3, 4])
    assert verify_drafts(logits, np.array([8, 4, 5]), sampler, 10) == (0, [3])


def test_sampled_rules_certain_and_impossible_drafts():
    params = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, presence_penalty=0.0, seed=3)
    logits = columns({3: 1.0, 7: 0.9}, {4: 1.0}, {5: 1.0})
    # top_k = 1: the argmax has probability 1 and is always accepted; anything else has probability 0.
    assert verify_drafts(logits, np.array([3, 4]), Sampler(params, VOCAB), 0) == (2, [3, 4, 5])
    accepted, tokens = verify_drafts(logits, np.array([7, 4]), Sampler(params, VOCAB), 0)
    assert (accepted, tokens) == (0, [3])


def test_sampled_acceptance_preserves_the_target_distribution():
    """P(first token = j) must be p_0(j) whatever the draft: accepted with p(draft), else drawn without it."""
    logits = columns({1: 2.0, 2: 1.5, 3: 1.0, 4: 0.2}, {5: 1.0})
    target = None
    counts = np.zeros(VOCAB)
    trials = 4000
    for seed in range(trials):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0, seed=seed),
                          VOCAB)
        if target is None:
            ids, weights = sampler.candidates(logits[0])
            target = np.zeros(VOCAB)
            target[ids] = weights / weights.sum()
        _, tokens = verify_drafts(logits, np.array([2]), sampler, 100)
        counts[tokens[0]] += 1
    assert np.max(np.abs(counts / trials - target)) < 0.025


def test_rng_is_keyed_by_round_position_and_purpose():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0, seed=9)
    logits = columns({1: 1.0, 2: 1.0}, {1: 1.0, 2: 1.0}, {1: 1.0, 2: 1.0})
    sampler = Sampler(params, VOCAB)
    accepted, tokens = verify_drafts(logits, np.array([1, 1]), sampler, 20)
    # Column 0 accepts draft 1 (p = 1/2) exactly when U(seed, L+1, accept) < 1/2; replaying is deterministic.
    assert (accepted >= 1) == (uniform(9, 21, Purpose.SPECULATIVE_ACCEPT) < 0.5)
    assert verify_drafts(logits, np.array([1, 1]), Sampler(params, VOCAB), 20) == (accepted, tokens)


def test_accepted_drafts_count_for_the_penalties_of_later_columns():
    # Token 3 leads column 1 by 0.5; a presence penalty of 2 makes it lose once column 0 accepted draft 3.
    params = SamplingParams(temperature=0.01, top_k=0, top_p=1.0, presence_penalty=2.0, seed=1)
    logits = columns({3: 5.0}, {3: 1.5, 4: 1.0}, {6: 1.0})
    _, tokens = verify_drafts(logits, np.array([3, 3]), Sampler(params, VOCAB), 0)
    assert tokens[:2] == [3, 4]


def test_counters():
    counters = SpeculativeCounters(3)
    counters.record_round(2)
    counters.record_round(3)
    counters.record_fallback()
    assert (counters.rounds, counters.drafted_tokens, counters.accepted_tokens, counters.fallback_steps) == (2, 6, 5, 1)
    assert counters.accepted_per_position == [2, 2, 1]
    assert counters.acceptance_rate == pytest.approx(5 / 6) and counters.tokens_per_round == 3.5


# ---- the engine ----

def engine(model, *, draft_tokens: int = 0, lm_head_draft: bool = False, concurrency: int = 4,
           greedy: bool = True) -> Engine:
    config = EngineConfig(max_concurrency=concurrency, max_context=512, prefill_chunk=128, greedy=greedy,
                          kv_capacity=concurrency * 512, spec="mtp" if draft_tokens else None,
                          draft_tokens=draft_tokens, lm_head_draft=lm_head_draft)
    return Engine(build_cpu_runner(model, config), config, QWEN_27B_PRESETS).start()


def work(count: int) -> list[tuple[PreparedPrompt, RequestOptions]]:
    rng = np.random.default_rng(5)
    return [(PreparedPrompt(token_ids=rng.integers(0, 500, int(rng.integers(10, 200)))),
             RequestOptions(max_tokens=int(rng.integers(2, 40)))) for _ in range(count)]


def run(eng: Engine, items) -> list:
    with eng:
        handles = [eng.submit(prompt, options) for prompt, options in items]
        return [h.result(timeout=120) for h in handles]


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return tiny_qwen(moe=request.param == "moe", predictable=True)


@pytest.fixture(scope="module")
def plain_tokens(model):
    return [r.tokens for r in run(engine(model), work(6))]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_mtp_is_token_identical_to_plain_greedy(model, plain_tokens, k):
    results = run(engine(model, draft_tokens=k, lm_head_draft=k == 3), work(6))
    assert [r.tokens for r in results] == plain_tokens
    assert_speculative_counters_add_up(results, k)


def assert_speculative_counters_add_up(results, k: int) -> None:
    """Every result's counters: k drafts a round, one token from every round, accepted draft and fallback step but
    the first (prefill) one; some drafts accepted over all."""
    counters = [r.usage.speculative for r in results]
    for result, c in zip(results, counters):
        assert c.draft_window == k and c.drafted_tokens == k * c.rounds
        assert c.rounds + c.accepted_tokens + c.fallback_steps == result.usage.completion_tokens - 1
    assert sum(c.accepted_tokens for c in counters) > 0


def stop_inside_a_round_then_continue(eng: Engine, plain_tokens, options: RequestOptions):
    """On a speculative engine: stop the longest work prompt at the first stop token that falls inside a verify
    round, check the exact commit, then send the next turn; returns (the follow-up prompt, its result), which reused
    the whole committed sequence."""
    longest = int(np.argmax([len(t) for t in plain_tokens]))
    first_prompt, tokens = work(6)[longest][0], plain_tokens[longest]
    for cut in range(3, len(tokens)):  # the first stop position that falls inside a verify round
        if tokens[cut] in tokens[:cut]:
            continue
        first = eng.submit(first_prompt, options, StopTokenPolicy({tokens[cut]})).result(60)
        c = first.usage.speculative
        if c.rounds + c.accepted_tokens + c.fallback_steps > len(first.tokens) - 1:  # produced more than kept
            break
    else:
        pytest.fail("no stop position fell inside a round")
    assert first.finish is FinishReason.STOP_TOKEN and first.tokens == tokens[: cut + 1]
    follow = PreparedPrompt(token_ids=np.concatenate([first_prompt.token_ids, first.tokens, [7, 8, 9]]))
    second = eng.submit(follow, options).result(60)
    assert second.usage.reuse_path == "append_frontier"
    assert second.usage.cached_tokens == len(first_prompt) + len(first.tokens) - 1
    return follow, second


def test_a_stop_inside_a_round_commits_exactly_and_the_next_turn_reuses_it(model, plain_tokens):
    options = RequestOptions(max_tokens=40)
    with engine(model, draft_tokens=4, concurrency=1) as eng:
        follow, second = stop_inside_a_round_then_continue(eng, plain_tokens, options)
    with engine(model, concurrency=1) as eng:
        assert eng.submit(follow, options).result(60).tokens == second.tokens


def assert_sampled_output_does_not_depend_on_the_batch(make_engine, prompts: int) -> None:
    """Seeded sampled requests of the first `prompts` work prompts: the tokens and speculative counters of a batched
    run equal those of each request alone. make_engine(concurrency) builds the speculative sampling engine."""
    sampled = RequestOptions(max_tokens=24, sampling=SamplingOverrides(temperature=0.8, seed=77))
    items = [(prompt, sampled) for prompt, _ in work(prompts)]
    batched = run(make_engine(4), items)
    alone = [run(make_engine(1), [item])[0] for item in items]
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.usage.speculative for r in batched] == [r.usage.speculative for r in alone]


def test_sampled_mtp_output_does_not_depend_on_the_batch(model):
    assert_sampled_output_does_not_depend_on_the_batch(
        lambda concurrency: engine(model, draft_tokens=3, concurrency=concurrency, greedy=False), 5)
