"""The cross-GPU cold tier's engine logic (serving.md "Cross-GPU cold tier"), with host-memory arenas standing in
for the secondary devices: parking, LRU eviction, best-effort failures, and conversations that return to a full pool
restoring their state instead of re-prefilling it, with the same greedy tokens as a pool that keeps them all."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.backends.cpu.runner import CpuRunner
from ninfer.engine.cold_tier import ColdTier, host_image
from ninfer.engine.config import EngineConfig
from ninfer.engine.prefix import Residency
from ninfer.engine.request import PreparedPrompt, StopTokenPolicy
from ninfer.engine.runner import LaneImage
from ninfer.engine.scheduler import Scheduler
from tests.test_runner_cpu import GREEDY, tiny_qwen


class HostArena:
    """An arena in host memory; `fail` makes its transfers raise (an injected device failure)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._bytes = np.zeros(capacity_bytes, np.uint8)
        self.fail = False

    def write(self, offset: int, data: np.ndarray) -> None:
        if self.fail:
            raise OSError("injected transfer failure")
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._bytes[offset:offset + flat.size] = flat

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        if self.fail:
            raise OSError("injected transfer failure")
        return self._bytes[offset:offset + nbytes].copy()

    def read_into(self, offset: int, destination: np.ndarray) -> None:
        flat = destination.reshape(-1).view(np.uint8)
        flat[...] = self.read(offset, flat.size)


class FailingArena:
    """Stands in for `arena` with every transfer raising (an injected device failure)."""

    def __init__(self, arena) -> None:
        self.capacity_bytes = arena.capacity_bytes

    def write(self, offset: int, data: np.ndarray) -> None:
        raise OSError("injected transfer failure")

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        raise OSError("injected transfer failure")

    def read_into(self, offset: int, destination) -> None:
        raise OSError("injected transfer failure")


def image(seed: int, size: int = 1000) -> LaneImage:
    rng = np.random.default_rng(seed)
    return LaneImage(tokens=70, pages=2, has_tail=True,
                     arrays={"kv/3/k": rng.integers(0, 65535, (2, size), dtype=np.uint16),
                             "state/0/conv": rng.standard_normal((3, 7)).astype(np.float32)})


def residency(frontier: int) -> Residency:
    resident = Residency()
    resident.ledger.assign(np.arange(frontier + 1, dtype=np.int32), np.tile(np.arange(frontier + 1), (3, 1)), ())
    resident.frontier = frontier
    return resident


# ---- the tier alone ----

def test_a_parked_image_comes_back_bitwise():
    tier = ColdTier([HostArena(1 << 20)])
    original = image(1)
    assert tier.park(residency(70), original)
    key, plan = tier.best_match(PreparedPrompt(token_ids=np.arange(90)))
    assert plan.frontier == 70
    _, restored = tier.take(key)
    assert tier.entries == 0 and tier.used_bytes > 0  # the range stays reserved until finish
    restored = host_image(restored)
    assert restored.arrays.keys() == original.arrays.keys()
    for name, value in original.arrays.items():
        assert restored.arrays[name].dtype == value.dtype
        np.testing.assert_array_equal(restored.arrays[name], value)
    tier.finish(key, restored=True)
    assert tier.used_bytes == 0 and tier.counters.parks == tier.counters.restores == 1


def test_parking_evicts_the_oldest_entries_and_refuses_an_oversize_image():
    one = image(0).nbytes
    tier = ColdTier([HostArena(3 * one + 1024)])
    for seed in range(5):
        assert tier.park(residency(10 + seed), image(seed))
    assert tier.entries == 3 and tier.counters.evictions == 2
    prompt = PreparedPrompt(token_ids=np.arange(40))
    assert tier.best_match(prompt)[1].frontier == 14  # the newest matching entry survived
    assert not tier.park(residency(5), image(9, size=10 * one))
    assert tier.counters.park_failures == 1 and tier.entries == 3


