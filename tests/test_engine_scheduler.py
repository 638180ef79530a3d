"""The scheduler against a model-free runner: admission, chunking, batching, limits, stops and cancellation.

`FakeRunner` (shared with the hypothesis tests and the overhead benchmark) implements the runner interface with a
fixed pseudo-random next-token function, so a request's output depends only on its prompt, and checks the
contract: writes stay inside the lane's pages, checkpoints exist before they are restored, rewinds follow a round.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from ninfer.engine.config import EngineConfig
from ninfer.engine.kv_pool import PagePool
from ninfer.engine.request import (ContextLengthExceeded, FinishReason, PreparedPrompt, PromptError, StopTokenPolicy,
                                   Verdict)
from ninfer.engine.runner import (DecodeBatch, DecodeResult, PrefillChunk, PrefillResult, RunnerInfo, SequenceStart,
                                  StateSource)
from ninfer.engine.sampler import SamplingParams
from ninfer.engine.scheduler import OutputPolicyError, Scheduler

VOCAB = 1000


def next_token(token: int, index: int) -> int:
    """The fake model: the token after `token` at sequence index `index`."""
    return (token * 7919 + index * 104729 + 17) % VOCAB


class FakeRunner:
    def __init__(self, *, lanes: int, pages: int, draft_tokens: int = 0) -> None:
        self.info = RunnerInfo(lanes=lanes, pages=pages, page_tokens=64, checkpoint_slots=2, vocab_ids=VOCAB,
                               draft_tokens=draft_tokens, kv_bytes_per_token=1)
        self.tables = {lane: np.zeros(0, np.int32) for lane in range(lanes)}
        self.tails: dict[int, tuple[int, int] | None] = {lane: None for lane in range(lanes)}  # (token, index) at E-1
        self.checkpoints: dict[tuple[int, int], tuple[int, int]] = {}
        self.rounds: dict[int, list[tuple[int, int]]] = {}  # lane -> processed (token, index) of its last round
        self.calls: collections.Counter = collections.Counter()
        self.starts: list[SequenceStart] = []
        self.batch_sizes: list[int] = []
        self.prefill_lengths: list[int] = []

    def _check_writes(self, lane: int, start: int, count: int) -> None:
        assert start + count <= len(self.tables[lane]) * 64, f"lane {lane} writes beyond its pages"

    def assign_pages(self, lane, page_table):
        self.tables[lane] = np.array(page_table, np.int32)

    def begin_sequence(self, lane, start: SequenceStart):
        self.calls[start.source.value] += 1
        self.starts.append(start)
        if start.source is StateSource.RESET:
            self.tails[lane] = None
            self.checkpoints = {key: value for key, value in self.checkpoints.items() if key[0] != lane}
        elif start.source is StateSource.CHECKPOINT:
            self.tails[lane] = self.checkpoints[(lane, start.checkpoint_slot)]
        self.rounds.pop(lane, None)

    def save_checkpoint(self, lane, slot):
        self.checkpoints[(lane, slot)] = self.tails[lane]

    def prefill(self, chunk: PrefillChunk) -> PrefillResult:
        count = len(chunk.token_ids)
        self._check_writes(chunk.lane, chunk.kv_length, count)
        self.prefill_lengths.append(count)
        if count:
            self.tails[chunk.lane] = (int(chunk.token_ids[-1]), chunk.kv_length + count - 1)
        if not chunk.final:
            return PrefillResult(-1, False)
        token, index = self.tails[chunk.lane]
        assert index == chunk.kv_length + count - 1
        k = self.info.draft_tokens
        return PrefillResult(next_token(token, index), bool(k) and chunk.remaining - 1 >= k + 1)

    def decode(self, batch: DecodeBatch) -> DecodeResult:
        self.batch_sizes.append(batch.size)
        assert len(set(batch.lanes.tolist())) == batch.size, "a lane appears twice in one round"
        k = self.info.draft_tokens
        size = batch.size
        tokens, counts = np.zeros((size, k + 1), np.int32), np.zeros(size, np.int32)
        accepted, ready = np.zeros(size, np.int32), np.zeros(size, bool)
        for b in range(size):
            lane, start, token = int(batch.lanes[b]), int(batch.kv_lengths[b]), int(batch.input_tokens[b])
            assert self.tails[lane][1] == start - 1, "the round does not continue the lane's frontier"
            columns = k + 1 if batch.speculative[b] else 1
            assert columns <= batch.remaining[b]
            self._check_writes(lane, start, columns)
            chain, processed = [], []
            for index in range(start, start + columns):
                processed.append((token, index))
                token = next_token(token, index)
                chain.append(token)
            kept = 1 + (start * 31 % columns if batch.speculative[b] else 0)  # a pseudo-random acceptance
            tokens[b, :kept], counts[b], accepted[b] = chain[:kept], kept, kept - 1
            self.rounds[lane] = processed[:kept]
            self.tails[lane] = processed[kept - 1]
            ready[b] = bool(batch.speculative[b]) and batch.remaining[b] - kept >= k + 1
        self.calls["decode"] += 1
        return DecodeResult(tokens=tokens, counts=counts, accepted=accepted, drafts_ready=ready)

    def rewind(self, lane, kept):
        self.calls["rewind"] += 1
        self.tails[lane] = self.rounds[lane][kept - 1]

    def release(self, lane):
        self.tables[lane] = np.zeros(0, np.int32)
        self.tails[lane] = None
        self.checkpoints = {key: value for key, value in self.checkpoints.items() if key[0] != lane}


def expected_output(prompt: list[int], count: int) -> list[int]:
    token, out = prompt[-1], []
    for index in range(len(prompt) - 1, len(prompt) - 1 + count):
        token = next_token(token, index)
        out.append(token)
    return out


class Harness:
    """A scheduler over a FakeRunner, driven synchronously; events are collected per request."""

    def __init__(self, *, lanes: int = 2, pages: int | None = None, max_context: int = 512, draft_tokens: int = 0,
                 prefix_reuse: bool = True, prefill_chunk: int = 128) -> None:
        pages = pages or lanes * -(-max_context // 64)
        self.runner = FakeRunner(lanes=lanes, pages=pages, draft_tokens=draft_tokens)
        self.config = EngineConfig(max_concurrency=lanes, max_context=max_context, prefill_chunk=prefill_chunk,
                                   kv_capacity=pages * 64, spec="mtp" if draft_tokens else None,
                                   draft_tokens=draft_tokens, prefix_reuse=prefix_reuse)
        self.scheduler = Scheduler(self.runner, self.config)
        self.events: dict[int, list] = collections.defaultdict(list)
        self.requests: dict[int, object] = {}
        self._next_id = 1

    def submit(self, prompt, max_tokens: int = 16, policy=None, **prompt_fields) -> int:
        request_id = self._next_id
        self._next_id += 1
        request = self.scheduler.new_request(
            request_id, PreparedPrompt(token_ids=prompt, **prompt_fields), max_tokens, SamplingParams.greedy(),
            policy or StopTokenPolicy(), self.events[request_id].append)
        self.requests[request_id] = request
        self.scheduler.enqueue(request)
        return request_id

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            check_pages(self.scheduler)
            if not self.scheduler.has_work:
                return
            self.scheduler.step()
        raise AssertionError("the scheduler did not drain")

    def tokens(self, request_id: int) -> list[int]:
        return [t for event in self.events[request_id] for t in event.tokens]

    def final(self, request_id: int):
        last = self.events[request_id][-1]
        assert last.finish is not None
        return last


def check_pages(scheduler: Scheduler) -> None:
    """Pool invariants: lanes' page lists are disjoint, each page owned by its lane, owned + free = all."""
    pool: PagePool = scheduler.pool
    seen: set[int] = set()
    for lane in scheduler.lanes:
        assert not seen & set(lane.pages), "a page is in two lanes"
        seen |= set(lane.pages)
        assert sorted(pool.owned_by(lane.index)) == sorted(lane.pages)
        if lane.resident is None:
            assert not lane.pages
    assert len(seen) + pool.free == pool.pages


