"""Capacity.decode_linear = "auto": the decode path of each bf16 matrix shape, timed on this GPU when the model is
built, instead of one path for every shape.

Why: at decode each bf16 projection is a GEMV of 1-8 rows, latency-bound below a few tens of MB, and which path
wins depends on the shape. On the H200 (35B-A3B bf16, B=1, results/cuda_model_35b_geometries_session27.json) the
GDN layers' two cuBLAS GEMVs of 30 launches a step took 16.2 and 14.2 us (one is the 50 MB in-projection, the other
the 16.8 MB out projection or the 0.3 MB a/b one), the other cuBLAS decode GEMVs, 0.3-17 MB each, 7.6 us plus a 2.4
us split-K reduction (40 launches), 6.0 (80) and 3.9 (40): a few us of bytes each. The skinny kernel (a warp a row
or two, K whole) and the narrow one (K split over a block's warps) trade differently.

Each shape gets the path with the least time summed over one row and the padded decode rows (the single-stream
case and the batched one), each timed as REPEATS launches captured in one graph and replayed, as decode runs them.
cuBLAS and the tensor-core kernel are timed on a bf16 copy made beforehand, as their decode producers write one beside
their fp32 output. The choice is one path a shape whatever the rows, so a row's result never depends on the batch
(the paths are each batch invariant: cuBLAS padded to the decode rows, the kernels by construction)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from ninfer.backends.cuda.timing import captured_repeats
from ninfer.kernels_numba.linear_mma import BLOCK as MMA_BLOCK
from ninfer.kernels_numba.linear_narrow import NARROW_MAX_K

DECODE_PATHS = ("cublas", "mma", "kernels", "narrow")  # cuBLAS first: ties keep the default
BF16_INPUT_PATHS = ("cublas", "mma")  # the paths that read the activation's bf16 copy
REPEATS = 20  # launches a timed graph holds
REPLAYS = 5  # timed replays of it (median)


def candidate_paths(shape: tuple[int, int]) -> tuple[str, ...]:
    """The decode paths that can multiply a bf16 [N, K] matrix (the narrow kernel holds K <= NARROW_MAX_K, the
    tensor-core one K of whole 64-column blocks)."""
    return tuple(path for path in DECODE_PATHS if (path != "narrow" or shape[1] <= NARROW_MAX_K)
                 and (path != "mma" or shape[1] % MMA_BLOCK == 0))


def fastest_paths(shapes: Iterable[tuple[int, int]],
                  seconds: Callable[[tuple[int, int], str], float]) -> tuple[dict, dict]:
    """({shape: the candidate path of least `seconds(shape, path)`, ties to the earlier path}, {shape: {path:
    seconds}})."""
    paths, timings = {}, {}
    for shape in dict.fromkeys(shapes):
        timings[shape] = {path: seconds(shape, path) for path in candidate_paths(shape)}
        paths[shape] = min(timings[shape], key=lambda path: (timings[shape][path], DECODE_PATHS.index(path)))
    return paths, timings


def tune_decode_paths(linear: Any, device: Any, matrices: Iterable[Any], rows: tuple[int, ...],
                      rng: np.random.Generator | None = None) -> tuple[dict, dict]:
    """Time every candidate path of each distinct bf16 matrix shape through `linear` (a `model.Linear`:
    `bf16_decode`, `bf16_input`) at each row count of `rows`, on `device` (a CudaDevice: graphs, wall clock);
    `fastest_paths` of the summed seconds. The timing buffers are freed when it returns."""
    rng = rng or np.random.default_rng(0)
    by_shape = {tuple(m.shape): m for m in matrices}
    if not by_shape:
        return {}, {}
    most = max(max(rows), linear.pad_rows)  # cuBLAS pads only when x and y hold the padded rows, as decode's do
    widest_k = max(k for _, k in by_shape)
    widest_n = max(n for n, _ in by_shape)
    x_words = device.upload((0.1 * rng.standard_normal(most * widest_k)).astype(np.float32), "tuning")
    y_words = device.empty(most * widest_n, np.float32, "tuning")
    k = device.kernels

    def seconds(shape: tuple[int, int], path: str) -> float:
        n, width = shape
        x, y = x_words[: most * width].reshape(most, width), y_words[: most * n].reshape(most, n)
        total = 0.0
        for count in rows:
            x_bf16 = None
            if path in BF16_INPUT_PATHS:  # their producers write the bf16 copy beside their own output
                x_bf16 = linear.bf16_input(count, width)
                k.to_bf16_rows(x[:count], x_bf16, stream=linear.stream)
            graph, each = captured_repeats(
                device, lambda: linear.bf16_decode(path, x, by_shape[shape], y, count, x_bf16=x_bf16), REPEATS,
                replays=REPLAYS)
            graph.close()
            total += each
        return total

    try:
        return fastest_paths(by_shape, seconds)
    finally:
        device.ledger["tuning"] -= x_words.nbytes + y_words.nbytes  # freed with the arrays
        if not device.ledger["tuning"]:
            del device.ledger["tuning"]
