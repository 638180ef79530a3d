"""CUDA backend at the real Qwen3.6 shapes, random weights generated on the GPU (no files).

Per model (27B, 35B-A3B), recipe (bf16, ninfer-v2) and KV dtype it reports:
* decode step time at batch 1, 2, 4, 8 (MTP off, captured graph replay: decoder + head + argmax), tok/s, and the
  ratio to the bandwidth roofline (compulsory bytes per step / measured device copy bandwidth), with the skinny
  kernels and, for bf16, with cuBLAS for every linear layer (the comparison point);
* prefill of 8,192 prompt tokens in one chunk (eager), tok/s, and the ratio to the GEMM roofline (linear-layer and
  attention FLOPs / measured cuBLAS bf16 rate), with the numba attention kernel and with tensor-core attention;
* the MTP round (verify k+1 columns + MTP head over the produced columns + k-1 draft steps, each proposal an argmax
  over the full head) for k = 1..3 at batch 1, through the runner's own code path; with `--lm-head-draft` (the
  serving option) also with proposals from the shortlist head (131,072 rows), side by side.

Run on the GPU machine: `python bench/cuda_model.py [--models 27b,35b] [--recipes bf16,ninfer-v2]`; JSON goes to
`$OUT/cuda_model.json` (or `bench/results/cuda_model.json` without OUT).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402  (numpy shim first)

from bench.host_trace import GcPauses  # noqa: E402
from ninfer.backends.cuda.timing import wall_seconds  # noqa: E402
from ninfer.backends.cuda.device import CudaDevice  # noqa: E402
from ninfer.backends.cuda.capacity import Capacity, PrefillSpan  # noqa: E402
from ninfer.backends.cuda.inputs import SampledRows  # noqa: E402
from ninfer.engine.sampler import Purpose, SamplingParams  # noqa: E402
from ninfer.backends.cuda.model import CudaQwen  # noqa: E402
from ninfer.backends.cuda.weights import RandomDeviceWeights  # noqa: E402
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs  # noqa: E402
from ninfer.targets.registry import QWEN36_27B_DIMS, QWEN36_35B_A3B_DIMS  # noqa: E402

MODELS = {"27b": QWEN36_27B_DIMS, "35b": QWEN36_35B_A3B_DIMS}
CONTEXT = 1024  # tokens already in each lane's KV during decode timing
PREFILL = 8192
PREFILL_REPEATS = 7  # timed prefills a setting (the median is reported)
PREFILL_WARMUPS = 2  # untimed ones first (session 22: 5 runs after one warm-up spread 156.9-171.8 ms)
SUFFIX = 32  # a returning turn's new prompt tokens, prefilled after the 8K context


def event_time(stream, run, repeats: int) -> list[float]:
    """Per-call seconds of `run()` on `stream`, each call timed with its own pair of events (wall-clock on a
    HostDevice, whose stream is None: the CPU smoke test of this script)."""
    out = []
    for _ in range(repeats):
        if stream is None:
            began = time.perf_counter()
            run()
            out.append(time.perf_counter() - began)
            continue
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        out.append(cuda.event_elapsed_time(start, end) / 1e3)
    return out


def back_to_back(stream, run, count: int = 20) -> tuple[float, float]:
    """(GPU seconds a call, host seconds a call) of `count` calls of `run()` queued back to back between one pair
    of events: the step time with the host's launch latency hidden behind the GPU (`event_time` times each call
    from an idle stream, so it includes the graph launch's latency, as a serving loop that waits for each step's
    tokens pays it), and what the enqueueing costs the host."""
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    began = time.perf_counter()
    for _ in range(count):
        run()
    host = (time.perf_counter() - began) / count
    end.record(stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / 1e3 / count, host


def copy_bandwidth(device: CudaDevice) -> float:
    size = 4 << 30
    a = device.empty(size // 4, np.float32, "bench")
    b = device.empty(size // 4, np.float32, "bench")
    from ninfer.backends.cuda.device import copy_device

    times = event_time(device.stream, lambda: copy_device(b, a, device.stream_handle), 10)
    return 2 * size / float(np.median(times))  # bytes read + written


def gemm_rate(device: CudaDevice) -> float:
    from ninfer.backends.cuda.blas import Blas
    from ninfer.kernels_numba.fill import fill_uniform

    m, n, k = 8192, 17408, 5120
    x = device.empty((m, k), np.uint16, "bench")
    w = device.empty((n, k), np.uint16, "bench")
    y = device.empty((m, n), np.float32, "bench")
    fill_uniform(x, seed=1, scale=1.0, stream=device.stream)
    fill_uniform(w, seed=2, scale=0.02, stream=device.stream)
    blas = Blas(device)
    times = event_time(device.stream, lambda: blas.gemm_bf16(x, w, y), 10)
    blas.close()
    return 2 * m * n * k / float(np.median(times[2:]))


def layer_matrices(model: CudaQwen):
    """(name, matrix) for every weight matrix of the decoder layers (split projections as their parts)."""
    from ninfer.backends.cuda.weights import SplitMatrix

    for layer in model.layers:
        for part in (layer.attention, layer.gdn, layer.ffn):
            if part is None:
                continue
            for name in ("in_proj", "ab_proj", "output", "gate_up", "down", "router_shared_gate",
                         "shared_gate_up", "shared_down", "routed_gate_up", "routed_down"):
                value = getattr(part, name, None)
                if value is not None:
                    yield from ((name, p) for p in (value.parts if isinstance(value, SplitMatrix) else (value,)))
        if layer.gdn_output is not None:
            yield "output", layer.gdn_output


def matrix_bytes(model: CudaQwen) -> tuple[int, int]:
    """(bytes every decode step reads regardless of routing, bytes of one routed expert's two matrices in a layer)."""
    fixed, routed = model.head.nbytes, 0
    for name, matrix in layer_matrices(model):
        if name.startswith("routed_"):
            routed += matrix.nbytes
        else:
            fixed += matrix.nbytes
    moe_layers = len(model.layers) if model.dims.is_moe else 1
    return fixed, routed // max(1, model.dims.moe_experts) // moe_layers


def decode_bytes(model: CudaQwen, batch: int, context: int) -> int:
    dims = model.dims
    fixed, expert = matrix_bytes(model)
    if dims.is_moe:  # expected distinct experts among batch x top_k uniform picks, per MoE layer
        unique = dims.moe_experts * (1 - (1 - dims.moe_top_k / dims.moe_experts) ** batch)
        fixed += int(unique * expert * len(model.layers))
    attention_layers = sum(kind == "full_attention" for kind in dims.layer_types)
    per_token = 2 * dims.kv_heads * dims.head_dim * (2 if model.capacity.kv_dtype == "bf16" else 1)
    kv = batch * attention_layers * context * per_token
    state = batch * len(model.gdn) * 2 * 4 * (dims.gdn_v_heads * dims.gdn_k_dim * dims.gdn_v_dim +
                                             (dims.conv_kernel - 1) * dims.gdn_conv_channels)
    return fixed + kv + state


def prefill_flops(model: CudaQwen, tokens: int) -> float:
    """Linear-layer FLOPs (routed experts at top_k of E) plus causal attention FLOPs of one prefill."""
    dims = model.dims
    params = 0.0
    for name, matrix in layer_matrices(model):
        share = dims.moe_top_k / dims.moe_experts if name.startswith("routed_") else 1.0
        params += matrix.shape[0] * matrix.shape[1] * share
    attention_layers = sum(kind == "full_attention" for kind in dims.layer_types)
    attention = attention_layers * 4 * dims.attn_heads * dims.head_dim * tokens * tokens / 2
    return 2.0 * params * tokens + attention


class FirstPasses:
    """Times the first eager pass of each kind in a configuration (decode step, prefill), where the kernels it
    launches are compiled or loaded from the kernel cache: the seconds and the cache's counts go into `result`
    ("first_passes") and the log."""

    def __init__(self, result: dict) -> None:
        self._result = result.setdefault("first_passes", {})

    @contextlib.contextmanager
    def __call__(self, kind: str):
        from ninfer.kernels_numba import kernel_cache

        if kind in self._result:
            yield
            return
        counts, began = attrs.evolve(kernel_cache.COUNTS), time.perf_counter()
        yield
        seconds = time.perf_counter() - began
        after = kernel_cache.COUNTS
        record = {"seconds": seconds, "loaded": after.loaded - counts.loaded,
                  "compiled": after.compiled - counts.compiled, "failed": after.failed - counts.failed}
        self._result[kind] = record
        print(f"  first {kind} pass {seconds:.1f}s: kernels {record['loaded']} loaded, {record['compiled']} "
              f"compiled, {record['failed']} failed (cache {kernel_cache.report()['directory'] or 'off'})",
              flush=True)


def setup_lanes(model: CudaQwen, batch: int, context: int, *, sampled: bool = False) -> None:
    """Page tables for `batch` lanes holding `context` tokens each, and one decode row per lane (with `sampled`,
    each row drawn on the device with a serving preset's parameters)."""
    pages_per_lane = model.capacity.max_pages_per_lane
    for lane in range(batch):
        table = np.arange(lane * pages_per_lane, (lane + 1) * pages_per_lane, dtype=np.int32)
        model.inputs.set_page_table(lane, table)
    lanes = np.arange(batch)
    model.inputs.fill(token_ids=np.arange(batch) + 100, positions=np.full((3, batch), context),
                      row_lane=lanes, row_pos=np.full(batch, context), seg_lane=lanes, seg_row=lanes,
                      seg_count=np.ones(batch), seg_record=np.zeros(batch),
                      sampling=sampled_rows(batch, range(batch), context) if sampled else None)


SAMPLED_PRESET = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0, presence_penalty=1.5, seed=1)


