"""The DFlash block drafter's own kernels (ninfer-facts §3.10): what its layers need beyond the shared row kernels
(RMSNorm, SwiGLU, linear layers, embedding, argmax), which the model reuses.

* `copy_columns`: the target's feature capture, a layer's residual rows written into their column block of the
  context-feature rows `[R, layers * hidden]`.
* `dflash_heads`: per-head plain RMSNorm and 1-D split-half RoPE over every head dim, for one launch that mixes a
  proposal's block rows (q, k written as fp32 rows, v copied) and committed context rows (k and v rounded to bf16
  and written into the layer's context cache: a lane's cyclic sliding-window cache, or the paged pool of a full
  layer).
* `dflash_attention`: non-causal attention of the block rows over their lane's context keys (read from the cache)
  and their block's own keys, with the symmetric window `|p_key - p_query| < window` of a sliding layer; flash-
  decoding splits, then a combine.

Layouts:
- `qkv` fp32 [R, (Hq + 2 Hkv) D]: column blocks q | k | v (the fused `query_key_value` projection's output).
- context caches uint16 (bf16 bits) [N, S, Hkv, D]: a sliding layer's ring is [lanes, window, ...] (position p of
  lane l at [l, p % window]); a full layer's pool is [pages, page_tokens, ...] addressed through the lane's page
  table like the target's KV.
- block rows: R_b = blocks * block_width rows, block b's rows b*width..(b+1)*width-1 (anchor first) at consecutive
  positions; the first row's position is its lane's context length L (context positions 0..L-1).
Limits: D a multiple of 32 and at most 256; Hq / Hkv at most 8. fastmath stays off; every row's result depends on
its own inputs only (split boundaries follow its own key count and the fixed split count): batch invariant.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, uint16

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.backends.cpu import ops
from ninfer.kernels_numba.attention import (DEFAULT_SPLITS, MAX_E, MAX_G, MAX_GE, NEG_INF, check_splits,
                                            head_normalized, init_online_state, merge_partials, online_scores,
                                            online_values, rotate_half, split_keys, store_block_partials)
from ninfer.kernels_numba.common import bf16_to_f32, blocks_for, f32_to_bf16
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel

THREADS = 256
WARPS = 4  # warps of an attention split block: each takes every WARPS-th key of the split

f32_1d = float32[::1]
f32_2d = float32[:, ::1]
f32_3d = float32[:, :, ::1]
f32_4d = float32[:, :, :, ::1]
i32_1d = int32[::1]
i32_2d = int32[:, ::1]
u16_4d = uint16[:, :, :, ::1]


def check_geometry(heads: int, kv_heads: int, head_dim: int) -> None:
    """The head geometry the kernels handle (a lane holds head_dim / 32 dims, a warp G q heads of a kv head)."""
    if head_dim % 32 or not 0 < head_dim <= 32 * MAX_E:
        raise ValueError(f"DFlash kernels need head_dim a multiple of 32 and at most {32 * MAX_E}, got {head_dim}")
    if kv_heads <= 0 or heads % kv_heads or heads // kv_heads > MAX_G:
        raise ValueError(f"DFlash kernels need heads / kv_heads an integer <= {MAX_G}, got {heads}/{kv_heads}")


def attention_partials_shape(rows: int, heads: int, head_dim: int, splits: int = DEFAULT_SPLITS) -> tuple:
    """Scratch of `dflash_attention`: per (block row, q head, split) the running max, the sum and D accumulators."""
    check_splits(splits)
    return (rows, heads, splits, head_dim + 2)


# ---------------------------------------------------------------------------------------------------------------
# feature capture


@kernel((f32_2d, f32_2d, int32), fastmath=False)
def _copy_columns(source, out, first_column):
    row = cuda.blockIdx.y
    for col in range(cuda.grid(1), source.shape[1], cuda.gridsize(1)):
        out[row, first_column + col] = source[row, col]


def copy_columns(source, out, *, first_column, stream) -> None:
    """out[r, first_column : first_column + W] = source[r] for the rows of source (fp32 [R, W] into [>= R, >= W])."""
    rows = source.shape[0]
    if rows:
        _copy_columns[(blocks_for(source.shape[1], THREADS), rows), THREADS, stream](source, out,
                                                                                    np.int32(first_column))


def copy_columns_reference(source: np.ndarray, out: np.ndarray, *, first_column: int) -> None:
    out[: source.shape[0], first_column : first_column + source.shape[1]] = source


# ---------------------------------------------------------------------------------------------------------------
# heads: plain per-head RMSNorm + split-half RoPE, context K/V into the caches


@kernel((f32_2d, f32_1d, f32_1d, f32_1d, i32_1d, i32_1d, i32_1d, i32_2d, u16_4d, u16_4d, f32_3d, f32_3d, f32_3d,
         int32, int32, int32, int32, int32, float32), fastmath=False)
def _heads_kernel(qkv, q_norm, k_norm, inv_freq, positions, row_lane, ring_slot, page_tables, cache_k, cache_v,
                  q_out, k_out, v_out, block_rows, paged, heads, kv_heads, head_dim, eps):
    """grid (R, Hq + Hkv), block head_dim threads: head slot < Hq a query head, else a kv head (k normed and rotated,
    v as is). Rows < block_rows are block rows; the others are context rows, which have no query."""
    r = cuda.blockIdx.x
    slot = cuda.blockIdx.y
    t = cuda.threadIdx.x
    block = r < block_rows
    is_q = slot < heads
    if is_q and not block:
        return
    position = positions[r]
    if not block:  # a context row without a place to go: padding (position < 0) or superseded in this ring
        if position < 0 or (paged == 0 and ring_slot[r] < 0):
            return
    red = cuda.shared.array(32, float32)
    vals = cuda.shared.array(256, float32)
    normalized, w = head_normalized(qkv, r, slot, heads, head_dim, q_norm, k_norm, red, eps)
    y = normalized * w
    vals[t] = y
    cuda.syncthreads()
    half = head_dim // 2
    angle = float32(position) * inv_freq[t % half]
    y = rotate_half(y, vals, t, half, math.cos(angle), math.sin(angle))
    if is_q:
        q_out[r, slot, t] = y
        return
    kvh = slot - heads
    v = qkv[r, (heads + kv_heads) * head_dim + kvh * head_dim + t]
    if block:
        k_out[r, kvh, t] = y
        v_out[r, kvh, t] = v
        return
    span = cache_k.shape[1]
    if paged != 0:
        first = page_tables[row_lane[r], position // span]
        offset = position % span
    else:
        first = row_lane[r]
        offset = ring_slot[r]
    cache_k[first, offset, kvh, t] = uint16(f32_to_bf16(y))
    cache_v[first, offset, kvh, t] = uint16(f32_to_bf16(v))


def dflash_heads(qkv, q_norm, k_norm, inv_freq, positions, row_lane, ring_slot, page_tables, cache_k, cache_v,
                 q_out, k_out, v_out, *, block_rows, paged, heads, kv_heads, head_dim, eps, stream) -> None:
    """Rows 0..block_rows-1 of qkv [R, ...] (block rows): q_out[r] = rope(plain_norm(q, q_norm)), k_out[r] =
    rope(plain_norm(k, k_norm)), v_out[r] = v (fp32 [>= block_rows, H, D]). Rows block_rows..R-1 (context rows of
    lane row_lane[r] at positions[r]): the same k and v rounded to bf16, written to the cache: the full layer's pool
    (`paged`) at the position's page, or the lane's ring at ring_slot[r]. A context row with position < 0 (padding)
    or, in a ring, ring_slot < 0 (a later row of the launch takes that slot) writes nothing. positions[r] is also
    the row's RoPE position. One launch."""
    check_geometry(heads, kv_heads, head_dim)
    rows = qkv.shape[0]
    if rows:
        _heads_kernel[(rows, heads + kv_heads), head_dim, stream](
            qkv, q_norm, k_norm, inv_freq, positions, row_lane, ring_slot, page_tables, cache_k, cache_v, q_out,
            k_out, v_out, np.int32(block_rows), np.int32(bool(paged)), np.int32(heads), np.int32(kv_heads),
            np.int32(head_dim), np.float32(eps))


