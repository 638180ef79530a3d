"""The MoE decode's bf16 experts in one launch: the router GEMV, the top-k routing, the routed experts' gate | up and
their down GEMV of silu(gate) * up, and the shared expert's two GEMVs, as work items of one grid.

Why: at batch 1 the 35B-A3B's MoE block was four launches on the critical path of every layer (H200, bf16,
results/cuda_model_fused_moe_v1_session31.log): the router's cuBLAS GEMV 5.5 us for its 1 MB, the routing 4.8, the
gathered gate | up 14.4 for 33.5 MB and the down 9.2 for 16.8 MB, each behind a launch boundary, with the shared
expert's three launches on a second stream beside them. A first version of this kernel (16-row items, the shared
expert left on that stream) took 40 us a launch, and the shared expert, finding no SM free, ran after it: the step
went 3.76 -> 4.63 ms. This one (4-row items, the shared expert as items) takes 66 us a launch (B=1 3.72 -> 5.08 ms,
B=8 8.46 -> 19.26; results/cuda_model_fused_moe_v2_session31.json): a block's items run one after another, and
each pays its DRAM round trip, x staging, barriers and counter fence in series, where the separate launches' blocks
overlap them. So `Capacity.fused_moe_decode` is off.

Items, in the order a block takes them (block b: items b, b + G, b + 2G, ... for a grid of G blocks); an item is
4 weight rows, one a warp, each warp's lanes loading all of a row's 2048-column round at once:
    router          (x row m, 4 router rows): logits[m, rows]                        waits for nothing
    shared gate|up  (x row m, 4 rows): shared_gate_up[m, rows]                        waits for nothing
    route           (x row m): `moe.route_row` on the row's logits                    waits for row m's router items
    shared down     (x row m, 4 rows) of silu(gate) * up: shared_out[m, rows]         waits for row m's shared gate|up
    gate | up       (slot j = m S + s, 4 rows of expert ids[m, s]'s gate | up)        waits for row m's route
    down            (slot j, 4 rows of expert ids[m, s]'s down, of silu(gate) * up)   waits for slot j's gate | up
An item waits only for items before it, so with every block resident at once (G is at most what fits on the GPU,
`resident_blocks`) the first unfinished item always runs: no wait lasts forever.

A writer's block meets at a barrier after its stores; its thread 0 fences and counts the item done. A waiter's
thread 0 polls the counter (`ld.acquire.gpu`), fences and releases its block, which then reads what the kernel wrote
with `ld.global.cg` (L2, past an L1 that may hold lines of an earlier launch). A block stages an x row in shared
memory once for all its items of that row. The last block out zeroes the counters for the next launch (a graph
replays the same buffer).

Every sum is a row's lanes in the same order as the skinny and gathered kernels' (`linear_bf16_gathered`: 8 columns
a lane, 256-column steps in order, then the warp sum), so every output equals theirs bit for bit: the router and the
shared expert as gathered GEMVs of one expert, the routing as `route_top_k`, the routed experts as
`linear_bf16_gathered(_swiglu)`. `rounding` rounds the router's, the shared gate | up's and the shared down's inputs
to bf16 where the separate path would hand them to cuBLAS (bits 1, 2, 4), so the routing is the same whichever path
runs (up to cuBLAS's own summation order).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import float32, int32, int64, uint32, uint64
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.kernels_numba.common import address_of, bf16_to_f32, f32_to_bf16, silu_times
from ninfer.kernels_numba.linear import (fma_bf16x8, linear_bf16_gathered_reference,
                                         linear_bf16_gathered_swiglu_reference, linear_bf16_reference, load2, load4,
                                         store4, warp_sum)
from ninfer.kernels_numba.elementwise import silu_mul_rows_reference
from ninfer.kernels_numba.moe import MAX_EXPERTS, check_route, route_row, route_top_k_reference
from ninfer.kernels_numba.numba_setup import config, cuda, device_function, kernel

WARPS = 4
THREADS = 32 * WARPS
ITEM_ROWS = WARPS  # weight rows an item: one a warp
STEPS = 8  # 256-column steps a warp's lanes load at once (a round of 2048 columns: 32 registers of weights)
MAX_ROWS = 8  # x rows (decode rows) a launch
MAX_SLOTS = 8  # experts a row
MAX_K = 8192  # a GEMV's K, staged whole in shared memory (32 KiB)
# counters: [0] blocks out; then per x row m: router items done, routed, shared gate | up items done; then per slot
# j: its gate | up items done
ROUTER_DONE = 1
ROUTED = ROUTER_DONE + MAX_ROWS
SHARED_DONE = ROUTED + MAX_ROWS
GATE_UP_DONE = SHARED_DONE + MAX_ROWS
COUNTERS = GATE_UP_DONE + MAX_ROWS * MAX_SLOTS
POLL_NS = 64  # a waiter's pause between polls
# 4 blocks an SM (16 warps, each with a row's 2048-column round in flight) instead of the 2 that ptxas's 174 leave
MAX_REGISTERS = 128
ROUND_ROUTER, ROUND_SHARED_GATE_UP, ROUND_SHARED_DOWN = 1, 2, 4  # `rounding` bits
# what a block's shared x holds (`staged`): source * SOURCE_ROWS + row
H_PLAIN, H_ROUNDED, SWIGLU_ROUTED, SWIGLU_SHARED, SWIGLU_SHARED_ROUNDED = 0, 1, 2, 3, 4
SOURCE_ROWS = MAX_ROWS * MAX_SLOTS  # (also the slots' count: the expert ids a block keeps)


def _word_load(instruction: str):
    @intrinsic
    def load(typingctx, address):
        """A uint32 word at a global byte address, as an asm statement with a memory clobber: LLVM neither hoists
        it out of a polling loop nor moves it across the barriers around it (numba's `ldcg` is a plain asm that it
        may move)."""
        def codegen(context, builder, sig, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            return builder.asm(ir.FunctionType(i32, [i64]), f"{instruction} $0, [$1];", "=r,l,~{memory}",
                               [args[0]], side_effect=True)

        return uint32(int64), codegen

    return load


load_cg_word_at = _word_load("ld.global.cg.b32")  # from L2: past an L1 that may hold an earlier launch's lines
load_acquire_word_at = _word_load("ld.acquire.gpu.global.b32")


@device_function
def fresh_float(array, row, column):
    """array[row, column] (C-contiguous float32) from L2: a value another block of this launch wrote."""
    at = address_of(array) + (int64(row) * array.shape[1] + column) * 4
    return libdevice.int_as_float(int32(load_cg_word_at(at)))


@device_function
def fresh_int(array, row, column):
    """array[row, column] (C-contiguous int32) from L2."""
    return int32(load_cg_word_at(address_of(array) + (int64(row) * array.shape[1] + column) * 4))


@device_function
def poll_counter(counters, index):
    return int32(load_acquire_word_at(address_of(counters) + int64(index) * 4))


@device_function
def pause():
    cuda.nanosleep(POLL_NS)


@device_function
def wait_for(counters, index, target):
    """Hold the block until counters[index] reaches target; what the counted items wrote is then visible."""
    if cuda.threadIdx.x == 0:
        while poll_counter(counters, index) < target:
            pause()
        cuda.threadfence()
    cuda.syncthreads()


@device_function
def count_done(counters, index):
    """Count this block's item done once every thread's stores are in (the barrier) and visible (the fence)."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.threadfence()
        cuda.atomic.add(counters, index, 1)


