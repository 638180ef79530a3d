"""bench/kernel_profile.py's per-stream timeline, on a hand-made Kineto trace (the profiler itself needs a GPU)."""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _kernel(ts, dur, stream, name="k"):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_the_timeline_splits_replays_and_reports_each_streams_busy_and_idle_time():
    profile = importlib.import_module("bench.kernel_profile")
    replay = [_kernel(0, 10, 7), _kernel(12, 5, 7), _kernel(11, 20, 9), _kernel(33, 4, 7),  # stream 7 waits on 9
              {"cat": "gpu_memset", "name": "Memset", "ts": 38, "dur": 1, "args": {"stream": 7}},
              {"cat": "cpu_op", "name": "host work", "ts": 5, "dur": 100}]  # not device work: ignored
    later = [dict(e, ts=e["ts"] + 1000) for e in replay]  # the next replay, 961 us of idle after the first
    timeline = profile.stream_timeline(replay + later)
    assert timeline["replays"] == 2
    assert timeline["span_us"] == 39  # 0 .. the memset's end
    serving, side = timeline["streams"]
    assert serving == {"stream": 7, "launches_per_replay": 4, "busy_us_per_replay": 20,
                       "idle_us_per_replay": 2 + 16 + 1, "median_gap_us": 2}
    assert side == {"stream": 9, "launches_per_replay": 1, "busy_us_per_replay": 20, "idle_us_per_replay": 0,
                    "median_gap_us": 0.0}


def test_an_empty_trace_has_no_replays():
    profile = importlib.import_module("bench.kernel_profile")
    assert profile.stream_timeline([]) == {"replays": 0, "span_us": 0.0, "streams": []}
