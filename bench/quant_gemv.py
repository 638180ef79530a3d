"""Q4G64 decode GEMV at the real 27B shapes: the SIMT kernel of `quant_linear` (fp32 x) against the tensor-core
kernel of `quant_mma` (bf16 x fragments, prepared once per x and timed apart), x rows 1/2/4/8, each launch captured 20 times in one graph. Reports microseconds per
launch, the weight bytes read per second, the ratio to the measured copy bandwidth and, at M = 1, the relative
difference of each kernel to its NumPy twin.

Run on the GPU machine: `python bench/quant_gemv.py`; JSON to $OUT/quant_gemv.json (bench/results without OUT).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.artifact.codec import f32_to_bf16_bits  # noqa: E402
from ninfer.artifact.formats import Q4G64, row_split_geometry  # noqa: E402

SHAPES = {"gate_up 34816x5120": (34816, 5120), "down 5120x17408": (5120, 17408), "query_key 7168x5120": (7168, 5120),
          "gdn out 5120x6144": (5120, 6144)}
REPEAT = 20
VARIANTS = [(1, 8, 2), (2, 4, 2), (2, 4, 4), (4, 4, 2), (4, 4, 1), (4, 8, 1), (2, 8, 2), (8, 4, 1)]
_VARIANT_KERNELS: dict = {}


def variant(tiles: int, warps: int, unroll: int):
    from ninfer.kernels_numba import quant_mma as QM

    if (tiles, warps, unroll) not in _VARIANT_KERNELS:
        _VARIANT_KERNELS[tiles, warps, unroll] = QM.make_q4_mma_kernel(tiles, warps, unroll)
    return _VARIANT_KERNELS[tiles, warps, unroll]


def random_q4_payload(shape: tuple[int, int], rng) -> np.ndarray:
    """A valid Q4G64 payload: random nibbles, positive binary16 scales (what the codec writes, without encoding)."""
    geometry = row_split_geometry(Q4G64, shape)
    payload = np.zeros(geometry.total_bytes, np.uint8)
    payload[: shape[0] * geometry.base_row_bytes] = rng.integers(0, 256, shape[0] * geometry.base_row_bytes,
                                                                 dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (shape[0], geometry.groups_per_row)).astype(np.float16)
    payload[geometry.scale_offset: geometry.total_bytes] = scales.view(np.uint8).reshape(-1)
    return payload


def timed(device, launch) -> float:
    from bench.kernel_profile import captured_repeats

    graph, seconds = captured_repeats(device, launch, REPEAT, replays=10)
    graph.close()
    return seconds


def eager_launches() -> None:
    """Each kernel launched twice, eagerly, at M = 1 on two shapes: the program `ncu` profiles (`--ncu`)."""
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.kernels_numba import quant_linear as Q
    from ninfer.kernels_numba import quant_mma as QM

    device = CudaDevice(0)
    stream, rng = device.stream, np.random.default_rng(0)
    for shape in (SHAPES["gate_up 34816x5120"], SHAPES["down 5120x17408"]):
        payload = random_q4_payload(shape, rng)
        simt = Q.upload_quant_weight(Q4G64, shape, payload, stream=stream)
        mma = QM.upload_q4_mma(shape, payload, stream=stream)
        dx = device.upload(rng.standard_normal((1, shape[1])).astype(np.float32), "bench")
        dxf = device.empty(QM.x_fragment_words(shape[1]), np.uint32, "bench")
        y = device.empty((1, shape[0]), np.float32, "bench")
        for _ in range(2):
            Q.linear_quant(dx, simt, y, stream=stream)
            QM.x_fragments(dx, dxf, stream=stream)
            QM.linear_q4_mma(dxf, mma, y, stream=stream)
            QM.linear_q4_mma(dxf, mma, y, stream=stream, _kernel=variant(4, 4, 2), tiles=4, warps=4)
        device.synchronize()


def main() -> None:
    if "--ncu" in sys.argv:
        eager_launches()
        return
    from bench.cuda_model import copy_bandwidth
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.kernels_numba import quant_linear as Q
    from ninfer.kernels_numba import quant_mma as QM

    device = CudaDevice(0)
    stream = device.stream
    bandwidth = copy_bandwidth(device)
    rng = np.random.default_rng(0)
    report = {"device": device.info.name, "copy_bandwidth_bytes_s": bandwidth, "rows": []}
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for name, shape in SHAPES.items():
        payload = random_q4_payload(shape, rng)
        simt = Q.upload_quant_weight(Q4G64, shape, payload, stream=stream)
        mma = QM.upload_q4_mma(shape, payload, stream=stream)
        x = rng.standard_normal((8, shape[1])).astype(np.float32)
        x_bf16 = f32_to_bf16_bits(x)
        dx = device.upload(x, "bench")
        dxf = device.empty(QM.x_fragment_words(shape[1]), np.uint32, "bench")
        y = device.empty((8, shape[0]), np.float32, "bench")
        for m in (1, 2, 4, 8):
            row = {"matrix": name, "rows": m}
            QM.x_fragments(dx[:m], dxf, stream=stream)  # once per x, shared by the layers that read it
            row["x_fragments_us"] = timed(device, lambda m=m: QM.x_fragments(dx[:m], dxf, stream=stream)) * 1e6
            for kernel, weight, launch in (
                    ("simt", simt, lambda m=m: Q.linear_quant(dx[:m], simt, y[:m], stream=stream)),
                    ("mma", mma, lambda m=m: QM.linear_q4_mma(dxf, mma, y[:m], stream=stream))):
                seconds = timed(device, launch)
                row[f"{kernel}_us"] = seconds * 1e6
                row[f"{kernel}_ratio_to_copy"] = weight.nbytes / seconds / bandwidth
                if m == 1:
                    launch()
                    got = device.read(y[:1]).astype(np.float64)
                    want = (Q.linear_quant_reference(x[:1], Q4G64, shape, payload) if kernel == "simt" else
                            QM.linear_q4_mma_reference(x_bf16[:1], shape, payload))
                    row[f"{kernel}_rel_to_twin"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            if name in ("gate_up 34816x5120", "down 5120x17408") and m in (1, 8):
                for tiles, warps, unroll in VARIANTS:  # geometry search for the tensor-core kernel
                    fn = variant(tiles, warps, unroll)
                    seconds = timed(device, lambda m=m, fn=fn, tiles=tiles, warps=warps: QM.linear_q4_mma(
                        dxf, mma, y[:m], stream=stream, _kernel=fn, tiles=tiles, warps=warps))
                    row[f"mma_t{tiles}_w{warps}_u{unroll}_us"] = seconds * 1e6
                print("   variants " + "  ".join(f"{k[4:-3]} {v:.1f}" for k, v in row.items()
                                                 if k.startswith("mma_t")), flush=True)
            report["rows"].append(row)
            print(f"{name:22s} M={m}: simt {row['simt_us']:7.1f} us ({row['simt_ratio_to_copy']:.2f})  "
                  f"mma {row['mma_us']:7.1f} us ({row['mma_ratio_to_copy']:.2f})"
                  + (f"  rel simt {row['simt_rel_to_twin']:.1e} mma {row['mma_rel_to_twin']:.1e}" if m == 1 else ""),
                  flush=True)
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "quant_gemv.json"
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
