"""Images and videos through the engine and the CPU runner (issue "Vision", items 4 and 5).

* Embedding overrides: a prefill chunk's rows replace the placeholder embeddings exactly as if the embeddings had been
  injected (model level, bitwise; runner and engine level, greedy tokens of the per-sequence reference), in the MTP
  head too, and independently of how prefill is chunked.
* Encoding: once per item per request however many chunks cover it, never for items inside the reused prefix.
* Prefix reuse: media identity (digest, grid, modality) and spans are part of a reuse point's identity.
"""

from __future__ import annotations

import collections

import attrs
import numpy as np
import pytest

from ninfer.backends.cpu.ops import Segment
from ninfer.backends.cpu.runner import CpuRunner
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.engine.prefix import CheckpointKind, ReusePath, Residency, media_prefix_matches, plan_reuse
from ninfer.engine.request import PreparedPrompt, RequestOptions, StopTokenPolicy
from ninfer.engine.runner import PrefillChunk, SequenceStart, StateSource, VisionUnavailable
from ninfer.engine.sampler import SamplingParams
from ninfer.engine.scheduler import MediaUnsupported, Scheduler
from ninfer.targets.registry import QWEN_27B_PRESETS
from tests.support.tiny_vision_artifact import media_item, media_prompt, tiny_vision_qwen

GREEDY = SamplingParams.greedy()


@pytest.fixture(scope="module")
def model():
    return tiny_vision_qwen()


@pytest.fixture(scope="module")
def patch_row(model):
    return model.dims.vision.patch_row


def words(seed: int, count: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 400, count).tolist()


def injected(model, prompt: PreparedPrompt) -> np.ndarray:
    """The prompt's input embeddings with every item's Vision rows written over its placeholder columns."""
    x = model.embed(prompt.token_ids).copy()
    for item in prompt.media:
        x[item.columns] = CpuRunner(model, lanes=1, pages=1).encode_media(item)
    return x


def reference_greedy(model, prompt: PreparedPrompt, count: int) -> list[int]:
    """Greedy tokens of the per-sequence model fed the injected embeddings (decode positions continue §3.12)."""
    vocab = model.dims.vocab_ids
    state = model.new_state()
    logits = model.forward_embeddings(state, injected(model, prompt), positions=prompt.rope_positions).logits
    tokens = [int(np.argmax(logits[-1][:vocab]))]
    while len(tokens) < count:
        logits = model.forward(state, np.array(tokens[-1:])).logits
        tokens.append(int(np.argmax(logits[-1][:vocab])))
    return tokens


class CountingRunner(CpuRunner):
    """A CPU runner that records which items it encoded (by digest) and every prefill chunk's overrides."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.encoded: collections.Counter = collections.Counter()
        self.chunks: list[PrefillChunk] = []

    def encode_media(self, item):
        self.encoded[item.digest] += 1
        return super().encode_media(item)

    def prefill(self, chunk):
        self.chunks.append(chunk)
        return super().prefill(chunk)


class Harness:
    """A scheduler over a counting CPU runner, driven synchronously."""

    def __init__(self, model, *, lanes: int = 1, max_context: int = 1024, prefill_chunk: int = 128,
                 prefix_reuse: bool = True, draft_tokens: int = 0) -> None:
        pages = lanes * -(-max_context // 64)
        self.runner = CountingRunner(model, lanes=lanes, pages=pages, draft_tokens=draft_tokens)
        self.config = EngineConfig(max_concurrency=lanes, max_context=max_context, prefill_chunk=prefill_chunk,
                                   prefix_reuse=prefix_reuse, spec="mtp" if draft_tokens else None,
                                   draft_tokens=draft_tokens)
        self.scheduler = Scheduler(self.runner, self.config)
        self.events: dict[int, list] = collections.defaultdict(list)
        self._next = 1

    def mtp_kv(self, length: int) -> np.ndarray:
        """The MTP KV (K and V stacked) of lane 0's first `length` tokens."""
        table = self.scheduler.lanes[0].pages
        return np.stack(self.runner._mtp_kv.read(np.array(table, np.int32), length))

    def generate(self, prompt: PreparedPrompt, max_tokens: int = 6):
        """Run one request to its end: (tokens, final event)."""
        request_id, self._next = self._next, self._next + 1
        request = self.scheduler.new_request(request_id, prompt, max_tokens, GREEDY, StopTokenPolicy(),
                                             self.events[request_id].append)
        self.scheduler.enqueue(request)
        while self.scheduler.has_work:
            self.scheduler.step()
        events = self.events[request_id]
        assert events[-1].finish is not None and events[-1].error is None
        return [t for e in events for t in e.tokens], events[-1]


