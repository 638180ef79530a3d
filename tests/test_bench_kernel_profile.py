"""bench/kernel_profile.py's per-stream timeline, on a hand-made Kineto trace (the profiler itself needs a GPU)."""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _kernel(ts, dur, stream, name="k"):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_the_timeline_reports_each_streams_busy_and_idle_time_and_what_the_serving_stream_waited_for():
    profile = importlib.import_module("bench.kernel_profile")
    # stream 7 (the most launches) waits 16 us on stream 9's kernel before "join"
    replay = [_kernel(0, 10, 7, "norm"), _kernel(12, 5, 7, "router"), _kernel(11, 20, 9, "shared"),
              _kernel(33, 4, 7, "join"),
              {"cat": "gpu_memset", "name": "Memset", "ts": 38, "dur": 1, "args": {"stream": 7}},
              {"cat": "cpu_op", "name": "host work", "ts": 5, "dur": 100}]  # not device work: ignored
    later = [dict(e, ts=e["ts"] + 40) for e in replay]  # the next replay, back to back (the memset ends at 39)
    timeline = profile.stream_timeline(replay + later, 2)
    assert timeline["replays"] == 2
    assert timeline["span_us"] == 79 / 2  # 0 .. the second memset's end, a replay
    serving, side = timeline["streams"]
    # idle a replay: 2 + 16 + 1 inside each, 1 between the first memset and the second replay's norm
    assert serving == {"stream": 7, "launches_per_replay": 4, "busy_us_per_replay": 20,
                       "idle_us_per_replay": (2 * (2 + 16 + 1) + 1) / 2, "median_gap_us": 2.0}
    assert side == {"stream": 9, "launches_per_replay": 1, "busy_us_per_replay": 20, "idle_us_per_replay": 20 / 2,
                    "median_gap_us": 20.0}
    assert timeline["waits"] == [{"before": "join", "idle_us_per_replay": 16.0},
                                 {"before": "router", "idle_us_per_replay": 2.0},
                                 {"before": "Memset", "idle_us_per_replay": 1.0},
                                 {"before": "norm", "idle_us_per_replay": 0.5}]
    # the first replay's device events in start order, from its start
    assert [(e["stream"], e["name"], e["start_us"], e["dur_us"]) for e in timeline["sequence"]] == [
        (7, "norm", 0, 10), (9, "shared", 11, 20), (7, "router", 12, 5), (7, "join", 33, 4), (7, "Memset", 38, 1)]
    # the serving stream's longest single gaps, either replay, with the kernels either side and where they open
    assert [(g["after"], g["before"], g["gap_us"], g["at_us"]) for g in timeline["gaps"][:4]] == [
        ("router", "join", 16, 17), ("router", "join", 16, 57), ("norm", "router", 2, 10), ("norm", "router", 2, 50)]


def test_an_empty_trace_has_no_streams():
    profile = importlib.import_module("bench.kernel_profile")
    assert profile.stream_timeline([], 3) == {"replays": 3, "span_us": 0.0, "streams": [], "waits": [],
                                                   "sequence": [], "gaps": []}
