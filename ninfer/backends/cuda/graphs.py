"""CUDA graph capture and replay through cuda-python: a decode step is recorded once per exact shape and replayed.

Everything a step reads per round lives in fixed device buffers that the host fills before a replay, so replays need
no parameter patching. A long prefill chunk's attention reads its KV start from the host, so such a chunk is
captured in pieces, its attention calls run eagerly between them (`capture_pieces`).
"""

from __future__ import annotations

from typing import Any, Callable

from cuda.bindings import driver

from ninfer.backends.cuda.device import check


class CapturedGraph:
    def __init__(self, executable: Any, graph: Any) -> None:
        self._executable, self._graph = executable, graph

    def replay(self, stream_handle: int) -> None:
        check(driver.cuGraphLaunch(self._executable, stream_handle), "cuGraphLaunch")

    def close(self) -> None:
        if self._executable is not None:
            driver.cuGraphExecDestroy(self._executable)
            driver.cuGraphDestroy(self._graph)
            self._executable = self._graph = None


def capture(stream_handle: int, record: Callable[[], None]) -> CapturedGraph:
    """Record every launch `record()` issues on the stream into a graph (nothing runs during capture)."""
    _begin(stream_handle)
    try:
        record()
    except BaseException:
        driver.cuStreamEndCapture(stream_handle)
        raise
    return _end(stream_handle)


class PiecewiseGraph:
    """A step captured as graphs with eager work between them: work that reads what differs from one replay to the
    next (a prefill chunk's KV start) runs between the pieces, with that replay's argument. A replay of n pieces
    launches n graphs and runs the n - 1 calls between them."""

    def __init__(self, pieces: list[CapturedGraph], between: list[Callable[[Any], None]]) -> None:
        if len(pieces) != len(between) + 1:
            raise ValueError(f"{len(pieces)} graph pieces need {len(pieces) - 1} calls between them, "
                             f"got {len(between)}")
        self._pieces, self._between = pieces, between

    @property
    def pieces(self) -> int:
        return len(self._pieces)

    def replay(self, stream_handle: int, argument: Any) -> None:
        for piece, run_between in zip(self._pieces, self._between):
            piece.replay(stream_handle)
            run_between(argument)
        self._pieces[-1].replay(stream_handle)

    def close(self) -> None:
        for piece in self._pieces:
            piece.close()


def capture_pieces(stream_handle: int, record: Callable[[Callable[[Callable[[Any], None]], None]], None]
                   ) -> PiecewiseGraph:
    """Record what `record(cut)` issues on the stream as graphs cut where it calls `cut(run_between)`: the piece so
    far becomes a graph, and `run_between(argument)` runs eagerly there at each replay (nothing runs during
    capture; what `record` issues eagerly between cuts, it must leave to `run_between`)."""
    pieces: list[CapturedGraph] = []
    between: list[Callable[[Any], None]] = []

    def cut(run_between: Callable[[Any], None]) -> None:
        pieces.append(_end(stream_handle))
        between.append(run_between)
        _begin(stream_handle)

    _begin(stream_handle)
    try:
        record(cut)
    except BaseException:
        driver.cuStreamEndCapture(stream_handle)
        for piece in pieces:
            piece.close()
        raise
    pieces.append(_end(stream_handle))
    return PiecewiseGraph(pieces, between)


def _begin(stream_handle: int) -> None:
    check(driver.cuStreamBeginCapture(stream_handle, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
          "cuStreamBeginCapture")


def _end(stream_handle: int) -> CapturedGraph:
    err, graph = driver.cuStreamEndCapture(stream_handle)
    check(err, "cuStreamEndCapture")
    err, executable = driver.cuGraphInstantiate(graph, 0)
    check(err, "cuGraphInstantiate")
    return CapturedGraph(executable, graph)
