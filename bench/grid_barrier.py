"""What a dependent phase costs on the GPU three ways: a kernel launch per phase replayed from a CUDA graph (what
decode does today), a grid-wide barrier in one cooperative kernel (numba's grid group sync), and per-phase arrival
counters in global memory that each block's first thread bumps and then spins on.

Why: the plan's persistent decode kernel for the 35B-A3B (bench/cuda_notes.md, plan item 4) keeps ~10 dependent
phases a layer inside one launch; it pays only if a phase boundary costs well under the ~5-8 us a short kernel
costs in a graph. Each way runs PHASES phases of a token amount of work (one add per thread) over one or two
blocks an SM; the figure is (time of PHASES phases - time of one) / (PHASES - 1), from wall times with the device
synchronised (median of REPEATS).

Run on the GPU machine: `python bench/grid_barrier.py`; JSON to $OUT/grid_barrier.json (bench/results without OUT).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.backends.cuda.timing import wall_seconds  # noqa: E402
from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402

PHASES = 400
THREADS = 256
REPEATS = 7


@cuda.jit
def one_phase(data):
    i = cuda.grid(1)
    data[i] += np.float32(1.0)


@cuda.jit
def phases_grid_sync(data, phases):
    grid = cuda.cg.this_grid()
    i = cuda.grid(1)
    for _ in range(phases):
        data[i] += np.float32(1.0)
        grid.sync()


@cuda.jit
def phases_counters(data, counters, phases):
    """Phase p ends when every block has bumped counters[p]: block-wide barrier, a fence so the phase's writes are
    visible device-wide, one atomic add, then block thread 0 spins on atomic reads until all blocks arrived."""
    i = cuda.grid(1)
    blocks = cuda.gridDim.x
    for p in range(phases):
        data[i] += np.float32(1.0)
        cuda.threadfence()
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            cuda.atomic.add(counters, p, 1)
            while cuda.atomic.add(counters, p, 0) < blocks:
                pass
        cuda.syncthreads()


def main() -> None:
    from ninfer.backends.cuda.device import CudaDevice, memset
    from ninfer.backends.cuda.graphs import capture

    device = CudaDevice(0)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    report = {"device": device.info.name, "sms": sms, "phases": PHASES, "threads": THREADS, "us_per_phase": {}}
    for per_sm in (1, 2):
        blocks = sms * per_sm
        data = device.zeros(blocks * THREADS, np.float32, "bench")
        counters = device.zeros(PHASES, np.int32, "bench")
        stream = device.stream

        def graph_of(phases: int):
            return capture(device.stream_handle, lambda: [one_phase[blocks, THREADS, stream](data)
                                                          for _ in range(phases)])

        graphs = {n: graph_of(n) for n in (1, PHASES)}

        def counted(phases: int) -> None:
            memset(counters, device.stream_handle)
            phases_counters[blocks, THREADS, stream](data, counters, np.int32(phases))

        ways = {
            "graph of launches": lambda n: graphs[n].replay(device.stream_handle),
            "grid sync": lambda n: phases_grid_sync[blocks, THREADS, stream](data, np.int32(n)),
            "arrival counters": counted,
        }
        for name, run in ways.items():
            one = wall_seconds(lambda: run(1), device.synchronize, repeats=REPEATS)
            many = wall_seconds(lambda: run(PHASES), device.synchronize, repeats=REPEATS)
            us = (many - one) / (PHASES - 1) * 1e6
            report["us_per_phase"][f"{name}, {blocks} blocks"] = us
            print(f"{name:18s} {blocks:4d} blocks x {THREADS}: {us:6.2f} us a phase", flush=True)
        for graph in graphs.values():
            graph.close()
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "grid_barrier.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