def sampled_rows(rows: int, drawn: Any, position: int, penalized: Any = ()) -> SampledRows:
    """Sampling inputs as the runner writes them for a serving preset (Qwen's non-thinking one): the rows `drawn` on
    the device, and the rows whose candidates the host reads (`penalized`: sampled verify rows)."""
    out = SampledRows(rows)
    for row in drawn:
        out.draw(row, SAMPLED_PRESET, position, Purpose.DECODE)
    for row in penalized:
        out.penalize(row, SAMPLED_PRESET.presence_penalty, SAMPLED_PRESET.frequency_penalty)
    return out


def bench_config(dims_name: str, recipe: str, kv_dtype: str, bandwidth: float, gemm: float, *, device=None,
                 dims=None, context: int = CONTEXT, prefill_tokens: int | tuple[int, ...] = PREFILL,
                 repeats: int = 30,
                 decode_linears: tuple[str, ...] = ("kernels",), profile: bool = False,
                 decode_only: bool = False, prefill_only: bool = False, mtp_only: bool = False,
                 decode_quant: str = "mma",
                 batches: tuple[int, ...] = (1, 2, 4, 8),
                 prefill_attentions: tuple[str, ...] = ("kernel", "gemm"), draft_head: bool = False,
                 branches: tuple[bool | None, ...] = (None,), programmatic: tuple[bool, ...] = (True,),
                 narrow: tuple[bool | None, ...] = (None,), moe_gemms: tuple[str, ...] = ("auto",),
                 moe_chunks: tuple[int | None, ...] = (None,), moe_chunk_steps: tuple[int | None, ...] = (None,),
                 moe_sync_frees: tuple[bool | None, ...] = (None,),
                 dequant_aheads: tuple[int | None, ...] = (None,),
                 attention_splits: tuple[int | None, ...] = (None,),
                 split_floors: tuple[int | None, ...] = (None,), split_k_norms: tuple[int, ...] = (0,),
                 conv_in_projections: tuple[bool, ...] = (True,),
                 ab_in_recurrences: tuple[bool | None, ...] = (None,),
                 recurrence_groups: tuple[int | None, ...] = (None,),
                 tensor_core_decodes: tuple[bool, ...] = (True,), prefill_chunk: int | None = None,
                 prefill_graphs: tuple[bool, ...] = (True,), prefill_buckets: tuple[bool, ...] = (False,),
                 direct_quant_experts: tuple[bool, ...] = (False,), sampled: tuple[bool, ...] = (False,)) -> dict:
    """One model/recipe/KV configuration. `device`, `dims` and the sizes exist for the CPU smoke test (a HostDevice
    and a tiny model); the GPU run uses the defaults. `prefill_only`: the 8K prefill alone (no decode steps, suffix
    prefill or MTP rounds), for a short device call after a prefill change; `mtp_only`: the decode steps and the MTP
    rounds, no prefill. `prefill_chunk`: the prompt prefilled in chunks of this many tokens, as the server does
    (--prefill-chunk, 1024 by default), with the workspace sized for a chunk; None: in one chunk. `prefill_graphs`:
    the full-size chunks replay graphs captured in pieces where the model can (`CudaQwen.capture_prefill`, as the
    server's runner does), off and/or on. `prefill_buckets`: shorter chunks padded to their row buckets
    (Capacity.prefill_buckets), off and/or on. `direct_quant_experts`: a MoE model's quantized routed experts
    multiplied from their codes (Capacity.direct_quant_experts), off and/or on. `sampled`: the decode steps and MTP
    rounds as greedy lanes and/or as sampled ones (presence penalty on) run them. `prefill_tokens`: one prompt length
    or several, each timed with every prefill setting on the same build (sized for the longest; with
    `prefill_chunk`, the workspace is the chunk's whatever the lengths)."""
    dims = dims or MODELS[dims_name]
    lengths = (prefill_tokens,) if isinstance(prefill_tokens, int) else tuple(prefill_tokens)
    prefill_tokens = max(lengths)  # what sizes the build, the suffix prefill's context
    if prefill_only:
        batches = ()
    device = device or CudaDevice(0)
    specs = [s for s in plan_qwen_tensor_specs(dims) if not s.name.startswith("vision/")]
    capacity = Capacity(lanes=8, max_context=max(prefill_tokens, context) + 64, kv_dtype=kv_dtype,
                        prefill_rows=prefill_chunk or prefill_tokens, draft_tokens=3,
                        tensor_core_attention=True,
                        decode_quant=decode_quant, draft_head=draft_head, attention_splits=attention_splits[0],
                        split_k_norm=max(split_k_norms))
    began = time.perf_counter()
    model = CudaQwen(dims, RandomDeviceWeights(specs, recipe, device), device, capacity)
    model.allocate_kv(8 * capacity.max_pages_per_lane)
    device.synchronize()
    result = {"model": dims_name, "recipe": recipe, "kv_dtype": kv_dtype, "decode_quant": decode_quant,
              "build_seconds": time.perf_counter() - began,
              "ledger_bytes": dict(device.ledger)}
    print(f"[{dims_name} {recipe} kv={kv_dtype}] built in {result['build_seconds']:.1f}s, "
          f"weights {device.ledger['weights'] / 2**30:.1f} GiB", flush=True)

    first_pass = FirstPasses(result)
    decode = []
    branches = tuple(dims.is_moe if side is None else side for side in branches)  # None: the serving default
    narrow = tuple(not dims.is_moe if thin is None else thin for thin in narrow)  # None: the serving default
    split_floors = tuple(capacity.attention_min_split_keys if floor is None else floor for floor in split_floors)
    for splits, floor, linear, side, pdl, thin, sliced, conv, fused_ab, groups, tc in (
            (splits, floor, linear, side, pdl, thin, sliced, conv, fused_ab, groups, tc) for splits in attention_splits
            for floor in split_floors for linear in decode_linears for side in branches for pdl in programmatic
            for thin in narrow for sliced in split_k_norms for conv in conv_in_projections
            for fused_ab in ab_in_recurrences for groups in recurrence_groups for tc in tensor_core_decodes):
        model.set_attention_splits(splits)
        model.set_attention_min_split_keys(floor)
        model.set_branches(side)
        model.set_programmatic(pdl)
        model.set_narrow(thin)
        model.set_split_k_norm(sliced)
        model.set_conv_in_projection(conv)
        model.set_ab_in_recurrence(fused_ab)
        model.set_recurrence_groups(groups or model.capacity.recurrence_groups)
        model.set_tensor_core_decode(tc)
        set_decode_linear(model, linear)
        if linear == "auto":
            began = time.perf_counter()
            timings = model.tune_decode_linears()
            result["decode_paths"] = [{"shape": list(shape), "path": model.linear.decode_paths[shape],
                                       "us": {path: t * 1e6 for path, t in by_path.items()}}
                                      for shape, by_path in timings.items()]
            print(f"  decode paths tuned in {time.perf_counter() - began:.1f}s: " + "  ".join(
                f"{n}x{k} {entry['path']} (" + " / ".join(f"{p} {t:.1f}" for p, t in entry["us"].items()) + " us)"
                for entry in result["decode_paths"] for n, k in [entry["shape"]]), flush=True)
        for batch, sampling in ((batch, sampling) for batch in batches for sampling in sampled):
            setup_lanes(model, batch, context, sampled=sampling)

            def step():  # as the runner's step (`CudaRunner._decode_step`)
                model.forward(batch, batch)
                model.keep_segment_rows(batch)
                logits = model.head_logits(model.workspace.final, batch)
                model.greedy(logits)
                if sampling:  # each lane's row draws on the device
                    model.candidates(logits)
                    model.sample(batch)

            with first_pass("decode"):
                step()
                device.synchronize()
            free_before = device.info.free_bytes
            graph = device.capture(step)
            device.synchronize()
            graph_bytes = max(0, free_before - device.info.free_bytes)  # what one captured step holds on the device
            times = event_time(device.stream, lambda: graph.replay(device.stream_handle), repeats)
            seconds = float(np.median(times[3:]))
            queued, host_launch = (back_to_back(device.stream, lambda: graph.replay(device.stream_handle))
                                   if device.stream is not None else (seconds, 0.0))
            nbytes = decode_bytes(model, batch, context)
            roofline = nbytes / bandwidth
            decode.append({"sampled": sampling, "linear": linear, "branches": side, "programmatic": pdl,
                           "narrow": thin,
                           "split_k_norm": sliced, "conv_in_projection": conv, "ab_in_recurrence": fused_ab,
                           "recurrence_groups": model.recurrence_groups, "tensor_core_decode": tc,
                           "attention_splits": model.workspace.partials.shape[2], "min_split_keys": floor,
                           "context": context, "batch": batch,
                           "step_ms": seconds * 1e3,
                           "tok_s": batch / seconds,
                           "bytes": nbytes, "roofline_ms": roofline * 1e3, "ratio_to_roofline": roofline / seconds,
                           "graph_device_bytes": graph_bytes, "back_to_back_step_ms": queued * 1e3,
                           "host_launch_us": host_launch * 1e6})
            label = linear + (" +branches" if side else "") + (" +programmatic" if pdl else "") + (
                " -narrow" if not thin else "") + (f" splits {splits}" if len(attention_splits) > 1 else "") + (
                f" floor {floor}" if len(split_floors) > 1 else "") + (f" split-K {sliced}" if sliced else "") + (
                " -conv-in-projection" if not conv else "") + (
                {False: " -ab-in-recurrence", True: " +ab-in-recurrence"}.get(fused_ab, "")) + (
                f" groups {groups}" if groups else "") + (
                {False: " -tensor-core-decode", True: " +tensor-core-decode"}[tc] if len(tensor_core_decodes) > 1
                else "") + (" sampled" if sampling else "")
            print(f"  decode [{label}] B={batch}: {seconds * 1e3:7.2f} ms/step  {batch / seconds:7.1f} tok/s  "
                  f"roofline {roofline * 1e3:6.2f} ms  ratio {roofline / seconds:.2f}  graph {graph_bytes / 2**20:.1f} "
                  f"MiB  back to back {queued * 1e3:.2f} ms (ratio {roofline / queued:.2f}), launch "
                  f"{host_launch * 1e6:.0f} us host", flush=True)
            if profile and batch in (1, 8) and linear in ("cublas", "mma", "kernels", "auto"):
                from bench.kernel_profile import print_profile, profile_replays

                kernels = profile_replays(lambda: graph.replay(device.stream_handle), device.synchronize)
                print_profile(f"{label} B={batch}", kernels)
                decode[-1]["profile"] = kernels
            graph.close()
    set_decode_linear(model, capacity.decode_linear)
    model.set_attention_splits(attention_splits[-1])
    model.set_attention_min_split_keys(split_floors[-1])
    model.set_branches(branches[-1])  # the suffix prefill and the MTP rounds run with the last settings
    model.set_programmatic(programmatic[-1])
    model.set_narrow(narrow[-1])
    model.set_split_k_norm(split_k_norms[-1])
    model.set_conv_in_projection(conv_in_projections[-1])
    model.set_ab_in_recurrence(ab_in_recurrences[-1])
    model.set_recurrence_groups(recurrence_groups[-1] or model.capacity.recurrence_groups)
    model.set_tensor_core_decode(tensor_core_decodes[-1])
    result["decode"] = decode
    result["branches_after_decode"] = branches[-1]
    result["programmatic_after_decode"] = programmatic[-1]
    result["narrow_after_decode"] = narrow[-1]
    if decode_only:
        return result
    if mtp_only:
        result["mtp_round"] = mtp_rounds_each(model, dims, context, tensor_core_decodes, decode_linears,
                                              profile=profile, sampled=sampled)
        return result

    # Prefill: one lane, `prefill_tokens` from position 0, in chunks of capacity.prefill_rows, each staged as the
    # server's runner stages it (`stage_prefill`: padded to its bucket with prefill buckets; inside the timing when
    # there are several chunks)
    table = np.arange(capacity.max_pages_per_lane, dtype=np.int32)
    model.inputs.set_page_table(0, table)
    ids = np.random.default_rng(0).integers(0, dims.vocab_ids, prefill_tokens)
    chunks: list[tuple[int, int]] = []  # the timed prompt's (start, rows) chunks: set for each length below

    def split(tokens: int) -> list[tuple[int, int]]:
        rows = capacity.prefill_rows
        return [(start, min(rows, tokens - start)) for start in range(0, tokens, rows)]

    def stage(start: int, count: int) -> tuple[int, PrefillSpan]:
        positions = np.tile(np.arange(start, start + count), (3, 1))
        return model.stage_prefill(0, start, ids[start : start + count], positions)

    staged: list = [None]  # one chunk's inputs, written before the timing (again for each setting and length)
    pieces: dict[int, Any] = {}  # padded rows -> their graph pieces while a setting replays them

    def prefill():
        for start, count in chunks:
            rows, span = stage(start, count) if len(chunks) > 1 else staged[0]
            graph = pieces.get(rows)
            if graph is not None:
                graph.replay(device.stream_handle, span)
                final = model.workspace.final[:count]
            else:
                final = model.forward(rows, 1, span)[:count]
        model.greedy(model.head_logits(final[count - 1 :]))

    result["prefill"] = []
    serving_chunk, serving_step, serving_sync_free = model.moe_chunk_rows, model.moe_chunk_step, model.moe_sync_free
    moe_settings = [(m, c, t, f) for m in moe_gemms for c in moe_chunks for t in moe_chunk_steps
                    for f in moe_sync_frees] if dims.is_moe else [("auto", None, None, None)]
    dequantizer = model.linear.dequantizer  # None: nothing to dequantize (bf16), and so nothing to time ahead
    serving_ahead = dequantizer.ahead if dequantizer is not None else 0
    aheads = dequant_aheads if dequantizer is not None else (None,)
    serving_free_chunk = model.moe_sync_free_chunk_rows
    directs = direct_quant_experts if dims.is_moe and dequantizer is not None else (False,)
    for attention, (moe_gemm, chunk, step, sync_free), ahead, buckets, direct, graphs, tokens in (
            (a, m, d, b, q, g, n) for a in prefill_attentions for m in moe_settings for d in aheads
            for b in prefill_buckets for q in directs for g in prefill_graphs for n in lengths):
        chunks[:] = split(tokens)
        model.prefill_attention, model.moe_prefill_gemm = attention, moe_gemm
        model.moe_chunk_rows, model.moe_chunk_step = chunk or serving_chunk, step or serving_step
        model.moe_sync_free_chunk_rows = chunk or serving_free_chunk
        model.moe_sync_free = serving_sync_free if sync_free is None else sync_free
        model.set_dequant_ahead(serving_ahead if ahead is None else ahead)
        model.prefill_buckets = buckets
        model.direct_quant_experts = direct
        staged[0] = stage(*chunks[0])
        padded = [model.padded_prefill_rows(count) for _, count in chunks]
        ahead_timed = dequantizer.ahead if dequantizer is not None else 0
        label = attention + ("" if moe_gemm == "auto" else f" moe {moe_gemm}") + (
            "" if chunk is None else f" chunk {chunk}") + ("" if step is None else f" step {step}") + (
            "" if sync_free is None else f" sync-free {'on' if sync_free else 'off'}") + (
            "" if ahead is None else f" dequant ahead {ahead}") + (" buckets" if buckets else "") + (
            " direct experts" if direct else "")
        with first_pass("prefill"):
            prefill()  # eager (compiles the kernels, or loads them from the kernel cache)
            device.synchronize()
        for _ in range(PREFILL_WARMUPS - 1):
            prefill()
        device.synchronize()
        # graphs of the full-size chunk and the buckets, as the runner captures them (`capture_prefill_graph`)
        captured = sorted(set(padded) & set(model.captured_prefill_rows())) if graphs else []
        if captured:
            pieces.update((rows, model.capture_prefill(rows)) for rows in captured)
            label += " graphs"
            prefill()
            device.synchronize()
        # (replayed graphs dequantize without asking the dequantizer: its counts are the eager calls')
        hits_before = dequantizer.hits if dequantizer is not None else 0
        dequantized_before = dequantizer.hits + dequantizer.misses if dequantizer is not None else 0
        with GcPauses() as pauses:
            times = event_time(device.stream, prefill, PREFILL_REPEATS)
        seconds = float(np.median(times))
        flops = prefill_flops(model, tokens)
        gc_pauses = pauses.summary()
        result["prefill"].append({"attention": attention, "moe_gemm": moe_gemm,
                                  "moe_chunk_rows": model.moe_chunk_rows, "moe_chunk_step": model.moe_chunk_step,
                                  "moe_sync_free": model.moe_sync_free,
                                  "moe_sync_free_chunk_rows": model.moe_sync_free_chunk_rows,
                                  "prefill_graphs": sorted(pieces), "prefill_buckets": buckets,
                                  "direct_quant_experts": direct,
                                  "padded_rows": padded,
                                  "dequant_ahead": ahead_timed,
                                  "dequant_hits": (dequantizer.hits - hits_before) if dequantizer is not None else 0,
                                  # matrices dequantized in all the prefills timed (each chunk dequantizes its own)
                                  "dequantized": (dequantizer.hits + dequantizer.misses - dequantized_before
                                                  if dequantizer is not None else 0),
                                  "tokens": tokens, "chunk": capacity.prefill_rows,
                                  "seconds": seconds, "all_seconds": [float(t) for t in times],
                                  "tok_s": tokens / seconds, "flops": flops,
                                  "ratio_to_gemm_peak": flops / seconds / gemm, "gc_pauses": gc_pauses})
        chunked = f" in chunks of {capacity.prefill_rows}" if len(chunks) > 1 else ""
        print(f"  prefill [{label}] {tokens}{chunked}: {seconds * 1e3:8.1f} ms  "
              f"{tokens / seconds:8.0f} tok/s  {flops / seconds / 1e12:6.1f} TFLOP/s  "
              f"ratio {flops / seconds / gemm:.2f}  (of "
              f"{PREFILL_REPEATS}: {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms; the collector paused the host "
              f"{gc_pauses['collections']} times, {gc_pauses['total_ms']:.1f} ms, longest {gc_pauses['max_ms']:.1f})",
              flush=True)
        if profile:  # GPU busy time against the wall time: is the eager prefill bound by the GPU or the host?
            from bench.kernel_profile import print_profile, profile_replays

            kernels = profile_replays(prefill, device.synchronize, replays=1)
            print_profile(f"prefill [{label}]", kernels, top=20)
            result["prefill"][-1]["profile"] = kernels
            # where the host's time goes: the GPU idles wherever the host, just woken from a MoE layer's wait for
            # its group sizes, takes longer to queue the next launches than the GPU takes to run what is queued
            from bench.kernel_profile import host_profile

            result["prefill"][-1]["host_profile"] = host_profile(lambda: (prefill(), device.synchronize()),
                                                                 sort="tottime", top=25)
            print(result["prefill"][-1]["host_profile"], flush=True)
            if dims.is_moe:
                result["prefill"][-1]["moe_host"] = trace_moe_host(model, lambda: (prefill(), device.synchronize()))
        for graph in pieces.values():
            graph.close()
        pieces.clear()
    model.prefill_attention, model.moe_prefill_gemm, model.moe_chunk_rows = "kernel", "auto", serving_chunk
    model.moe_sync_free_chunk_rows = serving_free_chunk
    model.prefill_buckets = capacity.prefill_buckets
    model.direct_quant_experts = capacity.direct_quant_experts
    model.moe_chunk_step, model.moe_sync_free = serving_step, serving_sync_free
    model.set_dequant_ahead(serving_ahead)
    if prefill_only:
        return result
    result["suffix_prefill"] = suffix_prefill(model, dims, prefill_tokens, min(SUFFIX, prefill_tokens),
                                              profile=profile)

    result["mtp_round"] = mtp_rounds_each(model, dims, context, tensor_core_decodes, decode_linears,
                                          profile=profile, sampled=sampled)
    return result


