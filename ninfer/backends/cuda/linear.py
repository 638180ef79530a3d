"""`Linear`: one linear layer call routed to its kernel (skinny GEMV, tensor-core GEMV, narrow kernel, cuBLAS with
its bf16 input and padding, split-K slices, dequantization for prefill), with the scratch each path needs."""

from __future__ import annotations

import copy
from typing import Any


from ninfer.backends.cuda.capacity import MMA_ROWS, SKINNY_ROWS
from ninfer.backends.cuda.dequant_ahead import WeightDequantizer
from ninfer.backends.cuda.device import Device
from ninfer.backends.cuda.linear_tuning import BF16_INPUT_PATHS, DECODE_PATHS, candidate_paths
from ninfer.backends.cuda.weights import Bf16Matrix, Matrix, SplitMatrix, is_quantized, row_blocks, tensor_core
from ninfer.backends.cuda.workspace import SideScratch, Workspace
from ninfer.kernels_numba.linear_narrow import NARROW_MAX_K, NARROW_MAX_ROWS

def fp32_read(h: Any, rows: int, h_bf16: Any, h_fragments: Any) -> Any:
    """Rows h (a layer's normed rows, the attention's output) for their producer to write, or None where nothing
    reads them in fp32: past SKINNY_ROWS rows every reader is a cuBLAS GEMM or the MoE gather, and all read the
    bf16 copy (the side streams that convert h themselves run only up to SKINNY_ROWS)."""
    return None if rows > SKINNY_ROWS and reads_bf16_alone(h_bf16, h_fragments) else h


def reads_bf16_alone(x_bf16: Any, x_fragments: Any) -> bool:
    """Whether the consumer of an activation reads only its bf16 copy: `Linear.bf16_input` asked for one (a cuBLAS
    GEMM, which reads nothing else) and `fragment_input` for no fragments. Its producer can then skip the fp32."""
    return x_bf16 is not None and x_fragments is None


