"""Device-side sampling helpers (math: `ninfer.engine.sampler`, ninfer-facts §4.8): greedy argmax, the 20 best
penalised candidates per row (the host finishes the pipeline over them) and the generated-token counts.

Ordering is done on 64-bit keys `(orderable fp32 bits << 32) | ~id`: the unsigned order of the keys is exactly
"value descending, id ascending", so a maximum over keys is order independent (deterministic, batch invariant) and
ties go to the lowest id, as `np.argmax` and `sampler.top_candidates`. -0.0 is treated as +0.0 (they compare equal
in NumPy). NaN logits are not supported.

Both row kernels split each row into chunks of CHUNK = 4096 columns (grid: chunks x rows, 256 threads, 16 columns a
thread), write per-chunk results into a uint64 scratch [rows, chunks * TOP_K_CAP], and a second small kernel per
row combines them. The scratch is passed as `scratch=` (see `sampling_scratch`) or, when omitted, a module-cached
buffer is used: call `reserve_sampling_scratch(max_rows, vocab_ids)` once before any CUDA-graph capture so the
launchers never allocate during capture.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, float64, int32, uint8, uint32, uint64
from numba.cuda import libdevice

from ninfer.engine.sampler import TOP_K_CAP, top_candidates
from ninfer.kernels_numba.common import GOLDEN_GAMMA, blocks_for, mix64, warp_max_u32
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel

THREADS = 256
WARPS = THREADS // 32
ITEMS = 16  # columns per thread per chunk
CHUNK = THREADS * ITEMS
COMBINE_WARPS = 4  # rows per block of the argmax combine
SIGN = 0x80000000

F32_2D = float32[:, ::1]
U64_2D = uint64[:, ::1]


def chunks_for(vocab_ids: int) -> int:
    return max(1, -(-vocab_ids // CHUNK))


def scratch_columns(vocab_ids: int) -> int:
    """Columns of the uint64 scratch a row needs (top_candidates; argmax needs only chunks_for(vocab_ids))."""
    columns = chunks_for(vocab_ids) * TOP_K_CAP
    if columns > CHUNK:
        raise ValueError(f"vocab_ids {vocab_ids} too large for a single combine block")
    return columns


def sampling_scratch(rows: int, vocab_ids: int):
    """A device scratch for argmax_rows / top_candidates_rows of up to `rows` rows: uint64 [rows, columns]."""
    return cuda.device_array((max(1, rows), scratch_columns(vocab_ids)), dtype=np.uint64)


_CACHED: list = []


def reserve_sampling_scratch(max_rows: int, vocab_ids: int):
    """Allocate (or grow) the module-cached scratch; call before capturing graphs that use the default scratch."""
    need_cols = scratch_columns(vocab_ids)
    if not _CACHED or _CACHED[0].shape[0] < max_rows or _CACHED[0].shape[1] < need_cols:
        rows = max(max_rows, _CACHED[0].shape[0] if _CACHED else 0)
        cols = max(need_cols, _CACHED[0].shape[1] if _CACHED else 0)
        _CACHED[:] = [cuda.device_array((rows, cols), dtype=np.uint64)]
    return _CACHED[0]


def _scratch(scratch, rows: int, vocab_ids: int):
    if scratch is None:
        scratch = reserve_sampling_scratch(rows, vocab_ids)
    if scratch.shape[0] < rows or scratch.shape[1] < scratch_columns(vocab_ids):
        raise ValueError(f"sampling scratch {scratch.shape} too small for {rows} rows of {vocab_ids} ids")
    return scratch


# ---------------------------------------------------------------------------------------------------- keys


@device_function
def order_key(value, idx):
    """uint64 key: unsigned order == (value descending, idx ascending) reversed, i.e. max key = best."""
    if value == float32(0.0):
        value = float32(0.0)  # -0.0 ties with +0.0
    bits = uint32(libdevice.float_as_int(value))
    if bits & uint32(SIGN):
        bits = ~bits
    else:
        bits = bits | uint32(SIGN)
    return (uint64(bits) << uint64(32)) | uint64(~uint32(idx))


@device_function
def key_id(key):
    return int32(~uint32(key & uint64(0xFFFFFFFF)))


@device_function
def key_value(key):
    bits = uint32(key >> uint64(32))
    if bits & uint32(SIGN):
        bits = bits & uint32(0x7FFFFFFF)
    else:
        bits = ~bits
    return libdevice.int_as_float(int32(bits))


@device_function
def warp_max_u64(key):
    """The warp's largest uint64 key, to every lane: the largest high word, then the largest low word among the
    lanes holding it (two `redux.sync`; ten shuffles as a butterfly of 64-bit halves). All 32 lanes must call it."""
    high = uint32(key >> uint64(32))
    top = warp_max_u32(high)
    low = uint32(key & uint64(0xFFFFFFFF)) if high == top else uint32(0)
    return (uint64(top) << uint64(32)) | uint64(warp_max_u32(low))


@device_function
def block_max_u64(key, buf):
    key = warp_max_u64(key)
    t = cuda.threadIdx.x
    if (t & 31) == 0:
        buf[t >> 5] = key
    cuda.syncthreads()
    best = uint64(0)
    for w in range(WARPS):
        if buf[w] > best:
            best = buf[w]
    cuda.syncthreads()
    return best


# ---------------------------------------------------------------------------------------------------- argmax


@kernel((F32_2D, int32, U64_2D), fastmath=False)
def _argmax_partial(logits, vocab_ids, scratch):
    buf = cuda.shared.array(WARPS, uint64)
    chunk = cuda.blockIdx.x
    r = cuda.blockIdx.y
    base = chunk * CHUNK + cuda.threadIdx.x
    best = uint64(0)
    for k in range(ITEMS):
        i = base + k * THREADS
        if i < vocab_ids:
            key = order_key(logits[r, i], i)
            if key > best:
                best = key
    best = block_max_u64(best, buf)
    if cuda.threadIdx.x == 0:
        scratch[r, chunk] = best


@kernel((U64_2D, int32, int32[::1]), fastmath=False)
def _argmax_combine(scratch, chunks, out):
    lane = cuda.threadIdx.x & 31
    r = cuda.blockIdx.x * COMBINE_WARPS + (cuda.threadIdx.x >> 5)
    if r >= out.shape[0]:
        return
    best = uint64(0)
    c = lane
    while c < chunks:
        if scratch[r, c] > best:
            best = scratch[r, c]
        c += 32
    best = warp_max_u64(best)
    if lane == 0:
        out[r] = key_id(best)


def argmax_rows(logits, vocab_ids, out, *, stream, scratch=None):
    """out[r] = argmax of logits[r, :vocab_ids] (lowest id on ties). logits fp32 [R, V]; out int32 [R]. 2 launches."""
    rows = logits.shape[0]
    if not rows:
        return
    scratch = _scratch(scratch, rows, vocab_ids)
    chunks = chunks_for(vocab_ids)
    _argmax_partial[(chunks, rows), THREADS, stream](logits, np.int32(vocab_ids), scratch)
    _argmax_combine[-(-rows // COMBINE_WARPS), 32 * COMBINE_WARPS, stream](scratch, np.int32(chunks), out)


def argmax_rows_reference(logits: np.ndarray, vocab_ids: int) -> np.ndarray:
    return np.argmax(np.asarray(logits, dtype=np.float32)[:, :vocab_ids], axis=1).astype(np.int32)


# ---------------------------------------------------------------------------------------------------- top candidates


STAGED = WARPS * TOP_K_CAP  # per-warp winners staged in shared memory
STAGED_PER_LANE = STAGED // 32


@device_function
def _warp_select(best, keys, count, sink, row, base):
    """TOP_K_CAP rounds of a warp max: lane 0 writes each round's winner to sink[row, base + j]; the winning lane (keys
    are unique) replaces its best by its next key. `keys`: this lane's `count` keys (a local array)."""
    for j in range(TOP_K_CAP):
        top = warp_max_u64(best)
        if (cuda.threadIdx.x & 31) == 0:
            sink[row, base + j] = top
        if best == top and top != uint64(0):
            nxt = uint64(0)
            for k in range(count):
                if keys[k] < top and keys[k] > nxt:
                    nxt = keys[k]
            best = nxt