def prompt_of(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


# ---- admission ----

def test_requests_run_to_their_limits_with_the_models_tokens():
    h = Harness(lanes=2)
    ids = [h.submit(prompt_of(i, 20 + i), max_tokens=5 + i) for i in range(5)]
    h.run()
    for i, request_id in enumerate(ids):
        assert h.tokens(request_id) == expected_output(prompt_of(i, 20 + i), 5 + i)
        final = h.final(request_id)
        assert final.finish is FinishReason.OUTPUT_LIMIT
        assert final.usage.completion_tokens == 5 + i and final.usage.prompt_tokens == 20 + i
    assert h.scheduler.pool.free + sum(len(lane.pages) for lane in h.scheduler.lanes) == h.scheduler.pool.pages


def test_admission_is_fifo_and_reserves_the_full_entitlement():
    # Room for 8 pages; each request needs prompt + output - 1 = 300 tokens = 5 pages: one at a time.
    h = Harness(lanes=2, pages=8, max_context=448, prefix_reuse=False)
    first = h.submit(prompt_of(1, 100), max_tokens=201)
    second = h.submit(prompt_of(2, 100), max_tokens=201)
    third = h.submit(prompt_of(3, 10), max_tokens=2)  # small, but FIFO: it waits behind the second
    h.scheduler.step()
    snapshot = h.scheduler.snapshot()
    assert (snapshot.running, snapshot.waiting) == (1, 2)
    while h.scheduler.snapshot().waiting == 2:
        h.scheduler.step()
    assert h.events[first][-1].finish is FinishReason.OUTPUT_LIMIT  # the second waited for the first's pages
    h.run()
    admitted = [h.requests[i].admitted for i in (first, second, third)]
    assert admitted == sorted(admitted)
    assert max(h.runner.batch_sizes[:200]) == 1  # the pool never held both big ones


def test_context_capacity_caps_the_output_and_names_the_finish():
    h = Harness(lanes=1, max_context=64)
    request_id = h.submit(prompt_of(1, 60), max_tokens=50)
    h.run()
    final = h.final(request_id)
    assert final.finish is FinishReason.CONTEXT_CAPACITY
    assert final.usage.completion_tokens == 64 - 60 + 1  # the last token needs no KV slot


def test_prompt_longer_than_the_context_is_rejected_at_submit():
    h = Harness(lanes=1, max_context=64)
    with pytest.raises(ContextLengthExceeded, match="65 tokens"):
        h.submit(prompt_of(1, 65))
    with pytest.raises(PromptError, match="below 1000"):
        h.submit([1, 2, VOCAB])


# ---- scheduling ----

def test_one_prefill_chunk_per_step_and_chunks_end_at_the_checkpoint():
    h = Harness(lanes=2, max_context=1024)
    h.submit(prompt_of(1, 300), max_tokens=4, assistant_boundary=290)
    h.scheduler.step()
    assert h.runner.prefill_lengths == [128]
    h.run()
    assert h.runner.prefill_lengths == [128, 128, 34, 10]  # 290 = 128 + 128 + 34, then the prologue


def test_every_decode_ready_request_is_in_each_round_and_leavers_leave_no_row():
    h = Harness(lanes=4)
    budgets = [3, 9, 5, 12]
    for i, budget in enumerate(budgets):
        h.submit(prompt_of(i, 30), max_tokens=budget)
    h.run()
    # One prefill chunk per step, so requests join one round apart; the first (3 tokens: prefill + 2 rounds)
    # leaves right after the second round, so the third round has the second and third requests only.
    assert h.runner.batch_sizes[:4] == [1, 2, 2, 3]
    assert sum(h.runner.batch_sizes) == sum(budgets) - len(budgets)  # one row per decode token, no empty rows


# ---- stops, policies, cancellation ----

class StopAfter:
    """Finishes with a stop string once `count` tokens were offered (accepting exactly up to there)."""

    def __init__(self, count: int) -> None:
        self.count, self.seen = count, 0

    def accept(self, tokens):
        if self.seen + len(tokens) >= self.count:
            return Verdict(self.count - self.seen, FinishReason.STOP_STRING, payload="cut")
        self.seen += len(tokens)
        return Verdict(len(tokens), payload=len(tokens))

    def close(self, reason):
        return f"closed:{reason.value}"


def test_stop_token_and_stop_string_finishes():
    h = Harness(lanes=2)
    out = expected_output(prompt_of(1, 20), 10)
    stopped = h.submit(prompt_of(1, 20), max_tokens=10, policy=StopTokenPolicy({out[3]}))
    cut = h.submit(prompt_of(1, 20), max_tokens=10, policy=StopAfter(6))
    h.run()
    assert h.tokens(stopped) == out[:4] and h.final(stopped).finish is FinishReason.STOP_TOKEN
    assert h.final(stopped).usage.completion_tokens == 4  # the stop token counts
    assert h.tokens(cut) == out[:6] and h.final(cut).finish is FinishReason.STOP_STRING
    assert h.final(cut).payload is None  # the policy decided the finish: nothing to close


def test_limit_finish_closes_the_policy():
    h = Harness(lanes=1)
    request_id = h.submit(prompt_of(1, 20), max_tokens=3, policy=StopAfter(100))
    h.run()
    assert h.final(request_id).payload == "closed:output_limit"


def test_a_policy_may_not_drop_tokens_without_finishing():
    class Greedy:
        def accept(self, tokens):
            return Verdict(0)

        def close(self, reason):
            return None

    h = Harness(lanes=1)
    h.submit(prompt_of(1, 20), policy=Greedy())
    with pytest.raises(OutputPolicyError):
        h.run()


def test_cancel_frees_pages_and_state_at_once():
    h = Harness(lanes=2)
    running = h.submit(prompt_of(1, 200), max_tokens=50)
    waiting_ids = [h.submit(prompt_of(2 + i, 20), max_tokens=50) for i in range(2)]
    h.scheduler.step()
    h.scheduler.step()
    lane = next(lane for lane in h.scheduler.lanes if lane.request and lane.request.id == running)
    assert lane.pages
    h.scheduler.cancel(running)
    h.scheduler.cancel(waiting_ids[1])
    check_pages(h.scheduler)
    assert not lane.pages and lane.resident is None and len(h.runner.tables[lane.index]) == 0
    assert h.final(running).finish is FinishReason.CANCELLED
    assert h.final(waiting_ids[1]).finish is FinishReason.CANCELLED
    assert h.final(waiting_ids[1]).usage.completion_tokens == 0
    h.run()
    assert h.final(waiting_ids[0]).finish is FinishReason.OUTPUT_LIMIT


def test_runner_failure_ends_admitted_requests_with_an_error():
    h = Harness(lanes=1)
    first, second = h.submit(prompt_of(1, 20)), h.submit(prompt_of(2, 20), max_tokens=3)
    h.scheduler.step()
    h.scheduler.fail_active("boom")
    assert h.final(first).finish is FinishReason.ERROR and h.final(first).error == "boom"
    h.run()
    assert h.final(second).finish is FinishReason.OUTPUT_LIMIT


def test_speculative_rounds_commit_what_is_accepted_and_count_it():
    h = Harness(lanes=2, draft_tokens=3)
    prompts = [prompt_of(i, 30) for i in range(2)]
    plain = h.submit(prompts[0], max_tokens=40)
    cut = h.submit(prompts[1], max_tokens=40, policy=StopAfter(17))
    short = h.submit(prompts[1], max_tokens=4)  # 3 tokens left after prefill: never enough for a k + 1 round
    h.run()
    assert h.tokens(plain) == expected_output(prompts[0], 40)
    assert h.tokens(cut) == expected_output(prompts[1], 17)
    counters = h.final(plain).usage.speculative
    assert counters.drafted_tokens == 3 * counters.rounds
    assert sum(counters.accepted_per_position) == counters.accepted_tokens
    assert counters.rounds + counters.fallback_steps + counters.accepted_tokens == 40 - 1
    assert h.runner.calls["rewind"] >= 1  # the stop at 17 fell inside a round
    assert h.final(short).usage.speculative.fallback_steps == 3 and h.final(short).usage.speculative.rounds == 0
