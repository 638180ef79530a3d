"""How long the host takes to queue a launch, and to see a result the GPU has just produced.

Why: the 35B-A3B's 8K prefill idled ~17 ms of its ~177 although the host reached each MoE layer's wait for the group
sizes ahead of the GPU (bench/host_trace.py), so either the host woke late from the wait or it was slow to queue
what followed. Measured on the H200 machine (results/host_round_trip_session20.json): every wait wakes ~13-15 us
after the copy lands, after 300 us or 3 ms alike; numba's launch costs 27-33 us against fast_launch's 8-11. It was
the queueing (ninfer/kernels_numba/fast_launch.py).

Cases (median of ROUNDS):
  launch_us[numba|fast]: one small kernel's launch call, numba's own launch against fast_launch's;
  wake_us[sleep][mode]: a kernel sleeps ~sleep us on the GPU (each of SLEEPS_US), then 16 bytes are copied to
    pinned memory and the host waits for them; host time from the launch to the values, minus the kernel's own
    GPU time (timed by events). Modes: `event_sync` (cuEventSynchronize, the staging slots' wait), `event_poll`
    (cuEventQuery in a loop), `stream_sync` (cuStreamSynchronize).

Run on the GPU machine: `python bench/host_round_trip.py`; JSON to $OUT/host_round_trip.json (bench/results
without OUT).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_report  # noqa: E402
from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402  (the numpy shim first)

ROUNDS = 100
SLEEPS_US = (300, 3000)  # a wait the driver spins through, and one long enough for it to give up spinning


def _sleep(out, microseconds):
    if cuda.threadIdx.x == 0:
        for _ in range(microseconds):
            cuda.nanosleep(1000)
        out[0] += 1


def main() -> None:
    from cuda.bindings import driver

    from ninfer.kernels_numba.fast_launch import FastKernel

    def check(result):
        err = result[0]
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(repr(err))
        return result[1] if len(result) == 2 else result[1:]

    stream = cuda.stream()
    handle = int(stream.handle)
    sleep = FastKernel(cuda.jit(_sleep))
    counter = cuda.to_device(np.zeros(4, np.int32), stream=stream)
    pinned = cuda.pinned_array(4, np.int32)
    began_event, ended_event, copied_event = (check(driver.cuEventCreate(0)) for _ in range(3))
    result: dict = {"rounds": ROUNDS}

    launches = {"numba": lambda: sleep.dispatcher[1, 32, stream](counter, np.int32(0)),
                "fast": lambda: sleep[1, 32, stream](counter, np.int32(0))}
    result["launch_us"] = {}
    for name, launch in launches.items():
        launch()
        stream.synchronize()
        times = []
        for _ in range(ROUNDS):
            began = time.perf_counter()
            launch()
            times.append(time.perf_counter() - began)
        stream.synchronize()
        result["launch_us"][name] = float(np.median(times) * 1e6)

    def wait_event_sync():
        check(driver.cuEventSynchronize(copied_event))

    def wait_event_poll():
        not_ready = driver.CUresult.CUDA_ERROR_NOT_READY
        while True:
            err, = driver.cuEventQuery(copied_event)
            if err != not_ready:
                check((err,))
                return

    def wait_stream_sync():
        check(driver.cuStreamSynchronize(handle))

    result["wake_us"] = {}
    for sleep_us in SLEEPS_US:
        modes = result["wake_us"][str(sleep_us)] = {}
        for name, wait in (("event_sync", wait_event_sync), ("event_poll", wait_event_poll),
                           ("stream_sync", wait_stream_sync)):
            overheads = []
            for round_ in range(ROUNDS // 4 + 3 if sleep_us > 1000 else ROUNDS + 3):
                began = time.perf_counter()
                check(driver.cuEventRecord(began_event, handle))
                sleep[1, 32, stream](counter, np.int32(sleep_us))
                check(driver.cuEventRecord(ended_event, handle))
                check(driver.cuMemcpyDtoHAsync(pinned.ctypes.data, counter.device_ctypes_pointer.value, 16, handle))
                check(driver.cuEventRecord(copied_event, handle))
                wait()
                host_us = (time.perf_counter() - began) * 1e6
                gpu_us = check(driver.cuEventElapsedTime(began_event, ended_event)) * 1e3
                if round_ >= 3:
                    overheads.append(host_us - gpu_us)
            modes[name] = {"median": float(np.median(overheads)), "p10": float(np.percentile(overheads, 10)),
                           "p90": float(np.percentile(overheads, 90))}
    print(json.dumps(result, indent=1), flush=True)
    write_report("host_round_trip", result)


if __name__ == "__main__":
    main()
