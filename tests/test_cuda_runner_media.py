"""The CUDA runner's media path (Vision tower output as prefill embedding overrides, MTP included), run on HostDevice
over the kernels' twins: the same tokens as the per-sequence CPU model fed the injected embeddings."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact.reader import Artifact
from ninfer.backends.cuda.build import build_cuda_runner
from ninfer.backends.cuda.host import HostDevice
from ninfer.backends.cuda.vision import scratch_bytes, scratch_plan
from ninfer.engine.config import EngineConfig
from ninfer.engine.runner import VisionUnavailable
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.request import StopTokenPolicy
from ninfer.models.loader import build_model
from tests.support.tiny_vision_artifact import media_prompt, write_tiny_vision_artifact
from tests.test_engine_media import GREEDY, reference_greedy, words

HOST_BYTES = 8 << 30


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return Artifact.open(write_tiny_vision_artifact(tmp_path_factory.mktemp("vision") / "tiny.ninfer"))


@pytest.fixture(scope="module")
def model(artifact):
    return build_model(artifact, vision=True)


def generate(runner, config, prompt, max_tokens: int) -> list[int]:
    scheduler = Scheduler(runner, config)
    events = []
    scheduler.enqueue(scheduler.new_request(1, prompt, max_tokens, GREEDY, StopTokenPolicy(), events.append))
    while scheduler.has_work:
        scheduler.step()
    assert events[-1].error is None, events[-1].error
    return [t for e in events for t in e.tokens]


@pytest.mark.parametrize("draft_tokens,on_device", [(0, False), (2, False), (2, True)])
def test_media_prompt_matches_the_injected_reference(artifact, model, draft_tokens, on_device):
    """An image split over two prefill chunks and a video whose slices sit between text, with and without MTP
    speculation (the MTP head embeds the Vision rows one column early)."""
    patch_row = model.dims.vision.patch_row
    prompt = media_prompt([words(1, 122), ("image", (1, 8, 8), 11), words(2, 3), ("video", (4, 4, 4), 12, [7, 8]),
                           words(3, 4)], patch_row=patch_row)
    assert prompt.media[0].columns[0] < 128 < prompt.media[0].columns[-1]  # the image spans two chunks
    config = EngineConfig(max_concurrency=1, max_context=512, prefill_chunk=128, kv_capacity=512,
                          spec="mtp" if draft_tokens else None, draft_tokens=draft_tokens)
    build = build_cuda_runner(artifact, config, device=HostDevice(HOST_BYTES), vision=True,
                              vision_on_device=on_device)  # on_device: the GPU tower's code over the twins
    assert build.runner.info.vision
    got = generate(build.runner, config, prompt, 8)
    assert got == reference_greedy(model, prompt, 8)
    if on_device:  # one arena, charged at startup for the largest item the context admits (2x2 patches a token)
        arena = scratch_bytes(scratch_plan(model.dims.vision, max_patches=4 * config.max_context))
        assert build.ledger["vision scratch"] == build.device.ledger["vision scratch"] == arena


def test_without_the_tower_media_is_refused(artifact, model):
    config = EngineConfig(max_concurrency=1, max_context=256, prefill_chunk=128, kv_capacity=256)
    runner = build_cuda_runner(artifact, config, device=HostDevice(HOST_BYTES)).runner
    assert not runner.info.vision
    prompt = media_prompt([words(1, 3), ("image", (1, 4, 4), 5)], patch_row=model.dims.vision.patch_row)
    with pytest.raises(VisionUnavailable):
        runner.encode_media(prompt.media[0])


def test_the_mtp_head_reads_the_vision_rows(artifact, model):
    """The MTP KV after a media prompt's prefill equals the CPU runner's (which the engine tests tie to the
    reference): MTP row r embeds the next token of its column, so a placeholder's Vision row enters one column early."""
    from ninfer.backends.cpu.runner import CpuRunner
    from ninfer.artifact.codec import bf16_bits_to_f32

    prompt = media_prompt([words(4, 120), ("image", (1, 8, 8), 21), words(5, 6)],
                          patch_row=model.dims.vision.patch_row)
    config = EngineConfig(max_concurrency=1, max_context=512, prefill_chunk=128, kv_capacity=512, spec="mtp",
                          draft_tokens=2)
    cuda_runner = build_cuda_runner(artifact, config, device=HostDevice(HOST_BYTES), vision=True).runner
    cpu_runner = CpuRunner(model, lanes=1, pages=8, draft_tokens=2)
    for runner in (cuda_runner, cpu_runner):
        generate(runner, config, prompt, 1)
    length = len(prompt) - 1  # the MTP KV covers every column but the last (its next token is the output)
    want = np.stack(cpu_runner._mtp_kv.read(np.arange(8, dtype=np.int32), length))
    pool, pages = cuda_runner._model.mtp_kv, np.arange(8)

    def gather(store):
        return bf16_bits_to_f32(store[pages].reshape((-1,) + store.shape[2:])[:length])

    got = np.stack([gather(pool.k), gather(pool.v)])
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error < 2e-2, error  # bf16 rounding of the chunk's cuBLAS activations: ~7e-3; without the rows: ~0.3
