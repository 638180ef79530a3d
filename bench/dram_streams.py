"""Does the Q4 GEMV's DRAM access pattern, not its arithmetic, cap it near 0.5-0.67 of copy bandwidth?

The tensor-core Q4 GEMV (`quant_mma`) gives each block one row tile, stored contiguously (139 KB for K = 17408): a
launch of 264-528 blocks reads 264-528 separate sequential streams, each 8 KB a step (8 warps x 2 blocks of 512
bytes). Session 13 measured ~20 GB/s an SM whatever an SM holds (2, 3 or 4 blocks), ~2.9 TB/s in all against a
4.28 TB/s copy. This probe runs the same pattern with no arithmetic (16-byte loads xor-folded into one word a
thread) two ways over the same bytes:
- `tiles`: block b reads its own contiguous region, as the GEMV's layout does;
- `stripes`: at step s block b reads the 8 KB at (s * blocks + b) * 8 KB, so all blocks move through one window of
  neighbouring addresses together, as a copy kernel does;
and a plain grid-stride read for reference. If `stripes` runs near the reference and `tiles` near the GEMV, the
weight layout (tiles interleaved by K step) is the lever; if both run like the GEMV, it is not the DRAM pattern.

Each shape also runs `chained`: a warp's next loads wait for this step's words (their address takes `acc & zero`,
zero a runtime 0), as the GEMV's do (load, wait, mma, next load), with `unroll` chunks a warp in flight. The GEMV's
geometry is 8 warps x 2 chunks. Consecutive launches read different copies of the bytes (more than the 50 MB L2
holds between two reads of one copy), as the model's layers do.

On the H200 (results/dram_streams_session14.json; 320 tiles, the 27B down projection, 44.6 MB):
- tiles and stripes run alike (12.5-14.4 us, 0.74-0.85 of copy): the layout is not the lever;
- the chain costs ~15% at 2 chunks a warp (14.4 us against 12.8) and nothing at 4 (11.9);
- the GEMV's other loads cost most of the rest: chained + scales + x 19.1 us (x alone 17.9, narrow x 15.9), the
  GEMV itself 23.0 with copies cycled (21.6 reusing one, which the L2 partly holds);
- the GEMV's SASS (tools/sass.py) showed ptxas issuing each step's first scale load after the step's first mma,
  a second DRAM round trip a step: with the scales loaded a step ahead and narrow x at M <= 4 the GEMV took 20.4
  (results/dram_streams_session14_after.json);
- without L1 allocation for the weights and scales (`no-allocate`) the probe's chained + scales + narrow x went
  17.0 -> 15.9 us, but the GEMV with such loads ran as before (20.2 against 20.3) and with 4 chunks a warp slower
  (25.2), so the GEMV's remaining ~3 us over its probe is its own arithmetic between a step's loads and the next
  (results/dram_streams_session14_no_allocate.json).

Run on the GPU machine: `python bench/dram_streams.py`; JSON to $OUT/dram_streams.json (bench/results without OUT).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels_numba.common import address_of, load_word_at, load_words2_at, load_words4_at
from ninfer.kernels_numba.linear import load4  # noqa: E402
from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import int32, int64, types, uint32  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

WARPS = 8
CHUNK = 512  # bytes a warp loads at once: 32 lanes x 16 bytes, one (tile, K block) of the Q4 layout
TILE_BYTES = 272 * CHUNK  # a 27B down-projection tile: K = 17408, 272 blocks of 64 columns
TILE_COUNTS = (320, 528)
# `stream_kernel` extras, the GEMV's other loads of a (tile, K block) and candidate replacements for them:
SCALES = 1  # a word a lane from the scale plane, as the GEMV loads its binary16 scale pair
SCALES_WIDE = 2  # the step's `unroll` scale words of a lane as one load (scales stored in step order)
X = 4  # two 16-byte words a lane of the K block's x fragments (1 KB: 8 x rows), one array every block reads
X_NARROW = 8  # the same two words from a 128-byte K block (lanes with equal lane % 4 share them: M = 1)
X_SHARED = 16  # X_NARROW's K blocks staged once a block in shared memory (34 KB), read from there
NO_ALLOCATE = 32  # the weight and scale loads through the read-only path without L1 allocation
SCALE_CHUNK = 32  # scale bytes of a (tile, K block): 8 words, lane l reads word l // 4
X_CHUNK = 1024  # x-fragment bytes of a K block: 32 bytes a lane, the same for every tile
X_NARROW_CHUNK = 128
UNROLLS = (2,)
# (striped, chained, extras): session 14's first run found tiles = stripes and the chain costing ~15% at unroll 2,
# the second that the x fragments and the scales cost most of the rest
VARIANTS = ((False, False, 0), (False, True, 0), (False, True, SCALES), (False, True, SCALES_WIDE),
            (False, True, X), (False, True, X_NARROW), (False, True, X_SHARED), (False, True, SCALES | X),
            (False, True, SCALES | X_NARROW), (False, True, SCALES | X_NARROW | NO_ALLOCATE),
            (False, True, SCALES | X | NO_ALLOCATE))
EXTRA_NAMES = {SCALES: "scales", SCALES_WIDE: "scales-wide", X: "x", X_NARROW: "x-narrow", X_SHARED: "x-shared",
               NO_ALLOCATE: "no-allocate"}
ROTATION_BYTES = 256 << 20  # bytes of copies launches cycle through: 5x the L2
READ_BLOCKS_PER_SM = 4
GEMV_COPIES = 5
_KERNELS: dict = {}


def _make_no_allocate_load(count: int):
    @intrinsic
    def load_no_allocate(typingctx, address):
        """`count` (1 or 4) uint32 words at a global byte address through the read-only path without L1 allocation
        (`ld.global.nc.L1::no_allocate`), so the streamed bytes leave the L1 to the x lines."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            if count == 1:
                return builder.asm(ir.FunctionType(i32, [ir.IntType(64)]),
                                   "ld.global.nc.L1::no_allocate.u32 $0, [$1];", "=r,l", list(args), side_effect=False)
            value = builder.asm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)]),
                                "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                list(args), side_effect=False)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(value, i) for i in range(4)])

        return (uint32 if count == 1 else types.UniTuple(uint32, 4))(int64), codegen

    return load_no_allocate


