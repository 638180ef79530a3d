"""DFlash speculative decoding on the CUDA runner (ninfer-facts §3.10, §4.6, §4.7), against the CPU runner's DFlash.

Runner tests run twice, like tests/test_cuda_runner.py: on `HostDevice` (the same model and runner code over the
kernels' NumPy twins, in CI) and on the GPU (`gpu` marker). They use the tiny 35B-shaped target of the CUDA tests
with the tiny 2-layer drafter (`tests.support.tiny_dflash`: a sliding layer whose 24-slot ring the prompts wrap, and
a full layer in the pages):

* the drafter rows every proposal reads equal the CPU drafter's (the twins to float32 rounding; the GPU within the
  bf16 context caches' rounding), batched lanes included;
* greedy DFlash output equals the CPU runner's DFlash output and plain greedy for k = 1, 4, 7; sampled DFlash
  output equals the CPU runner's (same seeds);
* a stop inside a round commits exactly: later proposals read the context a fresh prefill of the kept tokens builds;
* checkpoints, lane images and every prefix-reuse path (engine-driven, on the twins) continue exactly like an
  uninterrupted run;
* graphs on and off give identical tokens and acceptances; --lm-head-draft proposes shortlist ids only;
* startup accepts --spec dflash on the CUDA backend.

The kernel tests compare each DFlash kernel's twin with the CPU drafter's math (CI) and each kernel with its twin
(GPU).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tests.test_prefix_reuse as prefix_reuse
from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.artifact.reader import Artifact
from ninfer.backends.cpu import ops
from ninfer.backends.cpu.dflash import DFlashContextError
from ninfer.backends.cpu.runner import CpuRunner
from ninfer.backends.cuda.capacity import Capacity
from ninfer.engine.cold_tier import ColdTier, ParkedArray
from ninfer.engine.config import EngineConfig
from ninfer.engine.prefix import Residency
from ninfer.engine.runner import DecodeBatch
from ninfer.kernels_numba import dflash as kernels
from ninfer.models.loader import build_model
from tests.support.tiny_dflash import write_cuda_tiny_dflash_artifact
from tests.test_cold_tier import HostArena
from tests.test_cuda_runner import assert_same_or_near_tie, make_device
from tests.test_dflash import DraftRows, continue_moved_then_restored
from tests.test_runner_cpu import SAMPLED, Lane, decode_round, prompt

PROMPTS = [prompt(1, 20), prompt(4, 45), prompt(2, 33)]  # 45 and 33 tokens wrap the 24-slot ring
BUDGET = 30
# How far the drafter rows may move from the CPU drafter's: float32 rounding on the twins; on the GPU, summation
# order, plus a context value now and then rounding to the neighbouring bf16 in the caches.
ROW_TOLERANCE = {"host": 1e-5, "cuda": 2e-2}


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def device_kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return write_cuda_tiny_dflash_artifact(tmp_path_factory.mktemp("cuda-dflash") / "dflash.ninfer")


def engine_config(k: int, *, lanes: int, lm_head_draft: bool = False) -> EngineConfig:
    return EngineConfig(max_concurrency=lanes, max_context=256, prefill_chunk=128, kv_capacity=lanes * 256,
                        spec="dflash" if k else None, draft_tokens=k, lm_head_draft=lm_head_draft)


def build_runner(kind: str, path: Path, config: EngineConfig, *, graphs: bool = True):
    from ninfer.backends.cuda.build import build_cuda_runner

    return build_cuda_runner(Artifact.open(path), config, cuda_graphs=graphs, device=make_device(kind),
                             tensor_core_attention=False, decode_linear="kernels").runner


def cuda_runner(kind: str, path: Path, k: int, *, lanes: int = 3, graphs: bool = True, lm_head_draft: bool = False):
    return build_runner(kind, path, engine_config(k, lanes=lanes, lm_head_draft=lm_head_draft), graphs=graphs)


def cpu_runner(path: Path, k: int, *, lanes: int = 3) -> CpuRunner:
    return CpuRunner(build_model(Artifact.open(path), dflash=True), lanes=lanes, pages=lanes * 4, draft_tokens=k,
                     spec="dflash")


class CudaDraftRows:
    """Records the drafter rows every proposal of a CUDA runner reads (the final-norm rows of the block's masks), per
    drafter call: read after the call, so graph replays are seen too."""

    def __init__(self, runner) -> None:
        self.calls: list[np.ndarray] = []
        original, model, width = runner._run_drafter, runner._model, runner._k + 1

        def spy(lanes, blocks):
            original(lanes, blocks)
            if blocks:
                d = model.device.read(model.workspace.final[: len(blocks) * width])
                self.calls.append(d.reshape(len(blocks), width, -1)[:, 1:].reshape(-1, d.shape[1]))

        runner._run_drafter = spy


def run(runner, prompts: list[np.ndarray], budget: int = BUDGET) -> tuple[list[list[int]], list[list[int]]]:
    """Batched lanes to the end: every lane's tokens, and the drafts each round's lanes accepted."""
    lanes = [Lane(runner, i, p, budget=budget) for i, p in enumerate(prompts)]
    for lane in lanes:
        lane.prefill(64)  # chunks of at most 64 rows: the skinny (row-invariant) kernels on the GPU too
    accepted = []
    while not all(lane.done for lane in lanes):
        accepted.append(decode_round(runner, [lane for lane in lanes if not lane.done]).tolist())
    return [lane.tokens for lane in lanes], accepted


@pytest.fixture(scope="module")
def plain_tokens(artifact) -> list[list[int]]:
    """Plain greedy on the CUDA runner over the twins (the GPU's is checked equal in the speculative test)."""
    return run(cuda_runner("host", artifact, 0), PROMPTS)[0]


# ---- the runner ----

def test_drafter_rows_follow_the_cpu_drafter(device_kind, artifact, monkeypatch):
    cpu = cpu_runner(artifact, 3)
    cpu_rows = DraftRows(cpu._model, monkeypatch)
    runner = cuda_runner(device_kind, artifact, 3)
    rows = CudaDraftRows(runner)
    got, want = run(runner, PROMPTS), run(cpu, PROMPTS)
    assert got[0] == want[0]
    if device_kind == "host":
        assert got[1] == want[1]  # the same proposals, round by round
    assert len(rows.calls) == len(cpu_rows.calls) >= 8
    for mine, theirs in zip(rows.calls, cpu_rows.calls):
        np.testing.assert_allclose(mine, theirs, atol=ROW_TOLERANCE[device_kind])


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_dflash_equals_the_cpu_runner_and_plain_greedy(device_kind, artifact, plain_tokens, k):
    tokens, accepted = run(cuda_runner(device_kind, artifact, k), PROMPTS)
    if device_kind == "cuda":
        assert run(cuda_runner(device_kind, artifact, 0), PROMPTS)[0] == tokens
    else:
        assert tokens == plain_tokens
    cpu_tokens = run(cpu_runner(artifact, k), PROMPTS)[0]
    model = build_model(Artifact.open(artifact))
    for got, want, ids in zip(tokens, cpu_tokens, PROMPTS):
        assert_same_or_near_tie(got, want, model, ids)
    assert sum(map(sum, accepted)) > 0


def test_a_stop_inside_a_round_commits_exactly(device_kind, artifact):
    """A stop that keeps one token of a round (`rewind`), ordinary steps, multi-token commits: every later proposal
    reads the drafter rows a fresh lane computes after prefilling the same committed tokens."""
    k = 4
    runner = cuda_runner(device_kind, artifact, k, lanes=2)
    rows = CudaDraftRows(runner)
    ids = PROMPTS[1]
    lane = Lane(runner, 0, ids, budget=40)
    lane.prefill(16)
    seen, cut = [], False
    while not lane.done:
        frontier, speculative, calls, before = lane.frontier, lane.drafts_ready, len(rows.calls), len(lane.tokens)
        accepted = decode_round(runner, [lane])[0]
        if speculative:
            seen.append((frontier, np.concatenate([ids, lane.tokens])[: frontier + 1], rows.calls[calls]))
        if speculative and accepted and not cut:
            runner.rewind(0, 1)
            del lane.tokens[before + 1 :]
            lane.frontier, cut = frontier + 1, True
            lane.drafts_ready = lane.budget - len(lane.tokens) >= k + 1
    assert cut and len(seen) >= 5
    with pytest.raises(DFlashContextError, match="cannot keep 2"):
        runner.rewind(0, 2)  # the last round was an ordinary step: one pending column
    for frontier, sequence, drafted in seen:
        fresh = Lane(runner, 1, sequence[:frontier], budget=k + 2)
        fresh.prefill(*[32] * 4)
        calls = len(rows.calls)
        runner.decode(DecodeBatch(lanes=[1], input_tokens=[sequence[frontier]], kv_lengths=[frontier],
                                  positions=[frontier], speculative=[True], remaining=[k + 1]))
        np.testing.assert_allclose(rows.calls[calls], drafted, atol=ROW_TOLERANCE[device_kind])


def test_a_checkpoint_and_a_moved_lane_continue_like_an_uninterrupted_run(device_kind, artifact):
    """A lane image carries the drafter context (rings, pending columns, full-layer pages, the context lengths) and
    the checkpoints' rings: the moved sequence (parked in the cold tier on the way, on the host), and a restore of
    its checkpoint, propose as the unmoved one."""
    ids = PROMPTS[1]
    reference = cuda_runner(device_kind, artifact, 3, lanes=1)
    reference_rows = CudaDraftRows(reference)
    expected = run(reference, [ids])[0][0]
    runner = cuda_runner(device_kind, artifact, 3)
    rows = CudaDraftRows(runner)
    lane = Lane(runner, 0, ids, budget=BUDGET)
    lane.prefill_span(0, 40)  # near the end: the restored lane's first blocks read the checkpoint's ring
    runner.save_checkpoint(0, 1)
    lane.prefill_span(40, len(ids))
    for _ in range(3):
        decode_round(runner, [lane])
    image = runner.export_lane_view(0, lane.frontier)
    assert {"dflash/ring/0/k", "dflash/ring_checkpoints/0/v", "dflash/kv/1/k", "dflash/pending",
            "dflash/context_lengths", "dflash/pending_columns"} <= set(image.arrays)
    if device_kind == "host":  # through the cold tier: the image comes back as arrays still in their arena
        tier = ColdTier([HostArena(64 << 20)])
        assert tier.park(Residency(), image)
        image = tier.take(next(iter(tier.parked())))[1]
        assert isinstance(image.arrays["dflash/context_lengths"], ParkedArray)
    continue_moved_then_restored(runner, lane, image, np.arange(8, 12), expected, checkpoint=(1, 40), chunk=64)
    assert len(rows.calls) == 2 * len(reference_rows.calls)
    for got, want in zip(rows.calls, reference_rows.calls * 2):
        np.testing.assert_allclose(got, want, atol=ROW_TOLERANCE[device_kind])


def test_every_prefix_reuse_path_gives_the_tokens_and_counters_of_no_reuse(artifact, monkeypatch):
    """The prefix-reuse chat script (frontier, turn and response checkpoints, resets) served by the CUDA runner over
    the twins: the same tokens and speculative counters with reuse as without (the drafter context it restores is
    exact). Not on the GPU: the script's 128-row prefill chunks run cuBLAS on bf16 activations, whose rounding
    differs with the chunking that reuse changes."""
    monkeypatch.setattr(prefix_reuse, "build_cpu_runner", lambda model, config: build_runner("host", artifact, config))
    with_reuse = prefix_reuse.run_chat(None, prefix_reuse=True, draft_tokens=3, spec="dflash")
    without = prefix_reuse.run_chat(None, prefix_reuse=False, draft_tokens=3, spec="dflash")
    plain = prefix_reuse.run_chat(None, prefix_reuse=False)
    assert with_reuse[0] == without[0] == plain[0]
    assert [u.reuse_path for u in with_reuse[1]] == [turn.path.value for turn in prefix_reuse.SCRIPT]
    assert [u.speculative for u in with_reuse[1]] == [u.speculative for u in without[1]]
    assert sum(u.speculative.accepted_tokens for u in with_reuse[1]) > 0


def test_sampled_dflash_matches_the_cpu_runner(device_kind, artifact):
    """Sampled verify rounds read the verify logits on the host (§4.7 with the device's proposals): the same tokens
    as the CPU runner's DFlash with the same seeds."""
    prompts = PROMPTS[:2]

    def sampled(runner) -> list[list[int]]:
        lanes = [Lane(runner, i, p, sampling=SAMPLED, budget=20) for i, p in enumerate(prompts)]
        for lane in lanes:
            lane.prefill(64)
        while not all(lane.done for lane in lanes):
            decode_round(runner, [lane for lane in lanes if not lane.done])
        return [lane.tokens for lane in lanes]

    assert sampled(cuda_runner(device_kind, artifact, 3)) == sampled(cpu_runner(artifact, 3))


def test_graph_replay_equals_eager_rounds(device_kind, artifact):
    graphs = run(cuda_runner(device_kind, artifact, 7), PROMPTS)
    eager = run(cuda_runner(device_kind, artifact, 7, graphs=False), PROMPTS)
    assert graphs == eager


def test_lm_head_draft_proposes_shortlist_ids_and_keeps_greedy_output(device_kind, artifact, plain_tokens):
    runner = cuda_runner(device_kind, artifact, 4, lm_head_draft=True)
    proposed: list[int] = []
    original = runner._run_drafter

    def spy(lanes, blocks):
        original(lanes, blocks)
        proposed.extend(t for lane, *_ in blocks for t in runner._lanes[lane].drafts.tolist())

    runner._run_drafter = spy
    tokens = run(runner, PROMPTS)[0]
    assert proposed and all(t % 2 == 0 for t in proposed)  # the tiny shortlist holds the even ids
    if device_kind == "host":
        assert tokens == plain_tokens


def test_bad_configurations_are_refused(artifact):
    from ninfer.backends.cuda.build import build_cuda_runner
    from ninfer.backends.cuda.host import HostDevice
    from ninfer.backends.cuda.model import CudaQwen
    from ninfer.backends.cuda.weights import ArtifactDeviceWeights
    from ninfer.models.loader import artifact_dims
    from tests.support.cuda_models import write_tiny_qwen_artifact

    with pytest.raises(ValueError, match="spec must be one of"):
        Capacity(lanes=1, max_context=256, kv_dtype="bf16", prefill_rows=128, draft_tokens=3, spec="eagle")
    source = Artifact.open(artifact)
    capacity = Capacity(lanes=1, max_context=256, kv_dtype="bf16", prefill_rows=128, draft_tokens=16, spec="dflash")
    device = HostDevice()
    with pytest.raises(ValueError, match="at most 15 tokens"):
        CudaQwen(artifact_dims(source), ArtifactDeviceWeights(source, device), device, capacity,
                 dflash=build_model(source, dflash=True).dflash.dims)
    with pytest.raises(ValueError, match="drafter's dimensions"):
        CudaQwen(artifact_dims(source), ArtifactDeviceWeights(source, device), device,
                 Capacity(lanes=1, max_context=256, kv_dtype="bf16", prefill_rows=128, draft_tokens=3, spec="dflash"))
    moe = write_tiny_qwen_artifact(artifact.parent / "moe.ninfer", moe=True, recipe="bf16")
    with pytest.raises(ValueError, match="no DFlash drafter"):
        build_cuda_runner(Artifact.open(moe), engine_config(3, lanes=1), device=HostDevice())


def test_startup_serves_dflash_on_the_cuda_backend(artifact, monkeypatch):
    """With a GPU present, --spec dflash builds the CUDA runner with the drafter (a HostDevice stands in for the GPU;
    the tiny artifact has no frontend files, which this test does not need)."""
    import ninfer.backends.cuda.build as build
    import ninfer.nursery.startup as startup
    from ninfer.backends import cuda_probe
    from ninfer.backends.cuda.host import HostDevice
    from ninfer.backends.cuda.runner import CudaRunner
    from ninfer.cli.serve import parse_serve_args

    monkeypatch.setattr(cuda_probe, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(build, "CudaDevice", lambda index: HostDevice())
    monkeypatch.setattr(startup.PromptBuilder, "from_artifact", classmethod(lambda cls, artifact: None))
    monkeypatch.setattr(startup, "model_stop_ids", lambda artifact: frozenset())
    options = parse_serve_args([str(artifact), "--spec", "dflash", "--draft-tokens", "7", "--max-context", "256",
                                "--prefill-chunk", "128"])
    stack = startup.load_model_stack(options, artifact)
    assert isinstance(stack.runner, CudaRunner) and stack.cuda is not None
    assert stack.runner.info.draft_tokens == 7 and stack.model.dflash is not None


# ---- the kernels ----

WINDOW, SPAN = 8, 4  # a ring of 8 slots; pages of 4 tokens, so a context spans several pages


def kernel_case(seed: int = 0):
    """Two lanes' committed contexts (lengths 19 and 5: the first wraps the ring twice) and a proposal block of 4
    rows each, as the heads kernel's inputs: qkv rows (block rows first), positions, lanes, ring slots."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim, width = 4, 2, 32, 4
    lengths = (19, 5)
    block_positions = np.concatenate([np.arange(n, n + width) for n in lengths])
    block_lanes = np.repeat([0, 1], width)
    context_positions = np.concatenate([np.arange(n) for n in lengths])
    context_lanes = np.concatenate([np.full(n, lane) for lane, n in enumerate(lengths)])
    ends = np.array(lengths)[context_lanes]
    slots = np.where(context_positions >= ends - WINDOW, context_positions % WINDOW, -1)
    padding = 3  # context rows with position -1 (a lane's padding rows)
    positions = np.concatenate([block_positions, context_positions, -np.ones(padding, int)]).astype(np.int32)
    lanes = np.concatenate([block_lanes, context_lanes, np.zeros(padding, int)]).astype(np.int32)
    ring_slot = np.concatenate([-np.ones(len(block_positions), int), slots, -np.ones(padding, int)]).astype(np.int32)
    rows = len(positions)
    qkv = rng.normal(0.0, 1.0, (rows, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    norms = [(1.0 + rng.normal(0.0, 0.2, head_dim)).astype(np.float32) for _ in range(2)]
    inv_freq = ops.rope_inv_freq(head_dim, 1e7)
    page_tables = np.array([[5, 0, 3, 1, 6, 2], [4, 7, 0, 0, 0, 0]], np.int32)
    return dict(qkv=qkv, q_norm=norms[0], k_norm=norms[1], inv_freq=inv_freq, positions=positions, row_lane=lanes,
                ring_slot=ring_slot, page_tables=page_tables), dict(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, width=width, block_rows=len(block_positions))


def run_heads(heads_launch, arrays: dict, geometry: dict, paged: bool, to_device=np.asarray, read=np.asarray):
    g = geometry
    span, count = (SPAN, 8) if paged else (WINDOW, 2)
    cache = [np.zeros((count, span, g["kv_heads"], g["head_dim"]), np.uint16) for _ in range(2)]
    outs = [np.full((g["block_rows"], h, g["head_dim"]), np.nan, np.float32) for h in (g["heads"], g["kv_heads"],
                                                                                       g["kv_heads"])]
    args = [to_device(arrays[name]) for name in ("qkv", "q_norm", "k_norm", "inv_freq", "positions", "row_lane",
                                                  "ring_slot", "page_tables")]
    device_cache, device_outs = [to_device(c) for c in cache], [to_device(o) for o in outs]
    heads_launch(*args, *device_cache, *device_outs, block_rows=g["block_rows"], paged=paged, heads=g["heads"],
                 kv_heads=g["kv_heads"], head_dim=g["head_dim"], eps=1e-6)
    return [read(c) for c in device_cache], [read(o) for o in device_outs]


def test_the_heads_twin_is_the_cpu_drafters_norm_rope_and_cache_placement():
    arrays, g = kernel_case()
    b, (heads, kv_heads, d) = g["block_rows"], (g["heads"], g["kv_heads"], g["head_dim"])
    qw, kw = heads * d, kv_heads * d
    positions, qkv = arrays["positions"], arrays["qkv"]
    angles = ops.rope_angles(positions, arrays["inv_freq"])
    # DFlashLayer.keys_values and its query, on the projected rows
    keys = ops.apply_rotary(ops.rms_norm(qkv[:, qw : qw + kw].reshape(-1, kv_heads, d), arrays["k_norm"], 1e-6,
                                         offset=False), angles)
    values = qkv[:, qw + kw :].reshape(-1, kv_heads, d)
    queries = ops.apply_rotary(ops.rms_norm(qkv[:b, :qw].reshape(b, heads, d), arrays["q_norm"], 1e-6, offset=False),
                               angles[:b])
    for paged in (False, True):
        (cache_k, cache_v), (q, k, v) = run_heads(kernels.dflash_heads_reference, arrays, g, paged)
        np.testing.assert_array_equal(q, queries)
        np.testing.assert_array_equal(k, keys[:b])
        np.testing.assert_array_equal(v, values[:b])
        for r in range(b, len(positions)):
            position, lane = int(positions[r]), int(arrays["row_lane"][r])
            if position < 0:
                continue
            if paged:
                where = (arrays["page_tables"][lane, position // SPAN], position % SPAN)
            elif arrays["ring_slot"][r] >= 0:
                where = (lane, position % WINDOW)
            else:
                continue  # overwritten in the ring by a later position of the lane
            np.testing.assert_array_equal(cache_k[where], f32_to_bf16_bits(keys[r]))
            np.testing.assert_array_equal(cache_v[where], f32_to_bf16_bits(values[r]))


def test_the_attention_twin_is_the_cpu_drafters_windowed_attention():
    """Block rows over a wrapped ring (the last WINDOW positions) or all pages, plus their block's keys: the CPU
    drafter's `windowed_gqa_attention` over the same keys."""
    arrays, g = kernel_case()
    b, width, d = g["block_rows"], g["width"], g["head_dim"]
    positions, lanes = arrays["positions"], arrays["row_lane"]
    for paged in (False, True):
        (cache_k, cache_v), (q, k, v) = run_heads(kernels.dflash_heads_reference, arrays, g, paged)
        window = 0 if paged else WINDOW
        out = np.full((b, g["heads"] * d), np.nan, np.float32)
        kernels.dflash_attention_reference(q, k, v, positions[:b], lanes[:b], arrays["page_tables"], cache_k,
                                           cache_v, out, block_width=width, window=window, paged=paged,
                                           heads=g["heads"], kv_heads=g["kv_heads"], head_dim=d)
        for first in range(0, b, width):
            rows, length = slice(first, first + width), int(positions[first])
            lane_keys = (positions[b:] >= 0) & (lanes[b:] == lanes[first])
            context = positions[b:][lane_keys]
            ctx_k, ctx_v = stored_context(arrays, arrays["qkv"][b:][lane_keys], context, g)
            if not paged:
                keep = context >= length - WINDOW
                context, ctx_k, ctx_v = context[keep], ctx_k[keep], ctx_v[keep]
            expected = ops.windowed_gqa_attention(
                q[rows], positions[rows], np.concatenate([ctx_k, k[rows]]), np.concatenate([ctx_v, v[rows]]),
                np.concatenate([context, positions[rows]]), 1.0 / np.sqrt(d), None if paged else WINDOW)
            np.testing.assert_allclose(out[rows], expected.reshape(width, -1), rtol=1e-6, atol=1e-6)


def stored_context(arrays: dict, qkv: np.ndarray, positions: np.ndarray, g: dict) -> tuple[np.ndarray, np.ndarray]:
    """Context keys and values as the CPU drafter stores them (normed, rotated, rounded to bf16)."""
    heads, kv_heads, d = g["heads"], g["kv_heads"], g["head_dim"]
    qw, kw = heads * d, kv_heads * d
    k = ops.apply_rotary(ops.rms_norm(qkv[:, qw : qw + kw].reshape(-1, kv_heads, d), arrays["k_norm"], 1e-6,
                                      offset=False), ops.rope_angles(positions, arrays["inv_freq"]))
    v = qkv[:, qw + kw :].reshape(-1, kv_heads, d)
    return bf16_bits_to_f32(f32_to_bf16_bits(k)), bf16_bits_to_f32(f32_to_bf16_bits(v))


@pytest.mark.gpu
def test_the_kernels_equal_their_twins():
    from ninfer.kernels_numba.attention import DEFAULT_SPLITS
    from ninfer.kernels_numba.numba_setup import cuda

    stream = cuda.stream()

    def device_launch(launch):
        def run_on_stream(*args, **kwargs):
            launch(*args, **kwargs, stream=stream)
            stream.synchronize()
        return run_on_stream

    arrays, g = kernel_case(seed=3)
    b, width, d = g["block_rows"], g["width"], g["head_dim"]
    to_device, read = cuda.to_device, lambda array: array.copy_to_host()
    for paged in (False, True):
        (want_k, want_v), want = run_heads(kernels.dflash_heads_reference, arrays, g, paged)
        (got_k, got_v), got = run_heads(device_launch(kernels.dflash_heads), arrays, g, paged, to_device, read)
        for mine, theirs in zip(got, want):
            np.testing.assert_allclose(mine, theirs, rtol=2e-6, atol=2e-6)
        np.testing.assert_array_equal(got_v, want_v)  # v is copied: the same bits
        differ = got_k != want_k  # k is normed and rotated: at most one bf16 step apart
        assert np.all(np.abs(got_k.astype(np.int32) - want_k.astype(np.int32))[differ] <= 1)
        q, k, v = want
        window = 0 if paged else WINDOW
        expected = np.full((b, g["heads"] * d), np.nan, np.float32)
        common = dict(block_width=width, window=window, paged=paged, heads=g["heads"], kv_heads=g["kv_heads"],
                      head_dim=d)
        kernels.dflash_attention_reference(q, k, v, arrays["positions"][:b], arrays["row_lane"][:b],
                                           arrays["page_tables"], want_k, want_v, expected, **common)
        out = cuda.to_device(np.full((b, g["heads"] * d), np.nan, np.float32))
        partials = cuda.device_array(kernels.attention_partials_shape(b, g["heads"], d, DEFAULT_SPLITS), np.float32)
        kernels.dflash_attention(*(to_device(np.ascontiguousarray(a)) for a in (
            q, k, v, arrays["positions"][:b], arrays["row_lane"][:b], arrays["page_tables"], want_k, want_v)),
            partials, out, stream=stream, **common)
        stream.synchronize()
        np.testing.assert_allclose(read(out), expected, rtol=1e-5, atol=1e-5)
    source = np.random.default_rng(1).normal(size=(5, 70)).astype(np.float32)
    features = np.full((6, 300), np.nan, np.float32)
    device_features = cuda.to_device(features)
    kernels.copy_columns(cuda.to_device(source), device_features, first_column=140, stream=stream)
    kernels.copy_columns_reference(source, features, first_column=140)
    stream.synchronize()
    np.testing.assert_array_equal(read(device_features), features)
