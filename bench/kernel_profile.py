"""Per-kernel GPU time of a captured graph's replay, from CUPTI activity records (through torch.profiler, which the GPU
image has; only the benchmark uses it, never the server).

`profile_replays(replay, synchronize, replays)` runs `replay()` `replays` times under the profiler and returns, per
kernel name (numba's mangled names shortened to the Python function name), the GPU microseconds and launches per
replay, sorted by time. The sum over kernels is the GPU busy time; the gap to the replay's wall time is idle time
between kernels (launch latency inside the graph).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import defaultdict
from typing import Callable

import numpy as np


def short_name(name: str) -> str:
    """`_ZN6cudapy6ninfer13kernels_numba3gdn22_gdn_conv_kernel$2414E...` -> `gdn._gdn_conv_kernel`; other names
    (cuBLAS, torch) are cut to 60 characters."""
    if not name.startswith("_ZN"):
        return name[:60]
    parts, i, text = [], 3, name
    while i < len(text) and text[i].isdigit():
        j = i
        while text[j].isdigit():
            j += 1
        length = int(text[i:j])
        parts.append(text[j:j + length])
        i = j + length
    parts = [p.split("$")[0] for p in parts if p and not p.startswith("cudapy")]
    return ".".join(parts[-2:]) if parts else name[:60]


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


def captured_repeats(device, launch: Callable[[], None], repeats: int, replays: int = 20):
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


def profile_replays(replay: Callable[[], None], synchronize: Callable[[], None], replays: int = 5) -> dict:
    """{"kernels": [{"name", "us_per_replay", "launches_per_replay"}...], "busy_us_per_replay", "launches"}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        synchronize()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type):
            continue
        name = short_name(event.name)
        if name.lower().startswith(("memcpy", "memset")) or "Memcpy" in name or "Memset" in name:
            name = "(" + name.split()[0] + ")"
        totals[name] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        counts[name] += 1
    kernels = sorted(({"name": n, "us_per_replay": totals[n] / replays, "launches_per_replay": counts[n] / replays}
                      for n in totals), key=lambda k: -k["us_per_replay"])
    return {"kernels": kernels, "busy_us_per_replay": sum(k["us_per_replay"] for k in kernels),
            "launches_per_replay": sum(k["launches_per_replay"] for k in kernels)}


def print_profile(title: str, report: dict, top: int = 14) -> None:
    print(f"  profile {title}: {report['launches_per_replay']:.0f} launches, GPU busy "
          f"{report['busy_us_per_replay'] / 1e3:.2f} ms per replay", flush=True)
    for k in report["kernels"][:top]:
        print(f"    {k['us_per_replay']:9.1f} us  x{k['launches_per_replay']:5.0f}  {k['name']}", flush=True)


def host_profile(run: Callable[[], object], *, sort: str = "cumulative", top: int = 15) -> str:
    """The top host functions of one `run()` under cProfile (where the wall time that is not GPU time goes)."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(top)
    return text.getvalue()
