"""Sampling defaults: the registered presets per target and mode, and request > process flags > preset, --greedy."""

import pytest

from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import PreparedPrompt, RequestOptions
from ninfer.engine.sampler import SamplingOverrides, SamplingParamsError, resolve_sampling
from ninfer.targets.registry import QWEN_27B_PRESETS, SamplingDefaults, lookup_target
from tests.test_engine_scheduler import FakeRunner, prompt_of


def values(defaults: SamplingDefaults) -> tuple:
    d = defaults
    return d.temperature, d.top_p, d.top_k, d.min_p, d.presence_penalty, d.frequency_penalty


@pytest.mark.parametrize("model_id,thinking,non_thinking", [
    ("qwen3.6-27b", (1.0, 0.95, 20, 0.0, 0.0, 0.0), (0.7, 0.80, 20, 0.0, 1.5, 0.0)),
    ("qwen3.8-27b", (1.0, 0.95, 20, 0.0, 0.0, 0.0), (0.7, 0.80, 20, 0.0, 1.5, 0.0)),
    ("qwen3.6-35b-a3b", (1.0, 0.95, 20, 0.0, 1.5, 0.0), (0.7, 0.80, 20, 0.0, 1.5, 0.0)),
    ("qwen3.6-custom", (1.0, 0.95, 20, 0.0, 0.0, 0.0), (0.7, 0.80, 20, 0.0, 1.5, 0.0)),
    ("smollm2-135m-instruct", (0.6, 0.95, 20, 0.0, 1.0, 0.0), (0.6, 0.95, 20, 0.0, 1.0, 0.0)),
])
def test_registered_presets(model_id, thinking, non_thinking):
    presets = lookup_target(model_id).sampling
    assert values(presets.for_mode(True)) == thinking
    assert values(presets.for_mode(False)) == non_thinking


def test_request_fields_override_process_flags_which_override_the_preset():
    preset = QWEN_27B_PRESETS.thinking
    process = SamplingOverrides(temperature=0.5, top_k=5, presence_penalty=0.25, seed=11)
    request = SamplingOverrides(temperature=0.9, min_p=0.1, seed=3)
    params = resolve_sampling(preset, process, request, greedy=False)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.presence_penalty) == (
        0.9, 5, 0.95, 0.1, 0.25)
    assert params.seed == 3
    assert resolve_sampling(preset, process, SamplingOverrides(), greedy=False).seed == 11


def test_greedy_forces_temperature_zero_and_a_missing_seed_is_fresh():
    params = resolve_sampling(QWEN_27B_PRESETS.thinking, SamplingOverrides(),
                              SamplingOverrides(temperature=1.3), greedy=True)
    assert params.is_greedy
    seeds = {resolve_sampling(QWEN_27B_PRESETS.thinking, SamplingOverrides(), SamplingOverrides(),
                              greedy=False).seed for _ in range(8)}
    assert len(seeds) == 8


def test_the_engine_resolves_by_the_prompts_thinking_mode():
    config = EngineConfig(max_context=128, sampling=SamplingOverrides(top_p=0.5))
    runner = FakeRunner(lanes=1, pages=2)
    with Engine(runner, config, QWEN_27B_PRESETS) as engine:
        for thinking in (True, False):
            engine.submit(PreparedPrompt(token_ids=prompt_of(1, 10), thinking=thinking),
                          RequestOptions(max_tokens=2, sampling=SamplingOverrides(seed=5))).result(10)
        with pytest.raises(SamplingParamsError):
            engine.submit(PreparedPrompt(token_ids=prompt_of(1, 10)),
                          RequestOptions(sampling=SamplingOverrides(temperature=3.0)))
    thinking, plain = (start.sampling for start in runner.starts)
    assert (thinking.temperature, thinking.presence_penalty, thinking.top_p, thinking.seed) == (1.0, 0.0, 0.5, 5)
    assert (plain.temperature, plain.presence_penalty, plain.top_p) == (0.7, 1.5, 0.5)
