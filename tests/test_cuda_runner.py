"""The CUDA runner against the CPU reference runner on tiny random Qwen models.

Every test runs twice: on the GPU (`gpu` marker), and on `HostDevice`, where the same model and runner code drives
the kernels' NumPy twins (so CI checks the backend's host logic without a GPU). Both backends load the same
`.ninfer` file. Up to 64 rows the CUDA linear layers are fp32-accumulating skinny
kernels, so logits agree to float32 rounding and greedy tokens agree exactly, except where two logits are closer
than that rounding (a near-tie): the comparison reports the margin at the first difference and accepts only those.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer.artifact.reader import Artifact
from ninfer.backends.cpu.runner import CpuRunner
from ninfer.engine.config import EngineConfig
from ninfer.models.loader import load_model
from ninfer.kernels_numba.attention import MAX_SPLITS
from tests.support.cuda_models import write_tiny_qwen_artifact
from tests.test_runner_cpu import GREEDY, SAMPLED, Lane, decode_round, prompt, text_positions



@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def device_kind(request) -> str:
    return request.param


def make_device(kind: str, *, side_work_last: bool = False):
    if kind == "host":
        from ninfer.backends.cuda.host import HostDevice

        return HostDevice(side_work_last=side_work_last)
    from ninfer.backends.cuda.device import CudaDevice

    return CudaDevice(0)

CASES = [("dense", "bf16"), ("moe", "bf16"), ("dense", "ninfer-v2"), ("moe", "ninfer-v2")]
NEAR_TIE = 2e-3  # logit gap below which float32 summation order may pick either token
BF16_NEAR_TIE = 5e-2  # the same with bf16-rounded activations (relative logit error up to ~1e-2)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[tuple[str, str], Path]:
    folder = tmp_path_factory.mktemp("cuda-models")
    out = {(kind, recipe): write_tiny_qwen_artifact(folder / f"{kind}-{recipe}.ninfer", moe=kind == "moe",
                                                    recipe=recipe) for kind, recipe in CASES}
    out[("dense", "predictable")] = write_tiny_qwen_artifact(folder / "predictable.ninfer", moe=False,
                                                            recipe="bf16", predictable=True)
    return out


def cuda_build(kind: str, path: Path, *, lanes: int = 3, max_context: int = 256, kv_dtype: str = "bf16",
               draft_tokens: int = 0,
               graphs: bool = True, prefill_chunk: int = 128, lm_head_draft: bool = False,
               tensor_core_attention: bool = False, decode_linear: str = "kernels", decode_quant: str = "simt",
               branches: bool | None = None, side_work_last: bool = False, programmatic_launch: bool = False,
               narrow_decode: bool | None = False, split_k_norm: int = 0, conv_in_projection: bool = True,
               ab_in_recurrence: bool | None = True, recurrence_groups: int = 4, prefill_buckets: bool = False,
               direct_quant_experts: bool = False, tensor_core_decode_int8: bool = False):
    from ninfer.backends.cuda.build import build_cuda_runner

    config = EngineConfig(max_concurrency=lanes, max_context=max_context, prefill_chunk=prefill_chunk,
                          kv_capacity=lanes * max_context, kv_dtype=kv_dtype, spec="mtp" if draft_tokens else None,
                          draft_tokens=draft_tokens, lm_head_draft=lm_head_draft)
    return build_cuda_runner(Artifact.open(path), config, cuda_graphs=graphs,
                             device=make_device(kind, side_work_last=side_work_last),
                             tensor_core_attention=tensor_core_attention, decode_linear=decode_linear,
                             decode_quant=decode_quant, branches=branches, programmatic_launch=programmatic_launch,
                             narrow_decode=narrow_decode, split_k_norm=split_k_norm,
                             conv_in_projection=conv_in_projection, ab_in_recurrence=ab_in_recurrence,
                             recurrence_groups=recurrence_groups, prefill_buckets=prefill_buckets,
                             direct_quant_experts=direct_quant_experts,
                             tensor_core_decode_int8=tensor_core_decode_int8)


def cpu_runner(path: Path, *, lanes: int = 3, kv_dtype: str = "bf16", draft_tokens: int = 0) -> CpuRunner:
    return CpuRunner(load_model(path), lanes=lanes, pages=lanes * 4, kv_dtype=kv_dtype, draft_tokens=draft_tokens)


def run_lanes(runner, prompts: list[np.ndarray], budget: int, *, sampling=GREEDY, chunk: int = 1000) -> list[list[int]]:
    lanes = [Lane(runner, i, p, sampling=sampling, budget=budget) for i, p in enumerate(prompts)]
    for lane in lanes:
        lane.prefill(chunk)
    while not all(lane.done for lane in lanes):
        decode_round(runner, [lane for lane in lanes if not lane.done])
    return [lane.tokens for lane in lanes]


def prompt_logits(model, cpu_model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Last-row logits of a prompt on the CUDA model (lane 0, pages 0..3) and on the CPU model over the same paged
    bf16 KV storage (the per-sequence CPU cache keeps fp32 K/V, which a bf16 pool rounds)."""
    from ninfer.backends.cpu.ops import ATTENTION, Segment
    from ninfer.backends.cpu.paged_kv import PagedKVView, PagedLayerKV
    from ninfer.backends.cuda.capacity import PrefillSpan

    model.reset_lane(0)
    model.inputs.set_page_table(0, np.arange(4, dtype=np.int32))
    count = len(ids)
    positions = text_positions(0, count)
    model.inputs.fill(token_ids=ids, positions=positions, row_lane=np.zeros(count),
                      row_pos=np.arange(count), seg_lane=[0], seg_row=[0], seg_count=[count], seg_record=[0])
    final = model.forward(count, 1, PrefillSpan(0, 0))
    logits = model.device.read(model.head_logits(final[count - 1 :]))
    d = cpu_model.dims
    pages = np.arange(4, dtype=np.int32)
    stores = [PagedKVView(PagedLayerKV(4, 64, d.kv_heads, d.head_dim, "bf16"), pages, 0) if kind == ATTENTION
              else cpu_model.new_recurrent_state(i) for i, kind in enumerate(cpu_model.mixer_kinds)]
    hidden = cpu_model.forward_batch(np.asarray(ids, np.int32), positions, [Segment(slice(0, count), stores)])
    return logits[0], cpu_model.logits(hidden[-1:])[0]


def assert_same_or_near_tie(got: list[int], want: list[int], reference_model, prompt_ids: np.ndarray, *,
                            tie: float = NEAR_TIE) -> None:
    if got == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    state = reference_model.new_state()
    logits = reference_model.forward(state, np.concatenate([prompt_ids, want[:first]]).astype(np.int32)).logits[-1]
    gap = abs(float(logits[got[first]] - logits[want[first]]))
    assert gap < tie, f"tokens differ at {first} ({got[first]} vs {want[first]}) with a logit gap of {gap}"


@pytest.mark.parametrize("kind,recipe", CASES)
def test_prompt_logits_match_the_cpu_model(device_kind, artifacts, kind, recipe):
    path = artifacts[(kind, recipe)]
    build = cuda_build(device_kind, path)
    cpu = load_model(path)
    for length in (1, 7, 64, 65, 128):  # 65+ rows run the cuBLAS prefill path (bf16-rounded activations)
        ids = prompt(length, length)
        got, want = prompt_logits(build.model, cpu, ids)
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error < (1e-4 if length <= 64 else 2e-2), (length, error)