@device_function
def as_bf16(value, rounded):
    return bf16_to_f32(f32_to_bf16(value)) if rounded else value


@device_function
def stage_row(xs, x, row, k, rounded):
    """x[row, :k] into xs in `stage_x`'s layout 0 (column 256 q + 8 l + 4 h + e at 256 q + 128 h + 4 l + e),
    rounded to bf16 when asked."""
    c = cuda.threadIdx.x * 8
    while c < k:
        v0, v1, v2, v3 = load4(x, row * x.shape[1] + c)
        v4, v5, v6, v7 = load4(x, row * x.shape[1] + c + 4)
        d = ((c >> 8) << 8) + ((c & 255) >> 1)
        store4(xs, d, as_bf16(v0, rounded), as_bf16(v1, rounded), as_bf16(v2, rounded), as_bf16(v3, rounded))
        store4(xs, d + 128, as_bf16(v4, rounded), as_bf16(v5, rounded), as_bf16(v6, rounded), as_bf16(v7, rounded))
        c += cuda.blockDim.x * 8


@device_function
def stage_swiglu_row(xs, gate_up, row, rounded):
    """silu(gate) * up of gate_up[row] (its gate | up halves) into xs in layout 0, by `silu_times` as
    `linear.stage_swiglu_bf16` and the silu-mul kernels compute it, read with `fresh_float`; rounded to bf16 when
    asked (as `silu_mul_rows`' bf16 copy)."""
    inter = gate_up.shape[1] >> 1
    c = cuda.threadIdx.x * 8
    while c < inter:
        a0 = silu_times(fresh_float(gate_up, row, c), fresh_float(gate_up, row, inter + c))
        a1 = silu_times(fresh_float(gate_up, row, c + 1), fresh_float(gate_up, row, inter + c + 1))
        a2 = silu_times(fresh_float(gate_up, row, c + 2), fresh_float(gate_up, row, inter + c + 2))
        a3 = silu_times(fresh_float(gate_up, row, c + 3), fresh_float(gate_up, row, inter + c + 3))
        a4 = silu_times(fresh_float(gate_up, row, c + 4), fresh_float(gate_up, row, inter + c + 4))
        a5 = silu_times(fresh_float(gate_up, row, c + 5), fresh_float(gate_up, row, inter + c + 5))
        a6 = silu_times(fresh_float(gate_up, row, c + 6), fresh_float(gate_up, row, inter + c + 6))
        a7 = silu_times(fresh_float(gate_up, row, c + 7), fresh_float(gate_up, row, inter + c + 7))
        d = ((c >> 8) << 8) + ((c & 255) >> 1)
        store4(xs, d, as_bf16(a0, rounded), as_bf16(a1, rounded), as_bf16(a2, rounded), as_bf16(a3, rounded))
        store4(xs, d + 128, as_bf16(a4, rounded), as_bf16(a5, rounded), as_bf16(a6, rounded), as_bf16(a7, rounded))
        c += cuda.blockDim.x * 8