def dflash_heads_reference(qkv, q_norm, k_norm, inv_freq, positions, row_lane, ring_slot, page_tables, cache_k,
                           cache_v, q_out, k_out, v_out, *, block_rows, paged, heads, kv_heads, head_dim,
                           eps) -> None:
    """NumPy twin on host arrays (writes q_out, k_out, v_out and the cache), in the CPU drafter's math."""
    rows, qw, kw = qkv.shape[0], heads * head_dim, kv_heads * head_dim
    angles = ops.rope_angles(positions[:rows], inv_freq)
    k = ops.apply_rotary(ops.rms_norm(qkv[:, qw : qw + kw].reshape(rows, kv_heads, head_dim), k_norm, eps,
                                      offset=False), angles)
    v = qkv[:, qw + kw : qw + 2 * kw].reshape(rows, kv_heads, head_dim)
    b = block_rows
    q = ops.rms_norm(qkv[:b, :qw].reshape(b, heads, head_dim), q_norm, eps, offset=False)
    q_out[:b] = ops.apply_rotary(q, angles[:b])
    k_out[:b], v_out[:b] = k[:b], v[:b]
    span = cache_k.shape[1]
    for r in range(b, rows):
        position, lane = int(positions[r]), int(row_lane[r])
        if position < 0 or (not paged and ring_slot[r] < 0):
            continue
        first, offset = (page_tables[lane, position // span], position % span) if paged else (lane, ring_slot[r])
        cache_k[first, offset] = f32_to_bf16_bits(k[r])
        cache_v[first, offset] = f32_to_bf16_bits(v[r])


# ---------------------------------------------------------------------------------------------------------------
# attention of the block rows


@device_function
def load_head_dims(kx, cache, block, context_key, page, offset, row, kvh, dbase, per_lane):
    """kx[e] = this lane's dims of kv head `kvh` of one key (or value): from the bf16 cache at (page, offset) for a
    context key, else from the block's own fp32 rows."""
    for e in range(MAX_E):
        if e < per_lane:
            if context_key:
                kx[e] = bf16_to_f32(cache[page, offset, kvh, dbase + e])
            else:
                kx[e] = block[row, kvh, dbase + e]


@kernel((f32_3d, f32_3d, f32_3d, i32_1d, i32_1d, i32_2d, u16_4d, u16_4d, f32_4d, int32, int32, int32, int32, int32,
         int32), fastmath=False)
def _attention_split_kernel(q, k_block, v_block, positions, row_lane, page_tables, cache_k, cache_v, partials,
                            block_width, window, paged, heads, kv_heads, head_dim):
    """grid (splits, Hkv, R), block WARPS warps. A row's keys, in order: its visible context positions lo..L-1, then
    its block's block_width rows (those outside the window skipped); a warp per key, lanes split head_dim, the G q
    heads of this kv head at once. One partial (max, sum, accumulators) per (row, q head, split)."""
    split = cuda.blockIdx.x
    kvh = cuda.blockIdx.y
    r = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    lane = tid % 32
    warp = tid // 32
    group_heads = heads // kv_heads
    first = (r // block_width) * block_width
    context = positions[first]
    position = positions[r]
    lo = 0
    if window > 0:
        lo = max(0, position - window + 1)
    n_context = max(0, context - lo)
    total = n_context + block_width
    chunk = split_keys(total, partials.shape[2], 0)
    start = split * chunk
    if start >= total:  # an empty split: the combine skips it
        if tid < group_heads:
            partials[r, kvh * group_heads + tid, split, 0] = float32(NEG_INF)
            partials[r, kvh * group_heads + tid, split, 1] = float32(0.0)
        return
    stop = min(start + chunk, total)
    per_lane = head_dim // 32
    dbase = lane * per_lane
    scale = float32(1.0) / math.sqrt(float32(head_dim))
    span = cache_k.shape[1]
    lane_id = row_lane[r]
    qv = cuda.local.array(MAX_GE, float32)
    acc = cuda.local.array(MAX_GE, float32)
    m = cuda.local.array(MAX_G, float32)
    lsum = cuda.local.array(MAX_G, float32)
    kx = cuda.local.array(MAX_E, float32)
    ag = cuda.local.array(MAX_G, float32)
    pg = cuda.local.array(MAX_G, float32)
    init_online_state(q, r, kvh, group_heads, per_lane, dbase, scale, qv, acc, m, lsum, kx)
    for key in range(start + warp, stop, WARPS):
        # Every lane of the warp takes the same key, so the skip below is warp-uniform.
        context_key = key < n_context
        row = first + key - n_context
        if not context_key and window > 0 and abs(positions[row] - position) >= window:
            continue
        page = 0
        offset = 0
        if context_key:
            j = lo + key
            page = lane_id
            offset = j % span
            if paged != 0:
                page = page_tables[lane_id, j // span]
        load_head_dims(kx, cache_k, k_block, context_key, page, offset, row, kvh, dbase, per_lane)
        online_scores(qv, kx, m, lsum, ag, pg, group_heads, per_lane)
        load_head_dims(kx, cache_v, v_block, context_key, page, offset, row, kvh, dbase, per_lane)
        online_values(acc, kx, ag, pg, group_heads)
    sm_m = cuda.shared.array((WARPS, MAX_G), float32)
    sm_l = cuda.shared.array((WARPS, MAX_G), float32)
    sm_acc = cuda.shared.array((WARPS, MAX_G, 256), float32)
    store_block_partials(m, lsum, acc, sm_m, sm_l, sm_acc, partials, r, kvh, split, group_heads, head_dim, per_lane,
                         dbase, WARPS)


@kernel((f32_4d, f32_2d, int32), fastmath=False)
def _attention_combine_kernel(partials, out, head_dim):
    """grid (R, Hq), block head_dim: the row's splits merged in split order (empty ones skipped), normalised."""
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y
    d = cuda.threadIdx.x
    total_a, total_l = merge_partials(partials, r, h, d, partials.shape[2])
    out[r, h * head_dim + d] = total_a / total_l


def dflash_attention(q, k_block, v_block, positions, row_lane, page_tables, cache_k, cache_v, partials, out, *,
                     block_width, window, paged, heads, kv_heads, head_dim, stream) -> None:
    """out[r, h*D:(h+1)*D] = softmax(q[r, h] . keys / sqrt(D)) values for the R block rows of q [R, Hq, D]: the keys
    of row r are its lane's context positions before its block (cache_k / cache_v, a ring or the paged pool), then
    its block's rows of k_block / v_block [R, Hkv, D]; with `window` > 0 (a sliding layer) only keys within `window`
    positions of the row's, either side (window 0: every key). `partials` from `attention_partials_shape(>= R, ...)`
    (keep one split count for every call: batch invariance). Two launches."""
    check_geometry(heads, kv_heads, head_dim)
    rows = q.shape[0]
    if rows == 0:
        return
    if rows % block_width:
        raise ValueError(f"{rows} block rows are not whole blocks of {block_width}")
    splits = partials.shape[2]
    check_splits(splits)
    _attention_split_kernel[(splits, kv_heads, rows), WARPS * 32, stream](
        q, k_block, v_block, positions, row_lane, page_tables, cache_k, cache_v, partials, np.int32(block_width),
        np.int32(window), np.int32(bool(paged)), np.int32(heads), np.int32(kv_heads), np.int32(head_dim))
    _attention_combine_kernel[(rows, heads), head_dim, stream](partials, out, np.int32(head_dim))


def dflash_attention_reference(q, k_block, v_block, positions, row_lane, page_tables, cache_k, cache_v, out, *,
                               block_width, window, paged, heads, kv_heads, head_dim) -> None:
    """NumPy twin: per block, `ops.windowed_gqa_attention` over the context positions its rows can reach (the CPU
    drafter's `DFlashCaches.context`) and the block's own keys; writes out."""
    span = cache_k.shape[1]
    for first in range(0, q.shape[0], block_width):
        rows = slice(first, first + block_width)
        length, lane = int(positions[first]), int(row_lane[first])
        context = np.arange(max(0, length - window) if window > 0 else 0, length)
        where = (page_tables[lane, context // span], context % span) if paged else (lane, context % span)
        keys = np.concatenate([bf16_bits_to_f32(cache_k[where]), k_block[rows]])
        values = np.concatenate([bf16_bits_to_f32(cache_v[where]), v_block[rows]])
        attended = ops.windowed_gqa_attention(q[rows], positions[rows], keys, values,
                                              np.concatenate([context, positions[rows]]), 1.0 / np.sqrt(head_dim),
                                              window if window > 0 else None)
        out[rows] = attended.reshape(block_width, heads * head_dim)
