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

from typing import Any, Callable

import attrs
import numpy as np

from ninfer.artifact.formats import align_up
from ninfer.backends.cpu.dflash import DFLASH_KV_DTYPE
from ninfer.backends.cpu.ops import rope_inv_freq
from ninfer.backends.cpu.paged_kv import kv_bytes_per_token
from ninfer.backends.cuda.blas import MAX_CHUNKS
from ninfer.backends.cuda.capacity import (CAPTURED_SPAN, MMA_ROWS, MOE_CHUNK_ROWS, MOE_CHUNK_STEP,
                                           MOE_SYNC_FREE_CHUNK_ROWS, MOE_SYNC_FREE_ROWS, PAGE_TOKENS,
                                           SHORT_PREFILL_ROW_KEYS, SKINNY_ROWS, Capacity, PrefillSpan,
                                           check_recurrence_groups, check_split_k_norm)
from ninfer.backends.cuda.device import CudaDevice, Device
from ninfer.backends.cuda.inputs import DFlashInputs, InputRows, StepInputs
from ninfer.backends.cuda.lane_state import (CHECKPOINT_SLOTS, DFlashRing, GdnLayerState, KvPool, make_dflash_ring,
                                             make_gdn_states, make_kv_pool)
from ninfer.backends.cuda.layer_weights import (AttentionWeights, DenseFfn, LayerWeights, MoeFfn, MtpWeights,
                                                load_attention, load_dflash, load_ffn, load_layer)
from ninfer.backends.cuda.linear import Linear, fp32_read, reads_bf16_alone
from ninfer.backends.cuda.linear_tuning import tune_decode_paths
from ninfer.backends.cuda.weights import (Bf16Matrix, DeviceWeights, Matrix, SplitMatrix, is_matrix, is_quantized,
                                          row_blocks, tensor_core)
