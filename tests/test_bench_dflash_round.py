"""bench/dflash_round.py's measurement code runs end to end on a HostDevice with the tiny DFlash model (CPU), so the
GPU run spends its minutes measuring, not finding bugs in the script."""

from __future__ import annotations

import importlib

import pytest

from tests.support.cuda_models import cuda_tiny_dims
from tests.support.tiny_dflash import tiny_dflash_dims


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench.dflash_round")


@pytest.mark.parametrize("recipe", ["bf16", "ninfer-v2"])
def test_every_round_measurement_runs_on_the_host_device(bench, recipe):
    from ninfer.backends.cuda.host import HostDevice

    target = cuda_tiny_dims(moe=True)
    result = bench.bench_dflash(recipe, device=HostDevice(), dims=target,
                                drafter=tiny_dflash_dims(target, window=24, intermediate=128), k=7,
                                contexts=(30, 70), batches=(1, 2), repeats=2)
    assert [(row["context"], row["batch"]) for row in result["rounds"]] == [(30, 1), (30, 2), (70, 1), (70, 2)]
    for row in result["rounds"]:
        assert row["round_ms"] > 0 and row["draft_graph_ms"] > 0 and row["verify_graph_ms"] > 0
        assert list(row["tok_s_at_tokens_per_round"]) == ["4.6", "5.1", "5.6"]
