"""Prefix reuse: path planning, checkpoint placement and deferral, and a multi-turn chat whose tokens are identical
with reuse on and off (and with MTP, whose drafts - hence counters - are identical too: the bridge is exact).

The chat is scripted in token ids with ChatML-like markers, so every path is hit on purpose:
full_reset, restore_turn_checkpoint, restore_response_checkpoint, append_frontier.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from ninfer.backends.cpu.runner import build_cpu_runner
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.engine.prefix import (CheckpointKind, CheckpointTarget, ReusePath, Residency, checkpoint_to_capture,
                                  plan_reuse)
from ninfer.engine.request import PreparedPrompt, RequestOptions
from ninfer.targets.registry import QWEN_27B_PRESETS
from tests.test_engine_scheduler import Harness, prompt_of
from tests.test_runner_cpu import tiny_qwen

IM_START, IM_END, NL, USER, ASSISTANT, SYSTEM, THINK, THINK_END = range(480, 488)
OPEN_ASSISTANT = [IM_START, ASSISTANT, NL]


def block(role: int, words: list[int]) -> list[int]:
    return [IM_START, role, NL, *words, IM_END, NL]


def words(seed: int, count: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(0, 400, count).tolist()


def generation_prompt(history: list[int], *, preserve: bool) -> PreparedPrompt:
    """History, then `<|im_start|>assistant\\n<think>\\n`: boundary after the opener, prologue to the end."""
    ids = history + OPEN_ASSISTANT + [THINK, NL]
    return PreparedPrompt(token_ids=ids, thinking=True, assistant_boundary=len(history) + 3, prologue_end=len(ids),
                          preserve_thinking=preserve)


def closed_turn(generated: list[int], render: str) -> list[int]:
    """How the next prompt re-renders a response: `exact` (the raw tokens, as when preserve_thinking re-renders
    text that round-trips), `normalized` (preserve_thinking, but the reasoning split differs from the raw tokens),
    or `dropped` (reasoning removed: only the answer half)."""
    half = len(generated) // 2
    if render == "exact":
        return OPEN_ASSISTANT + [THINK, NL] + generated + [IM_END, NL]
    if render == "normalized":
        return OPEN_ASSISTANT + [THINK, NL] + generated[:half] + [THINK_END, NL, NL] + generated[half:] + [IM_END, NL]
    return OPEN_ASSISTANT + generated[half:] + [IM_END, NL]


# ---- planning ----

def resident(ids: list[int], frontier: int, **checkpoints: int) -> Residency:
    r = Residency(frontier=frontier, checkpoints={CheckpointKind[k.upper()]: v for k, v in checkpoints.items()})
    r.ledger.assign(np.array(ids), np.tile(np.arange(len(ids)), (3, 1)))
    return r


def test_the_longest_valid_point_wins_and_kv_alone_never_does():
    ledger = list(range(100, 140))  # 40 tokens, frontier 39, checkpoints at 10 (turn) and 25 (response)
    r = resident(ledger, 39, turn=10, response=25)
    assert plan_reuse(r, PreparedPrompt(token_ids=ledger[:39] + [7, 8])).path is ReusePath.APPEND_FRONTIER
    assert plan_reuse(r, PreparedPrompt(token_ids=ledger[:39])).frontier == 39  # empty suffix: sample the tail
    restored = plan_reuse(r, PreparedPrompt(token_ids=ledger[:30] + [1]))
    assert (restored.path, restored.frontier) == (ReusePath.RESTORE_RESPONSE_CHECKPOINT, 25)
    restored = plan_reuse(r, PreparedPrompt(token_ids=ledger[:24] + [1]))  # 24 matching tokens: no point there
    assert (restored.path, restored.frontier) == (ReusePath.RESTORE_TURN_CHECKPOINT, 10)
    assert plan_reuse(r, PreparedPrompt(token_ids=[5] + ledger[1:])).path is ReusePath.FULL_RESET


def test_positions_are_part_of_the_identity():
    ledger = list(range(100, 140))
    r = resident(ledger, 39)
    moved = np.tile(np.arange(40), (3, 1))
    moved[1:, 5:9] += 3  # the same ids laid out as a media grid
    assert plan_reuse(r, PreparedPrompt(token_ids=ledger, positions=moved)).path is ReusePath.FULL_RESET


def test_a_desired_checkpoint_behind_the_frontier_is_deferred():
    r = resident(list(range(100, 140)), 39, response=30)
    prompt = PreparedPrompt(token_ids=list(range(100, 130)), assistant_boundary=20, prologue_end=30)
    plan = plan_reuse(r, prompt)
    assert (plan.path, plan.frontier) == (ReusePath.RESTORE_RESPONSE_CHECKPOINT, 30)
    assert checkpoint_to_capture(prompt, plan) is None  # the turn checkpoint at 20 would need a reset: deferred
    keep = attrs.evolve(prompt, preserve_thinking=True)
    assert checkpoint_to_capture(keep, plan) == CheckpointTarget(CheckpointKind.RESPONSE, 30)


# ---- the engine ----

@attrs.frozen
class Turn:
    render: str  # how the previous response is re-rendered (see closed_turn); "fresh" starts over
    preserve: bool
    path: ReusePath
    extra: list[int] = []  # blocks appended after the closed turn (a mid-conversation system message)


# One conversation that takes every path: turn 5 re-sends turn 4's prompt with preserve_thinking off (its turn
# checkpoint would be behind the restored frontier, so it is deferred), turn 6 prefills the answer right after
# turn 4's assistant opener (only turn 1's turn checkpoint is before that), turn 7 edits the first message.
SCRIPT = [
    Turn("fresh", False, ReusePath.FULL_RESET),
    Turn("dropped", True, ReusePath.RESTORE_TURN_CHECKPOINT),
    Turn("normalized", True, ReusePath.RESTORE_RESPONSE_CHECKPOINT),
    Turn("exact", True, ReusePath.APPEND_FRONTIER, extra=block(SYSTEM, words(99, 5))),
    Turn("same prompt", False, ReusePath.RESTORE_RESPONSE_CHECKPOINT),
    Turn("prefilled answer", False, ReusePath.RESTORE_TURN_CHECKPOINT),
    Turn("edited start", False, ReusePath.FULL_RESET),
]


def run_chat(model, *, prefix_reuse: bool, draft_tokens: int = 0, spec: str = "mtp"):
    config = EngineConfig(max_concurrency=2, max_context=1024, prefill_chunk=128, greedy=True,
                          prefix_reuse=prefix_reuse, spec=spec if draft_tokens else None, draft_tokens=draft_tokens)
    outputs, usages, history, prompts = [], [], [], []
    with Engine(build_cpu_runner(model, config), config, QWEN_27B_PRESETS) as engine:
        for index, turn in enumerate(SCRIPT):
            if turn.render == "same prompt":
                prompt = attrs.evolve(prompts[-1], preserve_thinking=turn.preserve)
            elif turn.render == "prefilled answer":
                ids = list(prompts[-2].token_ids[: prompts[-2].assistant_boundary])
                prompt = PreparedPrompt(token_ids=ids + words(7, 3), assistant_boundary=len(ids))
            elif turn.render == "edited start":
                prompt = generation_prompt(block(USER, words(1000)) + history[len(block(USER, words(0))):],
                                           preserve=turn.preserve)
            else:
                if turn.render != "fresh":
                    history += closed_turn(outputs[-1], turn.render) + turn.extra
                history += block(USER, words(index))
                prompt = generation_prompt(list(history), preserve=turn.preserve)
            prompts.append(prompt)
            result = engine.submit(prompt, RequestOptions(max_tokens=10 + index)).result(timeout=60)
            outputs.append(list(result.tokens))
            usages.append(result.usage)
    return outputs, usages, prompts


@pytest.fixture(scope="module")
def chat_model():
    return tiny_qwen(predictable=True)


@pytest.fixture(scope="module")
def reference(chat_model):
    return run_chat(chat_model, prefix_reuse=False)


def test_a_chat_takes_every_path_and_its_tokens_do_not_change(chat_model, reference):
    outputs, usages, prompts = run_chat(chat_model, prefix_reuse=True)
    assert outputs == reference[0]
    assert [u.reuse_path for u in usages] == [turn.path.value for turn in SCRIPT]
    assert all(u.reuse_path == "full_reset" and u.cached_tokens == 0 for u in reference[1])
    # cached_tokens is the exact reused prefix, and only the rest is prefilled.
    turn_boundary = prompts[0].assistant_boundary
    expected_cached = [0, turn_boundary, len(prompts[1]), len(prompts[2]) + len(outputs[2]) - 1, len(prompts[3]),
                       turn_boundary, 0]
    assert [u.cached_tokens for u in usages] == expected_cached
    assert all(u.prefill_tokens == u.prompt_tokens - u.cached_tokens for u in usages)


def test_with_mtp_the_bridge_keeps_drafts_identical(chat_model, reference):
    with_reuse = run_chat(chat_model, prefix_reuse=True, draft_tokens=2)
    without = run_chat(chat_model, prefix_reuse=False, draft_tokens=2)
    assert with_reuse[0] == without[0] == reference[0]
    assert [u.speculative for u in with_reuse[1]] == [u.speculative for u in without[1]]
    assert sum(u.speculative.accepted_tokens for u in with_reuse[1]) > 0


def test_retained_residents_are_evicted_lru_under_pressure_and_reuse_can_be_off():
    h = Harness(lanes=2, pages=8, max_context=256)
    first = prompt_of(1, 100)
    h.submit(first, max_tokens=8)
    h.submit(prompt_of(2, 100), max_tokens=8)
    h.run()
    assert all(lane.resident is not None for lane in h.scheduler.lanes)
    again = h.submit(first + h.tokens(1)[:-1] + [5, 6], max_tokens=8)  # continues the first conversation
    big = h.submit(prompt_of(3, 200), max_tokens=56)  # needs 4 pages: the other resident (LRU) goes
    h.run()
    assert h.final(again).usage.reuse_path == "append_frontier"
    assert h.final(again).usage.cached_tokens == 107
    assert h.final(big).usage.reuse_path == "full_reset"
    off = Harness(lanes=1, prefix_reuse=False)
    off.submit(first, max_tokens=4)
    off.run()
    assert off.scheduler.lanes[0].resident is None and off.scheduler.pool.free == off.scheduler.pool.pages