class Linear:
    """y (+)= x @ W^T for any stored format: up to SKINNY_ROWS rows the quantized kernels, and for bf16 matrices
    cuBLAS, the tensor-core kernel (`bf16_path` "mma") or the skinny kernels (`cublas_decode`; both from
    Capacity.decode_linear); cuBLAS on bf16 beyond.

    Batch invariance with cuBLAS: cuBLAS picks its algorithm (and so the summation order) from the shape, so up to
    `pad_rows` rows every call computes exactly `pad_rows` rows (one shape, whatever the batch; a row's result never
    depends on other rows). Callers pass whole workspace buffers and `rows` for that: rows past `rows` of x are
    stale inputs and of y scratch outputs. cuBLAS takes bf16 activations; a producer kernel that already wrote them
    (into `bf16_input`'s scratch) passes that copy as `x_bf16` and saves the conversion launch."""

    def __init__(self, device: Device, workspace: Workspace, *, cublas_decode: bool, pad_rows: int,
                 bf16_path: str | None = None) -> None:
        self._device, self.blas, self._ws, self._k = device, device.blas(), workspace, device.kernels
        self._stream = device.stream
        self.cublas_decode, self.pad_rows = cublas_decode, pad_rows
        # the decode path (`DECODE_PATHS`) of every bf16 matrix `decode_paths` has none for; None: the settings above
        self.bf16_path = bf16_path
        self.programmatic = False  # Capacity.programmatic_launch (CudaQwen.set_programmatic)
        self.narrow = False  # Capacity.narrow_decode (CudaQwen.set_narrow)
        # Capacity.decode_linear "auto": each bf16 shape's decode path as timed on this GPU (`linear_tuning`; (N, K) ->
        # "cublas", "kernels" or "narrow"), ahead of the settings above; shared with `beside` and `with_pad_rows`
        self.decode_paths: dict[tuple[int, int], str] = {}
        # the bf16 copies of quantized matrices past SKINNY_ROWS (CudaQwen.set_dequant_ahead adds buffers)
        self.dequantizer = (WeightDequantizer([workspace.w_bf16], self._dequantize, device.stream)
                            if workspace.w_bf16 is not None else None)

    def beside(self, side: Any, scratch: "SideScratch") -> Linear:
        """A Linear with this one's settings that launches on the side stream `side`, with its cuBLAS handle and
        its own conversion scratch (an x_bf16 or x_fragments passed in is read, never written)."""
        sibling = copy.copy(self)
        sibling._stream, sibling.blas, sibling._ws = side.stream, side.blas, scratch
        sibling.dequantizer = None
        return sibling

    def with_pad_rows(self, pad_rows: int) -> Linear:
        """A Linear sharing this one's cuBLAS handle and scratch whose padded calls compute `pad_rows` rows: a caller
        with calls of another fixed size (the DFlash drafter) keeps its own shape."""
        sibling = copy.copy(self)
        sibling.pad_rows = pad_rows if self.cublas_decode else 0
        return sibling

    def __call__(self, x: Any, w: Matrix, y: Any, *, rows: int | None = None, accumulate: bool = False,
                 x_bf16: Any = None, x_fragments: Any = None) -> None:
        stream, k = self._stream, self._k
        rows = x.shape[0] if rows is None else rows
        if isinstance(w, SplitMatrix):
            self._split(x, w, y, rows, accumulate, x_bf16, x_fragments)
            return
        path = self.decode_path(w, rows)
        if path is not None:
            self.bf16_decode(path, x, w, y, rows, accumulate=accumulate, x_bf16=x_bf16)
            return
        if self.reads_narrow(w, rows):
            k.linear_bf16_narrow(x[:rows], w.data, y[:rows], stream=stream, accumulate=accumulate)
            return
        if rows <= SKINNY_ROWS and (is_quantized(w) or not self.cublas_decode):
            if tensor_core(w):
                if x_fragments is not None and rows <= self.mma_launch_rows:  # the producer of x wrote them
                    k.linear_quant_mma(x_fragments, w, y[:rows], stream=stream, accumulate=accumulate,
                                       programmatic=self.programmatic)
                    return
                for first in range(0, rows, self.mma_launch_rows):  # a row's result is independent of the others
                    last = min(rows, first + self.mma_launch_rows)
                    k.x_fragments(x[first:last], self._ws.x_fragments, stream=stream)
                    k.linear_quant_mma(self._ws.x_fragments, w, y[first:last], stream=stream, accumulate=accumulate,
                                       programmatic=self.programmatic)
            elif is_quantized(w):
                k.linear_quant(x[:rows], w, y[:rows], stream=stream, accumulate=accumulate)
            else:
                k.linear_bf16(x[:rows], w.data, y[:rows], stream=stream, accumulate=accumulate)
            return
        self._cublas(x, w, y, rows, accumulate, x_bf16)

    def decode_path(self, w: Matrix, rows: int) -> str | None:
        """The path `decode_paths` chose for a bf16 matrix at this row count, else `bf16_path` where that path takes
        the shape; None: the settings decide."""
        if rows <= SKINNY_ROWS and isinstance(w, Bf16Matrix):
            shape = tuple(w.shape)
            if shape in self.decode_paths:
                return self.decode_paths[shape]
            return self.bf16_path if self.bf16_path in candidate_paths(shape) else None
        return None

    def bf16_decode(self, path: str, x: Any, w: Bf16Matrix, y: Any, rows: int, *, accumulate: bool = False,
                    x_bf16: Any = None) -> None:
        """y[:rows] (+)= x[:rows] @ W^T through one decode path (`DECODE_PATHS`): cuBLAS padded to `pad_rows` or the
        tensor-core kernel (bf16 input, `x_bf16` when its producer wrote it), the skinny kernel or the narrow one
        (fp32 input)."""
        if path == "cublas":
            self._cublas(x, w, y, rows, accumulate, x_bf16)
        elif path == "mma":
            self._k.linear_bf16_mma(self._gemm_input(x, rows, x_bf16, rows), w.data, y[:rows], stream=self._stream,
                                    accumulate=accumulate, programmatic=self.programmatic)
        elif path == "kernels":
            self._k.linear_bf16(x[:rows], w.data, y[:rows], stream=self._stream, accumulate=accumulate)
        elif path == "narrow":
            self._k.linear_bf16_narrow(x[:rows], w.data, y[:rows], stream=self._stream, accumulate=accumulate)
        else:
            raise ValueError(f"decode path must be one of {', '.join(DECODE_PATHS)}, got {path!r}")

    def splits_k(self, w: Matrix, rows: int, slices: int) -> bool:
        """Whether `split_k` takes w at this row count: a bf16 matrix on the padded cuBLAS path, at least twice as
        wide as tall, whose K divides into `slices` slices of whole 8-column vectors. Why the width: on the H200
        (results/split_k_probe_session29c.json) the sliced call and its add beat cuBLAS plus the norm on the 35B-A3B's
        2048 x 4096 out projection (9.2 -> 7.8 us) and the 27B's 5120 x 17408 down (55.5 -> 50.0) but lost on the
        27B's 5120 x 6144 out projections (21.3 -> 22.4): near-square, cuBLAS does not split K itself, and the
        slices only add partials to write and read."""
        return (slices > 0 and isinstance(w, Bf16Matrix) and 0 < rows <= self.pad_rows <= SKINNY_ROWS
                and self._reads_bf16(w, rows) and self.decode_path(w, rows) in (None, "cublas")
                and w.shape[1] >= 2 * w.shape[0] and w.shape[1] % (8 * slices) == 0)

    def split_k(self, x: Any, w: Bf16Matrix, partials: Any, rows: int, x_bf16: Any, slices: int) -> Any:
        """The K slices of x[:pad_rows] @ W^T into the flat fp32 `partials` (`Blas.split_k_gemm_bf16`; x rounded
        to bf16 here unless its producer wrote `x_bf16`); returns them as [slices, pad_rows, N]. Check `splits_k`
        first."""
        n = w.shape[0]
        sliced = partials[: slices * self.pad_rows * n].reshape(slices, self.pad_rows, n)
        self.blas.split_k_gemm_bf16(self._gemm_input(x, rows, x_bf16, self.pad_rows), self.bf16_weight(w), sliced,
                                    slices)
        return sliced

    def _cublas(self, x: Any, w: Matrix, y: Any, rows: int, accumulate: bool, x_bf16: Any) -> None:
        gemm_rows = self._gemm_rows(rows, x, y)
        self.blas.gemm_bf16(self._gemm_input(x, rows, x_bf16, gemm_rows), self.bf16_weight(w), y[:gemm_rows],
                            accumulate=accumulate)

    def _gemm_input(self, x: Any, rows: int, x_bf16: Any, gemm_rows: int) -> Any:
        """The bf16 copy of x a cuBLAS call reads, its first `gemm_rows` rows: x[:rows] rounded into the shared
        scratch here unless its producer wrote it there (`x_bf16`)."""
        width = x.shape[1]
        if x_bf16 is None:
            self._k.to_bf16_rows(x[:rows], self.bf16_input(rows, width), stream=self._stream)
        return self.bf16_input(gemm_rows, width)

    def _gemm_rows(self, rows: int, x: Any, y: Any) -> int:
        """Rows a cuBLAS call computes: `pad_rows` for calls of up to that many (one GEMM shape whatever the
        batch), else `rows`."""
        return self.pad_rows if rows <= self.pad_rows <= min(x.shape[0], y.shape[0]) else rows

    @property
    def stream(self) -> Any:
        """The stream this Linear launches on."""
        return self._stream

    def fragments_of(self, x: Any) -> Any:
        """x's tensor-core x fragments (at most mma_launch_rows rows) in this Linear's scratch."""
        self._k.x_fragments(x, self._ws.x_fragments, stream=self._stream)
        return self._ws.x_fragments

    @property
    def mma_launch_rows(self) -> int:
        """x rows one tensor-core launch takes: its x-fragment sets of MMA_ROWS rows."""
        return MMA_ROWS * self._k.ROW_SETS

    def bf16_input(self, rows: int, width: int, *consumers: Matrix) -> Any:
        """The shared scratch for a [rows, width] bf16 copy of an activation, or None when no consumer would read it
        (with consumers given: the producer then skips writing it). Pass it to every consumer as `x_bf16` (those
        that read fp32 or fragments ignore it). The copy is valid until the next linear call that converts its own
        input."""
        if consumers and not any(self._reads_bf16(w, rows) for w in consumers):
            return None
        return self._ws.x_bf16.reshape(self._ws.x_bf16.size)[: rows * width].reshape(rows, width)

    def fragment_input(self, rows: int, *consumers: Matrix) -> Any:
        """The shared x-fragment buffer for the producer of an activation to write (`out_fragments`) when some
        consumer runs on the tensor cores at this row count (<= 8 rows: one set), else None. Pass it to every
        consumer as `x_fragments` (the others ignore it): none then converts its own input, and the fragments stay
        valid until the next linear call without them."""
        if rows > MMA_ROWS or not any(self._reads_fragments(w, rows) for w in consumers):
            return None
        return self._ws.x_fragments

    def reads_narrow(self, w: Matrix, rows: int) -> bool:
        """Whether `__call__` multiplies w through the narrow kernel (fp32 input) at this row count."""
        path = self.decode_path(w, rows)
        if path is not None:
            return path == "narrow"
        return (self.narrow and isinstance(w, Bf16Matrix) and rows <= SKINNY_ROWS and w.shape[0] <= NARROW_MAX_ROWS
                and w.shape[1] <= NARROW_MAX_K)

    def _reads_fragments(self, w: Matrix, rows: int) -> bool:
        if isinstance(w, SplitMatrix):
            return any(self._reads_fragments(part, rows) for part in w.parts)
        return tensor_core(w) and rows <= SKINNY_ROWS

    def _reads_bf16(self, w: Matrix, rows: int) -> bool:
        """Whether `__call__` multiplies w through cuBLAS (bf16 input) at this row count (a split projection: both
        its blocks, past the decode rows)."""
        if isinstance(w, SplitMatrix):
            return rows > SKINNY_ROWS
        path = self.decode_path(w, rows)
        if path is not None:
            return path in BF16_INPUT_PATHS
        return rows > SKINNY_ROWS or (isinstance(w, Bf16Matrix) and self.cublas_decode
                                      and not self.reads_narrow(w, rows))

    def _split(self, x: Any, w: SplitMatrix, y: Any, rows: int, accumulate: bool, x_bf16: Any,
               x_fragments: Any) -> None:
        """Two row blocks (every split projection of the 27B inventory has exactly two): past the decode rows each
        block's GEMM writes its columns of y from one bf16 copy of x; on the tensor-core decode path one pair launch
        writes both; otherwise each block into scratch rows, then joined side by side."""
        if accumulate or len(w.parts) != 2:
            raise ValueError("a split projection must have two blocks and overwrite its output")
        if rows > SKINNY_ROWS:  # no join: at 8K rows the 27B's 64 joins were 57 ms of a 0.9 s prefill
            gemm_rows = self._gemm_rows(rows, x, y)
            x_bf16 = self._gemm_input(x, rows, x_bf16, gemm_rows)
            column = 0
            for part in w.parts:
                self.blas.gemm_bf16(x_bf16, self.bf16_weight(part), y[:gemm_rows], first_column=column)
                column += part.shape[0]
            return
        widest = max(part.shape[0] for part in w.parts)
        capacity, outputs = min(x.shape[0], y.shape[0], self._ws.split_a.shape[0] // widest), []
        if rows > capacity:
            raise ValueError(f"a split projection of {rows} rows: its blocks' scratch holds {capacity}")
        if x_fragments is None and rows <= self.mma_launch_rows and self._reads_fragments(w, rows):
            x_fragments = self._ws.x_fragments  # one conversion for both blocks
            self._k.x_fragments(x[:rows], x_fragments, stream=self._stream)
        first, second = w.parts
        if (x_fragments is not None and rows <= min(self.mma_launch_rows, SKINNY_ROWS) and tensor_core(first)
                and tensor_core(second) and self._k.has_pair_kernel(first, second)):
            self._k.linear_quant_mma_pair(x_fragments, first, second, y[:rows], stream=self._stream,
                                          programmatic=self.programmatic)  # one launch, no join
            return
        for part, scratch in zip(w.parts, (self._ws.split_a, self._ws.split_b)):
            out = scratch[: capacity * part.shape[0]].reshape(capacity, part.shape[0])
            self(x, part, out, rows=rows, x_fragments=x_fragments)
            outputs.append(out[:rows])
        self._k.concat_columns(outputs[0], outputs[1], y[:rows], stream=self._stream)

    def convolves(self, w: Matrix, rows: int) -> bool:
        """Whether `linear_conv` takes w at this row count: the tensor-core decode path (one launch's rows) for
        every row block of w, and a compiled fused kernel for their formats."""
        parts = row_blocks(w)
        return (0 < rows <= min(self.mma_launch_rows, SKINNY_ROWS) and all(tensor_core(part) for part in parts)
                and self._k.has_conv_kernel(parts))

    def linear_conv(self, x: Any, w: Matrix, y: Any, conv: tuple, mixed: Any, *, rows: int, channels: int,
                    x_fragments: Any = None) -> None:
        """y[:rows] = x[:rows] @ W^T and mixed[:rows] = gdn_conv of y's first `channels` columns, in one launch
        (`linear_quant_mma_conv`; check `convolves` first). `conv`: the conv weight, state, histories and the four
        segment arrays, as `gdn_conv` takes them; `x_fragments`: x's, when its producer wrote them."""
        if x_fragments is None:
            x_fragments = self.fragments_of(x[:rows])
        self._k.linear_quant_mma_conv(x_fragments, row_blocks(w), y[:rows], *conv, mixed[:rows], channels=channels,
                                      stream=self._stream, programmatic=self.programmatic)

    def bf16_weight(self, w: Matrix) -> Any:
        """A bf16 [N, K] view of the weight: itself, or its dequantization (`WeightDequantizer.weight`: valid for
        the readers queued before the next call)."""
        if not is_quantized(w):
            return w.data
        if self.dequantizer is None:
            raise RuntimeError("this Linear has no dequantization scratch (a side stream's, or no long prefill rows)")
        return self.dequantizer.weight(w)

    def _dequantize(self, w: Matrix, out: Any, stream: Any) -> None:
        dequantize = self._k.dequantize_mma_bf16 if tensor_core(w) else self._k.dequantize_bf16
        dequantize(w, out, stream=stream)
