"""bf16 copies of quantized matrices for the prefill's cuBLAS GEMMs, dequantized up to `ahead` matrices early.

Past SKINNY_ROWS rows every quantized matrix is multiplied by cuBLAS from a bf16 copy. Dequantized on the serving
stream right before its GEMM, that copy is memory-bound work the compute-bound GEMMs wait for: 240 launches and 43
ms of the 35B-A3B ninfer-v2 8K prefill's 187 ms of GPU time on the H200 (results/cuda_model_prefill_session25.json).
A prefill chunk asks for its matrices in the same order every time, so the dequantizer learns which matrix follows
which and, with `ahead` > 0, queues the next ones' dequantizations on a stream of their own (`AheadStream`) into
spare buffers, to run beside the GEMMs, the attention and the scan instead of between them. On the H200 they
mostly cannot (those kernels leave no SM room): 27B ninfer-v2 -3%, the 35B-A3B within noise (Capacity.dequant_ahead).

Ordering: a buffer is written ahead only after everything queued on the serving stream so far, which includes every
reader of its previous matrix (a caller queues a matrix's readers before asking for the next one); the serving
stream waits for a buffer's mark before its reader. The same kernel writes the same bits, ahead or not.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import attrs


@attrs.frozen
class _Queued:
    matrix: Any
    buffer: int


class WeightDequantizer:
    """Hands out the bf16 [N, K] copy of a quantized matrix (`weight`). `buffers`: flat device arrays of bf16 bits,
    each at least as long as the largest matrix (the first serves the serving stream's own dequantizations; each
    further one lets one more matrix be dequantized ahead). `dequantize(w, out, stream)` launches the kernel."""

    def __init__(self, buffers: list[Any], dequantize: Callable[[Any, Any, Any], None], serving: Any) -> None:
        if not buffers:
            raise ValueError("a dequantizer needs at least one buffer")
        self._buffers = list(buffers)
        self._dequantize, self._serving = dequantize, serving
        self._streams: Any = None  # the AheadStream, once buffers for it were added
        self._ahead = 0
        self._queue: collections.deque[_Queued] = collections.deque()
        self._follows: dict[int, Any] = {}  # id(matrix) -> the matrix asked for after it last time
        self._last: Any = None
        self.hits = self.misses = 0  # requests served by a dequantization ahead / by the serving stream

    @property
    def ahead(self) -> int:
        return self._ahead

    @property
    def queued(self) -> int:
        """Dequantizations queued ahead and not yet handed out."""
        return len(self._queue)

    @property
    def spare_buffers(self) -> int:
        return len(self._buffers) - 1

    def add_buffers(self, buffers: list[Any], streams: Any) -> None:
        """More buffers (each one more matrix that can be dequantized ahead) and the stream that writes them."""
        self._buffers.extend(buffers)
        self._streams = streams

    def set_ahead(self, ahead: int) -> None:
        """How many matrices to dequantize ahead (at most one per spare buffer). What is in flight finishes first."""
        if not 0 <= ahead <= self.spare_buffers:
            raise ValueError(f"dequant ahead {ahead}: the dequantizer has {self.spare_buffers} spare buffers")
        self.drain()
        self._ahead = ahead

    def weight(self, w: Any) -> Any:
        """w's bf16 copy ([N, K] uint16), valid for readers the caller queues before its next request."""
        n, k = w.shape
        if n * k > self._buffers[0].shape[0]:
            raise ValueError(f"a [{n}, {k}] matrix does not fit the dequantization buffers of "
                             f"{self._buffers[0].shape[0]} elements (sized for the matrices prefill dequantizes: with "
                             "direct_quant_experts, not the routed experts)")
        if self._queue and self._queue[0].matrix is w:
            index = self._queue.popleft().buffer
            self._streams.serving_waits(index)
            self.hits += 1
        else:  # not the predicted matrix: whatever was queued ahead finishes, then the serving stream dequantizes
            self.drain()
            index = 0
            self._dequantize(w, self._view(index, w), self._serving)
            self.misses += 1
        if self._last is not None:
            self._follows[id(self._last)] = w
        self._last = w
        self._queue_ahead(w, index)
        return self._view(index, w)

    def _queue_ahead(self, w: Any, handed: int) -> None:
        """Dequantize the matrices predicted after w (after what is queued already) into the buffers nobody holds:
        not `handed` (its readers are not queued yet), not those queued. The others' readers are all queued."""
        busy = {handed} | {queued.buffer for queued in self._queue}
        last = self._queue[-1].matrix if self._queue else w
        waited = False
        while len(self._queue) < self._ahead:
            following = self._follows.get(id(last))
            if following is None:
                return
            free = next(i for i in range(len(self._buffers)) if i not in busy)
            if not waited:
                self._streams.after_serving()
                waited = True
            self._dequantize(following, self._view(free, following), self._streams.stream)
            self._streams.mark(free)
            self._queue.append(_Queued(following, free))
            busy.add(free)
            last = following

    def drain(self) -> None:
        """The serving stream waits for every queued dequantization, which is dropped."""
        while self._queue:
            self._streams.serving_waits(self._queue.popleft().buffer)

    def _view(self, index: int, w: Any) -> Any:
        n, k = w.shape
        return self._buffers[index][: n * k].reshape(n, k)
