"""Polling for state another thread updates (a server, an engine, a cache's background work)."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, poll: float = 0.002) -> None:
    """Return once `condition()` holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not reached within {timeout} s"
        time.sleep(poll)
