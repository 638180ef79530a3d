"""The threaded Engine API: submit, per-round events, callbacks, cancellation from other threads, errors, close."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ninfer.backends.cpu.runner import build_cpu_runner
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import ContextLengthExceeded, FinishReason, PreparedPrompt, RequestOptions, Verdict
from ninfer.frontend.output import OutputDecoder
from ninfer.targets.registry import QWEN_27B_PRESETS
from tests.support.waiting import wait_until
from tests.test_engine_scheduler import FakeRunner, Harness, expected_output, prompt_of
from tests.test_runner_cpu import tiny_qwen

GREEDY = EngineConfig(max_concurrency=2, max_context=512, kv_capacity=1024, prefill_chunk=128, greedy=True)


def fake_engine(config: EngineConfig = GREEDY, runner=None) -> Engine:
    runner = runner or FakeRunner(lanes=config.max_concurrency, pages=config.kv_capacity // 64,
                                  draft_tokens=config.draft_tokens)
    return Engine(runner, config, QWEN_27B_PRESETS).start()


def test_submit_streams_one_event_per_round_then_a_final_one():
    with fake_engine() as engine:
        handle = engine.submit(PreparedPrompt(token_ids=prompt_of(1, 40)), RequestOptions(max_tokens=6))
        events = list(handle)
    assert [e.tokens for e in events[:-1]] == [(t,) for t in expected_output(prompt_of(1, 40), 6)]
    final = events[-1]
    assert final.finish is FinishReason.OUTPUT_LIMIT and final.tokens == () and final.request_id == handle.id
    assert final.usage.prompt_tokens == 40 and final.usage.completion_tokens == 6
    assert final.usage.timings.total >= final.usage.timings.prefill > 0


def test_callbacks_run_on_the_engine_thread():
    seen, done = [], threading.Event()

    def on_event(event):
        seen.append((threading.current_thread().name, event.finish))
        if event.finish is not None:
            done.set()

    with fake_engine() as engine:
        engine.submit(PreparedPrompt(token_ids=prompt_of(2, 10)), RequestOptions(max_tokens=3), on_event=on_event)
        assert done.wait(10)
    assert {name for name, _ in seen} == {"ninfer-engine"} and seen[-1][1] is FinishReason.OUTPUT_LIMIT


def test_cancel_from_another_thread_takes_effect_and_frees_the_lane():
    class SlowRunner(FakeRunner):
        def decode(self, batch):
            time.sleep(0.002)
            return super().decode(batch)

    with fake_engine(runner=SlowRunner(lanes=2, pages=16)) as engine:
        long = engine.submit(PreparedPrompt(token_ids=prompt_of(3, 30)), RequestOptions(max_tokens=400))
        first = long.events.get(timeout=10)
        threading.Thread(target=long.cancel).start()
        result = long.result(timeout=10)
        after = engine.submit(PreparedPrompt(token_ids=prompt_of(4, 30)), RequestOptions(max_tokens=3)).result(10)
        pool = engine._scheduler.pool
        assert pool.free == pool.pages - 1  # only the finished request's 32 tokens stay resident (one page)
    assert result.finish is FinishReason.CANCELLED and 1 <= len(first.tokens + result.tokens) < 400
    assert after.finish is FinishReason.OUTPUT_LIMIT


def test_invalid_requests_raise_at_submit():
    with fake_engine() as engine:
        with pytest.raises(ContextLengthExceeded):
            engine.submit(PreparedPrompt(token_ids=prompt_of(1, 513)))
        assert engine.count_tokens(PreparedPrompt(token_ids=prompt_of(1, 513))) == 513


def test_a_runner_failure_fails_the_round_and_the_engine_goes_on():
    class FailOnce(FakeRunner):
        failed = False

        def decode(self, batch):
            if not self.failed:
                self.failed = True
                raise RuntimeError("device lost")
            return super().decode(batch)

    with fake_engine(runner=FailOnce(lanes=2, pages=16)) as engine:
        broken = engine.submit(PreparedPrompt(token_ids=prompt_of(1, 30)), RequestOptions(max_tokens=5)).result(10)
        fine = engine.submit(PreparedPrompt(token_ids=prompt_of(2, 30)), RequestOptions(max_tokens=5)).result(10)
    assert broken.finish is FinishReason.ERROR and "device lost" in broken.error
    assert fine.finish is FinishReason.OUTPUT_LIMIT and fine.tokens == tuple(expected_output(prompt_of(2, 30), 5))


def test_close_cancels_what_is_still_queued():
    engine = fake_engine()
    handles = [engine.submit(PreparedPrompt(token_ids=prompt_of(i, 30)), RequestOptions(max_tokens=10_000))
               for i in range(4)]
    engine.close(timeout=10)
    assert {h.result(timeout=1).finish for h in handles} <= {FinishReason.CANCELLED, FinishReason.CONTEXT_CAPACITY}


def test_the_engine_on_the_cpu_runner():
    config = EngineConfig(max_concurrency=2, max_context=256, prefill_chunk=128, greedy=True, kv_dtype="int8")
    model = tiny_qwen()
    with Engine(build_cpu_runner(model, config), config, QWEN_27B_PRESETS) as engine:
        prompts = [np.arange(5, 45), np.arange(100, 170)]
        results = [engine.submit(PreparedPrompt(token_ids=p), RequestOptions(max_tokens=8)).result(60)
                   for p in prompts]
        # the snapshot is taken at round boundaries: the round that finished a request ends after its result
        wait_until(lambda: engine.snapshot().running == 0)
    assert all(r.finish is FinishReason.OUTPUT_LIMIT and len(r.tokens) == 8 for r in results)


class LetterTokenizer:
    """Token i decodes to one lowercase letter (no specials)."""

    special_ids = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([97 + token_id % 26])


class DecoderPolicy:
    """The server's output policy in miniature: the frontend OutputDecoder's push_many decides the accepted prefix."""

    FINISHES = {"stop_token": FinishReason.STOP_TOKEN, "stop_string": FinishReason.STOP_STRING}

    def __init__(self, decoder) -> None:
        self.decoder = decoder

    def accept(self, tokens):
        delta, accepted = self.decoder.push_many(tokens)
        finish = self.FINISHES[delta.finish.value] if delta.finish is not None else None
        return Verdict(accepted, finish, payload=delta.content)

    def close(self, reason):
        return self.decoder.finish().content


def test_the_frontend_output_decoder_is_an_output_policy():
    prompt = prompt_of(9, 30)
    text = "".join(chr(97 + t % 26) for t in expected_output(prompt, 60))
    cut = next(i for i in range(8, 60) if text[i : i + 3] not in text[: i + 2])  # a first-time trigram
    h = Harness(lanes=1, draft_tokens=3)
    policy = DecoderPolicy(OutputDecoder(LetterTokenizer(), thinking=False, stop_strings=(text[cut : cut + 3],)))
    request_id = h.submit(prompt, max_tokens=60, policy=policy)
    h.run()
    final = h.final(request_id)
    assert final.finish is FinishReason.STOP_STRING
    assert len(h.tokens(request_id)) == cut + 3  # up to the token that completed the stop string ...
    assert h.runner.calls["rewind"] == 1  # ... which fell inside a speculative round
    assert "".join(e.payload or "" for e in h.events[request_id]) == text[:cut]
