"""The sizes, limits and options of one CUDA model build (`Capacity`), and the row and chunk rules the model
and its runner share."""

from __future__ import annotations

import attrs

from ninfer.backends.cpu.runner import SPEC_BACKENDS
from ninfer.kernels_numba.attention import check_min_split_keys, check_splits
from ninfer.kernels_numba.elementwise import ADD_SLICES
from ninfer.kernels_numba.gdn import REC_DEFAULT_GROUPS, REC_GROUP_CHOICES

SKINNY_ROWS = 64  # up to this many rows, linear layers run the batch-invariant skinny kernels
DEFAULT_SPLIT_K_NORM = 2  # Capacity.split_k_norm's default (see there)
MMA_ROWS = 8  # activation rows per x-fragment set (the mma's N); a plain launch takes k.ROW_SETS sets
PAGE_TOKENS = 64
# A prefill chunk of at most SKINNY_ROWS rows whose rows x keys stay within this bound runs the decode path (decode
# attention, each row over the lane's pages; the gathered MoE route) and is captured as a graph keyed by its row
# count. Eager, such a chunk costs its ~500-2,500 numba launches of Python (0.13-0.19 s for 32 rows at the 27B and
# 35B shapes on the H200), far more than its GPU work. The bound limits the decode kernel's per-row re-reads of the
# lane's keys (64 rows at 8K context, 16 at 32K); where it should sit is still to be measured on the GPU.
SHORT_PREFILL_ROW_KEYS = 64 * 8192
SCORE_BYTES = 1 << 30  # fp32 attention-score scratch of the tensor-core prefill path
# The MoE prefill's expert GEMMs (bf16, 8K chunk of the 35B-A3B's gate_up, results/grouped_gemm_probe_session13.json,
# time with the host's work): every expert padded to the largest count, one strided-batched GEMM, 0.52 ms at 20%
# padding (time grows with the padded rows); each expert padded to whole MOE_CHUNK_ROWS chunks, one pointer-array
# batched GEMM, 0.67-0.71 ms whatever the skew; the grouped GEMM on the contiguous groups 1.10-1.26 ms. So the
# padded layout while the padded rows stay within 8/5 of the routed ones (0.71 / 0.52 * 1.2: moe.PADDED_LIMIT, the
# rule `moe_layout` applies on the device), the chunked one past it. In the model
# (results/cuda_model_35b_bf16_moe_gemm_session13.json) chunked everywhere took the 8K prefill from 249.8 ms ("auto"
# then: padded within 2x, else grouped) to 230.5.
MOE_CHUNK_ROWS = 128  # rows a batch entry of the chunked layout
MOE_CHUNK_STEP = 1  # the chunked layout's batch count rounded up to a multiple of this (see CudaQwen.moe_chunk_step)
# Prefill chunks of up to MOE_SYNC_FREE_ROWS rows size their expert GEMMs without reading the group sizes back: the
# chunked layout at its most chunks for the rows, MOE_SYNC_FREE_CHUNK_ROWS rows a chunk (the surplus chunks, rows
# nothing reads, take the last expert's weights, which stay in L2). Then nothing waits on the host mid-chunk, so
# such a chunk replays as graphs (`CudaQwen.capture_prefill`). At the server's 1024-row chunks the 35B-A3B's 8K
# prefill is host-bound (H200, bf16, eager, counts read back in chunks of 128: 232 ms of GPU work in 300 ms of wall;
# results/cuda_model_35b_prefill_chunk1024_*_session38.*). Eager, the sync-free layout took 277 ms in chunks of 32
# rows (64: 295, 16: 309, 128: 309) against 303 read back in chunks of 128; replayed as graphs, 269 ms. Measured
# at 1024 rows only: longer chunks keep the read (2048: 192 ms eager, less host-bound).
MOE_SYNC_FREE_ROWS = 1024
MOE_SYNC_FREE_CHUNK_ROWS = 32


@attrs.frozen
class PrefillSpan:
    """A prefill chunk: rows 0..count-1 are tokens kv_start.. of `lane`. `rows`: the chunk's real rows when it runs
    padded to more (`CudaQwen.stage_prefill`), None when it runs as it is."""

    lane: int
    kv_start: int
    rows: int | None = None