def continued(first_parts: list, generated: list[int], parts: list, patch_row: int) -> PreparedPrompt:
    """The next turn: the first prompt's parts, its generated tokens, then `parts`."""
    return media_prompt(first_parts + [generated] + parts, patch_row=patch_row)


# ---- the model and the runner ----

def test_forward_batch_overrides_are_injected_embeddings_bitwise(model, patch_row):
    prompt = media_prompt([words(1, 5), ("image", (1, 4, 6), 11), words(2, 4)], patch_row=patch_row)
    x = injected(model, prompt)
    columns = np.concatenate([item.columns for item in prompt.media])
    state, other = model.new_state(), model.new_state()
    got = model.forward_batch(prompt.token_ids, prompt.rope_positions, [Segment(slice(0, len(prompt)), state.layers)],
                              embedding_columns=columns, embedding_rows=x[columns])
    want = model.forward_embeddings(other, x, positions=prompt.rope_positions, logits="all").hidden
    np.testing.assert_array_equal(got, want)
    plain = model.forward_batch(prompt.token_ids, prompt.rope_positions,
                                [Segment(slice(0, len(prompt)), model.new_state().layers)])
    assert np.abs(plain[-1] - got[-1]).max() > 1e-3  # the overrides matter


def test_encode_media_is_the_vision_tower_over_float32_patches(model, patch_row):
    from ninfer.artifact.codec import bf16_bits_to_f32

    item = media_item("video", (2, 4, 4), range(10, 18), seed=3, patch_row=patch_row)
    rows = CpuRunner(model, lanes=1, pages=1).encode_media(item)
    assert rows.dtype == np.float32 and rows.shape == (8, model.dims.hidden)
    np.testing.assert_array_equal(rows, model.vision_tower.encode(bf16_bits_to_f32(item.patches), [(2, 4, 4)]))
    with pytest.raises(ValueError, match="placeholder columns"):
        CpuRunner(model, lanes=1, pages=1).encode_media(attrs.evolve(item, columns=range(10, 17)))


def test_a_runner_without_vision_refuses_media(patch_row):
    text_only = tiny_vision_qwen(vision=False)
    runner = CpuRunner(text_only, lanes=1, pages=4)
    assert runner.info.vision is False
    item = media_item("image", (1, 2, 2), [3], seed=1, patch_row=patch_row)
    with pytest.raises(VisionUnavailable):
        runner.encode_media(item)
    scheduler = Scheduler(runner, EngineConfig(max_concurrency=1, max_context=256, prefill_chunk=128))
    prompt = media_prompt([words(1, 3), ("image", (1, 2, 2), 1)], patch_row=patch_row)
    with pytest.raises(MediaUnsupported, match="--vision"):
        scheduler.new_request(1, prompt, 4, GREEDY, StopTokenPolicy(), lambda event: None)
    runner.begin_sequence(0, SequenceStart(source=StateSource.RESET, sampling=GREEDY))
    with pytest.raises(VisionUnavailable):
        runner.prefill(PrefillChunk(lane=0, token_ids=[1, 2], positions=np.zeros((3, 2)), kv_length=0,
                                    tail_position=np.zeros(3), final=True, remaining=1,
                                    embedding_columns=[1], embedding_rows=np.zeros((1, 32))))


