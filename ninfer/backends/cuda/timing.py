"""Wall-clock timing of device work (host work included): what the benchmarks report and what the model's decode
linear tuning (`linear_tuning`) compares."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


def wall_seconds(run: Callable[[], object], synchronize: Callable[[], None], *, repeats: int,
                 warmup: int = 1) -> float:
    """Median wall seconds of `run()` and a `synchronize()` (host work included), after `warmup` untimed runs."""
    for _ in range(warmup):
        run()
        synchronize()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def captured_repeats(device: Any, launch: Callable[[], None], repeats: int, replays: int = 20):
    """`launch` issued `repeats` times back to back, captured as one graph (after one eager run, which compiles),
    then replayed: (the graph, median wall seconds per `launch`, device synchronised)."""
    def body():
        for _ in range(repeats):
            launch()

    body()
    device.synchronize()
    graph = device.capture(body)
    seconds = wall_seconds(lambda: graph.replay(device.stream_handle), device.synchronize, repeats=replays, warmup=3)
    return graph, seconds / repeats
