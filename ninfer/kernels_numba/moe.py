"""MoE routing and combining (math: `ninfer.backends.cpu.moe`, ninfer-facts §3.6).

Decode route: `route_top_k` (softmax over all experts, top-k with ties to the lower id, renormalised, then the k
experts SORTED BY ID ascending with their weights), the lead's per-slot expert GEMVs, `silu_mul_slots`, then
`moe_combine` (residual += sum over slots in ascending slot = ascending expert id order).

Prefill route (one cuBLAS GEMM call per projection over every expert's tokens, bf16 outputs): `moe_group`
groups the R*S (row, slot) pairs by expert (experts ascending, rows ascending within an expert: a stable
permutation) and writes `slot_of[p] = r*S + s` and its inverse `position_of[r*S + s] = p`; `moe_gather` makes the
bf16 GEMM input `out[p] = bf16(x[slot_of[p] // S])`, contiguous per expert for a grouped GEMM, or, through
`moe_pad_positions`, at a fixed row stride per expert for a strided-batched one; `moe_scatter_combine` adds
`sum_s weights[r, s] * permuted_out[position_of[r*S+s]]` to the residual, with exactly the arithmetic of
`moe_combine`, so the two routes agree bitwise given equal expert outputs (bf16 ones read exactly as fp32).

All launchers are capture-safe (no allocation, no sync, no host copies).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, uint16, uint32, uint64

from ninfer.backends.cpu.moe import route_top_k as cpu_route_top_k
from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.kernels_numba.common import (FULL_MASK, bf16_hi_to_f32, bf16_pair, bf16_target, bf16_to_f32, block_sum,
                                         blocks_for, f32_to_bf16, flat_row_piece, fragment_target, sigmoid_f32,
                                         warp_max, warp_sum)
from ninfer.kernels_numba.elementwise import (NORM_ITEMS, NORM_VECTORS, norm_threads, rms_norm_rows_reference,
                                              scale_row, sigmoid_gate_add, sigmoid_gate_add_reference)
from ninfer.kernels_numba.linear import load4, store4
from ninfer.kernels_numba.quant_mma import check_fragment_output
from ninfer.kernels_numba.numba_setup import allow_dynamic_shared, cuda, device_function, kernel
from ninfer.kernels_numba.programmatic import allow_dependents, launch, wait_for_prior_grids
from ninfer.kernels_numba.sampling import key_id, key_value, order_key, warp_max_u64

MAX_EXPERTS = 256  # route_top_k: one warp per row, 8 experts per lane
MAX_TOP_K = 32
ROUTE_WARPS = 4  # rows per block of route_top_k
TILE = 256
GROUP_THREADS = 256
GROUP_WARPS = GROUP_THREADS // 32

F32_2D = float32[:, ::1]
I32_2D = int32[:, ::1]


# ---------------------------------------------------------------------------------------------------- route_top_k


@device_function
def route_row(logits, r, n_exp, top_k, expert_ids, weights, lane):
    """One warp routes row r: softmax over the first n_exp logits, the top_k by probability (ties to the lower id),
    written in ascending id order with their probabilities renormalised."""
    v = cuda.local.array(8, float32)
    m = float32(-math.inf)
    for i in range(8):
        e = lane + 32 * i
        x = float32(-math.inf)
        if e < n_exp:
            x = logits[r, e]
        v[i] = x
        m = max(m, x)
    m = warp_max(m)
    s = float32(0.0)
    for i in range(8):
        e = lane + 32 * i
        p = float32(0.0)
        if e < n_exp:
            p = math.exp(v[i] - m)
        v[i] = p
        s += p
    s = warp_sum(s)
    keys = cuda.local.array(8, uint64)
    best = uint64(0)
    for i in range(8):
        e = lane + 32 * i
        key = uint64(0)  # padding: below every real key
        if e < n_exp:
            key = order_key(v[i] / s, e)  # probability descending, then id ascending
        keys[i] = key
        if key > best:
            best = key
    my_id = int32(0x7FFFFFFF)
    my_p = float32(0.0)
    total = float32(0.0)
    for j in range(top_k):
        top = warp_max_u64(best)
        p = key_value(top)
        if lane == j:
            my_id = key_id(top)
            my_p = p
        total += p  # in selection order (probability descending), as the CPU's sum
        if best == top:  # the lane that held it moves to its next key
            nxt = uint64(0)
            for i in range(8):
                if keys[i] < top and keys[i] > nxt:
                    nxt = keys[i]
            best = nxt
    rank = 0
    for src in range(top_k):  # lanes past top_k hold no id (0x7FFFFFFF): never below one
        other = cuda.shfl_sync(FULL_MASK, my_id, src)
        if other < my_id:
            rank += 1
    if lane < top_k:
        expert_ids[r, rank] = my_id
        weights[r, rank] = my_p / total


@kernel((F32_2D, int32, int32, I32_2D, F32_2D), fastmath=False)
def _route_top_k_kernel(logits, n_exp, top_k, expert_ids, weights):
    # launched programmatically, the launch overlaps the router GEMV's tail; the logits are read past the wait, and
    # the experts' GEMV after it may start once every block has passed it
    wait_for_prior_grids()
    allow_dependents()
    t = cuda.threadIdx.x
    r = cuda.blockIdx.x * ROUTE_WARPS + (t >> 5)
    if r < logits.shape[0]:  # a whole warp leaves together
        route_row(logits, r, n_exp, top_k, expert_ids, weights, t & 31)


def check_route(top_k: int, experts: int, columns: int) -> None:
    """The ValueError of a routing launch that cannot pick top_k of the first `experts` of `columns` logits."""
    if not 0 < top_k <= min(experts, MAX_TOP_K) or not 0 < experts <= min(columns, MAX_EXPERTS):
        raise ValueError(f"routing supports E <= {MAX_EXPERTS} of the {columns} logit columns, 0 < k <= min(E, "
                         f"{MAX_TOP_K}); got E={experts}, k={top_k}")


def route_top_k(router_logits, top_k, expert_ids, weights, *, stream, experts: int | None = None,
                programmatic: bool = False):
    """router_logits fp32 [R, >= E] (E = `experts`, all columns without it; E <= 256: columns past E, such as the
    shared expert's gate logit computed in the same GEMV, are not read) -> expert_ids int32 [R, k] (ascending id),
    weights fp32 [R, k] (sum 1). `programmatic`: launched to start while the kernel before finishes
    (`kernels_numba.programmatic`), the same results."""
    rows, columns = router_logits.shape
    n_exp = columns if experts is None else int(experts)
    check_route(top_k, n_exp, columns)
    if rows:
        launch(_route_top_k_kernel, blocks_for(rows, ROUTE_WARPS), 32 * ROUTE_WARPS, stream, 0, router_logits,
               np.int32(n_exp), np.int32(top_k), expert_ids, weights, programmatic=programmatic)


def route_top_k_reference(router_logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """cpu moe.route_top_k, then each row's experts sorted by id ascending (weights follow)."""
    ids, w = cpu_route_top_k(np.asarray(router_logits, dtype=np.float32), top_k)
    order = np.argsort(ids, axis=-1, kind="stable")
    return (np.take_along_axis(ids, order, axis=-1).astype(np.int32),
            np.take_along_axis(w, order, axis=-1).astype(np.float32))


# ---------------------------------------------------------------------------------------------------- combine


@device_function
def _routed_sum(expert_out, weights, r, c):
    """sum_s (in slot order) weights[r, s] * expert_out[r, s, c]."""
    acc = float32(0.0)
    for s in range(weights.shape[1]):
        acc += weights[r, s] * expert_out[r, s, c]
    return acc


@kernel((float32[:, :, ::1], F32_2D, F32_2D), fastmath=False)
def _moe_combine_kernel(expert_out, weights, residual):
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if c < residual.shape[1]:
        residual[r, c] += _routed_sum(expert_out, weights, r, c)


@kernel((float32[:, :, ::1], F32_2D, F32_2D, F32_2D, float32[:, :]), fastmath=False)
def _moe_combine_shared_kernel(expert_out, weights, residual, shared_out, gate_logit):
    """`_moe_combine_kernel`, then the shared expert's gated output added as `sigmoid_gate_add` adds it: the same
    two roundings, one launch."""
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if c < residual.shape[1]:
        routed = residual[r, c] + _routed_sum(expert_out, weights, r, c)
        residual[r, c] = routed + sigmoid_f32(gate_logit[r, 0]) * shared_out[r, c]


def moe_combine(expert_out, weights, residual, *, stream, shared_out=None, gate_logit=None):
    """residual[r] += sum_s (in slot order) weights[r, s] * expert_out[r, s]. expert_out fp32 [R, S, H]. With
    `shared_out` (fp32 [R, H]) and `gate_logit` (fp32 [R, >= 1], a view is fine), then residual[r] +=
    sigmoid(gate_logit[r, 0]) * shared_out[r], bitwise `sigmoid_gate_add` after the combine."""
    rows, width = residual.shape
    if (shared_out is None) != (gate_logit is None):
        raise ValueError("moe_combine takes the shared expert's output and its gate logit together")
    if rows and width:
        grid = (rows, blocks_for(width, TILE))
        if shared_out is None:
            _moe_combine_kernel[grid, TILE, stream](expert_out, weights, residual)
        else:
            _moe_combine_shared_kernel[grid, TILE, stream](expert_out, weights, residual, shared_out, gate_logit)


def moe_combine_reference(expert_out, weights, residual, shared_out=None, gate_logit=None):
    acc = np.zeros(residual.shape, dtype=np.float32)
    for s in range(weights.shape[1]):
        acc = (acc + weights[:, s:s + 1].astype(np.float32) * expert_out[:, s].astype(np.float32)).astype(np.float32)
    routed = (residual.astype(np.float32) + acc).astype(np.float32)
    if shared_out is None:
        return routed
    return sigmoid_gate_add_reference(routed, shared_out, gate_logit)


# The decode combine fused with the RMSNorm that reads its result next (the next layer's input norm, or the final
# norm): one launch fewer a MoE layer. A block a row, a thread a 16-byte vector of it (`combine_norm_threads`; past
# COMBINE_NORM_MAX_THREADS a thread takes vectors t + j * threads): each thread combines its vectors (every slot's
# loaded together, up to COMBINE_NORM_SLOTS slots) into the residual and into a copy of the row in shared memory.
# The norm's sum of squares then runs in `elementwise.rms_norm_rows`' geometry from the copy (norm_threads(width)
# threads, thread t adding its NORM_ITEMS columns in order; the block's warps in order, the warps past those adding
# zeros), so the bits are the unfused kernels'. Why a thread a vector: in the norm's geometry (4 warps for a
# 2048-wide row) each thread combined 16 columns of 8 slots in sequence, 6.4 us a launch on the H200 against 2.4
# for the plain norm (results/cuda_model_v2_profile_session17.json; 40 launches on the 35B-A3B's critical path).
COMBINE_NORM_SLOTS = 8
COMBINE_NORM_LOADS = 4 * COMBINE_NORM_SLOTS  # a thread's vector of every slot, all in registers
COMBINE_NORM_MAX_THREADS = 1024


def combine_norm_threads(width: int) -> int:
    """Threads of a `moe_combine_rms_norm` block: one a 16-byte vector of the row in whole warps, at most
    COMBINE_NORM_MAX_THREADS (then a thread takes up to NORM_VECTORS vectors), never fewer than the norm's own
    (`norm_threads`, which also checks the width)."""
    return int(max(norm_threads(width), min(COMBINE_NORM_MAX_THREADS, 32 * -(-(width // 4) // 32))))


_COMBINE_NORM_SIGNATURE = (float32[:, :, ::1], F32_2D, F32_2D, F32_2D, float32[:, :], float32[::1], F32_2D,
                           uint16[:, ::1], int32, uint16[::1], int32, float32, int32, int32)


@kernel(_COMBINE_NORM_SIGNATURE, fastmath=False)
def _combine_rms_norm_kernel(expert_out, weights, residual, shared_out, gate_logit, norm_weight, out, out_bf16,
                             write_bf16, fragments, write_fragments, eps, offset, norm_width_threads):
    row_copy = cuda.shared.array(0, float32)  # the combined row (dynamic: 4 x width bytes)
    buf = cuda.shared.array(32, float32)
    r = cuda.blockIdx.x
    t = cuda.threadIdx.x
    step = cuda.blockDim.x
    width = residual.shape[1]
    slots = weights.shape[1]
    gate = sigmoid_f32(gate_logit[r, 0])
    slot_weight = cuda.local.array(COMBINE_NORM_SLOTS, float32)
    for s in range(COMBINE_NORM_SLOTS):
        if s < slots:
            slot_weight[s] = weights[r, s]
    values = cuda.local.array(NORM_ITEMS, float32)  # this thread's combined columns, vector j at 4 j
    norm_weights = cuda.local.array(NORM_ITEMS, float32)  # their (offset +) norm weights, loaded with the slots
    loaded = cuda.local.array(COMBINE_NORM_LOADS, float32)
    for j in range(NORM_VECTORS):
        v = t + j * step
        if 4 * v < width:
            for s in range(COMBINE_NORM_SLOTS):  # unrolled, loads only: every slot's in flight together
                if s < slots:
                    loaded[4 * s], loaded[4 * s + 1], loaded[4 * s + 2], loaded[4 * s + 3] = load4(
                        expert_out, (r * slots + s) * width + 4 * v)
            w0, w1, w2, w3 = load4(norm_weight, 4 * v)
            norm_weights[4 * j], norm_weights[4 * j + 1], norm_weights[4 * j + 2], norm_weights[4 * j + 3] = (
                (w0 + float32(1.0), w1 + float32(1.0), w2 + float32(1.0), w3 + float32(1.0)) if offset != 0
                else (w0, w1, w2, w3))
            for e in range(4):
                routed = float32(0.0)
                for s in range(COMBINE_NORM_SLOTS):
                    if s < slots:
                        routed += slot_weight[s] * loaded[4 * s + e]
                i = 4 * v + e
                combined = (residual[r, i] + routed) + gate * shared_out[r, i]
                residual[r, i] = combined
                row_copy[i] = combined
                values[4 * j + e] = combined
    cuda.syncthreads()
    acc = float32(0.0)  # elementwise.load_row's sum, thread t < norm_width_threads over its vectors in order
    if t < norm_width_threads:
        for j in range(NORM_VECTORS):
            v = t + j * norm_width_threads
            if 4 * v < width:
                for e in range(4):
                    acc += row_copy[4 * v + e] * row_copy[4 * v + e]
    # the outputs as rms_norm_rows writes them, each thread its own vectors (values and weights in its layout)
    scale_row(values, norm_weights, out, int32(1), out_bf16, write_bf16, fragments, write_fragments, r,
              block_sum(acc, buf), width, eps)


def check_combine_slots(slots: int) -> None:
    """The ValueError of `moe_combine_rms_norm` (and its host twin) for more slots than it unrolls."""
    if slots > COMBINE_NORM_SLOTS:
        raise ValueError(f"the fused combine takes at most {COMBINE_NORM_SLOTS} slots, got {slots}")


def moe_combine_rms_norm(expert_out, weights, residual, shared_out, gate_logit, norm_weight, out, *, eps, offset,
                         stream, out_bf16=None, out_fragments=None):
    """`moe_combine(expert_out, weights, residual, shared_out=, gate_logit=)` then `rms_norm_rows(residual,
    norm_weight, out, ...)` (with its optional bf16 copy and x fragments) in one launch, the same bits. At most
    COMBINE_NORM_SLOTS slots."""
    rows, width = residual.shape
    check_combine_slots(weights.shape[1])
    if out_fragments is not None:
        check_fragment_output(rows, width, out_fragments)
    if rows:
        shared_bytes = 4 * width
        allow_dynamic_shared(_combine_rms_norm_kernel, _COMBINE_NORM_SIGNATURE, shared_bytes)
        _combine_rms_norm_kernel[rows, combine_norm_threads(width), stream, shared_bytes](
            expert_out, weights, residual, shared_out, gate_logit, norm_weight, out, *bf16_target(out, out_bf16),
            *fragment_target(out, out_fragments), np.float32(eps), np.int32(bool(offset)),
            np.int32(norm_threads(width)))


def moe_combine_rms_norm_reference(expert_out, weights, residual, shared_out, gate_logit, norm_weight, *, eps,
                                   offset):
    """(the new residual, the normed rows)."""
    combined = moe_combine_reference(expert_out, weights, residual, shared_out, gate_logit)
    return combined, rms_norm_rows_reference(combined, norm_weight, eps=eps, offset=offset)

# ---------------------------------------------------------------------------------------------------- prefill grouping


GROUP_ROWS = 128  # rows of expert ids a block of the grouping kernels takes (moe_group's scratch: a row a block)
GROUP_ROW_WORDS = GROUP_ROWS // 32  # 32-bit words of a block's row mask an expert
GROUP_MAX_EXPERTS = 1024  # the block histogram's shared size
GROUP_MAX_SLOTS = 16  # top-k slots a row the placement's shared copy holds
GROUP_PAIRS = GROUP_ROWS * GROUP_MAX_SLOTS  # (a literal for the shared array's size)
GROUP_MASK_WORDS = GROUP_MAX_EXPERTS * GROUP_ROW_WORDS  # (likewise)
GROUP_LOADS = 8  # block counts a thread has in flight while it sums an expert's column


@kernel((I32_2D, I32_2D), fastmath=False)
def _moe_block_count_kernel(expert_ids, block_counts):
    """block_counts[b, e] = how many of rows b GROUP_ROWS .. + GROUP_ROWS pick expert e (a shared histogram)."""
    hist = cuda.shared.array(GROUP_MAX_EXPERTS, int32)
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    experts = block_counts.shape[1]
    for e in range(t, experts, GROUP_THREADS):
        hist[e] = 0
    cuda.syncthreads()
    rows = expert_ids.shape[0]
    slots = expert_ids.shape[1]
    first = b * GROUP_ROWS
    for i in range(t, (min(rows, first + GROUP_ROWS) - first) * slots, GROUP_THREADS):
        r = i // slots
        cuda.atomic.add(hist, expert_ids[first + r, i - r * slots], 1)
    cuda.syncthreads()
    for e in range(t, experts, GROUP_THREADS):
        block_counts[b, e] = hist[e]


@device_function
def _column_sums(block_counts, e, b):
    """(expert e's pairs in all blocks, in the blocks before b), GROUP_LOADS loads in flight at a time: the sums are
    a chain of L2 round trips otherwise."""
    blocks = block_counts.shape[0]
    total = int32(0)
    before = int32(0)
    for b0 in range(0, blocks, GROUP_LOADS):
        held = cuda.local.array(GROUP_LOADS, int32)
        for j in range(GROUP_LOADS):
            held[j] = block_counts[b0 + j, e] if b0 + j < blocks else 0
        for j in range(GROUP_LOADS):
            total += held[j]
            if b0 + j < b:
                before += held[j]
    return total, before


@kernel((I32_2D, I32_2D, int32[::1], int32[::1], int32[::1], int32[::1]), fastmath=False)
def _moe_block_place_kernel(expert_ids, block_counts, counts, offsets, slot_of, position_of):
    """A thread a pair: the first position of expert e in block b's rows is e's offset (the exclusive sum of the
    experts before it) plus its count in the blocks before b (a thread an expert works those out); a pair of row r
    goes that many places on as e's rows before r in the block, counted from the block's bit a row per expert. So
    an expert's pairs keep their row order (the stable sort), and no thread walks a crowded expert's pairs alone (a
    thread an expert did: 48 us a layer, most of it in the layers whose routing crowds an expert)."""
    ids = cuda.shared.array(GROUP_PAIRS, int32)
    masks = cuda.shared.array(GROUP_MASK_WORDS, uint32)
    bases = cuda.shared.array(GROUP_MAX_EXPERTS, int32)
    buf = cuda.shared.array(GROUP_WARPS, int32)
    t = cuda.threadIdx.x
    lane = t & 31
    warp = t >> 5
    b = cuda.blockIdx.x
    experts = block_counts.shape[1]
    rows = expert_ids.shape[0]
    slots = expert_ids.shape[1]
    first = b * GROUP_ROWS
    pairs = (min(rows, first + GROUP_ROWS) - first) * slots
    for w in range(t, experts * GROUP_ROW_WORDS, GROUP_THREADS):
        masks[w] = uint32(0)
    cuda.syncthreads()
    for i in range(t, pairs, GROUP_THREADS):
        r = i // slots
        e = expert_ids[first + r, i - r * slots]
        ids[i] = e
        cuda.atomic.or_(masks, e * GROUP_ROW_WORDS + (r >> 5), uint32(1) << uint32(r & 31))
    running = int32(0)  # the experts of earlier passes' pairs
    for e0 in range(0, experts, GROUP_THREADS):
        e = e0 + t
        total = int32(0)
        before = int32(0)
        if e < experts:
            total, before = _column_sums(block_counts, e, b)
        # the inclusive sum of `total` over this pass's threads: within the warp by shuffles, then the warps before
        inclusive = total
        for step in (1, 2, 4, 8, 16):
            other = cuda.shfl_up_sync(FULL_MASK, inclusive, step)
            if lane >= step:
                inclusive += other
        if lane == 31:
            buf[warp] = inclusive
        cuda.syncthreads()  # also: the ids and masks are complete
        warps_before = int32(0)
        pass_total = int32(0)
        for w in range(GROUP_WARPS):
            if w < warp:
                warps_before += buf[w]
            pass_total += buf[w]
        cuda.syncthreads()  # buf is read before the next pass writes it
        offset = running + warps_before + inclusive - total
        if e < experts:
            if b == 0:
                counts[e] = total
                offsets[e] = offset
            bases[e] = offset + before
        running += pass_total
    if b == 0 and t == 0:
        offsets[experts] = running
    cuda.syncthreads()  # every expert's base is written
    for i in range(t, pairs, GROUP_THREADS):
        r = i // slots
        e = ids[i]
        word = r >> 5
        rank = cuda.popc(masks[e * GROUP_ROW_WORDS + word] & ((uint32(1) << uint32(r & 31)) - uint32(1)))
        for w in range(GROUP_ROW_WORDS):
            if w < word:
                rank += cuda.popc(masks[e * GROUP_ROW_WORDS + w])
        p = bases[e] + rank
        slot_of[p] = first * slots + i
        position_of[first * slots + i] = p


def moe_group(expert_ids, counts, offsets, slot_of, *, experts, position_of, block_counts, stream):
    """Group the R*S (row, slot) pairs of expert_ids int32 [R, S] by expert, stably.

    counts int32 [experts]; offsets int32 [experts + 1] (exclusive prefix sums, offsets[experts] = R*S); slot_of int32
    [R*S]: permuted position p -> r*S + s (experts ascending, rows ascending within an expert); position_of int32
    [R*S]: the inverse (r*S + s -> p), which moe_scatter_combine reads. A row must not repeat an expert (top-k
    ids are distinct). block_counts int32 [>= ceil(R / GROUP_ROWS), experts]: scratch. Two launches of
    ceil(R / GROUP_ROWS) blocks: a shared histogram of each block's rows, then each block places its rows' pairs
    (a launch an expert scanning every row, twice, took 28 + 39 us of the 35B-A3B's 8K prefill a layer).
    """
    rows, slots = expert_ids.shape
    if rows == 0:
        return
    blocks = -(-rows // GROUP_ROWS)
    if experts > GROUP_MAX_EXPERTS or slots > GROUP_MAX_SLOTS or block_counts.shape[0] < blocks or \
            block_counts.shape[1] != experts:
        raise ValueError(f"moe_group: at most {GROUP_MAX_EXPERTS} experts and {GROUP_MAX_SLOTS} slots, block counts "
                         f"[>= {blocks}, {experts}]; got {experts}, {slots}, {tuple(block_counts.shape)}")
    scratch = block_counts[:blocks]
    _moe_block_count_kernel[blocks, GROUP_THREADS, stream](expert_ids, scratch)
    _moe_block_place_kernel[blocks, GROUP_THREADS, stream](expert_ids, scratch, counts, offsets, slot_of, position_of)


def moe_group_reference(expert_ids: np.ndarray, experts: int):
    """Returns (counts, offsets, slot_of, position_of)."""
    flat = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
    counts = np.bincount(flat, minlength=experts).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    slot_of = np.argsort(flat, kind="stable").astype(np.int32)
    position_of = np.empty_like(slot_of)
    position_of[slot_of] = np.arange(slot_of.size, dtype=np.int32)
    return counts, offsets, slot_of, position_of


@kernel((F32_2D, int32[::1], int32, uint32[:, ::1]), fastmath=False)
def _moe_gather_pairs(x, slot_of, top_k, out):
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.x
    if j < out.shape[1]:
        r = slot_of[p] // top_k
        out[p, j] = bf16_pair(x[r, 2 * j], x[r, 2 * j + 1])


@kernel((F32_2D, int32[::1], int32, uint16[:, ::1]), fastmath=False)
def _moe_gather_single(x, slot_of, top_k, out):
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    p = cuda.blockIdx.x
    if j < out.shape[1]:
        out[p, j] = uint16(f32_to_bf16(x[slot_of[p] // top_k, j]))


@kernel((F32_2D, int32[::1], int32, uint32[:, ::1]), fastmath=False)
def _moe_scatter_rows_pairs(x, position_of, top_k, out):
    # one x row read once, converted once, written to its top_k permuted positions
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if j < out.shape[1]:
        word = bf16_pair(x[r, 2 * j], x[r, 2 * j + 1])
        for s in range(top_k):
            out[position_of[r * top_k + s], j] = word


@kernel((F32_2D, int32[::1], int32, uint16[:, ::1]), fastmath=False)
def _moe_scatter_rows_single(x, position_of, top_k, out):
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if j < out.shape[1]:
        value = uint16(f32_to_bf16(x[r, j]))
        for s in range(top_k):
            out[position_of[r * top_k + s], j] = value


@kernel((F32_2D, int32[::1], int32, uint32[:, ::1]), fastmath=False)
def _moe_scatter_rows_octets(x, position_of, top_k, out_words):
    # thread i: row r = i // octets, columns 8 o .. 8 o + 7 (o = i % octets): two 16-byte loads of x, converted once,
    # one 16-byte store to each of the row's top_k positions
    width = x.shape[1]
    r, o = flat_row_piece(width // 8)
    if r < x.shape[0]:
        x0, x1, x2, x3 = load4(x, r * width + 8 * o)
        x4, x5, x6, x7 = load4(x, r * width + 8 * o + 4)
        w0 = bf16_pair(x0, x1)
        w1 = bf16_pair(x2, x3)
        w2 = bf16_pair(x4, x5)
        w3 = bf16_pair(x6, x7)
        for s in range(top_k):
            store4(out_words, position_of[r * top_k + s] * (width // 2) + 4 * o, w0, w1, w2, w3)


@kernel((uint32[:, ::1], int32[::1], int32, uint32[:, ::1]), fastmath=False)
def _moe_scatter_bf16_rows_octets(x_words, position_of, top_k, out_words):
    # `_moe_scatter_rows_octets` from rows already in bf16: one 16-byte load, top_k 16-byte stores
    words = x_words.shape[1]
    r, o = flat_row_piece(words // 4)
    if r < x_words.shape[0]:
        w0, w1, w2, w3 = load4(x_words, r * words + 4 * o)
        for s in range(top_k):
            store4(out_words, position_of[r * top_k + s] * words + 4 * o, w0, w1, w2, w3)


@kernel((uint16[:, ::1], int32[::1], int32, uint16[:, ::1]), fastmath=False)
def _moe_scatter_bf16_rows_single(x, position_of, top_k, out):
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    r = cuda.blockIdx.x
    if j < out.shape[1]:
        value = x[r, j]
        for s in range(top_k):
            out[position_of[r * top_k + s], j] = value


def moe_gather(x, slot_of, top_k, out, *, stream, position_of=None):
    """The bf16 GEMM input of the prefill's expert GEMMs from x fp32 [R, H] into out uint16 [., H].

    Without `position_of`: out[p] = bf16 bits of x[slot_of[p] // top_k] for every row p of out. With it (moe_group's
    inverse map, or the padded one of moe_pad_positions; int32 [R*top_k]): out[position_of[r*top_k + s]] = bf16
    bits of x[r] for every row r of x and slot s, each x row read once (fewer bytes: the prefill's form); rows of
    out that no position names keep their contents. Over moe_group's maps the two forms write the same. The
    position form also takes x as bf16 bits (uint16 [R, H]: the norm's copy for the GEMMs, half the bytes to read)
    and copies them."""
    if x.dtype == np.uint16:
        if position_of is None:
            raise ValueError("moe_gather takes bf16 rows only with position_of")
        rows, width = x.shape[0], out.shape[1]
        if not rows or not width:
            return
        if width % 8 == 0:
            _moe_scatter_bf16_rows_octets[blocks_for(rows * width // 8, TILE), TILE, stream](
                x.view(np.uint32), position_of, np.int32(top_k), out.view(np.uint32))
        else:
            _moe_scatter_bf16_rows_single[(rows, blocks_for(width, TILE)), TILE, stream](
                x, position_of, np.int32(top_k), out)
        return
    if position_of is not None:
        rows, width = x.shape[0], out.shape[1]
        if not rows or not width:
            return
        if width % 8 == 0:  # 16-byte loads and stores
            _moe_scatter_rows_octets[blocks_for(rows * width // 8, TILE), TILE, stream](
                x, position_of, np.int32(top_k), out.view(np.uint32))
        elif width % 2 == 0:
            _moe_scatter_rows_pairs[(rows, blocks_for(width // 2, TILE)), TILE, stream](
                x, position_of, np.int32(top_k), out.view(np.uint32))
        else:
            _moe_scatter_rows_single[(rows, blocks_for(width, TILE)), TILE, stream](x, position_of, np.int32(top_k),
                                                                                      out)
        return
    positions, width = out.shape
    if not positions or not width:
        return
    if width % 2 == 0:
        _moe_gather_pairs[(positions, blocks_for(width // 2, TILE)), TILE, stream](
            x, slot_of, np.int32(top_k), out.view(np.uint32))
    else:
        _moe_gather_single[(positions, blocks_for(width, TILE)), TILE, stream](x, slot_of, np.int32(top_k), out)


def moe_gather_reference(x, slot_of, top_k):
    return f32_to_bf16_bits(np.asarray(x, dtype=np.float32)[np.asarray(slot_of) // top_k])


def moe_scatter_rows_reference(x, position_of, top_k, out):
    """moe_gather with position_of: a copy of out with row position_of[r*top_k + s] = bf16 bits of x[r] (x fp32, or
    those bits already)."""
    result = np.array(out, dtype=np.uint16, copy=True)
    bits = np.asarray(x) if np.asarray(x).dtype == np.uint16 else f32_to_bf16_bits(np.asarray(x, dtype=np.float32))
    result[np.asarray(position_of)] = np.repeat(bits, top_k, axis=0)
    return result


@kernel((I32_2D, int32[::1], int32[::1], int32[::1], int32[::1]), fastmath=False)
def _moe_pad_positions_kernel(expert_ids, position_of, offsets, starts, placed):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    slots = expert_ids.shape[1]
    if i < position_of.shape[0]:
        e = expert_ids[i // slots, i % slots]
        placed[i] = starts[e] + position_of[i] - offsets[e]


def moe_pad_positions(expert_ids, position_of, offsets, starts, placed, *, stream):
    """placed[r*S + s] = starts[e] + position_of[r*S + s] - offsets[e], e = expert_ids[r, s]: moe_group's positions
    moved to a layout where expert e's rows start at row starts[e] (with room for its count up to the next start,
    which the caller sizes): e * P for one strided-batched GEMM over experts padded to P rows
    (Blas.batched_gemm_bf16), or whole chunks per expert for a pointer-array batched one (Blas.chunked_gemm_bf16).
    expert_ids int32 [R, S]; position_of, placed int32 [R*S]; offsets int32 [E + 1]; starts int32 [E]."""
    if position_of.shape[0] != expert_ids.shape[0] * expert_ids.shape[1] or placed.shape != position_of.shape:
        raise ValueError(f"moe_pad_positions takes R*S positions for ids {tuple(expert_ids.shape)}; got "
                         f"{tuple(position_of.shape)} and {tuple(placed.shape)}")
    if position_of.shape[0]:
        _moe_pad_positions_kernel[blocks_for(position_of.shape[0], TILE), TILE, stream](
            expert_ids, position_of, offsets, starts, placed)


def moe_pad_positions_reference(expert_ids, position_of, offsets, starts):
    experts = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
    return (np.asarray(starts)[experts] + np.asarray(position_of) - np.asarray(offsets)[experts]).astype(np.int32)


# The expert GEMMs' row layouts of the prefill (`moe_layout`), and the rule between them. Codes, as the kernel writes
# them in info[0] and takes its `choice` (AUTO: padded while its rows stay within PADDED_LIMIT times the routed ones,
# chunked past it; a layout whose rows do not fit `room` rows, or whose chunks pass `max_chunks`, falls back to
# grouped).
LAYOUT_GROUPED, LAYOUT_PADDED, LAYOUT_CHUNKED, LAYOUT_AUTO = 0, 1, 2, 3
LAYOUT_CODES = {"grouped": LAYOUT_GROUPED, "padded": LAYOUT_PADDED, "chunked": LAYOUT_CHUNKED, "auto": LAYOUT_AUTO}
PADDED_LIMIT = (8, 5)  # padded rows <= 8/5 of the routed ones, in integers (the same on host and device)
LAYOUT_INFO = 3  # int32s of moe_layout's info: layout, rows in all, the largest count (padded) / chunks (chunked)
LAYOUT_THREADS = 1024  # one block; an expert a thread


@kernel((int32[::1], int32[::1], int32[::1], int32, int32, int32, int32), fastmath=False)
def _moe_layout_kernel(offsets, info, starts, choice, chunk, room, max_chunks):
    counts_scan = cuda.shared.array(LAYOUT_THREADS, int32)  # inclusive scan of the experts' chunks
    largest_scan = cuda.shared.array(LAYOUT_THREADS, int32)  # running max of the counts
    e = cuda.threadIdx.x
    experts = starts.shape[0]
    count = offsets[e + 1] - offsets[e] if e < experts else 0
    pieces = (count + chunk - 1) // chunk
    counts_scan[e] = pieces
    largest_scan[e] = count
    cuda.syncthreads()
    step = 1
    while step < LAYOUT_THREADS:
        add = counts_scan[e - step] if e >= step else 0
        top = largest_scan[e - step] if e >= step else 0
        cuda.syncthreads()
        counts_scan[e] += add
        largest_scan[e] = max(largest_scan[e], top)
        cuda.syncthreads()
        step *= 2
    chunks = counts_scan[LAYOUT_THREADS - 1]
    largest = largest_scan[LAYOUT_THREADS - 1]
    routed = offsets[experts]
    padded_rows = experts * largest
    layout = LAYOUT_GROUPED
    if choice == LAYOUT_PADDED or (choice == LAYOUT_AUTO and padded_rows * PADDED_LIMIT[1] <= PADDED_LIMIT[0] * routed):
        if padded_rows <= room:
            layout = LAYOUT_PADDED
    elif choice != LAYOUT_GROUPED and chunks * chunk <= room and chunks <= max_chunks:
        layout = LAYOUT_CHUNKED
    if e < experts:
        if layout == LAYOUT_PADDED:
            starts[e] = e * largest
        elif layout == LAYOUT_CHUNKED:
            starts[e] = (counts_scan[e] - pieces) * chunk
        else:
            starts[e] = offsets[e]
    if e == 0:
        info[0] = layout
        info[1] = padded_rows if layout == LAYOUT_PADDED else (chunks * chunk if layout == LAYOUT_CHUNKED else routed)
        info[2] = largest if layout == LAYOUT_PADDED else (chunks if layout == LAYOUT_CHUNKED else 0)


def moe_layout(offsets, info, starts, *, choice, chunk, room, max_chunks, stream):
    """The expert GEMMs' row layout from moe_group's offsets int32 [E + 1], on the device (so the rows can be placed
    and gathered before the host knows the layout): info int32 [LAYOUT_INFO] = (layout code, rows in all, the
    largest count for LAYOUT_PADDED or the chunks for LAYOUT_CHUNKED, else 0) and starts int32 [E], each expert's
    first row: e * largest (padded: one strided-batched GEMM), whole chunks of `chunk` rows an expert in expert order
    (chunked: one pointer-array batched GEMM) or its offset (grouped). `choice`: a LAYOUT_CODES key."""
    experts = starts.shape[0]
    if offsets.shape[0] != experts + 1 or info.shape[0] != LAYOUT_INFO or not 0 < experts <= LAYOUT_THREADS:
        raise ValueError(f"moe_layout takes E + 1 offsets, E <= {LAYOUT_THREADS} starts and {LAYOUT_INFO} info "
                         f"values; got {offsets.shape[0]}, {experts}, {info.shape[0]}")
    if choice not in LAYOUT_CODES or chunk < 1:
        raise ValueError(f"moe_layout: choice must be one of {sorted(LAYOUT_CODES)} and chunk >= 1, got {choice!r}, "
                         f"{chunk}")
    _moe_layout_kernel[1, LAYOUT_THREADS, stream](offsets, info, starts, np.int32(LAYOUT_CODES[choice]),
                                                  np.int32(chunk), np.int32(room), np.int32(max_chunks))


def moe_layout_reference(offsets, *, choice, chunk, room, max_chunks):
    """The twin: (info, starts)."""
    counts = np.diff(np.asarray(offsets, np.int64))
    experts, routed, largest = counts.size, int(offsets[-1]), int(counts.max())
    pieces = -(-counts // chunk)
    chunks, padded_rows = int(pieces.sum()), experts * largest
    layout = LAYOUT_GROUPED
    if choice == "padded" or (choice == "auto" and padded_rows * PADDED_LIMIT[1] <= PADDED_LIMIT[0] * routed):
        layout = LAYOUT_PADDED if padded_rows <= room else LAYOUT_GROUPED
    elif choice != "grouped" and chunks * chunk <= room and chunks <= max_chunks:
        layout = LAYOUT_CHUNKED
    if layout == LAYOUT_PADDED:
        starts, info = np.arange(experts) * largest, (layout, padded_rows, largest)
    elif layout == LAYOUT_CHUNKED:
        starts, info = (np.cumsum(pieces) - pieces) * chunk, (layout, chunks * chunk, chunks)
    else:
        starts, info = np.asarray(offsets[:-1]), (layout, routed, 0)
    return np.asarray(info, np.int32), np.asarray(starts, np.int32)


@kernel((int32[::1], int32[::1], int32[::1], int32[::1], int32, int32, int32), fastmath=False)
def _moe_chunk_groups_kernel(info, offsets, starts, chunk_groups, chunk, step, room):
    # thread e < E: expert e's chunks; threads past the last chunk fill the step's surplus entries
    if info[0] != LAYOUT_CHUNKED:
        return
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    experts = starts.shape[0]
    if t < experts:
        first = starts[t] // chunk
        for j in range((offsets[t + 1] - offsets[t] + chunk - 1) // chunk):
            chunk_groups[first + j] = t
    chunks = info[2]
    stepped = min((chunks + step - 1) // step * step, room // chunk)
    for i in range(chunks + t, stepped, cuda.gridDim.x * cuda.blockDim.x):
        chunk_groups[i] = experts - 1


def stepped_chunks(chunks: int, step: int, room: int, chunk: int) -> int:
    """The chunked layout's batch count rounded up to a multiple of `step`, within `room` rows (never below the
    chunks themselves, which moe_layout fits in the room)."""
    return max(chunks, min(-(-chunks // step) * step, room // chunk))


def moe_chunk_groups(info, offsets, starts, chunk_groups, *, chunk, step, room, stream):
    """When moe_layout chose the chunked layout (info[0]): chunk_groups int32 [>= the stepped count] = each chunk's
    expert (expert e's chunks from row starts[e], offsets' counts rounded up to whole chunks), then the last expert
    for the surplus entries up to `stepped_chunks` (rows nothing reads): the pointer-array GEMM's map, made on the
    device, so the host writes no address table after the counts arrive. Another layout leaves it alone."""
    experts = starts.shape[0]
    if offsets.shape[0] != experts + 1 or info.shape[0] != LAYOUT_INFO or chunk < 1 or step < 1:
        raise ValueError(f"moe_chunk_groups takes E + 1 offsets, E starts, {LAYOUT_INFO} info values, chunk and step "
                         f">= 1; got {offsets.shape[0]}, {experts}, {info.shape[0]}, {chunk}, {step}")
    _moe_chunk_groups_kernel[blocks_for(experts, TILE), TILE, stream](info, offsets, starts, chunk_groups,
                                                                      np.int32(chunk), np.int32(step),
                                                                      np.int32(room))


def moe_chunk_groups_reference(info, offsets, starts, chunk_groups, *, chunk, step, room):
    """The twin (writes chunk_groups in place, as the kernel)."""
    if int(info[0]) != LAYOUT_CHUNKED:
        return
    counts = np.diff(np.asarray(offsets, np.int64))
    for e, (start, count) in enumerate(zip(np.asarray(starts).tolist(), counts.tolist())):
        pieces = -(-count // chunk)
        chunk_groups[start // chunk:start // chunk + pieces] = e
    chunks = int(info[2])
    chunk_groups[chunks:stepped_chunks(chunks, step, room, chunk)] = len(counts) - 1


@kernel((int32[::1], int32, uint64, uint64, uint64, uint64, uint64, uint64, uint64[::1]), fastmath=False)
def _chunk_addresses_kernel(chunk_groups, chunks, w_address, w_stride, x_address, x_stride, y_address, y_stride,
                            table):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < chunks:
        table[i] = w_address + uint64(chunk_groups[i]) * w_stride
        table[chunks + i] = x_address + uint64(i) * x_stride
        table[2 * chunks + i] = y_address + uint64(i) * y_stride


def chunk_addresses(chunk_groups, table, *, chunks, w_address, x_address, y_address, n, k, chunk, stream):
    """table uint64 [>= 3 C] = the pointer-array GEMM's operand addresses for the first C = `chunks` entries of
    chunk_groups (int32, on the device): C weight blocks (w_address + group * N K * 2), C input chunks (x_address +
    i * chunk K * 2), C output chunks (y_address + i * chunk N * 2); bf16 operands. Blas.chunked_gemm_bf16 with
    device-side groups."""
    if table.shape[0] < 3 * chunks or chunk_groups.shape[0] < chunks:
        raise ValueError(f"chunk_addresses: {chunks} chunks (3 table entries each) from {chunk_groups.shape[0]} groups "
                         f"into a table of {table.shape[0]}")
    if chunks:
        _chunk_addresses_kernel[blocks_for(chunks, TILE), TILE, stream](
            chunk_groups, np.int32(chunks), np.uint64(w_address), np.uint64(n * k * 2), np.uint64(x_address),
            np.uint64(chunk * k * 2), np.uint64(y_address), np.uint64(chunk * n * 2), table)


def chunk_addresses_reference(chunk_groups, *, w_address, x_address, y_address, n, k, chunk) -> np.ndarray:
    """The twin: the 3 C addresses (also what Blas writes from the host for host-side groups)."""
    index = np.arange(len(chunk_groups), dtype=np.uint64)
    return np.concatenate([np.uint64(w_address) + np.asarray(chunk_groups, np.uint64) * np.uint64(n * k * 2),
                           np.uint64(x_address) + index * np.uint64(chunk * k * 2),
                           np.uint64(y_address) + index * np.uint64(chunk * n * 2)]).astype(np.uint64)


COMBINE_COLUMNS = 4  # columns per thread of moe_scatter_combine (independent loads in flight)


@kernel((uint16[:, ::1], int32[::1], F32_2D, F32_2D), fastmath=False)
def _moe_scatter_combine_kernel(permuted_out, position_of, weights, residual):
    # thread columns: c0 + k * TILE for k < COMBINE_COLUMNS; per column the same arithmetic as _moe_combine_kernel
    c0 = cuda.blockIdx.y * (TILE * COMBINE_COLUMNS) + cuda.threadIdx.x
    r = cuda.blockIdx.x
    width = residual.shape[1]
    slots = weights.shape[1]
    acc = cuda.local.array(COMBINE_COLUMNS, float32)
    for k in range(COMBINE_COLUMNS):
        acc[k] = float32(0.0)
    for s in range(slots):
        p = position_of[r * slots + s]
        w = weights[r, s]
        for k in range(COMBINE_COLUMNS):
            c = c0 + k * TILE
            if c < width:
                acc[k] += w * bf16_to_f32(permuted_out[p, c])
    for k in range(COMBINE_COLUMNS):
        c = c0 + k * TILE
        if c < width:
            residual[r, c] += acc[k]


@device_function
def _routed_octet(permuted_words, position_of, weights, r, o, width, acc):
    """acc[0..7] = sum_s (ascending s) weights[r, s] * the 8 bf16 outputs of columns 8 o .. 8 o + 7 of row r's slot
    s (each slot's 8 in one 16-byte load); per column the arithmetic of _moe_scatter_combine_kernel."""
    slots = weights.shape[1]
    for k in range(8):
        acc[k] = float32(0.0)
    for s in range(slots):
        p = position_of[r * slots + s]
        w = weights[r, s]
        words = load4(permuted_words, p * (width // 2) + 4 * o)
        for k in range(4):
            acc[2 * k] += w * bf16_to_f32(words[k])
            acc[2 * k + 1] += w * bf16_hi_to_f32(words[k])


@kernel((uint32[:, ::1], int32[::1], F32_2D, F32_2D), fastmath=False)
def _moe_scatter_combine_octets(permuted_words, position_of, weights, residual):
    # thread i: row r = i // octets, columns 8 o .. 8 o + 7 (o = i % octets); the residual's 8 in two 16-byte loads
    width = residual.shape[1]
    r, o = flat_row_piece(width // 8)
    if r < residual.shape[0]:
        acc = cuda.local.array(8, float32)
        _routed_octet(permuted_words, position_of, weights, r, o, width, acc)
        at = r * width + 8 * o
        for half in range(2):
            x0, x1, x2, x3 = load4(residual, at + 4 * half)
            store4(residual, at + 4 * half, x0 + acc[4 * half], x1 + acc[4 * half + 1], x2 + acc[4 * half + 2],
                   x3 + acc[4 * half + 3])


@kernel((uint32[:, ::1], int32[::1], F32_2D, F32_2D, F32_2D, F32_2D),
        (uint32[:, ::1], int32[::1], F32_2D, F32_2D, F32_2D, float32[:, :]), fastmath=False)
def _moe_scatter_combine_shared_octets(permuted_words, position_of, weights, residual, shared_out, gate_logit):
    """`_moe_scatter_combine_octets`, then the shared expert's gated output added as `sigmoid_gate_add` adds it (the
    same two roundings, `_moe_combine_shared_kernel`'s): the prefill's residual read and written once a MoE layer,
    not twice (two memory-bound passes of the 35B-A3B's 8K rows: ~105 + ~47 us a layer)."""
    width = residual.shape[1]
    r, o = flat_row_piece(width // 8)
    if r < residual.shape[0]:
        acc = cuda.local.array(8, float32)
        _routed_octet(permuted_words, position_of, weights, r, o, width, acc)
        gate = sigmoid_f32(gate_logit[r, 0])
        at = r * width + 8 * o
        for half in range(2):
            x0, x1, x2, x3 = load4(residual, at + 4 * half)
            d0, d1, d2, d3 = load4(shared_out, at + 4 * half)
            routed0 = x0 + acc[4 * half]
            routed1 = x1 + acc[4 * half + 1]
            routed2 = x2 + acc[4 * half + 2]
            routed3 = x3 + acc[4 * half + 3]
            store4(residual, at + 4 * half, routed0 + gate * d0, routed1 + gate * d1, routed2 + gate * d2,
                   routed3 + gate * d3)


def moe_scatter_combine(permuted_out, slot_of, weights, top_k, residual, *, position_of, stream, shared_out=None,
                        gate_logit=None):
    """residual[r] += sum_s (ascending s) weights[r, s] * permuted_out[position_of[r*S + s]]. With `shared_out` and
    `gate_logit` (as `moe_combine` takes them), then residual[r] += sigmoid(gate_logit[r, 0]) * shared_out[r]:
    bitwise `sigmoid_gate_add` after the combine, in the same pass where the row width is a multiple of 8.

    permuted_out bf16 bits uint16 [., H] (the expert GEMMs' output, rows in moe_group's permuted order or in
    moe_pad_positions' padded layout), read as their exact fp32 values; weights fp32 [R, S] with S == top_k;
    position_of int32 [R*S], the map that placed the GEMM's input rows (moe_group's, or the padded one). slot_of is
    accepted for symmetry and not read.
    """
    rows, width = residual.shape
    if np.dtype(permuted_out.dtype) != np.uint16 or weights.shape[1] != top_k:
        raise ValueError(f"moe_scatter_combine takes bf16 bits (uint16) expert outputs and top_k weights per row; "
                         f"got {permuted_out.dtype} outputs, weights {tuple(weights.shape)}, top_k {top_k}")
    if (shared_out is None) != (gate_logit is None):
        raise ValueError("moe_scatter_combine takes the shared expert's output and its gate logit together")
    if not rows or not width:
        return
    if width % 8 == 0:  # 16-byte loads (the prefill's 8K x 2048 took 0.19 ms a layer with 2-byte ones: ~0.5 of copy)
        grid = blocks_for(rows * width // 8, TILE)
        if shared_out is None:
            _moe_scatter_combine_octets[grid, TILE, stream](permuted_out.view(np.uint32), position_of, weights,
                                                            residual)
        else:
            _moe_scatter_combine_shared_octets[grid, TILE, stream](permuted_out.view(np.uint32), position_of,
                                                                   weights, residual, shared_out, gate_logit)
        return
    _moe_scatter_combine_kernel[(rows, blocks_for(width, TILE * COMBINE_COLUMNS)), TILE, stream](
        permuted_out, position_of, weights, residual)
    if shared_out is not None:
        sigmoid_gate_add(residual, shared_out, gate_logit, stream=stream)


def moe_scatter_combine_reference(permuted_out, position_of, weights, top_k, residual, shared_out=None,
                                  gate_logit=None):
    rows = residual.shape[0]
    expert_out = bf16_bits_to_f32(np.asarray(permuted_out, np.uint16))[np.asarray(position_of)].reshape(rows, top_k, -1)
    return moe_combine_reference(expert_out, weights, residual, shared_out, gate_logit)