from ninfer.backends.cuda.workspace import DFlashWorkspace, SideScratch, Workspace
from ninfer.engine.cold_tier import ParkedArray, RowRuns
from ninfer.engine.sampler import TOP_K_CAP
from ninfer.kernels_numba.attention import check_min_split_keys, check_splits, row_splits
from ninfer.kernels_numba.gdn import conv_normed_fits
from ninfer.kernels_numba.linear_narrow import FUSED_ROUTE_ROWS
from ninfer.kernels_numba.moe import COMBINE_NORM_SLOTS, LAYOUT_CHUNKED, LAYOUT_CODES, LAYOUT_PADDED, stepped_chunks
from ninfer.kernels_numba.programmatic import check_available as check_programmatic_launch
from ninfer.kernels_numba.quant_mma_chunked import CHUNK_ROWS as QUANT_CHUNK_ROWS
from ninfer.targets.dims import DFlashDims, QwenDims


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
        self.layers = [load_layer(weights, device, dims, f"text/layers/{i}/", kind, fused)
                       for i, kind in enumerate(dims.layer_types)]
        self.final_norm = weights.vector("text/final_norm")
        self.head = weights.matrix("text/output_head")
        self.mtp: MtpWeights | None = None
        if capacity.mtp:
            mtp_layer = LayerWeights(weights.vector("mtp/layer/input_norm"),
                                     weights.vector("mtp/layer/post_attention_norm"),
                                     load_attention(weights, "mtp/layer/attention/", True), None, None,
                                     load_ffn(weights, device, dims, "mtp/layer/"))
            self.mtp = MtpWeights(weights.matrix("mtp/input_projection"), weights.vector("mtp/embedding_norm"),
                                  weights.vector("mtp/hidden_norm"), mtp_layer, weights.vector("mtp/final_norm"))
        self.dflash = load_dflash(weights, device, dims, dflash, capacity.draft_tokens) if capacity.dflash \
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
        self.gdn, self.gdn_bank = make_gdn_states(device, dims, capacity, CHECKPOINT_SLOTS, recurrent)

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
            self.dflash_rings = {layer: make_dflash_ring(device, drafter, capacity.lanes, CHECKPOINT_SLOTS)
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
        # Sampling on the device: penalty counts per lane, the 20 best penalised candidates (the rows' penalties
        # and draw parameters are inputs: `StepInputs`).
        decode_rows = max(capacity.decode_rows, 1)
        self.penalty_counts = device.zeros((capacity.lanes, dims.vocab_ids), np.int32, "state")
        # a verify round's rows' counts (each with its round's drafts before it: `candidates(segments=)`)
        speculative = capacity.mtp or capacity.dflash
        self.row_counts = (device.zeros((decode_rows, dims.vocab_ids), np.int32, "workspace") if speculative
                           else None)
        self.row_index = device.upload(np.arange(decode_rows, dtype=np.int32), "inputs")
        # ids and values in one block (the values' fp32 as int32 bits), so the host reads both in one copy
        self.candidates_block = device.empty((2, decode_rows, TOP_K_CAP), np.int32, "workspace")
        self.candidate_ids, self.candidate_values = self.candidates_block[0], self.candidates_block[1].view(np.float32)
        self.counted = InputRows(device, ("lanes", "tokens", "valid"), decode_rows)  # `count_generated`'s tokens
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
        self.kv = {i: make_kv_pool(self.device, dims, kv_dtype, pages) for i, kind in enumerate(dims.layer_types)
                   if kind == "full_attention"}
        self.mtp_kv = make_kv_pool(self.device, dims, kv_dtype, pages) if self.capacity.mtp else None
        if self.dflash is not None:
            self.dflash_kv = {layer: make_kv_pool(self.device, self.dflash.dims, DFLASH_KV_DTYPE, pages)
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
        widths = [m.shape[1] for m in (*self._matrices(), *heads) if tensor_core(m)]
        return self.k.ROW_SETS * self.k.x_fragment_words(max(widths)) if widths else 0

    def _slot_fragment_words(self) -> int:
        """x-fragment words of the per-slot inputs of the MoE down projections, when they are tensor-core: one set
        per expert slot."""
        layers = self._layers_with_mtp()
        if not any(isinstance(layer.ffn, MoeFfn) and tensor_core(layer.ffn.routed_down) for layer in layers):
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
                    found += [v for v in attrs.astuple(part, recurse=False) if is_matrix(v)]
            if layer.gdn_output is not None:
                found.append(layer.gdn_output)
        if self.mtp:
            found.append(self.mtp.input_projection)
        if self.dflash is not None:
            found.append(self.dflash.feature_projection)
            for layer in self.dflash.layers:
                found += [layer.query_key_value, layer.output, layer.mlp.gate_up, layer.mlp.down]
        for matrix in found:
            yield from row_blocks(matrix)

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

        # dequantizations queued ahead by the eager calls before (the matrices predicted to follow) were recorded
        # outside the capture, which may not wait on them (CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
        self._drain_dequantizer()
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

    def candidates(self, logits: Any, *, segments: int | None = None) -> None:
        """The TOP_K_CAP best penalised candidates of each row (row r of lane row_lane[r], penalties presence[r] and
        frequency[r]) into candidate_ids / candidate_values: §4.8 steps 2-3 on the device. With `segments` (a
        verify round's), each row's counts also hold its segment's drafts before it (`sampling.verify_counts`)."""
        rows, inputs = logits.shape[0], self.inputs
        counts, count_rows = self.penalty_counts, inputs.row_lane[:rows]
        if segments is not None:
            counts, count_rows = self.row_counts[:rows], self.row_index[:rows]
            self.k.verify_counts(self.penalty_counts, inputs.row_lane[:rows], inputs.token_ids[:rows],
                                 inputs.seg_row[:segments], inputs.seg_count[:segments], counts,
                                 vocab_ids=self.dims.vocab_ids, stream=self.device.stream)
        self.k.top_candidates_rows(logits, self.dims.vocab_ids, counts, count_rows, inputs.presence[:rows],
                                   inputs.frequency[:rows], self.candidate_ids[:rows], self.candidate_values[:rows],
                                   stream=self.device.stream, scratch=self.sampling_scratch)

    def read_candidates(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `rows` rows' candidate ids and values on the host, in one read."""
        block = self.device.read(self.candidates_block)
        return block[0, :rows], block[1, :rows].view(np.float32)

    def sample(self, rows: int) -> Any:
        """§4.8 steps 4-8 on the device for the rows `inputs.sampling` flags: each one's token over its candidates
        (`candidates` first) replaces its argmax (`greedy` first), and is counted for its lane's penalties where
        flagged. Returns argmax[:rows], every row's token."""
        self.k.sample_candidates(self.candidate_ids[:rows], self.candidate_values[:rows], self.inputs.sampling,
                                 self.inputs.row_lane[:rows], self.penalty_counts, self.argmax[:rows],
                                 stream=self.device.stream)
        return self.argmax[:rows]

    def count_generated(self, lanes: list[int], tokens: list[int]) -> None:
        """Step 8 on the device: these generated tokens now count toward their lanes' penalties."""
        n = len(tokens)
        if not n:
            return
        counted = self.counted
        counted.fill({"lanes": lanes, "tokens": tokens, "valid": np.ones(n, np.int32)})
        self.k.count_tokens(self.penalty_counts, counted.row("lanes")[:n], counted.row("tokens")[:n],
                            counted.row("valid")[:n], stream=self.device.stream)

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
        self._norm(x, layer.input_norm, h if projects_ab else fp32_read(h, rows, h_bf16, h_frag), out_bf16=h_bf16,
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
        self._norm(x, layer.post_attention_norm, fp32_read(h, rows, h_bf16, h_frag), out_bf16=h_bf16,
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
        out = fp32_read(ws.attended[:rows], rows, out_bf16, None)
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
                act_frag = (ws.slot_x_fragments if rows <= MMA_ROWS and tensor_core(w.routed_down) else None)
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
        on = (all(tensor_core(part) for part in row_blocks(w.in_proj)) if self.ab_in_recurrence is None
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
        if tensor_core(w):
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
        return (tensor_core(gate_up) and tensor_core(down)
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


def _fused_swiglu(gate_up: Any, rows: int) -> bool:
    """Whether decode rows of this gate|up run the fused SwiGLU epilogue: it is stored for it (`_gate_up`), and the
    row count is the decode path's (prefill chunks dequantize it, back in its original row order)."""
    return bool(getattr(gate_up, "swiglu_rows", 0)) and rows <= SKINNY_ROWS
