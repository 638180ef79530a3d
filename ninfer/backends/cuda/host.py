"""`HostDevice`: the CUDA backend's device interface over host memory and the kernels' NumPy twins.

It lets `CudaQwen` and `CudaRunner` run unchanged without a GPU: arrays are NumPy arrays (new float arrays are
poisoned with NaN, so a read of anything no launch wrote shows up), launches are their twins, cuBLAS is a float32
matmul, and a "graph" replays the recorded Python calls.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import numpy as np

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.backends.cuda.blas import check_batched, check_chunked, check_column_block, check_split_k
from ninfer.backends.cuda.device import DeviceInfo
from ninfer.backends.cuda.staging import ReadValues

HOST_BYTES = 64 << 30  # the memory a HostDevice reports by default (KV auto-sizing needs a number)


class HostDevice:
    index = 0
    stream = None
    stream_handle = 0

    def __init__(self, total_bytes: int = HOST_BYTES, *, side_work_last: bool = False) -> None:
        """`side_work_last`: the side stream runs its work at the join instead of at once (see HostSideStream)."""
        self.ledger: collections.Counter[str] = collections.Counter()
        self._total = total_bytes
        self._side = HostSideStream(deferred=side_work_last)

    @property
    def info(self) -> DeviceInfo:
        used = sum(self.ledger.values())
        return DeviceInfo(0, "host (NumPy twins)", self._total, self._total - used, 0)

    @property
    def kernels(self) -> Any:
        from ninfer.backends.cuda import host_kernels

        return host_kernels

    def empty(self, shape: Any, dtype: Any, purpose: str) -> np.ndarray:
        dtype = np.dtype(dtype)
        array = np.full(shape, np.nan, dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
        self.ledger[purpose] += int(array.nbytes)
        return array

    def zeros(self, shape: Any, dtype: Any, purpose: str) -> np.ndarray:
        array = np.zeros(shape, np.dtype(dtype))
        self.ledger[purpose] += int(array.nbytes)
        return array

    def upload(self, host: np.ndarray, purpose: str) -> np.ndarray:
        array = np.array(host, copy=True)
        self.ledger[purpose] += int(array.nbytes)
        return array

    def synchronize(self) -> None:
        pass

    def write(self, destination: np.ndarray, host: np.ndarray, *, stream_handle: int | None = None) -> None:
        destination[...] = np.asarray(host).reshape(destination.shape)

    def write_rows(self, destination: np.ndarray, host: np.ndarray) -> None:
        destination[...] = np.asarray(host).reshape(destination.shape)

    def read(self, source: np.ndarray) -> np.ndarray:
        return np.array(source, copy=True)

    def start_read(self, source: np.ndarray) -> ReadValues:
        return ReadValues(self.read(source))

    def clear(self, array: np.ndarray) -> None:
        array[...] = 0

    def copy(self, destination: np.ndarray, source: np.ndarray) -> None:
        if destination.nbytes != source.nbytes:
            raise ValueError(f"copy of {source.nbytes} bytes into {destination.nbytes}")
        destination[...] = source.reshape(destination.shape)

    def blas(self) -> "HostBlas":
        return HostBlas()

    def side_stream(self) -> "HostSideStream":
        return self._side

    def ahead_stream(self) -> "HostAheadStream":
        return HostAheadStream()

    def capture(self, record: Callable[[], None]) -> "HostGraph":
        return HostGraph(record)

    def capture_pieces(self, record: Callable[[Callable[[Callable[[Any], None]], None]], None]
                       ) -> "HostPiecewiseGraph":
        return HostPiecewiseGraph(record)


class HostBlas:
    def gemm_bf16(self, x: np.ndarray, w: np.ndarray, y: np.ndarray, *, accumulate: bool = False,
                  first_column: int = 0) -> None:
        check_column_block(x.shape, w.shape, y.shape, first_column)
        product = (bf16_bits_to_f32(x) @ bf16_bits_to_f32(w).T).astype(np.float32)
        block = y[:, first_column:first_column + w.shape[0]]
        block[...] = (block + product) if accumulate else product

    def split_k_gemm_bf16(self, x: np.ndarray, w: np.ndarray, partials: np.ndarray, slices: int) -> None:
        check_split_k(x.shape, w.shape, partials.shape, slices)
        part = x.shape[1] // slices
        for s in range(slices):
            self.gemm_bf16(x[:, s * part:(s + 1) * part], w[:, s * part:(s + 1) * part], partials[s])

    def grouped_gemm_bf16(self, x: np.ndarray, w: np.ndarray, y: np.ndarray, offsets: np.ndarray,
                          rows_per_group: int) -> None:
        """Blas.grouped_gemm_bf16: fp32 products rounded to bf16 bits (y uint16)."""
        n = int(rows_per_group)
        for group, (start, stop) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            if stop > start:
                self._rounded_product(x[start:stop], w[group * n:(group + 1) * n], y[start:stop])

    def batched_gemm_bf16(self, x: np.ndarray, w: np.ndarray, y: np.ndarray, groups: int) -> None:
        """Blas.batched_gemm_bf16: fp32 products rounded to bf16 bits (y uint16)."""
        p, n, _ = check_batched(x.shape, w.shape, y.shape, y.dtype, groups)
        self.grouped_gemm_bf16(x, w, y, np.arange(groups + 1) * p, n)

    def chunked_gemm_bf16(self, x: np.ndarray, w: np.ndarray, y: np.ndarray, chunk_groups: np.ndarray,
                          chunk: int, chunks: int | None = None) -> None:
        """Blas.chunked_gemm_bf16: fp32 products rounded to bf16 bits (y uint16)."""
        chunks = len(chunk_groups) if chunks is None else int(chunks)
        n, _ = check_chunked(x.shape, w.shape, y.shape, y.dtype, chunk_groups, chunk, chunks)
        for i, group in enumerate(np.asarray(chunk_groups)[:chunks].tolist()):
            rows = slice(i * chunk, (i + 1) * chunk)
            self._rounded_product(x[rows], w[group * n:(group + 1) * n], y[rows])

    def _rounded_product(self, x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
        """y (bf16 bits) = x @ w^T in fp32, rounded once: one group or chunk of the expert GEMMs."""
        product = np.empty((x.shape[0], w.shape[0]), np.float32)
        self.gemm_bf16(x, w, product)
        y[...] = f32_to_bf16_bits(product)

    def batched_scores(self, q: np.ndarray, k: np.ndarray, keys: int, scores: np.ndarray) -> None:
        scores[...] = np.matmul(bf16_bits_to_f32(q), bf16_bits_to_f32(k[:, :keys]).transpose(0, 2, 1))

    def batched_values(self, probs: np.ndarray, v: np.ndarray, keys: int, out: np.ndarray) -> None:
        out[...] = np.matmul(bf16_bits_to_f32(probs), bf16_bits_to_f32(v[:, :keys]))

    def close(self) -> None:
        pass


class HostSideStream:
    """`SideStream` on the host: work runs at `run` (before the serving stream's work issued after the fork) or, when
    `deferred`, at `join` (after it). A model whose results differ between the two orders has a data race between
    its branches on the GPU; tests run both."""

    stream = None
    stream_handle = 0

    def __init__(self, *, deferred: bool) -> None:
        self.blas, self.deferred = HostBlas(), deferred
        self._pending: list[Callable[[], None]] = []

    def fork(self) -> None:
        if self._pending:
            raise RuntimeError("fork before the previous branch joined")

    def run(self, work: Callable[[], None]) -> None:
        if self.deferred:
            self._pending.append(work)
        else:
            work()

    def join(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            work()


class HostAheadStream:
    """`AheadStream` on the host: work launched on it runs at once, after everything the serving stream ran, and
    the marks have nothing to order. (`tests/test_dequant_ahead.py` checks the ordering on a model of two streams.)"""

    stream = None
    stream_handle = 0

    def after_serving(self) -> None:
        pass

    def mark(self, slot: int) -> None:
        pass

    def serving_waits(self, slot: int) -> None:
        pass


class HostGraph:
    """A 'captured' step: replaying calls the recorded function again (the buffers it reads are fixed)."""

    def __init__(self, record: Callable[[], None]) -> None:
        self._record = record

    def replay(self, stream_handle: int) -> None:
        self._record()

    def close(self) -> None:
        pass


class HostPiecewiseGraph:
    """A step 'captured' in pieces (`graphs.capture_pieces`): replaying calls the recorded function again, each cut
    running its eager work with the replay's argument where the graphs would stop for it."""

    def __init__(self, record: Callable[[Callable[[Callable[[Any], None]], None]], None]) -> None:
        self._record = record

    def replay(self, stream_handle: int, argument: Any) -> None:
        self._record(lambda run_between: run_between(argument))

    def close(self) -> None:
        pass