def test_prefill_with_the_real_key_dim_normalises_q_and_k_in_the_conv(device_kind, tmp_path, monkeypatch):
    """At key dim 128 (a warp a head) a chunked prefill's conv normalises q and k itself (`gdn_conv_normed`, the
    gates then write only decays and betas): the CPU model's logits; shorter prompts keep the conv and the gated
    recurrence."""
    path = write_tiny_qwen_artifact(tmp_path / "k128.ninfer", moe=False, recipe="bf16", gdn_k_dim=128)
    build = cuda_build(device_kind, path)
    model, cpu = build.model, load_model(path)
    calls = []
    for name in ("gdn_conv", "gdn_conv_normed"):
        launcher = getattr(model.k, name)
        monkeypatch.setattr(model.k, name, lambda *a, name=name, launcher=launcher, **kw: (calls.append(name),
                                                                                          launcher(*a, **kw))[1])
    for length, conv in ((64, "gdn_conv"), (128, "gdn_conv_normed")):
        del calls[:]
        got, want = prompt_logits(model, cpu, prompt(length, length))
        assert set(calls) == {conv}, (length, calls)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, length


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cublas_decode_matches_the_cpu_runner(device_kind, artifacts, kind):
    """decode_linear="cublas" (the serving default): bf16 activations into cuBLAS at every row count, so logits
    agree within the bf16 tolerance of the prefill path and greedy tokens up to ties within that error."""
    path = artifacts[(kind, "bf16")]
    cpu = load_model(path)
    build = cuda_build(device_kind, path, decode_linear="cublas")
    for length in (1, 7, 64):
        got, want = prompt_logits(build.model, cpu, prompt(length, length))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, length
    prompts = [prompt(1, 5), prompt(2, 60), prompt(3, 23)]
    got = run_lanes(cuda_build(device_kind, path, decode_linear="cublas").runner, prompts, 24)
    want = run_lanes(cpu_runner(path), prompts, 24)
    for g, w, p in zip(got, want, prompts):
        assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tensor_core_decode_linear_matches_the_cpu_runner(device_kind, artifacts, kind, monkeypatch):
    """decode_linear="mma": every bf16 decode projection through `linear_mma` (bf16 activations, only the rows
    there are), so greedy tokens are the CPU runner's up to bf16 ties, greedy MTP (4 verify rows a lane) equals
    greedy with no padding, and the graphs replay the eager tokens."""
    path = artifacts[(kind, "bf16")]
    cpu = load_model(path)
    prompts = [prompt(1, 5), prompt(2, 60), prompt(3, 23)]
    eager = cuda_build(device_kind, path, decode_linear="mma", graphs=False)
    assert eager.model.linear.pad_rows == 0
    rows = []
    launcher = eager.model.k.linear_bf16_mma
    monkeypatch.setattr(eager.model.k, "linear_bf16_mma",
                        lambda x, w, y, **kw: (rows.append(y.shape[0]), launcher(x, w, y, **kw)))
    got = run_lanes(eager.runner, prompts, 16)
    monkeypatch.undo()
    assert 3 in rows and max(rows) == 60  # the decode steps' 3 rows and the prompts' own, never padded
    for g, w, p in zip(got, run_lanes(cpu_runner(path), prompts, 16), prompts):
        assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)
    assert run_lanes(cuda_build(device_kind, path, decode_linear="mma").runner, prompts, 16) == got
    assert run_lanes(cuda_build(device_kind, path, decode_linear="mma", draft_tokens=3).runner, prompts, 16) == got


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_split_k_residual_projections_are_added_in_the_next_norm(device_kind, artifacts, kind, monkeypatch):
    """Capacity.split_k_norm: at the padded decode rows the output projections (and the dense FFN's down) leave
    their K slices for the norm after them to add (`add_slices_rms_norm_rows`, the slices of each call); greedy
    tokens are the CPU runner's up to bf16 ties, plain and MTP (verify rows), and graphs replay the eager tokens.
    Switched to 0 between steps the plain accumulating calls come back."""
    path = artifacts[(kind, "bf16")]
    cpu = load_model(path)
    prompts = [prompt(1, 5), prompt(2, 60), prompt(3, 23)]
    want = run_lanes(cpu_runner(path), prompts, 16)
    for draft_tokens in (0, 3):
        eager = cuda_build(device_kind, path, decode_linear="cublas", split_k_norm=2, graphs=False,
                           draft_tokens=draft_tokens)
        added = []
        launcher = eager.model.k.add_slices_rms_norm_rows
        monkeypatch.setattr(eager.model.k, "add_slices_rms_norm_rows",
                            lambda partials, *a, **kw: (added.append(partials.shape[0]), launcher(partials, *a, **kw)))
        got = run_lanes(eager.runner, prompts, 16)
        monkeypatch.undo()
        assert added and set(added) == {2}, draft_tokens
        for g, w, p in zip(got, want, prompts):
            assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)
        graphs = cuda_build(device_kind, path, decode_linear="cublas", split_k_norm=2, draft_tokens=draft_tokens)
        assert run_lanes(graphs.runner, prompts, 16) == got, draft_tokens
    from ninfer.backends.cuda.weights import Bf16Matrix

    # near-square matrices keep cuBLAS's call (as the 27B's 5120 x 6144 out projections), so does a K that is not
    # whole 8-column vectors a slice
    linear = eager.model.linear
    assert [linear.splits_k(Bf16Matrix(np.zeros(shape, np.uint16)), 1, 2) for shape in ((8, 16), (8, 12), (8, 40))] \
        == [True, False, False]
    eager.model.set_split_k_norm(0)
    monkeypatch.setattr(eager.model.k, "add_slices_rms_norm_rows", lambda *a, **kw: pytest.fail("slices added"))
    run_lanes(eager.runner, prompts[:1], 4)
    with pytest.raises(ValueError, match="between 0 and the 2 slices built for, got 4"):
        eager.model.set_split_k_norm(4)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_tuned_decode_path_matches_the_cpu_runner(device_kind, artifacts, kind):
    """decode_linear="auto": each bf16 shape's decode path as the tuning chose it (timed on the GPU; on the host,
    whose twins give no timings, each shape forced through each path in turn), greedy tokens equal the CPU runner's
    up to ties, and greedy MTP (4 verify rows a lane) equals greedy under the same paths."""
    from ninfer.backends.cuda.linear_tuning import DECODE_PATHS, candidate_paths

    path = artifacts[(kind, "bf16")]
    cpu = load_model(path)
    prompts = [prompt(1, 5), prompt(2, 60), prompt(3, 23)]
    want = run_lanes(cpu_runner(path), prompts, 16)
    tuned = cuda_build(device_kind, path, decode_linear="auto")
    shapes = sorted({tuple(m.shape) for m in tuned.model._linear_matrices()})
    assert shapes
    if device_kind == "cuda":  # the tuning ran at build: a timed path for every shape
        assert sorted(tuned.model.linear.decode_paths) == shapes
        assert all(set(tuned.model.decode_linear_timings[s]) == set(candidate_paths(s)) for s in shapes)
        choices = [dict(tuned.model.linear.decode_paths)]
    else:
        assert tuned.model.linear.decode_paths == {}
        choices = [{s: DECODE_PATHS[(i + turn) % len(DECODE_PATHS)] for i, s in enumerate(shapes)}
                   for turn in range(len(DECODE_PATHS))]
    for paths in choices:
        runs = []
        for draft_tokens in (0, 3):
            # eager: a build captures its decode graphs with the paths its own tuning chose (timings vary, most of
            # all on a shared GPU), so paths set afterwards would reach only the graphs captured later
            build = cuda_build(device_kind, path, decode_linear="auto", draft_tokens=draft_tokens, graphs=False)
            build.model.linear.decode_paths.clear()
            build.model.linear.decode_paths.update(paths)
            runs.append(run_lanes(build.runner, prompts, 16))
        for g, w, p in zip(runs[0], want, prompts):
            assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)
        assert runs[1] == runs[0], paths


def test_the_host_tuning_times_every_candidate_path_of_every_shape(artifacts):
    """The tuning itself run on the host twins (their times mean nothing; the plumbing is the GPU's): every
    distinct shape, every candidate path, and the path kept is the fastest timed."""
    from ninfer.backends.cuda.linear_tuning import candidate_paths

    model = cuda_build("host", artifacts[("moe", "bf16")], decode_linear="auto").model
    timings = model.tune_decode_linears()
    shapes = {tuple(m.shape) for m in model._linear_matrices()}
    assert set(timings) == shapes and set(model.linear.decode_paths) == shapes
    for shape, by_path in timings.items():
        assert set(by_path) == set(candidate_paths(shape)) and all(t > 0 for t in by_path.values())
        assert by_path[model.linear.decode_paths[shape]] == min(by_path.values())
    assert "tuning" not in model.device.ledger  # its buffers are given back


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tensor_core_quantized_decode_matches_the_cpu_runner(device_kind, artifacts, kind):
    """decode_quant="mma": ninfer-v2 matrices in the tensor-core layout (the stacked MoE experts too, read by the
    gathered tensor-core kernel), bf16 activations at decode (8-row launches; 9+ rows exercise the chunking, the
    gathered launches' too) and the layout's own dequantization for prefill: logits within the bf16 tolerance
    (measured 0.6-0.7% here before the experts moved to the tensor cores), greedy MTP equal to greedy. Greedy tokens
    equal the CPU runner's up to ties for the dense model; the tiny MoE's router has near-ties that bf16-rounded
    activations flip (one of these prompts diverges with a 0.45 logit gap), so there only the logits are compared."""
    from ninfer.backends.cuda.capacity import SKINNY_ROWS

    path = artifacts[(kind, "ninfer-v2")]
    cpu = load_model(path)
    build = cuda_build(device_kind, path, decode_quant="mma")
    assert any(getattr(m, "tensor_core", False) for m in build.model._matrices())
    if kind == "moe":
        assert all(getattr(layer.ffn.routed_gate_up, "tensor_core", False)
                   and getattr(layer.ffn.routed_down, "tensor_core", False) for layer in build.model.layers)
    for length in (1, 7, 9, 64, SKINNY_ROWS + 1):
        got, want = prompt_logits(build.model, cpu, prompt(length, length))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, length
    prompts = [prompt(1, 5), prompt(2, 60), prompt(3, 23)]
    got = run_lanes(cuda_build(device_kind, path, decode_quant="mma").runner, prompts, 24)
    if kind == "dense":
        want = run_lanes(cpu_runner(path), prompts, 24)
        for g, w, p in zip(got, want, prompts):
            assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)
    speculative = run_lanes(cuda_build(device_kind, path, decode_quant="mma", draft_tokens=3).runner, prompts, 24)
    assert speculative == got  # greedy MTP equals greedy, row for row (verify rows: 4 per lane, chunked by 8)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_short_prefill_chunks_replay_graphs_with_the_tokens_of_the_tiled_path(device_kind, artifacts, kind,
                                                                              monkeypatch):
    """Prefill chunks of at most 64 rows (and few enough keys) run the decode path, captured by row count, their MTP
    columns too; the tokens equal those of the same chunks through the tiled prefill attention (the bound set to 0)
    up to float ties, greedy MTP included."""
    import ninfer.backends.cuda.model as cuda_model

    path = artifacts[(kind, "bf16")]
    cpu = load_model(path)
    prompts = [prompt(1, 40), prompt(2, 90), prompt(3, 23)]  # chunks: 32 + 8, 32 + 58, 23
    build = cuda_build(device_kind, path, draft_tokens=3)
    got = run_lanes(build.runner, prompts, 16, chunk=32)
    prefill_keys = {key for key in build.runner._graphs if key[0] == "prefill"}
    assert prefill_keys == {("prefill", n) for n in (32, 8, 58, 23)}
    # the MTP head over each chunk's columns: 31 (a first chunk drops its first token), 9 and 59 (the bridge column
    # of a later chunk, and the sampled token of a final one), 23
    assert {("mtp", n) for n in (31, 9, 59, 23)} <= set(build.runner._graphs)
    monkeypatch.setattr(cuda_model, "SHORT_PREFILL_ROW_KEYS", 0)
    tiled = cuda_build(device_kind, path, draft_tokens=3)
    want = run_lanes(tiled.runner, prompts, 16, chunk=32)
    assert not any(key[0] == "prefill" for key in tiled.runner._graphs)
    for g, w, p in zip(got, want, prompts):
        assert_same_or_near_tie(g, w, cpu, p)


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_full_prefill_chunks_replay_graph_pieces_with_the_eager_bits(device_kind, artifacts, case):
    """A 300-token prompt in the runner's 128-row chunks: the two full ones replay the graphs captured at startup in
    pieces, each attention layer's prefill attention run eagerly between them at the chunk's own KV start; the
    44-row remainder runs eagerly. The tokens, and the lane's last hidden row bit for bit, are those of a build
    without graphs (the same launches)."""
    path = artifacts[case]
    prompts = [prompt(7, 300)]
    eager = cuda_build(device_kind, path, graphs=False, max_context=512)
    assert not any(key[0] == "prefill pieces" for key in eager.runner._graphs)
    built = cuda_build(device_kind, path, max_context=512)
    pieces = built.runner._graphs.get(("prefill pieces", 128))
    if device_kind == "cuda":  # a graph before each attention layer's attention, and one after the last
        attention_layers = sum(layer.attention is not None for layer in built.model.layers)
        assert pieces.pieces == attention_layers + 1
    spans, replay = [], pieces.replay
    pieces.replay = lambda handle, span: (spans.append(span), replay(handle, span))

    def tokens(runner) -> list[int]:
        lane = Lane(runner, 0, prompts[0], sampling=GREEDY, budget=8)
        lane.prefill(128, 128)  # and the 44 left
        while not lane.done:
            decode_round(runner, [lane])
        return lane.tokens

    assert tokens(built.runner) == tokens(eager.runner)
    assert [(span.lane, span.kv_start) for span in spans] == [(0, 0), (0, 128)]
    np.testing.assert_array_equal(built.model.device.read(built.model.tails),
                                  eager.model.device.read(eager.model.tails))


