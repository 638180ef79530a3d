"""Per-kernel GPU time of a captured graph's replay, from CUPTI activity records (through torch.profiler, which the GPU
image has; only the benchmark uses it, never the server).

`profile_replays(replay, synchronize, replays)` runs `replay()` `replays` times under the profiler and returns, per
kernel name (numba's mangled names shortened to the Python function name), the GPU microseconds and launches per
replay, sorted by time. The sum over kernels is the GPU busy time over all streams; `stream_timeline` says, per
stream, how much of a replay's span its kernels filled and how long it sat idle between them (launch latency, or a
wait on the other stream): with two streams the busy sum can pass the step time while the serving stream's chain,
kernels plus idle, is what sets it.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import tempfile
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


GPU_WORK = ("kernel", "gpu_memset", "gpu_memcpy")  # Kineto trace categories of device work
TOP_WAITS = 8  # the serving stream's idle time reported before this many kernel names
TOP_GAPS = 8  # the serving stream's longest single gaps, each with the kernels either side
TOP_STREAMS = 3  # streams printed one by one (a graph's branches may spread over dozens)
SEQUENCE_EVENTS = 72  # the first replay's first device events listed in order (the first layers' chains)


def stream_timeline(trace_events: list[dict], replays: int) -> dict:
    """From a Kineto (Chrome) trace of `replays` graph replays run back to back: the span a replay (first start to
    last end over all streams, over `replays`) and, per stream (`args.stream`), the launches, busy us and idle us
    between its own kernels a replay, and the median idle gap. A graph's parallel branches land on streams of the
    driver's choosing, so the one with the most launches is the serving stream's chain; for it, `waits`: its idle
    time a replay summed by the kernel that ran after the gap (what the chain waited to start: a join with another
    stream, or launch latency), the TOP_WAITS longest; `sequence`: the first replay's first SEQUENCE_EVENTS events in
    start order (stream, name, start and duration in us from the replay's start), to read which branch ran where;
    `gaps`: the serving stream's TOP_GAPS longest single gaps (after which kernel, before which, how long, and where
    from the trace's first event), to find a host round trip that a sum by kernel name spreads over many gaps."""
    work = sorted((e for e in trace_events if e.get("cat") in GPU_WORK and "dur" in e), key=lambda e: e["ts"])
    if not work:
        return {"replays": replays, "span_us": 0.0, "streams": [], "waits": [], "sequence": [], "gaps": []}
    streams: dict = defaultdict(lambda: {"launches": 0, "busy_us": 0.0, "idle_us": 0.0, "gaps": [],
                                         "waits": defaultdict(float), "single": []})
    last_end: dict = {}
    last_name: dict = {}
    for event in work:
        stream = event.get("args", {}).get("stream")
        entry = streams[stream]
        entry["launches"] += 1
        entry["busy_us"] += event["dur"]
        if stream in last_end:
            gap = max(0.0, event["ts"] - last_end[stream])
            entry["idle_us"] += gap
            entry["gaps"].append(gap)
            entry["waits"][short_name(event["name"])] += gap
            entry["single"].append({"after": last_name[stream], "before": short_name(event["name"]), "gap_us": gap,
                                    "at_us": last_end[stream] - work[0]["ts"]})
        last_end[stream] = event["ts"] + event["dur"]
        last_name[stream] = short_name(event["name"])
    count = max(1, replays)
    span = max(e["ts"] + e["dur"] for e in work) - work[0]["ts"]
    rows = sorted(({"stream": stream, "launches_per_replay": e["launches"] / count,
                    "busy_us_per_replay": e["busy_us"] / count, "idle_us_per_replay": e["idle_us"] / count,
                    "median_gap_us": float(np.median(e["gaps"])) if e["gaps"] else 0.0}
                   for stream, e in streams.items()), key=lambda e: -e["launches_per_replay"])
    serving = streams[rows[0]["stream"]]["waits"]
    waits = sorted(({"before": name, "idle_us_per_replay": us / count} for name, us in serving.items()),
                   key=lambda w: -w["idle_us_per_replay"])[:TOP_WAITS]
    start = work[0]["ts"]
    sequence = [{"stream": e.get("args", {}).get("stream"), "name": short_name(e["name"]), "start_us": e["ts"] - start,
                 "dur_us": e["dur"]} for e in work if e["ts"] - start < span / count][:SEQUENCE_EVENTS]
    gaps = sorted(streams[rows[0]["stream"]]["single"], key=lambda g: -g["gap_us"])[:TOP_GAPS]
    return {"replays": replays, "span_us": span / count, "streams": rows, "waits": waits, "sequence": sequence,
            "gaps": gaps}


def profile_replays(replay: Callable[[], None], synchronize: Callable[[], None], replays: int = 5) -> dict:
    """{"kernels": [{"name", "us_per_replay", "launches_per_replay"}...], "busy_us_per_replay", "launches",
    "timeline": `stream_timeline` of the replays}."""
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
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as trace:
            timeline = stream_timeline(json.load(trace).get("traceEvents", []), replays)
    return {"kernels": kernels, "busy_us_per_replay": sum(k["us_per_replay"] for k in kernels),
            "launches_per_replay": sum(k["launches_per_replay"] for k in kernels), "timeline": timeline}


def print_profile(title: str, report: dict, top: int = 14) -> None:
    print(f"  profile {title}: {report['launches_per_replay']:.0f} launches, GPU busy "
          f"{report['busy_us_per_replay'] / 1e3:.2f} ms per replay", flush=True)
    timeline = report.get("timeline")
    if timeline:
        print(f"    a replay (of {timeline['replays']}) spans {timeline['span_us'] / 1e3:.2f} ms", flush=True)
        streams = timeline["streams"]
        for s in streams[:TOP_STREAMS]:
            print(f"    stream {s['stream']}: {s['launches_per_replay']:.0f} launches, busy "
                  f"{s['busy_us_per_replay'] / 1e3:.2f} ms, idle between them {s['idle_us_per_replay'] / 1e3:.2f} ms "
                  f"(median gap {s['median_gap_us']:.1f} us)", flush=True)
        if len(streams) > TOP_STREAMS:
            rest = streams[TOP_STREAMS:]
            print(f"    {len(rest)} other streams: {sum(s['launches_per_replay'] for s in rest):.0f} launches, busy "
                  f"{sum(s['busy_us_per_replay'] for s in rest) / 1e3:.2f} ms", flush=True)
        for w in timeline["waits"]:
            print(f"    serving stream idle {w['idle_us_per_replay']:7.1f} us before {w['before']}", flush=True)
        for g in timeline.get("gaps", []):
            print(f"    gap {g['gap_us']:8.1f} us at {g['at_us'] / 1e3:8.2f} ms: after {g['after'][:40]} before "
                  f"{g['before'][:40]}", flush=True)
        for e in timeline["sequence"]:
            print(f"    {e['start_us']:8.1f} us +{e['dur_us']:6.1f}  stream {e['stream']}  {e['name']}", flush=True)
    for k in report["kernels"][:top]:
        print(f"    {k['us_per_replay']:9.1f} us  x{k['launches_per_replay']:5.0f}  {k['name']}", flush=True)


def host_profile(run: Callable[[], object], *, sort: str = "cumulative", top: int = 15) -> str:
    """The top host functions of one `run()` under cProfile (where the wall time that is not GPU time goes)."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(top)
    return text.getvalue()
