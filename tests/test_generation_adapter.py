"""The API-neutral generation path (ninfer.server.generation): prompt preparation, the output adapter as the engine's
OutputPolicy, and Generation's events and collected output.

Also home of the fake ServerContext the API handler tests share. Its generate() runs a real Engine through the
server's own trio bridge. The engine's runner is either `ScriptedRunner` (the scheduler's FakeRunner, whose outputs
follow a script of Qwen token ids, so a test decides what the "model" says: reasoning, answers, tool calls, stop
strings, and speculative rounds that a stop cuts short) or the CPU runner over a tiny random Qwen3.6 model with the
real vocabulary (the end-to-end path, sampled with a seed).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from ninfer.backends.cpu.runner import build_cpu_runner
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import ContextLengthExceeded
from ninfer.engine.request import FinishReason as EngineFinish
from ninfer.engine.request import RequestOptions
from ninfer.engine.runner import PrefillResult
from ninfer.frontend.chat import ChatTemplate
from ninfer.frontend.prompt import PromptBuilder, PromptOptions
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.frontend.tool_calls import TextDelta, ToolCallArgumentsDelta, ToolCallDone, ToolCallStarted
from ninfer.nursery.engine_bridge import submit
from ninfer.server.context import ApiError, HttpRequest, StreamResponse
from ninfer.server.generation import (Completed, Finish, OutputAdapter, ReasoningDelta, build_prompt,
                                      prepare_prompt, start_generation)
from ninfer.targets.registry import QWEN_27B_PRESETS
from tests.support.qwen_tokenizer import FIXTURES, TOKENIZER_CONFIG
from tests.test_engine_scheduler import FakeRunner
from tests.test_runner_cpu import tiny_qwen

IM_END, ENDOFTEXT = 248046, 248044  # the Qwen3.6 generation_config's eos ids
STOP_IDS = frozenset({IM_END, ENDOFTEXT})
QWEN_VOCAB = 248320
MAX_CONTEXT = 2048


@functools.cache
def qwen_tokenizer(tokenizer_json: Path) -> Tokenizer:
    return Tokenizer(tokenizer_json.read_bytes(), TOKENIZER_CONFIG.read_bytes())


@functools.cache
def qwen_builder(tokenizer_json: Path, model: str = "Qwen3.6-27B") -> PromptBuilder:
    return PromptBuilder(ChatTemplate((FIXTURES / model / "chat_template.jinja").read_text()),
                         qwen_tokenizer(tokenizer_json))


class ScriptedRunner(FakeRunner):
    """FakeRunner (page and frontier checks included) whose generated token k of every request is `script[k]`,
    then `filler` for ever. With draft tokens, rounds carry several tokens (FakeRunner's pseudo-random acceptance)."""

    def __init__(self, script: list[int], *, lanes: int = 2, draft_tokens: int = 0, filler: int = 220) -> None:
        super().__init__(lanes=lanes, pages=lanes * MAX_CONTEXT // 64, draft_tokens=draft_tokens)
        self.info = attrs.evolve(self.info, vocab_ids=QWEN_VOCAB)
        self.script, self.filler = script, filler
        self.prompt_lengths: dict[int, int] = {}

    def _token(self, k: int) -> int:
        return self.script[k] if k < len(self.script) else self.filler

    def prefill(self, chunk):
        result = super().prefill(chunk)
        if not chunk.final:
            return result
        self.prompt_lengths[chunk.lane] = chunk.kv_length + len(chunk.token_ids)
        return PrefillResult(self._token(0), result.drafts_ready)

    def decode(self, batch):
        result = super().decode(batch)
        for b in range(batch.size):
            first = int(batch.kv_lengths[b]) + 1 - self.prompt_lengths[int(batch.lanes[b])]
            for j in range(int(result.counts[b])):
                result.tokens[b, j] = self._token(first + j)
        return result


@attrs.frozen
class FakeOptions:
    """The serve options the handlers read."""

    no_thinking: bool = False
    preserve_thinking: bool = False
    vision: bool = False


@attrs.define
class EngineContext:
    """A ServerContext over a real Engine: what ninfer.server.serving_context does, minus admission and the log."""

    engine: Engine
    prompt_builder: PromptBuilder
    options: FakeOptions = FakeOptions()
    public_model_id: str = "qwen3.6-27b"
    stop_ids: frozenset[int] = STOP_IDS
    max_context: int = MAX_CONTEXT
    preparations: list[tuple[str, dict]] = attrs.Factory(list)
    submitted: list[tuple[Any, RequestOptions]] = attrs.Factory(list)
    generations: list[Any] = attrs.Factory(list)

    def begin_preparation(self, *, api: str, shape: dict | None = None) -> None:
        self.preparations.append((api, shape))

    def generate(self, prompt, options, policy, *, api):
        # Kept: a generation is then closed only when its consumer closes it, never by garbage collection.
        self.generations.append(self._generate(prompt, options, policy))
        return self.generations[-1]

    async def _generate(self, prompt, options, policy):
        try:
            submission = submit(self.engine, prompt, options, policy)
        except ContextLengthExceeded as exc:
            raise ApiError(400, "context_length_exceeded", str(exc), param="messages",
                           extra={"prompt_tokens": exc.prompt_tokens, "max_context": exc.max_context}) from None
        self.submitted.append((prompt, options))
        try:
            async for event in submission.events():
                yield event
        finally:
            submission.close()


def engine_config(**overrides: Any) -> EngineConfig:
    return EngineConfig(**{"max_concurrency": 2, "max_context": MAX_CONTEXT, "prefill_chunk": 1024, **overrides})


class SlowScriptedRunner(ScriptedRunner):
    """Takes a few milliseconds per decode round, so a test can leave a generation while it runs."""

    def decode(self, batch):
        time.sleep(0.005)
        return super().decode(batch)


def scripted_engine(script: list[int], *, draft_tokens: int = 0, slow: bool = False) -> Engine:
    config = engine_config(spec="mtp" if draft_tokens else None, draft_tokens=draft_tokens)
    runner = (SlowScriptedRunner if slow else ScriptedRunner)(script, draft_tokens=draft_tokens)
    return Engine(runner, config, QWEN_27B_PRESETS).start()


def left_early(ctx, handler, body: dict, events: int) -> int:
    """Read `events` events of a streamed response, then leave as a disconnecting client does (the app closes the
    event iterator); returns the engine's running requests once the cancellation had time to land."""

    async def main():
        request = HttpRequest(method="POST", path="/", path_params={}, query={}, headers={},
                              body=json.dumps(body).encode())
        response = await handler(ctx, request)
        for _ in range(events):
            await anext(response.events)
        await response.events.aclose()
        await trio.sleep(0.2)
        return ctx.engine.snapshot().running

    return trio.run(main)


def tiny_qwen_engine(**config: Any) -> Engine:
    """The CPU runner over a tiny random Qwen3.6 with the real vocabulary: real sampling, random text."""
    config = engine_config(kv_capacity=2 * MAX_CONTEXT, **config)
    return Engine(build_cpu_runner(tiny_qwen(vocab=QWEN_VOCAB), config), config, QWEN_27B_PRESETS).start()


def script_of(tokenizer: Tokenizer, text: str, *, stop: bool = True) -> list[int]:
    """The ids a model would write for `text`, then <|im_end|>."""
    return tokenizer.encode(text) + ([IM_END] if stop else [])


def post(ctx, handler, body: dict, path: str = "/") -> Any:
    """Call a handler directly; a JsonResponse, or a StreamResponse's events as a list. One trio run, since the
    engine bridge delivers into the run that submitted the request."""

    async def main():
        request = HttpRequest(method="POST", path=path, path_params={}, query={}, headers={},
                              body=json.dumps(body).encode())
        response = await handler(ctx, request)
        if isinstance(response, StreamResponse):
            return [event async for event in response.events]
        return response

    return trio.run(main)


# ---- prompt preparation ----

@pytest.fixture(scope="module")
def builder(qwen_tokenizer_json) -> PromptBuilder:
    return qwen_builder(qwen_tokenizer_json)


@pytest.mark.parametrize("thinking", [True, False])
def test_the_prepared_prompt_marks_the_assistant_opener_and_the_prologue(builder, thinking):
    options = PromptOptions(thinking=thinking, preserve_thinking=True)
    prompt = builder.build([{"role": "user", "content": "hi"}], options)
    prepared = prepare_prompt(builder, prompt, options)
    ids = list(prompt.ids)
    assert prepared.prologue_end == len(ids) and prepared.thinking is thinking and prepared.preserve_thinking
    opener = builder.tokenizer.encode("<|im_start|>assistant\n")
    assert ids[prepared.assistant_boundary - len(opener): prepared.assistant_boundary] == opener
    rest = builder.tokenizer.decode(ids[prepared.assistant_boundary:], skip_special=False)
    assert rest == ("<think>\n" if thinking else "<think>\n\n</think>\n\n")


def test_a_generation_prompt_that_does_not_tokenize_apart_gets_no_boundaries(builder):
    options = PromptOptions()
    prompt = builder.build([{"role": "user", "content": "hi"}], options)
    # The same text with the last two ids merged into one (as if BPE had joined across the boundary).
    merged = attrs.evolve(prompt, ids=prompt.ids[:-2] + (prompt.ids[-1],))
    prepared = prepare_prompt(builder, merged, options)
    assert prepared.assistant_boundary is None and prepared.prologue_end is None


# ---- the output adapter as a policy ----

def adapter(builder, *, thinking=True, tools=None, stops=()) -> OutputAdapter:
    counter = iter(range(100))
    return OutputAdapter(builder.tokenizer, thinking=thinking, stop_ids=STOP_IDS, stop_strings=stops, tools=tools,
                         new_tool_call_id=lambda: f"call_{next(counter)}")


def feed(policy: OutputAdapter, ids: list[int], round_size: int = 1):
    """Rounds through the policy as the engine offers them; (events, verdicts)."""
    events, verdicts, at = [], [], 0
    while at < len(ids):
        verdict = policy.accept(ids[at: at + round_size])
        verdicts.append(verdict)
        events += verdict.payload
        at += verdict.accepted
        if verdict.finish is not None:
            return events, verdicts
    return events + policy.close(EngineFinish.OUTPUT_LIMIT), verdicts


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n" \
       "</parameter>\n</function>\n</tool_call>"


def test_reasoning_then_content_trimmed_and_the_stop_token_accepted(builder):
    ids = script_of(builder.tokenizer, "\nLet me think.\n\n</think>\n\nThe answer is 4.  \n")
    events, verdicts = feed(adapter(builder), ids, round_size=3)
    text = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    answer = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert (text, answer) == ("Let me think.", "The answer is 4.")
    assert verdicts[-1].finish is EngineFinish.STOP_TOKEN and sum(v.accepted for v in verdicts) == len(ids)


@pytest.mark.parametrize("round_size", [1, 2, 5])
def test_a_tool_call_becomes_events_and_surrounding_whitespace_goes(builder, round_size):
    ids = script_of(builder.tokenizer, f"ok</think>\n\nChecking.\n\n{CALL}\n{CALL}\n")
    policy = adapter(builder, tools=TOOLS)
    events, _ = feed(policy, ids, round_size)
    kinds = [type(e).__name__ for e in events if not isinstance(e, ReasoningDelta)]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Checking."
    assert kinds[-6:] == ["ToolCallStarted", "ToolCallArgumentsDelta", "ToolCallDone"] * 2
    started = [e for e in events if isinstance(e, ToolCallStarted)]
    assert [(e.index, e.id, e.name) for e in started] == [(0, "call_0", "get_weather"), (1, "call_1", "get_weather")]
    arguments = [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta)]
    assert arguments == ['{"city":"Paris","days":2}'] * 2
    assert [e.call.arguments for e in events if isinstance(e, ToolCallDone)] == [{"city": "Paris", "days": 2}] * 2


def test_without_tools_call_markup_is_plain_text(builder):
    events, _ = feed(adapter(builder, thinking=False), script_of(builder.tokenizer, CALL))
    assert "".join(e.text for e in events) == CALL


@pytest.mark.parametrize("round_size", [1, 4])
def test_a_stop_string_is_found_again_for_stop_sequence(builder, round_size):
    ids = script_of(builder.tokenizer, "why</think>\n\nalpha beta END gamma", stop=False)
    policy = adapter(builder, stops=("gamma", "END", "beta END"))
    events, verdicts = feed(policy, ids, round_size)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "alpha"
    assert verdicts[-1].finish is EngineFinish.STOP_STRING
    assert policy.stop_sequence == "beta END"  # the earliest match, as the decoder cut it


def test_the_limit_flushes_held_text_and_an_unfinished_call_stays_text(builder):
    ids = script_of(builder.tokenizer, "x</think>\n\nsee <tool_call>\n<function=get_weather>", stop=False)
    events, _ = feed(adapter(builder, tools=TOOLS), ids)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "see <tool_call>\n<function=get_weather>"


# ---- generation over a real engine ----

def run_generation(ctx, messages, *, stream: bool, tools=None, stops=(), max_tokens=64, seed=None):
    async def main():
        prompt = build_prompt(ctx, messages, PromptOptions(), tools=tools)
        options = RequestOptions(max_tokens=max_tokens)
        generation = await start_generation(ctx, prompt, options, api="test", stop_strings=stops, tools=tools)
        if not stream:
            return await generation.collect()
        try:
            return [item async for item in generation.events()]
        finally:
            await generation.aclose()

    return trio.run(main)


def test_events_end_with_completed_and_collect_joins_them(builder):
    script = script_of(builder.tokenizer, f"plan</think>\n\nCalling.{CALL}")
    with scripted_engine(script, draft_tokens=3) as engine:
        ctx = EngineContext(engine, builder)
        messages = [{"role": "user", "content": "weather?"}]
        items = run_generation(ctx, messages, stream=True, tools=TOOLS)
        output = run_generation(ctx, messages, stream=False, tools=TOOLS)
    completed = items[-1]
    assert isinstance(completed, Completed) and completed.finish is Finish.TOOL_CALLS
    assert completed.usage.completion_tokens == len(script) and completed.usage.reasoning_tokens == 2
    assert completed.usage.prompt_tokens == len(ctx.submitted[0][0])
    assert output.reasoning == "plan" and output.content == "Calling."
    assert [c.name for c in output.tool_calls] == ["get_weather"] and output.completed.finish is Finish.TOOL_CALLS
    assert [type(s).__name__ for s in output.segments] == ["ReasoningDelta", "TextDelta", "ToolCall"]


def test_length_and_stop_sequence_finishes(builder):
    with scripted_engine(script_of(builder.tokenizer, "a</think>\n\none two three")) as engine:
        ctx = EngineContext(engine, builder)
        limited = run_generation(ctx, [{"role": "user", "content": "q"}], stream=False, max_tokens=3)
        stopped = run_generation(ctx, [{"role": "user", "content": "q"}], stream=False, stops=("two",))
    assert limited.completed.finish is Finish.LENGTH and limited.completed.usage.completion_tokens == 3
    assert stopped.completed.finish is Finish.STOP_SEQUENCE and stopped.completed.stop_sequence == "two"
    assert stopped.content == "one"


def test_context_errors_surface_before_any_event(builder):
    with scripted_engine([IM_END]) as engine:
        with pytest.raises(ApiError) as raised:
            run_generation(EngineContext(engine, builder), [{"role": "user", "content": "word " * MAX_CONTEXT}],
                           stream=True)
    assert raised.value.code == "context_length_exceeded" and raised.value.extra["max_context"] == MAX_CONTEXT


def test_an_engine_error_is_an_api_error_in_place_of_completed(builder):
    class Failing(ScriptedRunner):
        def decode(self, batch):
            raise RuntimeError("device lost")

    config = engine_config()
    with Engine(Failing([1, 2, 3]), config, QWEN_27B_PRESETS) as engine:
        with pytest.raises(ApiError) as raised:
            run_generation(EngineContext(engine, builder), [{"role": "user", "content": "q"}], stream=False)
    assert raised.value.status == 500 and "device lost" in raised.value.message


def test_the_tiny_qwen_model_streams_what_it_collects_for_one_seed(builder):
    with tiny_qwen_engine() as engine:
        ctx = EngineContext(engine, builder)

        async def both():
            results = []
            for stream in (True, False):
                prompt = build_prompt(ctx, [{"role": "user", "content": "hello"}], PromptOptions())
                options = RequestOptions(max_tokens=24, sampling=attrs.evolve(RequestOptions().sampling, seed=7))
                generation = await start_generation(ctx, prompt, options, api="test")
                results.append([i async for i in generation.events()] if stream else await generation.collect())
                await generation.aclose()
            return results

        items, output = trio.run(both)
    assert "".join(i.text for i in items if isinstance(i, ReasoningDelta)) == output.reasoning
    assert "".join(i.text for i in items if isinstance(i, TextDelta)) == output.content
    # The second request reuses the first one's prompt prefix: only cached_tokens may differ.
    streamed = attrs.evolve(items[-1].usage, cached_tokens=output.completed.usage.cached_tokens)
    assert streamed == output.completed.usage and output.completed.usage.completion_tokens == 24
    assert items[-1].finish is output.completed.finish is Finish.LENGTH
    assert np.asarray(ctx.submitted[0][0].token_ids).size == output.completed.usage.prompt_tokens
