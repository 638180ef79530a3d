"""The Gated DeltaNet in-projection's tensor-core decode GEMV with the causal conv in its epilogue: one launch
writes `projected` = x W^T and `mixed` = gdn_conv(projected) (with the conv state carried and recording segments'
histories), instead of the GEMV, a launch boundary and the conv kernel.

Why it can: the conv is depthwise, so each output channel reads only its own column of `projected` (the rows of its
segment and the carried state). A block of the GEMV owns a 16-row tile of W, that is 16 channels for every x row of
the launch, so once its warp 0 has stored them the block's threads can convolve those channels without waiting for
any other block (a block's global writes are visible to its own threads after `syncthreads`). Thread (s, c) runs
segment s of channel c row by row.

Why the conv's inputs load before the products: the segment's lane, then the carried state at that lane, are two
dependent round trips (the state from DRAM). Loaded in the epilogue they were paid once a wave of blocks, and the
35B-A3B's 768-block in-projection runs in three: on the H200 the fused step was slower than the two launches
(results/cuda_model_conv_in_projection_session30.json: B=1 3.02 -> 3.11 ms). They depend on nothing the products
write, so each thread of the first SEGMENT_PASS segments issues them before its weight loads and holds them (11
registers) through the sums.

Bits: the products are those of `linear_quant_mma` / `linear_quant_mma_pair` (the same `make_tile_sums` and
`make_store_sums`), each conv output `gdn.conv_silu` of the same four inputs as `gdn_conv`'s: the fused launch equals
the two launches bitwise.
"""

from __future__ import annotations

from numba import float32, int32, uint32

from ninfer.kernels_numba.gdn import CONV_TAPS, conv_silu
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel, register_options
from ninfer.kernels_numba.programmatic import allow_dependents, launch
from ninfer.kernels_numba.quant_mma import (FORMAT_BITS, MAX_X_ROWS, ROW_SETS, TILE_ROWS, UNROLL, WARPS,
                                            make_store_sums, make_tile_sums, partials_bytes, x_fragment_lane,
                                            x_fragment_words, x_sets)

SEGMENT_PASS = 32 * WARPS // TILE_ROWS  # segments one pass of a block's threads convolves (16 channels each)

_SIG = ((uint32[::1],) * 7 + (float32[:, ::1], int32, int32)
        + (float32[:, ::1], float32[:, :, ::1], float32[:, :, :, ::1]) + (int32[::1],) * 4 + (float32[:, ::1], int32))


@device_function
def _convolve(y, mixed, conv_state, conv_columns, c, lane, start, count, record, w0, w1, w2, w3, x0, x1, x2):
    """Channel c of one segment, rows start.. start + count - 1 of y, from the carried state (x0, x1, x2): each
    output from the four inputs `gdn_conv`'s row path reads for it, the history after each row recorded where asked,
    the state left as the last three inputs."""
    for t in range(count):
        x3 = y[start + t, c]
        mixed[start + t, c] = conv_silu(w0, w1, w2, w3, x0, x1, x2, x3)
        if record != 0:
            conv_columns[lane, t, 0, c] = x1
            conv_columns[lane, t, 1, c] = x2
            conv_columns[lane, t, 2, c] = x3
        x0 = x1
        x1 = x2
        x2 = x3
    conv_state[lane, 0, c] = x0
    conv_state[lane, 1, c] = x1
    conv_state[lane, 2, c] = x2


