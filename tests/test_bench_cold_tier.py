"""bench/cold_tier_ttft.py's measurement runs on a HostDevice with a tiny model and a host arena (CPU), so a 2-GPU
run spends its minutes measuring."""

from __future__ import annotations

import importlib

from ninfer.artifact.reader import Artifact
from ninfer.backends.cuda.build import build_cuda_runner
from ninfer.backends.cuda.host import HostDevice
from ninfer.engine.config import EngineConfig
from tests.support.cuda_models import write_tiny_qwen_artifact
from tests.test_cold_tier import HostArena

def test_the_measurement_runs_and_the_restored_turn_continues_the_sequence(tmp_path):
    bench = importlib.import_module("bench.cold_tier_ttft")
    path = write_tiny_qwen_artifact(tmp_path / "tiny.ninfer", moe=False, recipe="bf16")
    config = EngineConfig(max_concurrency=2, max_context=512, prefill_chunk=128, kv_capacity=1024)
    runner = build_cuda_runner(Artifact.open(path), config, device=HostDevice(8 << 30)).runner
    rows = bench.run(runner, HostArena(256 << 20), [200], 128, 500)
    assert rows[0]["parked"] and rows[0]["image_bytes"] > 0
    assert rows[0]["ttft_restored_seconds"] > 0 and rows[0]["ttft_prefilled_seconds"] > 0
