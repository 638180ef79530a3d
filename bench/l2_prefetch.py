"""Can a decode projection read its weights from L2 if a prefetch beside the latency-bound kernels before it put them
there?

Why: the 35B-A3B's B=1 bf16 layer (~88 us) spends ~40 us in kernels that read next to nothing from DRAM (norms,
conv, recurrence, router, routing), while the projections after them stream weights known in advance (the out
projection 16.8 MB, the shared expert 6.3 MB, the next layer's in-projection). If `prefetch_l2` (bulk L2
prefetches, sm_90) on a side stream fills L2 during those kernels, the projection reads at L2 speed instead of DRAM's.

Cases, each with L2 flushed first (a 256 MB copy), cuBLAS's decode GEMM (bf16, ROWS rows padded as decode pads, the
serving default) on weights of N x K, device microseconds between events:
  cold        the GEMM alone (DRAM);
  warm        the GEMM right after the same GEMM (as warm as L2 gets);
  prefetched  prefetch (blocks, chunk, evict_last), SETTLE_US of sleep, then the GEMM: does the prefetch land;
  overlap_X   a side stream's prefetch beside X us of sleep on the serving stream, then the GEMM; against the same
              without the prefetch: what a step would gain when X us of latency-bound kernels precede the GEMM.

Run on the GPU machine: `python bench/l2_prefetch.py`; JSON to $OUT/l2_prefetch.json (bench/results without OUT).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from llvmlite import ir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_report  # noqa: E402
from ninfer.kernels_numba.numba_setup import cuda, kernel  # noqa: E402  (the numpy shim before numba)
from numba import int64, types, uint32  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

ROWS = 32
RUNS = 7
FLUSH_BYTES = 256 << 20
SETTLE_US = 60
# (N, K): the 35B-A3B out projection, then sizes around L2's (50 MB on an H200)
SHAPES = [(2048, 4096), (2048, 2048), (4096, 2048), (6144, 2048), (8192, 2048), (12288, 2048)]
PREFETCH = [(blocks, chunk, evict_last) for blocks in (8, 32, 132) for chunk in (8192, 32768)
            for evict_last in (False, True)]
OVERLAP_US = (0, 5, 10, 20)
CHUNK_BYTES = 32768
WARP = 32


@intrinsic
def prefetch_bulk_l2(typingctx, address, size):
    """Ask L2 for `size` bytes (a multiple of 16) from the 16-byte aligned global `address`; returns at once."""
    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        function = ir.FunctionType(ir.VoidType(), [i64, i32])
        builder.asm(function, "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r,~{memory}", list(args),
                    side_effect=True)
        return context.get_dummy_value()

    return types.void(int64, uint32), codegen


@intrinsic
def prefetch_bulk_l2_evict_last(typingctx, address, size):
    """`prefetch_bulk_l2` whose lines L2 keeps ahead of normally cached ones (an evict_last policy): what a stream of
    other weights read between the prefetch and its use should not push out."""
    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        function = ir.FunctionType(ir.VoidType(), [i64, i32])
        builder.asm(function, "{.reg .b64 p; createpolicy.fractional.L2::evict_last.b64 p, 1.0; "
                    "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$0], $1, p;}", "l,r,~{memory}", list(args),
                    side_effect=True)
        return context.get_dummy_value()

    return types.void(int64, uint32), codegen


def _prefetch_kernel(evict_last: bool):
    prefetch = prefetch_bulk_l2_evict_last if evict_last else prefetch_bulk_l2

    @kernel((int64, int64, int64))
    def prefetch_l2(address, nbytes, chunk):
        chunks = (nbytes + chunk - 1) // chunk
        for c in range(cuda.grid(1), chunks, cuda.gridsize(1)):
            start = c * chunk
            prefetch(address + start, uint32(min(chunk, nbytes - start)))

    return prefetch_l2


_PREFETCH = {False: _prefetch_kernel(False), True: _prefetch_kernel(True)}


def prefetch_l2(address: int, nbytes: int, *, blocks: int, stream, chunk: int = CHUNK_BYTES,
                evict_last: bool = False) -> None:
    """Prefetch `nbytes` (a multiple of 16) at device `address` (16-byte aligned) into L2, `blocks` warps issuing
    chunks of `chunk` bytes."""
    if address % 16 or nbytes % 16 or chunk % 16 or chunk <= 0:
        raise ValueError(f"an L2 prefetch needs 16-byte aligned address, size and chunk: {address:#x} {nbytes} {chunk}")
    if nbytes == 0:
        return
    threads = min(blocks * WARP, -(-nbytes // chunk))
    _PREFETCH[evict_last][-(-threads // WARP), WARP, stream](address, nbytes, chunk)


@kernel((int64,), fastmath=False)
def _sleep(microseconds):
    for _ in range(microseconds):
        cuda.nanosleep(1000)


def main() -> None:
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.device import CudaDevice, device_pointer

    device = CudaDevice(0)
    blas = Blas(device)
    side = device.side_stream()
    stream, side_stream = device.stream, side.stream
    flush_from = device.zeros(FLUSH_BYTES, np.uint8, "bench")
    flush_to = device.zeros(FLUSH_BYTES, np.uint8, "bench")
    rng = np.random.default_rng(0)
    report = {"device": device.info.name, "rows": ROWS, "runs": RUNS, "shapes": []}

    def timed(before, measured) -> float:
        """Median device us of `measured()` after L2 is flushed and `before()` queued (events around measured)."""
        times = []
        for _ in range(RUNS):
            _sleep[1, 1, stream](300)  # the host queues everything below before the GPU reaches it
            device.copy(flush_to, flush_from)
            before()
            start, end = cuda.event(), cuda.event()
            start.record(stream)
            measured()
            end.record(stream)
            stream.synchronize()
            times.append(cuda.event_elapsed_time(start, end) * 1e3)
        return round(float(np.median(times)), 2)

    for n, k in SHAPES:
        w = device.upload(rng.integers(0x3C00, 0x3D00, (n, k), dtype=np.uint16), "bench")
        x = device.upload(rng.integers(0x3C00, 0x3D00, (ROWS, k), dtype=np.uint16), "bench")
        y = device.empty((ROWS, n), np.float32, "bench")
        address, nbytes = device_pointer(w), w.nbytes

        def gemm():
            blas.gemm_bf16(x, w, y)

        row = {"n": n, "k": k, "mb": round(nbytes / 2**20, 1), "cold_us": timed(lambda: None, gemm),
               "warm_us": timed(gemm, gemm), "prefetched_us": {}, "overlap_us": {}}
        for blocks, chunk, evict_last in PREFETCH:
            def prefetch_then_settle(b=blocks, c=chunk, e=evict_last):
                prefetch_l2(address, nbytes, blocks=b, chunk=c, evict_last=e, stream=stream)
                _sleep[1, 1, stream](SETTLE_US)

            row["prefetched_us"][f"{blocks}x{chunk}{'_last' if evict_last else ''}"] = timed(prefetch_then_settle,
                                                                                              gemm)
        best = min(PREFETCH, key=lambda p: row["prefetched_us"][f"{p[0]}x{p[1]}{'_last' if p[2] else ''}"])
        for sleep_us in OVERLAP_US:
            def alone(s=sleep_us):
                if s:
                    _sleep[1, 1, stream](s)
                gemm()

            def beside(s=sleep_us, p=best):
                side.fork()
                prefetch_l2(address, nbytes, blocks=p[0], chunk=p[1], evict_last=p[2], stream=side_stream)
                alone(s)
                side.join()

            row["overlap_us"][str(sleep_us)] = {"alone": timed(lambda: None, alone),
                                                "with_prefetch": timed(lambda: None, beside)}
        row["best_prefetch"] = list(best)
        print(row, flush=True)
        report["shapes"].append(row)
    write_report("l2_prefetch", report)


if __name__ == "__main__":
    main()
