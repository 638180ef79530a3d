"""Host timestamps of chosen calls during one run, without a profiler's overhead on every other call.

The torch profiler's CUPTI callbacks and cProfile both slow the host's launches (the 35B-A3B 8K prefill idled 46 ms
under CUPTI against 16 ms unprofiled), so neither says how long the host really takes between a MoE layer's wait for
its group sizes and its first expert GEMM. `HostTrace` wraps a few named callables with `time.perf_counter` stamps
(about a microsecond each) and `moe_waits` reads the stamps a layer at a time.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from typing import Any, Callable

import numpy as np


class HostTrace:
    """Wrap `owner.name` (an instance's or a class's attribute) so each call appends (label, start, end) seconds."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self._patched: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, name: str, label: str | None = None) -> None:
        original = getattr(owner, name)
        own = name in vars(owner)
        events, tag = self.events, label or name

        def traced(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                events.append((tag, began, time.perf_counter()))

        # On a class, the plain function becomes a method: the instance arrives as the first argument.
        setattr(owner, name, traced)
        self._patched.append((owner, name, original, own))

    def restore(self) -> None:
        for owner, name, original, own in reversed(self._patched):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._patched.clear()

    def run(self, work: Callable[[], object]) -> list[tuple[str, float, float]]:
        self.events.clear()
        try:
            work()
        finally:
            self.restore()
        return sorted(self.events, key=lambda e: e[1])


class GcPauses:
    """The garbage collector's pauses while the block runs (gc.callbacks): a collection that scans every object of a
    process that has compiled its kernels stops the host for milliseconds, and a prefill's GPU idles through it
    whenever its queue runs dry first."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._began = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._began))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        seconds = [s for _, s in self.pauses]
        return {"collections": len(self.pauses), "by_generation": {g: sum(1 for x, _ in self.pauses if x == g)
                                                                   for g in (0, 1, 2)},
                "total_ms": sum(seconds) * 1e3, "max_ms": max(seconds, default=0.0) * 1e3}


def moe_waits(events: list[tuple[str, float, float]], *, wait: str, gemms: tuple[str, ...]) -> dict:
    """Per MoE layer (a `wait` call followed by one of `gemms`): the wait's duration, and the host microseconds from
    its return to the return of that GEMM call (what the GPU must have queued to cover), with every call in between;
    the medians over layers, and each label's median duration over the run."""
    layers = []
    for index, (label, began, ended) in enumerate(events):
        if label != wait:
            continue
        between = []
        for other, start, end in events[index + 1:]:
            if other == wait:
                break
            between.append({"call": other, "from_wait_us": (start - ended) * 1e6, "us": (end - start) * 1e6})
            if other in gemms:
                break
        if not between or between[-1]["call"] not in gemms:
            continue
        gemm_end = ended + (between[-1]["from_wait_us"] + between[-1]["us"]) / 1e6
        layers.append({"wait_us": (ended - began) * 1e6, "to_first_gemm_us": (gemm_end - ended) * 1e6,
                       "calls": between})
    durations: dict[str, list[float]] = defaultdict(list)
    for label, began, ended in events:
        durations[label].append((ended - began) * 1e6)
    return {"layers": layers,
            "median_wait_us": float(np.median([x["wait_us"] for x in layers])) if layers else 0.0,
            "median_to_first_gemm_us": float(np.median([x["to_first_gemm_us"] for x in layers])) if layers else 0.0,
            "call_us": {label: {"calls": len(v), "median": float(np.median(v)), "max": float(np.max(v)),
                                "total": float(np.sum(v))} for label, v in durations.items()}}


def host_gap_us(events: list[tuple[str, float, float]], *, after: str, before: str) -> float | None:
    """Host microseconds from the return of the first `after` call to the start of the first `before` call that
    follows it (None when either is missing): e.g. a prefill's embedding launch to its first norm, which profiled
    replays showed the GPU idle through (~2.7 ms on the 35B-A3B, session 23) and timed runs seemed not to."""
    first = next((ended for label, _, ended in events if label == after), None)
    if first is None:
        return None
    start = next((began for label, began, _ in events if label == before and began >= first), None)
    return None if start is None else (start - first) * 1e6


def print_moe_waits(report: dict, *, layers: int = 2) -> None:
    print(f"    host: a MoE layer's wait for its sizes {report['median_wait_us']:.0f} us (median), then "
          f"{report['median_to_first_gemm_us']:.0f} us until its first expert GEMM call returns", flush=True)
    if report.get("embed_to_first_norm_us") is not None:
        print(f"    host: {report['embed_to_first_norm_us']:.0f} us from the embedding launch to the first norm's",
              flush=True)
    for label, c in sorted(report["call_us"].items(), key=lambda kv: -kv[1]["total"]):
        print(f"      {label:28s} x{c['calls']:5d}  median {c['median']:7.1f} us  max {c['max']:8.1f}  total "
              f"{c['total'] / 1e3:7.2f} ms", flush=True)
    for layer in report["layers"][1:1 + layers]:  # the first layer pays one-time costs
        print(f"      a layer: wait {layer['wait_us']:.0f} us, then", flush=True)
        for call in layer["calls"]:
            print(f"        +{call['from_wait_us']:7.1f} us  {call['call']:28s} {call['us']:7.1f} us", flush=True)