def test_prefill_chunk_checks_its_overrides():
    base = dict(lane=0, token_ids=[1, 2, 3], positions=np.zeros((3, 3)), kv_length=0, tail_position=np.zeros(3),
                final=False, remaining=1)
    assert not PrefillChunk(**base).has_embeddings
    assert PrefillChunk(**base, embedding_columns=[0, 2], embedding_rows=np.zeros((2, 8))).has_embeddings
    for columns, rows in [([0, 3], np.zeros((2, 8))), ([2, 1], np.zeros((2, 8))), ([0], np.zeros((2, 8))),
                          ([0], np.zeros(8))]:
        with pytest.raises(ValueError):
            PrefillChunk(**base, embedding_columns=columns, embedding_rows=rows)


# ---- the engine: exact outputs and encode counts ----

def test_media_prompt_generates_the_injected_reference_and_encodes_each_item_once(model, patch_row):
    # An image that straddles the 128-token chunk boundary, and a video whose slices are 300 text tokens apart: one
    # chunk lies wholly between its slices.
    parts = [words(1, 125), ("image", (1, 4, 6), 21), words(2, 30), ("video", (2, 4, 4), 22, words(3, 300)),
             words(4, 10)]
    prompt = media_prompt(parts, patch_row=patch_row)
    h = Harness(model)
    tokens, final = h.generate(prompt)
    assert tokens == reference_greedy(model, prompt, 6)
    assert sorted(h.runner.encoded.values()) == [1, 1]
    assert final.usage.timings.vision > 0 and final.usage.prefill_tokens == len(prompt)
    covered = [len(chunk.embedding_columns) for chunk in h.runner.chunks]
    assert sum(covered) == sum(len(item.columns) for item in prompt.media) and 0 in covered
    assert [len(c.token_ids) for c in h.runner.chunks][:2] == [128, 128]
    assert covered[2] == 0 and covered[3] == 4  # the video's rows outlive the chunk between its slices


def test_overrides_do_not_depend_on_chunking(model, patch_row):
    parts = [words(5, 100), ("image", (1, 6, 6), 31), words(6, 60), ("image", (1, 4, 4), 32), words(7, 5)]
    prompt = media_prompt(parts, patch_row=patch_row)
    small, _ = Harness(model, prefill_chunk=128).generate(prompt, 8)
    large, _ = Harness(model, prefill_chunk=512).generate(prompt, 8)
    assert small == large == reference_greedy(model, prompt, 8)


def test_mtp_sees_vision_embeddings_and_speculation_keeps_greedy_output(model, patch_row, monkeypatch):
    # The image starts exactly at the 128 boundary (the bridge column's next token is its first pad), the second
    # straddles 256.
    parts = [words(8, 128), ("image", (1, 4, 8), 41), words(9, 120), ("image", (1, 4, 4), 42), words(10, 20)]
    prompt = media_prompt(parts, patch_row=patch_row)
    plain, _ = Harness(model).generate(prompt, 10)
    drafts, kv = [], []
    for chunk in (128, 512):
        h = Harness(model, prefill_chunk=chunk, draft_tokens=2)
        tokens, final = h.generate(prompt, 10)
        assert tokens == plain
        drafts.append(attrs.asdict(final.usage.speculative))
        kv.append(h.mtp_kv(len(prompt)))
    assert drafts[0] == drafts[1]
    np.testing.assert_array_equal(kv[0], kv[1])  # the MTP KV (bridge columns included) does not depend on chunking

    # The MTP input of a column whose next token is a placeholder is that placeholder's Vision row.
    runner = CpuRunner(model, lanes=1, pages=8, draft_tokens=2)
    seen = []
    original = model.mtp_forward_batch

    def spy(hidden, next_ids, positions, segments, **overrides):
        seen.append(overrides)
        return original(hidden, next_ids, positions, segments, **overrides)

    monkeypatch.setattr(model, "mtp_forward_batch", spy)
    item = prompt.media[0]
    runner.begin_sequence(0, SequenceStart(source=StateSource.RESET, sampling=GREEDY))
    runner.assign_pages(0, np.arange(8))
    rows = runner.encode_media(item)
    runner.prefill(PrefillChunk(lane=0, token_ids=prompt.token_ids, positions=prompt.rope_positions,
                                kv_length=0, tail_position=np.zeros(3), final=True, remaining=10,
                                embedding_columns=item.columns, embedding_rows=rows))
    np.testing.assert_array_equal(seen[0]["embedding_columns"], item.columns - 1)  # no bridge row at kv_length 0
    np.testing.assert_array_equal(seen[0]["embedding_rows"], rows)