def make_quant_mma_conv_kernel(bits_a: int, bits_b: int, sets: int, max_registers: int | None = None):
    """The fused kernel for a projection of one format (bits_a == bits_b: the 35B-A3B's W8 query|key|value|z, its
    second part never read) or two row blocks in two formats (the 27B's Q4 query|key beside Q5 value|z, as
    `make_quant_mma_pair_kernel` runs them), for up to 8 `sets` x rows."""
    ACC = 4 * sets
    sums_a = make_tile_sums(bits_a, 1, WARPS, UNROLL, sets)
    sums_b = sums_a if bits_b == bits_a else make_tile_sums(bits_b, 1, WARPS, UNROLL, sets)
    store_sums = make_store_sums(1, sets)
    one_format = bits_a == bits_b

    @kernel(_SIG, fastmath=False, **register_options(max_registers))
    def quant_mma_conv_kernel(xf, base_a, high_a, scales_a, base_b, high_b, scales_b, y, blocks, rows_a, conv_weight,
                              conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, mixed, channels):
        """y[:, :rows_a] = x W_a^T, y[:, rows_a:] = x W_b^T, then mixed[:, :channels] = the conv of y's first
        `channels` columns (the state and histories as `gdn_conv` keeps them)."""
        allow_dependents()
        partials = cuda.shared.array(0, float32)
        N = int32(y.shape[1])
        tiles_a = (rows_a + 15) >> 4
        tile = int32(cuda.blockIdx.x)
        in_a = tile < tiles_a  # block-uniform: the barriers inside the sums see every thread of the block
        local = tile if in_a else tile - tiles_a
        last = tiles_a - 1 if in_a else ((N - rows_a + 15) >> 4) - 1
        first = local * TILE_ROWS + (0 if in_a else rows_a)
        end = min(rows_a if in_a else N, channels)  # the block's channels: first .. end - 1
        segments = int32(seg_lane.shape[0])
        tid = int32(cuda.threadIdx.x)
        s = tid // TILE_ROWS
        c = first + tid - s * TILE_ROWS
        lane = start = count = record = int32(0)
        w0 = w1 = w2 = w3 = x0 = x1 = x2 = float32(0.0)
        mine = s < segments and c < end
        if mine:  # this thread's conv inputs, before the weight loads (see the module's docstring)
            lane = seg_lane[s]
            start = seg_row[s]
            count = seg_count[s]
            record = seg_record[s]
            w0 = conv_weight[0, c]
            w1 = conv_weight[1, c]
            w2 = conv_weight[2, c]
            w3 = conv_weight[3, c]
            x0 = conv_state[lane, 0, c]
            x1 = conv_state[lane, 1, c]
            x2 = conv_state[lane, 2, c]
        acc = cuda.local.array(ACC, float32)
        x_lane_index = x_fragment_lane(int32(y.shape[0]))
        if one_format:  # one copy of the sums' code, its planes picked per block
            sums_a(acc, partials, xf, int32(0), x_lane_index, base_a if in_a else base_b,
                   high_a if in_a else high_b, scales_a if in_a else scales_b, local, last, blocks)
        elif in_a:
            sums_a(acc, partials, xf, int32(0), x_lane_index, base_a, high_a, scales_a, local, last, blocks)
        else:
            sums_b(acc, partials, xf, int32(0), x_lane_index, base_b, high_b, scales_b, local, last, blocks)
        store_sums(y, acc, first, rows_a if in_a else N, 0)
        if first < end:  # block-uniform
            cuda.syncthreads()  # warp 0's stores of y, visible to the block
            if mine:
                _convolve(y, mixed, conv_state, conv_columns, c, lane, start, count, record, w0, w1, w2, w3, x0, x1,
                          x2)
            if c < end:
                for later in range(s + SEGMENT_PASS, segments, SEGMENT_PASS):  # past one pass: loaded here
                    at = seg_lane[later]
                    _convolve(y, mixed, conv_state, conv_columns, c, at, seg_row[later], seg_count[later],
                              seg_record[later], conv_weight[0, c], conv_weight[1, c], conv_weight[2, c],
                              conv_weight[3, c], conv_state[at, 0, c], conv_state[at, 1, c], conv_state[at, 2, c])

    return quant_mma_conv_kernel


# Register caps that keep a fused variant at its plain kernel's blocks an SM (256 threads: 3 at <= 80 registers, 2 at
# <= 128), from ptxas's counts (tools/sass.py; plain -> fused uncapped): Q4 | Q5 one set 72 -> 91 (80 spills 28
# bytes to local memory, read once), three sets 123 -> 131; W8 two sets 124 -> 148. The others stay within their
# plain kernel's blocks uncapped (W8 one set 96 -> 128).
CONV_REGISTER_CAPS = {(4, 5, 1): 80, (4, 5, 3): 128, (8, 8, 2): 128}

