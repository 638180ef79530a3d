"""cuBLAS through nvmath-python's bindings, on raw device pointers: the prefill GEMMs.

Row-major `y[M, N] = x[M, K] @ w[N, K]^T` is the column-major product `y^T = w . x^T`, i.e. gemm(T, N) with w as A.
Operands are bf16 bit arrays, the output fp32, accumulation fp32 (CUBLAS_COMPUTE_32F).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ninfer.backends.cuda.device import device_pointer

CUDA_R_32F, CUDA_R_16BF = 0, 14
WORKSPACE_BYTES = 32 << 20
MAX_GROUPS = 1024  # groups (MoE experts) one grouped GEMM takes
MAX_CHUNKS = 8192  # row chunks one chunked GEMM takes: with MAX_GROUPS, what sizes the device table of addresses


def check_column_block(x_shape: tuple, w_shape: tuple, y_shape: tuple, first_column: int) -> None:
    """The shapes `gemm_bf16` takes: x [M, K], w [N, K], y [M, >= first_column + N]."""
    (m, k), (n, k2) = x_shape, w_shape
    if k != k2 or len(y_shape) != 2 or y_shape[0] != m or not 0 <= first_column <= y_shape[1] - n:
        raise ValueError(f"gemm shapes x{tuple(x_shape)} w{tuple(w_shape)} y{tuple(y_shape)} from column "
                         f"{first_column}")


def check_batched(x_shape: tuple, w_shape: tuple, y_shape: tuple, y_dtype: Any, groups: int) -> tuple[int, int, int]:
    """The shapes `batched_gemm_bf16` takes: x [G P, K], w [G N, K], y bf16 bits [G P, N]; returns (P, N, K)."""
    p, n, k = x_shape[0] // max(groups, 1), w_shape[0] // max(groups, 1), x_shape[1]
    if groups < 1 or tuple(x_shape) != (groups * p, k) or tuple(w_shape) != (groups * n, k) or \
            tuple(y_shape) != (groups * p, n) or np.dtype(y_dtype) != np.uint16:
        raise ValueError(f"batched gemm shapes x{tuple(x_shape)} w{tuple(w_shape)} y{tuple(y_shape)} {y_dtype} over "
                         f"{groups} groups (bf16 y, equal rows a group)")
    return p, n, k


def check_chunked(x_shape: tuple, w_shape: tuple, y_shape: tuple, y_dtype: Any, chunk_groups: Any, chunk: int,
                  chunks: int) -> tuple[int, int]:
    """The shapes `chunked_gemm_bf16` takes: x [>= C chunk, K], w [G N, K], y bf16 bits [>= C chunk, N] for the C =
    `chunks` first entries of chunk_groups, in [0, G) (checked when the groups are on the host); returns (N, K)."""
    k, n = x_shape[1], y_shape[1]
    groups = w_shape[0] // max(n, 1)
    host_groups = chunk_groups[:chunks] if isinstance(chunk_groups, np.ndarray) else None
    if groups < 1 or chunk < 1 or not 0 <= chunks <= min(MAX_CHUNKS, len(chunk_groups)) or \
            tuple(w_shape) != (groups * n, k) or x_shape[0] < chunks * chunk or tuple(y_shape[1:]) != (n,) or \
            y_shape[0] < chunks * chunk or np.dtype(y_dtype) != np.uint16 or (
                host_groups is not None and chunks and not 0 <= int(np.min(host_groups)) <= int(
                    np.max(host_groups)) < groups):
        raise ValueError(f"chunked gemm shapes x{tuple(x_shape)} w{tuple(w_shape)} y{tuple(y_shape)} {y_dtype}: "
                         f"{chunks} chunks of {chunk} rows (of {len(chunk_groups)} groups' entries) over {groups} "
                         f"groups (bf16 y, at most {MAX_CHUNKS} chunks)")
    return n, k


def check_split_k(x_shape: tuple, w_shape: tuple, partials_shape: tuple, slices: int) -> None:
    """The shapes `split_k_gemm_bf16` takes: x [M, K], w [N, K], partials [S, M, N], K a multiple of 8 S (each
    slice's rows start 16-byte aligned)."""
    (m, k), (n, k2) = x_shape, w_shape
    if k != k2 or slices < 1 or k % (8 * slices) or tuple(partials_shape) != (slices, m, n):
        raise ValueError(f"split-K gemm shapes x{tuple(x_shape)} w{tuple(w_shape)} partials{tuple(partials_shape)} "
                         f"in {slices} slices (K a multiple of 8 slices, partials [slices, M, N])")


class Blas:
    def __init__(self, device: Any, *, stream_handle: int | None = None) -> None:
        """A handle bound to the device's serving stream, or to `stream_handle` (a side stream's)."""
        from nvmath.bindings import cublas

        self._cublas = cublas
        self._handle = cublas.create()
        self._stream_handle = device.stream_handle if stream_handle is None else stream_handle
        cublas.set_stream(self._handle, self._stream_handle)
        # A fixed workspace keeps cuBLAS from allocating during graph capture.
        self._workspace = device.empty(WORKSPACE_BYTES, np.uint8, "workspace")
        cublas.set_workspace(self._handle, device_pointer(self._workspace), WORKSPACE_BYTES)
        cublas.set_pointer_mode(self._handle, cublas.PointerMode.HOST)
        self._device = device
        if stream_handle is None:
            self._launch_stream = device.stream  # (the kernels' launches name the same stream)
        else:
            from ninfer.kernels_numba.numba_setup import cuda

            self._launch_stream = cuda.external_stream(stream_handle)
        # the grouped and chunked calls' operand addresses, written in stream order before each call
        self._addresses = device.empty(3 * max(MAX_GROUPS, MAX_CHUNKS), np.uint64, "workspace")
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)

    @property
    def handle(self) -> int:
        """The cuBLAS handle (bound to the device's stream), for calls this class does not wrap (probes)."""
        return self._handle

    def gemm_bf16(self, x: Any, w: Any, y: Any, *, accumulate: bool = False, first_column: int = 0) -> None:
        """y[:, first_column:first_column + N] (fp32, of a contiguous y [M, >= N]) (+)= x (bf16 [M, K]) @ w (bf16
        [N, K])^T; y's other columns are left alone (the parts of a split projection write their columns of one
        output: cuBLAS's leading dimension is y's row length)."""
        check_column_block(x.shape, w.shape, y.shape, first_column)
        (m, k), n = x.shape, w.shape[0]
        cublas = self._cublas
        beta = self._one if accumulate else self._zero
        cublas.gemm_ex(self._handle, cublas.Operation.T, cublas.Operation.N, n, m, k, self._one.ctypes.data,
                       device_pointer(w), CUDA_R_16BF, k, device_pointer(x), CUDA_R_16BF, k, beta.ctypes.data,
                       device_pointer(y) + 4 * first_column, CUDA_R_32F, y.shape[1], cublas.ComputeType.COMPUTE_32F,
                       cublas.GemmAlgo.DEFAULT)

    def split_k_gemm_bf16(self, x: Any, w: Any, partials: Any, slices: int) -> None:
        """partials[s] (fp32 [M, N]) = x[:, s K/S:(s+1) K/S] (bf16) @ w[:, s K/S:(s+1) K/S]^T for s < S = `slices`:
        one strided-batched call, each batch entry a slice of K (A and B advance K/S columns along their rows, C a
        whole partial), for a consumer that adds the slices itself (`elementwise.add_slices_rms_norm_rows`): split-K
        without cuBLAS's own reduction launch, in a fixed summation order."""
        check_split_k(x.shape, w.shape, partials.shape, slices)
        (m, k), n = x.shape, w.shape[0]
        part = k // slices
        cublas = self._cublas
        cublas.gemm_strided_batched_ex(
            self._handle, cublas.Operation.T, cublas.Operation.N, n, m, part, self._one.ctypes.data,
            device_pointer(w), CUDA_R_16BF, k, part, device_pointer(x), CUDA_R_16BF, k, part, self._zero.ctypes.data,
            device_pointer(partials), CUDA_R_32F, n, m * n, slices, cublas.ComputeType.COMPUTE_32F,
            cublas.GemmAlgo.DEFAULT)

    def grouped_gemm_bf16(self, x: Any, w: Any, y: Any, offsets: np.ndarray, rows_per_group: int) -> None:
        """For each group g with rows: y[offsets[g]:offsets[g+1]] (bf16 bits [., N]) = x[those rows] (bf16 [., K]) @
        w[g N:(g+1) N]^T (w bf16 [G N, K], N = rows_per_group), fp32 accumulation rounded once to bf16. The MoE
        prefill: tokens sorted by expert, every expert that has tokens in ONE cuBLAS grouped GEMM
        (cublasGemmGroupedBatchedEx). One GEMM call per expert cost ~17 us of host time each (4.3 ms a layer's
        projection at 8K tokens, against 1.1 ms grouped); the grouped call takes bf16 outputs only (fp32 C is
        CUBLAS_STATUS_NOT_SUPPORTED, bench/results/grouped_gemm_probe_session7.json). The per-group operand
        addresses go to the device in stream order, so the buffer is free again for the next call."""
        groups = len(offsets) - 1
        n, k = int(rows_per_group), x.shape[1]
        if w.shape != (groups * n, k) or y.shape[1] != n or y.shape[0] < int(offsets[-1]) or \
                x.shape[0] < int(offsets[-1]) or y.dtype != np.uint16 or groups > MAX_GROUPS:
            raise ValueError(f"grouped gemm shapes x{tuple(x.shape)} w{tuple(w.shape)} y{tuple(y.shape)} {y.dtype}, "
                             f"{groups} groups of {n} rows (bf16 y, at most {MAX_GROUPS} groups)")
        starts = np.asarray(offsets[:-1], np.int64)
        counts = np.asarray(offsets[1:], np.int64) - starts
        live = np.flatnonzero(counts > 0)
        g = int(live.size)
        if g == 0:
            return
        addresses = np.concatenate([device_pointer(w) + live * (n * k * 2), device_pointer(x) + starts[live] * (k * 2),
                                    device_pointer(y) + starts[live] * (n * 2)]).astype(np.uint64)
        self._device.write(self._addresses[:3 * g], addresses, stream_handle=self._stream_handle)
        table = device_pointer(self._addresses)
        cublas = self._cublas
        # Per-group host arrays, read by cuBLAS during the call. Each group is one problem, the column-major
        # y_e^T = W_e . x_e^T of `gemm_bf16` on the expert's rows.
        arguments = {"transa": np.full(g, int(cublas.Operation.T), np.int32),
                     "transb": np.full(g, int(cublas.Operation.N), np.int32),
                     "m": np.full(g, n, np.int32), "n": counts[live].astype(np.int32), "k": np.full(g, k, np.int32),
                     "alpha": np.ones(g, np.float32), "beta": np.zeros(g, np.float32),
                     "size": np.ones(g, np.int32)}
        at = {name: array.ctypes.data for name, array in arguments.items()}
        cublas.gemm_grouped_batched_ex(
            self._handle, at["transa"], at["transb"], at["m"], at["n"], at["k"], at["alpha"], table, CUDA_R_16BF,
            at["k"], table + 8 * g, CUDA_R_16BF, at["k"], at["beta"], table + 16 * g, CUDA_R_16BF, at["m"], g,
            at["size"], cublas.ComputeType.COMPUTE_32F)

    def batched_gemm_bf16(self, x: Any, w: Any, y: Any, groups: int) -> None:
        """For each group g: y[g P:(g+1) P] (bf16 bits [., N]) = x[g P:(g+1) P] (bf16 [., K]) @ w[g N:(g+1) N]^T, with
        P = x.shape[0] // groups rows a group and N = w.shape[0] // groups; fp32 accumulation rounded once to bf16.
        The MoE prefill with every expert's rows padded to the largest count (moe_pad_positions): one strided-
        batched GEMM, which gets cuBLAS's sm90 kernels where the grouped call runs an sm80 one. On the 35B-A3B's
        gate_up at 8K tokens: 484 TFLOP/s of useful work at 20% padding against the grouped call's 210
        (results/grouped_gemm_probe_session12.json), bit for bit the same products."""
        p, n, k = check_batched(x.shape, w.shape, y.shape, y.dtype, groups)
        if p == 0:
            return
        cublas = self._cublas
        # Column-major per group, as gemm_bf16: y_g^T = W_g . x_g^T.
        cublas.gemm_strided_batched_ex(
            self._handle, cublas.Operation.T, cublas.Operation.N, n, p, k, self._one.ctypes.data, device_pointer(w),
            CUDA_R_16BF, k, n * k, device_pointer(x), CUDA_R_16BF, k, p * k, self._zero.ctypes.data,
            device_pointer(y), CUDA_R_16BF, n, p * n, groups, cublas.ComputeType.COMPUTE_32F, cublas.GemmAlgo.DEFAULT)

    def chunked_gemm_bf16(self, x: Any, w: Any, y: Any, chunk_groups: Any, chunk: int,
                          chunks: int | None = None) -> None:
        """For each chunk i < C: y[i C:(i+1) C] (bf16 bits [., N]) = x[i C:(i+1) C] (bf16 [., K]) @ w[g N:(g+1) N]^T,
        g = chunk_groups[i], C = chunk; fp32 accumulation rounded once to bf16. The MoE prefill with each expert's
        rows padded to whole chunks (moe_pad_positions): one pointer-array batched GEMM (cublasGemmBatchedEx),
        padding under a chunk an expert whatever the routing's skew. C = `chunks` (default: every entry of
        chunk_groups). chunk_groups int32 on the host (the operand addresses then go to the device in stream order,
        as the grouped call's) or on the device (moe_chunk_groups' map: a kernel writes the addresses, and the host
        sends nothing; with `chunks`, whole workspace buffers serve every call, no view made per count)."""
        from ninfer.kernels_numba import moe

        chunks = len(chunk_groups) if chunks is None else int(chunks)
        n, k = check_chunked(x.shape, w.shape, y.shape, y.dtype, chunk_groups, chunk, chunks)
        if chunks == 0:
            return
        operands = dict(w_address=device_pointer(w), x_address=device_pointer(x), y_address=device_pointer(y), n=n,
                        k=k, chunk=chunk)
        if isinstance(chunk_groups, np.ndarray):
            self._device.write(self._addresses[:3 * chunks],
                               moe.chunk_addresses_reference(chunk_groups[:chunks], **operands),
                               stream_handle=self._stream_handle)
        else:
            moe.chunk_addresses(chunk_groups, self._addresses, chunks=chunks, stream=self._launch_stream, **operands)
        table = device_pointer(self._addresses)
        cublas = self._cublas
        cublas.gemm_batched_ex(
            self._handle, cublas.Operation.T, cublas.Operation.N, n, chunk, k, self._one.ctypes.data, table,
            CUDA_R_16BF, k, table + 8 * chunks, CUDA_R_16BF, k, self._zero.ctypes.data, table + 16 * chunks,
            CUDA_R_16BF, n, chunks, cublas.ComputeType.COMPUTE_32F, cublas.GemmAlgo.DEFAULT)

    def batched_scores(self, q: Any, k: Any, keys: int, scores: Any) -> None:
        """scores[b] (fp32 [M, keys]) = q[b] (bf16 [M, D]) @ k[b, :keys]^T (k bf16 [B, S >= keys, D]). q and k may
        be views whose rows are contiguous ([B, rows, D] slices of bigger head-major arrays): their batch strides
        are read from the arrays."""
        batch, m, d = q.shape
        stride_k, stride_q = k.strides[0] // k.dtype.itemsize, q.strides[0] // q.dtype.itemsize
        cublas = self._cublas
        cublas.gemm_strided_batched_ex(
            self._handle, cublas.Operation.T, cublas.Operation.N, keys, m, d, self._one.ctypes.data,
            device_pointer(k), CUDA_R_16BF, d, stride_k, device_pointer(q), CUDA_R_16BF, d, stride_q,
            self._zero.ctypes.data, device_pointer(scores), CUDA_R_32F, keys, m * keys, batch,
            cublas.ComputeType.COMPUTE_32F, cublas.GemmAlgo.DEFAULT)

    def batched_values(self, probs: Any, v: Any, keys: int, out: Any) -> None:
        """out[b] (fp32 [M, D]) = probs[b] (bf16 [M, keys]) @ v[b, :keys] (v bf16 [B, S >= keys, D]; a view's batch
        stride is read from the array)."""
        batch, m, _ = probs.shape
        d = v.shape[2]
        stride_v = v.strides[0] // v.dtype.itemsize
        cublas = self._cublas
        cublas.gemm_strided_batched_ex(
            self._handle, cublas.Operation.N, cublas.Operation.N, d, m, keys, self._one.ctypes.data,
            device_pointer(v), CUDA_R_16BF, d, stride_v, device_pointer(probs), CUDA_R_16BF, keys, m * keys,
            self._zero.ctypes.data, device_pointer(out), CUDA_R_32F, d, m * d, batch,
            cublas.ComputeType.COMPUTE_32F, cublas.GemmAlgo.DEFAULT)

    def close(self) -> None:
        if self._handle:
            self._cublas.destroy(self._handle)
            self._handle = 0
