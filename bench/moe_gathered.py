"""The gathered MoE expert GEMVs of quantized decode at the real 35B-A3B shapes: 256 experts, 8 slots a row;
gate_up [256 x 1024, 2048] (a row's slots share its x) and down [256 x 2048, 512] (an x per slot); Q4G64. The SIMT
kernel (`quant_linear.linear_quant_gathered`, fp32 x) against the tensor-core kernel
(`quant_mma.linear_quant_mma_gathered`, x fragments prepared once per x and timed apart), at 1 and 8 rows (decode
batch sizes), each launch captured 20 times in one graph. Reported: microseconds per launch, the bytes of the distinct
experts read per second as a ratio to the measured copy bandwidth, and each kernel's relative difference to its NumPy
twin. `--sweep` adds tensor-core geometries (tiles, warps, unroll, register cap), each timed with the expert ids
cycled over 16 sets (cold weights: one set's 8 experts stay in the L2 replay after replay): the down projection's K =
512 is only 8 blocks of 64 columns for the default 8 warps x unroll 2.

Run on the GPU machine: `python bench/moe_gathered.py [--sweep]`; JSON to $OUT/moe_gathered.json (bench/results
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
from ninfer.artifact import codec  # noqa: E402
from ninfer.artifact.formats import Q4G64  # noqa: E402

EXPERTS, SLOTS = 256, 8
PROJECTIONS = {"gate_up": (1024, 2048, False), "down": (2048, 512, True)}  # rows per expert, K, x per slot
# (tiles, warps, unroll, register cap), timed beside the default (4 warps, `gathered_unroll`; 1 x 8 x 2 until session
# 27): 8 warps capped at 64 registers hold 4 blocks an SM instead of 3 (Q4: 68 registers, no spill at 64 by ptxas
# sm_90), so the 35B-A3B's 512 gate|up blocks run in one wave
VARIANTS = [(1, 8, 2, None), (1, 8, 2, 64), (1, 4, 2, None), (1, 4, 1, None), (2, 4, 1, None), (1, 2, 2, None),
            (2, 2, 1, None)]
COLD_ID_SETS = 16  # expert sets the variants cycle through: 16 x 8 experts' weights outgrow the 50 MB L2
_VARIANT_KERNELS: dict = {}


def variant(bits: int, tiles: int, warps: int, unroll: int, max_registers: int | None):
    from ninfer.kernels_numba import quant_mma as QM

    key = (bits, tiles, warps, unroll, max_registers)
    if key not in _VARIANT_KERNELS:
        _VARIANT_KERNELS[key] = QM.make_quant_mma_gathered_kernel(bits, tiles, warps, unroll, max_registers)
    return _VARIANT_KERNELS[key]


def timed_cycled(device, launches) -> float:
    """`timed` over launches taken in turn (one a captured launch): each reads other experts than the one before."""
    turn = [0]

    def launch():
        launches[turn[0] % len(launches)]()
        turn[0] += 1
    return timed(device, launch)


def measure(device, bandwidth: float, fmt: str, name: str, rows_per_expert: int, K: int, x_per_slot: bool, rng, *,
            experts: int = EXPERTS, slots: int = SLOTS, batches=(1, 8), variants=()) -> list[dict]:
    """One projection: rows of results per batch size. `device` is a CudaDevice, or a HostDevice (its kernels are
    the NumPy twins: the CPU smoke test, without `variants`)."""
    from ninfer.kernels_numba import quant_mma as QM
    from ninfer.kernels_numba.linear import gathered_reference

    k, stream, rpe = device.kernels, device.stream, rows_per_expert
    shape = (experts * rpe, K)
    payload = random_payload(fmt, shape, rng)
    simt = k.upload_quant_weight(fmt, shape, payload, stream=stream)
    mma = k.upload_quant_mma(fmt, shape, payload, stream=stream)
    expert_bytes = payload.nbytes / experts
    fragments = k.x_slot_fragments if x_per_slot else k.x_fragments
    out = []
    for m in batches:
        ids = np.stack([rng.choice(experts, slots, replace=False) for _ in range(m)]).astype(np.int32)
        x = rng.standard_normal((m, slots, K) if x_per_slot else (m, K)).astype(np.float32)
        dx, dids = device.upload(x, "bench"), device.upload(ids, "bench")
        dxf = device.empty((slots if x_per_slot else 1) * QM.x_fragment_words(K), np.uint32, "bench")
        y = device.empty((m, slots, rpe), np.float32, "bench")
        nbytes = len(np.unique(ids)) * expert_bytes
        row = {"format": fmt, "projection": name, "rows": m, "distinct_experts": int(len(np.unique(ids)))}
        fragments(dx, dxf, stream=stream)
        row["x_fragments_us"] = timed(device, lambda: fragments(dx, dxf, stream=stream)) * 1e6
        launches = {
            "simt": lambda: k.linear_quant_gathered(dx, simt, dids, y, rows_per_expert=rpe, x_per_slot=x_per_slot,
                                                    stream=stream),
            "mma": lambda: k.linear_quant_mma_gathered(dxf, mma, dids, y, rows_per_expert=rpe,
                                                       x_per_slot=x_per_slot, stream=stream)}
        twins = {"simt": lambda: gathered_reference(x, codec.decode(payload, fmt, shape), ids, rows_per_expert=rpe,
                                                    x_per_slot=x_per_slot),
                 "mma": lambda: QM.linear_quant_mma_gathered_reference(x, fmt, shape, payload, ids,
                                                                       rows_per_expert=rpe, x_per_slot=x_per_slot)}
        for kernel, launch in launches.items():
            seconds = timed(device, launch)
            row[f"{kernel}_us"] = seconds * 1e6
            row[f"{kernel}_ratio_to_copy"] = nbytes / seconds / bandwidth
            launch()
            got, want = device.read(y).astype(np.float64), twins[kernel]().astype(np.float64)
            row[f"{kernel}_rel_to_twin"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        cold_ids = [device.upload(np.stack([rng.choice(experts, slots, replace=False) for _ in range(m)]).astype(
            np.int32), "bench") for _ in range(COLD_ID_SETS if variants else 0)]
        for tiles, warps, unroll, cap in variants:  # each on cold experts (id sets cycled)
            fn = variant(QM.FORMAT_BITS[fmt], tiles, warps, unroll, cap)
            seconds = timed_cycled(device, [lambda fn=fn, tiles=tiles, warps=warps, ids=ids: (
                QM.linear_quant_mma_gathered(dxf, mma, ids, y, rows_per_expert=rpe, x_per_slot=x_per_slot,
                                             stream=stream, _kernel=fn, tiles=tiles, warps=warps))
                for ids in cold_ids])
            row[f"mma_t{tiles}_w{warps}_u{unroll}{'' if cap is None else f'_r{cap}'}_us"] = seconds * 1e6
        out.append(row)
        print(f"{fmt} {name:8s} M={m} ({row['distinct_experts']} experts): simt {row['simt_us']:7.1f} us "
              f"({row['simt_ratio_to_copy']:.2f})  mma {row['mma_us']:7.1f} us ({row['mma_ratio_to_copy']:.2f})  "
              f"fragments {row['x_fragments_us']:.1f} us  rel simt {row['simt_rel_to_twin']:.1e} "
              f"mma {row['mma_rel_to_twin']:.1e}", flush=True)
        if variants:
            print("   variants " + "  ".join(f"{key[4:-3]} {value:.1f}" for key, value in row.items()
                                             if key.startswith("mma_t")), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time tensor-core geometries (tiles, warps, unroll)")
    args = parser.parse_args()
    from bench.cuda_model import copy_bandwidth
    from ninfer.backends.cuda.device import CudaDevice

    device = CudaDevice(0)
    bandwidth = copy_bandwidth(device)
    rng = np.random.default_rng(0)
    report = {"device": device.info.name, "copy_bandwidth_bytes_s": bandwidth, "rows": []}
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for name, (rpe, K, x_per_slot) in PROJECTIONS.items():
        report["rows"] += measure(device, bandwidth, Q4G64, name, rpe, K, x_per_slot, rng,
                                  variants=VARIANTS if args.sweep else ())
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "moe_gathered.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
