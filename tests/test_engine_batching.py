"""Continuous batching is invisible in the output: each request's tokens are the same alone or in a batch of 8
with others joining and leaving (greedy, and sampled with a fixed seed), on the dense and the MoE model."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.backends.cpu.runner import build_cpu_runner
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import PreparedPrompt, RequestOptions
from ninfer.engine.sampler import SamplingOverrides
from ninfer.targets.registry import QWEN_27B_PRESETS
from tests.test_runner_cpu import tiny_qwen

SAMPLED = SamplingOverrides(temperature=0.9, top_k=10, top_p=0.9, presence_penalty=0.3, seed=1234)


def requests(count: int) -> list[tuple[PreparedPrompt, RequestOptions]]:
    rng = np.random.default_rng(42)
    out = []
    for i in range(count):
        ids = rng.integers(0, 500, int(rng.integers(20, 300)))
        sampling = SAMPLED if i % 3 == 2 else SamplingOverrides(temperature=0.0)
        out.append((PreparedPrompt(token_ids=ids), RequestOptions(max_tokens=int(rng.integers(3, 24)),
                                                                   sampling=sampling)))
    return out


def run_all(model, concurrency: int, work) -> tuple[list[tuple[int, ...]], list[int]]:
    """Every request's tokens, and the batch size of every decode round."""
    config = EngineConfig(max_concurrency=concurrency, max_context=512, prefill_chunk=128,
                          kv_capacity=concurrency * 512)
    runner, sizes = build_cpu_runner(model, config), []
    decode = runner.decode
    runner.decode = lambda batch: sizes.append(batch.size) or decode(batch)
    with Engine(runner, config, QWEN_27B_PRESETS) as engine:
        handles = [engine.submit(prompt, options) for prompt, options in work]
        return [handle.result(timeout=120).tokens for handle in handles], sizes


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_output_is_independent_of_batch_composition(moe):
    model, work = tiny_qwen(moe=moe), requests(14)
    batched, sizes = run_all(model, 8, work)
    alone = [run_all(model, 1, [item])[0][0] for item in work]
    assert batched == alone
    assert max(sizes) == 8 and len(set(sizes)) >= 6  # requests joined and left at many batch sizes
    assert [len(tokens) for tokens in batched] == [options.max_tokens for _, options in work]
