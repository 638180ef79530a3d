"""DFlash speculative decoding on the CPU runner and the engine (ninfer-facts §3.10, §4.1, §4.4, §4.6, §4.7), on
the tiny 35B-shaped model with a tiny drafter (`tests.support.tiny_dflash`):

* the drafter's proposals against a float64 transcription of §3.10 (context from committed positions only, cyclic
  sliding-window cache wrapped many times, full layer in pages, non-causal windowed block attention);
* the context after speculative rounds (multi-token commits, a stop cutting a round) is bitwise the context a
  fresh prefill of the same tokens builds;
* greedy output identical to plain greedy for every k = 1..15; sampled rounds follow the §4.7 rules and keep the
  target distribution; --lm-head-draft proposes shortlist ids only;
* exact commits when a stop cuts a round, prefix reuse (every path) and lane images with the DFlash state.
"""

from __future__ import annotations

import collections

import attrs
import numpy as np
import pytest

import ninfer.backends.cpu.runner as cpu_runner
from ninfer.backends.cpu.dflash import dflash_kv_bytes_per_token, dflash_lane_bytes
from ninfer.backends.cpu.ops import Segment
from ninfer.backends.cpu.paged_kv import kv_bytes_per_token
from ninfer.backends.cpu.runner import CpuRunner, build_cpu_runner, runner_state_bytes
from ninfer.engine.config import EngineConfig, EngineConfigError
from ninfer.engine.engine import Engine
from ninfer.engine.kv_pool import AUTO_HEADROOM_BYTES
from ninfer.engine.request import RequestOptions
from ninfer.engine.runner import DecodeBatch, SequenceStart, StateSource
from ninfer.engine.sampler import Sampler, SamplingParams
from ninfer.models.dflash import DFlashMismatchError
from ninfer.models.qwen3_6 import Qwen36Model
from ninfer.targets.registry import QWEN_35B_A3B_PRESETS
from tests.support.tiny_dflash import reference_block, tiny_dflash_dims, tiny_dflash_qwen
from tests.test_prefix_reuse import SCRIPT, run_chat
from tests.test_runner_cpu import Lane, decode_round, generate, prompt, text_positions, tiny_qwen
from tests.test_speculative import (assert_sampled_output_does_not_depend_on_the_batch,
                                    assert_speculative_counters_add_up, run, stop_inside_a_round_then_continue, work)


@pytest.fixture(scope="module")
def model() -> Qwen36Model:
    return tiny_dflash_qwen()


