"""The Qwen3.6 Vision tower on the GPU: the math of `models.qwen3_6_vision.VisionTower`, as bf16 cuBLAS GEMMs with
fp32 results and the `kernels_numba.vision` kernels around them.

Weights are the host tower's (dequantized fp32) rounded once to bf16 and uploaded at startup (about 0.8 GB for the
27-block tower). Per item: patch embedding (+ bias + interpolated position embedding, computed on the host), then per
block LayerNorm -> qkv GEMM -> bias + 2-D RoPE into head-major q/k/v -> attention per temporal slice (scores and
values as strided-batched GEMMs around a softmax over all keys of the slice, queries in blocks bounded by
SCORE_BYTES) -> output GEMM accumulated into the residual -> LayerNorm -> fc1 -> tanh-GELU -> fc2 accumulated; then
the merger (LayerNorm over each group of merge^2 rows, fc1, erf-GELU, fc2). Scratch is allocated per item: media
encoding runs between scheduler rounds, never inside a captured graph.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.models.qwen3_6_vision import LAYER_NORM_EPS, VisionTower

SCORE_BYTES = 256 << 20  # fp32 attention scores of one query block, all heads


class CudaVisionTower:
    def __init__(self, tower: VisionTower, device: Any) -> None:
        self._host, self.device, self.dims = tower, device, tower.dims

        def matrix(value: np.ndarray) -> Any:
            return device.upload(f32_to_bf16_bits(np.asarray(value, np.float32)), "vision")

        def vector(value: np.ndarray) -> Any:
            return device.upload(np.ascontiguousarray(value, np.float32), "vision")

        self.patch_w, self.patch_b = matrix(tower.patch_w), vector(tower.patch_b)
        self.blocks = [{name: (matrix(value) if value.ndim == 2 else vector(value)) for name, value in block.items()}
                       for block in tower.blocks]
        self.merger = {name: (matrix(value) if value.ndim == 2 else vector(value))
                       for name, value in tower.merger.items()}
        self._blas = device.blas()

    def encode_item(self, patches_bf16: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """One item's bf16 patch rows `[t*h*w, patch_row]` -> merged tokens fp32 `[t*h*w / merge^2, out_hidden]`."""
        d, device, k, blas = self.dims, self.device, self.device.kernels, self._blas
        stream = device.stream
        t, h, w = (int(v) for v in grid)
        n, hidden, heads = t * h * w, d.hidden, d.heads
        head_dim = hidden // heads
        if patches_bf16.shape != (n, d.patch_row):
            raise ValueError(f"patches {patches_bf16.shape} do not match grid {grid} (rows of {d.patch_row})")

        def scratch(*shape: int, dtype: Any = np.float32) -> Any:
            return device.empty(shape, dtype, "vision scratch")

        x = scratch(n, hidden)
        blas.gemm_bf16(device.upload(np.ascontiguousarray(patches_bf16, np.uint16), "vision scratch"), self.patch_w, x)
        k.add_rows(x, self.patch_b, extra=device.upload(self._host.position_embeddings(t, h, w), "vision scratch"),
                   stream=stream)
        angles = self._host.rope_angles(t, h, w)
        cos = device.upload(np.cos(angles).astype(np.float32), "vision scratch")
        sin = device.upload(np.sin(angles).astype(np.float32), "vision scratch")
        normed = scratch(n, hidden, dtype=np.uint16)
        qkv = scratch(n, 3 * hidden)
        q, key, value = (scratch(heads, n, head_dim, dtype=np.uint16) for _ in range(3))
        attended = scratch(n, hidden, dtype=np.uint16)
        mlp = scratch(n, d.intermediate)
        mlp_bf16 = scratch(n, d.intermediate, dtype=np.uint16)
        side = h * w  # one temporal slice attends to itself only
        block_rows = max(1, min(side, SCORE_BYTES // (4 * heads * side)))
        scores = scratch(heads * block_rows * side)
        probs = scratch(heads * block_rows * side, dtype=np.uint16)
        out = scratch(heads * block_rows * head_dim)
        for blk in self.blocks:
            k.layer_norm_bf16(x, blk["norm1/weight"], blk["norm1/bias"], normed, eps=LAYER_NORM_EPS, stream=stream)
            blas.gemm_bf16(normed, blk["attention/qkv"], qkv)
            k.vision_heads(qkv, blk["attention/qkv_bias"], cos, sin, q, key, value, scale=1.0 / math.sqrt(head_dim),
                           stream=stream)
            for start in range(0, n, side):
                for first in range(start, start + side, block_rows):
                    rows = min(block_rows, start + side - first)
                    s = scores[: heads * rows * side].reshape(heads, rows, side)
                    p = probs[: heads * rows * side].reshape(heads, rows, side)
                    o = out[: heads * rows * head_dim].reshape(heads, rows, head_dim)
                    blas.batched_scores(q[:, first:first + rows], key[:, start:start + side], side, s)
                    k.causal_softmax(s, p, rows=rows, first_position=side, stream=stream)  # every key visible
                    blas.batched_values(p, value[:, start:start + side], side, o)
                    k.vision_merge_heads(o, attended, first=first, stream=stream)
            blas.gemm_bf16(attended, blk["attention/output"], x, accumulate=True)
            k.add_rows(x, blk["attention/output_bias"], stream=stream)
            k.layer_norm_bf16(x, blk["norm2/weight"], blk["norm2/bias"], normed, eps=LAYER_NORM_EPS, stream=stream)
            blas.gemm_bf16(normed, blk["mlp/fc1"], mlp)
            k.bias_gelu_bf16(mlp, blk["mlp/fc1_bias"], mlp_bf16, exact=False, stream=stream)
            blas.gemm_bf16(mlp_bf16, blk["mlp/fc2"], x, accumulate=True)
            k.add_rows(x, blk["mlp/fc2_bias"], stream=stream)
        mg = self.merger
        merged_rows = n // (d.spatial_merge * d.spatial_merge)
        k.layer_norm_bf16(x, mg["norm/weight"], mg["norm/bias"], normed, eps=LAYER_NORM_EPS, stream=stream)
        grouped = normed.reshape(merged_rows, d.merged_hidden)
        fc1 = scratch(merged_rows, d.merged_hidden)
        blas.gemm_bf16(grouped, mg["fc1"], fc1)
        fc1_bf16 = scratch(merged_rows, d.merged_hidden, dtype=np.uint16)
        k.bias_gelu_bf16(fc1, mg["fc1_bias"], fc1_bf16, exact=True, stream=stream)
        result = scratch(merged_rows, d.out_hidden)
        blas.gemm_bf16(fc1_bf16, mg["fc2"], result)
        k.add_rows(result, mg["fc2_bias"], stream=stream)
        return device.read(result)