_F32_2D = float32[:, ::1]
_U64_2D = uint64[:, ::1]
_SIGNATURE = (_F32_2D, _U64_2D, _F32_2D, int32, int32, int32[:, ::1], _F32_2D, _U64_2D, _F32_2D, _U64_2D, _F32_2D,
              _U64_2D, _F32_2D, _U64_2D, _F32_2D, int32[::1], int32)


@kernel(_SIGNATURE, fastmath=False, max_registers=MAX_REGISTERS)
def moe_decode_bf16_kernel(h, router_w, logits, n_exp, top_k, ids, weights, gate_up_w, gate_up, down_w, out,
                           shared_gate_up_w, shared_gate_up, shared_down_w, shared_out, counters, rounding):
    xs = cuda.shared.array(0, float32)
    row_logits = cuda.shared.array((1, MAX_EXPERTS), float32)
    ids_seen = cuda.shared.array(SOURCE_ROWS, int32)  # the rows' expert ids, once routed (`seen`)
    wa = cuda.local.array(STEPS, uint64)
    wb = cuda.local.array(STEPS, uint64)
    tid = cuda.threadIdx.x
    lane = tid & 31
    warp = tid >> 5
    rows_x = h.shape[0]
    hidden = h.shape[1]
    router_rows = router_w.shape[0]
    routed_rows = gate_up.shape[1]
    shared_rows = shared_gate_up.shape[1]
    router_items = (router_rows + ITEM_ROWS - 1) // ITEM_ROWS
    shared_gate_up_items = (shared_rows + ITEM_ROWS - 1) // ITEM_ROWS
    down_items = (hidden + ITEM_ROWS - 1) // ITEM_ROWS  # the routed and the shared down's
    gate_up_items = (routed_rows + ITEM_ROWS - 1) // ITEM_ROWS
    end_router = rows_x * router_items
    end_shared_gate_up = end_router + rows_x * shared_gate_up_items
    end_route = end_shared_gate_up + rows_x
    end_shared_down = end_route + rows_x * down_items
    end_gate_up = end_shared_down + rows_x * top_k * gate_up_items
    total = end_gate_up + rows_x * top_k * down_items
    staged = int32(-1)
    seen = int32(0)

    item = int32(cuda.blockIdx.x)
    while item < total:
        if item >= end_shared_gate_up and item < end_route:  # route row m on its finished logits, one warp
            m = item - end_shared_gate_up
            wait_for(counters, ROUTER_DONE + m, router_items)
            for e in range(tid, n_exp, THREADS):
                row_logits[0, e] = fresh_float(logits, m, e)
            cuda.syncthreads()
            if warp == 0:
                route_row(row_logits, 0, n_exp, top_k, ids[m:m + 1], weights[m:m + 1], lane)
            count_done(counters, ROUTED + m)
        else:  # 4 rows of one matrix, a row a warp, times one staged x row
            w = router_w
            y = logits
            rows = router_rows
            k = hidden
            base = int64(0)
            done = int32(-1)
            wait_index = int32(-1)
            wait_target = int32(0)
            if item < end_shared_gate_up:
                if item < end_router:
                    y_row = item // router_items
                    block_row = item - y_row * router_items
                    done = ROUTER_DONE + y_row
                    source = H_ROUNDED if rounding & ROUND_ROUTER else H_PLAIN
                else:
                    y_row = (item - end_router) // shared_gate_up_items
                    block_row = item - end_router - y_row * shared_gate_up_items
                    w = shared_gate_up_w
                    y = shared_gate_up
                    rows = shared_rows
                    done = SHARED_DONE + y_row
                    source = H_ROUNDED if rounding & ROUND_SHARED_GATE_UP else H_PLAIN
                x_row = y_row
            elif item < end_shared_down:
                y_row = (item - end_route) // down_items
                block_row = item - end_route - y_row * down_items
                w = shared_down_w
                y = shared_out
                rows = hidden
                k = shared_rows >> 1
                wait_index = SHARED_DONE + y_row
                wait_target = shared_gate_up_items
                source = SWIGLU_SHARED_ROUNDED if rounding & ROUND_SHARED_DOWN else SWIGLU_SHARED
                x_row = y_row
            else:
                if item < end_gate_up:
                    y_row = (item - end_shared_down) // gate_up_items
                    block_row = item - end_shared_down - y_row * gate_up_items
                    w = gate_up_w
                    y = gate_up
                    rows = routed_rows
                    done = GATE_UP_DONE + y_row
                    source = H_PLAIN
                    x_row = y_row // top_k
                else:
                    y_row = (item - end_gate_up) // down_items
                    block_row = item - end_gate_up - y_row * down_items
                    w = down_w
                    y = out
                    rows = hidden
                    k = routed_rows >> 1
                    wait_index = GATE_UP_DONE + y_row
                    wait_target = gate_up_items
                    source = SWIGLU_ROUTED
                    x_row = y_row
                m = y_row // top_k
                if (seen >> m) & 1 == 0:  # the row's expert ids, once a block
                    wait_for(counters, ROUTED + m, 1)
                    if tid < top_k:
                        ids_seen[m * MAX_SLOTS + tid] = fresh_int(ids, m, tid)
                    cuda.syncthreads()
                    seen |= int32(1) << m
                base = int64(ids_seen[m * MAX_SLOTS + y_row - m * top_k]) * rows
            n = block_row * ITEM_ROWS + warp
            rowoff = (base + min(n, rows - 1)) * (k >> 2)
            acc = float32(0.0)
            key = source * SOURCE_ROWS + x_row
            for c0 in range(0, k, STEPS * 256):
                for i in range(STEPS):  # the round's weights in flight while the block waits and stages x
                    c = c0 + lane * 8 + 256 * i
                    if c < k:
                        wa[i], wb[i] = load2(w, rowoff + (c >> 2))
                if c0 == 0:
                    if wait_index >= 0:
                        wait_for(counters, wait_index, wait_target)
                    if key != staged:
                        cuda.syncthreads()  # every warp is done with the x staged before
                        if source == SWIGLU_ROUTED:
                            stage_swiglu_row(xs, gate_up, x_row, False)
                        elif source >= SWIGLU_SHARED:
                            stage_swiglu_row(xs, shared_gate_up, x_row, source == SWIGLU_SHARED_ROUNDED)
                        else:
                            stage_row(xs, h, x_row, k, source == H_ROUNDED)
                        cuda.syncthreads()
                        staged = key
                for i in range(STEPS):
                    c = c0 + lane * 8 + 256 * i
                    if c < k:
                        p = c - lane * 4
                        x0, x1, x2, x3 = load4(xs, p)
                        x4, x5, x6, x7 = load4(xs, p + 128)
                        acc = fma_bf16x8(acc, wa[i], wb[i], x0, x1, x2, x3, x4, x5, x6, x7)
            total_n = warp_sum(acc)
            if lane == 0 and n < rows:
                y[y_row, n] = total_n
            if done >= 0:
                count_done(counters, done)
        item += int32(cuda.gridDim.x)

    cuda.syncthreads()
    if tid == 0:
        cuda.threadfence()
        if cuda.atomic.add(counters, 0, 1) == cuda.gridDim.x - 1:  # the last block out
            for i in range(1, COUNTERS):
                cuda.atomic.exch(counters, i, 0)
            cuda.atomic.exch(counters, 0, 0)


