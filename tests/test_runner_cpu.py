"""The CPU paged runner: paged KV against the per-sequence model, row invariance (batch, chunk, verify), checkpoints.

Also home of the tiny random Qwen models the engine tests share: built straight from the converter's tensor
inventory with a 512-token vocabulary, so they cost milliseconds and need no transformers.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.backends.cpu.ops import Segment
from ninfer.backends.cpu.paged_kv import KVPageError, PagedKVView, PagedLayerKV, dequantize_int8, quantize_int8
from ninfer.backends.cpu.runner import CpuRunner, build_cpu_runner, runner_kv_bytes_per_token, runner_state_bytes
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs
from ninfer.engine.config import EngineConfig
from ninfer.engine.kv_pool import AUTO_HEADROOM_BYTES
from ninfer.engine.runner import DecodeBatch, PrefillChunk, SequenceStart, StateSource
from ninfer.engine.sampler import SamplingParams
from ninfer.models.base import DictWeights
from ninfer.models.llama import LlamaModel
from ninfer.models.qwen3_6 import Qwen36Model
from ninfer.targets.dims import LlamaDims, QwenDims

GREEDY = SamplingParams.greedy()
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, presence_penalty=0.5, seed=7)


def tiny_qwen_dims(*, moe: bool = False, vocab: int = 512, vocab_ids: int | None = None) -> QwenDims:
    """4 layers (3 GDN + 1 full attention) of width 32; dense, or MoE with 4 experts top-2. The head has `vocab`
    rows of which `vocab_ids` (default: all but 12 padding rows) can be emitted."""
    ffn = dict(moe_experts=4, moe_top_k=2, moe_intermediate=16, shared_intermediate=16) if moe else \
        dict(intermediate=64)
    attention = dict(attn_heads=4, kv_heads=1, head_dim=32, rotary_dim=8, mrope_section=(2, 1, 1)) if moe else \
        dict(attn_heads=4, kv_heads=2, head_dim=64, rotary_dim=16, mrope_section=(3, 3, 2))
    return QwenDims(hidden=32, layer_types=("linear_attention",) * 3 + ("full_attention",), vocab_rows=vocab,
                    vocab_ids=vocab - 12 if vocab_ids is None else vocab_ids, rope_theta=1e7, gdn_qk_heads=2,
                    gdn_v_heads=4, gdn_k_dim=16, gdn_v_dim=16, conv_kernel=4, rms_eps=1e-6, mtp_layers=1,
                    **attention, **ffn)


def tiny_qwen(*, moe: bool = False, vocab: int = 512, vocab_ids: int | None = None, seed: int = 0,
              predictable: bool = False, dims: QwenDims | None = None) -> Qwen36Model:
    """A random tiny Qwen3.6 model with every tensor the converter would write (MTP and draft head included).

    `predictable` scales every mixer and FFN output down and makes the MTP head read the next token's embedding,
    so the target is nearly a bigram model that the MTP head predicts well: speculative rounds accept most drafts
    without accepting all of them. `dims` replaces the default tiny dimensions (the CUDA tests need widths that
    are multiples of 64).
    """
    dims = dims or tiny_qwen_dims(moe=moe, vocab=vocab, vocab_ids=vocab_ids)
    rng = np.random.default_rng(seed)
    tensors = {}
    for spec in plan_qwen_tensor_specs(dims):
        name, shape = spec.name, spec.shape
        if name.endswith("a_log"):
            value = np.log(rng.uniform(1.0, 16.0, shape))
        elif len(shape) == 1:  # norm weights far from 0 (the offset form matters) and dt_bias
            value = rng.normal(0.0, 0.4, shape)
        elif name == "text/token_embedding" or name.endswith("convolution"):
            value = rng.normal(0.0, 1.0, shape)
        else:
            value = rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape)
        tensors[name] = value.astype(np.float32)
    # The draft head is a shortlist (every other id) gathered from the output head, as the converter builds it.
    shortlist = np.arange(0, dims.vocab_ids, 2, dtype=np.int32)
    tensors["text/draft_head"], tensors["text/draft_head_token_ids"] = tensors["text/output_head"][shortlist], shortlist
    if predictable:
        for name in tensors:
            if name.endswith(("/output", "/down", "_down")):
                tensors[name] = tensors[name] * np.float32(0.05)
        for name in ("text/final_norm", "mtp/embedding_norm", "mtp/final_norm"):
            tensors[name] = np.zeros_like(tensors[name])
        h = dims.hidden
        tensors["mtp/input_projection"] = np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(np.float32)
    return Qwen36Model(dims, DictWeights(tensors))


def tiny_llama(seed: int = 0) -> LlamaModel:
    """A random 2-layer llama (the demo model's family) with a tied 300-token head."""
    d = LlamaDims(hidden=32, layers=2, vocab_rows=300, vocab_ids=300, attn_heads=4, kv_heads=2, head_dim=8,
                  intermediate=64, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True)
    rng = np.random.default_rng(seed)
    shapes = {"text/token_embedding": (300, 32), "text/final_norm": (32,)}
    for i in range(d.layers):
        shapes.update({f"text/layers/{i}/input_norm": (32,), f"text/layers/{i}/post_attention_norm": (32,),
                       f"text/layers/{i}/attention/query_key_value": (64, 32),
                       f"text/layers/{i}/attention/output": (32, 32), f"text/layers/{i}/mlp/gate_up": (128, 32),
                       f"text/layers/{i}/mlp/down": (32, 64)})
    tensors = {name: (1.0 + rng.normal(0.0, 0.2, shape) if len(shape) == 1 else
                      rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape)).astype(np.float32)
               for name, shape in shapes.items()}
    return LlamaModel(d, DictWeights(tensors))


