"""Per-launch time of the small kernels decode is made of, each captured 50 times back to back in one CUDA graph and
replayed: wall microseconds per launch (graph replay, device synchronised) and the CUPTI kernel time. Cases pair a
kernel alone with the same kernel behind a cuBLAS GEMV that writes its input (the decode pattern), which separates a
slow kernel from a slow hand-over between kernels.

Run on the GPU machine: `python bench/kernel_latency.py`; JSON to $OUT/kernel_latency.json (bench/results without
OUT).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAUNCHES = 50


def cases(device, blas, k) -> dict:
    """name -> (body issuing ONE step, launches per step)."""
    stream = device.stream
    out = {}
    for width in (2048, 5120):
        x = device.upload(np.random.default_rng(width).standard_normal((1, width)).astype(np.float32), "bench")
        weight = device.upload(np.zeros(width, np.float32), "bench")
        normed = device.empty((1, width), np.float32, "bench")
        normed_bf16 = device.empty((1, width), np.uint16, "bench")
        w = device.upload(np.zeros((width, width), np.uint16), "bench")

        def norm(x=x, weight=weight, normed=normed, normed_bf16=normed_bf16):
            k.rms_norm_rows(x, weight, normed, eps=1e-6, offset=True, stream=stream, out_bf16=normed_bf16)

        def gemv_then_norm(x=x, w=w, normed_bf16=normed_bf16, norm=norm):
            blas.gemm_bf16(normed_bf16, w, x, accumulate=True)
            norm()

        def gemv(x=x, w=w, normed_bf16=normed_bf16):
            blas.gemm_bf16(normed_bf16, w, x, accumulate=True)

        gate_up = device.upload(np.zeros((1, 2 * width), np.float32), "bench")
        act = device.empty((1, width), np.float32, "bench")

        def silu(gate_up=gate_up, act=act):
            k.silu_mul_rows(gate_up, act, stream=stream)

        out[f"rms_norm 1x{width} (+bf16 copy)"] = (norm, 1)
        out[f"silu_mul 1x{width}"] = (silu, 1)
        out[f"cuBLAS gemv {width}x{width} accumulate"] = (gemv, 1)
        out[f"cuBLAS gemv {width}x{width} then rms_norm"] = (gemv_then_norm, 2)
    return out


def measure(device, body, launches_per_step: int, profile: bool) -> dict:
    from ninfer.backends.cuda.timing import captured_repeats

    graph, seconds = captured_repeats(device, body, LAUNCHES)
    row = {"wall_us_per_step": seconds * 1e6, "launches_per_step": launches_per_step}
    if profile:
        from bench.kernel_profile import profile_replays

        report = profile_replays(lambda: graph.replay(device.stream_handle), device.synchronize, replays=3)
        row["kernels_us_per_step"] = {kernel["name"]: kernel["us_per_replay"] / LAUNCHES
                                      for kernel in report["kernels"]}
    graph.close()
    return row


def main() -> None:
    from ninfer.backends.cuda.device import CudaDevice

    device = CudaDevice(0)
    blas, k = device.blas(), device.kernels
    report = {"device": device.info.name, "launches_per_graph": LAUNCHES, "cases": {}}
    for name, (body, launches) in cases(device, blas, k).items():
        row = measure(device, body, launches, profile=True)
        report["cases"][name] = row
        print(f"{name:44s} {row['wall_us_per_step']:7.2f} us/step  kernels "
              + ", ".join(f"{n[:40]} {us:.2f}" for n, us in row.get("kernels_us_per_step", {}).items()), flush=True)
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "kernel_latency.json"
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