def test_failed_transfers_are_counted_and_forgotten():
    arena = HostArena(1 << 20)
    tier = ColdTier([arena])
    arena.fail = True
    assert not tier.park(residency(20), image(1))
    arena.fail = False
    assert tier.park(residency(20), image(1))
    arena.fail = True
    key, _ = tier.best_match(PreparedPrompt(token_ids=np.arange(30)))
    _, taken = tier.take(key)
    with pytest.raises(OSError):
        host_image(taken)
    tier.finish(key, restored=False)
    assert tier.counters.park_failures == 1 and tier.counters.restore_failures == 1 and tier.entries == 0
    assert tier.used_bytes == 0


# ---- conversations through the scheduler ----

def run(scheduler: Scheduler, prompt: PreparedPrompt, max_tokens: int, request_id: int):
    events = []
    scheduler.enqueue(scheduler.new_request(request_id, prompt, max_tokens, GREEDY, StopTokenPolicy(), events.append))
    while scheduler.has_work:
        scheduler.step()
    assert events[-1].error is None, events[-1].error
    return [t for e in events for t in e.tokens], events[-1].usage


def conversations(scheduler: Scheduler, count: int, turns: int) -> tuple[list[list[int]], list]:
    """`count` conversations taking turns in rotation: each turn appends the reply and a new user message."""
    histories = [list(np.random.default_rng(c).integers(0, 400, 60 + 7 * c)) for c in range(count)]
    outputs, usages, request_id = [[] for _ in range(count)], [], 0
    for turn in range(turns):
        for c in range(count):
            if turn:
                histories[c] += list(np.random.default_rng(100 * c + turn).integers(0, 400, 9))
            request_id += 1
            tokens, usage = run(scheduler, PreparedPrompt(token_ids=histories[c]), 6, request_id)
            outputs[c].append(tokens)
            usages.append((turn, usage))
            histories[c] += tokens
    return outputs, usages


def scheduler_for(model, *, lanes: int, pages: int, tier: ColdTier | None) -> Scheduler:
    config = EngineConfig(max_concurrency=lanes, max_context=256, prefill_chunk=128, kv_capacity=pages * 64)
    return Scheduler(CpuRunner(model, lanes=lanes, pages=pages), config, tier)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen()


@pytest.mark.parametrize("lanes,pages", [(1, 4), (2, 5)])  # in-place resets; admission evictions under pressure
def test_returning_conversations_restore_from_the_tier(model, lanes, pages):
    tier = ColdTier([HostArena(64 << 20)])
    got, usages = conversations(scheduler_for(model, lanes=lanes, pages=pages, tier=tier), 3, 3)
    want, _ = conversations(scheduler_for(model, lanes=3, pages=12, tier=None), 3, 3)
    assert got == want
    returns = [usage for turn, usage in usages if turn]
    assert tier.counters.restores == len(returns) and tier.counters.park_failures == 0
    for usage in returns:  # only the new user message and the last reply token are prefilled
        assert usage.reuse_path == "append_frontier" and usage.prefill_tokens == 10


def test_without_the_tier_the_returns_are_prefilled_again(model):
    _, usages = conversations(scheduler_for(model, lanes=1, pages=4, tier=None), 3, 2)
    assert all(usage.reuse_path == "full_reset" for turn, usage in usages if turn)


def test_failed_transfers_fall_back_to_a_full_prefill_with_the_same_tokens(model):
    arena = HostArena(64 << 20)
    arena.fail = True
    tier = ColdTier([arena])
    got, usages = conversations(scheduler_for(model, lanes=1, pages=4, tier=tier), 3, 2)
    want, _ = conversations(scheduler_for(model, lanes=3, pages=12, tier=None), 3, 2)
    assert got == want and tier.counters.restores == 0 and tier.counters.park_failures > 0
    assert all(usage.reuse_path == "full_reset" for turn, usage in usages if turn)


def test_the_request_log_fields_and_the_request_done_suffix():
    from ninfer.server.serving_context import _cold_tier_summary

    tier = ColdTier([HostArena(1 << 20)])
    tier.park(residency(20), image(1))
    stats = tier.stats()
    assert stats == {"cold_tier_parks": 1, "cold_tier_restores": 0, "cold_tier_evictions": 0,
                     "cold_tier_park_failures": 0, "cold_tier_restore_failures": 0,
                     "cold_tier_capacity_bytes": 1 << 20, "cold_tier_used_bytes": tier.used_bytes,
                     "cold_tier_entries": 1}
    assert _cold_tier_summary(stats) == " cold=parks=1 restores=0 failures=0 entries=1 evictions=0 used=0.00GiB"
    assert _cold_tier_summary(None) == ""