class DraftRows:
    """Records the drafter rows every proposal reads (the `d` given to the head), per call."""

    def __init__(self, model: Qwen36Model, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[np.ndarray] = []
        original = model.draft_ids

        def spy(d: np.ndarray, *, shortlist: bool) -> np.ndarray:
            self.calls.append(d.copy())
            return original(d, shortlist=shortlist)

        monkeypatch.setattr(model, "draft_ids", spy)


def dflash_runner(model, k: int, *, lanes: int = 1, lm_head_draft: bool = False) -> CpuRunner:
    return CpuRunner(model, lanes=lanes, pages=8 * lanes, draft_tokens=k, lm_head_draft=lm_head_draft, spec="dflash")


def engine(model, *, k: int = 0, lm_head_draft: bool = False, concurrency: int = 4, greedy: bool = True) -> Engine:
    config = EngineConfig(max_concurrency=concurrency, max_context=512, prefill_chunk=128, greedy=greedy,
                          kv_capacity=concurrency * 512, spec="dflash" if k else None, draft_tokens=k,
                          lm_head_draft=lm_head_draft)
    return Engine(build_cpu_runner(model, config), config, QWEN_35B_A3B_PRESETS).start()


def committed_features(model: Qwen36Model, ids: np.ndarray) -> np.ndarray:
    """The context features of a sequence, from the per-sequence model (fp32 KV, no pages)."""
    state = model.new_state()
    return model.forward_batch_features(ids, text_positions(0, len(ids)), [Segment(slice(0, len(ids)), state.layers)],
                                        model.dflash.dims.target_layer_ids)[1]


# ---- the drafter ----

def test_proposals_follow_the_drafter_transcribed_from_the_spec(monkeypatch):
    """A random drafter with an 8-slot sliding window over prompts chunked across the window: every round's mask rows
    match §3.10 computed from the committed tokens alone (bf16 caches: a few 1e-3)."""
    model, k = tiny_dflash_qwen(predictable=False, window=8), 3
    rows = DraftRows(model, monkeypatch)
    runner = dflash_runner(model, k)
    ids = prompt(6, 23)
    lane = Lane(runner, 0, ids, budget=14)
    lane.prefill(5, 13)
    rounds = 0
    while not lane.done:
        sequence = np.concatenate([ids, lane.tokens])
        frontier, speculative = lane.frontier, lane.drafts_ready
        calls = len(rows.calls)
        decode_round(runner, [lane])
        if speculative:
            expected = reference_block(model, committed_features(model, sequence[:frontier]),
                                       int(sequence[frontier]), k)
            np.testing.assert_allclose(rows.calls[calls], expected, atol=2e-2)
            rounds += 1
    assert rounds >= 8


def test_the_context_after_rounds_and_a_cut_round_is_the_prefilled_context(model, monkeypatch):
    """Multi-token commits, a stop that keeps one token of a round, ordinary steps: every later proposal reads
    bitwise the drafter rows a fresh lane computes after prefilling the same committed tokens."""
    k = 4
    rows = DraftRows(model, monkeypatch)
    runner = dflash_runner(model, k, lanes=2)
    ids = prompt(8, 40)
    lane = Lane(runner, 0, ids, budget=40)
    lane.prefill(16)
    seen, cut = [], False
    while not lane.done:
        frontier, speculative, calls = lane.frontier, lane.drafts_ready, len(rows.calls)
        before = len(lane.tokens)
        accepted = decode_round(runner, [lane])[0]
        if speculative:
            seen.append((frontier, np.concatenate([ids, lane.tokens])[: frontier + 1], rows.calls[calls]))
        if speculative and accepted and not cut:  # a stop inside the round keeps only its first token
            runner.rewind(0, 1)
            del lane.tokens[before + 1 :]
            lane.frontier, cut = frontier + 1, True
            lane.drafts_ready = lane.budget - len(lane.tokens) >= k + 1
    assert cut and len(seen) >= 6
    for frontier, sequence, drafted in seen:
        fresh = Lane(runner, 1, sequence[:frontier], budget=k + 2)
        fresh.prefill(frontier)
        calls = len(rows.calls)
        runner.decode(DecodeBatch(lanes=[1], input_tokens=[sequence[frontier]], kv_lengths=[frontier],
                                  positions=[frontier], speculative=[True], remaining=[k + 1]))
        np.testing.assert_array_equal(rows.calls[calls], drafted)


def test_a_drafter_must_fit_its_target():
    dense, moe = tiny_qwen(), tiny_qwen(moe=True)
    weights = tiny_dflash_qwen()._weights
    with pytest.raises(DFlashMismatchError, match="35B-A3B"):
        Qwen36Model(dense.dims, dense._weights, dflash=tiny_dflash_dims(moe.dims))
    with pytest.raises(DFlashMismatchError, match="target_layer_ids"):
        Qwen36Model(moe.dims, weights, dflash=attrs.evolve(tiny_dflash_dims(moe.dims), target_layer_ids=(1, 4)))
    with pytest.raises(ValueError, match="at most 15"):
        dflash_runner(tiny_dflash_qwen(), 16)
    with pytest.raises(ValueError, match="DFlash drafter"):
        CpuRunner(moe, lanes=1, pages=4, draft_tokens=3, spec="dflash")
    with pytest.raises(EngineConfigError, match="1..15"):
        EngineConfig(spec="dflash", draft_tokens=16)


# ---- greedy, sampled, shortlist ----

@pytest.fixture(scope="module")
def plain_tokens(model):
    return [r.tokens for r in run(engine(model), work(6))]


@pytest.mark.parametrize("k", [1, 4, 15])
def test_greedy_dflash_is_token_identical_to_plain_greedy(model, plain_tokens, k):
    results = run(engine(model, k=k, lm_head_draft=k == 4), work(6))
    assert [r.tokens for r in results] == plain_tokens
    assert_speculative_counters_add_up(results, k)


def test_every_draft_window_keeps_greedy_output(model):
    plain = CpuRunner(model, lanes=1, pages=8)
    expected = generate(plain, Lane(plain, 0, prompt(6, 60), budget=30))
    for k in range(1, 16):
        runner = dflash_runner(model, k)
        assert generate(runner, Lane(runner, 0, prompt(6, 60), budget=30)) == expected, k


def test_sampled_rounds_apply_the_accept_rules_to_the_drafters_proposals(model, monkeypatch):
    rounds = []
    original = cpu_runner.verify_drafts

    def spy(logits, drafts, sampler, base):
        accepted, produced = original(logits, drafts, sampler, base)
        rounds.append((base, drafts.copy(), produced))
        return accepted, produced

    monkeypatch.setattr(cpu_runner, "verify_drafts", spy)
    rows = DraftRows(model, monkeypatch)
    runner = dflash_runner(model, 3)
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, presence_penalty=0.5, seed=5)
    lane = Lane(runner, 0, prompt(3, 50), sampling=sampled, budget=30)
    lane.prefill(50)
    while not lane.done:
        frontier, speculative, before = lane.frontier, lane.drafts_ready, len(lane.tokens)
        calls, verified = len(rows.calls), len(rounds)
        decode_round(runner, [lane])
        if speculative:
            base, drafts, produced = rounds[verified]
            proposals = np.argmax(model.logits(rows.calls[calls])[:, : model.dims.vocab_ids], axis=1)
            assert base == frontier and drafts.tolist() == proposals.tolist()
            assert lane.tokens[before:] == produced
    assert len(rounds) >= 5


