"""CUDA graph capture and replay through cuda-python: a decode step is recorded once per exact shape and replayed.

Everything a step reads per round lives in fixed device buffers that the host fills before a replay, so replays need
no parameter patching.
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
    check(driver.cuStreamBeginCapture(stream_handle, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
          "cuStreamBeginCapture")
    try:
        record()
    except BaseException:
        driver.cuStreamEndCapture(stream_handle)
        raise
    err, graph = driver.cuStreamEndCapture(stream_handle)
    check(err, "cuStreamEndCapture")
    err, executable = driver.cuGraphInstantiate(graph, 0)
    check(err, "cuGraphInstantiate")
    return CapturedGraph(executable, graph)
