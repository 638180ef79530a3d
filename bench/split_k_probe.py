"""Is the decode out projection's split-K cheaper when we reduce the slices ourselves, inside the norm after it?

Why: on the 35B-A3B's B=1 bf16 step (results/cuda_model_35b_profile_session28.log) each layer's output projection
(2048 x 4096, 16.8 MB: ~5 us at copy speed) is cuBLAS's split-K GEMM, 7.4 us, then its reduction kernel, 2.9 us,
then the RMSNorm that reads the residual, 2.4 us: three launches on the critical path, ~14 us with their gaps. If
cuBLAS's strided-batched GEMM over K slices (each slice a batch entry writing its own fp32 partial) runs as fast as
its split-K GEMM, one kernel adds the slices to the residual and norms it (`add_slices_rms_norm_rows`, the norm's
row pass): two launches instead of three a layer, deterministic (the slices summed in a fixed order).

Cases, each a CUDA graph of REPEATS launches replayed (median microseconds a launch), bf16 weights at the real
shapes, PAD_ROWS rows (the decode GEMMs' padded shape, whatever the batch):
  cublas_accumulate      what decode runs now: y (+)= x @ W^T, cuBLAS's own choice (split-K and its reduction);
  rms_norm               the norm after the projection, as decode runs it (fp32 in, fp32 and bf16 copy out);
  sliced_S               `Blas.split_k_gemm_bf16` over S slices of K into S fp32 partials;
  add_slices_S_rms_norm  `add_slices_rms_norm_rows` of those S partials.
Each sliced case also reports how far its slices' sum is from the whole product (fp32 rounding: ~1e-6 of the
largest). The candidate (the best S) wins where sliced_S + add_slices_S_rms_norm is below cublas_accumulate +
rms_norm by a few us; then the model's out projections can take it (Linear, a setting, timed in cuda_model.py).

Run on the GPU machine: `python bench/split_k_probe.py`; JSON to $OUT/split_k_probe.json (bench/results without OUT).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_report  # noqa: E402

PAD_ROWS = 8
REPEATS = 20
SLICES = (2, 4, 8)
# (N, K) of the decode projections that accumulate into the residual right before a norm
SHAPES = {"35b out (gdn, attention)": (2048, 4096), "27b gdn out": (5120, 6144), "27b attention out": (5120, 6144),
          "27b down": (5120, 17408)}


def main() -> None:
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.backends.cuda.timing import captured_repeats
    from ninfer.kernels_numba.elementwise import add_slices_rms_norm_rows, rms_norm_rows

    device = CudaDevice(0)
    blas = Blas(device)
    rng = np.random.default_rng(0)
    report = {"device": device.info.name, "rows": PAD_ROWS, "repeats": REPEATS, "shapes": {}}

    def micros(launch) -> float:
        graph, seconds = captured_repeats(device, launch, REPEATS)
        graph.close()
        return round(seconds * 1e6, 2)

    for name, (n, k) in SHAPES.items():
        w = device.upload(rng.integers(0x3C00, 0x3D00, (n, k), dtype=np.uint16), "bench")
        x = device.upload(rng.integers(0x3C00, 0x3D00, (PAD_ROWS, k), dtype=np.uint16), "bench")
        residual = device.upload(rng.standard_normal((PAD_ROWS, n)).astype(np.float32), "bench")
        weight = device.upload(rng.standard_normal(n).astype(np.float32), "bench")
        normed = device.empty((PAD_ROWS, n), np.float32, "bench")
        normed_bf16 = device.empty((PAD_ROWS, n), np.uint16, "bench")
        partials = device.empty((max(SLICES), PAD_ROWS, n), np.float32, "bench")
        stream = device.stream
        row = {"cublas_accumulate": micros(lambda: blas.gemm_bf16(x, w, residual, accumulate=True)),
               "rms_norm": micros(lambda: rms_norm_rows(residual, weight, normed, eps=1e-6, offset=True,
                                                        stream=stream, out_bf16=normed_bf16))}
        whole = device.empty((PAD_ROWS, n), np.float32, "bench")
        blas.gemm_bf16(x, w, whole)
        for slices in SLICES:
            if k % (8 * slices) == 0:
                row[f"sliced_{slices}"] = micros(lambda s=slices: blas.split_k_gemm_bf16(x, w, partials[:s], s))
                # the slices' sum is the whole product (to fp32 rounding): the strides address the right blocks
                summed = partials[:slices].copy_to_host().sum(axis=0)
                want = whole.copy_to_host()
                row[f"sliced_{slices}_rel_error"] = float(np.abs(summed - want).max() / np.abs(want).max())
                row[f"add_slices_{slices}_rms_norm"] = micros(lambda s=slices: add_slices_rms_norm_rows(
                    partials[:s], residual, weight, normed, eps=1e-6, offset=True, stream=stream, out_bf16=normed_bf16))
        now = row["cublas_accumulate"] + row["rms_norm"]
        best = min(row[f"sliced_{s}"] + row[f"add_slices_{s}_rms_norm"] for s in SLICES if f"sliced_{s}" in row)
        row["now_us"], row["candidate_us"] = round(now, 2), round(best, 2)
        report["shapes"][name] = row
        print(f"{name:26s} N={n:5d} K={k:5d}  " + "  ".join(f"{key} {v}" for key, v in row.items()), flush=True)
    write_report("split_k_probe", report)


if __name__ == "__main__":
    main()