# the span `capture_prefill` records with: only the attention calls read a span, and they run at each replay with
# the replay's
CAPTURED_SPAN = PrefillSpan(-1, -1)


@attrs.frozen
class Capacity:
    """Everything that sizes the runtime layout except the KV pool's page count (sized last, from what is left)."""

    lanes: int
    max_context: int
    kv_dtype: str  # "bf16" | "int8"
    prefill_rows: int  # most rows of a prefill chunk
    draft_tokens: int  # k of speculative decoding, 0 when off
    draft_head: bool = False  # --lm-head-draft: proposals from the artifact's shortlist head, when it has one
    spec: str = "mtp"  # the drafter that draft_tokens > 0 runs: "mtp" (the MTP head) or "dflash" (the DFlash drafter)
    # Prefill attention on the tensor cores (cuBLAS; 2.5x faster than the numba kernel at 8K on the H200): its
    # scratch is allocated only with this set.
    tensor_core_attention: bool = True
    # bf16 linear layers of up to SKINNY_ROWS rows: "cublas" (activations rounded to bf16; every call padded to the
    # decode rows, since cuBLAS picks its algorithm from the row count), "mma" (`linear_mma`: the tensor cores,
    # activations rounded to bf16, only the rows there are: batch invariant by construction), "kernels" (the
    # batch-invariant SIMT skinny kernels, fp32 activations; 1.4x slower at 27B batch 1 on the H200) or "auto" (per
    # matrix shape the fastest of those and the narrow kernel, timed on the GPU when the model is built:
    # `linear_tuning`). Quantized matrices always use their kernels.
    decode_linear: str = "cublas"
    # Quantized (ninfer-v2) linear layers of up to SKINNY_ROWS rows: "mma" (`quant_mma`: the tensor cores,
    # activations rounded to bf16, in launches of 8 rows; the stacked MoE experts through its gathered kernel) or
    # "simt" (`quant_linear`, fp32 activations). On the H200, 27B ninfer-v2 decode: 1.7x faster per Q4 GEMV at M=1,
    # 10x at M=8; the whole B=1 step 11.3 ms.
    decode_quant: str = "mma"
    # Steps of up to SKINNY_ROWS rows run independent work on a second stream, beside the serving stream's: the MoE
    # shared expert beside the router and routed experts, the Gated DeltaNet a/b projection beside in_proj and the
    # conv. Same kernels, same results (tests run the branches in both orders on the host). None: on for MoE models
    # only, as measured on the H200 (bench/cuda_model.py --branches off,on; results/cuda_model_session10.json):
    # 35B-A3B B=1 ninfer-v2 3.76 -> 3.36-3.55 ms, bf16 4.77 -> 4.27-4.31; B=8 7.48 -> 7.16, 10.18 -> 9.67; 27B
    # (no shared expert, only the small a/b projection to overlap) bf16 15.58 -> 15.99, ninfer-v2 9.38 -> 9.20.
    branches: bool | None = None
    # Decode kernels launched programmatically (`kernels_numba.programmatic`): the tensor-core quantized GEMVs, the
    # bf16 gathered expert GEMVs and the Gated DeltaNet recurrence start while the kernel before finishes and load
    # what no earlier kernel of the step writes (weights, the recurrent state) before waiting for it. Same kernels,
    # same bits. On, as measured on the H200 (bench/cuda_model.py --programmatic off,on, ms a step): the quantized
    # GEMVs alone (results/cuda_model_v2_programmatic_session29.json) 27B ninfer-v2 B=1 7.94 -> 7.62, B=8 11.08 ->
    # 10.74; with the gathered GEMVs and the recurrence (results/cuda_model_programmatic_bf16_session31.json)
    # 35B-A3B bf16 B=1 3.73 -> 3.60, B=8 8.29 -> 8.12, ninfer-v2 B=1 3.08 -> 2.99, B=8 5.55 -> 5.47.
    programmatic_launch: bool = True
    # The most key splits a decode attention row takes (`attention_decode`: ceil(length / S) keys each, one block a
    # kv head and split), at S x (head_dim + 2) fp32 of scratch a row and q head. None: `row_splits` (64 for the
    # 27B and the 35B-A3B), as measured on the H200. A row's bits depend on its keys and S only, so one S holds for
    # every batch size.
    attention_splits: int | None = None
    # The fewest keys a decode attention split takes (`split_keys`): fewer splits for a short row. At B=8 every
    # decode kernel was fastest at 16 splits (35B-A3B 1K context: 28 us against 55 at 64; results/
    # kernel_attention_staged_session16.json), B=1 at 32-64: a floor per split (the same for every row and batch,
    # so batch invariant) gives short rows fewer splits. 64, as measured on the H200 (results/
    # cuda_model_floor_session17.json, bf16, floor 0 / 64 / 128, ms a step): 1K context B=8 35B-A3B 9.33 / 9.21 /
    # 9.25, 27B 19.00 / 18.63 / 18.73; B=1 within noise (4.07 / 4.08 / 4.16, 15.64 / 15.71 / 15.89); 32K the same.
    attention_min_split_keys: int = 64
    # Decode attention over bf16 KV (head_dim 256) on the tensor cores (`attention_decode_mma`: a block serves the
    # q heads of one kv head for the rows of one lane together, K and V tiles loaded once for all of them) instead
    # of the staged SIMT kernel (a warp a q head and row). Both are batch invariant; the choice depends on the KV
    # dtype only (INT8 pools: tensor_core_decode_int8), so greedy MTP stays greedy. Why: the SIMT kernel's time grows
    # with the rows of a lane, and an MTP verify step is k + 1 rows of one lane: 27B bf16 at 8K context, 4 rows,
    # 128 us a layer (results/cuda_model_27b_bf16_mtp_parts_session33.log). On, as measured on the H200 at 8K
    # context (bench/cuda_model.py --tensor-core-decode off,on; results/*tensor_core_decode_session33.json, ms):
    # 27B bf16 MTP k = 3 round 20.84 -> 19.32 (verify 17.76 -> 16.37), decode B=1 / 4 / 8 14.88 / 17.51 / 20.80 ->
    # 14.77 / 17.04 / 19.81; 35B-A3B bf16 k = 3 round 7.55 -> 7.27, B=1 / 8 3.72 / 9.33 -> 3.65 / 8.92; 27B
    # ninfer-v2 round 12.79 -> 11.33, B=1 / 8 7.65 / 14.34 -> 7.54 / 13.36; 35B-A3B ninfer-v2 round 5.70 -> 5.39,
    # B=1 / 8 2.91 / 6.55 -> 2.86 / 6.15.
    tensor_core_decode: bool = True
    # The same for INT8-G64 pools (`attention_decode_mma`'s INT8 form: the tile's codes turned into exact bf16 in
    # shared memory, each 64-dim group's scores times its K scales, a key's V scale folded into its probability).
    # Off until timed on the GPU (bench/cuda_model.py --kv int8 --tensor-core-decode off,on): the staged SIMT kernel
    # till then.
    tensor_core_decode_int8: bool = False
    # bf16 matrices of at most NARROW_MAX_ROWS output rows and NARROW_MAX_K columns (the MoE router, the Gated
    # DeltaNet a/b projection) up to SKINNY_ROWS rows through `linear_narrow` (K split over a block's warps, every
    # weight load issued first; the router's GEMV and the expert routing in one launch) instead of decode_linear's
    # path. Batch invariant like the quantized kernels. Why: on the H200 each of those cuBLAS GEMVs took ~6.7 us for
    # ~0.3 us of bytes (35B-A3B decode: 70 a step, 471 us) and the routing launch after the router ~5 us more. None:
    # on for dense models only, as measured (results/cuda_model_v2_decode_session16.json, off -> on): 27B ninfer-v2
    # B=1 8.25 -> 8.15 ms, B=8 12.21 -> 11.97; 35B-A3B B=1 3.55 -> 3.62, B=8 7.34 -> 7.52 (its 40 fused routers at
    # ~9 us a launch against ~7 for cuBLAS's GEMV, and slower beside the shared expert on the side stream).
    narrow_decode: bool | None = None
    # Quantized matrices a long prefill chunk dequantizes to bf16 ahead of their cuBLAS GEMMs, on a stream of their
    # own (`dequant_ahead`), each in a buffer as large as the largest quantized matrix (27B: 356 MB; the 35B-A3B's
    # stacked expert gate|up: 1 GiB). 0: each right before its GEMM, on the serving stream. None: 2 for dense models,
    # 0 for MoE, as measured on the H200 (8K prefill, ahead 0 / 1 / 2 / 3, ms; results/
    # cuda_model_v2_dequant_ahead_session25.json): 27B ninfer-v2 722.3 / 714.6 / 699.5 / 706.4, 35B-A3B ninfer-v2
    # 185.6 / 185.7 / 183.4 / 184.8 (within its run-to-run spread, for 3 GiB). The dequantizations barely overlap:
    # the GEMMs and flash attention leave no SM room for their blocks.
    dequant_ahead: int | None = None
    # Decode projections that add into the residual right before a norm (the attention and Gated DeltaNet output
    # projections, the dense FFN's down) on the cuBLAS path, padded to the decode rows: their product in this many
    # slices of K (one strided-batched cuBLAS call, `Blas.split_k_gemm_bf16`), the slices added to the residual in
    # the launch of that norm (`add_slices_rms_norm_rows`) instead of cuBLAS's own split-K reduction launch and an
    # accumulating write. 0: off. A matrix whose K is not a multiple of 8 slices keeps the plain call. The slices'
    # sum is the same product to fp32 rounding in a fixed order: batch invariant like the padded call. 2, as measured
    # on the H200 (bench/cuda_model.py --split-k-norm 0,2,4, cuBLAS padded to 32 decode rows; results/
    # cuda_model_split_k_norm_session29.json, ms a step): 35B-A3B bf16 B=1 3.75 / 3.69 / 3.70, B=8 8.31 / 8.26 /
    # 8.27; 27B bf16 B=1 15.55 / 15.48 / 15.79, B=8 18.38 / 18.30 / 18.55.
    split_k_norm: int = DEFAULT_SPLIT_K_NORM
    # Gated DeltaNet decode rows whose in-projection runs on the tensor cores (ninfer-v2): the causal conv in the
    # GEMV's launch (`quant_mma_conv`: each block convolves the 16 channels it computed) instead of a launch of its
    # own after it. The same bits either way. On, as measured on the H200 (bench/cuda_model.py --conv-in-projection
    # off,on, twice each; results/cuda_model_conv_in_projection_preloaded_session30.json, ms a step): 27B ninfer-v2
    # B=1 7.59 / 7.61 -> 7.53 / 7.51, B=8 10.66 -> 10.67; 35B-A3B ninfer-v2 B=1 3.01 / 3.02 -> 3.04 / 3.02, B=8
    # 5.51 / 5.52 -> 5.53 / 5.51 (level).
    conv_in_projection: bool = True
    # Gated DeltaNet decode rows with a bf16 a/b projection: the projection computed by the recurrence's blocks from
    # the fp32 normed rows (`gdn_recurrent_projected`) instead of a GEMV launch before it. That GEMV (2 Hv rows, ~0.3
    # MB) sat on the critical path: serially on the dense models, and beside a tensor-core in-projection that held
    # every SM on the 35B-A3B (its side-stream launch waited ~11 us for SMs, the recurrence ~5 us for it). None: on
    # where the in-projection is a tensor-core quantized matrix (ninfer-v2), as measured on the H200
    # (bench/cuda_model.py --ab-in-recurrence off,on, ms a step; results/*ab_in_recurrence*session32.json):
    # 35B-A3B ninfer-v2 B=1 2.93 -> 2.77, B=8 5.38 -> 5.38; 27B ninfer-v2 B=1 7.35 -> 7.36. Off beside a cuBLAS
    # in-projection (bf16), where the projection overlaps it: 35B-A3B bf16 B=1 3.56 -> 3.62, B=8 8.17 -> 8.43 (the
    # first form of the kernel, a group of columns a round trip). Row-independent, so a step's rows never change it
    # (greedy MTP stays greedy).
    ab_in_recurrence: bool | None = None
    # Key groups of the decode recurrence (`gdn.gdn_recurrent`: 4 or 8 threads share a value column's key-dim sum;
    # 8 halves a thread's registers, 166 against 242-255 at key dim 128, so more blocks fit an SM when a step has
    # many: the 35B-A3B's B=8 recurrence ran 23.8 us a layer against 6.8 at B=1, ~0.3 of copy). It fixes the
    # sums' order: one value a deployment. Not yet timed on the H200 (bench/cuda_model.py --recurrence-groups 4,8).
    recurrence_groups: int = REC_DEFAULT_GROUPS
    # Prefill chunks between SKINNY_ROWS and prefill_rows rows padded to the next power of two
    # (`CudaQwen.padded_prefill_rows`), so that graphs captured at startup for those few row counts serve every such
    # chunk: a prompt shorter than a chunk, and every prompt's remainder, run eagerly otherwise (host-bound on the
    # 35B-A3B: ~1,200 launches a chunk whatever its rows). Off until timed on the GPU (bench/cuda_model.py
    # --prefill-tokens N --prefill-buckets off,on).
    prefill_buckets: bool = False
    # Prefill MoE chunks whose routed experts are tensor-core quantized (ninfer-v2) multiply them straight from their
    # codes over the chunked layout (`quant_mma_chunked`: 32 rows a block, the gate|up GEMM writing silu(gate) * up)
    # instead of dequantizing every expert to bf16 for cuBLAS: the 35B-A3B ninfer-v2 writes ~64 GB of bf16 experts
    # a 1024-row chunk that way (~27 ms on the H200 against ~12 ms of expert GEMMs; its served 8K prefill 545 ms
    # against bf16's 269-311). The layout is then chunked whatever moe_prefill_gemm says. Off until timed on the GPU
    # (bench/cuda_model.py --prefill-only --prefill-chunk 1024 --direct-quant-experts off,on).
    direct_quant_experts: bool = False

    def __attrs_post_init__(self) -> None:
        if self.attention_splits is not None:
            check_splits(self.attention_splits)
        check_min_split_keys(self.attention_min_split_keys)
        if self.decode_linear not in ("cublas", "mma", "kernels", "auto"):
            raise ValueError(f"decode_linear must be 'cublas', 'mma', 'kernels' or 'auto', got {self.decode_linear!r}")
        if self.decode_quant not in ("simt", "mma"):
            raise ValueError(f"decode_quant must be 'simt' or 'mma', got {self.decode_quant!r}")
        if self.spec not in SPEC_BACKENDS:
            raise ValueError(f"spec must be one of {', '.join(SPEC_BACKENDS)}, got {self.spec!r}")
        if self.dequant_ahead is not None and self.dequant_ahead < 0:
            raise ValueError(f"dequant_ahead must be 0 or more, got {self.dequant_ahead}")
        check_split_k_norm(self.split_k_norm)
        check_recurrence_groups(self.recurrence_groups)

    @property
    def mtp(self) -> bool:
        return self.draft_tokens > 0 and self.spec == "mtp"

    @property
    def dflash(self) -> bool:
        return self.draft_tokens > 0 and self.spec == "dflash"

    @property
    def verify_columns(self) -> int:
        return self.draft_tokens + 1 if self.draft_tokens else 0

    @property
    def decode_rows(self) -> int:
        return self.lanes * (self.draft_tokens + 1)

    @property
    def dflash_rows(self) -> int:
        """Rows of a DFlash drafter call in a decode round: per lane a proposal block and its committed columns, k+1
        rows each (0 without DFlash)."""
        return 2 * self.decode_rows if self.dflash else 0

    @property
    def short_prefill_rows(self) -> int:
        """The most rows of a prefill chunk that may run the decode path (see SHORT_PREFILL_ROW_KEYS)."""
        return min(self.prefill_rows, SKINNY_ROWS)

    @property
    def max_rows(self) -> int:
        # +1: a final prefill chunk's MTP rows add the bridge column
        return max(self.decode_rows, self.prefill_rows + 1, self.dflash_rows)

    @property
    def max_pages_per_lane(self) -> int:
        return -(-self.max_context // PAGE_TOKENS)


def check_recurrence_groups(groups: int) -> None:
    """The ValueError of a Capacity.recurrence_groups the recurrence has no compiled variant for."""
    if groups not in REC_GROUP_CHOICES:
        raise ValueError(f"recurrence_groups must be one of {', '.join(map(str, REC_GROUP_CHOICES))}, got {groups}")


def check_split_k_norm(slices: int) -> None:
    """The ValueError of a Capacity.split_k_norm `add_slices_rms_norm_rows` has no kernel for."""
    if slices != 0 and slices not in ADD_SLICES:
        raise ValueError(f"split_k_norm must be 0 (off) or one of {', '.join(map(str, ADD_SLICES))} slices, got "
                         f"{slices}")