def trace_moe_host(model: CudaQwen, run) -> dict:
    """The host's own time through each MoE layer of one unprofiled `run()` (bench/host_trace.py): the wait for the
    group sizes, then each call until the first expert GEMM is queued. The GPU idles wherever that takes longer
    than the work queued before the wait (the rows' gather, the shared expert)."""
    from bench.host_trace import HostTrace, host_gap_us, moe_waits, print_moe_waits
    from ninfer.backends.cuda.staging import PendingRead, StagingSlots

    trace = HostTrace()
    gemms = ("batched_gemm_bf16", "chunked_gemm_bf16", "grouped_gemm_bf16")
    for name in ("gemm_bf16", *gemms):
        trace.wrap(model.linear.blas, name)
    trace.wrap(PendingRead, "values", "sizes wait")
    trace.wrap(StagingSlots, "write", "staging write")
    trace.wrap(model.linear, "bf16_weight")
    for name in ("moe_group", "moe_layout", "moe_pad_positions", "moe_gather", "silu_mul_bf16_rows",
                 "silu_mul_to_bf16_rows", "moe_scatter_combine", "sigmoid_gate_add", "route_top_k", "rms_norm_rows",
                 "embed_rows"):
        trace.wrap(model.k, name)
    events = trace.run(run)
    report = moe_waits(events, wait="sizes wait", gemms=gemms)
    report["embed_to_first_norm_us"] = host_gap_us(events, after="embed_rows", before="rms_norm_rows")
    print_moe_waits(report)
    return report