@device_function
def _select_top(keys, stage, sink, r, sink_base):
    """Write the TOP_K_CAP largest of the block's keys (each thread's ITEMS keys in `keys`) to sink[r, sink_base + j],
    best first: each warp selects its own TOP_K_CAP (warp shuffles only), then warp 0 selects from the staged
    WARPS * TOP_K_CAP. stage: shared uint64 [WARPS, TOP_K_CAP]."""
    best = uint64(0)
    for k in range(ITEMS):
        if keys[k] > best:
            best = keys[k]
    warp = cuda.threadIdx.x >> 5
    _warp_select(best, keys, ITEMS, stage, warp, 0)
    cuda.syncthreads()
    if warp == 0:
        lane = cuda.threadIdx.x & 31
        mine = cuda.local.array(STAGED_PER_LANE, uint64)
        best = uint64(0)
        for m in range(STAGED_PER_LANE):
            flat = lane + 32 * m
            key = stage[flat // TOP_K_CAP, flat % TOP_K_CAP]
            mine[m] = key
            if key > best:
                best = key
        _warp_select(best, mine, STAGED_PER_LANE, sink, r, sink_base)


@kernel((F32_2D, int32, int32[:, ::1], int32[::1], float32[::1], float32[::1], U64_2D), fastmath=False)
def _top_partial(logits, vocab_ids, counts, row_lane, presence, frequency, scratch):
    stage = cuda.shared.array((WARPS, TOP_K_CAP), uint64)
    keys = cuda.local.array(ITEMS, uint64)
    chunk = cuda.blockIdx.x
    r = cuda.blockIdx.y
    base = chunk * CHUNK + cuda.threadIdx.x
    pres = presence[r]
    freq = frequency[r]
    penal = pres != float32(0.0) or freq != float32(0.0)
    lane_row = row_lane[r]
    for k in range(ITEMS):
        i = base + k * THREADS
        key = uint64(0)
        if i < vocab_ids:
            x = logits[r, i]
            if penal:
                c = counts[lane_row, i]
                if c > 0:
                    x = x - pres
                else:
                    x = x - float32(0.0) * pres
                # NumPy: float32 scalar * int32 array is float64, then rounded once to float32
                x = float32(float64(x) - float64(freq) * float64(c))
            key = order_key(x, i)
        keys[k] = key
    _select_top(keys, stage, scratch, r, chunk * TOP_K_CAP)


@kernel((U64_2D, int32, int32[:, ::1], F32_2D), fastmath=False)
def _top_combine(scratch, columns, out_ids, out_values):
    stage = cuda.shared.array((WARPS, TOP_K_CAP), uint64)
    result = cuda.shared.array((1, TOP_K_CAP), uint64)
    keys = cuda.local.array(ITEMS, uint64)
    r = cuda.blockIdx.x
    for k in range(ITEMS):
        i = cuda.threadIdx.x + k * THREADS
        key = uint64(0)
        if i < columns:
            key = scratch[r, i]
        keys[k] = key
    _select_top(keys, stage, result, 0, 0)
    cuda.syncthreads()
    t = cuda.threadIdx.x
    if t < TOP_K_CAP:
        key = result[0, t]
        if key == uint64(0):
            out_ids[r, t] = -1
            out_values[r, t] = -math.inf
        else:
            out_ids[r, t] = key_id(key)
            out_values[r, t] = key_value(key)


def top_candidates_rows(logits, vocab_ids, counts, row_lane, presence, frequency, out_ids, out_values, *, stream,
                        scratch=None):
    """Per row r: x = logits[r, :vocab_ids] - presence[r] * (c > 0) - frequency[r] * c with c = counts[row_lane[r]]
    (skipped, counts unread, when both are 0), then the TOP_K_CAP best (value desc, id asc) -> out_ids int32 [R, 20],
    out_values fp32 [R, 20] (penalised values). If vocab_ids < 20 the tail is id -1, value -inf. 2 launches."""
    rows = logits.shape[0]
    if not rows:
        return
    scratch = _scratch(scratch, rows, vocab_ids)
    chunks = chunks_for(vocab_ids)
    _top_partial[(chunks, rows), THREADS, stream](logits, np.int32(vocab_ids), counts, row_lane, presence, frequency,
                                                  scratch)
    _top_combine[rows, THREADS, stream](scratch, np.int32(chunks * TOP_K_CAP), out_ids, out_values)


def penalised_row(logits_row, counts_row, presence: float, frequency: float) -> np.ndarray:
    """Sampler.candidates' penalty step, verbatim."""
    x = np.asarray(logits_row, dtype=np.float32)
    if presence != 0.0 or frequency != 0.0:
        x = x - np.float32(presence) * (counts_row > 0) - np.float32(frequency) * counts_row
        x = x.astype(np.float32)
    return x


def top_candidates_rows_reference(logits, vocab_ids, counts, row_lane, presence, frequency):
    rows = logits.shape[0]
    ids = np.full((rows, TOP_K_CAP), -1, dtype=np.int32)
    values = np.full((rows, TOP_K_CAP), -np.inf, dtype=np.float32)
    for r in range(rows):
        x = penalised_row(logits[r, :vocab_ids], counts[row_lane[r], :vocab_ids], float(presence[r]),
                          float(frequency[r]))
        top = top_candidates(x, TOP_K_CAP)
        ids[r, :len(top)] = top
        values[r, :len(top)] = x[top]
    return ids, values


# ---------------------------------------------------------------------------------------------------- the draw

# The per-row parameters of `sample_candidates`, rows of one int32 array [len(SAMPLE_FIELDS), R] (fp32 values as
# their bits: `sample_parameters` writes them).
SAMPLE_FIELDS = ("temperature", "top_p", "min_p", "top_k", "seed_low", "seed_high", "sample_position", "sample_flags")
(_TEMPERATURE, _TOP_P, _MIN_P, _TOP_K, _SEED_LOW, _SEED_HIGH, _POSITION, _FLAGS) = range(len(SAMPLE_FIELDS))
SAMPLED, COUNTED, MIN_P_CUT, TOP_P_CUT = 1, 2, 4, 8  # flag bits; the draw's purpose (sampler.Purpose) in bits 8..15
SAMPLE_THREADS = 64


@device_function
def _uniform(seed, position, purpose):
    """sampler.uniform on the device: u in [0, 1) from (seed, position, purpose), sub 0."""
    key = mix64((seed ^ (position * uint64(0xD1B54A32D192ED03))) + uint64(GOLDEN_GAMMA))
    key = mix64((key ^ (purpose << uint64(21))) + uint64(GOLDEN_GAMMA))
    return float32(uint32(key >> uint64(40))) * float32(1.0 / 16777216.0)


@kernel((int32[:, ::1], F32_2D, int32[:, ::1], int32[::1], int32[:, ::1], int32[::1], int32), fastmath=False)
def _sample_kernel(ids, values, params, row_lane, counts, out, rows):
    """A thread a row: steps 4-8 of the pipeline over the row's candidates, in `sampler.kept_weights` and
    `sampler.draw`'s order and precision (each exp in float64 rounded once to fp32, the sums in order in fp32)."""
    r = cuda.grid(1)
    if r >= rows:
        return
    flags = params[_FLAGS, r]
    if (flags & SAMPLED) == 0:  # a greedy row: its argmax is already in out
        return
    temperature = libdevice.int_as_float(params[_TEMPERATURE, r])
    k = params[_TOP_K, r]
    n = 0
    for j in range(TOP_K_CAP):
        if j < k and ids[r, j] >= 0:  # (a vocabulary under TOP_K_CAP pads the tail with id -1)
            n = j + 1
    weights = cuda.local.array(TOP_K_CAP, float32)
    best = values[r, 0]
    total = float32(0.0)
    for j in range(TOP_K_CAP):
        if j < n:
            weights[j] = float32(math.exp(float64((values[r, j] - best) / temperature)))
            total += weights[j]
    keep = n
    if (flags & MIN_P_CUT) != 0:
        min_p = libdevice.int_as_float(params[_MIN_P, r])
        for j in range(TOP_K_CAP):
            if j < n and keep == n and weights[j] < min_p:
                keep = j
    if (flags & TOP_P_CUT) != 0:
        target = libdevice.int_as_float(params[_TOP_P, r]) * total
        running = float32(0.0)
        reached = n
        for j in range(TOP_K_CAP):
            if j < n:
                running += weights[j]
                if reached == n and running >= target:
                    reached = j
        if reached < n:
            keep = min(keep, reached + 1)
    keep = max(keep, 1)
    seed = (uint64(uint32(params[_SEED_HIGH, r])) << uint64(32)) | uint64(uint32(params[_SEED_LOW, r]))
    u = _uniform(seed, uint64(uint32(params[_POSITION, r])), uint64((flags >> 8) & 0xFF))
    kept_total = float32(0.0)
    for j in range(TOP_K_CAP):
        if j < keep:
            kept_total += weights[j]
    threshold = u * kept_total
    chosen = keep - 1
    running = float32(0.0)
    for j in range(TOP_K_CAP):
        if j < keep:
            running += weights[j]
            if chosen == keep - 1 and running > threshold:
                chosen = j
    token = ids[r, chosen]
    out[r] = token
    if (flags & COUNTED) != 0:
        counts[row_lane[r], token] += 1


def sample_candidates(ids, values, params, row_lane, counts, out, *, stream) -> None:
    """Steps 4-8 of §4.8 on the device for the rows params flag SAMPLED, over their TOP_K_CAP best penalised
    candidates (`top_candidates_rows`): ids int32 [R, 20], values fp32 [R, 20]; params int32 [SAMPLE_FIELDS, R]
    (`sample_parameters`). Writes each sampled row's token to out[r] (the other rows keep their argmax) and, where
    flagged COUNTED, counts it for the row's lane (row_lane[r]: one row a lane). Capture-safe."""
    rows = ids.shape[0]
    if rows:
        _sample_kernel[blocks_for(rows, SAMPLE_THREADS), SAMPLE_THREADS, stream](
            ids, values, params, row_lane, counts, out, np.int32(rows))


def sample_parameters(*, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, position: int,
                      purpose: int, counted: bool) -> dict[str, int]:
    """One sampled row's SAMPLE_FIELDS values as int32 (fp32 as bits), for `sample_candidates`: `top_k` already
    the effective count (1..TOP_K_CAP), the min_p / top_p cuts flagged where the host sampler applies them."""
    bits = np.array([temperature, top_p, min_p], np.float32).view(np.int32)
    flags = SAMPLED | (COUNTED if counted else 0) | (MIN_P_CUT if min_p > 0.0 else 0) | (
        TOP_P_CUT if top_p < 1.0 else 0) | (int(purpose) << 8)
    return {"temperature": int(bits[0]), "top_p": int(bits[1]), "min_p": int(bits[2]), "top_k": int(top_k),
            "seed_low": int(np.uint32(seed & 0xFFFFFFFF).view(np.int32)),
            "seed_high": int(np.uint32(seed >> 32).view(np.int32)),
            "sample_position": int(np.uint32(position & 0xFFFFFFFF).view(np.int32)), "sample_flags": flags}


def sample_candidates_reference(ids, values, params, row_lane, counts, out) -> None:
    """`sample_candidates` on the host, in place (out, counts): the host sampler's own functions."""
    from ninfer.engine.sampler import draw, kept_weights, uniform

    for r in range(ids.shape[0]):
        field = {name: int(params[i, r]) for i, name in enumerate(SAMPLE_FIELDS)}
        flags = field["sample_flags"]
        if not flags & SAMPLED:
            continue
        as_float = np.array([field["temperature"], field["top_p"], field["min_p"]], np.int32).view(np.float32)
        real = ids[r, : field["top_k"]] >= 0
        row_ids, row_values = ids[r, : field["top_k"]][real], values[r, : field["top_k"]][real]
        weights = kept_weights(row_values, float(as_float[0]), float(as_float[2]) if flags & MIN_P_CUT else 0.0,
                               float(as_float[1]) if flags & TOP_P_CUT else 1.0)
        seed = (field["seed_high"] & 0xFFFFFFFF) << 32 | (field["seed_low"] & 0xFFFFFFFF)
        token = draw(row_ids[: len(weights)], weights,
                     uniform(seed, field["sample_position"] & 0xFFFFFFFF, (flags >> 8) & 0xFF))
        out[r] = token
        if flags & COUNTED:
            counts[row_lane[r], token] += 1


# ---------------------------------------------------------------------------------------------------- verify rows

MAX_ROUND_ROWS = 16  # a verify round's rows a lane (k + 1, DFlash's k at most 15)
COUNT_THREADS = 256
COUNT_ITEMS = 8  # vocabulary columns a thread


@kernel((int32[:, ::1], int32[::1], int32[::1], int32[::1], int32[::1], int32, int32[:, ::1], int32),
        fastmath=False)
def _verify_counts_kernel(counts, row_lane, token_ids, seg_row, seg_count, segments, out, vocab_ids):
    """Block (vocabulary chunk, row r): out[r, t] = counts[row_lane[r], t] + the times t occurs among the tokens of
    r's segment after its first row, up to r (a verify round's drafts before column r)."""
    r = cuda.blockIdx.y
    drafts = cuda.shared.array(MAX_ROUND_ROWS, int32)
    start = r
    for s in range(segments):
        if seg_row[s] <= r < seg_row[s] + seg_count[s]:
            start = seg_row[s]
    before = r - start  # drafts before column r
    if cuda.threadIdx.x < before:
        drafts[cuda.threadIdx.x] = token_ids[start + 1 + cuda.threadIdx.x]
    cuda.syncthreads()
    lane = row_lane[r]
    first = cuda.blockIdx.x * COUNT_THREADS * COUNT_ITEMS + cuda.threadIdx.x
    for item in range(COUNT_ITEMS):
        t = first + item * COUNT_THREADS
        if t < vocab_ids:
            c = counts[lane, t]
            for j in range(MAX_ROUND_ROWS - 1):
                if j < before and drafts[j] == t:
                    c += 1
            out[r, t] = c


def verify_counts(counts, row_lane, token_ids, seg_row, seg_count, out, *, vocab_ids: int, stream) -> None:
    """Each row's penalty counts for the sampler (out int32 [R, vocab_ids]): its lane's counts (counts[row_lane[r]])
    plus the tokens of its segment after the segment's first row, up to and with r: in an MTP / DFlash verify round
    those are the drafts before column r, which the host sampler has counted by the time it reads column r (each
    earlier draft accepted; `speculative.verify_candidates`). A one-row segment (a plain decode row) gets its lane's
    counts. Segments of at most MAX_ROUND_ROWS rows. Capture-safe."""
    rows, segments = out.shape[0], seg_row.shape[0]
    if rows:
        blocks = -(-vocab_ids // (COUNT_THREADS * COUNT_ITEMS))
        _verify_counts_kernel[(blocks, rows), COUNT_THREADS, stream](counts, row_lane, token_ids, seg_row, seg_count,
                                                                     np.int32(segments), out, np.int32(vocab_ids))


def verify_counts_reference(counts, row_lane, token_ids, seg_row, seg_count, *, rows: int,
                            vocab_ids: int) -> np.ndarray:
    out = np.zeros((rows, vocab_ids), np.int32)
    for r in range(rows):
        start = next((int(first) for first, count in zip(seg_row, seg_count) if first <= r < first + count), r)
        out[r] = counts[row_lane[r], :vocab_ids]
        for token in token_ids[start + 1:r + 1]:
            out[r, token] += 1
    return out


# ---------------------------------------------------------------------------------------------------- counts


@kernel((int32[:, ::1], int32[::1], int32[::1], int32[::1]), (int32[:, ::1], int32[::1], int32[::1], uint8[::1]),
        fastmath=False)
def _count_tokens_kernel(counts, lanes, tokens, valid):
    i = cuda.grid(1)
    if i < tokens.shape[0] and valid[i] != 0:
        cuda.atomic.add(counts, (lanes[i], tokens[i]), 1)


def count_tokens(counts, lanes, tokens, valid, *, stream):
    """counts[lanes[i], tokens[i]] += 1 where valid[i] != 0 (int atomics: order independent). valid int32 or uint8."""
    n = tokens.shape[0]
    if n:
        _count_tokens_kernel[-(-n // 128), 128, stream](counts, lanes, tokens, valid)


def count_tokens_reference(counts, lanes, tokens, valid):
    out = np.array(counts, dtype=np.int32, copy=True)
    for lane, token, ok in zip(lanes, tokens, valid):
        if ok:
            out[lane, token] += 1
    return out
