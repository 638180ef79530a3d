"""Qwen3.6 on the GPU: the layer math of `ninfer.models.qwen3_6` as kernel launches on device buffers.

`CudaQwen` holds the weights, the per-layer state (paged KV pools, Gated DeltaNet lane states, their checkpoint
slots and verify-column copies) and a workspace sized for the largest call. `forward` runs the decoder over the rows
whose inputs the caller put in `inputs` (token ids, rope positions, per-row lane and KV index, per-lane segments):

* decode and verify rounds (`prefill=None`): every row attends through its lane's page table; all launches read
  their sizes from Python ints fixed per graph shape, so the whole call is captured once per shape and replayed;
* a prefill chunk of one lane (`prefill=PrefillSpan`): tiled causal attention, and cuBLAS GEMMs beyond
  `SKINNY_ROWS` rows.

With DFlash (`Capacity.spec == "dflash"`), `forward` also captures the context features of the rows it runs (the
residual rows after the drafter's target layers), and `dflash_step` runs the drafter (ninfer-facts §3.10): committed
columns projected into its context caches (a cyclic window-slot cache per lane for each sliding layer, the paged
pool for the full layer, both bf16), then one forward of the proposal blocks over those caches.

Numerics: fp32 activations; linear layers read bf16 or quantized weights with fp32 accumulation. Up to SKINNY_ROWS
rows use the skinny kernels, whose per-row results do not depend on the row count (greedy output is the same alone or
batched); longer prefill chunks round activations to bf16 for cuBLAS.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import attrs
import numpy as np

from ninfer.artifact.formats import align_up
from ninfer.backends.cpu.dflash import DFLASH_KV_DTYPE
from ninfer.backends.cpu.ops import rope_inv_freq
from ninfer.backends.cpu.paged_kv import kv_bytes_per_token
from ninfer.backends.cpu.runner import SPEC_BACKENDS
from ninfer.engine.cold_tier import ParkedArray, RowRuns
from ninfer.engine.sampler import TOP_K_CAP
from ninfer.kernels_numba.attention import check_min_split_keys, check_splits, row_splits
from ninfer.kernels_numba.elementwise import ADD_SLICES
from ninfer.kernels_numba.gdn import REC_DEFAULT_GROUPS, REC_GROUP_CHOICES, conv_normed_fits
from ninfer.kernels_numba.gdn_chunked import CHUNK as GDN_CHUNK
from ninfer.kernels_numba.linear_narrow import FUSED_ROUTE_ROWS, NARROW_MAX_K, NARROW_MAX_ROWS
from ninfer.kernels_numba.moe import (COMBINE_NORM_SLOTS, LAYOUT_CHUNKED, LAYOUT_CODES, LAYOUT_INFO, LAYOUT_PADDED,
                                     PADDED_LIMIT, stepped_chunks)
from ninfer.kernels_numba.moe import GROUP_ROWS as MOE_GROUP_ROWS
from ninfer.kernels_numba.programmatic import check_available as check_programmatic_launch
from ninfer.kernels_numba.quant_mma_chunked import CHUNK_ROWS as QUANT_CHUNK_ROWS
from ninfer.backends.cuda.blas import MAX_CHUNKS
from ninfer.backends.cuda.dequant_ahead import WeightDequantizer
from ninfer.backends.cuda.device import CudaDevice, Device
from ninfer.backends.cuda.linear_tuning import BF16_INPUT_PATHS, DECODE_PATHS, candidate_paths, tune_decode_paths
from ninfer.backends.cuda.weights import Bf16Matrix, DeviceWeights, Matrix, SplitMatrix, is_quantized
from ninfer.models.dflash import DFlashMismatchError
from ninfer.targets.dims import SLIDING_ATTENTION, DFlashDims, QwenDims

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


# ---------------------------------------------------------------------------------------------------------------
# Weights


@attrs.frozen
class AttentionWeights:
    in_proj: Matrix  # rows q | k | gate | v
    query_norm: Any
    key_norm: Any
    output: Matrix


@attrs.frozen
class GdnWeights:
    in_proj: Matrix  # rows q | k | v | z
    ab_proj: Matrix  # rows a | b
    conv: Any  # fp32 [K, C]
    neg_a: Any  # fp32 [Hv]: -exp(a_log)
    dt_bias: Any
    norm: Any


@attrs.frozen
class GdnOutput:
    output: Matrix


@attrs.frozen
class DenseFfn:
    gate_up: Matrix
    down: Matrix


@attrs.frozen
class MoeFfn:
    # [E + 1 + zero rows, H]: the router's rows, then the shared expert's gate (one GEMV), padded (ROUTER_ROWS_MULTIPLE)
    router_shared_gate: Bf16Matrix
    routed_gate_up: Matrix  # [E * 2I, H]
    routed_down: Matrix  # [E * H, I]
    shared_gate_up: Matrix
    shared_down: Matrix


@attrs.frozen
class LayerWeights:
    input_norm: Any
    post_attention_norm: Any
    attention: AttentionWeights | None
    gdn: GdnWeights | None
    gdn_output: Matrix | None
    ffn: DenseFfn | MoeFfn


@attrs.frozen
class MtpWeights:
    input_projection: Matrix  # [H, 2H]
    embedding_norm: Any
    hidden_norm: Any
    layer: LayerWeights
    final_norm: Any


@attrs.frozen
class DFlashLayerWeights:
    input_norm: Any
    query_key_value: Matrix  # rows q | k | v
    query_norm: Any  # plain per-head norms
    key_norm: Any
    output: Matrix
    post_attention_norm: Any
    mlp: DenseFfn
    window: int  # a sliding layer's window (|p_key - p_query| < window); 0 for a full layer


@attrs.frozen
class DFlashWeights:
    """The drafter's own objects (`dflash/...`); it reads the target's embedding table and heads."""

    dims: DFlashDims
    feature_projection: Matrix  # [H, layers * H]
    context_norm: Any
    layers: tuple[DFlashLayerWeights, ...]
    final_norm: Any
    inv_freq: Any  # 1-D RoPE over every head dim


def _dflash_weights(w: DeviceWeights, device: Device, target: QwenDims, dims: DFlashDims | None,
                    draft_tokens: int) -> DFlashWeights:
    # Imported here: the kernel geometry check needs numba, which the rest of this module reaches through `device`.
    from ninfer.kernels_numba.dflash import check_geometry

    if dims is None:
        raise ValueError("DFlash speculative decoding needs the drafter's dimensions (an artifact with its "
                         "dflash/... objects)")
    problems = dims.problems_with(target)
    if problems:
        raise DFlashMismatchError("the DFlash drafter does not fit the target model: " + "; ".join(problems))
    if draft_tokens > dims.max_draft_tokens:
        raise ValueError(f"the DFlash drafter proposes at most {dims.max_draft_tokens} tokens (block size "
                         f"{dims.block_size}), not {draft_tokens}")
    check_geometry(dims.attn_heads, dims.kv_heads, dims.head_dim)
    layers = []
    for index, kind in enumerate(dims.layer_types):
        p = f"dflash/layers/{index}/"
        layers.append(DFlashLayerWeights(
            w.vector(p + "input_norm"), w.matrix(p + "attention/query_key_value"), w.vector(p + "attention/query_norm"),
            w.vector(p + "attention/key_norm"), w.matrix(p + "attention/output"), w.vector(p + "post_attention_norm"),
            DenseFfn(w.matrix(p + "mlp/gate_up"), w.matrix(p + "mlp/down")),
            dims.sliding_window if kind == SLIDING_ATTENTION else 0))
    return DFlashWeights(dims, w.matrix("dflash/feature_projection"), w.vector("dflash/context_norm"), tuple(layers),
                         w.vector("dflash/final_norm"),
                         device.upload(rope_inv_freq(dims.head_dim, dims.rope_theta), "weights"))


def _attention_weights(w: DeviceWeights, prefix: str, fused: bool) -> AttentionWeights:
    names = (prefix + "query_key_gate_value",) if fused else (prefix + "query_key", prefix + "gate_value")
    return AttentionWeights(w.matrix(*names), w.vector(prefix + "query_norm"), w.vector(prefix + "key_norm"),
                            w.matrix(prefix + "output"))


def _gdn_weights(w: DeviceWeights, device: Device, prefix: str, fused: bool) -> GdnWeights:
    if fused:
        in_proj, ab = w.matrix(prefix + "query_key_value_z"), w.matrix(prefix + "a_b_projection")
    else:
        in_proj = w.matrix(prefix + "query_key", prefix + "value_z")
        ab = w.matrix(prefix + "a_projection", prefix + "b_projection")
    neg_a = -np.exp(w.host(prefix + "a_log").astype(np.float32)).astype(np.float32)
    return GdnWeights(in_proj, ab, w.vector(prefix + "convolution"), device.upload(neg_a, "weights"),
                      w.vector(prefix + "dt_bias"),
                      w.vector(prefix + "norm"))


# cuBLAS runs a GEMM whose fp32 output rows are not 16-byte aligned on old kernels with a split-K reduce (the router
# and shared gate, 257 rows: 6.6 + 2 us a layer on the H200, where 256 + 1 took 5.5 + 5): their weight rows are padded
# with zeros to a multiple of this.
ROUTER_ROWS_MULTIPLE = 8


def _zero_padded_rows(device: Device, matrix: Bf16Matrix, multiple: int) -> Bf16Matrix:
    """`matrix` with zero rows appended up to a multiple of `multiple` rows; the unpadded copy is released."""
    rows, width = matrix.shape
    padded_rows = align_up(rows, multiple)
    if padded_rows == rows:
        return matrix
    padded = device.zeros((padded_rows, width), np.uint16, "weights")
    device.copy(padded[:rows], matrix.data)
    device.synchronize()  # the copy has read the unpadded rows before they are freed with their last reference
    device.ledger["weights"] -= matrix.nbytes
    return Bf16Matrix(padded)


def _gate_up(w: DeviceWeights, name: str, down: Matrix, inter: int, *, gathered: bool = False) -> Matrix:
    """A SwiGLU gate|up matrix, stored for the fused epilogue (`swiglu_rows`) when its down projection reads x
    fragments too (the epilogue writes those, and no fp32 activation)."""
    return w.matrix(name, gathered=gathered, swiglu_rows=2 * inter if _tensor_core(down) else 0)


def _ffn_weights(w: DeviceWeights, device: Device, dims: QwenDims, prefix: str) -> DenseFfn | MoeFfn:
    if not dims.is_moe:
        down = w.matrix(prefix + "mlp/down")
        return DenseFfn(_gate_up(w, prefix + "mlp/gate_up", down, dims.intermediate), down)
    p = prefix + "moe/"
    router_shared_gate = w.matrix(p + "router_shared_gate")
    if is_quantized(router_shared_gate):
        raise ValueError(f"{p}router_shared_gate must be stored as BF16")
    routed_down, shared_down = w.matrix(p + "routed_down", gathered=True), w.matrix(p + "shared_down")
    return MoeFfn(_zero_padded_rows(device, router_shared_gate, ROUTER_ROWS_MULTIPLE),
                  _gate_up(w, p + "routed_gate_up", routed_down, dims.moe_intermediate, gathered=True), routed_down,
                  _gate_up(w, p + "shared_gate_up", shared_down, dims.shared_intermediate), shared_down)


def _layer_weights(w: DeviceWeights, device: Device, dims: QwenDims, prefix: str, kind: str,
                   fused: bool) -> LayerWeights:
    attention = gdn_weights = gdn_output = None
    if kind == "full_attention":
        attention = _attention_weights(w, prefix + "attention/", fused)
    else:
        gdn_weights = _gdn_weights(w, device, prefix + "gdn/", fused)
        gdn_output = w.matrix(prefix + "gdn/output")
    return LayerWeights(w.vector(prefix + "input_norm"), w.vector(prefix + "post_attention_norm"), attention,
                        gdn_weights, gdn_output, _ffn_weights(w, device, dims, prefix))


# ---------------------------------------------------------------------------------------------------------------
# State


@attrs.frozen
class KvPool:
    k: Any
    v: Any
    k_scale: Any  # None for bf16 pools
    v_scale: Any


@attrs.frozen
class GdnLayerState:
    conv: Any  # [lanes, K-1, C]
    ssm: Any  # [lanes, Hv, Dk, Dv]
    conv_checkpoints: Any  # [lanes, slots, K-1, C]
    ssm_checkpoints: Any  # [lanes, slots, Hv, Dk, Dv]
    conv_columns: Any  # [lanes, max(1, columns), K-1, C]
    ssm_columns: Any  # [lanes, columns - 1, Hv, Dk, Dv]: the last column's state is the running one (none without MTP)


@attrs.frozen
class DFlashRing:
    """A sliding drafter layer's cyclic context caches: position p of lane l in slot p % window (bf16)."""

    k: Any  # uint16 [lanes, window, kv_heads, head_dim]
    v: Any
    k_checkpoints: Any  # uint16 [lanes, slots, window, kv_heads, head_dim]
    v_checkpoints: Any


def _dflash_ring(device: Device, dims: DFlashDims, lanes: int, slots: int) -> DFlashRing:
    shape = (dims.sliding_window, dims.kv_heads, dims.head_dim)
    return DFlashRing(device.zeros((lanes,) + shape, np.uint16, "state"),
                      device.zeros((lanes,) + shape, np.uint16, "state"),
                      device.zeros((lanes, slots) + shape, np.uint16, "state"),
                      device.zeros((lanes, slots) + shape, np.uint16, "state"))


