"""The admission gate: a fixed number of generation-request slots (serving.md: max_concurrency +
max_pending_requests). A slot is held for a request's whole life in the server - preparation, the engine queue,
generation, and writing the response - so a full gate means the server is at capacity, not merely busy.

Trio-side only (no locks): slots are taken and released on the trio thread.
"""

from __future__ import annotations


class ServerOverloaded(Exception):
    """Every slot is taken (HTTP 429 server_overloaded)."""


class ShuttingDown(Exception):
    """The server is draining and admits nothing new (HTTP 503)."""


class Slot:
    def __init__(self, gate: AdmissionGate) -> None:
        self._gate: AdmissionGate | None = gate

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        if self._gate is not None:
            self._gate._release()
            self._gate = None


class AdmissionGate:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the admission capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.outstanding = 0
        self.closed = False

    def take(self) -> Slot:
        if self.closed:
            raise ShuttingDown("the server is shutting down and admits no new requests")
        if self.outstanding >= self.capacity:
            raise ServerOverloaded(f"the server is at capacity ({self.capacity} generation requests: "
                                   f"--max-concurrency plus --max-pending-requests)")
        self.outstanding += 1
        return Slot(self)

    def close(self) -> None:
        """Stop admitting (the drain); slots already taken stay valid."""
        self.closed = True

    def _release(self) -> None:
        self.outstanding -= 1