def suffix_prefill(model: CudaQwen, dims, context: int, tokens: int, *, profile: bool) -> dict:
    """A returning turn: `tokens` new prompt tokens after the `context` tokens the 8K prefill left in lane 0's
    cache, to their greedy token. Wall-clock with the host work (what a multi-turn request waits for before its
    first token; the GPU work is small): eagerly through the tiled prefill attention, and as the runner runs a short
    chunk (`CudaQwen.short_prefill`): the decode path replayed as a captured graph. Each run writes the same
    positions again."""
    ids = np.random.default_rng(1).integers(0, dims.vocab_ids, tokens)
    positions = np.arange(context, context + tokens)
    device = model.device

    def fill():
        model.inputs.fill(token_ids=ids, positions=np.tile(positions, (3, 1)), row_lane=np.zeros(tokens),
                          row_pos=positions, seg_lane=[0], seg_row=[0], seg_count=[tokens], seg_record=[0])

    def eager():
        fill()
        final = model.forward(tokens, 1, PrefillSpan(0, context))
        model.greedy(model.head_logits(final[tokens - 1:]))
        device.synchronize()

    out = {"context": context, "tokens": tokens, "seconds": wall_seconds(eager, device.synchronize, repeats=5)}
    if model.short_prefill(tokens, context):
        fill()
        model.forward(tokens, 1)
        device.synchronize()
        graph = device.capture(lambda: model.forward(tokens, 1))

        def replayed():
            fill()
            graph.replay(device.stream_handle)
            model.greedy(model.head_logits(model.workspace.final[tokens - 1 : tokens]))
            device.synchronize()

        out["graph_seconds"] = wall_seconds(replayed, device.synchronize, repeats=5)
        graph.close()
    print(f"  suffix prefill {tokens} tokens after {context}: eager {out['seconds'] * 1e3:7.1f} ms, graph "
          f"{out.get('graph_seconds', float('nan')) * 1e3:7.1f} ms (host included)", flush=True)
    if profile:
        from bench.kernel_profile import host_profile

        out["host_profile"] = host_profile(eager, sort="tottime", top=20)
        print(out["host_profile"], flush=True)
    return out


