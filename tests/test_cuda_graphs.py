"""Graph capture in pieces (`graphs.capture_pieces`): what it asks the driver for, in what order, and how a replay
interleaves the pieces with the eager work between them; checked against a recording stand-in for the driver, so
the order is pinned without a GPU (the GPU tests run it for real: test_cuda_runner.py's prefill pieces)."""

from __future__ import annotations

import types

import pytest

from ninfer.backends.cuda import graphs
from ninfer.backends.cuda.host import HostPiecewiseGraph

STREAM = 7


class RecordingDriver:
    """The driver calls graphs.py makes, each logged; graphs and executables are numbered as they are made."""

    CUstreamCaptureMode = types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL="thread-local")

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.made = 0

    def cuStreamBeginCapture(self, stream, mode):
        self.log.append(("begin", stream, mode))
        return (0,)

    def cuStreamEndCapture(self, stream):
        self.made += 1
        self.log.append(("end", stream))
        return 0, f"graph{self.made}"

    def cuGraphInstantiate(self, graph, flags):
        self.log.append(("instantiate", graph))
        return 0, f"exec-of-{graph}"

    def cuGraphLaunch(self, executable, stream):
        self.log.append(("launch", executable, stream))
        return (0,)

    def cuGraphExecDestroy(self, executable):
        self.log.append(("destroy exec", executable))

    def cuGraphDestroy(self, graph):
        self.log.append(("destroy", graph))


@pytest.fixture
def driver(monkeypatch) -> RecordingDriver:
    recording = RecordingDriver()
    monkeypatch.setattr(graphs, "driver", recording)
    return recording


def test_each_cut_ends_a_piece_and_a_replay_runs_the_eager_work_between_the_pieces(driver):
    def record(cut) -> None:  # the eager work logs where it runs among the launches
        cut(lambda argument: driver.log.append(("first attention", argument)))
        cut(lambda argument: driver.log.append(("second attention", argument)))

    pieces = graphs.capture_pieces(STREAM, record)
    mode = "thread-local"
    assert pieces.pieces == 3
    assert driver.log == [("begin", STREAM, mode), ("end", STREAM), ("instantiate", "graph1"),
                          ("begin", STREAM, mode), ("end", STREAM), ("instantiate", "graph2"),
                          ("begin", STREAM, mode), ("end", STREAM), ("instantiate", "graph3")]  # nothing ran
    for span in ("span A", "span B"):
        driver.log.clear()
        pieces.replay(STREAM, span)
        assert driver.log == [("launch", "exec-of-graph1", STREAM), ("first attention", span),
                              ("launch", "exec-of-graph2", STREAM), ("second attention", span),
                              ("launch", "exec-of-graph3", STREAM)]
    driver.log.clear()
    pieces.close()
    assert sorted(driver.log) == sorted([("destroy exec", f"exec-of-graph{i}") for i in (1, 2, 3)]
                                        + [("destroy", f"graph{i}") for i in (1, 2, 3)])


def test_a_capture_that_raises_ends_the_capture_and_frees_the_pieces_it_made(driver):
    def record(cut) -> None:
        cut(lambda argument: None)
        raise RuntimeError("a read back while capturing")

    with pytest.raises(RuntimeError, match="read back"):
        graphs.capture_pieces(STREAM, record)
    assert driver.log[-3:] == [("end", STREAM), ("destroy exec", "exec-of-graph1"), ("destroy", "graph1")]


def test_pieces_and_the_work_between_them_must_match():
    with pytest.raises(ValueError, match="2 graph pieces need 1"):
        graphs.PiecewiseGraph([graphs.CapturedGraph(None, None)] * 2, [])


def test_the_host_device_replays_the_record_with_the_replays_argument_at_each_cut():
    calls: list = []

    def record(cut) -> None:
        calls.append("before")
        cut(lambda argument: calls.append(("attention", argument)))
        calls.append("after")

    pieces = HostPiecewiseGraph(record)
    pieces.replay(0, "span")
    pieces.replay(0, "next span")
    assert calls == ["before", ("attention", "span"), "after", "before", ("attention", "next span"), "after"]
