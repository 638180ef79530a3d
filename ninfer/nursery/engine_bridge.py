"""The engine bridge: one request's engine events delivered into trio, and its cancellation when trio leaves.

The engine thread never waits on trio: its callbacks only schedule a non-blocking channel send on the trio loop
(`TrioToken.run_sync_soon`). The trio side never blocks on the engine: it awaits the channel. Closing a
submission early - the client went away, the pending deadline passed, a handler failed - cancels the request in
the engine, which frees its pages and lane at the next round boundary.
"""

from __future__ import annotations

import math
from typing import AsyncIterator

import trio

from ninfer.engine.engine import Engine, RequestHandle
from ninfer.engine.request import OutputPolicy, PreparedPrompt, RequestEvent, RequestOptions


class AdmissionTimeout(Exception):
    """The engine did not admit the request before its pending deadline (HTTP 503 request_queue_timeout)."""


_ADMITTED = object()  # the channel item that says the engine gave the request a lane


class Submission:
    """A request in the engine, seen from trio: first its admission, then its events until the final one."""

    def __init__(self, handle: RequestHandle, events: trio.MemoryReceiveChannel) -> None:
        self.handle = handle
        self.finished = False  # the final event was received
        self._events = events
        self._early: RequestEvent | None = None  # a final event that came instead of an admission

    async def admission(self, deadline: float) -> None:
        """Wait (until trio time `deadline`) for a lane. A request the engine ended while it waited (the engine
        closing) returns too: its final event is the next one `events` yields."""
        with trio.move_on_at(deadline):
            item = await self._events.receive()
            if item is not _ADMITTED:
                self._early = item
            return
        raise AdmissionTimeout("the request was not admitted within --pending-timeout-ms")

    def close(self) -> None:
        """Done with the request: one that has not finished is cancelled (its pages are freed at the next round
        boundary), and events still on their way are dropped."""
        if not self.finished:
            self.handle.cancel()
        self._events.close()

    async def events(self) -> AsyncIterator[RequestEvent]:
        """The request's events, the final one (with finish and usage) included (waiting for the admission first,
        without a deadline, when `admission` was not awaited)."""
        while not self.finished:
            if self._early is not None:
                event, self._early = self._early, None
            else:
                event = await self._events.receive()
                if event is _ADMITTED:
                    continue
            self.finished = event.finish is not None
            yield event


def _deliver(send: trio.MemorySendChannel, item: object) -> None:
    """Runs on the trio loop. A consumer that already left has closed its end: the item is dropped."""
    try:
        send.send_nowait(item)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def submit(engine: Engine, prompt: PreparedPrompt, options: RequestOptions, policy: OutputPolicy) -> Submission:
    """Submit one request from the trio thread. The engine's own validation errors (ContextLengthExceeded,
    PromptError, SamplingParamsError) raise here, before anything is queued. `close()` the submission when done."""
    token = trio.lowlevel.current_trio_token()
    send, receive = trio.open_memory_channel(math.inf)  # bounded by the request's own output limit

    def from_engine(item: object) -> None:  # the engine thread
        try:
            token.run_sync_soon(_deliver, send, item)
        except trio.RunFinishedError:  # the server's trio loop is gone; nobody is listening
            pass

    handle = engine.submit(prompt, options, policy, on_event=from_engine, on_admit=lambda: from_engine(_ADMITTED))
    return Submission(handle, receive)