def set_decode_linear(model: CudaQwen, linear: str) -> None:
    """The bf16 decode linear path to time: "kernels", "mma" (`linear_mma`), "cublas" (padded to the capacity's
    decode rows, the serving default), "cublas:N" (padded to N rows; 0: no padding) or "auto" (each shape's path
    timed on the GPU: `linear_tuning`; the caller tunes). The Linear reads these settings at every call: no rebuild
    needed."""
    model.linear.cublas_decode = linear.startswith("cublas") or linear == "auto"
    model.linear.pad_rows = int(linear.split(":")[1]) if ":" in linear else model.capacity.decode_rows
    model.linear.bf16_path = "mma" if linear == "mma" else None
    model.linear.decode_paths.clear()


def mtp_rounds_each(model: CudaQwen, dims, context: int, tensor_core_decodes: tuple[bool, ...],
                    decode_linears: tuple[str, ...], *, profile: bool,
                    sampled: tuple[bool, ...] = (False,)) -> list[dict]:
    """`mtp_rounds` with each decode attention kernel and each bf16 decode linear path asked for ("auto" and
    "cublas:N" skipped: the serving paths' rounds), then back to the serving default."""
    out = []
    linears = [linear for linear in decode_linears if linear in ("cublas", "mma", "kernels")] or ["cublas"]
    for tc, linear, sampling in ((tc, linear, sampling) for tc in tensor_core_decodes for linear in linears
                                 for sampling in sampled):
        model.set_tensor_core_decode(tc)
        set_decode_linear(model, linear)
        if len(tensor_core_decodes) > 1 or len(linears) > 1 or len(sampled) > 1:
            print(f"  MTP rounds, decode attention {'tensor cores' if tc else 'staged SIMT'}, bf16 linear {linear}"
                  f"{', sampled lane' if sampling else ''}:", flush=True)
        out += [dict(entry, tensor_core_decode=tc, decode_linear=linear, sampled=sampling)
                for entry in mtp_rounds(model, dims, context, profile=profile, sampled=sampling)]
    set_decode_linear(model, model.capacity.decode_linear)
    return out