def test_sampled_rounds_keep_the_target_distribution(model):
    """The first token of a DFlash round, over many seeds, is distributed as the target's sampler says (§4.7: the
    one-hot proposal is accepted with p(draft), else the correction is drawn without it)."""
    k, trials = 2, 600
    runner = dflash_runner(model, k)
    ids = prompt(11, 30)
    lane = Lane(runner, 0, ids, budget=k + 2)
    lane.prefill(30)
    runner.save_checkpoint(0, 0)
    first = lane.tokens[0]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.5, top_k=4, top_p=1.0, presence_penalty=0.0, seed=seed)

    logits = model.forward(model.new_state(), np.append(ids, first)).logits[-1]
    candidates, weights = Sampler(params(0), model.dims.vocab_ids).candidates(logits)
    target = dict(zip(candidates.tolist(), weights / weights.sum()))
    counts, accepted = collections.Counter(), 0
    for seed in range(trials):
        runner.begin_sequence(0, SequenceStart(source=StateSource.CHECKPOINT, checkpoint_slot=0,
                                               sampling=params(seed)))
        result = runner.decode(DecodeBatch(lanes=[0], input_tokens=[first], kv_lengths=[30], positions=[30],
                                           speculative=[True], remaining=[k + 1]))
        counts[int(result.tokens[0, 0])] += 1
        accepted += int(result.accepted[0] > 0)
    assert 0 < accepted < trials  # both rules ran: acceptances and corrections
    assert set(counts) <= set(target)
    assert max(abs(counts[t] / trials - p) for t, p in target.items()) < 0.06


def test_sampled_dflash_output_does_not_depend_on_the_batch(model):
    assert_sampled_output_does_not_depend_on_the_batch(
        lambda concurrency: engine(model, k=3, concurrency=concurrency, greedy=False), 4)


def test_lm_head_draft_proposes_shortlist_ids_only(model, monkeypatch):
    """The tiny shortlist holds the even ids: with --lm-head-draft every proposal is one of them."""
    proposed: list[int] = []
    original = cpu_runner.verify_drafts

    def spy(logits, drafts, sampler, base):
        proposed.extend(drafts.tolist())
        return original(logits, drafts, sampler, base)

    monkeypatch.setattr(cpu_runner, "verify_drafts", spy)
    by_head = {}
    for shortlist in (False, True):
        start = len(proposed)
        runner = dflash_runner(model, 5, lm_head_draft=shortlist)
        generate(runner, Lane(runner, 0, prompt(6, 30), budget=30))
        by_head[shortlist] = proposed[start:]
    assert all(t % 2 == 0 for t in by_head[True]) and any(t % 2 for t in by_head[False])
    assert set(by_head[True]) <= set(model.draft_head.token_ids.tolist())


# ---- commits, reuse, lane images, sizing ----

def test_a_stop_inside_a_round_commits_exactly_and_the_next_turn_reuses_it(model, plain_tokens):
    options = RequestOptions(max_tokens=40)
    with engine(model, k=4, concurrency=1) as eng:
        follow, second = stop_inside_a_round_then_continue(eng, plain_tokens, options)
    with engine(model, k=4, concurrency=1) as eng:
        fresh = eng.submit(follow, options).result(60)
    assert fresh.tokens == second.tokens and fresh.usage.speculative == second.usage.speculative


