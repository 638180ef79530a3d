"""Does cuBLASLt's grouped matmul, whose per-group sizes live on the device, run the MoE prefill's expert GEMMs on
this GPU, how fast, and at what host cost?

Why: the MoE prefill copies the experts' row counts to the host before every layer's expert GEMMs, because
cublasGemmBatchedEx and cublasGemmGroupedBatchedEx take their sizes from the host. Since session 21 that round trip
is what the 35B-A3B bf16 8K prefill waits on: its GPU is busy ~156 of ~165 ms, idle where the host, woken by the
counts, has not yet queued the first expert GEMM. cuBLASLt (13.x) has an experimental grouped mode
(`grouped_matrix_layout_create`: rows, columns and leading dimensions as device arrays, one entry a group; operand
pointers as device arrays; alpha and beta host scalars, the same for every group): if the heuristic offers an
algorithm here, the counts never need to reach the host, and the whole MoE layer could even be captured.

What it does, at the 35B-A3B's routed gate_up (256 experts, [1024, 2048]) and down ([2048, 512]) over 65,536 rows,
uniform and skewed routings (some experts without rows):
  - asks the heuristic (with the average-size hints) for algorithms; none means "not supported here" (reported);
  - runs one grouped call and compares its bf16 output with `Blas.grouped_gemm_bf16` (host-sized grouped GEMM) on
    every row: the fraction of equal bits and the largest relative difference;
  - GPU time per call (events) of the Lt call, the host-sized grouped call and the chunked pointer-array call the
    model uses now (128-row chunks), and the host time of each call.

Run on the GPU machine: `python bench/grouped_lt_probe.py`; JSON to $OUT/grouped_lt_probe.json (bench/results
without OUT).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_report  # noqa: E402
from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402

EXPERTS, TOKENS, SLOTS, CHUNK = 256, 8192, 8, 128
SHAPES = {"gate_up": (1024, 2048), "down": (2048, 512)}  # (N, K): y[rows, N] = x[rows, K] @ w_e[N, K]^T
REPEATS = 20
WORKSPACE = 32 << 20


def expert_counts(rng: np.random.Generator, routing: str) -> np.ndarray:
    popularity = np.full(EXPERTS, 1.0 / EXPERTS) if routing == "uniform" else rng.dirichlet(np.full(EXPERTS, 0.3))
    counts = rng.multinomial(TOKENS * SLOTS, popularity)
    if routing == "skewed":  # a few experts without rows, as a real router leaves them
        counts[rng.choice(EXPERTS, 8, replace=False)] = 0
    return counts


class GroupedLt:
    """One grouped cuBLASLt matmul shape: y_e^T = W_e . x_e^T (column-major, as `Blas.gemm_bf16`), the group sizes,
    leading dimensions and operand pointers in device arrays; alpha = 1 and beta = 0 host scalars (session 22: this
    cuBLASLt refused ALPHA_BATCH_STRIDE, the per-group device vectors, with CUBLAS_STATUS_INVALID_VALUE)."""

    def __init__(self, device, n: int, k: int, groups: int) -> None:
        from nvmath.bindings import cublas
        from nvmath.bindings import cublasLt as lt

        self.lt, self.device, self.groups = lt, device, groups
        self.handle = lt.create()
        self.version = int(lt.get_version())
        bf16, f32 = 14, 0  # CUDA_R_16BF, CUDA_R_32F
        self.desc = lt.matmul_desc_create(int(cublas.ComputeType.COMPUTE_32F), f32)
        self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, self.desc,
                  lt.MatmulDescAttribute.TRANSA, int(cublas.Operation.T))
        self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, self.desc,
                  lt.MatmulDescAttribute.TRANSB, int(cublas.Operation.N))

        def column(value: int) -> object:
            array = device.empty(groups, np.int64, "bench")
            device.write(array, np.full(groups, value, np.int64))
            return array

        from ninfer.backends.cuda.device import device_pointer

        self.pointer = device_pointer
        self.k_array, self.n_array, self.rows = column(k), column(n), device.empty(groups, np.int64, "bench")
        self.ld_k, self.ld_n = column(k), column(n)
        self.alpha, self.beta = np.ones(1, np.float32), np.zeros(1, np.float32)  # host pointer mode (the default)
        self.pointers = device.empty(3 * groups, np.uint64, "bench")
        p = device_pointer
        # A = W_e stored [K, N] column-major (rows K, columns N); B = x_e [K, rows]; C = D = y_e [N, rows]
        self.layouts = [lt.grouped_matrix_layout_create(bf16, groups, p(rows), p(cols), p(ld))
                        for rows, cols, ld in ((self.k_array, self.n_array, self.ld_k),
                                               (self.k_array, self.rows, self.ld_k),
                                               (self.n_array, self.rows, self.ld_n),
                                               (self.n_array, self.rows, self.ld_n))]
        for layout in self.layouts:
            for attribute in (lt.MatrixLayoutAttribute.GROUPED_ROWS_COLS_ARRAY_INTEGER_WIDTH,
                              lt.MatrixLayoutAttribute.GROUPED_LD_ARRAY_INTEGER_WIDTH):
                self._set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype, layout, attribute,
                          int(lt.IntegerWidth.WIDTH_64))
        self.preference = lt.matmul_preference_create()
        for attribute, value in ((lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, WORKSPACE),
                                 (lt.MatmulPreferenceAttribute.GROUPED_DESC_D_AVERAGE_ROWS, n),
                                 (lt.MatmulPreferenceAttribute.GROUPED_DESC_D_AVERAGE_COLS,
                                  TOKENS * SLOTS // groups),
                                 (lt.MatmulPreferenceAttribute.GROUPED_AVERAGE_REDUCTION_DIM, k)):
            self._set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype,
                      self.preference, attribute, value)
        self.results = lt.MatmulHeuristicResult(8)
        found = np.zeros(1, np.int32)
        a, b, c, d = self.layouts
        lt.matmul_algo_get_heuristic(self.handle, self.desc, a, b, c, d, self.preference, 8, self.results.ptr,
                                     found.ctypes.data)
        self.algorithms = int(found[0])
        self.workspace = device.empty(WORKSPACE, np.uint8, "bench")

    @staticmethod
    def _set(setter, dtype_of, target, attribute, value) -> None:
        buffer = np.array([value], dtype=dtype_of(attribute))
        setter(target, attribute, buffer.ctypes.data, buffer.nbytes)

    def set_groups(self, w, x, y, offsets: np.ndarray, n: int, k: int) -> None:
        """The groups' rows and operand addresses (in a model, a kernel would write both from moe_group's output)."""
        starts = np.asarray(offsets[:-1], np.uint64)
        g = np.arange(self.groups, dtype=np.uint64)
        p = self.pointer
        self.device.write(self.rows, np.diff(offsets).astype(np.int64))
        self.device.write(self.pointers, np.concatenate([
            p(w) + g * np.uint64(n * k * 2), p(x) + starts * np.uint64(k * 2),
            p(y) + starts * np.uint64(n * 2)]).astype(np.uint64))

    def __call__(self) -> None:
        a, b, c, d = self.layouts
        table, g = self.pointer(self.pointers), self.groups
        self.lt.matmul(self.handle, self.desc, self.alpha.ctypes.data, table, a, table + 8 * g, b,
                       self.beta.ctypes.data, table + 16 * g, c, table + 16 * g, d, self.results.ptr,
                       self.pointer(self.workspace), WORKSPACE, self.device.stream_handle)


def gpu_and_host_us(device, run) -> tuple[float, float]:
    """(median GPU microseconds a call by events, median host microseconds inside the call)."""
    from ninfer.kernels_numba.numba_setup import cuda

    gpu, host = [], []
    for _ in range(REPEATS):
        device.synchronize()
        start, end = cuda.event(), cuda.event()
        start.record(device.stream)
        began = time.perf_counter()
        run()
        host.append(time.perf_counter() - began)
        end.record(device.stream)
        end.synchronize()
        gpu.append(cuda.event_elapsed_time(start, end) / 1e3)
    return float(np.median(gpu) * 1e6), float(np.median(host) * 1e6)


def main() -> None:
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.device import CudaDevice

    device = CudaDevice(0)
    blas = Blas(device)
    rng = np.random.default_rng(0)
    report = {"device": device.info.name, "experts": EXPERTS, "rows": TOKENS * SLOTS, "cases": []}
    for shape, (n, k) in SHAPES.items():
        w = device.empty((EXPERTS * n, k), np.uint16, "bench")
        one = f32_to_bf16_bits((rng.standard_normal((n, k)) * 0.02).astype(np.float32))
        for e in range(EXPERTS):  # one random expert repeated: times do not depend on the values
            device.write(w[e * n:(e + 1) * n], one)
        try:
            grouped = GroupedLt(device, n, k, EXPERTS)
        except Exception as exc:  # this cuBLASLt has no grouped matmul (session 23: no such entry point)
            grouped, absent = None, repr(exc)
            print(f"{shape}: cuBLASLt has no grouped matmul here: {absent}", flush=True)
        else:
            print(f"{shape}: cuBLASLt {grouped.version}, grouped algorithms offered: {grouped.algorithms}", flush=True)
        for routing in ("uniform", "skewed"):
            counts = expert_counts(rng, routing)
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            rows = int(offsets[-1])
            x = device.empty((rows, k), np.uint16, "bench")
            device.write(x, f32_to_bf16_bits(rng.standard_normal((rows, k)).astype(np.float32)))
            flops = 2.0 * rows * n * k
            want = device.empty((rows, n), np.uint16, "bench")
            case = {"shape": shape, "routing": routing, "empty_experts": int((counts == 0).sum())}
            if grouped is None:
                case["lt_grouped"] = {"error": absent}
            else:
                case.update(lt_version=grouped.version, lt_algorithms=grouped.algorithms)
            gpu, host = gpu_and_host_us(device, lambda: blas.grouped_gemm_bf16(x, w, want, offsets, n))
            case["host_sized_grouped"] = {"gpu_us": gpu, "host_us": host, "tflop_s": flops / gpu / 1e6}
            chunk_groups = np.repeat(np.arange(EXPERTS), -(-counts // CHUNK))
            x_chunked = device.empty((len(chunk_groups) * CHUNK, k), np.uint16, "bench")
            y_chunked = device.empty((len(chunk_groups) * CHUNK, n), np.uint16, "bench")
            gpu, host = gpu_and_host_us(device, lambda: blas.chunked_gemm_bf16(x_chunked, w, y_chunked, chunk_groups,
                                                                               CHUNK))
            case["chunked_128"] = {"gpu_us": gpu, "host_us": host, "tflop_s": flops / gpu / 1e6,
                                   "chunks": int(len(chunk_groups))}
            if grouped is not None and grouped.algorithms:
                got = device.empty((rows, n), np.uint16, "bench")
                grouped.set_groups(w, x, got, offsets, n, k)
                try:
                    gpu, host = gpu_and_host_us(device, grouped)
                    device.synchronize()
                    a, b = bf16_bits_to_f32(got.copy_to_host()), bf16_bits_to_f32(want.copy_to_host())
                    case["lt_grouped"] = {
                        "gpu_us": gpu, "host_us": host, "tflop_s": flops / gpu / 1e6,
                        "equal_bits": float(np.mean(got.copy_to_host() == want.copy_to_host())),
                        "max_relative_difference": float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))}
                except Exception as exc:  # the heuristic offered one, the call refused: say how
                    case["lt_grouped"] = {"error": repr(exc)}
            report["cases"].append(case)
            print(json.dumps(case), flush=True)
            x = x_chunked = y_chunked = want = None
        w = None
    write_report("grouped_lt_probe", report)


if __name__ == "__main__":
    main()