def mtp_rounds(model: CudaQwen, dims, context: int, *, profile: bool = False, sampled: bool = False) -> list[dict]:
    """Batch-1 MTP round at `context` tokens, as the runner runs it: the verify graph (k+1 rows, decoder + head +
    argmax), a read of the argmaxes, the MTP-head graph over the k+1 columns, then the draft chain (one graph: k
    proposals with k-1 MTP steps between them, each step's token copied on the device) and a read of the drafts.
    The round rejects its last draft, so the verify columns' states are restored (`select_columns`, as the runner
    does). Wall-clock per round, host work and reads included, and each part's GPU time alone; with `profile`, the
    k = 3 round's kernels. Proposals over the full head, and over the shortlist head when the model loaded one
    (`model.propose`, as the runner does). `sampled`: a sampled lane's round, whose verify also computes each
    column's candidates with the round's earlier drafts counted and whose host reads them."""
    out = []
    device = model.device
    heads = ("full", "shortlist") if model.draft_head is not None else ("full",)
    for k, proposals in ((k, head) for head in heads for k in (1, 2, 3)):
        rows = k + 1
        positions = np.tile(np.arange(context, context + rows), (3, 1))
        hidden = device.empty((rows, dims.hidden), np.float32, "bench")

        def verify():
            model.forward(rows, 1)
            model.keep_segment_rows(1)  # the lane's verify columns, as the runner's step keeps them
            logits = model.head_logits(model.workspace.final, rows)
            model.greedy(logits)
            if sampled:
                model.candidates(logits, segments=1)

        def fill():
            model.inputs.fill(token_ids=np.arange(rows) + 5, next_ids=np.arange(rows) + 6, positions=positions,
                              row_lane=np.zeros(rows), row_pos=context + np.arange(rows), seg_lane=[0],
                              seg_row=[0], seg_count=[rows], seg_record=[1],
                              sampling=sampled_rows(rows, (), context, range(rows)) if sampled else None)

        def mtp():
            model.mtp_forward(hidden, rows)

        def propose():
            if proposals == "full":
                return model.greedy(model.head_logits(model.workspace.final[rows - 1 : rows]))
            return model.propose(model.workspace.final[rows - 1 : rows])

        def advance():
            model.mtp_forward(hidden[:1], 1)

        def drafts():  # the runner's draft chain, one graph: its first row gathered from the MTP output
            model.draft_chain(model.mtp_hidden[1:2], model.mtp_hidden[:1], k, full_head=proposals == "full",
                              gather=True)

        def select():  # the runner's column selection of a round that rejects its last draft (the states copied)
            model.select_staged(1, True)

        graphs = {}
        model.stage_selection([0], [k - 1], [True])
        for name, body in (("verify", verify), ("mtp", mtp), ("propose", propose), ("advance", advance),
                           ("drafts", drafts), ("select", select)):
            fill()
            body()
            device.synchronize()
            graphs[name] = device.capture(body)

        def round_():
            fill()
            graphs["verify"].replay(device.stream_handle)
            device.read(model.argmax[:rows])
            if sampled:  # the runner's accept rules read the columns' candidates
                model.read_candidates(rows)
            model.stage_selection([0], [k - 1], [True])
            graphs["select"].replay(device.stream_handle)
            device.copy(hidden, model.workspace.final[:rows])
            graphs["mtp"].replay(device.stream_handle)
            model.stage_draft_steps(k, [0], [context + rows - 1], [context + rows - 1],  # as the runner does
                                    sources=[rows - 1])
            graphs["drafts"].replay(device.stream_handle)
            device.read(model.draft_ids)

        seconds = wall_seconds(round_, device.synchronize, repeats=20, warmup=3)
        # GPU time of each graph alone ("propose" and "advance": one proposal and one MTP step, the parts of the
        # "drafts" chain); what the round spends beyond verify + mtp + drafts is the host's: its two reads, the
        # copy, the chain's inputs and the launches after each read.
        parts = {name: float(np.median(event_time(device.stream, lambda g=graph: g.replay(device.stream_handle),
                                                  10))) * 1e3 for name, graph in graphs.items()}
        gpu_ms = parts["verify"] + parts["mtp"] + parts["drafts"] + parts["select"]
        entry = {"k": k, "proposals": proposals, "round_ms": seconds * 1e3, "graph_ms": parts,
                 "host_ms": seconds * 1e3 - gpu_ms,
                 "tok_s_at_tokens_per_round": {str(t): t / seconds for t in (1.0 + 0.8 * k, float(k + 1))}}
        print(f"  MTP k={k} ({proposals} head{', sampled' if sampled else ''}): round {seconds * 1e3:7.2f} ms "
              f"(graphs; host reads included): "
              + " ".join(f"{name} {ms:.3f}" for name, ms in parts.items())
              + f" ms a replay, host {entry['host_ms']:.2f} ms a round", flush=True)
        if profile and k == 3:
            from bench.kernel_profile import print_profile, profile_replays

            entry["profile"] = profile_replays(round_, device.synchronize)
            print_profile(f"MTP k={k} ({proposals} head) round", entry["profile"])
        for graph in graphs.values():
            graph.close()
        out.append(entry)
    return out


