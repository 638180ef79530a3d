"""GPU bench of the decode linear kernels (bf16 and ninfer-v2 quantized GEMV, MoE gathered) at the real model shapes.

Run on the GPU box: `python bench/kernel_linear.py [--sweep]`. Each case captures `REPS` launches (rotating input
sets) into one CUDA graph through cuda-python, replays it (warm-up, then >= 20 timed replays with CUDA events) and
reports the median per launch: us, GB/s of compulsory bytes (weights + x + y) and the ratio to 4.3 TB/s (the measured
device copy bandwidth). Writes $OUT/kernel_linear.json when OUT is set. `--sweep` also times other rows-per-warp
variants of the kernels (for tuning); the bf16 gathered MoE GEMVs (gate|up, and the down with its SwiGLU staged)
are always timed at the `GATHERED_BF16_VARIANTS` and `GATHERED_FLIGHT_VARIANTS` geometries too; `--gathered` times
only those (and the quantized gathered kernels).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32, row_split_geometry  # noqa: E402
from ninfer.kernels_numba import linear as L  # noqa: E402
from ninfer.kernels_numba import quant_linear as Q  # noqa: E402
from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402

COPY_BW = 4.3e12
REPS = 12  # launches per captured graph
TIMED = 25  # timed replays (median)
FORMATS = [Q4G64, Q5G64, Q6G64, W8G32]
bf16_variant = functools.lru_cache(L.make_linear_bf16_kernel)  # each (R, MT) compiled once
quant_variant = functools.lru_cache(Q.make_linear_quant_kernel)


class Timer:
    """Times a launch callable per launch: graph capture when cuda-python is there, eager batches otherwise."""

    def __init__(self):
        try:
            from cuda.bindings import driver as drv
        except ImportError:  # pragma: no cover
            drv = None
        self.drv = drv
        cuda.current_context()
        if drv is not None:
            err, self.raw = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self.stream = cuda.external_stream(int(self.raw))
        else:
            self.stream = cuda.stream()

    def time(self, launch, sets: int) -> float:
        """launch(i, stream) enqueues one launch on input set i; returns the median seconds per launch."""
        stream = self.stream
        for i in range(sets):  # compile + warm
            launch(i, stream)
        stream.synchronize()
        start, end = cuda.event(), cuda.event()
        samples = []
        if self.drv is not None:
            drv = self.drv
            drv.cuStreamBeginCapture(self.raw, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            for r in range(REPS):
                launch(r % sets, stream)
            err, graph = drv.cuStreamEndCapture(self.raw)
            err, gexec = drv.cuGraphInstantiate(graph, 0)
            for _ in range(3):
                drv.cuGraphLaunch(gexec, self.raw)
            for _ in range(TIMED):
                start.record(stream)
                drv.cuGraphLaunch(gexec, self.raw)
                end.record(stream)
                end.synchronize()
                samples.append(cuda.event_elapsed_time(start, end) / 1e3 / REPS)
            drv.cuGraphExecDestroy(gexec)
            drv.cuGraphDestroy(graph)
        else:  # pragma: no cover
            for _ in range(TIMED):
                start.record(stream)
                for r in range(REPS):
                    launch(r % sets, stream)
                end.record(stream)
                end.synchronize()
                samples.append(cuda.event_elapsed_time(start, end) / 1e3 / REPS)
        return statistics.median(samples)


def random_payload(fmt: str, shape: tuple[int, int], rng) -> np.ndarray:
    """A valid-format payload with random codes and small positive scales (speed does not depend on values)."""
    geometry = row_split_geometry(fmt, shape)
    data = rng.integers(0, 256, geometry.total_bytes, dtype=np.uint8)
    scales = data[geometry.scale_offset:].view(np.uint16)
    scales[:] = rng.integers(0x1400, 0x2400, scales.size, dtype=np.uint16)  # ~1e-3 .. 1e-2
    return data


def report(rows, name, M, shape, seconds, nbytes, flops):
    gbs = nbytes / seconds / 1e9
    row = {"kernel": name, "M": M, "shape": list(shape), "us": round(seconds * 1e6, 2), "GB/s": round(gbs, 1),
           "ratio_4.3TB/s": round(gbs * 1e9 / COPY_BW, 3), "TFLOP/s": round(flops / seconds / 1e12, 2)}
    rows.append(row)
    print(f"{name:34s} M={M:<3d} {str(list(shape)):16s} {row['us']:9.2f} us {row['GB/s']:8.1f} GB/s "
          f"{row['ratio_4.3TB/s']:6.3f}x4.3TB/s {row['TFLOP/s']:7.2f} TFLOP/s", flush=True)


def bench_dense(timer, rows, rng, sweep: bool):
    shapes = [(17408, 5120), (5120, 17408), (248320, 5120)]
    bf16_variants: dict = {"": None}
    quant_variants: dict = {"": None}
    ms = (1, 2, 4, 8)
    formats = FORMATS
    if sweep:  # tuning subset: rows-per-warp variants at one shape
        bf16_variants = {f"R{r}W{w}" + (f"reg{g}" if g else ""): (r, w, g)
                         for r, w, g in ((1, 8, None), (2, 8, None), (4, 8, None), (2, 4, None), (2, 16, None),
                                         (4, 16, None), (2, 8, 80), (2, 8, 64), (2, 4, 80))}
        quant_variants = dict(bf16_variants)
        shapes, ms, formats = [(17408, 5120)], (1, 8), [Q4G64]
    for shape in shapes:
        N, K = shape
        dw = cuda.device_array((N, K), np.uint16)
        dw.copy_to_device(rng.integers(0x3C00, 0x3D00, (N, K), dtype=np.uint16) if N * K < 2**28 else
                          np.zeros((N, K), np.uint16))
        for M in ms:
            xs = [cuda.to_device(rng.standard_normal((M, K)).astype(np.float32)) for _ in range(3)]
            dy = cuda.device_array((M, N), np.float32)
            for tag, rw in bf16_variants.items():
                r, warps, regs = rw or (L.BF16_ROWS_PER_WARP, L.WARPS, None)
                kern = None if rw is None else bf16_variant(r, 1 if M == 1 else 8, regs)
                t = timer.time(lambda i, s: L.linear_bf16(xs[i], dw, dy, stream=s, rows_per_warp=r, warps=warps,
                                                          _kernel=kern), 3)
                report(rows, f"linear_bf16{('_' + tag) if tag else ''}", M, shape, t, N * K * 2 + M * (K + N) * 4,
                       2 * M * N * K)
        dw = None
        if N > 20000:
            continue
        for fmt in formats:
            payload = random_payload(fmt, shape, rng)
            qw = Q.upload_quant_weight(fmt, shape, payload)
            qbytes = payload.size
            for M in ms:
                xs = [cuda.to_device(rng.standard_normal((M, K)).astype(np.float32)) for _ in range(3)]
                dy = cuda.device_array((M, N), np.float32)
                for tag, rw in quant_variants.items():
                    r, warps, regs = rw or (Q.QUANT_ROWS_PER_WARP, L.WARPS, None)
                    kern = None if rw is None else quant_variant(Q.FORMAT_IDS[fmt], r, 1 if M == 1 else 8, regs)
                    t = timer.time(lambda i, s: Q.linear_quant(xs[i], qw, dy, stream=s, rows_per_warp=r, warps=warps,
                                                               _kernel=kern), 3)
                    report(rows, f"linear_quant[{fmt}]{('_' + tag) if tag else ''}", M, shape, t,
                           qbytes + M * (K + N) * 4, 2 * M * N * K)
            out = cuda.device_array(shape, np.uint16)
            t = timer.time(lambda i, s: Q.dequantize_bf16(qw, out, stream=s), 1)
            report(rows, f"dequantize_bf16[{fmt}]", 0, shape, t, qbytes + N * K * 2, 0)
            qw = out = None


# (rows a warp, warps a block) of the bf16 gathered GEMVs timed beside the defaults: the stepping kernel's (one
# 256-column step of loads in flight a lane), and the all-in-flight kernel's (every load of a lane issued first,
# where K fits its steps: gate|up K = 2048 in 8 steps, the SwiGLU down K = 512 in 2)
GATHERED_BF16_VARIANTS = ((2, 8), (1, 8), (4, 8), (2, 4))
GATHERED_FLIGHT_VARIANTS = {False: ((1, 4), (1, 8), (2, 4), (2, 8), (4, 4)), True: ((2, 4), (4, 4), (4, 8), (8, 4))}


gathered_bf16_variant = functools.lru_cache(L.gathered_stepping)  # (rows a warp, swiglu): compiled once
gathered_flight_variant = functools.lru_cache(L.gathered_in_flight)  # (rows a warp, steps, swiglu)


def bench_gathered(timer, rows, rng):
    E, M, S = 256, 1, 8
    # 8 expert sets cycled: 8 x 8 experts' down projections (128 MB) outgrow the 50 MB L2 as gate|up's do
    id_sets = [cuda.to_device(rng.choice(E, S, replace=False).astype(np.int32).reshape(M, S)) for _ in range(8)]
    for name, rpe, K, swiglu in (("gate_up", 1024, 2048, False), ("down", 2048, 512, True)):
        shape = (E * rpe, K)
        x = cuda.to_device(rng.standard_normal((M, S, 2 * K) if swiglu else (M, K)).astype(np.float32))
        dy = cuda.device_array((M, S, rpe), np.float32)
        dw = cuda.to_device(np.full(shape, 0x3C80, np.uint16))
        cases = [("stepping", L.GATHERED_WARPS, L.GATHERED_STEPPING_KERNELS[swiglu])]
        cases += [("stepping", warps, gathered_bf16_variant(r, swiglu)) for r, warps in GATHERED_BF16_VARIANTS]
        cases += [("flight", warps, gathered_flight_variant(r, L.GATHERED_FLIGHT[swiglu][1], swiglu))
                  for r, warps in GATHERED_FLIGHT_VARIANTS[swiglu]]
        for kind, warps, kern in cases:
            def launch(i, s, warps=warps, kern=kern):
                if swiglu:
                    L.linear_bf16_gathered_swiglu(x, dw, id_sets[i], dy, rows_per_expert=rpe, stream=s, warps=warps,
                                                  _kernel=kern)
                else:
                    L.linear_bf16_gathered(x, dw, id_sets[i], dy, rows_per_expert=rpe, x_per_slot=False, stream=s,
                                           warps=warps, _kernel=kern)

            t = timer.time(launch, len(id_sets))
            report(rows, f"linear_bf16_gathered({name})_{kind}_r{kern.rows_per_warp}_w{warps}", M, shape, t,
                   S * rpe * K * 2 + S * rpe * 4, 2 * S * rpe * K)
        dw = None
    rpe, K = 1024, 2048  # the quantized gathered kernels at the gate|up shape
    shape = (E * rpe, K)
    x = cuda.to_device(rng.standard_normal((M, K)).astype(np.float32))
    dy = cuda.device_array((M, S, rpe), np.float32)
    for fmt in FORMATS:
        payload = random_payload(fmt, shape, rng)
        qw = Q.upload_quant_weight(fmt, shape, payload)
        per_expert = payload.size / E
        t = timer.time(lambda i, s: Q.linear_quant_gathered(x, qw, id_sets[i], dy, rows_per_expert=rpe,
                                                            x_per_slot=False, stream=s), 3)
        report(rows, f"linear_quant_gathered[{fmt}]", M, shape, t, S * per_expert + S * rpe * 4, 2 * S * rpe * K)
        qw = None


def main() -> None:
    sweep = "--sweep" in sys.argv
    rng = np.random.default_rng(0)
    timer = Timer()
    rows: list[dict] = []
    t0 = time.time()
    if not sweep:
        bench_gathered(timer, rows, rng)
    if "--gathered" not in sys.argv:
        bench_dense(timer, rows, rng, sweep)
    print(f"total {time.time() - t0:.0f} s")
    for name, fn in (("bf16 m1", L.linear_bf16_kernel_m1), ("bf16", L.linear_bf16_kernel),
                     ("q4 m1", Q.LINEAR_QUANT_KERNELS_M1[4]), ("q4 tile4", Q.LINEAR_QUANT_KERNELS_BY_TILE[4][4]),
                     ("q6 m1", Q.LINEAR_QUANT_KERNELS_M1[6]), ("w8 m1", Q.LINEAR_QUANT_KERNELS_M1[8])):
        try:
            print(name, "regs", {str(k): v for k, v in fn.get_regs_per_thread().items()},
                  "local", {str(k): v for k, v in fn.get_local_mem_per_thread().items()})
        except Exception as error:  # noqa: BLE001
            print(name, "regs?", error)
    out = os.environ.get("OUT")
    if out:
        Path(out, "kernel_linear_sweep.json" if sweep else "kernel_linear.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
