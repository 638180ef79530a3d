"""Random submit / cancel / continue / step sequences against the scheduler: pages are never in two lanes, every
admitted request holds its full entitlement, every request ends exactly once with the model's own tokens, and all
pages come back."""

from __future__ import annotations

from hypothesis import event, given, settings, strategies as st

from ninfer.engine.kv_pool import pages_for
from ninfer.engine.request import FinishReason, StopTokenPolicy
from tests.test_engine_scheduler import Harness, check_pages, expected_output, prompt_of

operations = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 300), st.integers(1, 80), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("continue"), st.integers(0, 40), st.integers(1, 30), st.integers(1, 20),
              st.sampled_from(["append", "rewrite"]), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.integers(1, 6)),
), max_size=40)


def turn_fields(length: int, preserve: bool) -> dict:
    """Chat-like boundaries: the assistant opener two tokens before the end, the prologue to the end."""
    return dict(assistant_boundary=max(1, length - 2), prologue_end=length, preserve_thinking=preserve)


def check_entitlements(h: Harness) -> None:
    for lane in h.scheduler.lanes:
        if lane.request is not None:
            assert len(lane.pages) >= pages_for(lane.request.kv_tokens)


@settings(max_examples=300, deadline=None)
@given(lanes=st.integers(1, 4), spare_pages=st.integers(0, 12), draft_tokens=st.sampled_from([0, 2]),
       prefix_reuse=st.booleans(), ops=operations)
def test_pages_are_never_shared_and_all_come_back(lanes, spare_pages, draft_tokens, prefix_reuse, ops):
    h = Harness(lanes=lanes, pages=8 + spare_pages, max_context=512, draft_tokens=draft_tokens,
                prefix_reuse=prefix_reuse)
    prompts: dict[int, list[int]] = {}
    for op in ops:
        if op[0] == "submit":
            _, length, max_tokens, seed, preserve = op
            stop = expected_output(prompt_of(seed, length), max_tokens)[max_tokens // 2]
            request_id = h.submit(prompt_of(seed, length), max_tokens=max_tokens,
                                  policy=StopTokenPolicy({stop}) if seed == 3 else None,
                                  **turn_fields(length, preserve))
            prompts[request_id] = prompt_of(seed, length)
        elif op[0] == "continue" and prompts:
            # The next turn of an earlier request once it has answered: its prompt and output, or its prompt up to
            # the assistant opener (the answer re-rendered), then a new suffix.
            _, pick, extra, max_tokens, mode, preserve = op
            earlier = sorted(prompts)[pick % len(prompts)]
            while h.events[earlier][-1:] == [] or h.events[earlier][-1].finish is None:
                h.scheduler.step()
            base = prompts[earlier] + h.tokens(earlier) if mode == "append" else \
                prompts[earlier][: max(1, len(prompts[earlier]) - 2)]
            follow = base + prompt_of(pick, extra)
            if len(follow) <= 512:
                prompts[h.submit(follow, max_tokens=max_tokens, **turn_fields(len(follow), preserve))] = follow
        elif op[0] == "cancel" and prompts:
            h.scheduler.cancel(sorted(prompts)[op[1] % len(prompts)])
        elif op[0] == "step":
            for _ in range(op[1]):
                h.scheduler.step()
                check_pages(h.scheduler)
                check_entitlements(h)
        check_pages(h.scheduler)
    h.run()
    for request_id, prompt in prompts.items():
        finals = [e for e in h.events[request_id] if e.finish is not None]
        assert len(finals) == 1 and h.events[request_id][-1] is finals[0]
        tokens = h.tokens(request_id)
        assert tokens == expected_output(prompt, len(tokens))
        assert finals[0].usage.completion_tokens == len(tokens)
        event(f"{finals[0].finish.value} via {finals[0].usage.reuse_path}")
        if finals[0].finish is not FinishReason.CANCELLED:
            assert finals[0].usage.cached_tokens + finals[0].usage.prefill_tokens == len(prompt)
    # Only retained residents still hold pages, exactly their frontier's worth; dropping them frees everything.
    for lane in h.scheduler.lanes:
        assert lane.request is None
        assert len(lane.pages) == (pages_for(lane.resident.frontier) if lane.resident else 0)
        if lane.resident is not None:
            assert prefix_reuse
            h.scheduler._evict(lane)
    assert h.scheduler.pool.free == h.scheduler.pool.pages
