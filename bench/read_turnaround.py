"""How long the stream idles between a read the host waits for and the next work the host queues: the MTP round
has two such turns (the verify's argmaxes, the drafts) and a plain decode step one (its argmaxes).

Each trial keeps the GPU busy (~0.5 ms of device copy), records a timing event, queues a small read (a few us
of copy), waits for it and records a second event at once: the GPU is idle after the read, so the pair's span in GPU
clock is the read plus the host's turn-around. The host waits three ways: the device's own read (a pinned staging
slot and cuEventSynchronize), cuStreamSynchronize, and a cuEventQuery spin.

Run on the GPU machine: `python bench/read_turnaround.py`; JSON goes to `$OUT/read_turnaround.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402  (the numpy shim before numba)

from ninfer.backends.cuda.device import CudaDevice, check, copy_device, device_pointer  # noqa: E402

TRIALS = 200
BUSY_BYTES = 1 << 30  # ~0.5 ms of copy ahead of each read


def timed_event(driver):
    err, event = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT)
    check(err, "cuEventCreate")
    return event


def main() -> None:
    from cuda.bindings import driver

    device = CudaDevice(0)
    stream = device.stream_handle
    source, target = (device.empty(BUSY_BYTES // 4, np.float32, "bench") for _ in range(2))
    small = device.zeros(8, np.int32, "bench")
    pinned = cuda.pinned_array(8, dtype=np.int32)
    before, after, copied = timed_event(driver), timed_event(driver), timed_event(driver)

    def read_with_device():
        device.read(small)

    def read_with_stream_sync():
        check(driver.cuMemcpyDtoHAsync(pinned.ctypes.data, device_pointer(small), small.nbytes, stream),
              "cuMemcpyDtoHAsync")
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def read_with_spin():
        check(driver.cuMemcpyDtoHAsync(pinned.ctypes.data, device_pointer(small), small.nbytes, stream),
              "cuMemcpyDtoHAsync")
        check(driver.cuEventRecord(copied, stream), "cuEventRecord")
        while driver.cuEventQuery(copied)[0] == driver.CUresult.CUDA_ERROR_NOT_READY:
            pass

    out = {}
    for name, read in (("device.read", read_with_device), ("cuStreamSynchronize", read_with_stream_sync),
                       ("cuEventQuery spin", read_with_spin)):
        spans = []
        for trial in range(TRIALS + 10):
            copy_device(target, source, stream)
            check(driver.cuEventRecord(before, stream), "cuEventRecord")
            read()
            check(driver.cuEventRecord(after, stream), "cuEventRecord")
            check(driver.cuEventSynchronize(after), "cuEventSynchronize")
            err, ms = driver.cuEventElapsedTime(before, after)
            check(err, "cuEventElapsedTime")
            if trial >= 10:
                spans.append(ms)
        out[name] = {"median_ms": float(np.median(spans)), "p90_ms": float(np.percentile(spans, 90))}
        print(f"{name}: read + turn-around median {out[name]['median_ms'] * 1e3:.1f} us, "
              f"p90 {out[name]['p90_ms'] * 1e3:.1f} us", flush=True)
    path = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "read_turnaround.json"
    path.write_text(json.dumps({"device": device.info.name, "trials": TRIALS, "spans": out}, indent=1))


if __name__ == "__main__":
    main()