# ---- prefix reuse ----

FIRST = [words(10, 20), ("image", (1, 4, 4), 51), words(11, 8), ("image", (1, 4, 6), 52), words(12, 6)]


def test_the_same_images_are_reused_and_not_encoded_again(model, patch_row):
    h = Harness(model)
    first = media_prompt(FIRST, patch_row=patch_row)
    generated, _ = h.generate(first)
    assert len(h.runner.encoded) == 2
    h.runner.encoded.clear()
    second = continued(FIRST, generated, [words(13, 9)], patch_row)
    tokens, final = h.generate(second)
    assert final.usage.reuse_path == ReusePath.APPEND_FRONTIER.value
    assert final.usage.cached_tokens == len(first) + len(generated) - 1
    assert not h.runner.encoded and final.usage.timings.vision == 0.0
    assert tokens == Harness(model, prefix_reuse=False).generate(second)[0] == reference_greedy(model, second, 6)


def test_a_new_suffix_image_is_the_only_one_encoded(model, patch_row):
    h = Harness(model)
    first = media_prompt(FIRST, patch_row=patch_row)
    generated, _ = h.generate(first)
    h.runner.encoded.clear()
    second = continued(FIRST, generated, [words(14, 4), ("image", (1, 6, 4), 53), words(15, 3)], patch_row)
    tokens, final = h.generate(second)
    assert final.usage.cached_tokens == len(first) + len(generated) - 1
    assert dict(h.runner.encoded) == {second.media[2].digest: 1}
    assert tokens == reference_greedy(model, second, 6)


def test_a_changed_earlier_image_is_not_reused_past_its_first_column(model, patch_row):
    h = Harness(model)
    first = media_prompt(FIRST, patch_row=patch_row)
    generated, _ = h.generate(first)
    h.runner.encoded.clear()
    changed = list(FIRST)
    changed[3] = ("image", (1, 4, 6), 99)  # same grid, so the same token ids and positions: only the digest differs
    second = continued(changed, generated, [words(13, 9)], patch_row)
    assert np.array_equal(second.token_ids[:len(first)], first.token_ids)
    tokens, final = h.generate(second)
    assert final.usage.cached_tokens <= int(second.media[1].columns[0])
    assert final.usage.reuse_path == ReusePath.FULL_RESET.value  # no checkpoint before it: a full reset
    assert h.runner.encoded == collections.Counter({second.media[0].digest: 1, second.media[1].digest: 1})
    assert tokens == reference_greedy(model, second, 6)


def test_a_changed_image_falls_back_to_a_checkpoint_before_it(model, patch_row):
    h = Harness(model)
    head = [words(16, 12)]
    first = media_prompt(head + [("image", (1, 4, 4), 61), words(17, 5)], patch_row=patch_row, assistant_boundary=8)
    generated, _ = h.generate(first)
    h.runner.encoded.clear()
    second = media_prompt(head + [("image", (1, 4, 4), 62), words(17, 5), generated, words(18, 3)],
                          patch_row=patch_row, assistant_boundary=8)
    tokens, final = h.generate(second)
    assert (final.usage.reuse_path, final.usage.cached_tokens) == (ReusePath.RESTORE_TURN_CHECKPOINT.value, 8)
    assert dict(h.runner.encoded) == {second.media[0].digest: 1}
    assert tokens == reference_greedy(model, second, 6)