load_word_no_allocate_at = _make_no_allocate_load(1)
load_words4_no_allocate_at = _make_no_allocate_load(4)


def stream_kernel(unroll: int, striped: bool, chained: bool, extras: int = 0):
    """Each block reads `steps` steps of WARPS * unroll chunks; warp w's loads of a step are chunks w + u * WARPS
    (the GEMV's order), issued together, then folded (`chained`: before the next step's loads may issue), with the
    `extras` loads of each chunk."""
    key = (unroll, striped, chained, extras)
    if key in _KERNELS:
        return _KERNELS[key]
    step_chunks = WARPS * unroll
    held = 4 * unroll  # words a lane holds between its loads and its folds
    scale_words = unroll if extras & (SCALES | SCALES_WIDE) else 0
    x_words = 8 * unroll if extras & (X | X_NARROW | X_SHARED) else 0
    other_slots = max(1, scale_words + x_words)
    x_stride = X_CHUNK if extras & X else X_NARROW_CHUNK

    @cuda.jit
    def read_streams(buf, out, steps, zero, scales, xf, x_words_total):
        staged = cuda.shared.array(0, uint32)
        block = int64(cuda.blockIdx.x)
        blocks = int64(cuda.gridDim.x)
        warp = int64(cuda.threadIdx.x >> 5)
        lane = int64(cuda.threadIdx.x & 31)
        lane_at = address_of(buf) + lane * 16 + warp * CHUNK
        x_lane = lane * 32 if extras & X else (lane & 3) * 32
        x_at = address_of(xf) + x_lane + warp * x_stride
        if extras & X_SHARED:
            i = int32(cuda.threadIdx.x) * 4
            while i < x_words_total:
                staged[i], staged[i + 1], staged[i + 2], staged[i + 3] = load_words4_at(address_of(xf) + i * 4)
                i += int32(cuda.blockDim.x) * 4
            cuda.syncthreads()
        acc = uint32(0)
        words = cuda.local.array(held, uint32)
        others = cuda.local.array(other_slots, uint32)
        for s in range(steps):
            chunk = (int64(s) * blocks + block) * step_chunks if striped else (block * steps + s) * step_chunks
            x_chunk = int64(s) * step_chunks
            if chained:
                chunk += int64(acc & zero[0])
            if extras & SCALES_WIDE:  # the warp's `unroll` chunks' scales sit together, lane l's words at l // 4
                at = address_of(scales) + (chunk + warp * unroll) * SCALE_CHUNK + (lane >> 2) * 4 * unroll
                if unroll == 2:
                    others[0], others[1] = load_words2_at(at)
                else:
                    others[0], others[1], others[2], others[3] = load_words4_at(at)
            for u in range(unroll):
                at = lane_at + (chunk + u * WARPS) * CHUNK
                if extras & NO_ALLOCATE:
                    words[4 * u], words[4 * u + 1], words[4 * u + 2], words[4 * u + 3] = load_words4_no_allocate_at(at)
                else:
                    words[4 * u], words[4 * u + 1], words[4 * u + 2], words[4 * u + 3] = load_words4_at(at)
                if extras & SCALES:
                    at = address_of(scales) + (chunk + u * WARPS + warp) * SCALE_CHUNK + (lane >> 2) * 4
                    others[u] = load_word_no_allocate_at(at) if extras & NO_ALLOCATE else load_word_at(at)
                o = scale_words + 8 * u
                if extras & (X | X_NARROW):
                    at = x_at + (x_chunk + u * WARPS) * x_stride
                    others[o], others[o + 1], others[o + 2], others[o + 3] = load_words4_at(at)
                    others[o + 4], others[o + 5], others[o + 6], others[o + 7] = load_words4_at(at + 16)
                if extras & X_SHARED:
                    at = int32(((x_chunk + u * WARPS + warp) * X_NARROW_CHUNK + x_lane) >> 2)
                    others[o], others[o + 1], others[o + 2], others[o + 3] = load4(staged, at)
                    others[o + 4], others[o + 5], others[o + 6], others[o + 7] = load4(staged, at + 4)
            for i in range(held):
                acc ^= words[i]
            for i in range(scale_words + x_words):
                acc ^= others[i]
        out[cuda.grid(1)] = acc

    _KERNELS[key] = read_streams
    return read_streams