def on_off(parser: argparse.ArgumentParser, option: str, value: str) -> tuple[bool, ...]:
    """An off/on list option (off, on or off,on) as booleans, or the parser's error."""
    choices = value.split(",")
    if not set(choices) <= {"off", "on"}:
        parser.error(f"{option} takes off, on or off,on; got {value!r}")
    return tuple(choice == "on" for choice in choices)


def on_off_or_default(parser: argparse.ArgumentParser, option: str, value: str) -> tuple[bool | None, ...]:
    """`on_off` where "default" (None: the model's own setting) may stand in the list too (e.g. default,off)."""
    return tuple(None if choice == "default" else on_off(parser, option, choice)[0] for choice in value.split(","))


def prompt_lengths(parser: argparse.ArgumentParser, value: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in value.split(","))
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        parser.error(f"--prefill-tokens takes positive token counts separated by commas, got {value!r}")
    return lengths


def counts_or_default(value: str) -> tuple[int | None, ...]:
    """A list option of integers, where "default" (None) stands for the model's own setting."""
    return tuple(None if x == "default" else int(x) for x in value.split(","))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="27b,35b")
    parser.add_argument("--recipes", default="bf16,ninfer-v2")
    parser.add_argument("--kv", default="bf16")
    parser.add_argument("--decode-linear", default="kernels,mma,cublas:0,cublas:8,cublas,auto",
                        help="bf16 decode linear paths to time: the skinny kernels, the tensor-core kernel (mma), "
                             "cuBLAS padded to the decode rows (the default), cuBLAS padded to N rows (cublas:N, 0 = "
                             "unpadded), or each shape's fastest path as timed on the GPU (auto); the MTP rounds run "
                             "with each of kernels, mma and cublas asked for")
    parser.add_argument("--batches", default="1,2,4,8", help="decode batch sizes to time (at most 8)")
    parser.add_argument("--prefill-attention", default="kernel,gemm",
                        help="8K prefill attention paths to time: kernel (the numba kernel), gemm (the tensor cores "
                             "through cuBLAS), flash (one tensor-core kernel)")
    parser.add_argument("--decode-only", action="store_true", help="skip the 8K prefill and the MTP rounds")
    parser.add_argument("--mtp-only", action="store_true",
                        help="the decode steps (--batches) and the MTP rounds: no 8K or suffix prefill")
    parser.add_argument("--prefill-only", action="store_true",
                        help="only the 8K prefill: no decode steps, suffix prefill or MTP rounds")
    parser.add_argument("--decode-quant", default="mma", choices=("simt", "mma"),
                        help="quantized decode kernels: SIMT (quant_linear) or tensor cores (quant_mma)")
    parser.add_argument("--branches", default="default",
                        help="decode with the side stream off and/or on (off,on; default: the serving default, on for "
                             "MoE models); the MTP rounds use the last")
    parser.add_argument("--programmatic", default="on",
                        help="decode with the quantized GEMVs launched programmatically off and/or on (off,on; "
                             "default: on, the serving default); the MTP rounds use the last")
    parser.add_argument("--narrow", default="default",
                        help="decode with the narrow bf16 GEMVs (router + routing, GDN a/b) off and/or on (off,on; "
                             "default: the serving default, on for dense models); the MTP rounds use the last")
    parser.add_argument("--moe-gemm", default="auto",
                        help="MoE models' 8K prefill with these expert GEMM layouts (auto, grouped, padded, chunked; "
                             "a list times each)")
    parser.add_argument("--dequant-ahead", default="default",
                        help="quantized recipes' 8K prefill with these many matrices dequantized ahead of their GEMMs "
                             "(e.g. 0,1,2,4; default: the serving default)")
    parser.add_argument("--moe-chunk", default="default",
                        help="MoE models' 8K prefill with these chunked-layout chunk rows (e.g. 64,128; default: the "
                             "serving default)")
    parser.add_argument("--moe-chunk-step", default="default",
                        help="MoE models' 8K prefill with the chunked layout's batch count rounded up to multiples of "
                             "these (e.g. 1,32; default: the serving default)")
    parser.add_argument("--moe-sync-free", default="default",
                        help="MoE models' 8K prefill with the expert GEMMs sized without reading the counts back off "
                             "and/or on (off,on; default: the serving default)")
    parser.add_argument("--lm-head-draft", action="store_true",
                        help="load the shortlist proposal head too and time the MTP rounds with it as well")
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens each decode row attends to")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prefill the 8K prompt in chunks of this many tokens, as the server does (its "
                             "--prefill-chunk, 1024 by default), the workspace sized for one; default: one chunk")
    parser.add_argument("--attention-splits", default="default",
                        help="decode with these most key splits a row (a list times each; default: the model's; the "
                             "MTP rounds use the last)")
    parser.add_argument("--split-floor", default="default",
                        help="decode with these fewest keys a split takes (a list times each; default: the model's; "
                             "the MTP rounds use the last)")
    parser.add_argument("--split-k-norm", default="0",
                        help="decode with the residual projections' K in these many slices, added in the next norm "
                             "(a list times each, e.g. 0,2,4; 0: off); the MTP rounds use the last")
    parser.add_argument("--conv-in-projection", default="on",
                        help="decode with the Gated DeltaNet conv in the quantized in-projection's launch off "
                             "and/or on (off,on; default: on, the serving default); the MTP rounds use the last")
    parser.add_argument("--ab-in-recurrence", default="default",
                        help="decode with the Gated DeltaNet a/b projection computed in the recurrence's launch off "
                             "and/or on (off,on; default: the serving default, on beside a tensor-core "
                             "in-projection); the MTP rounds use the last")
    parser.add_argument("--recurrence-groups", default="default",
                        help="decode with the recurrence's key sums split over these many threads (a list of 4 and "
                             "8 times each; default: the serving default); the MTP rounds use the last")
    parser.add_argument("--tensor-core-decode", default="on",
                        help="decode attention over bf16 KV on the tensor cores off and/or on (off,on; default: on, "
                             "the serving default); the MTP rounds run with each")
    parser.add_argument("--prefill-tokens", default=str(PREFILL),
                        help="the prompt lengths the prefill timings run (a list: 200,500,900; 8192 by default), on "
                             "one build; with --prefill-chunk longer, the workspace is still the chunk's, as the "
                             "server's")
    parser.add_argument("--prefill-buckets", default="off",
                        help="prefill chunks shorter than --prefill-chunk padded to their row buckets off and/or on "
                             "(off,on; default: off, the serving default)")
    parser.add_argument("--sampled", default="off",
                        help="decode steps and MTP rounds of greedy and/or sampled lanes (off,on; sampled: a Qwen "
                             "preset's parameters, the draw on the device, a verify's candidates read by the host)")
    parser.add_argument("--direct-quant-experts", default="off",
                        help="a MoE model's quantized routed experts multiplied from their codes in prefill chunks "
                             "off and/or on (off,on; default: off, the serving default)")
    parser.add_argument("--prefill-graphs", default="on",
                        help="the prefill's full-size chunks replaying graphs captured in pieces off and/or on "
                             "(off,on; default: on, as the server's runner does where the model can)")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel GPU time of the B=1 and B=8 decode graphs and of the 8K prefill (CUPTI "
                             "through torch.profiler)")
    args = parser.parse_args()
    lengths = prompt_lengths(parser, args.prefill_tokens)
    if not set(args.branches.split(",")) <= {"off", "on", "default"}:
        parser.error(f"--branches takes off, on, default or a list of them; got {args.branches!r}")
    programmatic = on_off(parser, "--programmatic", args.programmatic)
    narrow = on_off_or_default(parser, "--narrow", args.narrow)
    device = CudaDevice(0)
    bandwidth, gemm = copy_bandwidth(device), gemm_rate(device)
    print(f"device {device.info.name}: copy {bandwidth / 1e12:.2f} TB/s, cuBLAS bf16 {gemm / 1e12:.0f} TFLOP/s",
          flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    # The device machine gets a copy of the working tree over an older checkout: HEAD there can be stale. Say so.
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True).stdout.strip()
    commit += "+changes" if changed else ""
    report = {"device": device.info.name, "commit": commit, "copy_bandwidth_bytes_s": bandwidth,
              "gemm_bf16_flop_s": gemm, "decode_context": args.context, "configs": []}
    del device
    for name in args.models.split(","):
        for recipe in args.recipes.split(","):
            for kv in args.kv.split(","):
                try:
                    linears = tuple(args.decode_linear.split(",")) if recipe == "bf16" else ("cublas",)
                    report["configs"].append(bench_config(name, recipe, kv, bandwidth, gemm,
                                                          decode_linears=linears, profile=args.profile,
                                                          decode_only=args.decode_only, mtp_only=args.mtp_only,
                                                          prefill_only=args.prefill_only,
                                                          batches=tuple(int(b) for b in args.batches.split(",")),
                                                          prefill_attentions=tuple(args.prefill_attention.split(",")),
                                                          decode_quant=args.decode_quant,
                                                          draft_head=args.lm_head_draft,
                                                          branches=tuple({"on": True, "off": False}.get(b) for b in
                                                                         args.branches.split(",")),
                                                          programmatic=programmatic, narrow=narrow,
                                                          moe_gemms=tuple(args.moe_gemm.split(",")),
                                                          moe_chunks=counts_or_default(args.moe_chunk),
                                                          moe_chunk_steps=counts_or_default(args.moe_chunk_step),
                                                          moe_sync_frees=on_off_or_default(parser, "--moe-sync-free",
                                                                                           args.moe_sync_free),
                                                          dequant_aheads=counts_or_default(args.dequant_ahead),
                                                          context=args.context,
                                                          attention_splits=counts_or_default(args.attention_splits),
                                                          split_floors=counts_or_default(args.split_floor),
                                                          split_k_norms=tuple(int(s) for s in
                                                                              args.split_k_norm.split(",")),
                                                          conv_in_projections=on_off(parser, "--conv-in-projection",
                                                                                     args.conv_in_projection),
                                                          ab_in_recurrences=on_off_or_default(
                                                              parser, "--ab-in-recurrence", args.ab_in_recurrence),
                                                          recurrence_groups=counts_or_default(
                                                              args.recurrence_groups),
                                                          tensor_core_decodes=on_off(parser, "--tensor-core-decode",
                                                                                     args.tensor_core_decode),
                                                          prefill_chunk=args.prefill_chunk,
                                                          prefill_graphs=on_off(parser, "--prefill-graphs",
                                                                                args.prefill_graphs),
                                                          prefill_buckets=on_off(parser, "--prefill-buckets",
                                                                                 args.prefill_buckets),
                                                          direct_quant_experts=on_off(
                                                              parser, "--direct-quant-experts",
                                                              args.direct_quant_experts),
                                                          prefill_tokens=lengths,
                                                          sampled=on_off(parser, "--sampled", args.sampled)))
                    gc.collect()  # the configuration's device arrays go with its model
                    cuda.current_context().deallocations.clear()
                except Exception as exc:  # keep the other configurations' numbers
                    import traceback

                    traceback.print_exc()
                    report["configs"].append({"model": name, "recipe": recipe, "kv_dtype": kv, "error": repr(exc)})
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "cuda_model.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