def test_media_identity_rules_of_a_reuse_point(patch_row):
    prompt = media_prompt([words(20, 10), ("image", (1, 4, 4), 71), words(21, 10)], patch_row=patch_row)
    item = prompt.media[0]  # columns 10..13
    resident = Residency(frontier=len(prompt), checkpoints={CheckpointKind.TURN: 5})
    resident.ledger.assign(prompt.token_ids, prompt.rope_positions, prompt.media)
    assert plan_reuse(resident, prompt).path is ReusePath.APPEND_FRONTIER
    for different in (attrs.evolve(item, digest="0" * 64), attrs.evolve(item, modality="video"),
                      attrs.evolve(item, grid=(1, 2, 8))):
        other = attrs.evolve(prompt, media=(different,))
        plan = plan_reuse(resident, other)
        assert (plan.path, plan.frontier) == (ReusePath.RESTORE_TURN_CHECKPOINT, 5)
    spans = resident.ledger.media
    assert media_prefix_matches(spans, prompt.media, 10) and media_prefix_matches(spans, prompt.media, 14)
    assert not media_prefix_matches(spans, prompt.media, 12)  # a point never splits an item
    assert not media_prefix_matches(spans, (), 14) and media_prefix_matches(spans, (), 10)
    moved = attrs.evolve(item, columns=item.columns + 1)
    assert not media_prefix_matches(spans, (moved,), 20)
    text_only = PreparedPrompt(token_ids=prompt.token_ids, positions=prompt.positions)
    assert plan_reuse(resident, text_only).frontier == 5  # the same ids without the media are different tokens


def test_engine_reports_vision_seconds(model, patch_row):
    runner = CpuRunner(model, lanes=1, pages=8)
    config = EngineConfig(max_concurrency=1, max_context=512, prefill_chunk=128, greedy=True)
    prompt = media_prompt([words(30, 6), ("image", (1, 4, 4), 81), words(31, 4)], patch_row=patch_row)
    with Engine(runner, config, QWEN_27B_PRESETS) as engine:
        assert engine.vision
        done = engine.submit(prompt, RequestOptions(max_tokens=3)).result(timeout=60)
    assert done.usage.timings.vision > 0 and len(done.tokens) == 3
    assert done.tokens == tuple(reference_greedy(model, prompt, 3))


def test_a_suffix_that_starts_with_an_image_bridges_mtp_through_its_vision_row(model, patch_row):
    """Restoring a checkpoint right before an image: the MTP bridge column fuses the checkpoint's hidden row with the
    image's first Vision row, so drafts (hence counters) equal a run without reuse."""
    head = [words(40, 12)]
    first = media_prompt(head + [words(41, 5)], patch_row=patch_row, assistant_boundary=12)
    second_parts = head + [("image", (1, 4, 4), 91), words(42, 30)]
    runs, kv = [], []
    second = media_prompt(second_parts, patch_row=patch_row, assistant_boundary=12)
    for reuse in (True, False):
        h = Harness(model, draft_tokens=2)
        if reuse:
            h.generate(first, 4)
        # (the run without reuse has no checkpoint to stop at: its prompt is one chunk, no bridge at 12)
        tokens, final = h.generate(second if reuse else attrs.evolve(second, assistant_boundary=None), 12)
        runs.append((tokens, attrs.asdict(final.usage.speculative), final.usage.cached_tokens))
        kv.append(h.mtp_kv(len(second)))
    assert runs[0][2] == 12 and runs[1][2] == 0
    assert runs[0][:2] == runs[1][:2]
    np.testing.assert_array_equal(kv[0], kv[1])
