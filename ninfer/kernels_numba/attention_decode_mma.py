"""Decode attention on the bf16 tensor cores (head_dim 256, bf16 KV): the flash-decoding split kernel of
`attention.attention_decode` for a block of query rows that read the same lane's keys.

Why: the staged SIMT kernel spends ~200 instructions a warp on each 4-key step of one (row, q head) pair, so a
verify step's rows, which all read one lane's keys, multiply its time: the 27B's MTP verify of 4 rows at 8K context
took 128 us a layer against ~20 at one row (H200, results/cuda_model_27b_bf16_mtp_parts_session33.log), 1.8 ms of
a 20.8 ms round. Here a block takes the q heads of one kv head for up to `group_rows` consecutive rows of one lane
(query rows m = row x G + head, two m16 tiles), loads each K and V tile once for all of them, and computes
S = Q K^T and O += P V with mma. Queries and probabilities go in as two bf16 terms each (hi + lo: the fp32 value to
~2^-17), so the result keeps the SIMT kernel's fp32 accuracy against the twin.

Batch invariance: a row's split is [split x chunk, ...) with chunk from its own length (`split_keys`), as in the
SIMT kernels, and the tiles are aligned to absolute key positions (multiples of TILE_KEYS), so a row visits the
same tiles with the same keys visible whatever rows share its block: keys outside its split are masked to
probability 0 (exact zeros in the P V sums) and a tile with no key of its own leaves its state untouched. Each
(row, head) element comes from its own mma lanes in a fixed order, so its bits are those of the row alone.

Layout: 8 warps, warp w = 4 mt + quarter: m-tile mt (query rows 16 mt..16 mt + 15) and a quarter of the work: in
S, keys 8 quarter..8 quarter + 7 of the tile (all 256 dims); in P V, head dims 64 quarter..64 quarter + 63. S goes
through shared memory between the two. Shared memory (dynamic, 32-bit words): Q as bf16 hi and lo rows, two
tiles of K rows then V rows (`cp.async`, double buffered), S [M_ROWS, S_WORDS] fp32; bf16 rows are D/2 + 4 words
so the 8 rows an `ldmatrix` phase reads fall in distinct banks.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, int64, uint32, uint64
from numba.cuda import libdevice

from ninfer.kernels_numba.async_copy import (copy_async_8, copy_async_16, copy_async_commit, copy_async_wait_all,
                                             shared_address)
from ninfer.kernels_numba.attention import _pool_row, split_keys
from ninfer.kernels_numba.common import (LOG2E, address_of, exp2_approx, half_pair_to_f32, load_matrix_x4,
                                         load_matrix_x4_trans, load_words4_at, pack_bf16x2, quad_softmax_step, quad_sum)
from ninfer.kernels_numba.numba_setup import allow_dynamic_shared, cuda, device_function, kernel
from ninfer.kernels_numba.quant_mma import BF16_128_PAIR, BF16_ONE_PAIR, and_or, fma_bf16x2, mma_bf16_m16n8k16

HEAD_DIM = 256
TILE_KEYS = 32  # keys a tile: 4 quarters of an 8-key n-tile in S, 2 k-steps in P V
STAGES = 2  # double buffered: tile t + 1 loads while tile t is computed (two blocks an SM fit; three stages: one)
WARPS = 8
THREADS = 32 * WARPS
M_ROWS = 32  # query rows (row x q head) a block: two m16 tiles
MAX_GROUP_ROWS = 8  # rows of one lane a block takes at most (fewer when G x rows passes M_ROWS)
ROW_WORDS = HEAD_DIM // 2 + 4  # a bf16 row in shared memory, padded
S_WORDS = TILE_KEYS + 4
Q_HI = 0
Q_LO = M_ROWS * ROW_WORDS
STAGE0 = 2 * M_ROWS * ROW_WORDS
STAGE_WORDS = 2 * TILE_KEYS * ROW_WORDS  # K rows, then V rows
S_OFF = STAGE0 + STAGES * STAGE_WORDS
SHARED_BYTES = 4 * (S_OFF + M_ROWS * S_WORDS)  # 103.5 KiB: two blocks an SM
ROW_PIECES = HEAD_DIM // 8  # 16-byte pieces of a K or V row
COPY_STEP = THREADS // ROW_PIECES  # keys between the pieces one thread copies
COPY_KEYS = TILE_KEYS // COPY_STEP  # keys a thread copies a piece of, a tile
# INT8-G64 pools (int8 codes, an fp16 scale per 64 dims: 4 a head): the tile's codes and scales land by cp.async in
# one of two raw stages, then each thread turns the codes it copied into exact bf16 (|code| <= 128) in the one bf16
# stage the mma read; the scales stay in the raw stage.
GROUPS = 4  # scale groups of a head (64 dims: a warp's quarter of the P V dims is one group)
RAW_ROW_WORDS = HEAD_DIM // 4  # a row of int8 codes
RAW_SCALES = 2 * TILE_KEYS * RAW_ROW_WORDS  # word offset of the K scales in a raw stage (2 words a key), then V's
RAW_WORDS = RAW_SCALES + 2 * 2 * TILE_KEYS
RAW0 = STAGE0 + STAGE_WORDS  # the two raw stages: where the bf16 kernel's second stage is, which they fill exactly
assert 2 * RAW_WORDS == STAGE_WORDS  # (so S, at S_OFF, and SHARED_BYTES are the bf16 kernel's)
ROW_PIECES8 = HEAD_DIM // 16
COPY_STEP8 = THREADS // ROW_PIECES8
COPY_KEYS8 = TILE_KEYS // COPY_STEP8
MINUS_256_PAIR = 0xC380C380  # the bf16 pair (-256, -256)
Q_ROW_PIECES = HEAD_DIM // 4  # 16-byte pieces of an fp32 query row
Q_ROW_SHIFT = 6  # log2(Q_ROW_PIECES)
Q_ROW_STEP = THREADS // Q_ROW_PIECES  # query rows between a thread's pieces
Q_PIECES = M_ROWS // Q_ROW_STEP  # pieces a thread stages
Q_WORDS = 4 * Q_PIECES
NEG_INF = float32(-math.inf)


@device_function
def group_rows(group_heads):
    """Rows of one lane a block takes: as many as fit M_ROWS query rows, at most MAX_GROUP_ROWS."""
    return max(1, min(MAX_GROUP_ROWS, M_ROWS // group_heads))


@device_function
def _bf16_split(x0, x1):
    """(hi, lo) bf16 pair words of (x0, x1): hi rounds them, lo rounds what hi left (x = hi + lo to ~2^-17)."""
    hi = pack_bf16x2(x0, x1)
    r0 = libdevice.int_as_float(int32(hi << uint32(16)))
    r1 = libdevice.int_as_float(int32(hi & uint32(0xFFFF0000)))
    return hi, pack_bf16x2(x0 - r0, x1 - r1)


@device_function
def _copy_tile(shared, stage, k_at, v_at, page_tables, lane_id, key0, lo, hi, page_tokens, token_bytes):
    """Issue the copies of keys key0 .. key0 + TILE_KEYS - 1 (K rows, then V rows) into the stage at word `stage`;
    keys outside [lo, hi) read nothing and land as zeros. A thread copies one 16-byte piece of COPY_KEYS keys. Pages
    of whole tiles (the serving pool's 64 tokens) hold a tile in one page: one page-table read a tile, the keys'
    rows consecutive from there (a read and a division a key were most of the kernel's integer work); other pages
    a read a key, all issued before the first copy."""
    piece = cuda.threadIdx.x & (ROW_PIECES - 1)
    first = cuda.threadIdx.x // ROW_PIECES
    rows = cuda.local.array(COPY_KEYS, int64)
    if page_tokens % TILE_KEYS == 0:
        start = min(max(key0, lo), hi - 1)  # keys are clamped into [lo, hi - 1]: inside this tile, so its page
        row0 = _pool_row(page_tables, lane_id, start, hi, page_tokens)
        for j in range(COPY_KEYS):
            rows[j] = row0 + (min(max(key0 + first + COPY_STEP * j, lo), hi - 1) - start)
    else:
        for j in range(COPY_KEYS):
            rows[j] = _pool_row(page_tables, lane_id, max(key0 + first + COPY_STEP * j, lo), hi, page_tokens)
    for j in range(COPY_KEYS):
        i = first + COPY_STEP * j
        key = key0 + i
        at = rows[j] * token_bytes + piece * 16
        size = uint32(16) if lo <= key and key < hi else uint32(0)
        dst = shared + uint32((stage + i * ROW_WORDS + piece * 4) * 4)
        copy_async_16(dst, k_at + at, size)
        copy_async_16(dst + uint32(TILE_KEYS * ROW_WORDS * 4), v_at + at, size)


@device_function
def _copy_raw_tile(shared, raw, k_at, v_at, ks_at, vs_at, page_tables, lane_id, key0, lo, hi, page_tokens,
                   token_bytes, scale_token_bytes):
    """`_copy_tile` for INT8 pools, into the raw stage at word `raw`: a thread copies one 16-byte piece of the codes
    of COPY_KEYS8 keys, K and V; threads 0..31 copy key tid's 4 K scales, 32..63 its V scales (8 bytes). Keys
    outside [lo, hi) read nothing and land as zeros. Pages of whole tiles: one page-table read a tile, as there."""
    tid = cuda.threadIdx.x
    piece = tid & (ROW_PIECES8 - 1)
    first = tid // ROW_PIECES8
    whole = page_tokens % TILE_KEYS == 0
    start = min(max(key0, lo), hi - 1)  # keys are clamped into [lo, hi - 1]: inside this tile, so its page
    row0 = _pool_row(page_tables, lane_id, start, hi, page_tokens) if whole else int64(0)
    for j in range(COPY_KEYS8):
        i = first + COPY_STEP8 * j
        key = key0 + i
        row = (row0 + (min(max(key, lo), hi - 1) - start) if whole
               else _pool_row(page_tables, lane_id, max(key, lo), hi, page_tokens))
        size = uint32(16) if lo <= key and key < hi else uint32(0)
        dst = shared + uint32((raw + i * RAW_ROW_WORDS + piece * 4) * 4)
        copy_async_16(dst, k_at + row * token_bytes + piece * 16, size)
        copy_async_16(dst + uint32(TILE_KEYS * RAW_ROW_WORDS * 4), v_at + row * token_bytes + piece * 16, size)
    if tid < 2 * TILE_KEYS:
        i = tid & (TILE_KEYS - 1)
        key = key0 + i
        row = (row0 + (min(max(key, lo), hi - 1) - start) if whole
               else _pool_row(page_tables, lane_id, max(key, lo), hi, page_tokens))
        size = uint32(8) if lo <= key and key < hi else uint32(0)
        source = (ks_at if tid < TILE_KEYS else vs_at) + row * scale_token_bytes
        copy_async_8(shared + uint32((raw + RAW_SCALES + 2 * tid) * 4), source, size)


@device_function
def _code_pairs(word):
    """The two bf16 pairs of a word's four int8 codes (low byte first), exactly: with u = code + 128 = 128 h + m,
    bf16(128 + m) is 0x4300 | m, and code = (128 + m) - 256 + 128 h, each step exact in bf16 (|code| <= 128)."""
    x = word ^ uint32(0x80808080)  # the bytes as u
    low = (x & uint32(0xFF)) | ((x & uint32(0xFF00)) << uint32(8))  # u0, u1 in the two halves
    high = ((x >> uint32(16)) & uint32(0xFF)) | ((x >> uint32(8)) & uint32(0xFF0000))
    return _u_pair(low), _u_pair(high)


@device_function
def _u_pair(pair):
    """The bf16 pair of the codes of a pair of u = code + 128 (one a half)."""
    base = and_or(pair, uint32(0x007F007F), uint32(BF16_128_PAIR))  # 128 + m
    above = (pair & uint32(0x00800080)) * uint32(0x86)  # bf16 128.0 (0x4300) where h = 1, else 0
    return fma_bf16x2(above, uint32(BF16_ONE_PAIR), fma_bf16x2(base, uint32(BF16_ONE_PAIR), uint32(MINUS_256_PAIR)))


@device_function
def _convert_raw_tile(sh, raw):
    """The codes this thread copied into the raw stage at word `raw` (its pieces of K and V), as bf16 rows of the
    bf16 stage (STAGE0): a 16-code piece becomes 8 words."""
    tid = cuda.threadIdx.x
    piece = tid & (ROW_PIECES8 - 1)
    first = tid // ROW_PIECES8
    for j in range(COPY_KEYS8):
        i = first + COPY_STEP8 * j
        for kv in range(2):
            src = raw + (kv * TILE_KEYS + i) * RAW_ROW_WORDS + piece * 4
            dst = STAGE0 + (kv * TILE_KEYS + i) * ROW_WORDS + piece * 8
            for w in range(4):
                sh[dst + 2 * w], sh[dst + 2 * w + 1] = _code_pairs(sh[src + w])


@device_function
def _scale(sh, raw, kv, key, group):
    """The fp32 scale of group `group` of `key` (K: kv 0, V: 1) in the raw stage at word `raw`."""
    low, high = half_pair_to_f32(sh[raw + RAW_SCALES + 2 * (kv * TILE_KEYS + key) + (group >> 1)])
    return high if group & 1 else low


@device_function
def _row_range(row_pos, row, split, splits, min_keys):
    """Keys [start, stop) of `row`'s split (empty when start >= stop), as the SIMT kernels cut them."""
    length = row_pos[row] + 1
    chunk = split_keys(length, splits, min_keys)
    start = split * chunk
    return start, min(start + chunk, length)


_SIGNATURE = (float32[:, :, ::1], int32[:, ::1], int32[::1], int32[::1], uint64[:, :, :, ::1],
              uint64[:, :, :, ::1], uint64[:, :, :, ::1], uint64[:, :, :, ::1], float32[:, :, :, ::1], int32, int32,
              int32)


def _make_decode_mma_kernel(quant: bool):
    """The kernel for bf16 pools, or (`quant`) INT8-G64 pools: their codes turned into exact bf16 in shared memory,
    each 64-dim group's partial scores times its keys' K scales, a key's V scale (the warp's quarter of the dims is
    one group) folded into its probability before P V."""
    QUANT = quant
    CODE_BYTES = 1 if quant else 2  # bytes a K or V element in the pool
    KK_STEPS = HEAD_DIM // 32 // (GROUPS if quant else 1)  # 32-dim steps of S summed before a scale

    @kernel(_SIGNATURE, fastmath=True, max_registers=128)  # two blocks of 256 threads an SM
    def decode_mma_kernel(q, page_tables, row_lane, row_pos, k_words, v_words, k_scales, v_scales, partials, heads,
                          kv_heads, min_keys):
        """grid (splits, Hkv, R), block THREADS: the block of row r serves rows r .. r + n - 1 when r leads its
        group (runs of rows on one lane cut every `group_rows`), else exits; writes each served row's (max, sum,
        accumulators) partial of its split, as `attention._store_step_partials` does. k_scales / v_scales: an INT8
        pool's scales as one word a (token, kv head); for bf16 pools unused stand-ins."""
        sh = cuda.shared.array(0, uint32)
        split = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        r = cuda.blockIdx.z
        rows = q.shape[0]
        splits = partials.shape[2]
        group_heads = heads // kv_heads
        cap = group_rows(group_heads)
        lane_id = row_lane[r]
        first = r
        while first > 0 and row_lane[first - 1] == lane_id:
            first -= 1
        if (r - first) % cap != 0:
            return
        n = 1
        while n < cap and r + n < rows and row_lane[r + n] == lane_id:
            n += 1
        lo = int32(2147483647)
        hi = int32(0)
        for i in range(n):
            start, stop = _row_range(row_pos, r + i, split, splits, min_keys)
            if start < stop:
                lo = min(lo, start)
                hi = max(hi, stop)
        if lo >= hi:
            return

        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        gq = lane >> 2
        t = lane & 3
        mt = warp >> 2
        quarter = warp & 3
        served = n * group_heads  # query rows in use
        active = mt * 16 < served  # warp-uniform: this m-tile holds a served row
        # this thread's two query rows (mma rows gq and gq + 8 of its m-tile): their keys, empty for padding
        m_lo = mt * 16 + gq
        m_hi = m_lo + 8
        st_lo = sp_lo = st_hi = sp_hi = int32(0)
        if m_lo < served:
            st_lo, sp_lo = _row_range(row_pos, r + m_lo // group_heads, split, splits, min_keys)
        if m_hi < served:
            st_hi, sp_hi = _row_range(row_pos, r + m_hi // group_heads, split, splits, min_keys)

        shared = shared_address(address_of(sh))
        page_tokens = int32(k_words.shape[1])
        token_bytes = int64(k_words.shape[2] * HEAD_DIM * CODE_BYTES)
        k_at = address_of(k_words) + int64(kvh * HEAD_DIM * CODE_BYTES)
        v_at = address_of(v_words) + int64(kvh * HEAD_DIM * CODE_BYTES)
        scale_token_bytes = int64(k_scales.shape[2] * 8)  # (INT8: a word of 4 fp16 scales a kv head)
        ks_at = address_of(k_scales) + int64(kvh * 8)
        vs_at = address_of(v_scales) + int64(kvh * 8)
        t_first = lo // TILE_KEYS
        tiles = (hi + TILE_KEYS - 1) // TILE_KEYS - t_first
        # tile 0 now; tile t + 1 in iteration t, once every warp has left tile t - 1, whose stage it takes
        if QUANT:
            _copy_raw_tile(shared, RAW0, k_at, v_at, ks_at, vs_at, page_tables, lane_id, t_first * TILE_KEYS, lo, hi,
                           page_tokens, token_bytes, scale_token_bytes)
        else:
            _copy_tile(shared, STAGE0, k_at, v_at, page_tables, lane_id, t_first * TILE_KEYS, lo, hi, page_tokens,
                       token_bytes)
        copy_async_commit()

        # Q of the served rows, scaled by 1/sqrt(D) (a power of two: exact), as bf16 hi and lo rows; padding rows
        # zero. A thread takes Q_PIECES 16-byte pieces (query rows m0, m0 + 4, ...; the same 4 dims), every load
        # issued before any is converted: the prologue's dependent loads and divisions were ~45% of the kernel's
        # stalls (ncu, 4 rows of one lane at 8K, results/ncu_decode_mma_verify_session34_summary.txt).
        piece = tid & (Q_ROW_PIECES - 1)
        m0 = tid >> Q_ROW_SHIFT
        words = cuda.local.array(Q_WORDS, uint32)
        head_of = m0 % group_heads  # (row, head) of query row m, stepped by Q_ROW_STEP rows without a division
        row_of = m0 // group_heads
        q_at = address_of(q) + int64(piece * 16)
        last = served - 1  # padding rows read the last served row and store zeros
        last_at = q_at + (int64(r + last // group_heads) * heads + kvh * group_heads + last % group_heads) * (
            HEAD_DIM * 4)
        for j in range(Q_PIECES):
            at = q_at + (int64(r + row_of) * heads + kvh * group_heads + head_of) * (HEAD_DIM * 4)
            if m0 + Q_ROW_STEP * j > last:
                at = last_at
            words[4 * j], words[4 * j + 1], words[4 * j + 2], words[4 * j + 3] = load_words4_at(at)
            head_of += Q_ROW_STEP
            while head_of >= group_heads:
                head_of -= group_heads
                row_of += 1
        scale = float32(1.0) / float32(16.0)
        for j in range(Q_PIECES):
            m = m0 + Q_ROW_STEP * j
            x = cuda.local.array(4, float32)
            for i in range(4):
                x[i] = libdevice.int_as_float(int32(words[4 * j + i])) * scale
            hi0, lo0 = _bf16_split(x[0], x[1])
            hi1, lo1 = _bf16_split(x[2], x[3])
            if m >= served:
                hi0 = lo0 = hi1 = lo1 = uint32(0)
            sh[Q_HI + m * ROW_WORDS + 2 * piece] = hi0
            sh[Q_HI + m * ROW_WORDS + 2 * piece + 1] = hi1
            sh[Q_LO + m * ROW_WORDS + 2 * piece] = lo0
            sh[Q_LO + m * ROW_WORDS + 2 * piece + 1] = lo1

        o = cuda.local.array(32, float32)  # O rows gq, gq + 8 over the quarter's 8 dim n-tiles (mma C layout)
        s = cuda.local.array(16, float32)  # the tile's scores, then P: 4 key n-tiles
        for e in range(32):
            o[e] = float32(0.0)
        mx_lo = NEG_INF
        mx_hi = NEG_INF
        l_lo = float32(0.0)
        l_hi = float32(0.0)
        # ldmatrix row addresses (bytes). Q (A fragments): rows gq / gq + 8 by lanes' halves, columns by lane >> 4.
        # K (B fragments of the quarter's n-tile, two k-steps an instruction): key rows lane & 7, dims 8 (lane >> 3).
        # V (B fragments by .trans, two dim n-tiles an instruction): key rows (lane & 7) + 8 ((lane >> 3) & 1), dims
        # 8 (lane >> 4) of the pair.
        q_row = (mt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * ROW_WORDS + ((lane >> 4) << 2)
        q_hi_lds = shared + uint32(4 * (Q_HI + q_row))
        q_lo_lds = shared + uint32(4 * (Q_LO + q_row))
        k_row = (quarter * 8 + (lane & 7)) * ROW_WORDS + ((lane >> 3) << 2)
        v_row = (TILE_KEYS + (lane & 7) + (((lane >> 3) & 1) << 3)) * ROW_WORDS + quarter * 32 + ((lane >> 4) << 2)
        s_lo = S_OFF + m_lo * S_WORDS
        s_hi = S_OFF + m_hi * S_WORDS

        for it in range(tiles):
            copy_async_wait_all()
            cuda.syncthreads()  # tile `it` (and Q) landed for every thread; every warp left tile it - 1 and its S
            raw = RAW0 + (it % 2) * RAW_WORDS
            if QUANT:  # the codes this thread copied, as bf16 rows; then tile it + 1 into the other raw stage
                _convert_raw_tile(sh, raw)
                if it + 1 < tiles:
                    _copy_raw_tile(shared, RAW0 + ((it + 1) % 2) * RAW_WORDS, k_at, v_at, ks_at, vs_at, page_tables,
                                   lane_id, (t_first + it + 1) * TILE_KEYS, lo, hi, page_tokens, token_bytes,
                                   scale_token_bytes)
                    copy_async_commit()
                cuda.syncthreads()  # every thread's rows converted
                stage = STAGE0
            else:
                if it + 1 < tiles:
                    _copy_tile(shared, STAGE0 + ((it + 1) % STAGES) * STAGE_WORDS, k_at, v_at, page_tables, lane_id,
                               (t_first + it + 1) * TILE_KEYS, lo, hi, page_tokens, token_bytes)
                    copy_async_commit()
                stage = STAGE0 + (it % STAGES) * STAGE_WORDS
            key0 = (t_first + it) * TILE_KEYS
            if active:  # S of the m-tile's rows x the quarter's 8 keys, over all dims, Q as hi + lo
                # four accumulator chains (hi / lo x even / odd k-steps) summed in a fixed order: one chain of 32
                # dependent mma was ~0.5 us a tile of latency. INT8: the chains of each 64-dim group (2 kk steps)
                # times its keys' K scales (the C columns 2 t, 2 t + 1 are keys quarter * 8 + 2 t, + 1).
                c0 = c1 = c2 = c3 = float32(0.0)
                k_lds = shared + uint32(4 * (stage + k_row))
                for grp in range(GROUPS if QUANT else 1):
                    e0 = e1 = e2 = e3 = f0 = f1 = f2 = f3 = float32(0.0)
                    g0 = g1 = g2 = g3 = h0 = h1 = h2 = h3 = float32(0.0)
                    for kk in range(grp * KK_STEPS, (grp + 1) * KK_STEPS):
                        b0, b1, b2, b3 = load_matrix_x4(k_lds + uint32(64 * kk))
                        a0, a1, a2, a3 = load_matrix_x4(q_hi_lds + uint32(64 * kk))
                        e0, e1, e2, e3 = mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, e0, e1, e2, e3)
                        a0, a1, a2, a3 = load_matrix_x4(q_lo_lds + uint32(64 * kk))
                        f0, f1, f2, f3 = mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, f0, f1, f2, f3)
                        a0, a1, a2, a3 = load_matrix_x4(q_hi_lds + uint32(64 * kk + 32))
                        g0, g1, g2, g3 = mma_bf16_m16n8k16(a0, a1, a2, a3, b2, b3, g0, g1, g2, g3)
                        a0, a1, a2, a3 = load_matrix_x4(q_lo_lds + uint32(64 * kk + 32))
                        h0, h1, h2, h3 = mma_bf16_m16n8k16(a0, a1, a2, a3, b2, b3, h0, h1, h2, h3)
                    if QUANT:
                        sa = _scale(sh, raw, 0, quarter * 8 + 2 * t, grp)
                        sb = _scale(sh, raw, 0, quarter * 8 + 2 * t + 1, grp)
                        c0 += sa * ((e0 + g0) + (f0 + h0))
                        c1 += sb * ((e1 + g1) + (f1 + h1))
                        c2 += sa * ((e2 + g2) + (f2 + h2))
                        c3 += sb * ((e3 + g3) + (f3 + h3))
                    else:
                        c0 = (e0 + g0) + (f0 + h0)
                        c1 = (e1 + g1) + (f1 + h1)
                        c2 = (e2 + g2) + (f2 + h2)
                        c3 = (e3 + g3) + (f3 + h3)
                col = quarter * 8 + 2 * t
                sh[s_lo + col] = uint32(libdevice.float_as_int(c0))
                sh[s_lo + col + 1] = uint32(libdevice.float_as_int(c1))
                sh[s_hi + col] = uint32(libdevice.float_as_int(c2))
                sh[s_hi + col + 1] = uint32(libdevice.float_as_int(c3))
            cuda.syncthreads()  # the tile's S complete
            if active:
                # the rows' scores over the whole tile in the C layout of 4 key n-tiles, masked to their own keys
                for nt in range(4):
                    for e in range(4):
                        col = nt * 8 + 2 * t + (e & 1)
                        key = key0 + col
                        if e < 2:
                            value = libdevice.int_as_float(int32(sh[s_lo + col]))
                            s[4 * nt + e] = value if st_lo <= key and key < sp_lo else NEG_INF
                        else:
                            value = libdevice.int_as_float(int32(sh[s_hi + col]))
                            s[4 * nt + e] = value if st_hi <= key and key < sp_hi else NEG_INF
                top_lo = max(max(max(s[0], s[1]), max(s[4], s[5])), max(max(s[8], s[9]), max(s[12], s[13])))
                top_hi = max(max(max(s[2], s[3]), max(s[6], s[7])), max(max(s[10], s[11]), max(s[14], s[15])))
                new_lo, new_hi, keep_lo, keep_hi, base_lo, base_hi = quad_softmax_step(top_lo, top_hi, mx_lo, mx_hi)
                sum_lo = float32(0.0)
                sum_hi = float32(0.0)
                for nt in range(4):
                    for e in range(4):
                        if e < 2:
                            s[4 * nt + e] = exp2_approx(s[4 * nt + e] * LOG2E - base_lo)
                            sum_lo += s[4 * nt + e]
                        else:
                            s[4 * nt + e] = exp2_approx(s[4 * nt + e] * LOG2E - base_hi)
                            sum_hi += s[4 * nt + e]
                l_lo = l_lo * keep_lo + quad_sum(sum_lo)
                l_hi = l_hi * keep_hi + quad_sum(sum_hi)
                if QUANT:  # each key's V scale of the warp's dims (group `quarter`), into its probability
                    for nt in range(4):
                        for e in range(2):
                            v_scale = _scale(sh, raw, 1, nt * 8 + 2 * t + e, quarter)
                            s[4 * nt + e] *= v_scale
                            s[4 * nt + e + 2] *= v_scale
                mx_lo = new_lo
                mx_hi = new_hi
                if keep_lo != float32(1.0) or keep_hi != float32(1.0):
                    for nt in range(8):
                        o[4 * nt] *= keep_lo
                        o[4 * nt + 1] *= keep_lo
                        o[4 * nt + 2] *= keep_hi
                        o[4 * nt + 3] *= keep_hi
                # O += P V over the quarter's dims: P (two key n-tiles a k-step) as hi + lo, V by ldmatrix .trans
                v_lds = shared + uint32(4 * (stage + v_row))
                for kk in range(2):
                    p_hi0, p_lo0 = _bf16_split(s[8 * kk], s[8 * kk + 1])
                    p_hi1, p_lo1 = _bf16_split(s[8 * kk + 2], s[8 * kk + 3])
                    p_hi2, p_lo2 = _bf16_split(s[8 * kk + 4], s[8 * kk + 5])
                    p_hi3, p_lo3 = _bf16_split(s[8 * kk + 6], s[8 * kk + 7])
                    for pn in range(4):
                        b0, b1, c0_, c1_ = load_matrix_x4_trans(v_lds + uint32(4 * (16 * kk * ROW_WORDS + 8 * pn)))
                        o[8 * pn], o[8 * pn + 1], o[8 * pn + 2], o[8 * pn + 3] = mma_bf16_m16n8k16(
                            p_hi0, p_hi1, p_hi2, p_hi3, b0, b1, o[8 * pn], o[8 * pn + 1], o[8 * pn + 2], o[8 * pn + 3])
                        o[8 * pn], o[8 * pn + 1], o[8 * pn + 2], o[8 * pn + 3] = mma_bf16_m16n8k16(
                            p_lo0, p_lo1, p_lo2, p_lo3, b0, b1, o[8 * pn], o[8 * pn + 1], o[8 * pn + 2], o[8 * pn + 3])
                        o[8 * pn + 4], o[8 * pn + 5], o[8 * pn + 6], o[8 * pn + 7] = mma_bf16_m16n8k16(
                            p_hi0, p_hi1, p_hi2, p_hi3, c0_, c1_, o[8 * pn + 4], o[8 * pn + 5], o[8 * pn + 6],
                            o[8 * pn + 7])
                        o[8 * pn + 4], o[8 * pn + 5], o[8 * pn + 6], o[8 * pn + 7] = mma_bf16_m16n8k16(
                            p_lo0, p_lo1, p_lo2, p_lo3, c0_, c1_, o[8 * pn + 4], o[8 * pn + 5], o[8 * pn + 6],
                            o[8 * pn + 7])

        # the served rows' partials of this split (a row whose split is empty writes none: the combine never reads it)
        if active:
            dim0 = quarter * 64 + 2 * t
            if st_lo < sp_lo:
                row = r + m_lo // group_heads
                h = kvh * group_heads + m_lo % group_heads
                for nt in range(8):
                    partials[row, h, split, 2 + dim0 + nt * 8] = o[4 * nt]
                    partials[row, h, split, 3 + dim0 + nt * 8] = o[4 * nt + 1]
                if quarter == 0 and t == 0:
                    partials[row, h, split, 0] = mx_lo
                    partials[row, h, split, 1] = l_lo
            if st_hi < sp_hi:
                row = r + m_hi // group_heads
                h = kvh * group_heads + m_hi % group_heads
                for nt in range(8):
                    partials[row, h, split, 2 + dim0 + nt * 8] = o[4 * nt + 2]
                    partials[row, h, split, 3 + dim0 + nt * 8] = o[4 * nt + 3]
                if quarter == 0 and t == 0:
                    partials[row, h, split, 0] = mx_hi
                    partials[row, h, split, 1] = l_hi

    return decode_mma_kernel


DECODE_MMA_KERNELS = {quant: _make_decode_mma_kernel(quant) for quant in (False, True)}


def decode_mma(q, page_tables, row_lane, row_pos, k_pool, v_pool, partials, *, heads, kv_heads, min_split_keys,
               stream, k_scale=None, v_scale=None) -> None:
    """Launch the kernel over (splits, Hkv, rows): pools uint16 [pages, page_tokens, Hkv, 256] (bf16 bits), or
    int8 codes with k_scale / v_scale uint16 [pages, page_tokens, Hkv, 4] (fp16 bits: INT8-G64)."""
    quant = k_pool.dtype == np.int8
    if quant and (k_scale is None or v_scale is None or k_scale.shape[-1] != GROUPS):
        raise ValueError(f"an INT8 pool of head dim {HEAD_DIM} needs k_scale and v_scale of {GROUPS} groups")
    function = DECODE_MMA_KERNELS[quant]
    allow_dynamic_shared(function, _SIGNATURE, SHARED_BYTES)
    k_words, v_words = k_pool.view(np.uint64), v_pool.view(np.uint64)
    # (bf16 pools: the pools stand in for the scales no code reads)
    scales = (k_scale.view(np.uint64), v_scale.view(np.uint64)) if quant else (k_words, v_words)
    function[(partials.shape[2], kv_heads, q.shape[0]), THREADS, stream, SHARED_BYTES](
        q, page_tables, row_lane, row_pos, k_words, v_words, *scales, partials, np.int32(heads), np.int32(kv_heads),
        np.int32(min_split_keys))