def moe_decode_fits(rows: int, hidden: int, inter: int, shared_inter: int, experts: int, top_k: int) -> bool:
    """Whether `moe_decode_bf16` takes these shapes (rows decode rows of top_k of `experts` experts)."""
    return (0 < rows <= MAX_ROWS and 0 < top_k <= min(MAX_SLOTS, experts) and experts <= MAX_EXPERTS
            and all(n % 8 == 0 and 0 < n <= MAX_K for n in (hidden, inter, shared_inter)))


def check_moe_decode(h_shape, router_shape, logits_shape, top_k: int, experts: int, gate_up_shape, down_shape,
                     shared_gate_up_shape, shared_down_shape, counters_size: int) -> None:
    """The ValueError of a `moe_decode_bf16` launch (and its host twin) its kernel cannot run."""
    rows, hidden = h_shape
    inter2 = gate_up_shape[0] // max(experts, 1)
    shared2 = shared_gate_up_shape[0]
    check_route(top_k, experts, logits_shape[1])
    problems = []
    if not 0 < rows <= MAX_ROWS or top_k > MAX_SLOTS:
        problems.append(f"at most {MAX_ROWS} rows of at most {MAX_SLOTS} experts (got {rows} rows, k={top_k})")
    if router_shape[1] != hidden or logits_shape[0] < rows or logits_shape[1] < router_shape[0]:
        problems.append(f"router {router_shape} against h {h_shape} and logits {logits_shape}")
    if gate_up_shape[1] != hidden or gate_up_shape[0] != experts * inter2 or inter2 % 2:
        problems.append(f"gate | up {gate_up_shape} for {experts} experts of width {hidden}")
    if down_shape != (experts * hidden, inter2 // 2):
        problems.append(f"down {down_shape}, not ({experts * hidden}, {inter2 // 2})")
    if shared_gate_up_shape[1] != hidden or shared2 % 2 or shared_down_shape != (hidden, shared2 // 2):
        problems.append(f"shared expert {shared_gate_up_shape} / {shared_down_shape} for width {hidden}")
    if not moe_decode_fits(min(rows, MAX_ROWS) or 1, hidden, inter2 // 2 or 8, shared2 // 2 or 8, experts,
                           min(top_k, MAX_SLOTS)):
        problems.append(f"K (hidden {hidden}, intermediate {inter2 // 2}, shared {shared2 // 2}) a multiple of 8, "
                        f"at most {MAX_K}")
    if counters_size < COUNTERS:
        problems.append(f"{COUNTERS} counters, got {counters_size}")
    if problems:
        raise ValueError("moe_decode_bf16: " + "; ".join(problems))


def _as_u64(w):
    return w.view(np.uint64) if w.dtype == np.uint16 else w


_RESIDENT: dict[int, int] = {}


def resident_blocks(shared_bytes: int) -> int:
    """Blocks of the kernel that fit on the current GPU at once (the grid's ceiling: see the module docstring)."""
    if shared_bytes not in _RESIDENT:
        _RESIDENT[shared_bytes] = 1 if config.ENABLE_CUDASIM else int(
            moe_decode_bf16_kernel.compile(_SIGNATURE).max_cooperative_grid_blocks(THREADS, shared_bytes))
    return _RESIDENT[shared_bytes]


def _bf16_shape(w) -> tuple[int, int]:
    return (w.shape[0], w.shape[1] * 4) if w.dtype == np.uint64 else tuple(w.shape)


def moe_decode_bf16(h, router_w, logits, top_k, expert_ids, weights, gate_up_w, gate_up, down_w, out,
                    shared_gate_up_w, shared_gate_up, shared_down_w, shared_out, counters, *, experts, stream,
                    rounding=0, blocks=None) -> None:
    """One launch for the decode rows' MoE experts (bf16 weights):
        logits[:, :Nr] = h @ router_w^T (router_w [Nr, H]: the router's E rows first; Nr <= logits' columns),
        expert_ids, weights = route_top_k(logits, top_k, experts=E),
        gate_up[m, s] = h[m] @ W_gate_up(expert_ids[m, s])^T   (gate_up_w [E 2I, H]; gate_up [M, k, 2I]),
        out[m, s] = (silu(gate) * up)(gate_up[m, s]) @ W_down(expert_ids[m, s])^T   (down_w [E H, I]; out [M, k, H]),
        shared_gate_up = h @ shared_gate_up_w^T ([2Is, H]; [M, 2Is]),
        shared_out = (silu(gate) * up)(shared_gate_up) @ shared_down_w^T ([H, Is]; [M, H]).
    h fp32 [M, H] (M <= MAX_ROWS); counters int32 [>= COUNTERS], zero (the kernel leaves them zero). `rounding`:
    ROUND_ROUTER | ROUND_SHARED_GATE_UP | ROUND_SHARED_DOWN, the inputs rounded to bf16 (as cuBLAS takes them).
    `blocks`: the grid (default: as many as fit on the GPU at once; any count up to that gives the same bits)."""
    rows = h.shape[0]
    weights64 = [_as_u64(a) for a in (router_w, gate_up_w, down_w, shared_gate_up_w, shared_down_w)]
    router64, gate_up64, down64, shared_gate_up64, shared_down64 = weights64
    check_moe_decode(h.shape, _bf16_shape(router64), logits.shape, top_k, experts, _bf16_shape(gate_up64),
                     _bf16_shape(down64), _bf16_shape(shared_gate_up64), _bf16_shape(shared_down64),
                     counters.shape[0])
    hidden, inter, shared_inter = h.shape[1], gate_up.shape[2] // 2, shared_gate_up.shape[1] // 2
    assert gate_up.shape == (rows, top_k, 2 * inter) and out.shape == (rows, top_k, hidden)
    assert shared_gate_up.shape[0] == rows and shared_out.shape == (rows, hidden)
    shared = -(-max(hidden, inter, shared_inter) // 256) * 256 * 4  # stage_x's layout spans 256 columns
    items = rows * (-(-router64.shape[0] // ITEM_ROWS) + -(-2 * shared_inter // ITEM_ROWS) + 1
                    + -(-hidden // ITEM_ROWS) + top_k * (-(-2 * inter // ITEM_ROWS) + -(-hidden // ITEM_ROWS)))
    grid = min(items, resident_blocks(shared) if blocks is None else int(blocks))
    moe_decode_bf16_kernel[grid, THREADS, stream, shared](
        h, router64, logits, np.int32(experts), np.int32(top_k), expert_ids, weights, gate_up64,
        gate_up.reshape(rows * top_k, 2 * inter), down64, out.reshape(rows * top_k, hidden), shared_gate_up64,
        shared_gate_up, shared_down64, shared_out, counters, np.int32(rounding))


def _bf16_rounded(values: np.ndarray, rounded: bool) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(values)) if rounded else values


def moe_decode_bf16_reference(h: np.ndarray, router_w: np.ndarray, top_k: int, gate_up_w: np.ndarray,
                              down_w: np.ndarray, shared_gate_up_w: np.ndarray, shared_down_w: np.ndarray, *,
                              experts: int, rounding: int = 0):
    """(logits [M, Nr], expert_ids [M, k], weights [M, k], gate_up [M, k, 2I], out [M, k, H], shared_gate_up
    [M, 2Is], shared_out [M, H]) of `moe_decode_bf16` from the separate kernels' twins."""
    logits = linear_bf16_reference(_bf16_rounded(h, bool(rounding & ROUND_ROUTER)), router_w)
    ids, weights = route_top_k_reference(logits[:, :experts], top_k)
    hidden = h.shape[1]
    gate_up = linear_bf16_gathered_reference(h, gate_up_w, ids, rows_per_expert=gate_up_w.shape[0] // experts,
                                             x_per_slot=False)
    out = linear_bf16_gathered_swiglu_reference(gate_up, down_w, ids, rows_per_expert=hidden)
    shared_gate_up = linear_bf16_reference(_bf16_rounded(h, bool(rounding & ROUND_SHARED_GATE_UP)), shared_gate_up_w)
    act = _bf16_rounded(silu_mul_rows_reference(shared_gate_up), bool(rounding & ROUND_SHARED_DOWN))
    return logits, ids, weights, gate_up, out, shared_gate_up, linear_bf16_reference(act, shared_down_w)