@cuda.jit
def read_grid_stride(buf, out, vectors):
    """Every thread's 16-byte vectors i, i + threads, ...: the reference read pattern."""
    i = int64(cuda.grid(1))
    threads = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
    base = address_of(buf)
    acc = uint32(0)
    while i < vectors:
        w0, w1, w2, w3 = load_words4_at(base + i * 16)
        acc ^= w0 ^ w1 ^ w2 ^ w3
        i += threads
    out[cuda.grid(1)] = acc


def gemv_rows(device, record, tiles: int, rng) -> None:
    """The Q4 tensor-core GEMV itself at M = 1 on a [16 tiles, 17408] matrix, cycling through GEMV_COPIES copies
    (the probe rows' setting), then reusing one copy as bench/quant_gemv.py --tiles does (the 50 MB L2 partly holds
    it)."""
    from bench.quant_gemv import random_payload
    from ninfer.artifact.formats import Q4G64
    from ninfer.kernels_numba import quant_mma as QM

    shape = (16 * tiles, TILE_BYTES // CHUNK * 64)
    payload = random_payload(Q4G64, shape, rng)
    copies = [QM.upload_quant_mma(Q4G64, shape, payload, stream=device.stream) for _ in range(GEMV_COPIES)]
    dxf = device.empty(QM.x_fragment_words(shape[1]), np.uint32, "bench")
    QM.x_fragments(device.upload(rng.standard_normal((1, shape[1])).astype(np.float32), "bench"), dxf,
                   stream=device.stream)
    y = device.empty((1, shape[0]), np.float32, "bench")
    turn = iter(range(1 << 30))
    record({"pattern": "gemv q4", "tiles": tiles, "bytes": copies[0].nbytes},
           lambda: QM.linear_quant_mma(dxf, copies[next(turn) % GEMV_COPIES], y, stream=device.stream))
    record({"pattern": "gemv q4 one copy", "tiles": tiles, "bytes": copies[0].nbytes},
           lambda: QM.linear_quant_mma(dxf, copies[0], y, stream=device.stream))


def main() -> None:
    from bench.cuda_model import copy_bandwidth
    from ninfer.backends.cuda.timing import captured_repeats
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.kernels_numba.fill import fill_uniform

    device = CudaDevice(0)
    bandwidth = copy_bandwidth(device)
    sms = device.info.multiprocessors
    pool = device.empty(ROTATION_BYTES // 4, np.float32, "bench")
    fill_uniform(pool, seed=3, scale=1.0, stream=device.stream)
    words = pool.view(np.uint32)
    out = device.empty(max(TILE_COUNTS) * WARPS * 32, np.uint32, "bench")
    zero = device.upload(np.zeros(1, np.uint32), "bench")
    scale_pool = device.empty(ROTATION_BYTES // (CHUNK // SCALE_CHUNK) // 4, np.uint32, "bench")
    fill_uniform(scale_pool.view(np.float32), seed=4, scale=1.0, stream=device.stream)
    xf = device.empty(TILE_BYTES // CHUNK * X_CHUNK // 4, np.uint32, "bench")
    fill_uniform(xf.view(np.float32), seed=5, scale=1.0, stream=device.stream)
    rng = np.random.default_rng(0)
    report = {"device": device.info.name, "copy_bandwidth_bytes_s": bandwidth, "rows": []}
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s ({sms} SMs)", flush=True)

    def measure_gemv(row: dict, launch) -> None:
        graph, seconds = captured_repeats(device, launch, 20, replays=10)
        graph.close()
        report_row(row, seconds)

    def measure(row: dict, launch) -> None:
        """`launch(weights, scales)` on each copy of the shape's bytes in turn, 20 launches captured as one graph."""
        copies = ROTATION_BYTES // (row["tiles"] * TILE_BYTES)
        turn = iter(range(1 << 30))

        def next_copy():
            at = (next(turn) % copies) * row["tiles"] * TILE_BYTES
            launch(words[at // 4:], scale_pool[at // (CHUNK // SCALE_CHUNK) // 4:])

        graph, seconds = captured_repeats(device, next_copy, 20, replays=10)
        graph.close()
        report_row(row, seconds)

    def report_row(row: dict, seconds: float) -> None:
        row.update(us=seconds * 1e6, bytes_s=row["bytes"] / seconds, ratio_to_copy=row["bytes"] / seconds / bandwidth,
                   per_sm_bytes_s=row["bytes"] / seconds / sms)
        report["rows"].append(row)
        print(f"{row['pattern']:40s} tiles {row['tiles']:4d} unroll {row.get('unroll', '-')}: {row['us']:7.1f} us "
              f"{row['bytes_s'] / 1e12:5.2f} TB/s {row['ratio_to_copy']:.3f} of copy "
              f"{row['per_sm_bytes_s'] / 1e9:5.1f} GB/s an SM", flush=True)

    for tiles in TILE_COUNTS:
        total = tiles * TILE_BYTES
        grid = READ_BLOCKS_PER_SM * sms
        x_words = TILE_BYTES // CHUNK * X_NARROW_CHUNK // 4
        measure({"pattern": "grid", "tiles": tiles, "bytes": total},
                lambda data, _: read_grid_stride[grid, 256, device.stream](data, out, int64(total // 16)))
        for unroll in UNROLLS:
            steps = TILE_BYTES // (WARPS * unroll * CHUNK)  # unroll 4 and 8: the tile's first 128 KB of 136
            for striped, chained, extras in VARIANTS:
                fn = stream_kernel(unroll, striped, chained, extras)
                shared = x_words * 4 if extras & X_SHARED else 0
                pattern = " +".join([("stripes" if striped else "tiles") + (" chained" if chained else "")] +
                                    [name for flag, name in EXTRA_NAMES.items() if extras & flag])
                measure({"pattern": pattern, "tiles": tiles, "unroll": unroll,
                         "bytes": tiles * steps * WARPS * unroll * CHUNK},
                        lambda data, scales, fn=fn, shared=shared: fn[tiles, WARPS * 32, device.stream, shared](
                            data, out, int32(steps), zero, scales, xf, int32(x_words)))
        gemv_rows(device, measure_gemv, tiles, rng)
    path = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "dram_streams.json"
    path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