def test_a_prefill_capture_starts_with_no_dequantization_queued_ahead(artifacts):
    """Each prefill capture at startup (the full-size chunk's, then each bucket's) follows an eager pass, whose
    dequantizer queues the matrices it predicts next outside any capture; a capture that waited on them fails on the
    GPU (CUDA_ERROR_STREAM_CAPTURE_ISOLATION: the dense ninfer-v2 bucket capture, session 40). So the queue is empty
    when each capture begins."""
    from ninfer.backends.cuda import dequant_ahead
    from ninfer.backends.cuda import host as host_module

    dequantizers, queued = [], []
    capture, init = host_module.HostDevice.capture_pieces, dequant_ahead.WeightDequantizer.__init__

    def counting_capture(device, record):
        queued.append(dequantizers[-1].queued)
        return capture(device, record)

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        dequantizers.append(self)

    host_module.HostDevice.capture_pieces = counting_capture
    dequant_ahead.WeightDequantizer.__init__ = recording_init
    try:  # the build captures at startup (dense models dequantize two matrices ahead)
        build = cuda_build("host", artifacts[("dense", "ninfer-v2")], prefill_chunk=256, prefill_buckets=True)
    finally:
        host_module.HostDevice.capture_pieces, dequant_ahead.WeightDequantizer.__init__ = capture, init
    assert build.model.linear.dequantizer is dequantizers[-1] and dequantizers[-1].ahead == 2
    assert queued == [0, 0]  # the full-size chunk's and the 128-row bucket's


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_padded_prefill_chunks_replay_their_buckets_graphs_and_leave_other_lanes_alone(device_kind, artifacts, case):
    """With prefill buckets (256-row chunks: shorter ones past 64 rows padded to 128, or to 256), three lanes
    prefill 100 tokens (padded to 128), 200 (to 256) and 70 + 80 (to 128 twice, the second at KV start 70), each
    chunk replaying the graph pieces of its padded rows with its real rows in the span; then decode rounds of all
    three. The padded rows write no KV (a lane's unassigned page-table entries name page 0, lane 0's first page) and
    leave the recurrent state alone: the tokens and every lane's last hidden row are those of the same padding
    without graphs bit for bit, and the tokens those of an unpadded build up to a near-tie (a GEMM's rounding
    follows its row count, even NumPy's on the host), the hidden rows close."""
    path = artifacts[case]
    prompts = [prompt(11, 100), prompt(12, 200), prompt(13, 150)]
    plain = cuda_build(device_kind, path, graphs=False, prefill_chunk=256)
    eager = cuda_build(device_kind, path, graphs=False, prefill_chunk=256, prefill_buckets=True)
    bucketed = cuda_build(device_kind, path, prefill_chunk=256, prefill_buckets=True)
    assert bucketed.model.prefill_buckets_rows() == [128] and plain.model.padded_prefill_rows(100) == 100
    spans: dict[int, list] = {128: [], 256: []}
    for rows, replayed in spans.items():
        pieces = bucketed.runner._graphs.get(("prefill pieces", rows))
        pieces.replay = lambda handle, span, replay=pieces.replay, replayed=replayed: (replayed.append(span),
                                                                                       replay(handle, span))

    def tokens(runner) -> list[list[int]]:
        lanes = [Lane(runner, i, p, sampling=GREEDY, budget=6) for i, p in enumerate(prompts)]
        lanes[0].prefill(256)
        lanes[1].prefill(256)
        lanes[2].prefill(70)  # and the 80 left
        while not all(lane.done for lane in lanes):
            decode_round(runner, [lane for lane in lanes if not lane.done])
        return [lane.tokens for lane in lanes]

    got = tokens(bucketed.runner)
    assert [(span.lane, span.kv_start, span.rows) for span in spans[128]] == [(0, 0, 100), (2, 0, 70), (2, 70, 80)]
    assert [(span.lane, span.kv_start, span.rows) for span in spans[256]] == [(1, 0, 200)]
    assert tokens(eager.runner) == got
    tails = bucketed.model.device.read(bucketed.model.tails)
    np.testing.assert_array_equal(tails, eager.model.device.read(eager.model.tails))
    cpu = load_model(path)
    for g, w, p in zip(got, tokens(plain.runner), prompts):
        assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)
    assert np.linalg.norm(tails - plain.model.device.read(plain.model.tails)) < 2e-2 * np.linalg.norm(tails)


def test_padded_prefill_rows_are_powers_of_two_between_the_skinny_rows_and_the_chunk(artifacts):
    model = cuda_build("host", artifacts[("dense", "bf16")], graphs=False, prefill_chunk=256,
                       prefill_buckets=True).model
    assert [model.padded_prefill_rows(n) for n in (1, 64, 65, 128, 129, 255, 256)] == [1, 64, 128, 128, 256, 256,
                                                                                       256]
    rows, span = model.stage_prefill(1, 30, np.arange(5, 105), text_positions(30, 100))
    assert rows == 128 and (span.lane, span.kv_start, span.rows) == (1, 30, 100)
    read = model.device.read
    assert list(read(model.inputs.row_pos[:rows])) == list(range(30, 130)) + [-1] * 28
    assert list(read(model.inputs.token_ids[:rows])) == list(range(5, 105)) + [0] * 28
    assert list(read(model.inputs.seg_count[:1])) == [100]
    rows, span = model.stage_prefill(1, 30, np.arange(5, 105), text_positions(30, 100), pad=False)
    assert rows == 100 and span.rows is None
    model.prefill_buckets = False
    assert model.padded_prefill_rows(100) == 100 and model.prefill_buckets_rows() == []


def test_capture_prefill_refuses_a_chunk_that_reads_the_group_sizes_back(artifacts):
    """A MoE model's long chunk whose expert GEMMs read the group sizes back cannot be captured (the read would
    wait on the host mid-graph): piecewise_prefill says so and capture_prefill raises; no graph is held for it."""
    model = cuda_build("host", artifacts[("moe", "bf16")], graphs=False).model
    assert model.piecewise_prefill(128) and model.piecewise_prefill(1)
    assert not model.piecewise_prefill(0) and not model.piecewise_prefill(129)  # past the capacity's chunk
    model.moe_sync_free = False
    assert not model.piecewise_prefill(128) and model.piecewise_prefill(64)  # (64: SKINNY_ROWS, no grouping)
    with pytest.raises(ValueError, match="sync"):
        model.capture_prefill(128)


def test_a_bounded_graph_cache_frees_old_shapes_and_changes_no_token(device_kind, artifacts):
    """With room for 2 shapes beyond the pinned decode graphs, a run through many shapes (prefill lengths, verify
    rounds, MTP head) frees the least recently used ones and recaptures them when they return; tokens are those of
    the unbounded cache."""
    path = artifacts[("dense", "bf16")]
    prompts = [prompt(1, 40), prompt(2, 90), prompt(3, 23)]
    want = run_lanes(cuda_build(device_kind, path, draft_tokens=3).runner, prompts, 16, chunk=32)
    bounded = cuda_build(device_kind, path, draft_tokens=3)
    bounded.runner._graphs.spare = 2
    assert run_lanes(bounded.runner, prompts, 16, chunk=32) == want
    cache = bounded.runner._graphs
    assert cache.evictions > 0
    from ninfer.backends.cuda.runner import decode_key

    pinned = {decode_key(size, size) for size in range(1, bounded.runner.info.lanes + 1)}
    pinned.add(("prefill pieces", bounded.model.capacity.prefill_rows))  # the full-size prefill chunk's
    assert pinned <= set(cache) and len(cache) <= len(pinned) + 2


def test_greedy_decode_steps_replay_the_graphs_the_startup_captured(device_kind, artifacts):
    """Without speculation, greedy lanes of every batch size decode through the graphs `capture_decode_graphs` made
    at startup (their key is the decode step's own): no decode graph is captured while serving."""
    from ninfer.backends.cuda.runner import decode_key

    build = cuda_build(device_kind, artifacts[("dense", "bf16")], lanes=3)
    startup = {key for key in build.runner._graphs if key[0] == "decode"}
    assert startup == {decode_key(size, size) for size in (1, 2, 3)}
    run_lanes(build.runner, [prompt(1, 20), prompt(2, 9), prompt(3, 14)], 6)
    assert {key for key in build.runner._graphs if key[0] == "decode"} == startup