def text_positions(start: int, count: int) -> np.ndarray:
    return np.tile(np.arange(start, start + count, dtype=np.int32), (3, 1))


class Lane:
    """Drives one sequence on a runner lane, the way the engine would: prefill in chunks, then decode rounds."""

    def __init__(self, runner: CpuRunner, lane: int, prompt: np.ndarray, *, sampling: SamplingParams = GREEDY,
                 budget: int = 32, checkpoint: tuple[int, int] | None = None) -> None:
        """`checkpoint` = (slot, position): start from that checkpoint instead of a reset lane (pages kept)."""
        self.runner, self.lane, self.prompt, self.budget = runner, lane, np.asarray(prompt), budget
        if checkpoint is None:
            runner.assign_pages(lane, np.arange(lane * 4, lane * 4 + 4))
            start = SequenceStart(source=StateSource.RESET, sampling=sampling)
        else:
            start = SequenceStart(source=StateSource.CHECKPOINT, checkpoint_slot=checkpoint[0], sampling=sampling)
        runner.begin_sequence(lane, start)
        self.tokens: list[int] = []
        self.frontier = 0 if checkpoint is None else checkpoint[1]
        self.drafts_ready = False

    def prefill(self, *chunks: int) -> None:
        """Prefill the rest of the prompt in chunks of these sizes (the last chunk takes the rest)."""
        bounds = self.frontier + np.cumsum([0, *chunks])
        bounds = [int(b) for b in bounds if b < len(self.prompt)] + [len(self.prompt)]
        for start, end in zip(bounds, bounds[1:]):
            self.prefill_span(start, end)

    def prefill_span(self, start: int, end: int) -> None:
        tail = text_positions(start - 1, 1)[:, 0] if start else np.zeros(3, np.int32)
        final = end == len(self.prompt)
        result = self.runner.prefill(PrefillChunk(
            lane=self.lane, token_ids=self.prompt[start:end], positions=text_positions(start, end - start),
            kv_length=start, tail_position=tail, final=final, remaining=self.budget))
        self.frontier = end
        if final:
            self.tokens.append(result.token)
            self.drafts_ready = result.drafts_ready

    def batch_row(self) -> dict:
        remaining = self.budget - len(self.tokens)
        return dict(lane=self.lane, input_token=self.tokens[-1], kv_length=self.frontier, position=self.frontier,
                    speculative=self.drafts_ready, remaining=remaining)

    def take(self, tokens: np.ndarray, drafts_ready: bool) -> None:
        self.tokens += [int(t) for t in tokens]
        self.frontier += len(tokens)
        self.drafts_ready = drafts_ready

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.budget


