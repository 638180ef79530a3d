"""The Qwen3.6 Vision tower on the CPU backend (ninfer-facts §3.11), fp32 NumPy math.

Input: patch rows `[N, patch_row]` (channel-major `[3][temporal_patch][patch][patch]`) of one or more items, each item
laid out as its temporal slices one after another and, within a slice, the 2x2 (spatial_merge^2) merge blocks in
row-major block order with each block's patches (merge_y, merge_x) consecutive. Output: one `[out_hidden]` row per
merge block, in the same order.

Pipeline: patch embedding + bias; bilinearly interpolated learned position table (align-corners sampling of the
square table at each item's h x w grid), reordered to the merge order and repeated over t; `depth` pre-LN blocks of
non-causal attention segmented per (item, temporal slice) with 2-D (h, w) rotate-half RoPE and a GELU-tanh MLP; the
merger (per-patch LayerNorm, concat each merge block, fc1, exact GELU, fc2).
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np

from ninfer.artifact.codec import bf16_bits_to_f32

from ninfer.backends.cpu.ops import apply_rotary, rope_inv_freq, softmax
from ninfer.models.base import WeightSource
from ninfer.targets.dims import VisionDims

F32 = np.float32
LAYER_NORM_EPS = 1e-6
ROPE_THETA = 10000.0


def gemm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """`x @ weight.T` as one GEMM over all rows. The text model's row-wise `ops.linear` keeps a row's result
    independent of its batch; the tower needs no such care (an item is always encoded alone, so in one shape), and
    one GEMM is what makes thousands of patch rows affordable on the host."""
    return x.astype(F32, copy=False) @ weight.T


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = LAYER_NORM_EPS) -> np.ndarray:
    """LayerNorm over the last axis (biased variance), fp32."""
    x = x.astype(F32, copy=False)
    mean = np.mean(x, axis=-1, keepdims=True, dtype=F32)
    centred = x - mean
    var = np.mean(centred * centred, axis=-1, keepdims=True, dtype=F32)
    return centred * (F32(1.0) / np.sqrt(var + F32(eps))) * weight + bias


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """`0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`."""
    x = x.astype(F32, copy=False)
    c = F32(math.sqrt(2.0 / math.pi))
    return F32(0.5) * x * (F32(1.0) + np.tanh(c * (x + F32(0.044715) * x * x * x)))


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7, about one fp32 ulp near 1)."""
    x = x.astype(np.float64)
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return sign * (1.0 - poly * np.exp(-a * a))


def gelu_exact(x: np.ndarray) -> np.ndarray:
    """`0.5 x (1 + erf(x / sqrt 2))`."""
    x = x.astype(F32, copy=False)
    return (F32(0.5) * x * (F32(1.0) + _erf(x / math.sqrt(2.0)).astype(F32))).astype(F32)