def test_the_short_prefill_bound(device_kind, artifacts):
    from ninfer.backends.cuda.capacity import SHORT_PREFILL_ROW_KEYS, SKINNY_ROWS

    model = cuda_build(device_kind, artifacts[("dense", "bf16")]).model
    assert model.capacity.short_prefill_rows == SKINNY_ROWS  # prefill_chunk 128
    assert model.short_prefill(SKINNY_ROWS, SHORT_PREFILL_ROW_KEYS // SKINNY_ROWS - SKINNY_ROWS)
    assert not model.short_prefill(SKINNY_ROWS, SHORT_PREFILL_ROW_KEYS // SKINNY_ROWS - SKINNY_ROWS + 1)
    assert not model.short_prefill(SKINNY_ROWS + 1, 0) and not model.short_prefill(0, 0)
    assert model.short_prefill(1, SHORT_PREFILL_ROW_KEYS - 1)


@pytest.mark.parametrize("attention", ["gemm", "flash"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tensor_core_prefill_attention_matches_the_cpu_model(device_kind, artifacts, kind, attention):
    """prefill_attention="gemm" (bf16 queries and probabilities through cuBLAS) and "flash" (one tensor-core kernel,
    bf16 queries and P, every model's default): within bf16 tolerance."""
    path = artifacts[(kind, "bf16")]
    build = cuda_build(device_kind, path, tensor_core_attention=True)
    assert build.model.prefill_attention == "flash"
    assert build.model.branches == (kind == "moe")
    build.model.prefill_attention = attention
    cpu = load_model(path)
    for length in (1, 7, 65, 128):
        got, want = prompt_logits(build.model, cpu, prompt(length, length))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, length


@pytest.mark.parametrize("recipe", ["bf16", "ninfer-v2"])
def test_padded_and_chunked_expert_gemms_give_the_grouped_gemms_logits(device_kind, artifacts, recipe):
    """The MoE prefill's expert GEMMs as one strided-batched call over experts padded to the largest count, or one
    pointer-array batched call over 128-row chunks, against the grouped call over contiguous groups: the same
    logits (bitwise on the host's twins, within a bf16 step's effect on the GPU, where each call picks its own
    kernels), and the CPU model's within bf16 tolerance; so do 64-row chunks, also with their batch count rounded up
    to a multiple of 5, or at the most chunks the rows can make (no read of the counts). "auto" gives the logits of
    the layout its rule picks for this routing; both fall back to the grouped call when their rows pass the
    scratch. (The counts read back: a chunk this short is sync-free by default, `moe_sync_free` None.)"""
    from ninfer.backends.cuda.capacity import MOE_CHUNK_ROWS

    path = artifacts[("moe", recipe)]
    build = cuda_build(device_kind, path, prefill_chunk=256)
    model, cpu = build.model, load_model(path)
    model.moe_sync_free = False
    blas, calls = model.linear.blas, []
    for name in ("batched_gemm_bf16", "chunked_gemm_bf16"):  # (the groups of a batched call, a chunked one's rows)
        call = getattr(blas, name)
        setattr(blas, name, lambda *args, name=name, call=call, **kw: (calls.append((name, args[4 if kw else -1])),
                                                                       call(*args, **kw)))
    ids = prompt(5, 100)
    logits, used = {}, {}
    for choice in ("grouped", "padded", "chunked", "auto"):
        model.moe_prefill_gemm = choice
        before = len(calls)
        logits[choice], want = prompt_logits(model, cpu, ids)
        used[choice] = set(calls[before:])
        assert np.linalg.norm(logits[choice] - want) / np.linalg.norm(want) < 2e-2, choice
    experts = model.dims.moe_experts
    picked = {("batched_gemm_bf16", experts): "padded", ("chunked_gemm_bf16", MOE_CHUNK_ROWS): "chunked"}
    assert used["grouped"] == set() and used["padded"] == {("batched_gemm_bf16", experts)}
    assert used["chunked"] == {("chunked_gemm_bf16", MOE_CHUNK_ROWS)} and len(used["auto"]) == 1
    for choice in ("padded", "chunked"):
        if device_kind == "host":
            np.testing.assert_array_equal(logits[choice], logits["grouped"])
        else:
            assert np.linalg.norm(logits[choice] - logits["grouped"]) / np.linalg.norm(logits["grouped"]) < 5e-3
    np.testing.assert_array_equal(logits["auto"], logits[picked[next(iter(used["auto"]))]])
    model.moe_prefill_gemm, model.moe_chunk_rows = "chunked", MOE_CHUNK_ROWS // 2  # smaller chunks, less padding
    chunked, batch_counts, got = blas.chunked_gemm_bf16, {}, {}
    # a batch count rounded up to a multiple of 5: the surplus chunks run over rows nothing reads
    for step in (1, 5):
        model.moe_chunk_step, batch_counts[step] = step, []
        blas.chunked_gemm_bf16 = lambda *args, step=step, **kw: (batch_counts[step].append(kw["chunks"]),
                                                                 chunked(*args, **kw))
        before = len(calls)
        got[step], _ = prompt_logits(model, cpu, ids)
        assert set(calls[before:]) == {("chunked_gemm_bf16", MOE_CHUNK_ROWS // 2)}
        if device_kind == "host":
            np.testing.assert_array_equal(got[step], logits["grouped"])
        else:
            assert np.linalg.norm(got[step] - logits["grouped"]) / np.linalg.norm(logits["grouped"]) < 5e-3
    # and sized without reading the counts back: each call at the most chunks the rows can make
    model.moe_chunk_step, model.moe_sync_free, batch_counts["free"] = 1, True, []
    model.moe_sync_free_chunk_rows = MOE_CHUNK_ROWS // 2
    blas.chunked_gemm_bf16 = lambda *args, **kw: (batch_counts["free"].append(kw["chunks"]), chunked(*args, **kw))
    free, _ = prompt_logits(model, cpu, ids)
    model.moe_sync_free = False
    blas.chunked_gemm_bf16 = chunked
    if device_kind == "host":
        np.testing.assert_array_equal(free, logits["grouped"])
    else:
        assert np.linalg.norm(free - logits["grouped"]) / np.linalg.norm(logits["grouped"]) < 5e-3
    dims = model.dims
    most = (len(ids) * dims.moe_top_k + dims.moe_experts * (MOE_CHUNK_ROWS // 2 - 1)) // (MOE_CHUNK_ROWS // 2)
    assert set(batch_counts["free"]) == {most} and most > max(batch_counts[1])
    assert batch_counts[5] == [-(-n // 5) * 5 for n in batch_counts[1]] != batch_counts[1]
    model.moe_chunk_rows, model.moe_chunk_step = MOE_CHUNK_ROWS, 1
    before = len(calls)
    routed = len(ids) * model.dims.moe_top_k
    model.workspace.perm_in = model.workspace.perm_in[:routed]  # room for the routed rows, not the padded ones
    for choice in ("padded", "chunked"):
        model.moe_prefill_gemm = choice
        got, _ = prompt_logits(model, cpu, ids)
        np.testing.assert_array_equal(got, logits["grouped"])
    assert len(calls) == before
    model.moe_prefill_gemm = "pad"
    with pytest.raises(ValueError, match="moe_prefill_gemm"):
        prompt_logits(model, cpu, ids)


def test_auto_expert_layout_pads_balanced_routing_and_chunks_skewed_routing(artifacts):
    """The "auto" rule on given expert counts (`moe_layout`'s twin, at the model's scratch size): padded while the
    experts padded to the largest count stay within 8/5 of the routed rows, chunked past it (each expert to whole
    MOE_CHUNK_ROWS chunks, chunks laid end to end), grouped when neither fits the permuted scratch; info says which,
    the rows in all and the largest count or the chunks."""
    from ninfer.backends.cuda.blas import MAX_CHUNKS
    from ninfer.backends.cuda.capacity import MOE_CHUNK_ROWS
    from ninfer.kernels_numba.moe import LAYOUT_CHUNKED, LAYOUT_GROUPED, LAYOUT_PADDED, moe_layout_reference

    model = cuda_build("host", artifacts[("moe", "bf16")], prefill_chunk=256).model
    experts = model.dims.moe_experts
    room = model.workspace.perm_in.shape[0]

    def layout(counts, choice="auto"):
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        return moe_layout_reference(offsets, choice=choice, chunk=MOE_CHUNK_ROWS, room=room, max_chunks=MAX_CHUNKS)

    balanced = np.full(experts, 20)
    # the largest count past which E x largest > 8/5 (20 (E - 1) + largest): just padded at one less
    edge = 160 * (experts - 1) // (5 * experts - 8) + 1
    balanced[0] = edge - 1
    info, starts = layout(balanced)
    assert info.tolist() == [LAYOUT_PADDED, experts * (edge - 1), edge - 1] and experts * (edge - 1) <= room
    np.testing.assert_array_equal(starts, np.arange(experts) * (edge - 1))
    balanced[0] = edge
    assert layout(balanced)[0][0] == LAYOUT_CHUNKED
    skewed = np.zeros(experts, np.int64)
    skewed[:2] = (MOE_CHUNK_ROWS + 1, 3)
    info, starts = layout(skewed)
    assert info.tolist() == [LAYOUT_CHUNKED, 3 * MOE_CHUNK_ROWS, 3]
    np.testing.assert_array_equal(starts[:3], [0, 2 * MOE_CHUNK_ROWS, 3 * MOE_CHUNK_ROWS])
    crowded = np.full(experts, room // experts + 1)
    info, starts = layout(crowded)
    assert info.tolist() == [LAYOUT_GROUPED, int(crowded.sum()), 0]
    np.testing.assert_array_equal(starts, np.arange(experts) * crowded[0])  # the offsets: rows stay in place
    assert layout(balanced, "grouped")[0].tolist() == [LAYOUT_GROUPED, int(balanced.sum()), 0]
    assert layout(balanced, "padded")[0][0] == LAYOUT_PADDED


@pytest.mark.parametrize("kind,recipe", CASES)
def test_batched_greedy_generation_matches_the_cpu_runner(device_kind, artifacts, kind, recipe):
    path = artifacts[(kind, recipe)]
    prompts = [prompt(1, 5), prompt(2, 60), prompt(3, 23)]
    got = run_lanes(cuda_build(device_kind, path).runner, prompts, 24)
    want = run_lanes(cpu_runner(path), prompts, 24)
    model = load_model(path)
    for g, w, p in zip(got, want, prompts):
        assert_same_or_near_tie(g, w, model, p)


@pytest.mark.parametrize("kind,recipe", [("moe", "bf16"), ("moe", "ninfer-v2"), ("dense", "ninfer-v2")])
def test_side_stream_branches_change_no_token(device_kind, artifacts, kind, recipe):
    """Capacity.branches (the MoE shared expert and the GDN a/b projection on a second stream) with the serving
    defaults (cuBLAS bf16 decode, tensor-core quantized decode): the same tokens as without, graphs and eager, greedy
    MTP too (its verify rows exceed one x-fragment set). On the host the side work runs once before and once after
    the serving stream's: a buffer one branch writes and the other reads would change tokens in one of the orders."""
    path = artifacts[(kind, recipe)]
    prompts = [prompt(4, 9), prompt(5, 31), prompt(6, 17)]
    settings = dict(decode_linear="cublas", decode_quant="mma")
    want = run_lanes(cuda_build(device_kind, path, branches=False, **settings).runner, prompts, 16)
    want_mtp = run_lanes(cuda_build(device_kind, path, branches=False, draft_tokens=3, **settings).runner, prompts,
                         16)
    for last in ((False, True) if device_kind == "host" else (False,)):
        for graphs in (True, False):
            build = cuda_build(device_kind, path, branches=True, side_work_last=last, graphs=graphs, **settings)
            assert build.model.branches
            assert run_lanes(build.runner, prompts, 16) == want, (last, graphs)
        speculative = cuda_build(device_kind, path, branches=True, side_work_last=last, draft_tokens=3, **settings)
        assert run_lanes(speculative.runner, prompts, 16) == want_mtp, last


@pytest.mark.parametrize("kind,quant", [("moe", "mma"), ("dense", "mma"), ("moe", "simt")])
def test_dequantizing_ahead_changes_no_logit(device_kind, artifacts, kind, quant):
    """Capacity.dequant_ahead: a long prefill chunk's quantized matrices dequantized ahead of their GEMMs on a stream
    of their own, into spare buffers. The first chunk teaches the dequantizer the order, the next ones run ahead:
    the logits are those of dequantizing each matrix right before its GEMM, bit for bit (on the GPU: no GEMM read a
    buffer before or while its matrix was written, and none was overwritten under a GEMM)."""
    from ninfer.backends.cuda.capacity import SKINNY_ROWS

    path = artifacts[(kind, "ninfer-v2")]
    model = cuda_build(device_kind, path, decode_linear="cublas", decode_quant=quant).model
    cpu = load_model(path)
    ids = prompt(22, SKINNY_ROWS + 50)
    model.set_dequant_ahead(0)
    want, _ = prompt_logits(model, cpu, ids)
    for ahead in (1, 3):
        model.set_dequant_ahead(ahead)
        for _ in range(2):
            got, _ = prompt_logits(model, cpu, ids)
            assert np.array_equal(got, want), ahead
    dequantizer = model.linear.dequantizer
    assert dequantizer.hits > dequantizer.misses > 0
    model.set_dequant_ahead(0)
    assert np.array_equal(prompt_logits(model, cpu, ids)[0], want)


def test_split_projections_decode_in_one_pair_launch(artifacts, monkeypatch):
    """The dense ninfer-v2 recipe stores query|key (Q4) apart from gate|value and value|z (Q5): on the tensor-core
    decode path each such projection is one `linear_quant_mma_pair` launch, and the tokens stay the CPU runner's up to
    the near ties of bf16-rounded activations."""
    from ninfer.backends.cuda import host_kernels

    calls = []
    pair = host_kernels.linear_quant_mma_pair
    monkeypatch.setattr(host_kernels, "linear_quant_mma_pair",
                        lambda *a, **k: (calls.append(a[3].shape), pair(*a, **k)))
    path = artifacts[("dense", "ninfer-v2")]
    prompts = [prompt(10, 9), prompt(11, 20)]
    got = run_lanes(cuda_build("host", path, decode_linear="cublas", decode_quant="mma").runner, prompts, 6)
    # decode steps (1-2 rows) and these short prompts' prefill (up to 32 rows: one launch of 4 fragment sets)
    assert {rows for rows, _ in calls} >= {1, 2, 9} and max(rows for rows, _ in calls) <= 32
    cpu = load_model(path)
    for g, w, p in zip(got, run_lanes(cpu_runner(path), prompts, 6), prompts):  # bf16 activations: up to ties
        assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)


def test_split_projections_prefill_into_their_columns_without_a_join(artifacts, monkeypatch):
    """Past the decode rows each block of a split projection (27B ninfer-v2: query|key Q4, gate|value Q5) is one
    GEMM that writes its columns of the output from one bf16 copy of x: no concat_columns join at prefill rows, and
    the tokens stay the CPU runner's."""
    from ninfer.backends.cuda import host_kernels
    from ninfer.backends.cuda.host import HostBlas
    from ninfer.backends.cuda.capacity import SKINNY_ROWS

    joins, columns = [], []
    concat, gemm = host_kernels.concat_columns, HostBlas.gemm_bf16
    monkeypatch.setattr(host_kernels, "concat_columns", lambda a, b, y, **k: (joins.append(y.shape[0]),
                                                                                 concat(a, b, y, **k)))
    monkeypatch.setattr(HostBlas, "gemm_bf16", lambda self, x, w, y, **k: (
        columns.append((x.shape[0], k.get("first_column", 0), w.shape[0], y.shape[1])), gemm(self, x, w, y, **k)))
    path = artifacts[("dense", "ninfer-v2")]
    prompts = [prompt(14, SKINNY_ROWS + 20), prompt(15, 9)]
    got = run_lanes(cuda_build("host", path, decode_linear="cublas", decode_quant="mma").runner, prompts, 6)
    assert not [rows for rows in joins if rows > SKINNY_ROWS]
    split = [(first, n, width) for rows, first, n, width in columns if rows > SKINNY_ROWS and n < width]
    assert split and {first for first, _, _ in split} >= {0} and any(first > 0 for first, _, _ in split)
    assert all(first + n <= width for first, n, width in split)
    assert got == run_lanes(cpu_runner(path), prompts, 6)


def test_split_projections_join_short_rows_in_the_skinny_scratch(artifacts, monkeypatch):
    """On the SIMT quantized path each block of a split projection writes its rows into the workspace's scratch
    (SKINNY_ROWS rows a block, whatever the prefill chunk), then one join: decode steps and a short prompt, the CPU
    runner's tokens."""
    from ninfer.backends.cuda import host_kernels
    from ninfer.backends.cuda.capacity import SKINNY_ROWS

    joins = []
    concat = host_kernels.concat_columns
    monkeypatch.setattr(host_kernels, "concat_columns", lambda a, b, y, **k: (joins.append(y.shape[0]),
                                                                                 concat(a, b, y, **k)))
    path = artifacts[("dense", "ninfer-v2")]
    prompts = [prompt(16, SKINNY_ROWS), prompt(17, 9)]
    build, smaller = cuda_build("host", path, prefill_chunk=256), cuda_build("host", path, prefill_chunk=128)
    assert build.model.workspace.split_a.size == smaller.model.workspace.split_a.size
    got = run_lanes(build.runner, prompts, 6)
    assert joins and max(joins) == SKINNY_ROWS
    assert got == run_lanes(cpu_runner(path), prompts, 6)


@pytest.mark.parametrize("kind,recipe", [("moe", "ninfer-v2"), ("dense", "ninfer-v2"), ("moe", "bf16"),
                                         ("dense", "bf16")])
def test_programmatic_launch_changes_no_token(device_kind, artifacts, kind, recipe):
    """Capacity.programmatic_launch (the tensor-core quantized GEMVs, the bf16 gathered expert GEMVs and the Gated
    DeltaNet recurrence start while the kernel before them finishes and wait for it before reading its outputs): the
    same tokens as normal launches, graphs and eager, with the branches, and greedy MTP. On the GPU this is the check
    that no kernel reads an activation, an expert id or a conv output before its producer completed."""
    path = artifacts[(kind, recipe)]
    prompts = [prompt(7, 9), prompt(8, 31), prompt(9, 17)]
    settings = dict(decode_linear="cublas", decode_quant="mma")
    want = run_lanes(cuda_build(device_kind, path, **settings).runner, prompts, 16)
    for graphs in (True, False):
        build = cuda_build(device_kind, path, graphs=graphs, programmatic_launch=True, **settings)
        assert build.model.linear.programmatic
        assert run_lanes(build.runner, prompts, 16) == want, graphs
    want_mtp = run_lanes(cuda_build(device_kind, path, draft_tokens=3, **settings).runner, prompts, 16)
    speculative = cuda_build(device_kind, path, draft_tokens=3, programmatic_launch=True, **settings)
    assert run_lanes(speculative.runner, prompts, 16) == want_mtp


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_conv_in_projection_changes_no_token(device_kind, artifacts, kind, monkeypatch):
    """Capacity.conv_in_projection: on the ninfer-v2 decode rows each Gated DeltaNet conv runs in its in-projection's
    launch (the 35B-A3B's W8 matrix, the 27B's Q4 | Q5 pair), plain steps and MTP verify rows with their recorded
    histories: the same tokens as the GEMV then the conv kernel, eager and graphs, and greedy MTP equal to greedy.
    Switched off between steps, the conv kernel comes back."""
    path = artifacts[(kind, "ninfer-v2")]
    prompts = [prompt(4, 9), prompt(5, 33), prompt(6, 17)]
    settings = dict(decode_linear="cublas", decode_quant="mma")
    greedy = None
    for draft_tokens in (0, 3):
        want = run_lanes(cuda_build(device_kind, path, draft_tokens=draft_tokens, conv_in_projection=False,
                                    **settings).runner, prompts, 16)
        eager = cuda_build(device_kind, path, graphs=False, draft_tokens=draft_tokens, **settings)
        recorded, launcher = [], eager.model.k.linear_quant_mma_conv

        def spy(xf, parts, y, weight, state, columns, lanes, first_rows, counts, record, *a, **kw):
            on_host = record.copy_to_host() if hasattr(record, "copy_to_host") else record
            recorded.append(bool(np.asarray(on_host).any()))
            launcher(xf, parts, y, weight, state, columns, lanes, first_rows, counts, record, *a, **kw)

        monkeypatch.setattr(eager.model.k, "linear_quant_mma_conv", spy)
        got = run_lanes(eager.runner, prompts, 16)
        monkeypatch.undo()
        assert got == want, draft_tokens
        assert recorded and any(recorded) == (draft_tokens > 0), draft_tokens  # verify rows record histories
        graphs = cuda_build(device_kind, path, draft_tokens=draft_tokens, **settings)
        assert graphs.model.conv_in_projection and run_lanes(graphs.runner, prompts, 16) == want, draft_tokens
        greedy = greedy or got
        assert got == greedy
    _switched_off_between_steps(eager, monkeypatch, "conv_in_projection", "linear_quant_mma_conv", prompts)


def _switched_off_between_steps(build, monkeypatch, setting: str, launcher: str, prompts) -> None:
    """`set_<setting>(False)` on a built model: its next steps launch no `launcher`."""
    getattr(build.model, f"set_{setting}")(False)
    monkeypatch.setattr(build.model.k, launcher, lambda *a, **kw: pytest.fail(f"{launcher} with {setting} off"))
    run_lanes(build.runner, prompts[:1], 4)


@pytest.mark.parametrize("kind,recipe", CASES)
def test_ab_in_recurrence_keeps_the_tokens(device_kind, artifacts, kind, recipe, monkeypatch):
    """Capacity.ab_in_recurrence: the Gated DeltaNet decode and verify rows' a/b projection computed by the
    recurrence (fp32 sums in another order than the projection's GEMV): the tokens of the GEMV path or a near tie,
    eager and graphs alike, greedy MTP equal to greedy, and no a/b GEMV launched. Switched off between steps, the
    gated recurrence on the GEMV's output comes back."""
    path = artifacts[(kind, recipe)]
    prompts = [prompt(4, 9), prompt(5, 33), prompt(6, 17)]
    settings = dict(decode_linear="cublas", decode_quant="mma") if recipe == "ninfer-v2" else {}
    cpu = load_model(path)
    greedy = None
    for draft_tokens in (0, 3):
        want = run_lanes(cuda_build(device_kind, path, draft_tokens=draft_tokens, ab_in_recurrence=False,
                                    **settings).runner, prompts, 16)
        eager = cuda_build(device_kind, path, graphs=False, draft_tokens=draft_tokens, **settings)
        projected, launcher = [], eager.model.k.gdn_recurrent_projected
        monkeypatch.setattr(eager.model.k, "gdn_recurrent_projected",
                            lambda *a, **kw: projected.append(1) or launcher(*a, **kw))
        monkeypatch.setattr(eager.model.k, "gdn_recurrent_gated", lambda *a, **kw: pytest.fail("a/b GEMV path"))
        got = run_lanes(eager.runner, prompts, 16)
        monkeypatch.undo()
        assert projected, draft_tokens
        for tokens, reference, ids in zip(got, want, prompts):
            assert_same_or_near_tie(tokens, reference, cpu, ids)
        graphs = cuda_build(device_kind, path, draft_tokens=draft_tokens, **settings)
        assert graphs.model.ab_in_recurrence and run_lanes(graphs.runner, prompts, 16) == got, draft_tokens
        greedy = greedy or got
        assert got == greedy
    _switched_off_between_steps(eager, monkeypatch, "ab_in_recurrence", "gdn_recurrent_projected", prompts)


@pytest.mark.parametrize("kind,recipe", CASES)
def test_ab_in_recurrence_defaults_to_the_tensor_core_in_projections(device_kind, artifacts, kind, recipe,
                                                                      monkeypatch):
    """Capacity.ab_in_recurrence None: the recurrence projects a/b where the in-projection is a tensor-core
    quantized matrix (ninfer-v2 with the tensor-core decode kernels), not beside a bf16 in-projection's GEMM."""
    build = cuda_build(device_kind, artifacts[(kind, recipe)], graphs=False, ab_in_recurrence=None,
                       decode_linear="cublas", decode_quant="mma")
    calls = []
    for name in ("gdn_recurrent_projected", "gdn_recurrent_gated"):
        launcher = getattr(build.model.k, name)
        monkeypatch.setattr(build.model.k, name,
                            lambda *a, _name=name, _launch=launcher, **kw: calls.append(_name) or _launch(*a, **kw))
    run_lanes(build.runner, [prompt(4, 9)], 3)
    assert set(calls) == {"gdn_recurrent_projected" if recipe == "ninfer-v2" else "gdn_recurrent_gated"}


def test_capacity_settings_are_checked_where_they_are_given():
    from ninfer.backends.cuda.capacity import Capacity

    sizes = dict(lanes=1, max_context=256, kv_dtype="bf16", prefill_rows=128, draft_tokens=0)
    with pytest.raises(ValueError, match="fewest keys a split takes must be >= 0, got -1"):
        Capacity(**sizes, attention_min_split_keys=-1)
    with pytest.raises(ValueError, match="splits per row, got 0"):
        Capacity(**sizes, attention_splits=0)
    for slices in (-1, 3, 16):
        with pytest.raises(ValueError, match=f"split_k_norm must be 0 .off. or one of 1, 2, 4, 8 slices, got {slices}"):
            Capacity(**sizes, split_k_norm=slices)
    with pytest.raises(ValueError, match="recurrence_groups must be one of 4, 8, got 2"):
        Capacity(**sizes, recurrence_groups=2)


@pytest.mark.parametrize("kind,recipe", [("dense", "bf16"), ("moe", "ninfer-v2")])
def test_eight_key_groups_keep_the_tokens(device_kind, artifacts, kind, recipe):
    """Capacity.recurrence_groups 8: the decode recurrence's key sums over 8 threads (another fp32 order): the
    tokens of 4 groups or a near tie, greedy MTP equal to greedy, graphs as eager. A bad count is refused."""
    path = artifacts[(kind, recipe)]
    prompts = [prompt(4, 9), prompt(5, 33)]
    settings = dict(decode_linear="cublas", decode_quant="mma") if recipe == "ninfer-v2" else {}
    want = run_lanes(cuda_build(device_kind, path, **settings).runner, prompts, 12)
    eight = [run_lanes(cuda_build(device_kind, path, recurrence_groups=8, graphs=graphs, draft_tokens=draft,
                                  **settings).runner, prompts, 12)
             for graphs, draft in ((False, 0), (True, 0), (True, 3))]
    cpu = load_model(path)
    for tokens, reference, ids in zip(eight[0], want, prompts):
        assert_same_or_near_tie(tokens, reference, cpu, ids)
    assert eight[1] == eight[0] and eight[2] == eight[0]
    build = cuda_build(device_kind, path, **settings)
    with pytest.raises(ValueError, match="recurrence_groups must be one of 4, 8, got 16"):
        build.model.set_recurrence_groups(16)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_narrow_decode_is_the_dense_models_default(device_kind, artifacts, kind):
    """Capacity.narrow_decode None: on where the H200 measured it faster (the dense models' a/b projection), off for
    the MoE models (their fused router slowed the step)."""
    build = cuda_build(device_kind, artifacts[(kind, "bf16")], narrow_decode=None)
    assert build.model.linear.narrow is (kind == "dense")


@pytest.mark.parametrize("recipe", ["bf16", "ninfer-v2"])
def test_narrow_decode_routes_in_one_launch(device_kind, artifacts, recipe, monkeypatch):
    """Capacity.narrow_decode: the MoE router (and the a/b projection) of decode rows through `linear_narrow`, for up to
    8 rows the router's GEMV and the routing in one launch; more rows route through route_top_k, and prefill chunks past
    SKINNY_ROWS keep the cuBLAS router. Graphs give the eager tokens, greedy MTP the greedy ones, across batch and chunk
    sizes; with bf16 weights (fp32 activations throughout) they are the CPU runner's up to fp32 near ties (the tiny
    MoE's router has near ties that the quantized recipe's bf16-rounded activations flip). On the GPU this is the check
    that the routing block reads every block's logits and leaves its counter at zero for the next replay."""
    from ninfer.backends.cuda import host_kernels
    from ninfer.backends.cuda.capacity import SKINNY_ROWS

    routed, fused = [], []
    for name, calls in (("route_top_k", routed), ("linear_bf16_narrow_route", fused)):
        original = getattr(host_kernels, name)
        monkeypatch.setattr(host_kernels, name, lambda *a, _calls=calls, _original=original, **k: (
            _calls.append(a[0].shape[0]), _original(*a, **k)))
    path = artifacts[("moe", recipe)]
    prompts = [prompt(12, 5), prompt(13, SKINNY_ROWS + 9), prompt(14, 23)]
    settings = dict(decode_quant="mma", narrow_decode=True)
    eager = run_lanes(cuda_build(device_kind, path, graphs=False, **settings).runner, prompts, 16,
                      chunk=SKINNY_ROWS + 9)
    assert run_lanes(cuda_build(device_kind, path, **settings).runner, prompts, 16) == eager
    speculative = cuda_build(device_kind, path, draft_tokens=3, **settings)
    assert run_lanes(speculative.runner, prompts, 16) == eager
    if recipe == "bf16":
        cpu = load_model(path)
        for g, w, p in zip(eager, run_lanes(cpu_runner(path), prompts, 16), prompts):
            assert_same_or_near_tie(g, w, cpu, p)
    if device_kind == "host":
        # decode and short chunks of up to 8 rows in one launch; MTP verify rows (12) and long chunks apart
        assert fused and max(fused) <= 8 and routed and min(routed) > 8, (fused, routed)
    assert cuda_build(device_kind, path, **settings).model.linear.narrow
    assert not cuda_build(device_kind, path).model.linear.narrow  # off by default until measured


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_swiglu_epilogue_replaces_the_silu_mul_launches(device_kind, artifacts, kind, monkeypatch):
    """ninfer-v2 gate|up matrices on the tensor-core path are stored for the fused SwiGLU epilogue (`swiglu_order`):
    decode rows and short prefill chunks launch no silu-mul (the gate|up GEMV writes the down projection's x
    fragments), longer chunks dequantize them back in order for cuBLAS. Graphs give the eager tokens, greedy MTP the
    greedy ones, and the dense model's tokens are the CPU runner's up to bf16 near ties."""
    from ninfer.backends.cuda import host_kernels
    from ninfer.backends.cuda.capacity import SKINNY_ROWS

    silu_rows, fused = [], []
    for name, calls in (("silu_mul_rows", silu_rows), ("silu_mul_slots", silu_rows),
                        ("silu_mul_to_bf16_rows", silu_rows), ("linear_quant_mma_swiglu", fused),
                        ("linear_quant_mma_gathered_swiglu", fused)):
        original = getattr(host_kernels, name)
        monkeypatch.setattr(host_kernels, name, lambda *a, _calls=calls, _original=original, **k: (
            _calls.append(a[0].shape[0] if "silu" in _original.__name__ else 1), _original(*a, **k)))
    path = artifacts[(kind, "ninfer-v2")]
    build = cuda_build(device_kind, path, decode_quant="mma", graphs=False)
    ffns = [layer.ffn for layer in build.model.layers]
    stored = [f.gate_up for f in ffns] if kind == "dense" else [m for f in ffns for m in (f.routed_gate_up,
                                                                                           f.shared_gate_up)]
    assert all(m.swiglu_rows for m in stored)
    prompts = [prompt(15, 7), prompt(16, SKINNY_ROWS + 11), prompt(17, 30)]
    eager = run_lanes(build.runner, prompts, 12, chunk=SKINNY_ROWS + 11)
    assert run_lanes(cuda_build(device_kind, path, decode_quant="mma").runner, prompts, 12) == eager
    speculative = cuda_build(device_kind, path, decode_quant="mma", draft_tokens=3)
    assert run_lanes(speculative.runner, prompts, 12) == eager
    if kind == "dense":
        cpu = load_model(path)
        for g, w, p in zip(eager, run_lanes(cpu_runner(path), prompts, 12), prompts):
            assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)
    if device_kind == "host":
        assert fused and silu_rows and min(silu_rows) > SKINNY_ROWS, silu_rows  # only the long chunk's


def test_direct_quant_experts_multiply_the_codes_and_keep_the_tokens(device_kind, artifacts, monkeypatch):
    """With direct_quant_experts, a ninfer-v2 MoE prefill chunk past SKINNY_ROWS multiplies its routed experts from
    their codes (`linear_quant_mma_chunked`: the gate|up writing silu(gate) * up, then the down) and dequantizes no
    expert matrix; the sync-free layout (graph pieces or eager, the same tokens) and the read-back one (the layout
    forced to chunks of 128) give the dequantizing build's tokens up to bf16 near ties (the activation is rounded
    once from fp32 instead of from bf16 gate and up), and greedy MTP (its head's MoE too) the same tokens. Its
    dequantization scratch leaves the experts out."""
    from ninfer.backends.cuda import host_kernels
    from ninfer.backends.cuda.capacity import SKINNY_ROWS
    from ninfer.backends.cuda.weights import is_quantized

    chunked, dequantized = [], []
    original_chunked, original_dequantize = host_kernels.linear_quant_mma_chunked, host_kernels.dequantize_mma_bf16
    monkeypatch.setattr(host_kernels, "linear_quant_mma_chunked", lambda *a, **k: (
        chunked.append((a[0].shape[1], k["swiglu"], k["chunk"])), original_chunked(*a, **k)))
    monkeypatch.setattr(host_kernels, "dequantize_mma_bf16", lambda qw, out, **k: (
        dequantized.append(qw.shape), original_dequantize(qw, out, **k)))
    path = artifacts[("moe", "ninfer-v2")]
    prompts = [prompt(21, 200), prompt(22, SKINNY_ROWS + 30), prompt(23, 40)]
    dequantizing = cuda_build(device_kind, path, decode_quant="mma")
    want = run_lanes(dequantizing.runner, prompts, 8, chunk=128)
    build = cuda_build(device_kind, path, decode_quant="mma", direct_quant_experts=True)
    experts = {m.shape for layer in build.model.layers for m in (layer.ffn.routed_gate_up, layer.ffn.routed_down)}
    # the dequantization scratch holds the largest other quantized matrix, not the stacked experts
    others = [m.shape[0] * m.shape[1] for m in build.model._matrices() if is_quantized(m) and m.shape not in experts]
    assert build.model.workspace.w_bf16.shape[0] == max(others) < dequantizing.model.workspace.w_bf16.shape[0]
    dequantized.clear()
    got = run_lanes(build.runner, prompts, 8, chunk=128)
    eager = cuda_build(device_kind, path, decode_quant="mma", direct_quant_experts=True, graphs=False)
    assert run_lanes(eager.runner, prompts, 8, chunk=128) == got
    # the MTP layer's long prefill chunks take the same path; greedy MTP stays greedy
    speculative = cuda_build(device_kind, path, decode_quant="mma", direct_quant_experts=True, draft_tokens=3)
    assert run_lanes(speculative.runner, prompts, 8, chunk=128) == got
    eager.model.moe_sync_free = False
    eager.model.moe_prefill_gemm = "padded"  # (the direct path takes chunks whatever this says)
    read_back = run_lanes(eager.runner, prompts, 8, chunk=128)
    cpu = load_model(path)
    for g, r, w, p in zip(got, read_back, want, prompts):
        assert_same_or_near_tie(g, w, cpu, p, tie=BF16_NEAR_TIE)
        assert_same_or_near_tie(r, w, cpu, p, tie=BF16_NEAR_TIE)
    if device_kind == "host":
        d = build.model.dims
        assert set(chunked) == {(d.hidden, True, 32), (d.moe_intermediate, False, 32), (d.hidden, True, 128),
                                (d.moe_intermediate, False, 128)}, set(chunked)
        assert not experts & set(dequantized), dequantized


def test_more_attention_splits_keep_the_greedy_tokens(device_kind, artifacts):
    """Capacity.attention_splits past 32 (the combine's lanes then merge several splits each): eager decode with the
    most splits gives the tokens the default gives, which match the CPU runner's."""
    path = artifacts[("dense", "bf16")]
    prompts = [prompt(3, 150), prompt(4, 9)]
    want = run_lanes(cuda_build(device_kind, path, lanes=2).runner, prompts, 12, chunk=64)
    build = cuda_build(device_kind, path, lanes=2, graphs=False)
    build.model.set_attention_splits(MAX_SPLITS)
    assert build.model.workspace.partials.shape[2] == MAX_SPLITS
    assert run_lanes(build.runner, prompts, 12, chunk=64) == want
    model = load_model(path)
    for got, expected, p in zip(want, run_lanes(cpu_runner(path, lanes=2), prompts, 12, chunk=64), prompts):
        assert_same_or_near_tie(got, expected, model, p)


def test_graph_replay_equals_eager_decode_and_batching_changes_nothing(device_kind, artifacts):
    path = artifacts[("moe", "ninfer-v2")]
    prompts = [prompt(4, 9), prompt(5, 31), prompt(6, 17)]
    graphs = run_lanes(cuda_build(device_kind, path).runner, prompts, 20)
    eager = run_lanes(cuda_build(device_kind, path, graphs=False).runner, prompts, 20)
    alone = [run_lanes(cuda_build(device_kind, path, lanes=1).runner, [p], 20)[0] for p in prompts]
    assert graphs == eager == alone


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["staged", "tensor-cores"])
def test_int8_kv_matches_the_cpu_runner(device_kind, artifacts, tmp_path, kind, tensor_cores):
    """INT8 KV through the staged SIMT decode kernel or (`tensor_core_decode_int8`, head dim 256) the tensor-core
    one: the CPU runner's tokens up to near ties, and greedy MTP (verify runs of 4 rows a lane) its own greedy
    tokens."""
    path = artifacts[(kind, "bf16")] if not tensor_cores else write_tiny_qwen_artifact(
        tmp_path / "d256.ninfer", moe=kind == "moe", recipe="bf16", head_dim=256)
    prompts = [prompt(7, 40), prompt(8, 3)]
    settings = dict(lanes=2, kv_dtype="int8", tensor_core_decode_int8=tensor_cores)
    got = run_lanes(cuda_build(device_kind, path, **settings).runner, prompts, 16)
    want = run_lanes(cpu_runner(path, lanes=2, kv_dtype="int8"), prompts, 16)
    model = load_model(path)
    for g, w, p in zip(got, want, prompts):
        assert_same_or_near_tie(g, w, model, p)
    if tensor_cores:
        assert run_lanes(cuda_build(device_kind, path, draft_tokens=3, **settings).runner, prompts, 16) == got


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_mtp_is_token_identical_to_greedy(device_kind, artifacts, k):
    path = artifacts[("dense", "predictable")]
    prompts = [prompt(9, 12), prompt(10, 40)]
    plain_build = cuda_build(device_kind, path, lanes=2)
    plain = run_lanes(plain_build.runner, prompts, 30)
    build = cuda_build(device_kind, path, lanes=2, draft_tokens=k)
    speculative = run_lanes(build.runner, prompts, 30)
    assert speculative == plain
    # the recurrence records k of a verify's k + 1 columns (the last one's state is the running state), and no
    # column at all without speculation
    assert build.model.gdn_bank.ssm_columns.shape[2] == k and plain_build.model.gdn_bank.ssm_columns.shape[2] == 0


def test_a_selection_of_the_unrecorded_last_column_is_refused(artifacts):
    model = cuda_build("host", artifacts[("dense", "predictable")], lanes=2, draft_tokens=3).model
    model.stage_selection([0, 1], [2, 1], [True, True])  # recorded columns
    model.stage_selection([0], [3], [False])  # the last column: the running states stay, nothing is copied
    with pytest.raises(ValueError, match="only columns below 3 are recorded"):
        model.stage_selection([0], [3], [True])


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tensor-core", "staged"])
def test_head_dim_256_decode_keeps_greedy_mtp_token_identical(device_kind, tmp_path, tensor_cores):
    """At the real models' head dim (256) bf16 decode attention runs on the tensor cores by default, a verify step's
    rows of one lane in one block: greedy MTP (k = 3) stays token-identical to greedy, and both give the CPU
    runner's tokens (or a near tie); the staged SIMT kernel the same."""
    path = write_tiny_qwen_artifact(tmp_path / "d256.ninfer", moe=False, recipe="bf16", predictable=True,
                                    head_dim=256)
    prompts = [prompt(9, 12), prompt(10, 40)]
    plain_build = cuda_build(device_kind, path, lanes=2)
    plain_build.model.set_tensor_core_decode(tensor_cores)
    plain = run_lanes(plain_build.runner, prompts, 30)
    build = cuda_build(device_kind, path, lanes=2, draft_tokens=3)
    build.model.set_tensor_core_decode(tensor_cores)
    assert run_lanes(build.runner, prompts, 30) == plain
    want = run_lanes(cpu_runner(path, lanes=2), prompts, 30)
    model = load_model(path)
    for g, w, p in zip(plain, want, prompts):
        assert_same_or_near_tie(g, w, model, p)


def test_lm_head_draft_proposes_from_the_shortlist_and_keeps_greedy_output(device_kind, artifacts):
    path = artifacts[("dense", "predictable")]  # its shortlist holds the even ids only
    prompts = [prompt(9, 12), prompt(10, 40)]
    plain = run_lanes(cuda_build(device_kind, path, lanes=2).runner, prompts, 30)
    runner = cuda_build(device_kind, path, lanes=2, draft_tokens=3, lm_head_draft=True).runner
    lane = Lane(runner, 0, prompts[0], budget=30)
    lane.prefill(1000)
    assert runner._lanes[0].drafts is not None and np.all(runner._lanes[0].drafts % 2 == 0)
    runner = cuda_build(device_kind, path, lanes=2, draft_tokens=3, lm_head_draft=True).runner
    assert run_lanes(runner, prompts, 30) == plain


@pytest.mark.parametrize("lm_head_draft", [False, True], ids=["full head", "shortlist"])
def test_the_draft_chain_proposes_the_cpu_runners_drafts(device_kind, artifacts, lm_head_draft):
    """A round's k proposals and the MTP steps between them run as one graph, each step's token copied on the device
    from the proposal before it (the shortlist's row through its id table): the drafts are the CPU runner's, after
    the prefill and after every round, with the graph replayed from the second round on."""
    path = artifacts[("dense", "predictable")]
    prompts = [prompt(9, 12), prompt(10, 40)]
    runners = [cuda_build(device_kind, path, lanes=2, draft_tokens=3, lm_head_draft=lm_head_draft).runner,
               CpuRunner(load_model(path), lanes=2, pages=8, draft_tokens=3, lm_head_draft=lm_head_draft)]
    lanes = [[Lane(runner, i, p, budget=24) for i, p in enumerate(prompts)] for runner in runners]
    for pair in zip(*lanes):
        for lane in pair:
            lane.prefill(1000)
    rounds = 0
    while not all(lane.done for lane in lanes[0]):
        for i in range(len(prompts)):
            got, want = (runner._lanes[i].drafts for runner in runners)
            assert (got is None) == (want is None) and (got is None or np.array_equal(got, want)), (rounds, i)
        for runner, group in zip(runners, lanes):
            decode_round(runner, [lane for lane in group if not lane.done])
        rounds += 1
    assert rounds > 2 and lanes[0][0].tokens == lanes[1][0].tokens


def test_sampled_generation_matches_the_cpu_runner(device_kind, artifacts):
    path = artifacts[("dense", "bf16")]
    prompts = [prompt(11, 20), prompt(12, 8)]
    got = run_lanes(cuda_build(device_kind, path, lanes=2).runner, prompts, 12, sampling=SAMPLED)
    want = run_lanes(cpu_runner(path, lanes=2), prompts, 12, sampling=SAMPLED)
    assert got == want  # same seeds, same candidates unless a near-tie reorders the top 20 (none here)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sampled_mtp_generation_matches_the_cpu_runner(device_kind, artifacts, kind):
    """Sampled lanes (presence penalty on) under MTP k = 3: the accept rules over the device's candidates (each verify
    column's with the round's earlier drafts counted) give the CPU runner's tokens, which applies them to its full
    logits."""
    path = artifacts[(kind, "bf16")]
    prompts = [prompt(11, 20), prompt(12, 8)]
    got = run_lanes(cuda_build(device_kind, path, lanes=2, draft_tokens=3).runner, prompts, 24, sampling=SAMPLED)
    want = run_lanes(cpu_runner(path, lanes=2, draft_tokens=3), prompts, 24, sampling=SAMPLED)
    assert got == want


def test_checkpoint_restores_the_state_it_saved(device_kind, artifacts):
    path = artifacts[("dense", "bf16")]
    runner = cuda_build(device_kind, path, lanes=1).runner
    ids = prompt(13, 30)
    first = Lane(runner, 0, ids, budget=1)
    first.prefill(1000)
    runner.save_checkpoint(0, 1)
    continued = run_lanes_from(runner, first, 10)
    again = Lane(runner, 0, ids, budget=1, checkpoint=(1, len(ids)))
    again.tokens = list(first.tokens[:1])
    assert run_lanes_from(runner, again, 10) == continued


def run_lanes_from(runner, lane: Lane, extra: int) -> list[int]:
    lane.budget = len(lane.tokens) + extra
    while not lane.done:
        decode_round(runner, [lane])
    return lane.tokens


def test_the_engine_serves_batched_requests_on_the_cuda_runner(device_kind, artifacts):
    """Continuous batching on the CUDA runner: 10 requests, greedy and sampled, 8 lanes; each request's tokens
    equal the same request served alone by the same configuration (graphs of every batch size get replayed; the
    cuBLAS decode shape is fixed per configuration)."""
    from ninfer.backends.cuda.build import build_cuda_runner
    from ninfer.engine.engine import Engine
    from ninfer.targets.registry import QWEN_27B_PRESETS
    from tests.test_engine_batching import requests

    path, work = artifacts[("moe", "bf16")], requests(10)

    def run_all(concurrency: int, items) -> list[tuple[int, ...]]:
        config = EngineConfig(max_concurrency=concurrency, max_context=512, prefill_chunk=128,
                              kv_capacity=concurrency * 512)
        runner = build_cuda_runner(Artifact.open(path), config, device=make_device(device_kind)).runner
        with Engine(runner, config, QWEN_27B_PRESETS) as engine:
            handles = [engine.submit(prompt, options) for prompt, options in items]
            return [handle.result(timeout=300).tokens for handle in handles]

    batched = run_all(8, work)
    alone = [run_all(8, [item])[0] for item in work]
    assert batched == alone
    assert [len(tokens) for tokens in batched] == [options.max_tokens for _, options in work]


def test_kv_capacity_auto_is_sized_from_the_free_memory_after_the_whole_layout(artifacts):
    """On HostDevice (64 GiB reported): auto takes what the weights, lane state, workspace, inputs, graph allowance
    and 1 GiB leave, capped at what the lanes can use; an explicit capacity is kept exactly or refused."""
    from ninfer.backends.cuda.build import GRAPH_ALLOWANCE_PER_SHAPE, KvCapacityDoesNotFit, build_cuda_runner
    from ninfer.backends.cuda.graph_cache import SPARE_GRAPHS
    from ninfer.backends.cuda.host import HostDevice
    from ninfer.engine.kv_pool import AUTO_HEADROOM_BYTES

    path = artifacts[("dense", "bf16")]

    def build(capacity, max_context=256, device_bytes=64 << 30):
        config = EngineConfig(max_concurrency=2, max_context=max_context, prefill_chunk=128, kv_capacity=capacity)
        return build_cuda_runner(Artifact.open(path), config, device=HostDevice(device_bytes))

    auto = build("auto")
    sizing = auto.sizing
    assert sizing["policy"] == "auto" and sizing["pages"] == 2 * 4  # all the 2 lanes x 256 tokens can use
    reserved = sum(size for purpose, size in auto.ledger.items() if purpose not in ("weights", "kv"))
    assert sizing["runtime_reservation_bytes"] == reserved > 0
    assert sizing["headroom_bytes"] == AUTO_HEADROOM_BYTES
    # a graph's allowance for each lane's decode graph, the 2 pieces of the prefill chunk (one attention layer) and
    # each spare shape
    assert sizing["graph_allowance_bytes"] == GRAPH_ALLOWANCE_PER_SHAPE * (2 + 2 + SPARE_GRAPHS)
    assert auto.ledger["kv"] == sizing["pool_bytes"] == sizing["pages"] * 64 * sizing["bytes_per_token"]
    assert sizing["free_after_startup_bytes"] <= sizing["free_after_weights_bytes"] - reserved - sizing["pool_bytes"]
    explicit = build(300)
    assert explicit.sizing["policy"] == "explicit" and explicit.sizing["capacity_tokens"] == 320  # whole pages
    with pytest.raises(KvCapacityDoesNotFit, match="GiB"):  # 64 MiB of KV on a 48 MiB device: never reduced
        build(2 * 65536, max_context=65536, device_bytes=48 << 20)
    roomy = build("auto", max_context=65536).sizing
    assert roomy["pages"] == 2 * 1024
    layout = (64 << 30) - roomy["free_after_weights_bytes"] + roomy["runtime_reservation_bytes"] \
        + roomy["graph_allowance_bytes"]
    sequence = 1024 * 64 * roomy["bytes_per_token"]
    tight = build("auto", max_context=65536, device_bytes=layout + AUTO_HEADROOM_BYTES + sequence * 3 // 2).sizing
    assert tight["pages"] == 1024 * 3 // 2  # what the memory holds, not what the lanes could use
