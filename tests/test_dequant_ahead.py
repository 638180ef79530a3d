"""WeightDequantizer's ordering on a model of the two streams: every GEMM operand it hands out holds the matrix asked
for by the time its reader runs, whatever the GPU overlaps, and nothing overwrites it while a reader may still run.

The fake streams log each launch (a dequantization's write of a buffer, a reader's read) with its stream, and the
events as edges; happens-before is their transitive closure. A write and a read of one buffer must be ordered one
way or the other, two writes too, and the last write before a read must be of the matrix that read wants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.backends.cuda.dequant_ahead import WeightDequantizer

SERVING, AHEAD = "serving", "ahead"


class Matrix:
    def __init__(self, name: str, shape: tuple[int, int]) -> None:
        self.name, self.shape = name, shape


class TwoStreams:
    """The AheadStream interface over an op log: ops[i] = (stream, kind, buffer, matrix), preceded[i] = bitset of
    the ops that happen before op i."""

    stream = AHEAD

    def __init__(self, buffers: list[np.ndarray]) -> None:
        self.buffers = buffers
        self.ops: list[tuple[str, str, int, str]] = []
        self.preceded: list[int] = []
        self._tail = {SERVING: 0, AHEAD: 0}  # bitset: the stream's ops so far and what they wait for
        self._marks: dict[int, int] = {}

    def _append(self, stream: str, kind: str, buffer: int, matrix: str) -> None:
        index = len(self.ops)
        self.ops.append((stream, kind, buffer, matrix))
        self.preceded.append(self._tail[stream])
        self._tail[stream] |= 1 << index

    def buffer_of(self, view: np.ndarray) -> int:
        return next(i for i, b in enumerate(self.buffers) if np.shares_memory(b, view))

    def dequantize(self, w: Matrix, out: np.ndarray, stream: str) -> None:
        assert out.shape == w.shape
        self._append(stream, "write", self.buffer_of(out), w.name)

    def read(self, view: np.ndarray, w: Matrix) -> None:
        self._append(SERVING, "read", self.buffer_of(view), w.name)

    def after_serving(self) -> None:
        self._tail[AHEAD] |= self._tail[SERVING]

    def mark(self, slot: int) -> None:
        self._marks[slot] = self._tail[AHEAD]

    def serving_waits(self, slot: int) -> None:
        self._tail[SERVING] |= self._marks[slot]

    def check(self) -> None:
        for i, (_, kind, buffer, _) in enumerate(self.ops):
            for j in range(i):
                if kind == "write" and self.ops[j][1] == "write" and self.ops[j][2] == buffer:
                    assert self.preceded[i] >> j & 1, f"writes {j} and {i} of buffer {buffer} race"
        for i, (_, kind, buffer, matrix) in enumerate(self.ops):
            if kind != "read":
                continue
            writes = [j for j, op in enumerate(self.ops) if op[1] == "write" and op[2] == buffer]
            before = [j for j in writes if self.preceded[i] >> j & 1]
            after = [j for j in writes if self.preceded[j] >> i & 1]
            assert len(before) + len(after) == len(writes), f"a write races read {i} of buffer {buffer}"
            assert before, f"read {i} of buffer {buffer} before any write"
            last = max(before, key=lambda j: bin(self.preceded[j]).count("1"))
            assert all(self.preceded[last] >> j & 1 for j in before if j != last), "unordered writes"
            assert self.ops[last][3] == matrix, f"read {i} wants {matrix}, the buffer holds {self.ops[last][3]}"


def run(requests: list[Matrix], ahead: int, *, readers: int = 1) -> tuple[WeightDequantizer, TwoStreams]:
    buffers = [np.zeros(64, np.uint16) for _ in range(ahead + 1)]
    streams = TwoStreams(buffers)
    dequantizer = WeightDequantizer(buffers[:1], streams.dequantize, SERVING)
    dequantizer.add_buffers(buffers[1:], streams)
    dequantizer.set_ahead(ahead)
    for w in requests:
        view = dequantizer.weight(w)
        for _ in range(readers):  # the caller queues every reader before its next request
            streams.read(view, w)
    streams.check()
    return dequantizer, streams


LAYER = [Matrix(name, shape) for name, shape in (("in", (6, 4)), ("out", (4, 4)), ("gate_up", (8, 8)),
                                                 ("down", (4, 8)))]


@pytest.mark.parametrize("ahead", [0, 1, 2, 3])
def test_a_repeating_order_is_learned_then_dequantized_ahead(ahead):
    requests = LAYER * 6
    dequantizer, streams = run(requests, ahead, readers=2)
    writes = [op for op in streams.ops if op[1] == "write"]
    if ahead == 0:
        assert dequantizer.hits == 0 and len(writes) == len(requests) and all(op[0] == SERVING for op in writes)
    else:  # the first round teaches the order and the wrap-around; after it every request is a hit
        assert dequantizer.misses == len(LAYER) + 1
        assert dequantizer.hits == len(requests) - len(LAYER) - 1
        # one write a request, and the `ahead` predicted past the last
        assert len(writes) == len(requests) + ahead
        assert sum(op[0] == AHEAD for op in writes) == dequantizer.hits + ahead


@settings(max_examples=200, deadline=None)
@given(order=st.lists(st.integers(0, len(LAYER) - 1), min_size=1, max_size=40), ahead=st.integers(0, 3),
       readers=st.integers(1, 3))
def test_any_order_of_requests_reads_the_right_bits(order, ahead, readers):
    """Requests that follow no fixed order: predictions miss, and a miss waits out what was queued ahead."""
    run([LAYER[i] for i in order] * 2, ahead, readers=readers)


def test_ahead_needs_its_buffers():
    buffers = [np.zeros(8, np.uint16)]
    dequantizer = WeightDequantizer(buffers, lambda w, out, stream: None, SERVING)
    with pytest.raises(ValueError, match="spare buffers"):
        dequantizer.set_ahead(1)
    with pytest.raises(ValueError, match="at least one buffer"):
        WeightDequantizer([], lambda w, out, stream: None, SERVING)


def test_a_matrix_past_the_buffers_is_refused_before_anything_is_dequantized():
    """The buffers hold the largest matrix prefill dequantizes (without the routed experts when they multiply from
    their codes): a larger one is a clear error, not a short view."""
    calls = []
    dequantizer = WeightDequantizer([np.zeros(8, np.uint16)], lambda w, out, stream: calls.append(w), SERVING)
    with pytest.raises(ValueError, match="does not fit the dequantization buffers of 8 elements"):
        dequantizer.weight(Matrix("experts", (3, 4)))
    assert not calls
    assert dequantizer.weight(Matrix("fits", (2, 4))).shape == (2, 4) and len(calls) == 1
