"""The tensor-core bf16 decode GEMM (`linear_mma`) against cuBLAS, launch by launch, at the real decode shapes.

Why: the whole-step bench (cuda_model.py --decode-linear mma) times the kernel inside a step; this one says which of
its geometries streams the weights fastest at each row count, beside cuBLAS unpadded (its GEMV at one row, what
decode would run without batch invariance) and padded to 32 rows (what serving runs for batch invariance).

Variants (`make_linear_bf16_mma_kernel`): warps a block, K blocks a warp step, x loaded a step ahead, weights
through non-allocating L1 loads. Each case is a CUDA graph of REPEATS launches replayed (median us a launch); GB/s
counts the weight bytes. Rows 1, 4, 8, 32.

Run on the GPU machine: `python bench/linear_mma.py [--quick]`; JSON to $OUT/linear_mma.json (bench/results without
OUT).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_report  # noqa: E402

REPEATS = 20
ROWS = (1, 4, 8, 32)
PAD_ROWS = 32
# (N, K) of the 27B's bf16 decode projections and its LM head
SHAPES = {"27b gdn in": (16384, 5120), "27b out": (5120, 6144), "27b gate|up": (34816, 5120),
          "27b down": (5120, 17408), "27b attention qkv": (14336, 5120), "27b attention out": (5120, 10240),
          "lm head": (248320, 5120)}
# (warps, unroll, x_ahead, streaming)
VARIANTS = [(8, 2, False, False), (8, 2, False, True), (8, 2, True, False), (8, 2, True, True), (8, 4, False, True),
            (4, 2, False, True), (4, 2, True, False), (16, 2, False, True)]


def main() -> None:
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.backends.cuda.timing import captured_repeats
    from ninfer.kernels_numba import linear_mma as LM
    from ninfer.kernels_numba.quant_mma import x_sets

    quick = "--quick" in sys.argv
    device = CudaDevice(0)
    blas = Blas(device)
    rng = np.random.default_rng(0)
    report = {"device": device.info.name, "repeats": REPEATS, "variants": VARIANTS, "cases": []}
    kernels = {}

    def micros(launch) -> float:
        graph, seconds = captured_repeats(device, launch, REPEATS, replays=10)
        graph.close()
        return round(seconds * 1e6, 2)

    shapes = dict(list(SHAPES.items())[:3]) if quick else SHAPES
    for name, (n, k) in shapes.items():
        w = device.upload(rng.integers(0x3C00, 0x3D00, (n, k), dtype=np.uint16), "bench")
        x = device.upload(rng.integers(0x3C00, 0x3D00, (PAD_ROWS, k), dtype=np.uint16), "bench")
        y = device.empty((PAD_ROWS, n), np.float32, "bench")
        stream = device.stream
        for rows in ROWS:
            row = {"shape": name, "n": n, "k": k, "rows": rows,
                   "cublas": micros(lambda: blas.gemm_bf16(x[:rows], w, y[:rows])),
                   "cublas_padded": micros(lambda: blas.gemm_bf16(x, w, y))}
            want = {}  # warps -> bits: the K split (and so the sums' order) depends on the warps alone
            for variant in VARIANTS:
                warps, unroll, x_ahead, streaming = variant
                sets = x_sets(rows)
                key = (sets, *variant)
                if key not in kernels:
                    kernels[key] = LM.make_linear_bf16_mma_kernel(sets, warps, unroll, x_ahead, streaming)
                fn = kernels[key]
                label = f"mma w{warps} u{unroll}{' xa' if x_ahead else ''}{' nc' if streaming else ''}"
                row[label] = micros(lambda: LM.linear_bf16_mma(x[:rows], w, y[:rows], stream=stream, _kernel=fn,
                                                                warps=warps, programmatic=True))
                got = want.setdefault(warps, y[:rows].copy_to_host())
                assert np.array_equal(y[:rows].copy_to_host(), got), (name, rows, variant)
            best = min((v, key) for key, v in row.items() if key.startswith("mma"))
            row["best"] = best[1]
            row["best_gb_s"] = round(n * k * 2 / best[0] / 1e3, 1)
            row["cublas_gb_s"] = round(n * k * 2 / row["cublas"] / 1e3, 1)
            report["cases"].append(row)
            print(f"{name:18s} {n:6d}x{k:5d} rows {rows:2d}  " + "  ".join(
                f"{key} {v}" for key, v in row.items() if key not in ("shape", "n", "k", "rows")), flush=True)
    write_report("linear_mma", report)


if __name__ == "__main__":
    main()
