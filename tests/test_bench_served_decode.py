"""bench/served_decode.py runs end to end on a HostDevice with a tiny model (CPU): the scheduler serves greedy and
sampled requests over the CUDA runner built as the server builds it, and the figures add up."""

from __future__ import annotations

import importlib

import pytest

from tests.support.cuda_models import cuda_tiny_dims


@pytest.mark.parametrize("draft_tokens", [0, 3], ids=["plain", "mtp"])
def test_greedy_and_sampled_requests_are_served_and_timed(draft_tokens):
    from ninfer.backends.cuda.host import HostDevice

    bench = importlib.import_module("bench.served_decode")
    runs = bench.bench_served(HostDevice(), {"tiny": cuda_tiny_dims(moe=True)}, ["bf16"], [1, 2],
                              ["greedy", "sampled"], prompt=40, output=6, draft_tokens=draft_tokens,
                              prefill_chunk=128)
    assert [(run["batch"], run["mode"]) for run in runs] == [(1, "greedy"), (1, "sampled"), (2, "greedy"),
                                                             (2, "sampled")]
    for run in runs:  # (every request's output reached its sink: served() checks the count)
        assert run["rounds"] >= 1 and run["tok_s"] > 0 and run["runner_ms"] > 0
        if not draft_tokens:  # a token a lane a round (a lane whose prefill ended first may finish a round early)
            assert run["rounds"] <= run["tokens"] <= run["rounds"] * run["batch"]