def test_prefix_reuse_restores_the_drafter_context_exactly(model, monkeypatch):
    """Every reuse path (frontier, turn and response checkpoints, reset): the same tokens and counters as without
    reuse, and bitwise the same drafter rows in every round."""
    rows = DraftRows(model, monkeypatch)
    with_reuse = run_chat(model, prefix_reuse=True, draft_tokens=3, spec="dflash")
    reused_rows, rows.calls = rows.calls, []
    without = run_chat(model, prefix_reuse=False, draft_tokens=3, spec="dflash")
    reference = run_chat(model, prefix_reuse=False)
    assert with_reuse[0] == without[0] == reference[0]
    assert [u.reuse_path for u in with_reuse[1]] == [turn.path.value for turn in SCRIPT]
    assert [u.speculative for u in with_reuse[1]] == [u.speculative for u in without[1]]
    assert sum(u.speculative.accepted_tokens for u in with_reuse[1]) > 0
    assert len(reused_rows) == len(rows.calls)
    for reused, fresh in zip(reused_rows, rows.calls):
        np.testing.assert_array_equal(reused, fresh)


def continue_moved_then_restored(runner, lane, image, pages: np.ndarray, expected: list[int], *,
                                 checkpoint: tuple[int, int], chunk: int) -> None:
    """`lane`'s sequence, exported from lane 0 as `image`, continues on lane 1 (`pages`) to the `expected` tokens;
    then a new sequence restored from `checkpoint` (slot, tokens) on lane 1, prefilled in chunks of `chunk`,
    reaches them too."""
    runner.assign_pages(1, pages)
    runner.import_lane(1, image)
    runner.release(0)
    runner.begin_sequence(1, SequenceStart(source=StateSource.RESIDENT, sampling=SamplingParams.greedy()))
    lane.lane = 1
    while not lane.done:
        decode_round(runner, [lane])
    assert lane.tokens == expected
    restored = Lane(runner, 1, lane.prompt, budget=lane.budget, checkpoint=checkpoint)
    restored.prefill(chunk)
    while not restored.done:
        decode_round(runner, [restored])
    assert restored.tokens == expected


def test_an_imported_lane_continues_with_its_drafter_context(model, monkeypatch):
    """A lane image carries the drafter context (cyclic caches, pending columns, full-layer pages) and the
    checkpoints' cyclic caches: the moved sequence, and a restore of its checkpoint, propose bitwise as unmoved."""
    rows = DraftRows(model, monkeypatch)
    ids = prompt(12, 45)
    reference = dflash_runner(model, 3)
    expected = generate(reference, Lane(reference, 0, ids, budget=30))
    expected_rows, rows.calls = rows.calls, []
    runner = dflash_runner(model, 3, lanes=2)
    lane = Lane(runner, 0, ids, budget=30)
    lane.prefill_span(0, 20)
    runner.save_checkpoint(0, 1)  # the checkpoint's cyclic caches travel too
    lane.prefill_span(20, 45)
    for _ in range(3):
        decode_round(runner, [lane])
    image = runner.export_lane(0, lane.frontier)
    assert any(name.startswith("dflash/ring/") for name in image.arrays)
    assert any(name.startswith("checkpoint/1/dflash/") for name in image.arrays)
    continue_moved_then_restored(runner, lane, image, np.arange(8, 16), expected, checkpoint=(1, 20), chunk=100)
    assert len(rows.calls) == 2 * len(expected_rows)
    for got, want in zip(rows.calls, expected_rows * 2):
        np.testing.assert_array_equal(got, want)


def test_pool_and_lane_state_sizes_count_the_drafter(model):
    dims, drafter = model.dims, model.dflash.dims
    runner = dflash_runner(model, 3)
    assert runner.info.kv_bytes_per_token == kv_bytes_per_token(1, dims.kv_heads, dims.head_dim, "bf16") + \
        dflash_kv_bytes_per_token(drafter)
    assert dflash_kv_bytes_per_token(drafter) == 2 * drafter.kv_heads * drafter.head_dim * 2  # one full layer, bf16
    assert dflash_lane_bytes(drafter) == 2 * drafter.sliding_window * drafter.kv_width * 2
    config = EngineConfig(max_concurrency=2, max_context=1024, kv_capacity="auto", spec="dflash", draft_tokens=3)
    page_bytes = 64 * runner.info.kv_bytes_per_token
    reserved = runner_state_bytes(model, 2, 3, "dflash")
    assert reserved == runner_state_bytes(model, 2, 3) + 2 * 3 * dflash_lane_bytes(drafter)
    budget = AUTO_HEADROOM_BYTES + reserved + 20 * page_bytes + page_bytes // 2
    assert build_cpu_runner(model, config, memory_budget=budget).info.pages == 20