# The in-projections the ninfer-v2 recipe writes (convert/qwen_hf.py): W8 whole (the MoE models), Q4 beside Q5 (the
# dense ones). Others keep the GEMV and the conv kernel.
QUANT_MMA_CONV_KERNELS = {(a, b, sets): make_quant_mma_conv_kernel(a, b, sets, CONV_REGISTER_CAPS.get((a, b, sets)))
                          for a, b in ((8, 8), (4, 5)) for sets in range(1, ROW_SETS + 1)}


def has_conv_kernel(parts) -> bool:
    """Whether `linear_quant_mma_conv` takes this projection: one quantized matrix or two row blocks of one K whose
    formats have a compiled fused kernel."""
    if len(parts) not in (1, 2) or any(getattr(part, "fmt", None) not in FORMAT_BITS for part in parts):
        return False
    first, second = parts[0], parts[-1]
    return (FORMAT_BITS[first.fmt], FORMAT_BITS[second.fmt], 1) in QUANT_MMA_CONV_KERNELS and (
        first.shape[1] == second.shape[1])


def check_conv_shapes(x_words: int, parts, y_shape: tuple[int, int], mixed_shape: tuple[int, int], channels: int,
                      conv_shapes: tuple[tuple[int, ...], ...]) -> None:
    """The ValueError of `linear_quant_mma_conv` (and its host twin) for parts or shapes it cannot run."""
    M, N = y_shape
    weight, state, columns = conv_shapes
    sets = x_sets(M)
    if not has_conv_kernel(parts) or N != sum(part.shape[0] for part in parts) or sets > ROW_SETS or (
            x_words < sets * x_fragment_words(parts[0].shape[1])):
        raise ValueError(f"tensor-core conv projection: W {[(p.shape, getattr(p, 'fmt', None)) for p in parts]}, "
                         f"y{tuple(y_shape)} (M <= {MAX_X_ROWS * ROW_SETS}), {x_words} x words")
    if not 0 < channels <= N or mixed_shape[0] != M or mixed_shape[1] < channels or weight[0] != CONV_TAPS or (
            weight[1] < channels or state[1] != CONV_TAPS - 1 or state[2] < channels or columns[2] != CONV_TAPS - 1
            or columns[3] < channels):
        raise ValueError(f"tensor-core conv projection: {channels} channels of y{tuple(y_shape)} into "
                         f"mixed{tuple(mixed_shape)}, conv weight {weight}, state {state}, histories {columns}")


def linear_quant_mma_conv(xf, parts, y, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count,
                          seg_record, mixed, *, channels: int, stream, programmatic: bool = False) -> None:
    """y[M, :] = x @ W^T for W one quantized matrix or two row blocks side by side (`parts`, M <= 8 ROW_SETS, x
    given as its fragments), and mixed = gdn_conv(y, ...) over the first `channels` columns, in one launch: bitwise
    `linear_quant_mma` (or `linear_quant_mma_pair`) then `gdn_conv`. Capture-safe. With `programmatic`, the conv
    state and the segment arrays are read before the kernel before this one completes: nothing launched right
    before it may write them (in decode, a norm precedes it)."""
    check_conv_shapes(xf.shape[0], parts, y.shape, mixed.shape, channels,
                      (conv_weight.shape, conv_state.shape, conv_columns.shape))
    M = y.shape[0]
    if M == 0:
        return
    first, second = parts[0], parts[-1]
    fn = QUANT_MMA_CONV_KERNELS[FORMAT_BITS[first.fmt], FORMAT_BITS[second.fmt], x_sets(M)]
    rows_a = first.shape[0] if len(parts) == 2 else y.shape[1]
    grid = -(-rows_a // TILE_ROWS) + (-(-second.shape[0] // TILE_ROWS) if len(parts) == 2 else 0)
    launch(fn, grid, 32 * WARPS, stream, partials_bytes(1, WARPS, x_sets(M)), xf, first.base, first.high,
           first.scales, second.base, second.high, second.scales, y, int32(first.blocks), int32(rows_a), conv_weight,
           conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, mixed, int32(channels),
           programmatic=programmatic)
