"""The Qwen3.6 Vision tower on the GPU: the math of `models.qwen3_6_vision.VisionTower`, as bf16 cuBLAS GEMMs with
fp32 results and the `kernels_numba.vision` kernels around them. The CUDA build uses it by default (`build_cuda_runner
(..., vision_on_device=True)`); the host tower stays available with `vision_on_device=False`.

Weights are the host tower's (dequantized fp32) rounded once to bf16 and uploaded at startup (about 0.8 GB for the
27-block tower). Per item: patch embedding (the GEMM accumulated onto the uploaded bias + interpolated position
embedding), then per block LayerNorm -> qkv GEMM -> bias + 2-D RoPE into head-major q/k/v -> attention per temporal
slice (scores and values as strided-batched GEMMs around a softmax over all keys of the slice, queries in blocks
bounded by `score_bytes`, each block's output GEMM accumulated into the residual) -> LayerNorm -> fc1 -> tanh-GELU ->
fc2 accumulated; then the merger (LayerNorm over each group of merge^2 rows, fc1, erf-GELU, fc2). The residual GEMMs
leave their bias to the next LayerNorm, which adds it to the residual as it reads it.

Scratch is one arena allocated at startup for the largest item the server admits (`max_patches`) and charged once to
the ledger as "vision scratch"; an item takes views of it, so encoding allocates nothing on the device. Only the
residual, q/k/v and the RoPE tables scale with the item: the row-local work (patch embedding, qkv + heads, the MLP,
the merger) runs in chunks of `chunk_rows` rows, so its wide fp32 intermediates are per chunk. Media encoding runs
between scheduler rounds, never inside a captured graph.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterator

import numpy as np

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.models.qwen3_6_vision import LAYER_NORM_EPS, VisionTower
from ninfer.targets.dims import VisionDims

SCORE_BYTES = 256 << 20  # fp32 attention scores of one query block, all heads
CHUNK_ROWS = 4096  # rows of one pass of the row-local work (a multiple of every merge group)
# Grids whose position embeddings stay computed: images of one size recur (screenshots, one camera), and the
# interpolation runs on the host before any GPU work (27-46 ms at 64 x 64 patches, 19 MB each).
EMBEDDING_GRIDS = 4


def scratch_plan(dims: VisionDims, *, max_patches: int, chunk_rows: int = CHUNK_ROWS,
                 score_bytes: int = SCORE_BYTES) -> dict[str, tuple[int, Any]]:
    """The arena's buffers: name -> (elements, dtype), for items of up to `max_patches` patches."""
    heads, hidden, group = dims.heads, dims.hidden, dims.spatial_merge * dims.spatial_merge
    head_dim = hidden // heads
    chunk = min(chunk_rows, max_patches)
    score_keys = score_bytes // (4 * heads)  # scores per head of one query block
    query_rows = min(max_patches, math.isqrt(score_keys))  # the most rows min(side, score_keys // side) can reach
    wide = chunk * max(dims.intermediate, hidden)  # MLP fc1 rows, or the merger's chunk / group rows of group * hidden
    return {
        "x": (max_patches * hidden, np.float32),  # the residual stream
        "q": (heads * max_patches * head_dim, np.uint16),
        "k": (heads * max_patches * head_dim, np.uint16),
        "v": (heads * max_patches * head_dim, np.uint16),
        "cos": (max_patches * head_dim // 2, np.float32),
        "sin": (max_patches * head_dim // 2, np.float32),
        "patches": (chunk * dims.patch_row, np.uint16),
        "normed": (chunk * hidden, np.uint16),
        "qkv": (max(chunk * 3 * hidden, chunk // group * dims.out_hidden), np.float32),  # also the merger's output
        "wide": (wide, np.float32),
        "wide_bf16": (wide, np.uint16),
        "scores": (heads * min(max_patches * max_patches, score_keys), np.float32),
        "probs": (heads * min(max_patches * max_patches, score_keys), np.uint16),
        "heads_out": (heads * query_rows * head_dim, np.float32),
        "attended": (query_rows * hidden, np.uint16),
    }


def scratch_bytes(plan: dict[str, tuple[int, Any]]) -> int:
    return sum(count * np.dtype(dtype).itemsize for count, dtype in plan.values())


def head_rows(array: Any, first: int, rows: int) -> Any:
    """array[:, first:first + rows] of a head-major [heads, n, head_dim] buffer. numba's slicing walks every
    contiguous extent of a strided view in Python (about 1.4 s of host time per 1024x1024 image, measured); a device
    array is built from the base pointer and the strides instead."""
    if not hasattr(array, "gpu_data"):  # a HostDevice (NumPy) array
        return array[:, first:first + rows]
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray((array.shape[0], rows, array.shape[2]), array.strides, array.dtype,
                         gpu_data=array.gpu_data.view(first * array.strides[1]))


class CudaVisionTower:
    """`encode_item` for items of up to `max_patches` patches. `chunk_rows` and `score_bytes` bound the per-chunk and
    attention scratch (tests shrink them to cover several chunks and query blocks with tiny items)."""

    def __init__(self, tower: VisionTower, device: Any, *, max_patches: int, chunk_rows: int = CHUNK_ROWS,
                 score_bytes: int = SCORE_BYTES) -> None:
        d = tower.dims
        group = d.spatial_merge * d.spatial_merge
        if max_patches < group or chunk_rows < group or chunk_rows % group:
            raise ValueError(f"max_patches {max_patches} and chunk_rows {chunk_rows} must hold whole merge groups of "
                             f"{group} (chunk_rows a multiple of it)")
        if 4 * d.heads * max_patches > score_bytes:
            raise ValueError(f"score_bytes {score_bytes} cannot hold one query row of {max_patches} keys "
                             f"for {d.heads} heads")
        # the grid geometry and the patch bias are all of the host tower an encode needs: its weights go
        self._geometry, self._patch_bias, self.device, self.dims = tower.geometry, tower.patch_b, device, d
        self.max_patches, self._chunk_rows = max_patches, chunk_rows
        self._score_keys = score_bytes // (4 * d.heads)
        self._slice_embedding = functools.lru_cache(maxsize=EMBEDDING_GRIDS)(self._compute_slice_embedding)

        def matrix(value: np.ndarray) -> Any:
            return device.upload(f32_to_bf16_bits(np.asarray(value, np.float32)), "vision")

        def vector(value: np.ndarray) -> Any:
            return device.upload(np.ascontiguousarray(value, np.float32), "vision")

        self.patch_w = matrix(tower.patch_w)
        self.blocks = [{name: (matrix(value) if value.ndim == 2 else vector(value)) for name, value in block.items()}
                       for block in tower.blocks]
        self.merger = {name: (matrix(value) if value.ndim == 2 else vector(value))
                       for name, value in tower.merger.items()}
        plan = scratch_plan(d, max_patches=max_patches, chunk_rows=chunk_rows, score_bytes=score_bytes)
        self._arena = {name: device.empty(count, dtype, "vision scratch") for name, (count, dtype) in plan.items()}
        self.scratch_bytes = scratch_bytes(plan)
        self._blas = device.blas()

    def _view(self, name: str, *shape: int) -> Any:
        """The first prod(shape) elements of arena buffer `name`, shaped."""
        return self._arena[name][: math.prod(shape)].reshape(shape)

    def _chunks(self, n: int) -> Iterator[tuple[int, int]]:
        for first in range(0, n, self._chunk_rows):
            yield first, min(self._chunk_rows, n - first)

    def _compute_slice_embedding(self, h: int, w: int) -> np.ndarray:
        """Position embeddings of one h x w slice plus the patch bias, read-only (it is shared between calls)."""
        embedding = self._geometry.position_embeddings(1, h, w) + self._patch_bias
        embedding.setflags(write=False)
        return embedding

    def encode_item(self, patches_bf16: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """One item's bf16 patch rows `[t*h*w, patch_row]` -> merged tokens fp32 `[t*h*w / merge^2, out_hidden]`."""
        d, device, k, blas, view = self.dims, self.device, self.device.kernels, self._blas, self._view
        stream = device.stream
        t, h, w = (int(v) for v in grid)
        n, hidden, heads, merge = t * h * w, d.hidden, d.heads, d.spatial_merge
        head_dim = hidden // heads
        if patches_bf16.shape != (n, d.patch_row):
            raise ValueError(f"patches {patches_bf16.shape} do not match grid {grid} (rows of {d.patch_row})")
        if h % merge or w % merge:
            raise ValueError(f"grid {grid}: h and w must be multiples of the spatial merge {merge}")
        if n > self.max_patches:
            raise ValueError(f"an item of {n} patches (grid {grid}) exceeds this Vision tower's {self.max_patches}")
        x = view("x", n, hidden)
        q, key, value = (view(name, heads, n, head_dim) for name in ("q", "k", "v"))
        cos, sin = view("cos", n, head_dim // 2), view("sin", n, head_dim // 2)
        angles = self._geometry.rope_angles(t, h, w)
        device.write(cos, np.cos(angles))
        device.write(sin, np.sin(angles))
        side = h * w  # one temporal slice attends to itself only
        embedding = self._slice_embedding(h, w)  # the same for every temporal slice
        for first, rows in self._chunks(n):
            patches = view("patches", rows, d.patch_row)
            device.write(patches, patches_bf16[first:first + rows])
            start = first % side
            device.write(x[first:first + rows], embedding[start:start + rows] if start + rows <= side
                         else embedding[np.arange(first, first + rows) % side])
            blas.gemm_bf16(patches, self.patch_w, x[first:first + rows], accumulate=True)
        pending = None  # the bias the last residual GEMM left for the next LayerNorm to add
        block_rows = min(side, self._score_keys // side)
        for blk in self.blocks:
            for first, rows in self._chunks(n):
                normed, qkv = view("normed", rows, hidden), view("qkv", rows, 3 * hidden)
                k.layer_norm_bf16(x[first:first + rows], blk["norm1/weight"], blk["norm1/bias"], normed,
                                  eps=LAYER_NORM_EPS, pending_bias=pending, stream=stream)
                blas.gemm_bf16(normed, blk["attention/qkv"], qkv)
                k.vision_heads(qkv, blk["attention/qkv_bias"], cos, sin, q, key, value,
                               scale=1.0 / math.sqrt(head_dim), first=first, stream=stream)
            for start in range(0, n, side):
                keys, values = head_rows(key, start, side), head_rows(value, start, side)
                for first in range(start, start + side, block_rows):
                    rows = min(block_rows, start + side - first)
                    scores, probs = view("scores", heads, rows, side), view("probs", heads, rows, side)
                    heads_out, attended = view("heads_out", heads, rows, head_dim), view("attended", rows, hidden)
                    blas.batched_scores(head_rows(q, first, rows), keys, side, scores)
                    k.vision_softmax(scores, probs, stream=stream)
                    blas.batched_values(probs, values, side, heads_out)
                    k.vision_merge_heads(heads_out, attended, stream=stream)
                    blas.gemm_bf16(attended, blk["attention/output"], x[first:first + rows], accumulate=True)
            for first, rows in self._chunks(n):
                normed = view("normed", rows, hidden)
                fc1, activated = view("wide", rows, d.intermediate), view("wide_bf16", rows, d.intermediate)
                k.layer_norm_bf16(x[first:first + rows], blk["norm2/weight"], blk["norm2/bias"], normed,
                                  eps=LAYER_NORM_EPS, pending_bias=blk["attention/output_bias"], stream=stream)
                blas.gemm_bf16(normed, blk["mlp/fc1"], fc1)
                k.bias_gelu_bf16(fc1, blk["mlp/fc1_bias"], activated, exact=False, stream=stream)
                blas.gemm_bf16(activated, blk["mlp/fc2"], x[first:first + rows], accumulate=True)
            pending = blk["mlp/fc2_bias"]
        return self._merge(x, pending)

    def _merge(self, x: Any, pending: Any) -> np.ndarray:
        """The merger over the residual `x` (still owed `pending`), chunk by chunk; chunks hold whole merge groups."""
        d, device, k, blas, view, mg = self.dims, self.device, self.device.kernels, self._blas, self._view, self.merger
        group = d.spatial_merge * d.spatial_merge
        merged = np.empty((x.shape[0] // group, d.out_hidden), np.float32)
        for first, rows in self._chunks(x.shape[0]):
            tokens = rows // group
            normed = view("normed", rows, d.hidden)
            fc1, activated = view("wide", tokens, d.merged_hidden), view("wide_bf16", tokens, d.merged_hidden)
            out = view("qkv", tokens, d.out_hidden)
            k.layer_norm_bf16(x[first:first + rows], mg["norm/weight"], mg["norm/bias"], normed, eps=LAYER_NORM_EPS,
                              pending_bias=pending, stream=device.stream)
            blas.gemm_bf16(normed.reshape(tokens, d.merged_hidden), mg["fc1"], fc1)
            k.bias_gelu_bf16(fc1, mg["fc1_bias"], activated, exact=True, stream=device.stream)
            blas.gemm_bf16(activated, mg["fc2"], out)
            k.add_rows(out, mg["fc2_bias"], stream=device.stream)
            merged[first // group: first // group + tokens] = device.read(out)
        return merged
