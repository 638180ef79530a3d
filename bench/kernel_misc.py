"""GPU timings of the small kernels (elementwise, MoE routing, sampling) at the real Qwen3.6 shapes.

Run on the GPU box: `python bench/kernel_misc.py`. Each launcher is timed with CUDA events around single launches
queued behind a sleeping kernel (so the ~26 us Python launch cost is hidden and the events measure device time),
after a warm-up; the median of RUNS launches, rotating several input sets. GB/s counts compulsory bytes (every input
read once, every output written once); the last column is the ratio to 4.3 TB/s (measured device copy bandwidth).
Writes `$OUT/kernel_misc.json` when OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

import numpy as np  # noqa: E402
from numba import int64  # noqa: E402

from ninfer.artifact.codec import f32_to_bf16_bits  # noqa: E402
from ninfer.kernels_numba import elementwise as ew  # noqa: E402
from ninfer.kernels_numba import moe, sampling  # noqa: E402
from ninfer.kernels_numba.numba_setup import cuda, kernel  # noqa: E402

RUNS = 30
WARMUP = 3
SETS = 4
COPY_BW = 4.3e12
VOCAB_IDS, VOCAB_ROWS = 248077, 248320


@kernel((int64,), fastmath=False)
def _sleep(iterations):
    for _ in range(iterations):
        cuda.nanosleep(1000)


@kernel((int64,), fastmath=False)
def _empty(unused):
    pass


def time_launch(launch, sets, stream) -> float:
    """Median device microseconds of launch(*sets[i % len(sets)])."""
    for i in range(WARMUP):
        launch(*sets[i % len(sets)])
    stream.synchronize()
    events = [cuda.event() for _ in range(2 * RUNS)]
    _sleep[1, 1, stream](RUNS * 120)  # ~ RUNS * 120 us of sleep covers queueing RUNS launches of a few kernels
    for i in range(RUNS):
        events[2 * i].record(stream)
        launch(*sets[i % len(sets)])
        events[2 * i + 1].record(stream)
    stream.synchronize()
    times = [cuda.event_elapsed_time(events[2 * i], events[2 * i + 1]) * 1e3 for i in range(RUNS)]
    return float(np.median(times))


def main() -> None:
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    dev = lambda a: cuda.to_device(np.ascontiguousarray(a), stream=stream)  # noqa: E731
    f32 = lambda *s: (rng.standard_normal(s) * 2).astype(np.float32)  # noqa: E731
    rows_out = []

    def record(name, shape, launch, sets, nbytes, flops=None):
        us = time_launch(launch, sets, stream)
        gbps = nbytes / (us * 1e-6) / 1e9
        row = dict(name=name, shape=shape, us=round(us, 2), gbps=round(gbps, 1), ratio=round(gbps * 1e9 / COPY_BW, 3))
        if flops:
            row["tflops"] = round(flops / (us * 1e-6) / 1e12, 2)
        rows_out.append(row)
        print(f"{name:28s} {shape:28s} {us:9.2f} us {gbps:9.1f} GB/s {row['ratio']:7.3f} x copy", flush=True)

    record("empty kernel (floor)", "-", lambda: _empty[1, 32, stream](0), [()], 0)

    # rms_norm / add_rms_norm at [R, 5120]
    for rows in (1, 8, 48):
        h = 5120
        w = dev(f32(h) * 0.1)
        sets = [(dev(f32(rows, h)), dev(f32(rows, h)), dev(np.zeros((rows, h), np.float32))) for _ in range(SETS)]
        record("rms_norm_rows", f"[{rows}, {h}]",
               lambda x, d, o: ew.rms_norm_rows(x, w, o, eps=1e-6, offset=True, stream=stream), sets,
               2 * rows * h * 4 + h * 4)
        record("add_rms_norm_rows", f"[{rows}, {h}]",
               lambda x, d, o: ew.add_rms_norm_rows(x, d, w, o, eps=1e-6, offset=True, stream=stream), sets,
               4 * rows * h * 4 + h * 4)
    rows, h = 8192, 5120
    x, o = dev(f32(rows, h)), dev(np.zeros((rows, h), np.float32))
    record("rms_norm_rows", f"[{rows}, {h}]",
           lambda: ew.rms_norm_rows(x, w, o, eps=1e-6, offset=True, stream=stream), [()], 2 * rows * h * 4)
    x = o = None  # free the prefill-sized buffers

    # embed_rows from the 27B table [248320, 5120]
    table = cuda.device_array((VOCAB_ROWS, 5120), dtype=np.uint16, stream=stream)
    for rows in (8, 8192):
        sets = [(dev(rng.integers(0, VOCAB_ROWS, rows).astype(np.int32)),) for _ in range(SETS)]
        out = dev(np.zeros((rows, 5120), np.float32))
        record("embed_rows", f"[{rows}] of [{VOCAB_ROWS}, 5120]",
               lambda ids: ew.embed_rows(table, ids, out, stream=stream), sets, rows * 5120 * 6)
    table = None

    # silu_mul: dense [R, 2*17408], MoE slots [R, 8, 2*512]
    for rows in (8, 48):
        sets = [(dev(f32(rows, 2 * 17408)), dev(np.zeros((rows, 17408), np.float32))) for _ in range(SETS)]
        record("silu_mul_rows", f"[{rows}, 2x17408]", lambda g, o: ew.silu_mul_rows(g, o, stream=stream), sets,
               rows * 17408 * 12)
    sets = [(dev(f32(8, 8, 1024)), dev(np.zeros((8, 8, 512), np.float32))) for _ in range(SETS)]
    record("silu_mul_slots", "[8, 8, 2x512]", lambda g, o: ew.silu_mul_slots(g, o, stream=stream), sets, 64 * 512 * 12)
    rows = 8192
    sets = [(dev(f32(rows, 5120)), cuda.device_array((rows, 5120), np.uint16, stream=stream))]
    record("to_bf16_rows", f"[{rows}, 5120]", lambda a, b: ew.to_bf16_rows(a, b, stream=stream), sets, rows * 5120 * 6)
    sets = [(dev(f32(8, 2048)), dev(f32(8, 2048)), dev(f32(8, 1))) for _ in range(SETS)]
    record("sigmoid_gate_add", "[8, 2048]", lambda r, d, g: ew.sigmoid_gate_add(r, d, g, stream=stream), sets,
           8 * 2048 * 12)

    # MoE (35B-A3B: 256 experts top-8, hidden 2048)
    for rows in (8, 48, 8192):
        sets = [(dev(f32(rows, 256)), dev(np.zeros((rows, 8), np.int32)), dev(np.zeros((rows, 8), np.float32)))
                for _ in range(SETS)]
        record("route_top_k", f"[{rows}, 256] k=8", lambda lg, i, w: moe.route_top_k(lg, 8, i, w, stream=stream),
               sets, rows * 256 * 4 + rows * 8 * 8)
    for rows in (8, 48):
        sets = [(dev(f32(rows, 8, 2048)), dev(f32(rows, 8)), dev(f32(rows, 2048))) for _ in range(SETS)]
        record("moe_combine", f"[{rows}, 8, 2048]", lambda e, w, r: moe.moe_combine(e, w, r, stream=stream), sets,
               rows * 8 * 2048 * 4 + 2 * rows * 2048 * 4)
    rows, k, experts, h = 8192, 8, 256, 2048
    ids_sets = []
    for _ in range(SETS):
        ids = np.sort(np.argsort(rng.random((rows, experts)), axis=1)[:, :k], axis=1).astype(np.int32)
        ids_sets.append((dev(ids),))
    counts, offsets = dev(np.zeros(experts, np.int32)), dev(np.zeros(experts + 1, np.int32))
    slot_of, position_of = dev(np.zeros(rows * k, np.int32)), dev(np.zeros(rows * k, np.int32))
    record("moe_group", f"[{rows}, {k}] E={experts}",
           lambda ids: moe.moe_group(ids, counts, offsets, slot_of, experts=experts, position_of=position_of,
                                     stream=stream), ids_sets, rows * k * 12)
    x = dev(f32(rows, h))
    gathered = cuda.device_array((rows * k, h), np.uint16, stream=stream)
    record("moe_gather", f"[{rows}x{k}, {h}]", lambda: moe.moe_gather(x, slot_of, k, gathered, stream=stream), [()],
           rows * h * 4 + rows * k * h * 2)
    record("moe_gather (position_of)", f"[{rows}x{k}, {h}]",
           lambda: moe.moe_gather(x, slot_of, k, gathered, position_of=position_of, stream=stream), [()],
           rows * h * 4 + rows * k * h * 2)
    gathered = None
    permuted, weights = dev(f32_to_bf16_bits(f32(rows * k, h))), dev(f32(rows, k))
    record("moe_scatter_combine", f"[{rows}x{k}, {h}] bf16 outputs",
           lambda: moe.moe_scatter_combine(permuted, slot_of, weights, k, x, position_of=position_of, stream=stream),
           [()], rows * k * h * 2 + 2 * rows * h * 4)
    permuted = x = None

    # sampling at [R, 248320] (vocab_ids 248077)
    for rows in (1, 8, 48):
        scratch = sampling.sampling_scratch(rows, VOCAB_IDS)
        nsets = SETS if rows <= 8 else 2
        sets = [(dev(f32(rows, VOCAB_ROWS)),) for _ in range(nsets)]
        out = dev(np.zeros(rows, np.int32))
        record("argmax_rows", f"[{rows}, {VOCAB_ROWS}]",
               lambda lg: sampling.argmax_rows(lg, VOCAB_IDS, out, stream=stream, scratch=scratch), sets,
               rows * VOCAB_IDS * 4)
        counts_t = dev(rng.integers(0, 2, (rows, VOCAB_IDS)).astype(np.int32))
        lane = dev(np.arange(rows, dtype=np.int32))
        oi, ov = dev(np.zeros((rows, 20), np.int32)), dev(np.zeros((rows, 20), np.float32))
        for label, p in (("no penalty", 0.0), ("penalties", 1.0)):
            pres, freq = dev(np.full(rows, p, np.float32)), dev(np.full(rows, p / 2, np.float32))
            record(f"top_candidates_rows ({label})", f"[{rows}, {VOCAB_ROWS}]",
                   lambda lg: sampling.top_candidates_rows(lg, VOCAB_IDS, counts_t, lane, pres, freq, oi, ov,
                                                           stream=stream, scratch=scratch), sets,
                   rows * VOCAB_IDS * (8 if p else 4))
        sets = counts_t = None
    counts_t = dev(np.zeros((8, VOCAB_IDS), np.int32))
    sets = [(dev(np.arange(48, dtype=np.int32) % 8), dev(rng.integers(0, VOCAB_IDS, 48).astype(np.int32)),
             dev(np.ones(48, np.int32)))]
    record("count_tokens", "[48]", lambda a, b, c: sampling.count_tokens(counts_t, a, b, c, stream=stream), sets,
           48 * 16)

    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "kernel_misc.json"
        path.write_text(json.dumps(dict(device=str(cuda.get_current_device().name), runs=RUNS, results=rows_out),
                                   indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