def decode_round(runner: CpuRunner, lanes: list[Lane]) -> np.ndarray:
    """One decode round over these lanes; returns the drafts each accepted."""
    rows = [lane.batch_row() for lane in lanes]
    result = runner.decode(DecodeBatch(
        lanes=[r["lane"] for r in rows], input_tokens=[r["input_token"] for r in rows],
        kv_lengths=[r["kv_length"] for r in rows], positions=[r["position"] for r in rows],
        speculative=[r["speculative"] for r in rows], remaining=[r["remaining"] for r in rows]))
    for b, lane in enumerate(lanes):
        lane.take(result.tokens[b, : result.counts[b]], bool(result.drafts_ready[b]))
    return result.accepted


def generate(runner: CpuRunner, lane: Lane) -> list[int]:
    lane.prefill(len(lane.prompt))
    while not lane.done:
        decode_round(runner, [lane])
    return lane.tokens


def greedy_reference(model: Qwen36Model | LlamaModel, prompt: np.ndarray, count: int) -> list[int]:
    """Greedy tokens of the per-sequence model (fp32 KV, no pages)."""
    state = model.new_state()
    logits = model.forward(state, prompt).logits[-1]
    tokens = [int(np.argmax(logits[: model.dims.vocab_ids]))]
    while len(tokens) < count:
        logits = model.forward(state, np.array([tokens[-1]])).logits[-1]
        tokens.append(int(np.argmax(logits[: model.dims.vocab_ids])))
    return tokens


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request) -> Qwen36Model:
    return tiny_qwen(moe=request.param == "moe")


def prompt(seed: int, length: int, vocab: int = 500) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, length)


# ---- paged KV storage ----