def _merge_order(a: np.ndarray, merge: int) -> np.ndarray:
    """`[h, w, ...]` raster -> `[h*w, ...]` in merge-block order (blocks row-major, patches (y, x) inside)."""
    h, w = a.shape[:2]
    rest = a.shape[2:]
    a = a.reshape(h // merge, merge, w // merge, merge, *rest)
    return np.swapaxes(a, 1, 2).reshape(h * w, *rest)


def _axis_taps(size: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Align-corners sampling of a `side`-long table at `size` points: (floor index, ceil index, ceil weight)."""
    src = np.arange(size, dtype=F32) * F32(side - 1) / F32(max(size - 1, 1))
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, side - 1)
    return lo, hi, (src - lo.astype(F32)).astype(F32)


@attrs.frozen(eq=False)
class VisionGeometry:
    """What an item's grid alone determines: its interpolated position embeddings and its 2-D RoPE angles (small:
    the learned position table and inv_freq; a GPU tower keeps this and drops the host weights)."""

    dims: VisionDims
    side: int  # the position table is side x side
    pos_table: np.ndarray
    inv_freq: np.ndarray

    def position_embeddings(self, t: int, h: int, w: int) -> np.ndarray:
        """Bilinear samples of the learned table at an h x w grid, merge-ordered, repeated t times: `[t*h*w, hidden]`."""
        side, table = self.side, self.pos_table.reshape(self.side, self.side, -1)
        y0, y1, fy = _axis_taps(h, side)
        x0, x1, fx = _axis_taps(w, side)
        wy0, wy1 = (F32(1) - fy)[:, None, None], fy[:, None, None]
        wx0, wx1 = (F32(1) - fx)[None, :, None], fx[None, :, None]
        # The four corner terms summed left to right, each gathered in one indexing step and added in place: the
        # same values as gathering rows then columns in one expression, with a third of its temporaries (a 64 x 64
        # grid: 36 -> 27 ms here; it runs on the host for every item, before the GPU tower starts).
        rows0, rows1, cols0, cols1 = y0[:, None], y1[:, None], x0[None, :], x1[None, :]
        grid = table[rows0, cols0] * (wy0 * wx0)
        grid += table[rows0, cols1] * (wy0 * wx1)
        grid += table[rows1, cols0] * (wy1 * wx0)
        grid += table[rows1, cols1] * (wy1 * wx1)
        return np.tile(_merge_order(grid.astype(F32, copy=False), self.dims.spatial_merge), (t, 1))

    def rope_angles(self, t: int, h: int, w: int) -> np.ndarray:
        """Angles `[t*h*w, head_dim/2]`: `[h_pos * inv_freq, w_pos * inv_freq]` per patch, merge-ordered."""
        hw = np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"), axis=-1)  # [h, w, 2]
        pos = np.tile(_merge_order(hw, self.dims.spatial_merge), (t, 1)).astype(F32)
        return np.concatenate([pos[:, :1] * self.inv_freq[None, :], pos[:, 1:] * self.inv_freq[None, :]], axis=-1)


class VisionTower:
    """Qwen3.6 Vision encoder: `encode(patches, grids)` -> merged visual tokens `[N / merge^2, out_hidden]`."""

    def __init__(self, dims: VisionDims, weights: WeightSource) -> None:
        if dims.hidden % dims.heads or (dims.hidden // dims.heads) % 4:
            raise ValueError(f"vision head_dim {dims.hidden}/{dims.heads} must be a multiple of 4 (2-D RoPE)")
        side = math.isqrt(dims.position_table)
        if side * side != dims.position_table:
            raise ValueError(f"vision position table of {dims.position_table} rows is not square")
        self.dims = dims
        self.head_dim = dims.hidden // dims.heads
        g = weights.get
        self.patch_w = g("vision/patch_embedding")
        self.patch_b = g("vision/patch_embedding_bias")
        # 2-D RoPE: inv_freq over head_dim/2 dims; angles [h*inv, w*inv] span head_dim/2 pairs (rotate-half).
        self.geometry = VisionGeometry(dims, side, g("vision/position_embedding"),
                                       rope_inv_freq(self.head_dim // 2, ROPE_THETA))
        self.blocks = []
        for b in range(dims.depth):
            p = f"vision/blocks/{b}/"
            self.blocks.append({k: g(p + k) for k in (
                "attention/qkv", "attention/qkv_bias", "attention/output", "attention/output_bias",
                "mlp/fc1", "mlp/fc1_bias", "mlp/fc2", "mlp/fc2_bias",
                "norm1/weight", "norm1/bias", "norm2/weight", "norm2/bias")})
        self.merger = {k: g("vision/merger/" + k) for k in (
            "fc1", "fc1_bias", "fc2", "fc2_bias", "norm/weight", "norm/bias")}

    # ---- per-item geometry -------------------------------------------------------------------------------------

    def _check(self, patches: np.ndarray, grids: Sequence[tuple[int, int, int]]) -> None:
        d, m = self.dims, self.dims.spatial_merge
        if patches.ndim != 2 or patches.shape[1] != d.patch_row:
            raise ValueError(f"patches must be [N, {d.patch_row}], got {patches.shape}")
        total = 0
        for t, h, w in grids:
            if t < 1 or h < 1 or w < 1 or h % m or w % m:
                raise ValueError(f"grid {(t, h, w)}: h and w must be positive multiples of {m}")
            total += t * h * w
        if total != patches.shape[0]:
            raise ValueError(f"grids cover {total} patches, got {patches.shape[0]}")

    def position_embeddings(self, t: int, h: int, w: int) -> np.ndarray:
        return self.geometry.position_embeddings(t, h, w)

    def rope_angles(self, t: int, h: int, w: int) -> np.ndarray:
        return self.geometry.rope_angles(t, h, w)

    # ---- the network -------------------------------------------------------------------------------------------

    def _attention(self, x: np.ndarray, blk: dict, angles: np.ndarray, segments: list[tuple[int, int]]) -> np.ndarray:
        n, heads, hd = x.shape[0], self.dims.heads, self.head_dim
        qkv = (gemm(x, blk["attention/qkv"]) + blk["attention/qkv_bias"]).reshape(n, 3, heads, hd)
        q = apply_rotary(qkv[:, 0], angles)
        k = apply_rotary(qkv[:, 1], angles)
        v = qkv[:, 2]
        scale = F32(1.0 / math.sqrt(hd))
        out = np.empty((n, heads, hd), dtype=F32)
        for start, end in segments:
            qs, ks, vs = (a[start:end].transpose(1, 0, 2) for a in (q, k, v))  # [heads, S, hd]
            probs = softmax(np.matmul(qs, ks.transpose(0, 2, 1)) * scale, axis=-1)
            out[start:end] = np.matmul(probs, vs).transpose(1, 0, 2)
        return gemm(out.reshape(n, heads * hd), blk["attention/output"]) + blk["attention/output_bias"]

    def encode_item(self, patches_bf16: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """One item from its bf16 patch bits (how prepared media keeps them)."""
        return self.encode(bf16_bits_to_f32(patches_bf16), [grid])

    def encode(self, patches: np.ndarray, grids: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """Patch rows `[N, patch_row]` of the items with grids `(t, h, w)` (patch units) -> `[N / merge^2, out_hidden]`."""
        grids = [tuple(int(v) for v in g) for g in grids]
        self._check(patches, grids)
        d = self.dims
        x = gemm(patches.astype(F32, copy=False), self.patch_w) + self.patch_b
        x = x + np.concatenate([self.position_embeddings(*g) for g in grids], axis=0)
        angles = np.concatenate([self.rope_angles(*g) for g in grids], axis=0)
        segments, start = [], 0  # one attention segment per (item, temporal slice)
        for t, h, w in grids:
            for _ in range(t):
                segments.append((start, start + h * w))
                start += h * w
        for blk in self.blocks:
            x = x + self._attention(layer_norm(x, blk["norm1/weight"], blk["norm1/bias"]), blk, angles, segments)
            hmid = gelu_tanh(gemm(layer_norm(x, blk["norm2/weight"], blk["norm2/bias"]), blk["mlp/fc1"])
                             + blk["mlp/fc1_bias"])
            x = x + gemm(hmid, blk["mlp/fc2"]) + blk["mlp/fc2_bias"]
        mg = self.merger
        y = layer_norm(x, mg["norm/weight"], mg["norm/bias"]).reshape(-1, d.merged_hidden)
        y = gelu_exact(gemm(y, mg["fc1"]) + mg["fc1_bias"])
        return (gemm(y, mg["fc2"]) + mg["fc2_bias"]).astype(F32)


def encode_prompt_item(tower, item, hidden: int) -> np.ndarray:
    """A prompt media item (`engine.request.PromptMedia`: bf16 patch bits, grid, placeholder columns) through a tower
    (`VisionTower` or the GPU's `CudaVisionTower`: anything with `encode_item(patch bits, grid)`): float32
    `[len(item.columns), hidden]`, checked against the item's placeholder count and the text width."""
    rows = tower.encode_item(np.asarray(item.patches, dtype=np.uint16), item.grid)
    if rows.shape != (len(item.columns), hidden):
        raise ValueError(f"{item.modality} {item.digest[:12]}: the Vision tower made {rows.shape[0]} tokens of width "
                         f"{rows.shape[1]}, its prompt has {len(item.columns)} placeholder columns of width {hidden}")
    return rows