def _kv_pool(device: Device, dims: QwenDims | DFlashDims, kv_dtype: str, pages: int) -> KvPool:
    shape = (pages, PAGE_TOKENS, dims.kv_heads, dims.head_dim)
    if kv_dtype == "bf16":
        return KvPool(device.zeros(shape, np.uint16, "kv"), device.zeros(shape, np.uint16, "kv"), None, None)
    group = min(64, dims.head_dim)
    scale_shape = shape[:-1] + (dims.head_dim // group,)
    return KvPool(device.zeros(shape, np.int8, "kv"), device.zeros(shape, np.int8, "kv"),
                  device.zeros(scale_shape, np.uint16, "kv"), device.zeros(scale_shape, np.uint16, "kv"))


@attrs.frozen
class GdnStateBank:
    """The running and verify-column states of every recurrent layer, one allocation a kind with the layer first
    (each GdnLayerState holds views of its layer), so one launch restores every layer of many lanes from their
    verify columns (`CudaQwen.select_columns`) where a copy a layer a lane cost ~100 host calls a lane a round."""

    conv: Any  # [layers, lanes, (K-1) C]
    ssm: Any  # [layers, lanes, Hv Dk Dv]
    conv_columns: Any  # [layers, lanes, max(1, columns), (K-1) C]
    ssm_columns: Any  # [layers, lanes, columns - 1, Hv Dk Dv]


def _gdn_states(device: Device, dims: QwenDims, cap: Capacity, slots: int,
                layers: list[int]) -> tuple[dict[int, GdnLayerState], GdnStateBank | None]:
    """Each recurrent layer's state (views into the bank for the running and the verify-column states), and the
    bank (None without recurrent layers)."""
    if not layers:
        return {}, None
    conv = (dims.conv_kernel - 1, dims.gdn_conv_channels)
    ssm = (dims.gdn_v_heads, dims.gdn_k_dim, dims.gdn_v_dim)
    lanes, columns, count = cap.lanes, max(1, cap.verify_columns), len(layers)
    # the recurrence records every verify column but the last (gdn.py): 3 MB a layer a lane less on the 27B, and
    # nothing at all without speculative decoding (~1.2 GB at 8 lanes)
    records = max(0, cap.verify_columns - 1)
    bank = GdnStateBank(device.zeros((count, lanes, math.prod(conv)), np.float32, "state"),
                        device.zeros((count, lanes, math.prod(ssm)), np.float32, "state"),
                        device.zeros((count, lanes, columns, math.prod(conv)), np.float32, "state"),
                        device.zeros((count, lanes, records, math.prod(ssm)), np.float32, "state"))
    states = {layer: GdnLayerState(
        bank.conv[j].reshape((lanes,) + conv), bank.ssm[j].reshape((lanes,) + ssm),
        device.zeros((lanes, slots) + conv, np.float32, "state"),
        device.zeros((lanes, slots) + ssm, np.float32, "state"),
        bank.conv_columns[j].reshape((lanes, columns) + conv), bank.ssm_columns[j].reshape((lanes, records) + ssm))
        for j, layer in enumerate(layers)}
    return states, bank


# ---------------------------------------------------------------------------------------------------------------
# Per-call inputs and workspace


class InputRows:
    """Named int32 input rows carved from one device array [names, rows] (each row a contiguous view), with a host
    mirror, so that a call's inputs go down in one pitched copy (`Device.write_rows`) instead of a write each: a
    write with its event took ~10 us of host time, and an MTP round at one lane wrote 12 input rows (two fills)
    while the GPU waited for them. `fill` copies rows 0 .. the last one given, columns 0 .. the longest value given:
    rows in that range it was not given go down again as the mirror holds them, so no kernel may write a row
    before a name listed after it unless every fill gives that row (`StepInputs` puts `next_ids`, which the draft
    chain writes on the device, last)."""

    def __init__(self, device: Device, names: tuple[str, ...], rows: int) -> None:
        self._device = device
        self._rows = {name: i for i, name in enumerate(names)}
        self.block = device.zeros((len(names), rows), np.int32, "inputs")
        self._mirror = np.zeros((len(names), rows), np.int32)

    def row(self, name: str) -> Any:
        return self.block[self._rows[name]]

    def fill(self, values: dict[str, Any]) -> None:
        """Each named row's first len(value) entries (a 2D value: its rows from the named row on); names given None
        or empty values keep their contents. (Per call on the decode path: kept to plain slice assignments.)"""
        last, width, mirror, capacity = -1, 0, self._mirror, self._mirror.shape[1]
        for name, value in values.items():
            if value is None or not len(value):
                continue
            first = self._rows[name]
            value = value if isinstance(value, np.ndarray) else np.asarray(value)
            count, columns = value.shape if value.ndim == 2 else (1, value.shape[0])
            if columns > capacity:
                raise ValueError(f"{columns} values of {name} exceed the {capacity} this model was sized for")
            mirror[first:first + count, :columns] = value
            if first + count - 1 > last:
                last = first + count - 1
            if columns > width:
                width = columns
        if last >= 0:
            self._device.write_rows(self.block[:last + 1, :width], mirror[:last + 1, :width])


class StepInputs:
    """Fixed device buffers a call reads its per-row and per-segment inputs from (filled before a replay)."""

    # positions are three rows (MRoPE's sections); next_ids last (see InputRows)
    ROWS = ("token_ids", "row_lane", "row_pos", "positions", "positions 1", "positions 2", "seg_lane", "seg_row",
            "seg_count", "seg_record", "hidden_rows", "next_ids")

    def __init__(self, device: Device, rows: int, lanes: int, pages: int) -> None:
        self._device = device
        self._inputs = InputRows(device, self.ROWS, rows)
        row = self._inputs.row
        self.token_ids, self.row_lane, self.row_pos = row("token_ids"), row("row_lane"), row("row_pos")
        self.positions = self._inputs.block[3:6]  # [3, rows]
        self.seg_lane, self.seg_row = row("seg_lane"), row("seg_row")
        self.seg_count, self.seg_record = row("seg_count"), row("seg_record")
        self.hidden_rows = row("hidden_rows")  # MTP: each row's target hidden row (`CudaQwen.gather_mtp_hidden`)
        self.next_ids = row("next_ids")  # MTP: the token after each row's token
        self.page_tables = device.zeros((lanes, pages), np.int32, "inputs")
        self.host_page_tables = np.zeros((lanes, pages), np.int32)

    def fill(self, *, token_ids: Any, positions: np.ndarray, row_lane: Any, row_pos: Any, seg_lane: Any,
             seg_row: Any, seg_count: Any, seg_record: Any, next_ids: Any = None, hidden_rows: Any = None) -> None:
        """Per-row inputs (rows = len(token_ids)) and per-segment inputs (segments = len(seg_lane)), in one copy."""
        if len(token_ids) > len(self.token_ids):
            raise ValueError(f"{len(token_ids)} rows exceed the {len(self.token_ids)} this model was sized for")
        rows = len(token_ids)
        self._inputs.fill({"token_ids": token_ids, "row_lane": row_lane, "row_pos": row_pos,
                           "positions": np.asarray(positions)[:, :rows] if rows else None, "seg_lane": seg_lane,
                           "seg_row": seg_row, "seg_count": seg_count, "seg_record": seg_record,
                           "hidden_rows": hidden_rows, "next_ids": next_ids})

    def set_page_table(self, lane: int, table: np.ndarray) -> None:
        pages = self.host_page_tables.shape[1]
        if len(table) > pages:
            raise ValueError(f"lane {lane}: {len(table)} pages exceed the {pages} a lane can address")
        row = np.zeros(pages, np.int32)
        row[: len(table)] = table
        self.host_page_tables[lane] = row
        self._device.write(self.page_tables[lane], row)


class DFlashInputs:
    """Fixed device buffers of a drafter call's rows: block rows first (proposal blocks of k+1 rows), then context
    rows (committed positions to project into the caches)."""

    def __init__(self, device: Device, rows: int) -> None:
        self._inputs = InputRows(device, ("ids", "positions", "row_lane", "ring_slot", "context_source"), rows)
        row = self._inputs.row
        self.ids = row("ids")  # block rows: anchor, then the mask id
        self.positions = row("positions")  # RoPE and window position; -1: a padding row
        self.row_lane = row("row_lane")
        self.ring_slot = row("ring_slot")  # context rows: ring slot, -1 when superseded
        self.context_source = row("context_source")  # context row r: its pending row (lane-major)

    def fill(self, *, ids: Any, positions: Any, row_lane: Any, ring_slot: Any, context_source: Any) -> None:
        if len(positions) > len(self.positions):
            raise ValueError(f"{len(positions)} drafter rows exceed the {len(self.positions)} this model was sized for")
        self._inputs.fill({"ids": ids, "positions": positions, "row_lane": row_lane, "ring_slot": ring_slot,
                           "context_source": context_source})


class DFlashWorkspace:
    """The drafter's activation buffers: `rows` rows for what context rows pass through (a prefill chunk's features
    and projections), `linear_rows` (the drafter's cuBLAS padding, see `Linear`) for the block rows' linear-layer
    operands, and `block_rows` (the most proposal rows of a call) for the attention's."""

    def __init__(self, device: Device, dims: DFlashDims, *, rows: int, linear_rows: int, block_rows: int) -> None:
        def buf(*shape: int) -> Any:
            return device.empty(shape, np.float32, "workspace")

        h = dims.hidden
        self.features = buf(rows, dims.feature_width)  # context features: captured by the target, or gathered
        self.projected = buf(rows, h)  # W_fc s, before the context norm
        self.normed = buf(rows, h)  # block rows' normed input, then context rows' c: one qkv projection for both
        self.qkv = buf(rows, dims.q_width + 2 * dims.kv_width)
        self.u = buf(linear_rows, h)  # the block rows' residual stream
        self.attended = buf(linear_rows, dims.q_width)
        self.gate_up = buf(linear_rows, 2 * dims.intermediate)
        self.act = buf(linear_rows, dims.intermediate)
        self.q = buf(block_rows, dims.attn_heads, dims.head_dim)
        self.k_block = buf(block_rows, dims.kv_heads, dims.head_dim)
        self.v_block = buf(block_rows, dims.kv_heads, dims.head_dim)
        self.partials = buf(*device.kernels.attention_partials_shape(block_rows, dims.attn_heads, dims.head_dim))


class Workspace:
    """Activation buffers for up to `rows` rows, allocated once."""

    def __init__(self, device: Device, dims: QwenDims, rows: int, *, mtp: bool, dequant_elements: int,
                 decode_attention_rows: int, attention_splits: int, max_context: int,
                 tensor_core_attention: bool, fragment_words: int = 0,
                 slot_fragment_words: int = 0, dflash: DFlashDims | None = None, decode_rows: int = 0,
                 residual_slices: int = 0) -> None:
        d, f32 = dims, np.float32

        def buf(*shape: int, dtype: Any = f32) -> Any:
            return device.empty(shape, dtype, "workspace")

        h = d.hidden
        self.x = buf(rows, h)
        self.h = buf(rows, h)
        self.final = buf(rows, h)
        self.qkgv = buf(rows, 2 * d.q_width + 2 * d.kv_width)
        self.q = buf(rows, d.attn_heads, d.head_dim)
        self.attended = buf(rows, d.q_width)
        # split partials of the decode attention kernel: decode and verify rows, and short prefill chunks
        self.partials = buf(*device.kernels.decode_partials_shape(decode_attention_rows, d.attn_heads, d.head_dim,
                                                                  attention_splits))
        channels = d.gdn_conv_channels
        self.projected = buf(rows, channels + d.gdn_v_width)
        self.ab = buf(rows, 2 * d.gdn_v_heads)
        self.mixed = buf(rows, channels)
        self.gdn_out = buf(rows, d.gdn_v_heads, d.gdn_v_dim)
        self.gdn_normed = buf(rows, d.gdn_v_width)
        if rows > SKINNY_ROWS:  # the chunked gated delta rule of long prefill chunks: its inputs (gdn_gates'
            # outputs: the recurrent form computes them itself), G, and T / P per chunk
            self.gdn_q = buf(rows, d.gdn_qk_heads, d.gdn_k_dim)
            self.gdn_k = buf(rows, d.gdn_qk_heads, d.gdn_k_dim)
            self.log_decay = buf(rows, d.gdn_v_heads)
            self.beta = buf(rows, d.gdn_v_heads)
            self.gdn_cum = buf(rows, d.gdn_v_heads)
            self.gdn_mats = buf(rows, d.gdn_v_heads, GDN_CHUNK)
        # Split projections (27B ninfer-v2): q|k and gate|v of attention, q|k and v|z of Gated DeltaNet. Their
        # blocks meet in this scratch only up to SKINNY_ROWS rows (past them each block's GEMM writes its columns).
        split = max(d.q_width + d.kv_width, 2 * d.gdn_qk_width, 2 * d.gdn_v_width)
        split_rows = min(rows, SKINNY_ROWS)
        self.split_a, self.split_b = buf(split_rows * split), buf(split_rows * split)
        widths = [h, d.q_width, d.gdn_v_width, 2 * h if mtp else h]
        if d.is_moe:
            s, e = d.moe_top_k, d.moe_experts
            # then the shared expert's gate logit and the padding rows' zeros
            self.router_logits = buf(rows, align_up(e + 1, ROUTER_ROWS_MULTIPLE))
            self.expert_ids = buf(rows, s, dtype=np.int32)
            self.expert_weights = buf(rows, s)
            # linear_bf16_narrow_route's count of finished blocks: zero between launches
            self.route_counter = device.zeros(1, np.int32, "workspace")
            slot_rows = min(rows, SKINNY_ROWS)  # the per-row expert route runs for up to SKINNY_ROWS rows
            self.slot_gate_up = buf(slot_rows, s, 2 * d.moe_intermediate)
            self.slot_act = buf(slot_rows, s, d.moe_intermediate)
            self.slot_out = buf(slot_rows, s, h)
            self.shared_gate_up = buf(rows, 2 * d.shared_intermediate)
            self.shared_act = buf(rows, d.shared_intermediate)
            self.shared_out = buf(rows, h)
            widths += [d.moe_intermediate, d.shared_intermediate]
            self.moe_counts = buf(e, dtype=np.int32)
            # moe_group's offsets, then moe_layout's info: what the prefill reads back, in one copy
            self.moe_sizes = buf(e + 1 + LAYOUT_INFO, dtype=np.int32)
            self.moe_offsets = self.moe_sizes[: e + 1]
            self.moe_slot_of = buf(rows * s, dtype=np.int32)
            self.moe_position_of = buf(rows * s, dtype=np.int32)
            if rows > SKINNY_ROWS:
                self.moe_block_counts = buf(-(-rows // MOE_GROUP_ROWS), e, dtype=np.int32)  # moe_group's scratch
                self.moe_padded_position_of = buf(rows * s, dtype=np.int32)
                self.moe_starts = buf(e, dtype=np.int32)  # each expert's first row in the expert GEMMs' layout
                self.moe_chunk_groups = buf(MAX_CHUNKS, dtype=np.int32)  # the chunked layout's chunk -> expert
                # the expert GEMMs' input, bf16 outputs and the activation between them, with room for the padded
                # layout wherever the "auto" rule takes it
                limit, parts = PADDED_LIMIT
                permuted = max(rows * s * limit // parts, rows * s + e * (MOE_CHUNK_ROWS - 1))
                self.perm_in = buf(permuted, h, dtype=np.uint16)
                self.perm_gate_up = buf(permuted, 2 * d.moe_intermediate, dtype=np.uint16)
                self.perm_act_bf16 = buf(permuted, d.moe_intermediate, dtype=np.uint16)
                self.perm_out = buf(permuted, h, dtype=np.uint16)
        else:
            self.gate_up = buf(rows, 2 * d.intermediate)
            self.act = buf(rows, d.intermediate)
            widths.append(d.intermediate)
        if dflash is not None:  # the drafter's linear layers share the bf16 activation scratch
            widths += [dflash.feature_width, dflash.q_width, dflash.intermediate]
        self.mtp_in = buf(rows, 2 * h) if mtp else None
        self.mtp_embedded = buf(rows, h) if mtp else None
        self.mtp_carried = buf(rows, h) if mtp else None
        self.x_bf16 = buf(rows, max(widths), dtype=np.uint16)  # activations rounded for cuBLAS
        # the same for the linear layers on the side stream (Capacity.branches): h into the shared expert and the
        # GDN a/b projection, the shared expert's activation into its down projection
        side_rows = min(rows, max(SKINNY_ROWS, decode_rows))
        self.side_x_bf16 = buf(side_rows, max(h, d.shared_intermediate if d.is_moe else 0), dtype=np.uint16)
        # Capacity.split_k_norm: a residual projection's K slices at the padded decode rows, for the norm after it
        self.residual_partials = buf(residual_slices * decode_rows * h) if residual_slices and decode_rows else None
        # Tensor-core prefill attention (`prefill_attention="gemm"`), only when asked for (up to ~1.5 GiB): the
        # lane's K/V as contiguous bf16, a block of packed queries, and the score / probability scratch (at most
        # SCORE_BYTES of fp32 scores).
        self.gemm_keys = self.gemm_values = self.gemm_queries = self.gemm_out = None
        self.gemm_scores = self.gemm_probs = None
        if tensor_core_attention:
            self.gemm_keys = buf(d.kv_heads * max_context * d.head_dim, dtype=np.uint16)
            # (flash: V^T rows of a multiple of 8 keys)
            self.gemm_values = buf(d.kv_heads * align_up(max_context, 8) * d.head_dim, dtype=np.uint16)
            self.gemm_queries = buf(rows * d.q_width, dtype=np.uint16)
            self.gemm_out = buf(rows * d.q_width)
            scores = min(SCORE_BYTES // 4, d.attn_heads * rows * max_context)
            self.gemm_scores = buf(scores)
            self.gemm_probs = buf(scores, dtype=np.uint16)
        self.w_bf16 = buf(dequant_elements, dtype=np.uint16) if dequant_elements else None
        # bf16 B fragments of up to 8 activation rows for the tensor-core quantized layers (`quant_mma`)
        self.x_fragments = buf(fragment_words, dtype=np.uint32) if fragment_words else None
        # the same per expert slot for the tensor-core MoE down projection, whose input differs per slot
        self.slot_x_fragments = buf(slot_fragment_words, dtype=np.uint32) if slot_fragment_words else None
        self.side_x_fragments = buf(fragment_words, dtype=np.uint32) if fragment_words else None
        # the down projections' x fragments the fused SwiGLU epilogues write (dense FFN, or the shared expert), apart
        # from the fragments of h their gate|up reads
        self.act_fragments = buf(fragment_words, dtype=np.uint32) if fragment_words else None


# ---------------------------------------------------------------------------------------------------------------
# The model


@attrs.frozen
class SideScratch:
    """The scratch a Linear on the side stream converts its inputs into (`Linear.beside`): not the serving stream's,
    which the other branch may be reading. Split projections and dequantized weights never run there."""

    x_bf16: Any
    x_fragments: Any
    split_a: None = None
    split_b: None = None
    w_bf16: None = None


def _fp32_read(h: Any, rows: int, h_bf16: Any, h_fragments: Any) -> Any:
    """Rows h (a layer's normed rows, the attention's output) for their producer to write, or None where nothing
    reads them in fp32: past SKINNY_ROWS rows every reader is a cuBLAS GEMM or the MoE gather, and all read the
    bf16 copy (the side streams that convert h themselves run only up to SKINNY_ROWS)."""
    return None if rows > SKINNY_ROWS and reads_bf16_alone(h_bf16, h_fragments) else h


def reads_bf16_alone(x_bf16: Any, x_fragments: Any) -> bool:
    """Whether the consumer of an activation reads only its bf16 copy: `Linear.bf16_input` asked for one (a cuBLAS
    GEMM, which reads nothing else) and `fragment_input` for no fragments. Its producer can then skip the fp32."""
    return x_bf16 is not None and x_fragments is None


class Linear:
    """y (+)= x @ W^T for any stored format: up to SKINNY_ROWS rows the quantized kernels, and for bf16 matrices
    cuBLAS, the tensor-core kernel (`bf16_path` "mma") or the skinny kernels (`cublas_decode`; both from
    Capacity.decode_linear); cuBLAS on bf16 beyond.

    Batch invariance with cuBLAS: cuBLAS picks its algorithm (and so the summation order) from the shape, so up to
    `pad_rows` rows every call computes exactly `pad_rows` rows (one shape, whatever the batch; a row's result never
    depends on other rows). Callers pass whole workspace buffers and `rows` for that: rows past `rows` of x are
    stale inputs and of y scratch outputs. cuBLAS takes bf16 activations; a producer kernel that already wrote them
    (into `bf16_input`'s scratch) passes that copy as `x_bf16` and saves the conversion launch."""

    def __init__(self, device: Device, workspace: Workspace, *, cublas_decode: bool, pad_rows: int,
                 bf16_path: str | None = None) -> None:
        self._device, self.blas, self._ws, self._k = device, device.blas(), workspace, device.kernels
        self._stream = device.stream
        self.cublas_decode, self.pad_rows = cublas_decode, pad_rows
        # the decode path (`DECODE_PATHS`) of every bf16 matrix `decode_paths` has none for; None: the settings above
        self.bf16_path = bf16_path
        self.programmatic = False  # Capacity.programmatic_launch (CudaQwen.set_programmatic)
        self.narrow = False  # Capacity.narrow_decode (CudaQwen.set_narrow)
        # Capacity.decode_linear "auto": each bf16 shape's decode path as timed on this GPU (`linear_tuning`; (N, K) ->
        # "cublas", "kernels" or "narrow"), ahead of the settings above; shared with `beside` and `with_pad_rows`
        self.decode_paths: dict[tuple[int, int], str] = {}
        # the bf16 copies of quantized matrices past SKINNY_ROWS (CudaQwen.set_dequant_ahead adds buffers)
        self.dequantizer = (WeightDequantizer([workspace.w_bf16], self._dequantize, device.stream)
                            if workspace.w_bf16 is not None else None)

    def beside(self, side: Any, scratch: "SideScratch") -> Linear:
        """A Linear with this one's settings that launches on the side stream `side`, with its cuBLAS handle and
        its own conversion scratch (an x_bf16 or x_fragments passed in is read, never written)."""
        sibling = copy.copy(self)
        sibling._stream, sibling.blas, sibling._ws = side.stream, side.blas, scratch
        sibling.dequantizer = None
        return sibling

    def with_pad_rows(self, pad_rows: int) -> Linear:
        """A Linear sharing this one's cuBLAS handle and scratch whose padded calls compute `pad_rows` rows: a caller
        with calls of another fixed size (the DFlash drafter) keeps its own shape."""
        sibling = copy.copy(self)
        sibling.pad_rows = pad_rows if self.cublas_decode else 0
        return sibling

    def __call__(self, x: Any, w: Matrix, y: Any, *, rows: int | None = None, accumulate: bool = False,
                 x_bf16: Any = None, x_fragments: Any = None) -> None:
        stream, k = self._stream, self._k
        rows = x.shape[0] if rows is None else rows
        if isinstance(w, SplitMatrix):
            self._split(x, w, y, rows, accumulate, x_bf16, x_fragments)
            return
        path = self.decode_path(w, rows)
        if path is not None:
            self.bf16_decode(path, x, w, y, rows, accumulate=accumulate, x_bf16=x_bf16)
            return
        if self.reads_narrow(w, rows):
            k.linear_bf16_narrow(x[:rows], w.data, y[:rows], stream=stream, accumulate=accumulate)
            return
        if rows <= SKINNY_ROWS and (is_quantized(w) or not self.cublas_decode):
            if _tensor_core(w):
                if x_fragments is not None and rows <= self.mma_launch_rows:  # the producer of x wrote them
                    k.linear_quant_mma(x_fragments, w, y[:rows], stream=stream, accumulate=accumulate,
                                       programmatic=self.programmatic)
                    return
                for first in range(0, rows, self.mma_launch_rows):  # a row's result is independent of the others
                    last = min(rows, first + self.mma_launch_rows)
                    k.x_fragments(x[first:last], self._ws.x_fragments, stream=stream)
                    k.linear_quant_mma(self._ws.x_fragments, w, y[first:last], stream=stream, accumulate=accumulate,
                                       programmatic=self.programmatic)
            elif is_quantized(w):
                k.linear_quant(x[:rows], w, y[:rows], stream=stream, accumulate=accumulate)
            else:
                k.linear_bf16(x[:rows], w.data, y[:rows], stream=stream, accumulate=accumulate)
            return
        self._cublas(x, w, y, rows, accumulate, x_bf16)

    def decode_path(self, w: Matrix, rows: int) -> str | None:
        """The path `decode_paths` chose for a bf16 matrix at this row count, else `bf16_path` where that path takes
        the shape; None: the settings decide."""
        if rows <= SKINNY_ROWS and isinstance(w, Bf16Matrix):
            shape = tuple(w.shape)
            if shape in self.decode_paths:
                return self.decode_paths[shape]
            return self.bf16_path if self.bf16_path in candidate_paths(shape) else None
        return None

    def bf16_decode(self, path: str, x: Any, w: Bf16Matrix, y: Any, rows: int, *, accumulate: bool = False,
                    x_bf16: Any = None) -> None:
        """y[:rows] (+)= x[:rows] @ W^T through one decode path (`DECODE_PATHS`): cuBLAS padded to `pad_rows` or the
        tensor-core kernel (bf16 input, `x_bf16` when its producer wrote it), the skinny kernel or the narrow one
        (fp32 input)."""
        if path == "cublas":
            self._cublas(x, w, y, rows, accumulate, x_bf16)
        elif path == "mma":
            self._k.linear_bf16_mma(self._gemm_input(x, rows, x_bf16, rows), w.data, y[:rows], stream=self._stream,
                                    accumulate=accumulate, programmatic=self.programmatic)
        elif path == "kernels":
            self._k.linear_bf16(x[:rows], w.data, y[:rows], stream=self._stream, accumulate=accumulate)
        elif path == "narrow":
            self._k.linear_bf16_narrow(x[:rows], w.data, y[:rows], stream=self._stream, accumulate=accumulate)
        else:
            raise ValueError(f"decode path must be one of {', '.join(DECODE_PATHS)}, got {path!r}")

    def splits_k(self, w: Matrix, rows: int, slices: int) -> bool:
        """Whether `split_k` takes w at this row count: a bf16 matrix on the padded cuBLAS path, at least twice as
        wide as tall, whose K divides into `slices` slices of whole 8-column vectors. Why the width: on the H200
        (results/split_k_probe_session29c.json) the sliced call and its add beat cuBLAS plus the norm on the 35B-A3B's
        2048 x 4096 out projection (9.2 -> 7.8 us) and the 27B's 5120 x 17408 down (55.5 -> 50.0) but lost on the
        27B's 5120 x 6144 out projections (21.3 -> 22.4): near-square, cuBLAS does not split K itself, and the
        slices only add partials to write and read."""
        return (slices > 0 and isinstance(w, Bf16Matrix) and 0 < rows <= self.pad_rows <= SKINNY_ROWS
                and self._reads_bf16(w, rows) and self.decode_path(w, rows) in (None, "cublas")
                and w.shape[1] >= 2 * w.shape[0] and w.shape[1] % (8 * slices) == 0)

    def split_k(self, x: Any, w: Bf16Matrix, partials: Any, rows: int, x_bf16: Any, slices: int) -> Any:
        """The K slices of x[:pad_rows] @ W^T into the flat fp32 `partials` (`Blas.split_k_gemm_bf16`; x rounded
        to bf16 here unless its producer wrote `x_bf16`); returns them as [slices, pad_rows, N]. Check `splits_k`
        first."""
        n = w.shape[0]
        sliced = partials[: slices * self.pad_rows * n].reshape(slices, self.pad_rows, n)
        self.blas.split_k_gemm_bf16(self._gemm_input(x, rows, x_bf16, self.pad_rows), self.bf16_weight(w), sliced,
                                    slices)
        return sliced

    def _cublas(self, x: Any, w: Matrix, y: Any, rows: int, accumulate: bool, x_bf16: Any) -> None:
        gemm_rows = self._gemm_rows(rows, x, y)
        self.blas.gemm_bf16(self._gemm_input(x, rows, x_bf16, gemm_rows), self.bf16_weight(w), y[:gemm_rows],
                            accumulate=accumulate)

    def _gemm_input(self, x: Any, rows: int, x_bf16: Any, gemm_rows: int) -> Any:
        """The bf16 copy of x a cuBLAS call reads, its first `gemm_rows` rows: x[:rows] rounded into the shared
        scratch here unless its producer wrote it there (`x_bf16`)."""
        width = x.shape[1]
        if x_bf16 is None:
            self._k.to_bf16_rows(x[:rows], self.bf16_input(rows, width), stream=self._stream)
        return self.bf16_input(gemm_rows, width)

    def _gemm_rows(self, rows: int, x: Any, y: Any) -> int:
        """Rows a cuBLAS call computes: `pad_rows` for calls of up to that many (one GEMM shape whatever the
        batch), else `rows`."""
        return self.pad_rows if rows <= self.pad_rows <= min(x.shape[0], y.shape[0]) else rows

    @property
    def stream(self) -> Any:
        """The stream this Linear launches on."""
        return self._stream

    def fragments_of(self, x: Any) -> Any:
        """x's tensor-core x fragments (at most mma_launch_rows rows) in this Linear's scratch."""
        self._k.x_fragments(x, self._ws.x_fragments, stream=self._stream)
        return self._ws.x_fragments

    @property
    def mma_launch_rows(self) -> int:
        """x rows one tensor-core launch takes: its x-fragment sets of MMA_ROWS rows."""
        return MMA_ROWS * self._k.ROW_SETS

    def bf16_input(self, rows: int, width: int, *consumers: Matrix) -> Any:
        """The shared scratch for a [rows, width] bf16 copy of an activation, or None when no consumer would read it
        (with consumers given: the producer then skips writing it). Pass it to every consumer as `x_bf16` (those
        that read fp32 or fragments ignore it). The copy is valid until the next linear call that converts its own
        input."""
        if consumers and not any(self._reads_bf16(w, rows) for w in consumers):
            return None
        return self._ws.x_bf16.reshape(self._ws.x_bf16.size)[: rows * width].reshape(rows, width)

    def fragment_input(self, rows: int, *consumers: Matrix) -> Any:
        """The shared x-fragment buffer for the producer of an activation to write (`out_fragments`) when some
        consumer runs on the tensor cores at this row count (<= 8 rows: one set), else None. Pass it to every
        consumer as `x_fragments` (the others ignore it): none then converts its own input, and the fragments stay
        valid until the next linear call without them."""
        if rows > MMA_ROWS or not any(self._reads_fragments(w, rows) for w in consumers):
            return None
        return self._ws.x_fragments

    def reads_narrow(self, w: Matrix, rows: int) -> bool:
        """Whether `__call__` multiplies w through the narrow kernel (fp32 input) at this row count."""
        path = self.decode_path(w, rows)
        if path is not None:
            return path == "narrow"
        return (self.narrow and isinstance(w, Bf16Matrix) and rows <= SKINNY_ROWS and w.shape[0] <= NARROW_MAX_ROWS
                and w.shape[1] <= NARROW_MAX_K)

    def _reads_fragments(self, w: Matrix, rows: int) -> bool:
        if isinstance(w, SplitMatrix):
            return any(self._reads_fragments(part, rows) for part in w.parts)
        return _tensor_core(w) and rows <= SKINNY_ROWS

    def _reads_bf16(self, w: Matrix, rows: int) -> bool:
        """Whether `__call__` multiplies w through cuBLAS (bf16 input) at this row count (a split projection: both
        its blocks, past the decode rows)."""
        if isinstance(w, SplitMatrix):
            return rows > SKINNY_ROWS
        path = self.decode_path(w, rows)
        if path is not None:
            return path in BF16_INPUT_PATHS
        return rows > SKINNY_ROWS or (isinstance(w, Bf16Matrix) and self.cublas_decode
                                      and not self.reads_narrow(w, rows))

    def _split(self, x: Any, w: SplitMatrix, y: Any, rows: int, accumulate: bool, x_bf16: Any,
               x_fragments: Any) -> None:
        """Two row blocks (every split projection of the 27B inventory has exactly two): past the decode rows each
        block's GEMM writes its columns of y from one bf16 copy of x; on the tensor-core decode path one pair launch
        writes both; otherwise each block into scratch rows, then joined side by side."""
        if accumulate or len(w.parts) != 2:
            raise ValueError("a split projection must have two blocks and overwrite its output")
        if rows > SKINNY_ROWS:  # no join: at 8K rows the 27B's 64 joins were 57 ms of a 0.9 s prefill
            gemm_rows = self._gemm_rows(rows, x, y)
            x_bf16 = self._gemm_input(x, rows, x_bf16, gemm_rows)
            column = 0
            for part in w.parts:
                self.blas.gemm_bf16(x_bf16, self.bf16_weight(part), y[:gemm_rows], first_column=column)
                column += part.shape[0]
            return
        widest = max(part.shape[0] for part in w.parts)
        capacity, outputs = min(x.shape[0], y.shape[0], self._ws.split_a.shape[0] // widest), []
        if rows > capacity:
            raise ValueError(f"a split projection of {rows} rows: its blocks' scratch holds {capacity}")
        if x_fragments is None and rows <= self.mma_launch_rows and self._reads_fragments(w, rows):
            x_fragments = self._ws.x_fragments  # one conversion for both blocks
            self._k.x_fragments(x[:rows], x_fragments, stream=self._stream)
        first, second = w.parts
        if (x_fragments is not None and rows <= min(self.mma_launch_rows, SKINNY_ROWS) and _tensor_core(first)
                and _tensor_core(second) and self._k.has_pair_kernel(first, second)):
            self._k.linear_quant_mma_pair(x_fragments, first, second, y[:rows], stream=self._stream,
                                          programmatic=self.programmatic)  # one launch, no join
            return
        for part, scratch in zip(w.parts, (self._ws.split_a, self._ws.split_b)):
            out = scratch[: capacity * part.shape[0]].reshape(capacity, part.shape[0])
            self(x, part, out, rows=rows, x_fragments=x_fragments)
            outputs.append(out[:rows])
        self._k.concat_columns(outputs[0], outputs[1], y[:rows], stream=self._stream)

    def convolves(self, w: Matrix, rows: int) -> bool:
        """Whether `linear_conv` takes w at this row count: the tensor-core decode path (one launch's rows) for
        every row block of w, and a compiled fused kernel for their formats."""
        parts = _row_blocks(w)
        return (0 < rows <= min(self.mma_launch_rows, SKINNY_ROWS) and all(_tensor_core(part) for part in parts)
                and self._k.has_conv_kernel(parts))

    def linear_conv(self, x: Any, w: Matrix, y: Any, conv: tuple, mixed: Any, *, rows: int, channels: int,
                    x_fragments: Any = None) -> None:
        """y[:rows] = x[:rows] @ W^T and mixed[:rows] = gdn_conv of y's first `channels` columns, in one launch
        (`linear_quant_mma_conv`; check `convolves` first). `conv`: the conv weight, state, histories and the four
        segment arrays, as `gdn_conv` takes them; `x_fragments`: x's, when its producer wrote them."""
        if x_fragments is None:
            x_fragments = self.fragments_of(x[:rows])
        self._k.linear_quant_mma_conv(x_fragments, _row_blocks(w), y[:rows], *conv, mixed[:rows], channels=channels,
                                      stream=self._stream, programmatic=self.programmatic)

    def bf16_weight(self, w: Matrix) -> Any:
        """A bf16 [N, K] view of the weight: itself, or its dequantization (`WeightDequantizer.weight`: valid for
        the readers queued before the next call)."""
        if not is_quantized(w):
            return w.data
        if self.dequantizer is None:
            raise RuntimeError("this Linear has no dequantization scratch (a side stream's, or no long prefill rows)")
        return self.dequantizer.weight(w)

    def _dequantize(self, w: Matrix, out: Any, stream: Any) -> None:
        dequantize = self._k.dequantize_mma_bf16 if _tensor_core(w) else self._k.dequantize_bf16
        dequantize(w, out, stream=stream)


class CudaQwen:
    def __init__(self, dims: QwenDims, weights: DeviceWeights, device: Device, capacity: Capacity, *,
                 dflash: DFlashDims | None = None) -> None:
        """`dflash`: the drafter's dimensions, which a capacity with spec "dflash" needs (its weights are loaded)."""
        self.dims, self.device, self.capacity, self.k = dims, device, capacity, device.kernels
        # Prefill attention: "kernel" (the tiled numba kernel, fp32 math), "gemm" (bf16 tensor cores via cuBLAS) or
        # "flash" (one bf16 tensor-core kernel, `attention_flash`); the last two need the model built with
        # Capacity.tensor_core_attention for their scratch. The 8K prefill on the H200 (results/
        # cuda_model_session10.json): 27B bf16 gemm 0.960 s, flash 0.915; 35B-A3B bf16 0.251, 0.259; since flash
        # loads K and V a stage apart (results/cuda_model_prefill_session16.json): 27B bf16 gemm 0.941, flash 0.886;
        # 35B-A3B 0.242, 0.232. So flash for every model.
        if capacity.tensor_core_attention:
            self.prefill_attention = "flash"
        else:
            self.prefill_attention = "kernel"
        # MoE prefill expert GEMMs: "auto" (padded while within moe.PADDED_LIMIT, else chunked), "grouped",
        # "padded" or "chunked" (the last two where their rows fit the permuted scratch; grouped otherwise).
        self.moe_prefill_gemm = "auto"
        # rows a batch entry of the chunked layout (the workspace has room for up to MOE_CHUNK_ROWS: a larger chunk
        # the rows do not fit takes the grouped GEMM); bench/cuda_model.py --moe-chunk times the choices
        self.moe_chunk_rows = MOE_CHUNK_ROWS
        # the chunked layout's batch count rounded up to a multiple of this, the surplus entries over rows past the
        # routed ones that nothing reads: a few batch counts recur instead of a new one each layer, in case cuBLAS
        # chooses its kernel anew for each (bench/cublas_host_cost.py), and the SiLU's and scatter's workspace views
        # come from the memo (numba builds a new one in ~50 us of host time); --moe-chunk-step times it
        self.moe_chunk_step = MOE_CHUNK_STEP
        # the prefill's expert GEMMs without reading the counts back: the chunked layout at its most chunks for the
        # rows (up to E - 1 surplus chunks over rows nothing reads, ~20% more expert FLOPs at the 35B-A3B's 8K), so
        # the host never waits on the GPU mid-prefill. None: for chunks of up to MOE_SYNC_FREE_ROWS rows; True or
        # False: for every chunk or none (--moe-sync-free times them)
        self.moe_sync_free: bool | None = None
        self.moe_sync_free_chunk_rows = MOE_SYNC_FREE_CHUNK_ROWS  # the sync-free layout's rows a chunk
        self.prefill_buckets = capacity.prefill_buckets  # switchable between chunks (the bench times each)
        self.direct_quant_experts = capacity.direct_quant_experts  # switchable between chunks, likewise
        # set while `capture_prefill` records: each prefill attention call is handed to it instead of issued
        self._attention_cut: Callable[[Callable[[PrefillSpan], None]], None] | None = None
        fused = dims.is_moe
        weights.quant_layout = capacity.decode_quant
        self.embedding = weights.table("text/token_embedding")
        self.layers = [_layer_weights(weights, device, dims, f"text/layers/{i}/", kind, fused)
                       for i, kind in enumerate(dims.layer_types)]
        self.final_norm = weights.vector("text/final_norm")
        self.head = weights.matrix("text/output_head")
        self.mtp: MtpWeights | None = None
        if capacity.mtp:
            mtp_layer = LayerWeights(weights.vector("mtp/layer/input_norm"),
                                     weights.vector("mtp/layer/post_attention_norm"),
                                     _attention_weights(weights, "mtp/layer/attention/", True), None, None,
                                     _ffn_weights(weights, device, dims, "mtp/layer/"))
            self.mtp = MtpWeights(weights.matrix("mtp/input_projection"), weights.vector("mtp/embedding_norm"),
                                  weights.vector("mtp/hidden_norm"), mtp_layer, weights.vector("mtp/final_norm"))
        self.dflash = _dflash_weights(weights, device, dims, dflash, capacity.draft_tokens) if capacity.dflash \
            else None
        # The optimized proposal head (§3.9): a shortlist of head rows and the token id of each.
        self.draft_head = self.draft_head_ids = self.draft_head_id_rows = None
        if capacity.draft_tokens and capacity.draft_head and weights.has("text/draft_head") \
                and weights.has("text/draft_head_token_ids"):
            self.draft_head = weights.matrix("text/draft_head")
            self.draft_head_ids = weights.host("text/draft_head_token_ids").astype(np.int32)
            # the same ids on the device, as one-column fp32 rows (their bits): `gather_rows` maps a proposal's
            # shortlist row to its token id between MTP steps without the host
            self.draft_head_id_rows = device.upload(self.draft_head_ids.view(np.float32).reshape(-1, 1), "weights")
        self.inv_freq = device.upload(rope_inv_freq(dims.rotary_dim, dims.rope_theta), "weights")
        device.synchronize()
        self.free_after_weights = device.info.free_bytes  # what --kv-capacity auto sizes from
        self.multiprocessors = device.info.multiprocessors  # the chunked GDN scan sizes its slices to the SMs

        self.pages = 0
        self.kv: dict[int, KvPool] = {}
        self.mtp_kv: KvPool | None = None
        self.dflash_kv: dict[int, KvPool] = {}  # the drafter's full layers (allocate_kv)
        recurrent = [i for i, kind in enumerate(dims.layer_types) if kind != "full_attention"]
        self.gdn, self.gdn_bank = _gdn_states(device, dims, capacity, CHECKPOINT_SLOTS, recurrent)

        rows = capacity.max_rows
        self.inputs = StepInputs(device, rows, capacity.lanes, capacity.max_pages_per_lane)
        drafter = self.dflash.dims if self.dflash is not None else None
        self.workspace = Workspace(device, dims, rows, mtp=capacity.mtp,
                                   dequant_elements=self._dequant_elements() if rows > SKINNY_ROWS else 0,
                                   decode_attention_rows=max(capacity.decode_rows, capacity.short_prefill_rows),
                                   attention_splits=capacity.attention_splits or row_splits(dims.kv_heads),
                                   max_context=capacity.max_pages_per_lane * PAGE_TOKENS,
                                   tensor_core_attention=capacity.tensor_core_attention,
                                   fragment_words=self._fragment_words(),
                                   slot_fragment_words=self._slot_fragment_words(), dflash=drafter,
                                   decode_rows=capacity.decode_rows, residual_slices=capacity.split_k_norm)
        # DFlash: the sliding layers' rings, each lane's committed columns not yet projected (their context
        # features, k+1 rows a lane), which target layer fills which column block of the features, the call buffers.
        self.dflash_rings: dict[int, DFlashRing] = {}
        self.dflash_pending = self.dflash_inputs = self.dflash_workspace = None
        self.feature_blocks: dict[int, int] = {}
        if drafter is not None:
            self.dflash_rings = {layer: _dflash_ring(device, drafter, capacity.lanes, CHECKPOINT_SLOTS)
                                 for layer in drafter.sliding_layers()}
            self.dflash_pending = device.zeros((capacity.lanes, capacity.verify_columns, drafter.feature_width),
                                               np.float32, "state")
            self.feature_blocks = {layer: block for block, layer in enumerate(drafter.target_layer_ids)}
            self.dflash_inputs = DFlashInputs(device, rows)
            self.dflash_workspace = DFlashWorkspace(device, drafter, rows=rows, linear_rows=capacity.dflash_rows,
                                                    block_rows=capacity.decode_rows)
        # Runner glue: MTP hidden rows gathered per round, a row index, a prefill chunk's last row.
        self.mtp_hidden = device.empty((rows + 1, dims.hidden), np.float32, "workspace") if capacity.mtp else None
        # The draft chain (one graph a round: k proposals and the k - 1 MTP steps between them): each proposal's
        # ids; and, written before the graph in one copy (`stage_draft_steps`) and copied into the step inputs
        # inside it, each row's lane, the MTP output row it starts from, and each MTP step's positions and MTP KV
        # indexes (step s: rows 4 s .. 4 s + 2 positions, 4 s + 3 the index).
        steps, lanes = max(capacity.draft_tokens, 1), max(capacity.lanes, 1)
        self.draft_ids = device.zeros((steps, lanes), np.int32, "inputs") if capacity.mtp else None
        self.chain = InputRows(device, ("row_lane", "sources") + tuple(
            f"step {s} {part}" for s in range(steps) for part in ("positions", "positions 1", "positions 2",
                                                                  "row_pos")), lanes) if capacity.mtp else None
        self.last_row = device.empty((1, dims.hidden), np.float32, "workspace")
        self.tails = device.zeros((capacity.lanes, dims.hidden), np.float32, "state")
        self.tail_checkpoints = device.zeros((capacity.lanes, CHECKPOINT_SLOTS, dims.hidden), np.float32, "state")
        self.verify_hidden = device.zeros((capacity.lanes, max(1, capacity.verify_columns), dims.hidden), np.float32,
                                          "state")
        # the verify-column selection's picks (`stage_selection`): lanes, each one's column for its tail, and for its
        # recurrent states (-1: keep them)
        self.selection = device.zeros((3, max(capacity.lanes, 1)), np.int32, "inputs")
        self.logits = device.empty((max(capacity.decode_rows, 1), dims.vocab_rows), np.float32, "workspace")
        if self.draft_head is not None:  # a row per MTP proposal, or per DFlash block row
            self.draft_logits = device.empty((capacity.decode_rows, self.draft_head.shape[0]), np.float32,
                                             "workspace")
        self.argmax = device.empty(max(capacity.decode_rows, 1), np.int32, "workspace")
        self.sampling_scratch = device.empty((max(capacity.decode_rows, 1),
                                              device.kernels.scratch_columns(dims.vocab_ids)),
                                             np.uint64, "workspace")
        # Sampling on the device: penalty counts per lane, per-row penalties, the 20 best penalised candidates.
        decode_rows = max(capacity.decode_rows, 1)
        self.penalty_counts = device.zeros((capacity.lanes, dims.vocab_ids), np.int32, "state")
        self.presence = device.zeros(decode_rows, np.float32, "inputs")
        self.frequency = device.zeros(decode_rows, np.float32, "inputs")
        self.candidate_ids = device.empty((decode_rows, TOP_K_CAP), np.int32, "workspace")
        self.candidate_values = device.empty((decode_rows, TOP_K_CAP), np.float32, "workspace")
        self.count_lanes = device.zeros(decode_rows, np.int32, "inputs")
        self.count_ids = device.zeros(decode_rows, np.int32, "inputs")
        self.count_valid = device.zeros(decode_rows, np.int32, "inputs")
        cublas = capacity.decode_linear in ("cublas", "auto")  # "auto": cuBLAS where the tuning chose no path
        self.linear = Linear(device, self.workspace, cublas_decode=cublas,
                             pad_rows=capacity.decode_rows if cublas else 0,
                             bf16_path="mma" if capacity.decode_linear == "mma" else None)
        self.dflash_linear = self.linear.with_pad_rows(capacity.dflash_rows) if drafter is not None else None
        self.set_programmatic(capacity.programmatic_launch)
        self.set_narrow(not dims.is_moe if capacity.narrow_decode is None else capacity.narrow_decode)
        if self.linear.dequantizer is not None:  # (nothing to dequantize otherwise)
            default_ahead = 0 if dims.is_moe else 2
            self.set_dequant_ahead(default_ahead if capacity.dequant_ahead is None else capacity.dequant_ahead)
        self.attention_min_split_keys = capacity.attention_min_split_keys
        # the tensor-core decode attention for this model's pools (Capacity.tensor_core_decode / _int8)
        self.tensor_core_decode = (capacity.tensor_core_decode_int8 if capacity.kv_dtype == "int8"
                                   else capacity.tensor_core_decode)
        self._side_scratch = SideScratch(self.workspace.side_x_bf16, self.workspace.side_x_fragments)
        self.branches = False
        # a decode MoE combine `_moe` left for the next norm to launch (`_norm`), or None
        self._pending_combine: tuple | None = None
        # Capacity.split_k_norm (switchable between steps up to it), and the K slices of a residual projection
        # `_add_to_residual` left for the next norm to add (`_norm`), or None
        self.split_k_norm = capacity.split_k_norm
        self._pending_partials: Any = None
        self.conv_in_projection = capacity.conv_in_projection  # switchable between steps
        self.ab_in_recurrence = capacity.ab_in_recurrence  # switchable between steps (None: by the in-projection)
        self.recurrence_groups = capacity.recurrence_groups  # switchable between steps (the bench times each)
        self.set_branches(dims.is_moe if capacity.branches is None else capacity.branches)
        # the decode paths timed on the GPU (a HostDevice's twins have no timing to go by: the settings decide there)
        self.decode_linear_timings: dict = {}
        if capacity.decode_linear == "auto" and isinstance(device, CudaDevice):
            self.tune_decode_linears()

    def tune_decode_linears(self) -> dict:
        """Capacity.decode_linear "auto": time the decode paths of every bf16 shape `self.linear` multiplies on this
        GPU and keep each shape's fastest (`linear_tuning`); {(N, K): {path: seconds}} (also kept as
        `decode_linear_timings`). Rows timed: one and the padded decode rows."""
        linear = self.linear
        linear.decode_paths.clear()  # time every path, not the ones chosen before
        rows = tuple(dict.fromkeys((1, min(max(linear.pad_rows, 1), SKINNY_ROWS))))
        paths, self.decode_linear_timings = tune_decode_paths(linear, self.device, self._linear_matrices(), rows)
        linear.decode_paths.update(paths)  # in place: the DFlash Linear shares the dict
        return self.decode_linear_timings

    def _linear_matrices(self) -> list[Matrix]:
        """The bf16 matrices decode multiplies through `self.linear`: every layer's projections (the MTP layer's
        too) and the MTP input projection; not the MoE's stacked experts (the gathered kernels read them) nor the
        head (one cuBLAS GEMV at ~0.9 of copy)."""
        found = []
        for layer in self._layers_with_mtp():
            if layer.attention is not None:
                found += [layer.attention.in_proj, layer.attention.output]
            if layer.gdn is not None:
                found += [layer.gdn.in_proj, layer.gdn.ab_proj, layer.gdn_output]
            ffn = layer.ffn
            found += ([ffn.gate_up, ffn.down] if isinstance(ffn, DenseFfn)
                      else [ffn.router_shared_gate, ffn.shared_gate_up, ffn.shared_down])
        if self.mtp:
            found.append(self.mtp.input_projection)
        return [matrix for matrix in found if isinstance(matrix, Bf16Matrix)]

    def set_programmatic(self, on: bool) -> None:
        """Capacity.programmatic_launch, switchable between steps like the branches."""
        if on and isinstance(self.device, CudaDevice):
            check_programmatic_launch()
        for linear in (self.linear, self.dflash_linear):
            if linear is not None:
                linear.programmatic = on

    def set_narrow(self, on: bool) -> None:
        """Capacity.narrow_decode, switchable between steps like the branches."""
        for linear in (self.linear, self.dflash_linear):
            if linear is not None:
                linear.narrow = on

    def set_dequant_ahead(self, ahead: int) -> None:
        """Capacity.dequant_ahead, switchable between prefill chunks (buffers once added stay)."""
        dequantizer = self.linear.dequantizer
        if dequantizer is None:
            if ahead:
                raise ValueError("dequant_ahead needs quantized matrices and prefill rows past SKINNY_ROWS")
            return
        missing = ahead - dequantizer.spare_buffers
        if missing > 0:
            size = self.workspace.w_bf16.shape[0]
            dequantizer.add_buffers([self.device.empty(size, np.uint16, "workspace") for _ in range(missing)],
                                    self.device.ahead_stream())
        dequantizer.set_ahead(ahead)

    def set_attention_min_split_keys(self, keys: int) -> None:
        """Capacity.attention_min_split_keys, switchable between steps for benchmarks (graphs captured before keep
        what they recorded)."""
        check_min_split_keys(keys)
        self.attention_min_split_keys = keys

    def set_tensor_core_decode(self, on: bool) -> None:
        """Capacity.tensor_core_decode (or _int8, for INT8 pools), switchable between steps for benchmarks (graphs
        captured before keep what they recorded)."""
        self.tensor_core_decode = on

    def set_attention_splits(self, splits: int | None) -> None:
        """Capacity.attention_splits (None: the model's `row_splits`), switchable between steps for benchmarks: the
        partials are reallocated (graphs captured before keep the old buffer)."""
        splits = splits or row_splits(self.dims.kv_heads)
        ws = self.workspace
        rows, heads, old, width = ws.partials.shape
        if splits != old:
            check_splits(splits)
            ws.partials = self.device.empty((rows, heads, splits, width), np.float32, "workspace")

    def set_branches(self, on: bool) -> None:
        """Capacity.branches, switchable between steps (graphs captured before keep what they recorded). The side
        stream, its cuBLAS handle and workspace are created here, never during a capture."""
        if on:
            self.device.side_stream()
        self.branches = on

    def _side(self, rows: int) -> Any:
        """The side stream for a step of `rows` rows, or None: branches off, or a long prefill chunk (its grouped
        MoE reads group sizes back to the host)."""
        return self.device.side_stream() if self.branches and rows <= SKINNY_ROWS else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Shared-pool bytes one token takes: every attention layer, and the MTP layer or the DFlash drafter's full
        layers (always bf16) with speculative decoding."""
        layers = sum(kind == "full_attention" for kind in self.dims.layer_types) + (1 if self.capacity.mtp else 0)
        total = kv_bytes_per_token(layers, self.dims.kv_heads, self.dims.head_dim, self.capacity.kv_dtype)
        if self.dflash is not None:
            drafter = self.dflash.dims
            total += kv_bytes_per_token(len(drafter.full_layers()), drafter.kv_heads, drafter.head_dim,
                                        DFLASH_KV_DTYPE)
        return total

    def allocate_kv(self, pages: int) -> None:
        """The shared paged KV pools (every attention layer, and the MTP layer or the DFlash drafter's full layers
        with speculative decoding)."""
        dims, kv_dtype = self.dims, self.capacity.kv_dtype
        self.kv = {i: _kv_pool(self.device, dims, kv_dtype, pages) for i, kind in enumerate(dims.layer_types)
                   if kind == "full_attention"}
        self.mtp_kv = _kv_pool(self.device, dims, kv_dtype, pages) if self.capacity.mtp else None
        if self.dflash is not None:
            self.dflash_kv = {layer: _kv_pool(self.device, self.dflash.dims, DFLASH_KV_DTYPE, pages)
                              for layer in self.dflash.dims.full_layers()}
        self.pages = pages

    def _dequant_elements(self) -> int:
        """The largest quantized matrix a prefill GEMM dequantizes (the head runs on the last row only; with
        Capacity.direct_quant_experts the routed experts that multiply from their codes never do: the 35B-A3B's
        stacked gate|up alone is 1 GiB of bf16)."""
        layers = self._layers_with_mtp()
        direct = {id(m) for layer in layers if isinstance(layer.ffn, MoeFfn) and self._direct_capable(layer.ffn)
                  for m in (layer.ffn.routed_gate_up, layer.ffn.routed_down)} if self.direct_quant_experts else set()
        return max([m.shape[0] * m.shape[1] for m in self._matrices() if is_quantized(m) and id(m) not in direct],
                   default=0)

    def _fragment_words(self) -> int:
        """x-fragment words of the widest input a tensor-core quantized matrix reads, for the sets of one launch."""
        heads = (self.head,) if self.draft_head is None else (self.head, self.draft_head)  # (a bf16 model's is Q4)
        widths = [m.shape[1] for m in (*self._matrices(), *heads) if _tensor_core(m)]
        return self.k.ROW_SETS * self.k.x_fragment_words(max(widths)) if widths else 0

    def _slot_fragment_words(self) -> int:
        """x-fragment words of the per-slot inputs of the MoE down projections, when they are tensor-core: one set
        per expert slot."""
        layers = self._layers_with_mtp()
        if not any(isinstance(layer.ffn, MoeFfn) and _tensor_core(layer.ffn.routed_down) for layer in layers):
            return 0
        return self.dims.moe_top_k * self.k.x_fragment_words(self.dims.moe_intermediate)

    def _layers_with_mtp(self) -> list[LayerWeights]:
        """The decoder's layers, and the MTP head's when it has one."""
        return self.layers + ([self.mtp.layer] if self.mtp else [])

    def _matrices(self):
        layers = self._layers_with_mtp()
        found = []
        for layer in layers:
            for part in (layer.attention, layer.gdn, layer.ffn):
                if part is not None:
                    found += [v for v in attrs.astuple(part, recurse=False) if _is_matrix(v)]
            if layer.gdn_output is not None:
                found.append(layer.gdn_output)
        if self.mtp:
            found.append(self.mtp.input_projection)
        if self.dflash is not None:
            found.append(self.dflash.feature_projection)
            for layer in self.dflash.layers:
                found += [layer.query_key_value, layer.output, layer.mlp.gate_up, layer.mlp.down]
        for matrix in found:
            yield from _row_blocks(matrix)

    # ---- the decoder ----

    def short_prefill(self, rows: int, kv_start: int) -> bool:
        """Whether a prefill chunk of `rows` rows after `kv_start` cached tokens runs the decode path, whose steps
        the runner captures as graphs (`forward` without a PrefillSpan; see SHORT_PREFILL_ROW_KEYS)."""
        return 0 < rows <= self.capacity.short_prefill_rows and rows * (kv_start + rows) <= SHORT_PREFILL_ROW_KEYS

    def padded_prefill_rows(self, count: int) -> int:
        """The rows a prefill chunk of `count` rows runs as: with `prefill_buckets`, a chunk of more than SKINNY_ROWS
        rows and fewer than the capacity's runs padded to the next power of two (at most the capacity's rows);
        otherwise as it is."""
        if not self.prefill_buckets or count <= SKINNY_ROWS or count >= self.capacity.prefill_rows:
            return count
        return min(1 << (count - 1).bit_length(), self.capacity.prefill_rows)

    def prefill_buckets_rows(self) -> list[int]:
        """Every row count `padded_prefill_rows` pads a chunk to, short of the capacity's rows."""
        if not self.prefill_buckets:
            return []
        return sorted({self.padded_prefill_rows(count) for count in range(SKINNY_ROWS + 1, self.capacity.prefill_rows)}
                      - {self.capacity.prefill_rows})

    def captured_prefill_rows(self) -> list[int]:
        """The prefill chunk sizes graphs serve (`capture_prefill`): the capacity's chunk and each bucket, where the
        model can capture them (`piecewise_prefill`)."""
        return [rows for rows in (self.capacity.prefill_rows, *self.prefill_buckets_rows())
                if self.piecewise_prefill(rows)]

    def stage_prefill(self, lane: int, kv_start: int, token_ids: Any, positions: np.ndarray, *,
                      pad: bool = True) -> tuple[int, PrefillSpan]:
        """Write a prefill chunk's inputs (tokens kv_start.. of `lane`, their MRoPE positions [3, count]) padded to
        `padded_prefill_rows` where `pad`; returns the rows to run `forward` (or the graph pieces of those rows) over
        and the span. A padded row is token 0 at position 0 outside every segment, with row_pos -1: it writes no KV
        and leaves the recurrent state alone, its attention output is zeros, and the rows after it reach nothing
        of the real rows' (row-wise work; the MoE's expert GEMMs are sized by the padded rows, so the real rows' bits
        depend on the padded count only)."""
        count = len(token_ids)
        rows = self.padded_prefill_rows(count) if pad else count
        padding = rows - count
        ids = np.concatenate([np.asarray(token_ids, np.int64), np.zeros(padding, np.int64)])
        placed = np.zeros((3, rows), np.int32)
        placed[:, :count] = positions
        row_pos = np.concatenate([kv_start + np.arange(count), np.full(padding, -1)])
        self.inputs.fill(token_ids=ids, positions=placed, row_lane=np.full(rows, lane), row_pos=row_pos,
                         seg_lane=[lane], seg_row=[0], seg_count=[count], seg_record=[0])
        return rows, PrefillSpan(lane, kv_start, count if padding else None)

    def piecewise_prefill(self, rows: int) -> bool:
        """Whether a prefill chunk of `rows` rows can be captured in pieces (`capture_prefill`): nothing in it but
        its attention calls waits on the host (a MoE model's long chunk must size its expert GEMMs sync-free)."""
        if not 0 < rows <= self.capacity.prefill_rows:
            return False
        return not self.dims.is_moe or rows <= SKINNY_ROWS or self._moe_sync_free(rows)

    def capture_prefill(self, rows: int) -> Any:
        """`forward(rows, 1, span)` of a prefill chunk (one lane, no embedding overrides), for any span, captured as
        graphs between its prefill attention calls, which read the span's KV start and so run eagerly between the
        pieces at each replay: `replay(stream_handle, span)` (`graphs.capture_pieces`). Long chunks are eager
        launches otherwise, ~1,200 a 1024-row chunk of the 35B-A3B, which the host issues slower than the GPU runs
        them. The graphs read the inputs (`inputs.fill`) and write `workspace.final[:rows]`, as `forward` does."""
        if not self.piecewise_prefill(rows):
            raise ValueError(f"a prefill chunk of {rows} rows cannot be captured: it must have 1..."
                             f"{self.capacity.prefill_rows} rows and a MoE model's long chunk must size its expert "
                             f"GEMMs without reading the group sizes back (moe_sync_free)")

        def record(cut: Callable[[Callable[[PrefillSpan], None]], None]) -> None:
            self._attention_cut = cut
            try:
                self.forward(rows, 1, CAPTURED_SPAN)
                self._drain_dequantizer()  # nothing of the pieces may stay on the dequantizer's stream
            finally:
                self._attention_cut = None

        return self.device.capture_pieces(record)

    def forward(self, rows: int, segments: int, prefill: PrefillSpan | None = None,
                embeddings: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
        """Run the target decoder over `rows` rows of `inputs`; returns the final-norm hidden rows [rows, H].
        `embeddings` (columns [n], rows [n, H] on the host: Vision output) replace the token embeddings of those rows
        (eager calls only: the rows are written from the host). With DFlash, the rows' context features land in
        rows 0..rows-1 of `dflash_workspace.features`."""
        ws, stream, d = self.workspace, self.device.stream, self.dims
        # x is written afresh (a pass that raised may have left a combine or slices behind)
        self._pending_combine = self._pending_partials = None
        x = ws.x[:rows]
        self._embed(self.inputs.token_ids[:rows], x)
        self._replace_rows(x, embeddings)
        for index, layer in enumerate(self.layers):
            self._layer(layer, index, rows, segments, prefill, self.kv.get(index))
            block = self.feature_blocks.get(index)
            if block is not None:  # the post-MLP residual: this layer's column block of the context features
                self._flush_combine()
                self.k.copy_columns(x, self.dflash_workspace.features, first_column=block * d.hidden, stream=stream)
        final = ws.final[:rows]
        self._norm(x, self.final_norm, final)
        return final

    def mtp_forward(self, hidden: Any, rows: int, prefill: PrefillSpan | None = None,
                    embeddings: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
        """The MTP head over `rows` rows: target hidden rows `hidden` [rows, H] fused with the embedding of
        `inputs.next_ids`, at `inputs.positions` / `row_pos` (the MTP KV index of each row). Returns d [rows, H].
        `embeddings` replace next-token embeddings, as in `forward`."""
        ws, stream, d, mtp = self.workspace, self.device.stream, self.dims, self.mtp
        self._pending_combine = self._pending_partials = None  # x is written afresh below
        embedded, x = ws.mtp_embedded[:rows], ws.x[:rows]
        self._embed(self.inputs.next_ids[:rows], ws.h[:rows])
        self._replace_rows(ws.h[:rows], embeddings)
        self.k.rms_norm_rows(ws.h[:rows], mtp.embedding_norm, embedded, eps=d.rms_eps, offset=True, stream=stream)
        carried = ws.mtp_carried[:rows]  # not `final`: the caller's hidden rows may live there
        self.k.rms_norm_rows(hidden, mtp.hidden_norm, carried, eps=d.rms_eps, offset=True, stream=stream)
        self.k.concat_columns(embedded, carried, ws.mtp_in[:rows], stream=stream)
        self.linear(ws.mtp_in, mtp.input_projection, ws.x, rows=rows)
        self._layer(mtp.layer, -1, rows, rows, prefill, self.mtp_kv)
        out = ws.final[:rows]
        self._norm(x, mtp.final_norm, out)
        return out

    def propose(self, d: Any, rows: int | None = None) -> Any:
        """Greedy proposals for drafter outputs d[:rows] [rows, H] (all of `d` without `rows`; with it, `d` is a whole
        buffer, as in `head_logits`) into argmax[:rows]: over the full head's token rows, or over the shortlist
        head's rows (indices into draft_head_ids) when the model loaded one."""
        rows = d.shape[0] if rows is None else rows
        if self.draft_head is None:
            return self.greedy(self.head_logits(d, rows))
        logits = self.draft_logits[:rows]
        self.linear(d, self.draft_head, self.draft_logits, rows=rows)
        out = self.argmax[:rows]
        self.k.argmax_rows(logits, logits.shape[1], out, stream=self.device.stream, scratch=self.sampling_scratch)
        return out

    def gather_mtp_hidden(self, rows: int) -> Any:
        """The MTP head's target hidden rows into mtp_hidden[:rows], as `inputs.hidden_rows` names them (i >= 0:
        row i of workspace.final, the last forward's output; -1 - lane: that lane's tail). Returns the rows."""
        hidden = self.mtp_hidden[:rows]
        self.k.gather_two_sources(self.workspace.final, self.tails, self.inputs.hidden_rows[:rows], hidden,
                                  stream=self.device.stream)
        return hidden

    def keep_segment_rows(self, segments: int) -> None:
        """After a decode step's forward over `segments` segments (`inputs`): each one-row segment's output row
        becomes its lane's tail, each verify segment's rows its lane's verify columns (`layout.keep_segment_rows`);
        with a DFlash drafter every segment's captured features wait in its lane's pending rows (the committed ones
        join the drafter's context at its next call)."""
        inputs, stream = self.inputs, self.device.stream
        segs = (inputs.seg_lane[:segments], inputs.seg_row[:segments], inputs.seg_count[:segments])
        self.k.keep_segment_rows(self.workspace.final, *segs, self.tails, self.verify_hidden, stream=stream)
        if self.dflash_pending is not None:
            self.k.copy_segments(self.dflash_workspace.features, *segs, self.dflash_pending, stream=stream)

    def stage_draft_steps(self, k: int, lanes: Any, positions: Any, columns: Any, sources: Any = None) -> None:
        """Before `draft_chain` over rows on these `lanes`, in one copy: what its k - 1 MTP steps read but their
        tokens (step s = 1..k-1 of row r runs at rope position positions[r] + s and MTP KV index columns[r] + s),
        and with `sources` the rows of `workspace.final` (the MTP head's output) its rows start from."""
        values = {"row_lane": lanes, "sources": sources}
        for s in range(1, k):
            values[f"step {s - 1} positions"] = np.tile(np.asarray(positions, np.int32) + s, (3, 1))
            values[f"step {s - 1} row_pos"] = np.asarray(columns, np.int32) + s
        self.chain.fill(values)

    def draft_chain(self, current: Any, hidden: Any, k: int, *, full_head: bool = False,
                    gather: bool = False) -> None:
        """k greedy proposals from the drafter rows `current` [n, H] into draft_ids[:k, :n] (the shortlist's rows
        when the model loaded one and not `full_head`), with the k - 1 MTP steps between them (`hidden` [n, H]
        their scratch input, `current` their output). With `gather`, `current` is first gathered from the rows of
        `workspace.final` that `stage_draft_steps` named. Each step's token is copied on the device from the
        proposal before it (a shortlist row through its id table), its lanes and positions from
        `stage_draft_steps`: no host work, so a round's drafts are one graph and one read."""
        n, inputs, device, chain = current.shape[0], self.inputs, self.device, self.chain
        shortlist = self.draft_head is not None and not full_head
        if gather:
            self.k.gather_rows(self.workspace.final, chain.row("sources")[:n], current, stream=device.stream)
        if k > 1:
            device.copy(inputs.row_lane[:n], chain.row("row_lane")[:n])
        for step in range(k):
            proposed = self.propose(current) if shortlist else self.greedy(self.head_logits(current))
            device.copy(self.draft_ids[step, :n], proposed)
            if step == k - 1:
                break
            if shortlist:  # the shortlist row's token id (int32 bits through the fp32 row gather)
                self.k.gather_rows(self.draft_head_id_rows, proposed, inputs.next_ids[:n].view(np.float32)
                                   .reshape(n, 1), stream=device.stream)
            else:
                device.copy(inputs.next_ids[:n], proposed)
            for i, part in enumerate(("positions", "positions 1", "positions 2")):
                device.copy(inputs.positions[i, :n], chain.row(f"step {step} {part}")[:n])
            device.copy(inputs.row_pos[:n], chain.row(f"step {step} row_pos")[:n])
            device.copy(hidden, current)
            device.copy(current, self.mtp_forward(hidden, n))

    def dflash_step(self, block_rows: int, context_rows: int, *, from_pending: bool) -> None:
        """One DFlash drafter call over the rows of `dflash_inputs` (§3.10): block rows 0..block_rows-1 (proposal
        blocks of k+1 rows, anchor first) and context rows after them (committed positions of their lanes, whose
        context features are rows 0..context_rows-1 of `dflash_workspace.features`; with `from_pending` they are
        gathered there first from the lanes' pending rows, through `context_source`). Every layer projects the
        context rows into its cache, then runs the block rows over that context and their own block. Each block
        row's greedy proposal lands in argmax[:block_rows] (mask row i of a block proposes the token at its own
        position; the anchor row's is not used)."""
        w, ws, inputs, d = self.dflash, self.dflash_workspace, self.dflash_inputs, self.dflash.dims
        stream, k, linear, eps = self.device.stream, self.k, self.dflash_linear, d.rms_eps
        rows = block_rows + context_rows
        if context_rows:
            if from_pending:
                pending = self.dflash_pending.reshape(self.capacity.lanes * self.capacity.verify_columns,
                                                      d.feature_width)
                k.gather_rows(pending, inputs.context_source[:context_rows], ws.features[:context_rows],
                              stream=stream)
            linear(ws.features, w.feature_projection, ws.projected, rows=context_rows)
            k.rms_norm_rows(ws.projected[:context_rows], w.context_norm, ws.normed[block_rows:rows], eps=eps,
                            offset=False, stream=stream)
        if block_rows:
            self._embed(inputs.ids[:block_rows], ws.u[:block_rows])
        u, normed = ws.u[:block_rows], ws.normed[:block_rows]
        for index, layer in enumerate(w.layers):
            if block_rows:
                k.rms_norm_rows(u, layer.input_norm, normed, eps=eps, offset=False, stream=stream)
            linear(ws.normed, layer.query_key_value, ws.qkv, rows=rows)
            paged = index in self.dflash_kv  # the full layer; a sliding layer keeps its rings
            cache = self.dflash_kv[index] if paged else self.dflash_rings[index]
            k.dflash_heads(ws.qkv[:rows], layer.query_norm, layer.key_norm, w.inv_freq, inputs.positions[:rows],
                           inputs.row_lane[:rows], inputs.ring_slot[:rows], self.inputs.page_tables, cache.k, cache.v,
                           ws.q, ws.k_block, ws.v_block, block_rows=block_rows, paged=paged, heads=d.attn_heads,
                           kv_heads=d.kv_heads, head_dim=d.head_dim, eps=eps, stream=stream)
            if not block_rows:
                continue
            k.dflash_attention(ws.q[:block_rows], ws.k_block[:block_rows], ws.v_block[:block_rows],
                               inputs.positions[:block_rows], inputs.row_lane[:block_rows], self.inputs.page_tables,
                               cache.k, cache.v, ws.partials, ws.attended[:block_rows],
                               block_width=self.capacity.verify_columns, window=layer.window, paged=paged,
                               heads=d.attn_heads, kv_heads=d.kv_heads, head_dim=d.head_dim, stream=stream)
            linear(ws.attended, layer.output, ws.u, rows=block_rows, accumulate=True)
            k.rms_norm_rows(u, layer.post_attention_norm, normed, eps=eps, offset=False, stream=stream)
            linear(ws.normed, layer.mlp.gate_up, ws.gate_up, rows=block_rows)
            k.silu_mul_rows(ws.gate_up[:block_rows], ws.act[:block_rows], stream=stream)
            linear(ws.act, layer.mlp.down, ws.u, rows=block_rows, accumulate=True)
        if block_rows:
            # The target's final-norm rows are free until the verify that follows: the head reads them from there.
            final = self.workspace.final
            k.rms_norm_rows(u, w.final_norm, final[:block_rows], eps=eps, offset=False, stream=stream)
            self.propose(final, block_rows)

    def _replace_rows(self, out: Any, embeddings: tuple[np.ndarray, np.ndarray] | None) -> None:
        """out[columns[i]] = rows[i], one host-to-device copy per run of consecutive columns (an image's columns
        are one run)."""
        if embeddings is None or not len(embeddings[0]):
            return
        columns, values = np.asarray(embeddings[0], np.int64), np.asarray(embeddings[1], np.float32)
        if values.shape != (len(columns), self.dims.hidden) or columns[0] < 0 or columns[-1] >= out.shape[0]:
            raise ValueError(f"embedding rows {values.shape} at columns {columns[0]}..{columns[-1]} do not fit "
                             f"{out.shape[0]} rows of width {self.dims.hidden}")
        for index, column, count in _runs(columns):
            self.device.write(out[column : column + count], values[index : index + count])

    def _embed(self, ids: Any, out: Any) -> None:
        if self.embedding.dtype == np.uint16:
            self.k.embed_rows(self.embedding, ids, out, stream=self.device.stream)
        else:
            self.k.gather_rows(self.embedding, ids, out, stream=self.device.stream)

    def head_logits(self, hidden: Any, rows: int | None = None) -> Any:
        """Logits of hidden[:rows] (all of `hidden` without `rows`; with it, `hidden` is a whole buffer such as
        workspace.final, which lets cuBLAS pad to its fixed shape) into logits[:rows]."""
        rows = hidden.shape[0] if rows is None else rows
        self.linear(hidden, self.head, self.logits, rows=rows)
        return self.logits[:rows]

    def candidates(self, logits: Any) -> None:
        """The TOP_K_CAP best penalised candidates of each row (row r of lane row_lane[r], penalties presence[r] and
        frequency[r]) into candidate_ids / candidate_values: §4.8 steps 2-3 on the device."""
        rows = logits.shape[0]
        self.k.top_candidates_rows(logits, self.dims.vocab_ids, self.penalty_counts, self.inputs.row_lane[:rows],
                                   self.presence[:rows], self.frequency[:rows], self.candidate_ids[:rows],
                                   self.candidate_values[:rows], stream=self.device.stream,
                                   scratch=self.sampling_scratch)

    def count_generated(self, lanes: list[int], tokens: list[int]) -> None:
        """Step 8 on the device: these generated tokens now count toward their lanes' penalties."""
        n = len(tokens)
        if not n:
            return
        self.device.write(self.count_lanes[:n], np.asarray(lanes, np.int32))
        self.device.write(self.count_ids[:n], np.asarray(tokens, np.int32))
        self.device.write(self.count_valid[:n], np.ones(n, np.int32))
        self.k.count_tokens(self.penalty_counts, self.count_lanes[:n], self.count_ids[:n], self.count_valid[:n],
                            stream=self.device.stream)

    def greedy(self, logits: Any) -> Any:
        out = self.argmax[: logits.shape[0]]
        self.k.argmax_rows(logits, self.dims.vocab_ids, out, stream=self.device.stream, scratch=self.sampling_scratch)
        return out

    # ---- one decoder layer ----

    def _layer(self, layer: LayerWeights, index: int, rows: int, segments: int, prefill: PrefillSpan | None,
               kv: KvPool | None) -> None:
        ws, stream, d = self.workspace, self.device.stream, self.dims
        x, h = ws.x[:rows], ws.h[:rows]
        projects_ab = layer.attention is None and self._projects_ab(layer.gdn, rows, prefill is not None)
        mixer = ((layer.attention.in_proj,) if layer.attention is not None else (layer.gdn.in_proj,) if projects_ab
                 else (layer.gdn.in_proj, layer.gdn.ab_proj))
        h_bf16 = self.linear.bf16_input(rows, d.hidden, *mixer)
        h_frag = self.linear.fragment_input(rows, *mixer)
        # the recurrence that projects a/b reads the fp32 rows
        self._norm(x, layer.input_norm, h if projects_ab else _fp32_read(h, rows, h_bf16, h_frag), out_bf16=h_bf16,
                   out_fragments=h_frag)
        if layer.attention is not None:
            self._attention(layer.attention, rows, prefill, kv, h_bf16, h_frag)
        else:
            self._gdn(layer, self.gdn[index], rows, segments, h_bf16, h_frag, chunked=prefill is not None,
                      projects_ab=projects_ab)
        ffn = layer.ffn
        consumers = ((ffn.gate_up,) if isinstance(ffn, DenseFfn)
                     else (ffn.router_shared_gate, ffn.shared_gate_up, ffn.routed_gate_up))
        h_bf16 = self.linear.bf16_input(rows, d.hidden, *consumers)
        h_frag = self.linear.fragment_input(rows, *consumers)
        self._norm(x, layer.post_attention_norm, _fp32_read(h, rows, h_bf16, h_frag), out_bf16=h_bf16,
                   out_fragments=h_frag)
        if isinstance(ffn, DenseFfn) and _fused_swiglu(ffn.gate_up, rows):
            self._swiglu_ffn(ffn.gate_up, ffn.down, rows, self.linear, h_frag, ws.gate_up, ws.x, accumulate=True)
        elif isinstance(ffn, DenseFfn):
            gate_up, act = ws.gate_up[:rows], ws.act[:rows]
            self.linear(ws.h, ffn.gate_up, ws.gate_up, rows=rows, x_bf16=h_bf16, x_fragments=h_frag)
            act_bf16 = self.linear.bf16_input(rows, act.shape[1], ffn.down)
            act_frag = self.linear.fragment_input(rows, ffn.down)
            self._silu_mul(gate_up, act, act_bf16, act_frag, stream)
            # a DFlash feature block copies x before the next norm could add pending slices
            self._add_to_residual(ws.act, ffn.down, rows, act_bf16, act_frag,
                                  before_norm=index not in self.feature_blocks)
        else:
            self._moe(ffn, rows, h_bf16, h_frag)

    def _attention(self, w: AttentionWeights, rows: int, prefill: PrefillSpan | None, kv: KvPool,
                   h_bf16: Any, h_frag: Any) -> None:
        ws, stream, d, inputs = self.workspace, self.device.stream, self.dims, self.inputs
        qkgv, q, out = ws.qkgv[:rows], ws.q[:rows], ws.attended[:rows]
        self.linear(ws.h, w.in_proj, ws.qkgv, rows=rows, x_bf16=h_bf16, x_fragments=h_frag)
        self.k.attention_prepare(qkgv, w.query_norm, w.key_norm, self.inv_freq, inputs.positions,
                               inputs.row_lane[:rows], inputs.row_pos[:rows], inputs.page_tables, kv.k, kv.v,
                               kv.k_scale, kv.v_scale, q, heads=d.attn_heads, kv_heads=d.kv_heads,
                               head_dim=d.head_dim, rotary_dim=d.rotary_dim, sections=tuple(d.mrope_section),
                               eps=d.rms_eps, stream=stream)
        out_bf16 = out_frag = None  # the output projection's input as its producer writes it (decode)
        if prefill is None:
            out_bf16 = self.linear.bf16_input(rows, out.shape[1], w.output)
            out_frag = self.linear.fragment_input(rows, w.output)
            self.k.attention_decode(q, qkgv, inputs.page_tables, inputs.row_lane[:rows], inputs.row_pos[:rows], kv.k,
                                  kv.v, kv.k_scale, kv.v_scale, out, ws.partials, heads=d.attn_heads,
                                  kv_heads=d.kv_heads, head_dim=d.head_dim, stream=stream,
                                  min_split_keys=self.attention_min_split_keys, out_bf16=out_bf16,
                                  out_fragments=out_frag, tensor_cores=self.tensor_core_decode)
        else:
            if self.prefill_attention == "flash":  # writes the output projection's bf16 input itself
                out_bf16 = self.linear.bf16_input(rows, out.shape[1], w.output)
            attention = self.prefill_attention

            def attend(span: PrefillSpan) -> None:
                self._prefill_attention(attention, kv, span, rows, out_bf16)

            if self._attention_cut is None:
                attend(prefill)
            else:  # capturing: the span's KV start is known only at each replay
                self._drain_dequantizer()
                self._attention_cut(attend)
        self._add_to_residual(ws.attended, w.output, rows, out_bf16, out_frag)

    def _prefill_attention(self, attention: str, kv: KvPool, prefill: PrefillSpan, rows: int, out_bf16: Any) -> None:
        """A prefill chunk's attention over its lane's KV up to the chunk's last row (the chunk's rows written by
        `attention_prepare`), by `attention`: "gemm", "flash" (the output in bf16 into `out_bf16`) or "kernel". A
        padded chunk's (`prefill.rows` of the `rows`) runs over its real rows, the padded rows' output zeros."""
        ws, d = self.workspace, self.dims
        real = rows if prefill.rows is None else prefill.rows
        if not 0 < real <= rows:
            raise ValueError(f"a prefill span of {prefill.rows} real rows in a chunk of {rows}")
        real_bf16 = None if out_bf16 is None else out_bf16[:real]
        if attention == "gemm":
            self._prefill_attention_gemm(kv, prefill, real)
        elif attention == "flash":
            self._prefill_attention_flash(kv, prefill, real, real_bf16)
        else:
            self.k.attention_prefill(ws.q[:real], ws.qkgv[:real], self.inputs.page_tables, prefill.lane,
                                     prefill.kv_start, real, kv.k, kv.v, kv.k_scale, kv.v_scale, ws.attended[:real],
                                     heads=d.attn_heads, kv_heads=d.kv_heads, head_dim=d.head_dim,
                                     stream=self.device.stream)
        if real < rows:  # whichever the output projection reads
            self.device.clear(ws.attended[real:rows])
            if out_bf16 is not None:
                self.device.clear(out_bf16[real:rows])

    def _drain_dequantizer(self) -> None:
        """The serving stream waits for every dequantization queued ahead (a captured piece must end joined)."""
        if self.linear.dequantizer is not None:
            self.linear.dequantizer.drain()

    def _prefill_attention_gemm(self, kv: KvPool, prefill: PrefillSpan, rows: int) -> None:
        """Prefill attention on the tensor cores (`attention_gemm`): K/V of the lane gathered once into contiguous
        bf16, then per block of queries two strided-batched cuBLAS GEMMs around a causal softmax. A block holds as
        many queries as the score scratch allows at the block's key count."""
        ws, stream, d, k = self.workspace, self.device.stream, self.dims, self.k
        if ws.gemm_scores is None:
            raise ValueError("tensor-core prefill attention needs the model built with Capacity.tensor_core_attention")
        heads, kv_heads, head_dim = d.attn_heads, d.kv_heads, d.head_dim
        group, length = heads // kv_heads, prefill.kv_start + rows
        keys_bf16 = ws.gemm_keys[: kv_heads * length * head_dim].reshape(kv_heads, length, head_dim)
        values_bf16 = ws.gemm_values[: kv_heads * length * head_dim].reshape(kv_heads, length, head_dim)
        k.gather_kv(self.inputs.page_tables, prefill.lane, length, kv.k, kv.k_scale, keys_bf16, stream=stream)
        k.gather_kv(self.inputs.page_tables, prefill.lane, length, kv.v, kv.v_scale, values_bf16, stream=stream)
        block = max(1, min(rows, ws.gemm_scores.size // (heads * length)))
        blas, q, qkgv, out = self.linear.blas, ws.q[:rows], ws.qkgv[:rows], ws.attended[:rows]
        for first in range(0, rows, block):
            count = min(block, rows - first)
            keys, m = prefill.kv_start + first + count, group * count  # the block's last query sees `keys` keys
            packed = ws.gemm_queries[: kv_heads * m * head_dim].reshape(kv_heads, m, head_dim)
            k.pack_queries(q, packed, first=first, rows=count, group=group, scale=1.0 / np.sqrt(head_dim),
                           stream=stream)
            scores = ws.gemm_scores[: kv_heads * m * keys].reshape(kv_heads, m, keys)
            blas.batched_scores(packed, keys_bf16, keys, scores)
            probs = ws.gemm_probs[: kv_heads * m * keys].reshape(kv_heads, m, keys)
            k.causal_softmax(scores, probs, rows=count, first_position=prefill.kv_start + first, stream=stream)
            attended = ws.gemm_out[: kv_heads * m * head_dim].reshape(kv_heads, m, head_dim)
            blas.batched_values(probs, values_bf16, keys, attended)
            k.unpack_gated(attended, qkgv, out, first=first, rows=count, group=group, stream=stream)

    def _prefill_attention_flash(self, kv: KvPool, prefill: PrefillSpan, rows: int, out_bf16: Any) -> None:
        """Prefill attention in one tensor-core kernel (`attention_flash`): K and V^T of the lane gathered once into
        contiguous bf16, every query packed, then scores, softmax, P V and the gate on chip; the output in bf16 into
        `out_bf16` where the projection reads that (then alone past SKINNY_ROWS), else in fp32."""
        ws, stream, d, k = self.workspace, self.device.stream, self.dims, self.k
        if ws.gemm_keys is None:
            raise ValueError("flash prefill attention needs the model built with Capacity.tensor_core_attention")
        kv_heads, head_dim = d.kv_heads, d.head_dim
        group, length = d.attn_heads // kv_heads, prefill.kv_start + rows
        stride = align_up(length, 8)
        keys_bf16 = ws.gemm_keys[: kv_heads * length * head_dim].reshape(kv_heads, length, head_dim)
        values_t = ws.gemm_values[: kv_heads * head_dim * stride].reshape(kv_heads, head_dim, stride)
        k.gather_kv(self.inputs.page_tables, prefill.lane, length, kv.k, kv.k_scale, keys_bf16, stream=stream)
        k.gather_kv(self.inputs.page_tables, prefill.lane, length, kv.v, kv.v_scale, values_t, stream=stream,
                    transposed=True)
        packed = ws.gemm_queries[: kv_heads * group * rows * head_dim].reshape(kv_heads, group * rows, head_dim)
        k.pack_queries(ws.q[:rows], packed, first=0, rows=rows, group=group, scale=1.0 / np.sqrt(head_dim),
                       stream=stream)
        out = _fp32_read(ws.attended[:rows], rows, out_bf16, None)
        k.flash_prefill(packed, keys_bf16, values_t, ws.qkgv[:rows], out, rows=rows, first_position=prefill.kv_start,
                        length=length, group=group, stream=stream, out_bf16=out_bf16)

    def _gdn(self, layer: LayerWeights, state: GdnLayerState, rows: int, segments: int, h_bf16: Any,
             h_frag: Any, *, chunked: bool, projects_ab: bool) -> None:
        """`chunked`: a prefill chunk of one lane (no per-row states recorded); past SKINNY_ROWS rows its gated delta
        rule runs in chunks on the tensor cores (`gdn_chunked`, TF32 products) instead of row by row.
        `projects_ab`: the recurrence computes the a/b projection from the fp32 normed rows (`_projects_ab`, decided
        once a layer by `_layer`, whose norm then writes those rows)."""
        ws, stream, d, inputs, w = self.workspace, self.device.stream, self.dims, self.inputs, layer.gdn
        projected, ab, mixed = ws.projected[:rows], ws.ab[:rows], ws.mixed[:rows]
        side = self._side(rows) if not isinstance(w.ab_proj, SplitMatrix) and not projects_ab else None
        if side is not None:  # a/b beside in_proj and the conv (bf16: it converts h into its own scratch)
            side.fork()
            side_linear = self.linear.beside(side, self._side_scratch)
            side.run(lambda: side_linear(ws.h, w.ab_proj, ws.ab, rows=rows, x_fragments=h_frag))
        seg = (inputs.seg_lane[:segments], inputs.seg_row[:segments], inputs.seg_count[:segments],
               inputs.seg_record[:segments])
        in_chunks = chunked and rows > SKINNY_ROWS
        # the conv in the in-projection's launch (decode rows on the tensor cores: `Linear.convolves`)
        fused_conv = not in_chunks and self.conv_in_projection and self.linear.convolves(w.in_proj, rows)
        if fused_conv:
            self.linear.linear_conv(ws.h, w.in_proj, ws.projected, (w.conv, state.conv, state.conv_columns, *seg),
                                    ws.mixed, rows=rows, channels=d.gdn_conv_channels, x_fragments=h_frag)
        else:
            self.linear(ws.h, w.in_proj, ws.projected, rows=rows, x_bf16=h_bf16, x_fragments=h_frag)
        if side is None and not projects_ab:
            self.linear(ws.h, w.ab_proj, ws.ab, rows=rows, x_bf16=h_bf16, x_fragments=h_frag)
        # in chunks, the conv normalises q and k itself where a warp holds a head (`gdn_conv_normed`)
        normed_conv = in_chunks and conv_normed_fits(projected, w.conv, state.conv, state.conv_columns, mixed,
                                                     channels=d.gdn_conv_channels, k_dim=d.gdn_k_dim)
        if normed_conv:
            self.k.gdn_conv_normed(projected, w.conv, state.conv, state.conv_columns, *seg, mixed, ws.gdn_q[:rows],
                                   ws.gdn_k[:rows], channels=d.gdn_conv_channels, qk_heads=d.gdn_qk_heads,
                                   k_dim=d.gdn_k_dim, stream=stream)
        elif not fused_conv:
            self.k.gdn_conv(projected, w.conv, state.conv, state.conv_columns, *seg, mixed,
                            channels=d.gdn_conv_channels, stream=stream)
        if side is not None:
            side.join()
        out = ws.gdn_out[:rows]
        heads = dict(qk_heads=d.gdn_qk_heads, v_heads=d.gdn_v_heads, k_dim=d.gdn_k_dim, v_dim=d.gdn_v_dim,
                     channels_qk=2 * d.gdn_qk_width, stream=stream)
        if in_chunks:
            q, k, log_decay, beta = ws.gdn_q[:rows], ws.gdn_k[:rows], ws.log_decay[:rows], ws.beta[:rows]
            self.k.gdn_gates(mixed, ab, w.neg_a, w.dt_bias, q, k, log_decay, beta, qk_heads=d.gdn_qk_heads,
                             v_heads=d.gdn_v_heads, k_dim=d.gdn_k_dim, stream=stream, tf32=True,
                             norms=not normed_conv)
            self.k.gdn_chunked(q, k, mixed, log_decay, beta, state.ssm, *seg[:3], out, ws.gdn_cum, ws.gdn_mats,
                               rows=rows, multiprocessors=self.multiprocessors, **heads)
        elif projects_ab:  # the a/b projection and the gates inside the recurrence
            self.k.gdn_recurrent_projected(mixed, ws.h[:rows], w.ab_proj.data, w.neg_a, w.dt_bias, state.ssm,
                                           state.ssm_columns, *seg, out, programmatic=self.linear.programmatic,
                                           groups=self.recurrence_groups, **heads)
        else:  # the gates computed inside the recurrence (one launch fewer, the same bits)
            self.k.gdn_recurrent_gated(mixed, ab, w.neg_a, w.dt_bias, state.ssm, state.ssm_columns, *seg, out,
                                       programmatic=self.linear.programmatic, groups=self.recurrence_groups,
                                       **heads)
        normed = ws.gdn_normed[:rows]
        normed_bf16 = self.linear.bf16_input(rows, normed.shape[1], layer.gdn_output)
        normed_frag = self.linear.fragment_input(rows, layer.gdn_output)
        result = None if reads_bf16_alone(normed_bf16, normed_frag) else normed
        self.k.gdn_output(out, projected, w.norm, result, v_heads=d.gdn_v_heads, v_dim=d.gdn_v_dim,
                          z_offset=d.gdn_conv_channels, eps=d.rms_eps, stream=stream, result_bf16=normed_bf16,
                          result_fragments=normed_frag)
        self._add_to_residual(ws.gdn_normed, layer.gdn_output, rows, normed_bf16, normed_frag)

    def _moe(self, w: MoeFfn, rows: int, h_bf16: Any, h_frag: Any) -> None:
        ws, stream, d = self.workspace, self.device.stream, self.dims
        h, x = ws.h[:rows], ws.x[:rows]
        e = d.moe_experts
        router_logits = ws.router_logits[:rows]
        side = self._side(rows)
        if side is not None:  # the shared expert beside the router and the routed experts
            side.fork()
            side_linear = self.linear.beside(side, self._side_scratch)
            side.run(lambda: self._shared_expert(w, rows, side_linear, side.stream, None, h_frag))
        ids, weights = ws.expert_ids[:rows], ws.expert_weights[:rows]
        if rows <= FUSED_ROUTE_ROWS and self.linear.reads_narrow(w.router_shared_gate, rows):  # one launch
            self.k.linear_bf16_narrow_route(h, w.router_shared_gate.data, router_logits, ws.route_counter,
                                            d.moe_top_k, ids, weights, stream=stream, experts=e)
        else:
            self.linear(ws.h, w.router_shared_gate, ws.router_logits, rows=rows, x_bf16=h_bf16, x_fragments=h_frag)
            self.k.route_top_k(router_logits, d.moe_top_k, ids, weights, stream=stream, experts=e,
                               programmatic=self.linear.programmatic)
        inter = d.moe_intermediate
        fused_swiglu = _fused_swiglu(w.routed_gate_up, rows)
        grouped = not fused_swiglu and rows > SKINNY_ROWS
        shared_out = ws.shared_out[:rows]
        gate_logit = router_logits[:, e:e + 1]
        # the grouped path's routed combine also adds the gated shared expert when this stream computed it (in the
        # same pass over the residual), not when a side stream did (it joins after the combine)
        gated_in_combine = grouped and side is None
        if grouped:  # the shared expert (when no side stream takes it) runs while the group sizes travel
            shared = None if side is not None else (
                lambda: self._shared_expert(w, rows, self.linear, stream, h_bf16, h_frag))
            self._moe_grouped(w, rows, h_bf16, beside_the_read=shared,
                              shared_gate=(shared_out, gate_logit) if gated_in_combine else None)
        elif fused_swiglu:
            self._swiglu_experts(w, rows, h_frag)
        else:
            gate_up, act, out = ws.slot_gate_up[:rows], ws.slot_act[:rows], ws.slot_out[:rows]
            self._gathered(h, w.routed_gate_up, ids, gate_up, rows_per_expert=2 * inter, x_per_slot=False,
                           x_fragments=h_frag)
            if isinstance(w.routed_down, Bf16Matrix):  # silu(gate) * up staged by the down GEMV: a launch fewer
                # launched programmatically it reads the ids before its wait: safe only behind the bf16 gate | up
                # GEMV, which lets it start after its own wait (the tensor-core one lets the next start before)
                self.k.linear_bf16_gathered_swiglu(gate_up, w.routed_down.data, ids, out, rows_per_expert=d.hidden,
                                                   stream=stream, programmatic=self.linear.programmatic
                                                   and isinstance(w.routed_gate_up, Bf16Matrix))
            else:
                act_frag = (ws.slot_x_fragments if rows <= MMA_ROWS and _tensor_core(w.routed_down) else None)
                self.k.silu_mul_slots(gate_up, act, stream=stream, out_fragments=act_frag)
                self._gathered(act, w.routed_down, ids, out, rows_per_expert=d.hidden, x_per_slot=True,
                               x_fragments=act_frag)
        if side is not None:
            side.join()
        elif not grouped:
            self._shared_expert(w, rows, self.linear, stream, h_bf16, h_frag)
        if rows <= SKINNY_ROWS and d.moe_top_k <= COMBINE_NORM_SLOTS:
            # the routed experts' weighted sum and the gated shared expert, in the launch of the norm that reads x
            # next (`_norm`)
            self._pending_combine = (ws.slot_out[:rows], weights, shared_out, gate_logit)
        elif rows <= SKINNY_ROWS:  # the same in one launch of its own
            self.k.moe_combine(ws.slot_out[:rows], weights, x, stream=stream, shared_out=shared_out,
                               gate_logit=gate_logit)
        elif not gated_in_combine:
            self.k.sigmoid_gate_add(x, shared_out, gate_logit, stream=stream)

    def _add_to_residual(self, x_in: Any, w: Matrix, rows: int, x_bf16: Any, x_fragments: Any, *,
                         before_norm: bool = True) -> None:
        """ws.x[:rows] += x_in[:rows] @ W^T. Where Capacity.split_k_norm takes w (`Linear.splits_k`) and a norm
        reads x next (`before_norm`), the product's K slices are left pending for that norm's launch (`_norm`);
        otherwise one accumulating call."""
        if before_norm and self.linear.splits_k(w, rows, self.split_k_norm):
            self._pending_partials = self.linear.split_k(x_in, w, self.workspace.residual_partials, rows, x_bf16,
                                                         self.split_k_norm)
            return
        self.linear(x_in, w, self.workspace.x, rows=rows, accumulate=True, x_bf16=x_bf16, x_fragments=x_fragments)

    def set_split_k_norm(self, slices: int) -> None:
        """Capacity.split_k_norm, switchable between steps from 0 up to the slices the model was built with (its
        partials buffer)."""
        built = self.capacity.split_k_norm
        check_split_k_norm(slices)
        if slices > built:
            raise ValueError(f"split_k_norm switches between 0 and the {built} slices built for, got {slices}")
        self.split_k_norm = slices

    def set_conv_in_projection(self, on: bool) -> None:
        """Capacity.conv_in_projection, switchable between steps like the branches."""
        self.conv_in_projection = on

    def set_recurrence_groups(self, groups: int) -> None:
        """Capacity.recurrence_groups, switchable between steps (the bench's comparison; a deployment keeps one)."""
        check_recurrence_groups(groups)
        self.recurrence_groups = groups

    def set_ab_in_recurrence(self, on: bool | None) -> None:
        """Capacity.ab_in_recurrence, switchable between steps like the branches."""
        self.ab_in_recurrence = on

    def _projects_ab(self, w: Any, rows: int, chunked: bool) -> bool:
        """Whether a Gated DeltaNet layer's recurrence computes its a/b projection (`Capacity.ab_in_recurrence`;
        None: where the in-projection is a tensor-core quantized matrix): rows that take the recurrence (not the
        chunked rule) and a bf16 projection."""
        on = (all(_tensor_core(part) for part in _row_blocks(w.in_proj)) if self.ab_in_recurrence is None
              else self.ab_in_recurrence)
        return on and isinstance(w.ab_proj, Bf16Matrix) and not (chunked and rows > SKINNY_ROWS)

    def _norm(self, x: Any, weight: Any, out: Any, *, out_bf16: Any = None, out_fragments: Any = None) -> None:
        """out = rms_norm(x, weight) (offset), as `rms_norm_rows` writes it; a decode MoE combine left pending by
        `_moe`, or a residual projection's K slices left by `_add_to_residual`, go into x in the same launch first
        (x is their residual)."""
        d, stream, pending, partials = self.dims, self.device.stream, self._pending_combine, self._pending_partials
        self._pending_combine = self._pending_partials = None
        if partials is not None:
            self.k.add_slices_rms_norm_rows(partials, x, weight, out, eps=d.rms_eps, offset=True, stream=stream,
                                            out_bf16=out_bf16, out_fragments=out_fragments)
            return
        if pending is None:
            self.k.rms_norm_rows(x, weight, out, eps=d.rms_eps, offset=True, stream=stream, out_bf16=out_bf16,
                                 out_fragments=out_fragments)
            return
        expert_out, weights, shared_out, gate_logit = pending
        self.k.moe_combine_rms_norm(expert_out, weights, x, shared_out, gate_logit, weight, out, eps=d.rms_eps,
                                    offset=True, stream=stream, out_bf16=out_bf16, out_fragments=out_fragments)

    def _flush_combine(self) -> None:
        """Launch a pending decode MoE combine on its own (something other than a norm reads x next)."""
        pending, self._pending_combine = self._pending_combine, None
        if pending is not None:
            expert_out, weights, shared_out, gate_logit = pending
            self.k.moe_combine(expert_out, weights, self.workspace.x[:expert_out.shape[0]], stream=self.device.stream,
                               shared_out=shared_out, gate_logit=gate_logit)

    def _shared_expert(self, w: MoeFfn, rows: int, linear: Linear, stream: Any, h_bf16: Any, h_frag: Any) -> None:
        """shared_out = down(silu(gate h) * up h), through `linear` on `stream` (the serving stream's, or the side
        stream's: then h_bf16 is None and it converts h into its own scratch)."""
        ws = self.workspace
        if _fused_swiglu(w.shared_gate_up, rows):
            self._swiglu_ffn(w.shared_gate_up, w.shared_down, rows, linear, h_frag, ws.shared_gate_up, ws.shared_out,
                             accumulate=False)
            return
        shared_gate_up, shared_act = ws.shared_gate_up[:rows], ws.shared_act[:rows]
        linear(ws.h, w.shared_gate_up, ws.shared_gate_up, rows=rows, x_bf16=h_bf16, x_fragments=h_frag)
        act_bf16 = linear.bf16_input(rows, shared_act.shape[1], w.shared_down)
        act_frag = linear.fragment_input(rows, w.shared_down)
        self._silu_mul(shared_gate_up, shared_act, act_bf16, act_frag, stream)
        linear(ws.shared_act, w.shared_down, ws.shared_out, rows=rows, x_bf16=act_bf16, x_fragments=act_frag)

    def _swiglu_ffn(self, gate_up: Any, down: Any, rows: int, linear: Linear, h_frag: Any, shape_of: Any, out: Any, *,
                    accumulate: bool) -> None:
        """out[:rows] (+)= down(silu(gate h) * up h) for a gate|up stored for the fused epilogue: per launch of up to
        `linear.mma_launch_rows` rows, the gate|up GEMV writes the activation's x fragments (ws.act_fragments) and
        the down GEMV reads them. `h_frag`: h's fragments when its producer wrote them (at most 8 rows), else each
        launch converts its rows of h; `shape_of`: the gate|up output buffer (its shape only)."""
        ws, k, launch = self.workspace, self.k, linear.mma_launch_rows
        for first in range(0, rows, launch):
            last = min(rows, first + launch)
            xf = h_frag if h_frag is not None and rows <= launch else linear.fragments_of(ws.h[first:last])
            k.linear_quant_mma_swiglu(xf, gate_up, shape_of[first:last], ws.act_fragments, stream=linear.stream,
                                      programmatic=linear.programmatic)
            linear(ws.h[first:last], down, out[first:last], accumulate=accumulate, x_fragments=ws.act_fragments)

    def _swiglu_experts(self, w: MoeFfn, rows: int, h_frag: Any) -> None:
        """The routed experts' slot outputs for gate|up stored for the fused epilogue: per 8 rows, the gathered
        gate|up GEMV writes every slot's activation fragments (ws.slot_x_fragments), the gathered down GEMV reads
        them."""
        ws, k, d, stream = self.workspace, self.k, self.dims, self.device.stream
        ids = ws.expert_ids[:rows]
        for first in range(0, rows, MMA_ROWS):
            last = min(rows, first + MMA_ROWS)
            xf = h_frag if h_frag is not None and rows <= MMA_ROWS else self.linear.fragments_of(ws.h[first:last])
            k.linear_quant_mma_gathered_swiglu(xf, w.routed_gate_up, ids[first:last], ws.slot_gate_up[first:last],
                                               ws.slot_x_fragments, rows_per_expert=2 * d.moe_intermediate,
                                               stream=stream, programmatic=self.linear.programmatic)
            k.linear_quant_mma_gathered(ws.slot_x_fragments, w.routed_down, ids[first:last], ws.slot_out[first:last],
                                        rows_per_expert=d.hidden, x_per_slot=True, stream=stream,
                                        programmatic=self.linear.programmatic)

    def _silu_mul(self, gate_up: Any, act: Any, act_bf16: Any, act_frag: Any, stream: Any) -> None:
        """act = silu(gate) * up for a down projection, in the forms it reads: when it reads the bf16 copy alone
        (`reads_bf16_alone`), that copy from one kernel that writes no fp32 (the same bits as the fp32 path's copy)."""
        if reads_bf16_alone(act_bf16, act_frag) and act.shape[1] % self.k.SILU_QUADS == 0:
            self.k.silu_mul_to_bf16_rows(gate_up, act_bf16, stream=stream)
        else:
            self.k.silu_mul_rows(gate_up, act, stream=stream, out_bf16=act_bf16, out_fragments=act_frag)

    def _gathered(self, x: Any, w: Matrix, ids: Any, y: Any, *, rows_per_expert: int, x_per_slot: bool,
                  x_fragments: Any = None) -> None:
        """MoE decode: y[m, s] = X(m, s) @ W_e^T, e = ids[m, s], for a stacked expert matrix in its stored layout;
        X(m, s) = x[m], or x[m, s] with x_per_slot. The tensor-core kernel takes x as fragments, 8 rows a launch;
        `x_fragments` are those of x written by its producer (at most 8 rows)."""
        k, stream = self.k, self.device.stream
        if _tensor_core(w):
            if x_fragments is not None and x.shape[0] <= MMA_ROWS:  # the producer of x wrote them
                k.linear_quant_mma_gathered(x_fragments, w, ids, y, rows_per_expert=rows_per_expert,
                                            x_per_slot=x_per_slot, stream=stream,
                                            programmatic=self.linear.programmatic)
                return
            fragments, xf = ((k.x_slot_fragments, self.workspace.slot_x_fragments) if x_per_slot
                             else (k.x_fragments, self.workspace.x_fragments))
            for first in range(0, x.shape[0], MMA_ROWS):  # each row's result is independent of its neighbours
                last = min(x.shape[0], first + MMA_ROWS)
                fragments(x[first:last], xf, stream=stream)
                k.linear_quant_mma_gathered(xf, w, ids[first:last], y[first:last], rows_per_expert=rows_per_expert,
                                            x_per_slot=x_per_slot, stream=stream,
                                            programmatic=self.linear.programmatic)
        elif is_quantized(w):
            k.linear_quant_gathered(x, w, ids, y, rows_per_expert=rows_per_expert, x_per_slot=x_per_slot,
                                    stream=stream)
        else:
            k.linear_bf16_gathered(x, w.data, ids, y, rows_per_expert=rows_per_expert, x_per_slot=x_per_slot,
                                   stream=stream, programmatic=self.linear.programmatic)

    def _moe_grouped(self, w: MoeFfn, rows: int, h_bf16: Any, *, beside_the_read: Callable[[], None] | None,
                     shared_gate: tuple[Any, Any] | None = None) -> None:
        """Prefill MoE: tokens grouped by expert, every expert that has tokens in one cuBLAS call per projection,
        bf16 outputs (not captured: cuBLAS takes the group sizes from the host). The call is the grouped GEMM on the
        contiguous groups, a strided-batched GEMM over the experts padded to the largest count, or a pointer-array
        batched GEMM over chunks of `moe_chunk_rows` rows: `moe_layout` picks one on the device by
        `moe_prefill_gemm`'s rule and places the rows, so the rows' gather, `beside_the_read` (work that needs no
        group size: the shared expert) and a quantized gate_up's dequantization queue after the sizes' copy and
        before the host waits for it. The GPU runs them while the sizes travel and the host sets up the GEMMs,
        instead of idling through both (~24 ms of the 35B-A3B's 212 ms 8K prefill idled so, most of it here).
        With `moe_sync_free` the host reads nothing: the chunked layout at its most chunks for the rows.
        `shared_gate` (the shared expert's output rows and gate logits) joins the routed combine's pass. The rows'
        gather reads the norm's bf16 copy `h_bf16` where there is one (the norm then skips the fp32 rows)."""
        ws, stream = self.workspace, self.device.stream
        s, e = self.dims.moe_top_k, self.dims.moe_experts
        if self.moe_prefill_gemm not in LAYOUT_CODES:
            raise ValueError(f"moe_prefill_gemm must be one of {sorted(LAYOUT_CODES)}, got {self.moe_prefill_gemm!r}")
        ids, weights = ws.expert_ids[:rows], ws.expert_weights[:rows]
        slot_of = ws.moe_slot_of[: rows * s]
        position_of = ws.moe_position_of[: rows * s]
        placed = ws.moe_padded_position_of[: rows * s]
        self.k.moe_group(ids, ws.moe_counts, ws.moe_offsets, slot_of, experts=e, position_of=position_of,
                         block_counts=ws.moe_block_counts, stream=stream)
        sync_free = self._moe_sync_free(rows)
        chunk, room = self.moe_sync_free_chunk_rows if sync_free else self.moe_chunk_rows, ws.perm_in.shape[0]
        direct = self._direct_experts(w, chunk)
        bound = self._moe_chunk_bound(rows, chunk)
        self.k.moe_layout(ws.moe_offsets, ws.moe_sizes[e + 1:], ws.moe_starts,
                          choice="chunked" if sync_free or direct else self.moe_prefill_gemm, chunk=chunk, room=room,
                          max_chunks=MAX_CHUNKS, stream=stream)
        self.k.moe_chunk_groups(ws.moe_sizes[e + 1:], ws.moe_offsets, ws.moe_starts, ws.moe_chunk_groups,
                                chunk=chunk, step=bound if sync_free else self.moe_chunk_step,
                                room=bound * chunk if sync_free else room, stream=stream)
        pending = None if sync_free else self.device.start_read(ws.moe_sizes)
        self.k.moe_pad_positions(ids, position_of, ws.moe_offsets, ws.moe_starts, placed, stream=stream)
        self.k.moe_gather(ws.h[:rows] if h_bf16 is None else h_bf16, slot_of, s, ws.perm_in, stream=stream,
                          position_of=placed)
        if beside_the_read is not None:
            beside_the_read()
        gate_up_w = None if direct else self.linear.bf16_weight(w.routed_gate_up)
        if sync_free:
            offsets, layout, stepped = None, LAYOUT_CHUNKED, bound
        else:
            sizes = pending.values()
            offsets, (layout, count, extent) = sizes[: e + 1], (int(v) for v in sizes[e + 1:])
            if layout == LAYOUT_CHUNKED:  # the chunks' experts are on the device already (moe_chunk_groups)
                stepped = stepped_chunks(extent, self.moe_chunk_step, room, chunk)
        # rows the expert GEMMs run over: the layout's, or its chunks' rounded up
        gemm_rows = stepped * chunk if layout == LAYOUT_CHUNKED else count
        if direct and layout == LAYOUT_CHUNKED:
            self._direct_expert_gemms(w, chunk, stepped)
        else:
            if gate_up_w is None:  # the direct path's layout fell back from chunked (its rows did not fit)
                gate_up_w = self.linear.bf16_weight(w.routed_gate_up)

            def expert_gemm(x: Any, weight: Any, y: Any) -> None:
                """x, y: whole workspace buffers. Only the padded call needs views of the count's rows: numba builds
                a view in ~50 us of host time, and this first call is what the GPU waits for once the counts
                arrive."""
                if layout == LAYOUT_PADDED:
                    self.linear.blas.batched_gemm_bf16(x[:count], weight, y[:count], e)
                elif layout == LAYOUT_CHUNKED:
                    self.linear.blas.chunked_gemm_bf16(x, weight, y, ws.moe_chunk_groups, chunk, chunks=stepped)
                else:
                    self.linear.blas.grouped_gemm_bf16(x, weight, y, offsets, y.shape[1])

            expert_gemm(ws.perm_in, gate_up_w, ws.perm_gate_up)
            # (the surplus rows past the routed ones are never read; with a chunk step the counts, and so these
            # views, recur, and the workspace's memo hands them back)
            self.k.silu_mul_bf16_rows(ws.perm_gate_up[:gemm_rows], ws.perm_act_bf16[:gemm_rows], stream=stream)
            expert_gemm(ws.perm_act_bf16, self.linear.bf16_weight(w.routed_down), ws.perm_out)
        shared_out, gate_logit = shared_gate or (None, None)
        self.k.moe_scatter_combine(ws.perm_out[:gemm_rows], slot_of, weights, s, ws.x[:rows], position_of=placed,
                                   stream=stream, shared_out=shared_out, gate_logit=gate_logit)

    def _direct_expert_gemms(self, w: MoeFfn, chunk: int, chunks: int) -> None:
        """The routed experts over the chunked layout straight from their codes (`direct_quant_experts`): the
        gate|up writes the activation rows, the down the output rows."""
        ws, inter, stream = self.workspace, self.dims.moe_intermediate, self.device.stream
        maps = (ws.moe_chunk_groups, ws.moe_offsets, ws.moe_starts)
        self.k.linear_quant_mma_chunked(ws.perm_in, w.routed_gate_up, *maps, ws.perm_act_bf16,
                                        rows_per_expert=2 * inter, chunk=chunk, chunks=chunks, swiglu=True,
                                        stream=stream)
        self.k.linear_quant_mma_chunked(ws.perm_act_bf16, w.routed_down, *maps, ws.perm_out,
                                        rows_per_expert=self.dims.hidden, chunk=chunk, chunks=chunks, swiglu=False,
                                        stream=stream)

    def _direct_experts(self, w: MoeFfn, chunk: int) -> bool:
        """Whether this chunk's routed experts multiply from their codes (`direct_quant_experts`): they can
        (`_direct_capable`) and the layout's chunks are whole 32-row pieces."""
        return self.direct_quant_experts and self._direct_capable(w) and chunk % QUANT_CHUNK_ROWS == 0

    def _direct_capable(self, w: MoeFfn) -> bool:
        """Both routed matrices in the tensor-core layout, the gate|up stored for the SwiGLU output."""
        gate_up, down = w.routed_gate_up, w.routed_down
        return (_tensor_core(gate_up) and _tensor_core(down)
                and getattr(gate_up, "swiglu_rows", 0) == 2 * self.dims.moe_intermediate)

    def _moe_chunk_bound(self, rows: int, chunk: int) -> int:
        """The chunked layout's most chunks for `rows` rows: every expert's rows rounded up to whole chunks come to
        at most (R S + E (chunk - 1)) / chunk (the sync-free layout takes that many; the map's surplus entries fill
        the rest)."""
        return (rows * self.dims.moe_top_k + self.dims.moe_experts * (chunk - 1)) // chunk

    def _moe_sync_free(self, rows: int) -> bool:
        """Whether a grouped MoE prefill of `rows` rows sizes its expert GEMMs without reading the counts back
        (`moe_sync_free`), which it can where the sync-free layout's most chunks fit the permuted scratch."""
        wanted = rows <= MOE_SYNC_FREE_ROWS if self.moe_sync_free is None else self.moe_sync_free
        chunk = self.moe_sync_free_chunk_rows
        bound = self._moe_chunk_bound(rows, chunk)
        return wanted and bound * chunk <= self.workspace.perm_in.shape[0] and bound <= MAX_CHUNKS

    # ---- state operations ----

    def reset_lane(self, lane: int) -> None:
        """Zero the lane's running recurrent state and tail (a sequence that starts at token 0)."""
        for state in self.gdn.values():
            self.device.clear(state.conv[lane])
            self.device.clear(state.ssm[lane])
        self.device.clear(self.tails[lane])

    def stage_selection(self, lanes: list[int], columns: list[int], states: list[bool]) -> None:
        """Before `select_staged(len(lanes), any(states))`: each of these distinct lanes continues from its verify
        column, its tail row from verify_hidden and, where `states`, every recurrent layer's conv and SSM state from
        the layer's columns (the verify leaves the running states at its last column: a lane there passes False)."""
        if self.gdn_bank is not None:
            records = self.gdn_bank.ssm_columns.shape[2]
            if any(state and column >= records for state, column in zip(states, columns)):
                raise ValueError(f"verify columns {columns} with states {states}: only columns below {records} are "
                                 f"recorded (the last column's state is the running one)")
        picks = np.full(self.selection.shape, -1, np.int32)
        picks[0, : len(lanes)], picks[1, : len(lanes)] = lanes, columns
        picks[2, : len(lanes)] = np.where(states, columns, -1)
        self.device.write(self.selection, picks)

    def select_staged(self, n: int, states: bool) -> None:
        """The staged selection of n lanes (a graph per (n, states) in the runner): the tails, then with `states`
        the recurrent states, one launch a kind for every layer and lane."""
        stream, tails, hidden, lanes = self.device.stream, self.tails, self.verify_hidden, self.selection[0, :n]
        self.k.select_columns(tails.reshape((1,) + tails.shape), hidden.reshape((1,) + hidden.shape), lanes,
                              self.selection[1, :n], stream=stream)
        bank = self.gdn_bank
        if bank is not None and states:
            for live, recorded in ((bank.conv, bank.conv_columns), (bank.ssm, bank.ssm_columns)):
                self.k.select_columns(live, recorded, lanes, self.selection[2, :n], stream=stream)

    def copy_lane_state(self, lane: int, *, to_slot: int | None = None, from_slot: int | None = None) -> None:
        """Checkpoint save (`to_slot`) or restore (`from_slot`) of every recurrent layer's lane state and the tail
        row."""
        copy = self.device.copy
        # (live, checkpoints) of every part a checkpoint carries. The DFlash rings change only by commits, never by a
        # verify column: a checkpoint carries them, and the full layer's prefix stays in the pages.
        parts = [pair for state in self.gdn.values()
                 for pair in ((state.conv, state.conv_checkpoints), (state.ssm, state.ssm_checkpoints))]
        parts += [pair for ring in self.dflash_rings.values()
                  for pair in ((ring.k, ring.k_checkpoints), (ring.v, ring.v_checkpoints))]
        parts.append((self.tails, self.tail_checkpoints))
        for live, saved in parts:
            if to_slot is not None:
                copy(saved[lane, to_slot], live[lane])
            else:
                copy(live[lane], saved[lane, from_slot])

    def export_lane_views(self, lane: int, pages: np.ndarray) -> dict[str, Any]:
        """A lane's sequence state in place, named for `import_lane_arrays`: the KV of these pages in every attention
        pool (MTP and the DFlash full layers included; a `RowRuns` of the runs of consecutive pages), the Gated
        DeltaNet running state and checkpoint slots, the tail rows, and with DFlash the rings (running and
        checkpoint slots) and pending context rows. Device views: valid until the lane runs again."""
        out = {}
        for name, array in self._page_arrays().items():
            parts = tuple(array[first : first + count] for _, first, count in _runs(pages))
            out[name] = parts[0] if len(parts) == 1 else RowRuns(parts, array.dtype,
                                                                 (len(pages),) + tuple(array.shape[1:]))
        for name, array in self._lane_arrays().items():
            out[name] = array[lane]
        return out

    def export_lane_arrays(self, lane: int, pages: np.ndarray) -> dict[str, np.ndarray]:
        """Host copies of `export_lane_views` (one read per run of consecutive pages)."""
        def host(value: Any) -> np.ndarray:
            if not isinstance(value, RowRuns):
                return self.device.read(value)
            parts = [self.device.read(part) for part in value.parts]
            return np.concatenate(parts) if parts else np.zeros(value.shape, value.dtype)

        return {name: host(value) for name, value in self.export_lane_views(lane, pages).items()}

    def import_lane_arrays(self, lane: int, pages: np.ndarray, arrays: dict[str, Any]) -> None:
        """Write `export_lane_arrays` output into these pages (the same count) and this lane's state rows. Arrays
        still parked in a cold-tier arena (`ParkedArray`) are streamed straight into place."""
        def write(destination: Any, source: Any, first: int) -> None:
            if isinstance(source, ParkedArray):
                source.copy_rows_to(first, destination)
            else:
                self.device.write(destination, source[first : first + destination.shape[0]])

        for name, array in self._page_arrays().items():
            for index, first, count in _runs(pages):
                write(array[first : first + count], arrays[name], index)
        for name, array in self._lane_arrays().items():
            source = arrays[name]
            if isinstance(source, ParkedArray):
                source.copy_rows_to(0, array[lane])
            else:
                self.device.write(array[lane], source)

    def _page_arrays(self) -> dict[str, Any]:
        pools = {f"kv/{layer}": pool for layer, pool in self.kv.items()}
        if self.mtp_kv is not None:
            pools["mtp"] = self.mtp_kv
        pools.update({f"dflash/kv/{layer}": pool for layer, pool in self.dflash_kv.items()})
        return {f"{name}/{part}": array for name, pool in pools.items()
                for part, array in (("k", pool.k), ("v", pool.v), ("k_scale", pool.k_scale),
                                    ("v_scale", pool.v_scale)) if array is not None}

    def _lane_arrays(self) -> dict[str, Any]:
        """Per-lane state arrays, indexed by lane first."""
        out = {"tail": self.tails, "tail_checkpoints": self.tail_checkpoints}
        for layer, state in self.gdn.items():
            out.update({f"gdn/{layer}/conv": state.conv, f"gdn/{layer}/ssm": state.ssm,
                        f"gdn/{layer}/conv_checkpoints": state.conv_checkpoints,
                        f"gdn/{layer}/ssm_checkpoints": state.ssm_checkpoints})
        for layer, ring in self.dflash_rings.items():
            out.update({f"dflash/ring/{layer}/k": ring.k, f"dflash/ring/{layer}/v": ring.v,
                        f"dflash/ring_checkpoints/{layer}/k": ring.k_checkpoints,
                        f"dflash/ring_checkpoints/{layer}/v": ring.v_checkpoints})
        if self.dflash_pending is not None:
            out["dflash/pending"] = self.dflash_pending
        return out


def _runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """(index in `values`, first value, count) of each run of consecutive integers (page ids, row indices)."""
    values = np.asarray(values, np.int64)
    if not values.size:
        return []
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    starts, stops = np.r_[0, breaks], np.r_[breaks, values.size]
    return [(int(a), int(values[a]), int(b - a)) for a, b in zip(starts, stops)]


CHECKPOINT_SLOTS = 2


def check_recurrence_groups(groups: int) -> None:
    """The ValueError of a Capacity.recurrence_groups the recurrence has no compiled variant for."""
    if groups not in REC_GROUP_CHOICES:
        raise ValueError(f"recurrence_groups must be one of {', '.join(map(str, REC_GROUP_CHOICES))}, got {groups}")


def check_split_k_norm(slices: int) -> None:
    """The ValueError of a Capacity.split_k_norm `add_slices_rms_norm_rows` has no kernel for."""
    if slices != 0 and slices not in ADD_SLICES:
        raise ValueError(f"split_k_norm must be 0 (off) or one of {', '.join(map(str, ADD_SLICES))} slices, got "
                         f"{slices}")


def _fused_swiglu(gate_up: Any, rows: int) -> bool:
    """Whether decode rows of this gate|up run the fused SwiGLU epilogue: it is stored for it (`_gate_up`), and the
    row count is the decode path's (prefill chunks dequantize it, back in its original row order)."""
    return bool(getattr(gate_up, "swiglu_rows", 0)) and rows <= SKINNY_ROWS


def _row_blocks(matrix: Matrix) -> tuple:
    """The matrices a projection is stored as: a split projection's row blocks, or the matrix itself."""
    return tuple(matrix.parts) if isinstance(matrix, SplitMatrix) else (matrix,)


def _tensor_core(matrix: Any) -> bool:
    """A quantized matrix stored in the tensor-core layout (`quant_mma`)."""
    return bool(getattr(matrix, "tensor_core", False))


def _is_matrix(value: Any) -> bool:
    return isinstance(value, (Bf16Matrix, SplitMatrix)) or is_quantized(value)