def test_int8_codec_matches_the_published_rule():
    rng = np.random.default_rng(3)
    x = (rng.normal(0, 2.0, (5, 2, 128)) * rng.uniform(0, 3, (5, 2, 1))).astype(np.float32)
    x[0, 0, :64] = 0.0  # an all-zero group: scale 0, codes 0
    codes, scales = quantize_int8(x, 64)
    for index in np.ndindex(5, 2, 2):
        group = x[index[:2]][index[2] * 64 : (index[2] + 1) * 64]
        s = np.float16(np.float32(np.abs(group).max()) / np.float32(127))
        inv = np.float32(0) if s == 0 else np.float32(1) / np.float32(s)
        expected = np.clip(np.rint(group * inv), -127, 127)
        assert scales[index] == s
        np.testing.assert_array_equal(codes[index[:2]][index[2] * 64 : (index[2] + 1) * 64], expected)
    error = np.abs(dequantize_int8(codes, scales) - x)
    assert np.all(error <= np.repeat(scales.astype(np.float32), 64, axis=-1) / 2 + 1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_pages_store_tokens_where_the_page_table_says(dtype):
    layer = PagedLayerKV(pages=6, page_tokens=4, kv_heads=2, head_dim=64, dtype=dtype)
    rng = np.random.default_rng(0)
    k, v = rng.normal(size=(2, 10, 2, 64)).astype(np.float32)
    view = PagedKVView(layer, np.array([5, 0, 3]), 0)
    view.append(k[:3], v[:3])
    keys, values = view.append(k[3:], v[3:])
    assert view.length == 10
    tolerance = 1e-2 if dtype == "bf16" else 0.05
    np.testing.assert_allclose(keys, k, atol=tolerance * 4)
    np.testing.assert_allclose(values, v, atol=tolerance * 4)
    # Another sequence's pages are untouched by this one, and writing past the owned pages is refused.
    other = PagedKVView(layer, np.array([1]), 0)
    other.append(k[:1] * 0, v[:1] * 0)
    np.testing.assert_array_equal(layer.read(np.array([5, 0, 3]), 10)[0], keys)
    with pytest.raises(KVPageError):
        view.append(k[:3], v[:3])


# ---- the model's ragged batch ----

def test_forward_batch_rows_are_bitwise_independent_of_their_batch_and_chunk(model):
    """The property everything else rests on: a row's hidden state is the same alone, batched or chunked."""
    p1, p2 = prompt(1, 23), prompt(2, 9)
    alone = [model.forward(model.new_state(), p, logits="all").hidden for p in (p1, p2)]
    s1, s2 = model.new_state(), model.new_state()
    batched = model.forward_batch(np.concatenate([p1, p2]), np.concatenate([text_positions(0, 23),
                                                                             text_positions(0, 9)], axis=1),
                                  [Segment(slice(0, 23), s1.layers), Segment(slice(23, 32), s2.layers)])
    np.testing.assert_array_equal(batched[:23], alone[0])
    np.testing.assert_array_equal(batched[23:], alone[1])
    state, pieces = model.new_state(), []
    for start, end in [(0, 1), (1, 8), (8, 22), (22, 23)]:
        pieces.append(model.forward(state, p1[start:end], logits="all").hidden)
    np.testing.assert_array_equal(np.concatenate(pieces), alone[0])


# ---- the runner ----

@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_paged_greedy_decode_follows_the_per_sequence_model(model, kv_dtype):
    runner = CpuRunner(model, lanes=1, pages=4, kv_dtype=kv_dtype)
    lane = Lane(runner, 0, prompt(5, 40), budget=12)
    tokens = generate(runner, lane)
    reference = greedy_reference(model, prompt(5, 40), 12)
    # bf16/int8 KV rounding moves logits by ~1e-3: the greedy path of these models is robust to that.
    assert tokens == reference


def test_batched_decode_equals_each_lane_alone(model):
    prompts = [prompt(10 + i, 17 + 9 * i) for i in range(4)]
    samplings = [GREEDY, SAMPLED, GREEDY, SAMPLED]
    alone = []
    for p, sampling in zip(prompts, samplings):
        runner = CpuRunner(model, lanes=1, pages=4)
        alone.append(generate(runner, Lane(runner, 0, p, sampling=sampling, budget=10)))
    runner = CpuRunner(model, lanes=4, pages=16)
    lanes = [Lane(runner, i, p, sampling=s, budget=10) for i, (p, s) in enumerate(zip(prompts, samplings))]
    # Staggered: lanes join the batch one round apart, so each one runs at several batch sizes.
    for lane in lanes:
        lane.prefill(7, 100)
        decode_round(runner, [x for x in lanes if x.tokens and not x.done])
    while any(not lane.done for lane in lanes):
        decode_round(runner, [x for x in lanes if not x.done])
    assert [lane.tokens for lane in lanes] == alone


def test_the_llama_family_runs_on_the_same_runner():
    model = tiny_llama()
    prompts = [prompt(20 + i, 25 + 10 * i, vocab=300) for i in range(3)]
    runner = CpuRunner(model, lanes=3, pages=12)
    lanes = [Lane(runner, i, p, budget=9) for i, p in enumerate(prompts)]
    for lane in lanes:
        lane.prefill(11)
    while not all(lane.done for lane in lanes):
        decode_round(runner, [lane for lane in lanes if not lane.done])
    assert [lane.tokens for lane in lanes] == [greedy_reference(model, p, 9) for p in prompts]


def test_chunking_does_not_change_the_sequence(model):
    outputs = []
    for chunks in [(64,), (1, 16), (5, 5, 5, 5, 5, 5, 5)]:
        runner = CpuRunner(model, lanes=1, pages=4)
        lane = Lane(runner, 0, prompt(4, 33), sampling=SAMPLED, budget=8)
        lane.prefill(*chunks)
        while not lane.done:
            decode_round(runner, [lane])
        outputs.append(lane.tokens)
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_decoding_is_token_identical(k):
    model = tiny_qwen(predictable=True)
    plain = CpuRunner(model, lanes=1, pages=4)
    expected = [generate(plain, Lane(plain, 0, prompt(6 + i, 30), budget=40)) for i in range(2)]
    runner = CpuRunner(model, lanes=2, pages=8, draft_tokens=k)
    lanes = [Lane(runner, i, prompt(6 + i, 30), budget=40) for i in range(2)]
    accepted = 0
    for lane in lanes:
        lane.prefill(30)
        assert lane.drafts_ready
    while not all(lane.done for lane in lanes):
        accepted += decode_round(runner, [lane for lane in lanes if not lane.done]).sum()
    assert [lane.tokens for lane in lanes] == expected  # rounds never overshoot the budget
    assert accepted > 20  # the predictable model's drafts are mostly right, so verify really skips steps


def test_lm_head_draft_proposes_from_the_shortlist():
    model = tiny_qwen(predictable=True)  # its shortlist holds the even ids only
    drafts = {}
    for shortlist in (False, True):
        runner = CpuRunner(model, lanes=1, pages=4, draft_tokens=5, lm_head_draft=shortlist)
        lane = Lane(runner, 0, prompt(6, 30), budget=40)
        lane.prefill(30)
        drafts[shortlist] = runner._lanes[0].drafts
    assert np.all(drafts[True] % 2 == 0) and not np.all(drafts[False] % 2 == 0)


def test_rewind_commits_exactly_the_kept_prefix_of_a_speculative_round():
    model = tiny_qwen(predictable=True)
    plain = CpuRunner(model, lanes=1, pages=4)
    expected = generate(plain, Lane(plain, 0, prompt(6, 30), budget=20))
    runner = CpuRunner(model, lanes=1, pages=4, draft_tokens=4)
    lane = Lane(runner, 0, prompt(6, 30), budget=20)
    lane.prefill(30)
    before = len(lane.tokens)
    while decode_round(runner, [lane])[0] < 2:
        before = len(lane.tokens)
    # Keep only the first token of that round, as a stop inside the round would, then go on ordinarily.
    runner.rewind(0, 1)
    del lane.tokens[before + 1 :]
    lane.frontier = 30 + before
    lane.drafts_ready = False
    while not lane.done:
        decode_round(runner, [lane])
    assert lane.tokens == expected


def test_checkpoint_restores_the_state_it_saved(model):
    p = prompt(8, 30)
    runner = CpuRunner(model, lanes=1, pages=4)
    first = Lane(runner, 0, p, budget=6)
    first.prefill(20)
    runner.save_checkpoint(0, 1)
    while not first.done:
        decode_round(runner, [first])
    # Back to the state at token 20 (KV pages are kept), and the same suffix again: the same tokens.
    again = Lane(runner, 0, p, budget=6, checkpoint=(1, 20))
    again.prefill(10)
    while not again.done:
        decode_round(runner, [again])
    assert again.tokens == first.tokens
    with pytest.raises(ValueError, match="no checkpoint"):
        runner.begin_sequence(0, SequenceStart(source=StateSource.CHECKPOINT, checkpoint_slot=0, sampling=GREEDY))


def test_auto_pool_sizing_counts_the_runners_fixed_lane_state():
    model = tiny_qwen()
    config = EngineConfig(max_concurrency=2, max_context=1024, kv_capacity="auto", spec="mtp", draft_tokens=2)
    page_bytes = 64 * runner_kv_bytes_per_token(model, "bf16", 2)
    budget = AUTO_HEADROOM_BYTES + runner_state_bytes(model, 2, 2) + 20 * page_bytes + page_bytes // 2
    assert build_cpu_runner(model, config, memory_budget=budget).info.pages == 20
