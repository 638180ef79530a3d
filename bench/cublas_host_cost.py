"""Host time of the MoE prefill's chunked expert GEMM call, with the batch count changing call to call or not.

Why: with fast_launch and moe_group's placement (session 21) the 35B-A3B bf16 8K prefill's GPU is busy ~156 ms
of ~165: the rest is idle at the MoE layers, where the GPU has run all it was given (the rows' gather, the shared
expert) before the host, woken by the group sizes, has queued the first expert GEMM. bench/host_trace.py put that
host stretch at ~300 us a layer, ~250 of it inside `Blas.chunked_gemm_bf16`; a plain cuBLAS GEMM call costs the
host ~40 us. Every layer asks `cublasGemmBatchedEx` for a different batch count (the number of 128-row chunks its
routing makes): if cuBLAS pays its algorithm choice again for each new count, a count rounded up to a coarse step
(the surplus chunks aimed at zero rows) would take it off the critical path for a few percent of padding.

Cases (median host microseconds of ROUNDS calls, the GPU idle at each call's start):
  varying: each call a new batch count (580..650 chunks, as the 35B-A3B's layers make);
  repeated: the same batch count every call;
  stepped: batch counts rounded up to multiples of STEP (a few distinct counts, each seen again).
For each: the whole `chunked_gemm_bf16` call, the address table's write, and the `gemm_batched_ex` call alone.

Run on the GPU machine: `python bench/cublas_host_cost.py`; JSON to $OUT/cublas_host_cost.json (bench/results
without OUT).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_trace import HostTrace  # noqa: E402
from bench.report import write_report  # noqa: E402

ROUNDS = 40
CHUNK = 128
EXPERTS = 256
COUNTS = (580, 650)  # chunk counts a 35B-A3B layer makes at 8K (65,536 routed rows plus each expert's padding)
STEP = 32
SHAPES = {"gate_up": (1024, 2048), "down": (2048, 512)}  # (N, K) of the 35B-A3B's routed experts


def main() -> None:
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.device import CudaDevice

    device = CudaDevice(0)
    blas = Blas(device)
    rng = np.random.default_rng(0)
    most = COUNTS[1] + STEP
    report = {"device": device.info.name, "rounds": ROUNDS, "chunk": CHUNK, "cases": {}}
    for shape, (n, k) in SHAPES.items():
        x = device.empty((most * CHUNK, k), np.uint16, "bench")
        w = device.empty((EXPERTS * n, k), np.uint16, "bench")
        y = device.empty((most * CHUNK, n), np.uint16, "bench")
        counts = {"varying": rng.permutation(np.arange(*COUNTS))[:ROUNDS],
                  "repeated": np.full(ROUNDS, (COUNTS[0] + COUNTS[1]) // 2),
                  "stepped": -(-rng.integers(*COUNTS, ROUNDS) // STEP) * STEP}
        for case, sequence in counts.items():
            trace = HostTrace()
            trace.wrap(blas._cublas, "gemm_batched_ex", "gemm_batched_ex")
            trace.wrap(device, "write", "address write")
            calls = []

            def run() -> None:
                for count in sequence:
                    groups = np.sort(rng.integers(0, EXPERTS, int(count)))
                    device.synchronize()
                    began = time.perf_counter()
                    blas.chunked_gemm_bf16(x, w, y, groups, CHUNK)
                    calls.append(time.perf_counter() - began)
                device.synchronize()

            events = trace.run(run)
            parts = {label: float(np.median([(end - start) * 1e6 for name, start, end in events if name == label]))
                     for label in ("gemm_batched_ex", "address write")}
            row = {"call_us": float(np.median(calls) * 1e6), "first_call_us": calls[0] * 1e6, **{
                f"{label}_us": us for label, us in parts.items()}, "distinct_counts": int(len(set(sequence)))}
            report["cases"][f"{shape}/{case}"] = row
            print(f"{shape:8s} {case:9s} ({row['distinct_counts']:3d} counts): call {row['call_us']:7.1f} us "
                  f"(first {row['first_call_us']:8.1f}), cuBLAS {row['gemm_batched_ex_us']:7.1f}, addresses "
                  f"{row['address write_us']:6.1f}", flush=True)
    write_report("cublas_host_cost", report)


if __name__ == "__main__":
    main()
