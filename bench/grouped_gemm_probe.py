"""Which cuBLAS call serves the MoE prefill's expert GEMMs best: the grouped GEMM the model runs, or one strided-
batched GEMM over the experts with each expert's rows padded to the largest count?

The 35B-A3B 8K prefill multiplies 8192 tokens x 8 slots of rows by their experts' [1024, 2048] gate_up (and [2048,
512] down) matrices. `Blas.grouped_gemm_bf16` (cublasGemmGroupedBatchedEx, bf16 out) ran an sm80 mma.sync kernel at
~275 TFLOP/s in the profiles (results/cuda_model_session10.json); a strided-batched GEMM gets cuBLAS's sm90 kernels
but computes the padding too. The expert counts reach the host before either call (the grouped call's offsets), so
the model could size the padded batch per layer. Per routing (uniform over experts, as a balanced router, and
skewed), this probe times both on one layer's gate_up: wall time per call (host work included, device
synchronised), TFLOP/s of the useful FLOPs, the padding's share of the batched FLOPs, and the relative difference
of the two results on the real rows.

Run on the GPU machine: `python bench/grouped_gemm_probe.py`; JSON to $OUT/grouped_gemm_probe.json (bench/results
without OUT).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_profile import wall_seconds  # noqa: E402
from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402

EXPERTS, ROWS_PER_EXPERT, K, TOKENS, SLOTS = 256, 1024, 2048, 8192, 8
PAD = 16  # padded expert rows round up to this (tensor-core tile friendly)
CUDA_R_16BF = 14


def expert_counts(rng: np.random.Generator, routing: str) -> np.ndarray:
    popularity = np.full(EXPERTS, 1.0 / EXPERTS) if routing == "uniform" else rng.dirichlet(np.full(EXPERTS, 0.3))
    return rng.multinomial(TOKENS * SLOTS, popularity)


def main() -> None:
    from nvmath.bindings import cublas

    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.device import CudaDevice, device_pointer

    device = CudaDevice(0)
    blas = Blas(device)
    rng = np.random.default_rng(0)
    w = device.empty((EXPERTS * ROWS_PER_EXPERT, K), np.uint16, "bench")
    w_host_expert = f32_to_bf16_bits((rng.standard_normal((ROWS_PER_EXPERT, K)) * 0.02).astype(np.float32))
    for e in range(EXPERTS):  # one random expert repeated: the time does not depend on the values
        device.write(w[e * ROWS_PER_EXPERT:(e + 1) * ROWS_PER_EXPERT], w_host_expert)
    report = {"device": device.info.name, "shape": [EXPERTS, ROWS_PER_EXPERT, K], "routings": {}}
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    for routing in ("uniform", "skewed"):
        counts = expert_counts(rng, routing)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        rows = int(offsets[-1])
        padded = -(-int(counts.max()) // PAD) * PAD
        x_host = f32_to_bf16_bits(rng.standard_normal((rows, K)).astype(np.float32))
        x_padded_host = np.zeros((EXPERTS, padded, K), np.uint16)
        for e in range(EXPERTS):
            x_padded_host[e, :counts[e]] = x_host[offsets[e]:offsets[e + 1]]
        x = device.upload(x_host, "bench")
        x_padded = device.upload(x_padded_host, "bench")
        y = device.empty((rows, ROWS_PER_EXPERT), np.uint16, "bench")
        y_padded = device.empty((EXPERTS, padded, ROWS_PER_EXPERT), np.uint16, "bench")
        flops = 2.0 * rows * ROWS_PER_EXPERT * K

        def grouped():
            blas.grouped_gemm_bf16(x, w, y, offsets, ROWS_PER_EXPERT)

        def batched():  # y_e^T = W_e . x_e^T for every expert, `padded` rows each
            cublas.gemm_strided_batched_ex(
                blas.handle, cublas.Operation.T, cublas.Operation.N, ROWS_PER_EXPERT, padded, K, one.ctypes.data,
                device_pointer(w), CUDA_R_16BF, K, ROWS_PER_EXPERT * K, device_pointer(x_padded), CUDA_R_16BF, K,
                padded * K, zero.ctypes.data, device_pointer(y_padded), CUDA_R_16BF, ROWS_PER_EXPERT,
                padded * ROWS_PER_EXPERT, EXPERTS, cublas.ComputeType.COMPUTE_32F, cublas.GemmAlgo.DEFAULT)

        row = {"rows": rows, "max_expert_rows": int(counts.max()), "padded_rows": padded,
               "padding_share": 1.0 - rows / (EXPERTS * padded), "flops": flops}
        for name, call in (("grouped", grouped), ("padded batched", batched)):
            seconds = wall_seconds(call, device.synchronize, repeats=5)
            row[name] = {"seconds": seconds, "tflop_s": flops / seconds / 1e12}
            print(f"{routing:8s} {name:15s} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:6.1f} TFLOP/s useful"
                  f"  (max {counts.max()} rows an expert, padding {row['padding_share']:.0%})", flush=True)
        got_grouped = bf16_bits_to_f32(y.copy_to_host()).astype(np.float64)
        got_padded = bf16_bits_to_f32(y_padded.copy_to_host())
        got_batched = np.concatenate([got_padded[e, :counts[e]] for e in range(EXPERTS)]).astype(np.float64)
        row["rel_batched_to_grouped"] = float(np.linalg.norm(got_batched - got_grouped) / np.linalg.norm(got_grouped))
        report["routings"][routing] = row
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "grouped_gemm_probe.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
