"""The routed expert GEMMs of a ninfer-v2 MoE prefill chunk at the real 35B-A3B shapes (256 experts, top-8; gate|up
Q4 [256 x 1024, 2048] stored for SwiGLU, down Q5 [256 x 2048, 512]), a layer's worth: straight from the codes
(`quant_mma_chunked`, Capacity.direct_quant_experts) against the path it replaces (each matrix dequantized to bf16,
then the chunked pointer-array cuBLAS GEMMs with the silu-mul between them), and that path's parts (the two
dequantizations alone; the GEMMs and silu-mul alone, on weights already dequantized). Chunks of 1024 rows in the
sync-free layout (32-row chunks at their most count, as the server's default prefill chunk runs) and of 8192 rows
(the bench's one-chunk 8K prompt: 128-row chunks, the counts read back), rows routed uniformly at random. Each path
is captured REPEAT times in one graph and replayed: ms per layer. Also the direct output's relative difference to the
dequantizing path's (the activation is rounded to bf16 once from fp32 there, from bf16 gate and up here), and
register-capped variants of the direct kernel (`--caps`: 80 registers hold 3 blocks an SM instead of 2, with spills).

Run on the GPU machine: `python bench/moe_chunked.py [--caps 80]`; JSON to $OUT/moe_chunked.json (bench/results
without OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quant_gemv import random_payload, timed  # noqa: E402
from ninfer.artifact.formats import Q4G64, Q5G64  # noqa: E402

EXPERTS, SLOTS, HIDDEN, INTER = 256, 8, 2048, 512
# (rows of the prefill chunk, rows a chunk of the layout, sync-free: the layout's most chunks for the rows)
CASES = [(1024, 32, True), (8192, 128, False)]


def routed_layout(rng, rows: int, chunk: int, sync_free: bool, *, experts: int, slots: int) -> dict:
    """Host-side maps of the chunked layout for `rows` rows routed to `slots` distinct random experts each."""
    from ninfer.kernels_numba import moe

    ids = np.argsort(rng.random((rows, experts)), axis=1)[:, :slots]
    counts = np.bincount(ids.reshape(-1), minlength=experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    info, starts = moe.moe_layout_reference(offsets, choice="chunked", chunk=chunk, room=1 << 24,
                                            max_chunks=1 << 20)
    real = int(info[2])
    chunks = (rows * slots + experts * (chunk - 1)) // chunk if sync_free else real
    groups = np.full(chunks, experts - 1, np.int32)
    for e, (start, count) in enumerate(zip(starts.tolist(), counts.tolist())):
        groups[start // chunk:start // chunk + -(-count // chunk)] = e
    return dict(offsets=offsets, starts=starts.astype(np.int32), groups=groups, chunks=chunks, real_chunks=real)


def measure(device, rng, *, cases=CASES, experts: int = EXPERTS, slots: int = SLOTS, hidden: int = HIDDEN,
            inter: int = INTER, caps: tuple[int, ...] = ()) -> list[dict]:
    """One row per case. `device` is a CudaDevice, or a HostDevice (its kernels are the NumPy twins: the CPU smoke
    test at a small shape, without `caps`)."""
    from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
    from ninfer.kernels_numba import quant_mma_chunked as QC

    k, stream, blas = device.kernels, device.stream, device.blas()
    gate_up_shape, down_shape = (experts * 2 * inter, hidden), (experts * hidden, inter)
    gate_up = k.upload_quant_mma(Q4G64, gate_up_shape, random_payload(Q4G64, gate_up_shape, rng), stream=stream,
                                 swiglu_rows=2 * inter)
    down = k.upload_quant_mma(Q5G64, down_shape, random_payload(Q5G64, down_shape, rng), stream=stream)
    gate_up_bf16 = device.empty(gate_up_shape, np.uint16, "bench")
    down_bf16 = device.empty(down_shape, np.uint16, "bench")
    variants = {cap: (QC.make_quant_mma_chunked_kernel(4, cap), QC.make_quant_mma_chunked_kernel(5, cap))
                for cap in caps}
    rows_out = []
    for rows, chunk, sync_free in cases:
        layout = routed_layout(rng, rows, chunk, sync_free, experts=experts, slots=slots)
        chunks = layout["chunks"]
        room = chunks * chunk
        x = device.upload(f32_to_bf16_bits(rng.standard_normal((room, hidden)).astype(np.float32)), "bench")
        groups, offsets, starts = (device.upload(layout[name], "bench") for name in ("groups", "offsets", "starts"))
        act, out, gate_up_out, act_ref, out_ref = (
            device.zeros((room, width), np.uint16, "bench") for width in (inter, hidden, 2 * inter, inter, hidden))
        sizes = dict(chunk=chunk, chunks=chunks, stream=stream)

        def direct(kernels=(None, None)):
            """Both projections; `kernels`: register-capped variants (the serving kernels where None)."""
            for source, weight, target, rpe, swiglu, variant in ((x, gate_up, act, 2 * inter, True, kernels[0]),
                                                                 (act, down, out, hidden, False, kernels[1])):
                if variant is None:
                    k.linear_quant_mma_chunked(source, weight, groups, offsets, starts, target, rows_per_expert=rpe,
                                               swiglu=swiglu, **sizes)
                else:
                    QC.linear_quant_mma_chunked(source, weight, groups, offsets, starts, target, rows_per_expert=rpe,
                                                swiglu=swiglu, **sizes, _kernel=variant)

        def dequantize():
            k.dequantize_mma_bf16(gate_up, gate_up_bf16, stream=stream)
            k.dequantize_mma_bf16(down, down_bf16, stream=stream)

        def gemms():
            blas.chunked_gemm_bf16(x, gate_up_bf16, gate_up_out, groups, chunk, chunks=chunks)
            k.silu_mul_bf16_rows(gate_up_out, act_ref, stream=stream)
            blas.chunked_gemm_bf16(act_ref, down_bf16, out_ref, groups, chunk, chunks=chunks)

        def dequantizing():
            dequantize()
            gemms()

        times = {"direct": timed(device, direct), "dequantizing": timed(device, dequantizing),
                 "dequantize_only": timed(device, dequantize), "gemms_only": timed(device, gemms)}
        for cap, kernels in variants.items():
            times[f"direct_cap{cap}"] = timed(device, lambda kernels=kernels: direct(kernels))
        direct()
        dequantizing()
        device.synchronize()
        routed = np.zeros(room, bool)
        counts = np.diff(layout["offsets"])
        for e, start in enumerate(layout["starts"].tolist()):
            routed[start:start + counts[e]] = True
        got = bf16_bits_to_f32(device.read(out)[routed]).astype(np.float64)
        want = bf16_bits_to_f32(device.read(out_ref)[routed]).astype(np.float64)
        row = {"rows": rows, "chunk": chunk, "sync_free": sync_free, "chunks": chunks,
               "real_chunks": layout["real_chunks"], "ms": {name: t * 1e3 for name, t in times.items()},
               "relative_difference": float(np.linalg.norm(got - want) / np.linalg.norm(want))}
        rows_out.append(row)
        print(f"{rows} rows, chunks of {chunk} ({chunks} launched, {layout['real_chunks']} with rows): "
              + ", ".join(f"{name} {t:.3f} ms" for name, t in row["ms"].items())
              + f"; direct vs dequantizing {row['relative_difference']:.2e}", flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", default="", help="register caps of direct-kernel variants to time (e.g. 80,96)")
    args = parser.parse_args()
    from ninfer.backends.cuda.device import CudaDevice

    device = CudaDevice(0)
    report = {"device": device.info.name,
              "cases": measure(device, np.random.default_rng(0), caps=tuple(int(c) for c in args.caps.split(",") if c))}
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "moe_chunked.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
