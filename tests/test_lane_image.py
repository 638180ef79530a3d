"""Lane images (`export_lane` / `import_lane`), the cold tier's primitive: a sequence copied out of one lane and
written into another lane with other pages continues exactly as if it had never moved, on the CPU runner and on the
CUDA runner (HostDevice here; the GPU with the `gpu` marker)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact.reader import Artifact
from ninfer.backends.cpu.runner import CpuRunner
from ninfer.engine.config import EngineConfig
from ninfer.engine.runner import SequenceStart, StateSource
from ninfer.models.loader import load_model
from tests.support.cuda_models import write_tiny_qwen_artifact
from tests.test_runner_cpu import GREEDY, Lane, decode_round, prompt

PAGES_PER_LANE = 4


@pytest.fixture(scope="module")
def artifact_path(tmp_path_factory):
    return write_tiny_qwen_artifact(tmp_path_factory.mktemp("lane-image") / "dense.ninfer", moe=False, recipe="bf16")


def make_runner(kind: str, path, draft_tokens: int):
    if kind == "cpu":
        return CpuRunner(load_model(path), lanes=3, pages=3 * PAGES_PER_LANE, draft_tokens=draft_tokens)
    from ninfer.backends.cuda.build import build_cuda_runner

    if kind == "cuda-host":
        from ninfer.backends.cuda.host import HostDevice

        device = HostDevice(8 << 30)
    else:
        from ninfer.backends.cuda.device import CudaDevice

        device = CudaDevice(0)
    config = EngineConfig(max_concurrency=3, max_context=256, prefill_chunk=128, kv_capacity=3 * 256,
                          spec="mtp" if draft_tokens else None, draft_tokens=draft_tokens)
    return build_cuda_runner(Artifact.open(path), config, device=device).runner


KINDS = ["cpu", "cuda-host", pytest.param("cuda-gpu", marks=pytest.mark.gpu)]


def continuation(runner, lane_index: int, moved: Lane) -> Lane:
    """A Lane driver for `moved`'s sequence now living on `lane_index` (its tokens and frontier so far)."""
    lane = object.__new__(Lane)
    lane.runner, lane.lane, lane.prompt, lane.budget = runner, lane_index, moved.prompt, moved.budget
    lane.tokens, lane.frontier, lane.drafts_ready = list(moved.tokens), moved.frontier, False
    return lane


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("draft_tokens", [0, 2])
def test_an_imported_lane_continues_as_if_it_never_moved(kind, artifact_path, draft_tokens):
    if kind == "cuda-gpu":
        pytest.importorskip("numba.cuda")
    reference_runner = make_runner(kind, artifact_path, draft_tokens)
    reference = Lane(reference_runner, 0, prompt(3, 70), budget=14)
    reference.prefill(64)
    while not reference.done:
        decode_round(reference_runner, [reference])

    runner = make_runner(kind, artifact_path, draft_tokens)
    first = Lane(runner, 0, prompt(3, 70), budget=14)
    first.prefill(64)
    for _ in range(3):
        decode_round(runner, [first])
    runner.save_checkpoint(0, 1)
    image = runner.export_lane(0, first.frontier)
    assert image.tokens == first.frontier and image.pages == 2 and image.has_tail and image.nbytes > 0
    runner.release(0)
    other = Lane(runner, 0, prompt(9, 90), budget=4)  # another sequence overwrites lane 0 and its pages
    other.prefill(128)

    runner.assign_pages(2, np.array([9, 10, 11, 8], np.int32))  # other pages, not in order
    runner.import_lane(2, image)
    again = runner.export_lane(2, image.tokens)
    assert image.arrays.keys() == again.arrays.keys()
    for name, value in image.arrays.items():
        np.testing.assert_array_equal(again.arrays[name], value, err_msg=name)
    runner.begin_sequence(2, SequenceStart(source=StateSource.RESIDENT, sampling=GREEDY))
    moved = continuation(runner, 2, first)
    while not moved.done:
        decode_round(runner, [moved])
    assert moved.tokens == reference.tokens


@pytest.mark.parametrize("kind", ["cpu", "cuda-host"])
def test_an_image_needs_the_pages_it_covers(kind, artifact_path):
    runner = make_runner(kind, artifact_path, 0)
    lane = Lane(runner, 0, prompt(3, 70), budget=2)
    lane.prefill(128)
    image = runner.export_lane(0, lane.frontier)
    runner.assign_pages(1, np.array([5], np.int32))
    with pytest.raises(ValueError, match="needs 2 pages"):
        runner.import_lane(1, image)
    with pytest.raises(ValueError, match="need 5 pages"):
        runner.export_lane(0, PAGES_PER_LANE * 64 + 1)
