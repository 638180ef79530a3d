"""Quantized decode GEMV at the real 27B shapes, per ninfer-v2 format (Q4/Q5/Q6 G64, W8 G32): the SIMT kernel of
`quant_linear` (fp32 x) against the tensor-core kernel of `quant_mma` (bf16 x fragments, prepared once per x and
timed apart), x rows 1/2/4/8, each launch captured 20 times in one graph. Reports microseconds per launch, the
weight bytes read per second, the ratio to the measured copy bandwidth and, at M = 1, the relative difference of
each kernel to its NumPy twin. A geometry sweep of the Q4 kernel runs on every shape.

Run on the GPU machine: `python bench/quant_gemv.py [--sweep-only]`; JSON to $OUT/quant_gemv.json (bench/results
without OUT). `--small`: block geometries on the small projections (35B-A3B W8, 27B split Q4/Q5) at M = 1, JSON to
quant_gemv_small.json. `--strides`: the Q4 kernel at M = 1 as K steps a block at a time around the down and gate_up
shapes (does bandwidth follow the row tiles' stride?), JSON to quant_gemv_strides.json. `--tiles`: the Q4 kernel at M
= 1, K = 17408, over row-tile counts around multiples of the SM count, then on the 27B shapes, JSON to
quant_gemv_tiles.json. `--dequantize`: the v2 prefill's expert dequantization (`dequantize_mma_bf16`) at the
35B-A3B's stacked expert shapes, JSON to dequantize_mma.json. (Session 14 timed the kernels with each step's codes
loaded during the step before against the former ones, matrix copies cycled:
results/quant_gemv_prefetch_session14.json.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_report  # noqa: E402
from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32, row_split_geometry  # noqa: E402

SHAPES = {"gate_up 34816x5120": (34816, 5120), "down 5120x17408": (5120, 17408), "query_key 7168x5120": (7168, 5120),
          "gdn out 5120x6144": (5120, 6144)}
REPEAT = 20
# (tiles, warps, unroll): more warps per tile or more blocks per warp step keep more bytes in flight on the
# matrices with few row tiles (5,120 rows: 320 tiles)
VARIANTS = [(1, 8, 2), (1, 4, 2), (1, 16, 2), (1, 16, 1), (1, 8, 4), (1, 32, 1), (2, 8, 2)]
_VARIANT_KERNELS: dict = {}
WIDE_SETS = 4  # x-fragment sets of the widest kernel timed (M = 32)


def wide_kernel(bits: int, sets: int):
    from ninfer.kernels_numba import quant_mma as QM

    if ("wide", bits, sets) not in _VARIANT_KERNELS:
        _VARIANT_KERNELS["wide", bits, sets] = QM.make_quant_mma_kernel(bits, sets=sets)
    return _VARIANT_KERNELS["wide", bits, sets]


def variant(tiles: int, warps: int, unroll: int):
    from ninfer.kernels_numba import quant_mma as QM

    key = (tiles, warps, unroll)
    if key not in _VARIANT_KERNELS:
        _VARIANT_KERNELS[key] = QM.make_quant_mma_kernel(4, tiles, warps, unroll)
    return _VARIANT_KERNELS[key]


def random_payload(fmt: str, shape: tuple[int, int], rng) -> np.ndarray:
    """A valid payload: random code planes, positive binary16 scales (what the codec writes, without encoding)."""
    geometry = row_split_geometry(fmt, shape)
    payload = rng.integers(0, 256, geometry.total_bytes, dtype=np.uint8)
    if fmt == W8G32:
        payload[payload == 0x80] = 0x81  # W8 forbids the code -128
    scales = rng.uniform(1e-3, 1e-2, (shape[0], geometry.groups_per_row)).astype(np.float16)
    payload[geometry.scale_offset: geometry.total_bytes] = scales.view(np.uint8).reshape(-1)
    return payload


def timed(device, launch) -> float:
    from ninfer.backends.cuda.timing import captured_repeats

    graph, seconds = captured_repeats(device, launch, REPEAT, replays=10)
    graph.close()
    return seconds


def eager_launches() -> None:
    """Each Q4 kernel launched twice, eagerly, at M = 1 on two shapes: the program `ncu` profiles (`--ncu`)."""
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.kernels_numba import quant_linear as Q
    from ninfer.kernels_numba import quant_mma as QM

    device = CudaDevice(0)
    stream, rng = device.stream, np.random.default_rng(0)
    for shape in (SHAPES["gate_up 34816x5120"], SHAPES["down 5120x17408"]):
        payload = random_payload(Q4G64, shape, rng)
        simt = Q.upload_quant_weight(Q4G64, shape, payload, stream=stream)
        mma = QM.upload_quant_mma(Q4G64, shape, payload, stream=stream)
        dx = device.upload(rng.standard_normal((1, shape[1])).astype(np.float32), "bench")
        dxf = device.empty(QM.x_fragment_words(shape[1]), np.uint32, "bench")
        y = device.empty((1, shape[0]), np.float32, "bench")
        for _ in range(2):
            Q.linear_quant(dx, simt, y, stream=stream)
            QM.x_fragments(dx, dxf, stream=stream)
            QM.linear_quant_mma(dxf, mma, y, stream=stream)
        device.synchronize()


def wide_rows(device, bandwidth, fmt: str, name: str, mma, dx, dxf, y) -> list[dict]:
    """M = 16 and 32 x rows: one launch per 8 rows (the one-set kernel, what ROW_SETS = 1 runs) against one launch
    of the kernel over 2 or 4 fragment sets, whose rows must hold the same bits."""
    from ninfer.kernels_numba import quant_mma as QM

    out = []
    for m in (16, 32):
        sets = m // 8
        fn = wide_kernel(QM.FORMAT_BITS[fmt], sets)
        QM.x_fragments(dx[:m], dxf, stream=device.stream)

        set_words = QM.x_fragment_words(dx.shape[1])

        def per_set(m=m):
            for first in range(0, m, 8):
                QM.linear_quant_mma(dxf[first // 8 * set_words:], mma, y[first:first + 8], stream=device.stream)

        def wide(m=m, fn=fn, sets=sets):
            QM.linear_quant_mma(dxf, mma, y[:m], stream=device.stream, _kernel=fn, sets=sets)

        row = {"format": fmt, "matrix": name, "rows": m, "per_set_launches_us": timed(device, per_set) * 1e6,
               "wide_us": timed(device, wide) * 1e6}
        per_set()
        narrow_y = device.read(y[:m])
        wide()
        row["wide_bitwise_per_set"] = bool(np.array_equal(device.read(y[:m]), narrow_y))
        row["wide_ratio_to_copy"] = mma.nbytes / (row["wide_us"] * 1e-6) / bandwidth
        print(f"{fmt} {name:22s} M={m}: {sets} one-set launches {row['per_set_launches_us']:7.1f} us, one launch of "
              f"{sets} sets {row['wide_us']:7.1f} us ({row['wide_ratio_to_copy']:.2f})"
              + ("" if row["wide_bitwise_per_set"] else "  (ROWS DIFFER FROM ONE-SET LAUNCHES)"), flush=True)
        out.append(row)
    return out


def measure(device, stream, bandwidth, fmt: str, name: str, shape, rng, *, sweep: bool) -> list[dict]:
    from ninfer.kernels_numba import quant_linear as Q
    from ninfer.kernels_numba import quant_mma as QM

    payload = random_payload(fmt, shape, rng)
    simt = Q.upload_quant_weight(fmt, shape, payload, stream=stream)
    mma = QM.upload_quant_mma(fmt, shape, payload, stream=stream)
    x = rng.standard_normal((8 * WIDE_SETS, shape[1])).astype(np.float32)
    dx = device.upload(x, "bench")
    dxf = device.empty(WIDE_SETS * QM.x_fragment_words(shape[1]), np.uint32, "bench")
    y = device.empty((8 * WIDE_SETS, shape[0]), np.float32, "bench")
    rows = []
    for m in (1, 2, 4, 8):
        row = {"format": fmt, "matrix": name, "rows": m}
        QM.x_fragments(dx[:m], dxf, stream=stream)  # once per x, shared by the layers that read it
        row["x_fragments_us"] = timed(device, lambda m=m: QM.x_fragments(dx[:m], dxf, stream=stream)) * 1e6
        for kernel, weight, launch in (
                ("simt", simt, lambda m=m: Q.linear_quant(dx[:m], simt, y[:m], stream=stream)),
                ("mma", mma, lambda m=m: QM.linear_quant_mma(dxf, mma, y[:m], stream=stream))):
            seconds = timed(device, launch)
            row[f"{kernel}_us"] = seconds * 1e6
            row[f"{kernel}_ratio_to_copy"] = weight.nbytes / seconds / bandwidth
            if m == 1:
                launch()
                got = device.read(y[:1]).astype(np.float64)
                want = (Q.linear_quant_reference(x[:1], fmt, shape, payload) if kernel == "simt" else
                        QM.linear_quant_mma_reference(x[:1], fmt, shape, payload))
                row[f"{kernel}_rel_to_twin"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        if sweep and m in (1, 8):
            QM.linear_quant_mma(dxf, mma, y[:m], stream=stream)
            default_y = device.read(y[:m])
            for tiles, warps, unroll in VARIANTS:  # geometry search for the tensor-core kernel
                fn = variant(tiles, warps, unroll)

                def launch_variant(m=m, fn=fn, tiles=tiles, warps=warps):
                    QM.linear_quant_mma(dxf, mma, y[:m], stream=stream, _kernel=fn, tiles=tiles, warps=warps)

                label = f"mma_t{tiles}_w{warps}_u{unroll}"
                row[f"{label}_us"] = timed(device, launch_variant) * 1e6
                if warps == QM.WARPS:  # the same warps sum the same blocks in the same order: the same bits
                    launch_variant()
                    row[f"{label}_bitwise_default"] = bool(np.array_equal(device.read(y[:m]), default_y))
            print("   variants " + "  ".join(f"{k[4:-3]} {v:.1f}" for k, v in row.items()
                                           if k.startswith("mma_t") and k.endswith("_us"))
                  + ("" if all(v for k, v in row.items() if k.endswith("_bitwise_default"))
                     else "  (A VARIANT WITH THE DEFAULT'S WARPS GAVE OTHER BITS)"), flush=True)
        rows.append(row)
        print(f"{fmt} {name:22s} M={m}: simt {row['simt_us']:7.1f} us ({row['simt_ratio_to_copy']:.2f})  "
              f"mma {row['mma_us']:7.1f} us ({row['mma_ratio_to_copy']:.2f})"
              + (f"  rel simt {row['simt_rel_to_twin']:.1e} mma {row['mma_rel_to_twin']:.1e}" if m == 1 else ""),
              flush=True)
    if sweep:
        rows += wide_rows(device, bandwidth, fmt, name, mma, dx, dxf, y)
    return rows


def stride_sweep(device, bandwidth, rng) -> list[dict]:
    """The Q4 tensor-core GEMV at M = 1 on the down and gate_up shapes with K stepped by one 64-column block either
    side: a row tile's bytes (its concurrent warps' stride apart) change by 512 bytes a step. Bandwidth that swings
    with K, not with bytes, would say the 320 concurrent tile streams meet in DRAM channels or banks (the suspect for
    the 320-tile shapes' 0.5 of copy bandwidth), and that the layout, not the kernel, is the lever."""
    from ninfer.kernels_numba import quant_mma as QM

    rows = []
    for name, (n, k0) in (("down", SHAPES["down 5120x17408"]), ("gate_up", SHAPES["gate_up 34816x5120"])):
        for k in [k0 + 64 * step for step in range(-4, 5)]:
            shape = (n, k)
            mma = QM.upload_quant_mma(Q4G64, shape, random_payload(Q4G64, shape, rng), stream=device.stream)
            dx = device.upload(rng.standard_normal((1, k)).astype(np.float32), "bench")
            dxf = device.empty(QM.x_fragment_words(k), np.uint32, "bench")
            y = device.empty((1, n), np.float32, "bench")
            QM.x_fragments(dx, dxf, stream=device.stream)
            seconds = timed(device, lambda: QM.linear_quant_mma(dxf, mma, y, stream=device.stream))
            row = {"format": Q4G64, "matrix": name, "shape": [n, k], "tile_bytes": mma.nbytes // (n // 16),
                   "mma_us": seconds * 1e6, "mma_ratio_to_copy": mma.nbytes / seconds / bandwidth}
            rows.append(row)
            print(f"{name:8s} {n}x{k}: {row['mma_us']:6.1f} us  {row['mma_ratio_to_copy']:.3f} of copy  "
                  f"(tile {row['tile_bytes']} bytes)", flush=True)
    return rows


TILE_COUNTS = (132, 200, 263, 264, 265, 300, 320, 330, 396, 397, 462, 528, 529)


def tile_sweep(device, bandwidth, rng) -> list[dict]:
    """The Q4 tensor-core GEMV at M = 1, K = 17408 (the 27B down projection) over row-tile counts around multiples
    of the H200's 132 SMs, then on the 27B shapes. A block (one tile, 8 warps, 64 registers a thread) is resident 4
    to an SM, so every count here runs in one wave. Time that steps at 132, 264, 396, 528 tiles (the most blocks any
    SM holds) rather than growing with the bytes would say a block's own duration, not DRAM, sets the 320-tile
    shapes' ~0.5 of copy bandwidth. On the H200 (results/quant_gemv_tiles_session13.json) it jumps past 264 and 528
    tiles (13.7 -> 16.1 us, 26.2 -> 39.9) but grows with the bytes in between; a K-split kernel (each tile's K over
    2 or 4 shorter blocks, spread evenly) gained nothing at the 320-tile down projection (21.9 us plain, 21.3 /
    21.5 split 2 / 4) and lost on the other 27B shapes, and was removed. So was a stream-K kernel (every block an
    equal run of the (tile, K block) steps, split tiles summed by the last block to arrive): slower at every count
    but 264 and 396 tiles, down 22.9 us at 3 blocks an SM against 21.5 (results/quant_gemv_tiles_session14.json)."""
    from ninfer.kernels_numba import quant_mma as QM

    rows = []
    shapes = [(f"down-like {16 * tiles}x17408", (16 * tiles, 17408)) for tiles in TILE_COUNTS] + list(SHAPES.items())
    for name, shape in shapes:
        n, k = shape
        mma = QM.upload_quant_mma(Q4G64, shape, random_payload(Q4G64, shape, rng), stream=device.stream)
        dx = device.upload(rng.standard_normal((1, k)).astype(np.float32), "bench")
        dxf = device.empty(QM.x_fragment_words(k), np.uint32, "bench")
        QM.x_fragments(dx, dxf, stream=device.stream)
        y = device.empty((1, n), np.float32, "bench")
        seconds = timed(device, lambda: QM.linear_quant_mma(dxf, mma, y, stream=device.stream))
        row = {"format": Q4G64, "matrix": name, "shape": list(shape), "tiles": -(-n // 16), "mma_us": seconds * 1e6,
               "mma_ratio_to_copy": mma.nbytes / seconds / bandwidth}
        rows.append(row)
        print(f"{name:26s} tiles {row['tiles']:4d}: {row['mma_us']:6.1f} us  {row['mma_ratio_to_copy']:.3f} of copy",
              flush=True)
    return rows


# The 35B-A3B ninfer-v2 projections outside the experts (all W8G32) and the 27B split ones: small grids, where the
# block geometry decides how much of the GPU a launch keeps busy.
SMALL_SHAPES = {"35b gdn in_proj 12288x2048": (W8G32, (12288, 2048)),
                "35b attn in_proj 9216x2048": (W8G32, (9216, 2048)), "35b output 2048x4096": (W8G32, (2048, 4096)),
                "35b shared gate_up 1024x2048": (W8G32, (1024, 2048)),
                "35b shared down 2048x512": (W8G32, (2048, 512)), "27b gdn query_key 4096x5120": (Q4G64, (4096, 5120)),
                "27b gdn value_z 12288x5120": (Q5G64, (12288, 5120)), "27b gdn output 5120x6144": (Q5G64, (5120, 6144))}
SMALL_GEOMETRIES = [(8, 2), (4, 2), (16, 2), (16, 1), (32, 1), (8, 1)]  # (warps, unroll), one tile per block


def small_sweep(device, bandwidth, rng) -> list[dict]:
    """M = 1 on the small projections: microseconds per launch for each (warps, unroll), the ratio to the copy
    bandwidth, and the relative difference of each geometry to the NumPy twin (other warps sum in another order)."""
    from ninfer.kernels_numba import quant_mma as QM

    rows = []
    for name, (fmt, shape) in SMALL_SHAPES.items():
        payload = random_payload(fmt, shape, rng)
        mma = QM.upload_quant_mma(fmt, shape, payload, stream=device.stream)
        x = rng.standard_normal((1, shape[1])).astype(np.float32)
        dxf = device.empty(QM.x_fragment_words(shape[1]), np.uint32, "bench")
        QM.x_fragments(device.upload(x, "bench"), dxf, stream=device.stream)
        y = device.empty((1, shape[0]), np.float32, "bench")
        want = QM.linear_quant_mma_reference(x, fmt, shape, payload).astype(np.float64)
        row = {"format": fmt, "matrix": name, "rows": 1}
        for warps, unroll in SMALL_GEOMETRIES:
            key = ("small", QM.FORMAT_BITS[fmt], warps, unroll)
            if key not in _VARIANT_KERNELS:
                _VARIANT_KERNELS[key] = QM.make_quant_mma_kernel(QM.FORMAT_BITS[fmt], 1, warps, unroll)
            fn = _VARIANT_KERNELS[key]

            def launch(fn=fn, warps=warps):
                QM.linear_quant_mma(dxf, mma, y, stream=device.stream, _kernel=fn, tiles=1, warps=warps)

            seconds = timed(device, launch)
            launch()
            got = device.read(y).astype(np.float64)
            label = f"w{warps}_u{unroll}"
            row[f"{label}_us"] = seconds * 1e6
            row[f"{label}_ratio_to_copy"] = mma.nbytes / seconds / bandwidth
            row[f"{label}_rel_to_twin"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        rows.append(row)
        print(f"{fmt} {name:30s} " + "  ".join(f"{label[:-3]} {value:5.1f}" for label, value in row.items()
                                               if label.endswith("_us"))
              + f"  (rel {max(v for k, v in row.items() if k.endswith('_rel_to_twin')):.1e})", flush=True)
    return rows


# (matrices stacked, rows each, K): the 35B-A3B's 256 routed experts (the prefill dequantizes each stacked matrix
# whole), then single projections, where `dequantize_parts` splits a tile's blocks across warps
DEQUANTIZE_SHAPES = {"gate_up 256 x 1024x2048": (256, 1024, 2048), "down 256 x 2048x512": (256, 2048, 512),
                     "35B gdn out 2048x4096": (1, 2048, 4096), "27B down 5120x17408": (5, 1024, 17408),
                     "27B gate_up 34816x5120": (34, 1024, 5120)}


DEQUANTIZE_BLOCK_THREADS = (128, 64)  # block sizes timed beside the default (more blocks, more warps an SM)


def dequantize_variant(bits: int, threads: int):
    from ninfer.kernels_numba import quant_mma as QM

    if threads == QM.DEQUANTIZE_THREADS:
        return QM.DEQUANTIZE_MMA_KERNELS[bits]
    key = "dequantize", bits, threads
    if key not in _VARIANT_KERNELS:
        _VARIANT_KERNELS[key] = QM.make_dequantize_mma_kernel(bits, threads)
    return _VARIANT_KERNELS[key]


def dequantize_rates(device, bandwidth, rng) -> list[dict]:
    """The v2 prefill's dequantization (`dequantize_mma_bf16`) at the 35B-A3B's stacked expert shapes and at single
    projections, each format (`--formats=A,B`), with the parts `dequantize_parts` picks and with 1, 2 and 4 parts
    (`--parts=1,2,4`), and with `--block-threads` at the chosen parts in smaller blocks (`DEQUANTIZE_BLOCK_THREADS`,
    no gain on the H200, session 26): microseconds, GB/s of planes read plus bf16 written, the ratio to copy. One
    matrix's planes are repacked on the host and repeated (tile-major planes stack by concatenation); the first and
    last matrices' rows are checked against the codec's values."""
    from ninfer.kernels_numba import quant_mma as QM
    from ninfer.kernels_numba.quant_linear import dequantize_bf16_reference

    options = dict(a.split("=", 1) for a in sys.argv if a.startswith("--") and "=" in a)
    parts_timed = [int(p) for p in options.get("--parts", "1,2,4").split(",")]
    formats = options.get("--formats", ",".join((Q4G64, Q5G64, Q6G64, W8G32))).split(",")
    block_threads = DEQUANTIZE_BLOCK_THREADS if "--block-threads" in sys.argv else ()
    rows = []
    for name, (stacked, rpe, k) in DEQUANTIZE_SHAPES.items():
        for fmt in formats:
            payload = random_payload(fmt, (rpe, k), rng)
            one = QM.repack_quant_mma(fmt, (rpe, k), payload)
            planes = {n: v if n == "high" and fmt == Q4G64 else np.tile(v, stacked) for n, v in one.items()}
            shape = (stacked * rpe, k)
            weight = QM.upload_quant_mma_planes(fmt, shape, planes, stream=device.stream)
            out = device.empty(shape, np.uint16, "bench")
            want = dequantize_bf16_reference(fmt, (rpe, k), payload)
            moved = sum(v.nbytes for v in planes.values()) + out.nbytes
            blank = np.zeros((rpe, k), np.uint16)  # the checked rows cleared, so each setting's bits are its own
            chosen = QM.dequantize_parts(-(-shape[0] // QM.TILE_ROWS), weight.blocks)
            settings = [(parts, QM.DEQUANTIZE_THREADS) for parts in
                        sorted(({chosen} | set(parts_timed)) & set(range(1, weight.blocks + 1)), reverse=True)]
            for parts, threads in settings + [(chosen, t) for t in block_threads]:
                def launch(parts=parts, threads=threads):
                    QM.dequantize_mma_bf16(weight, out, stream=device.stream, parts=parts, threads=threads,
                                           _kernel=dequantize_variant(QM.FORMAT_BITS[fmt], threads))

                device.synchronize()
                out[:rpe].copy_to_device(blank)
                out[shape[0] - rpe:].copy_to_device(blank)
                seconds = timed(device, launch)
                device.synchronize()
                ends = (out[:rpe].copy_to_host(), out[shape[0] - rpe:].copy_to_host())
                exact = all(np.array_equal(end, want) for end in ends)
                rows.append({"kernel": "dequantize_mma", "shape": name, "fmt": fmt, "parts": parts,
                             "threads": threads, "us": seconds * 1e6, "gb_s": moved / seconds / 1e9,
                             "of_copy": moved / seconds / bandwidth, "exact": exact})
                print(f"dequantize_mma {name:24s} {fmt:10s} parts {parts:3d} threads {threads:3d}: "
                      f"{seconds * 1e6:8.1f} us {moved / seconds / 1e9:7.0f} GB/s  {moved / seconds / bandwidth:.2f} "
                      f"of copy  exact {exact}", flush=True)
            weight = out = None
    return rows


def main() -> None:
    if "--ncu" in sys.argv:
        eager_launches()
        return
    from bench.cuda_model import copy_bandwidth
    from ninfer.backends.cuda.device import CudaDevice

    device = CudaDevice(0)
    bandwidth = copy_bandwidth(device)
    rng = np.random.default_rng(0)
    report = {"device": device.info.name, "copy_bandwidth_bytes_s": bandwidth, "rows": []}
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    if "--strides" in sys.argv:  # does the Q4 GEMV's bandwidth depend on its row tiles' stride?
        report["rows"] = stride_sweep(device, bandwidth, rng)
        write_report("quant_gemv_strides", report)
        return
    if "--tiles" in sys.argv:  # does the Q4 GEMV's time step with the most blocks an SM holds?
        report["rows"] = tile_sweep(device, bandwidth, rng)
        write_report("quant_gemv_tiles", report)
        return
    if "--dequantize" in sys.argv:  # the prefill's expert dequantization, not the GEMV
        report["rows"] = dequantize_rates(device, bandwidth, rng)
        write_report("dequantize_mma", report)
        return
    if "--small" in sys.argv:  # the geometry search on the small projections alone
        report["rows"] = small_sweep(device, bandwidth, rng)
        write_report("quant_gemv_small", report)
        return
    sweep_only = "--sweep-only" in sys.argv  # the Q4 geometry search alone
    for fmt in (Q4G64,) if sweep_only else (Q4G64, Q5G64, Q6G64, W8G32):
        for name, shape in SHAPES.items():
            sweep = fmt == Q4G64
            if sweep_only and not sweep:
                continue
            report["rows"] += measure(device, device.stream, bandwidth, fmt, name, shape, rng, sweep=sweep)
    write_report("quant_gemv", report)


if __name__ == "__main__":
    main()
