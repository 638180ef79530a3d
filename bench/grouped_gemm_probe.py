"""Which cuBLAS call serves the MoE prefill's expert GEMMs best: the grouped GEMM, one strided-batched GEMM over the
experts with each expert's rows padded to the largest count (the model's choice while that padding stays under 2x),
or a pointer-array batched GEMM over chunks of 128 or 256 rows, each expert's rows padded to whole chunks (padding
bounded whatever the skew)?

The 35B-A3B 8K prefill multiplies 8192 tokens x 8 slots of rows by their experts' [1024, 2048] gate_up (and [2048,
512] down) matrices. `Blas.grouped_gemm_bf16` (cublasGemmGroupedBatchedEx, bf16 out) ran an sm80 mma.sync kernel at
~275 TFLOP/s in the profiles (results/cuda_model_session10.json); a strided-batched GEMM gets cuBLAS's sm90 kernels
but computes the padding too. The expert counts reach the host before either call (the grouped call's offsets), so
the model could size the padded batch per layer. Per routing (uniform over experts, as a balanced router, and
skewed), this probe times each on one layer's gate_up: wall time per call (host work included, device
synchronised), TFLOP/s of the useful FLOPs, the padding's share of the batched FLOPs, and the relative difference
of each result to the grouped one on the real rows.

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

from ninfer.backends.cuda.timing import wall_seconds  # noqa: E402
from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402

EXPERTS, ROWS_PER_EXPERT, K, TOKENS, SLOTS = 256, 1024, 2048, 8192, 8
PAD = 16  # padded expert rows round up to this (tensor-core tile friendly)
CHUNKS = (128, 256)  # rows a batch entry of the pointer-array form: padding at most a chunk less one an expert


def expert_counts(rng: np.random.Generator, routing: str) -> np.ndarray:
    popularity = np.full(EXPERTS, 1.0 / EXPERTS) if routing == "uniform" else rng.dirichlet(np.full(EXPERTS, 0.3))
    return rng.multinomial(TOKENS * SLOTS, popularity)


def main() -> None:
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.device import CudaDevice

    device = CudaDevice(0)
    blas = Blas(device)
    rng = np.random.default_rng(0)
    w = device.empty((EXPERTS * ROWS_PER_EXPERT, K), np.uint16, "bench")
    w_host_expert = f32_to_bf16_bits((rng.standard_normal((ROWS_PER_EXPERT, K)) * 0.02).astype(np.float32))
    for e in range(EXPERTS):  # one random expert repeated: the time does not depend on the values
        device.write(w[e * ROWS_PER_EXPERT:(e + 1) * ROWS_PER_EXPERT], w_host_expert)
    report = {"device": device.info.name, "shape": [EXPERTS, ROWS_PER_EXPERT, K], "routings": {}}
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
        x_padded = device.upload(x_padded_host.reshape(EXPERTS * padded, K), "bench")
        y = device.empty((rows, ROWS_PER_EXPERT), np.uint16, "bench")
        y_padded = device.empty((EXPERTS * padded, ROWS_PER_EXPERT), np.uint16, "bench")
        flops = 2.0 * rows * ROWS_PER_EXPERT * K

        def grouped():
            blas.grouped_gemm_bf16(x, w, y, offsets, ROWS_PER_EXPERT)

        chunked = {}
        for chunk in CHUNKS:  # each expert's rows padded to whole chunks; one batch entry per chunk
            chunks = -(-counts // chunk)
            expert_of = np.repeat(np.arange(EXPERTS), chunks)
            x_chunked_host = np.zeros((int(chunks.sum()) * chunk, K), np.uint16)
            starts = np.concatenate([[0], np.cumsum(chunks)]) * chunk
            for e in range(EXPERTS):
                x_chunked_host[starts[e]:starts[e] + counts[e]] = x_host[offsets[e]:offsets[e + 1]]
            x_chunked = device.upload(x_chunked_host, "bench")
            y_chunked = device.empty((x_chunked_host.shape[0], ROWS_PER_EXPERT), np.uint16, "bench")
            chunked[chunk] = (expert_of, starts, x_chunked, y_chunked)

        def pointer_batched(chunk):  # the model's chunked layout (its host table write included)
            expert_of, _, x_chunked, y_chunked = chunked[chunk]
            blas.chunked_gemm_bf16(x_chunked, w, y_chunked, expert_of, chunk)

        def batched():  # the model's padded layout: every expert `padded` rows
            blas.batched_gemm_bf16(x_padded, w, y_padded, EXPERTS)

        row = {"rows": rows, "max_expert_rows": int(counts.max()), "padded_rows": padded,
               "padding_share": 1.0 - rows / (EXPERTS * padded), "flops": flops}
        calls = [("grouped", grouped, row["padding_share"]), ("padded batched", batched, row["padding_share"])]
        for chunk in CHUNKS:
            rows_chunked = chunked[chunk][2].shape[0]
            calls.append((f"chunks of {chunk}", lambda chunk=chunk: pointer_batched(chunk), 1.0 - rows / rows_chunked))
        for name, call, padding in calls:
            seconds = wall_seconds(call, device.synchronize, repeats=5)
            row[name] = {"seconds": seconds, "tflop_s": flops / seconds / 1e12, "padding_share": padding}
            print(f"{routing:8s} {name:15s} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:6.1f} TFLOP/s useful"
                  f"  (max {counts.max()} rows an expert, padding {padding:.0%})", flush=True)
        got_grouped = bf16_bits_to_f32(y.copy_to_host()).astype(np.float64)
        got_padded = bf16_bits_to_f32(y_padded.copy_to_host()).reshape(EXPERTS, padded, ROWS_PER_EXPERT)
        got_batched = np.concatenate([got_padded[e, :counts[e]] for e in range(EXPERTS)]).astype(np.float64)
        row["rel_batched_to_grouped"] = float(np.linalg.norm(got_batched - got_grouped) / np.linalg.norm(got_grouped))
        for chunk in CHUNKS:
            _, starts, _, y_chunked = chunked[chunk]
            got_all = bf16_bits_to_f32(y_chunked.copy_to_host())
            got = np.concatenate([got_all[starts[e]:starts[e] + counts[e]] for e in range(EXPERTS)]).astype(np.float64)
            row[f"rel_chunks_of_{chunk}_to_grouped"] = float(np.linalg.norm(got - got_grouped)
                                                             / np.linalg.norm(got_grouped))
        report["routings"][routing] = row
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "grouped_gemm_probe.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
