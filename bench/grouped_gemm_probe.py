"""Does cuBLAS's grouped GEMM (`cublasGemmGroupedBatchedEx`) serve the MoE prefill better than one GEMM per expert?

The 35B-A3B 8K prefill runs ~20,000 small per-expert GEMMs (`Blas.grouped_gemm_bf16`: 256 experts x 2 projections x
40 layers), each a host call and a small kernel. This probe builds one layer's routed gate_up at the real shape
(256 experts of [1024, 2048], 8192 tokens x 8 slots of rows with skewed expert counts), times the per-expert loop,
and tries the grouped call with bf16 inputs and an fp32 output (what the model needs; cuBLAS documents only some type
combinations for it) and with a bf16 output. Each variant reports its wall time per call (host work included, the
device synchronised) and its relative difference to the loop, or the cuBLAS error it raised.

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
CUDA_R_32F, CUDA_R_16BF = 0, 14


def main() -> None:
    from nvmath.bindings import cublas

    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.device import CudaDevice, device_pointer

    device = CudaDevice(0)
    blas = Blas(device)
    rng = np.random.default_rng(0)
    popularity = rng.dirichlet(np.full(EXPERTS, 0.3))  # skewed, as routers are
    counts = rng.multinomial(TOKENS * SLOTS, popularity)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = int(offsets[-1])
    x = device.upload(f32_to_bf16_bits(rng.standard_normal((rows, K)).astype(np.float32)), "bench")
    w = device.empty((EXPERTS * ROWS_PER_EXPERT, K), np.uint16, "bench")
    w_host_expert = f32_to_bf16_bits((rng.standard_normal((ROWS_PER_EXPERT, K)) * 0.02).astype(np.float32))
    for e in range(EXPERTS):  # one random expert repeated: the time does not depend on the values
        device.write(w[e * ROWS_PER_EXPERT:(e + 1) * ROWS_PER_EXPERT], w_host_expert)
    y_loop = device.empty((rows, ROWS_PER_EXPERT), np.float32, "bench")
    flops = 2.0 * rows * ROWS_PER_EXPERT * K
    report = {"device": device.info.name, "rows": rows, "max_expert_rows": int(counts.max()),
              "empty_experts": int((counts == 0).sum()), "flops": flops, "variants": {}}

    def loop():
        blas.grouped_gemm_bf16(x, w, y_loop, offsets, ROWS_PER_EXPERT)

    seconds = wall_seconds(loop, device.synchronize, repeats=5)
    report["variants"]["per-expert loop"] = {"seconds": seconds, "tflop_s": flops / seconds / 1e12}
    want = y_loop.copy_to_host().astype(np.float64)
    live = [e for e in range(EXPERTS) if counts[e]]
    groups = len(live)
    x0, w0 = device_pointer(x), device_pointer(w)
    a_pointers = device.upload(np.array([w0 + e * ROWS_PER_EXPERT * K * 2 for e in live], np.uint64), "bench")
    b_pointers = device.upload(np.array([x0 + int(offsets[e]) * K * 2 for e in live], np.uint64), "bench")
    # per-group host arguments as Python sequences (nvmath takes a sequence or a host pointer); scalars by pointer
    transa, transb = [int(cublas.Operation.T)] * groups, [int(cublas.Operation.N)] * groups
    m_array, n_array, k_array = [ROWS_PER_EXPERT] * groups, [int(counts[e]) for e in live], [K] * groups
    ones, zeros = np.ones(groups, np.float32), np.zeros(groups, np.float32)
    group_size = [1] * groups
    for name, ctype, itemsize in (("grouped, fp32 out", CUDA_R_32F, 4), ("grouped, bf16 out", CUDA_R_16BF, 2)):
        y = device.empty((rows, ROWS_PER_EXPERT), np.float32 if itemsize == 4 else np.uint16, "bench")
        y0 = device_pointer(y)
        c_pointers = device.upload(np.array([y0 + int(offsets[e]) * ROWS_PER_EXPERT * itemsize for e in live],
                                            np.uint64), "bench")

        def grouped(y=y, c_pointers=c_pointers, ctype=ctype):
            cublas.gemm_grouped_batched_ex(
                blas.handle, transa, transb, m_array, n_array, k_array, ones.ctypes.data,
                device_pointer(a_pointers), CUDA_R_16BF, k_array, device_pointer(b_pointers), CUDA_R_16BF, k_array,
                zeros.ctypes.data, device_pointer(c_pointers), ctype, m_array, groups, group_size,
                cublas.ComputeType.COMPUTE_32F)

        try:
            seconds = wall_seconds(grouped, device.synchronize, repeats=5)
        except Exception as error:  # the probe's question: which type combinations this cuBLAS accepts
            report["variants"][name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name}: {type(error).__name__}: {error}", flush=True)
            continue
        got = y.copy_to_host()
        got = (got if itemsize == 4 else bf16_bits_to_f32(got)).astype(np.float64)
        report["variants"][name] = {"seconds": seconds, "tflop_s": flops / seconds / 1e12,
                                    "rel_to_loop": float(np.linalg.norm(got - want) / np.linalg.norm(want))}
    for name, row in report["variants"].items():
        if "seconds" in row:
            print(f"{name:20s} {row['seconds'] * 1e3:8.2f} ms  {row['tflop_s']:6.1f} TFLOP/s"
                  + (f"  rel {row['rel_to_loop']:.1e}" if "rel_to_loop" in row else ""), flush=True)
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "grouped_gemm_probe.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