def test_the_tier_is_inactive_without_a_secondary_gpu():
    from ninfer.cli.serve import parse_serve_args
    from ninfer.nursery.startup import build_cold_tier

    options = parse_serve_args(["model.ninfer"])
    assert not build_cold_tier(options, on_gpu=False).active
    assert not build_cold_tier(parse_serve_args(["model.ninfer", "--no-cold-tier"]), on_gpu=True).active


@pytest.mark.gpu
def test_a_device_arena_on_the_secondary_gpu_round_trips_bytes():
    from ninfer.backends.cuda_probe import cuda_device_count

    if cuda_device_count() < 2:
        pytest.skip("needs two GPUs")
    from ninfer.backends.cuda.cold_arena import build_cold_arenas

    arenas, staging = build_cold_arenas(primary=0, devices=cuda_device_count(), pinned=-1, capacity_mib=64,
                                        staging_mib=1)
    assert arenas and staging.nbytes == 1 << 20
    tier = ColdTier(arenas)
    original = image(3, size=1_500_000)  # several staging pieces
    assert tier.park(residency(70), original)
    key, _ = tier.best_match(PreparedPrompt(token_ids=np.arange(90)))
    _, restored = tier.take(key)
    for name, value in original.arrays.items():
        np.testing.assert_array_equal(restored.arrays[name].host(), value)
    tier.finish(key, restored=True)


# ---- the CUDA runner's lane images through the tier (HostDevice here; two GPUs with the `gpu` marker) ----

@pytest.fixture(scope="module")
def qwen_artifact(tmp_path_factory):
    from tests.support.cuda_models import write_tiny_qwen_artifact

    return write_tiny_qwen_artifact(tmp_path_factory.mktemp("cold-tier") / "dense.ninfer", moe=False, recipe="bf16")


def cuda_scheduler(path, kind: str, *, lanes: int, pages: int, tier: ColdTier | None) -> Scheduler:
    from ninfer.artifact.reader import Artifact
    from ninfer.backends.cuda.build import build_cuda_runner
    from tests.test_cuda_runner import make_device

    config = EngineConfig(max_concurrency=lanes, max_context=256, prefill_chunk=128, kv_capacity=pages * 64)
    return Scheduler(build_cuda_runner(Artifact.open(path), config, device=make_device(kind)).runner, config, tier)


@pytest.mark.parametrize("kind", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cuda_runner_conversations_restore_from_the_tier(qwen_artifact, kind):
    """With kind "cuda" the arenas are real device memory on the second GPU, reached through pinned staging."""
    if kind == "cuda":
        from ninfer.backends.cuda.cold_arena import build_cold_arenas
        from ninfer.backends.cuda_probe import cuda_device_count

        if cuda_device_count() < 2:
            pytest.skip("needs two GPUs")
        arenas, _ = build_cold_arenas(primary=0, devices=cuda_device_count(), pinned=-1, capacity_mib=256,
                                      staging_mib=4)
    else:
        arenas = [HostArena(64 << 20)]
    tier = ColdTier(arenas)
    got, usages = conversations(cuda_scheduler(qwen_artifact, kind, lanes=1, pages=4, tier=tier), 3, 3)
    want, _ = conversations(cuda_scheduler(qwen_artifact, kind, lanes=3, pages=12, tier=None), 3, 3)
    assert got == want
    returns = [usage for turn, usage in usages if turn]
    assert tier.counters.restores == len(returns) and tier.counters.park_failures == 0
    assert all(usage.reuse_path == "append_frontier" and usage.prefill_tokens == 10 for usage in returns)
    failing = ColdTier([FailingArena(arena) for arena in arenas])  # injected failures: full prefills, same tokens
    got, usages = conversations(cuda_scheduler(qwen_artifact, kind, lanes=1, pages=4, tier=failing), 3, 2)
    assert got == [outputs[:2] for outputs in want] and failing.counters.restores == 0
    assert all(usage.reuse_path == "full_reset" for turn, usage in usages if turn)
