"""The activation buffers a CUDA model call works in, sized once for the largest call (`Workspace`), the DFlash
drafter's (`DFlashWorkspace`) and a side stream's conversion scratch (`SideScratch`)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ninfer.artifact.formats import align_up
from ninfer.backends.cuda.blas import MAX_CHUNKS
from ninfer.backends.cuda.capacity import MOE_CHUNK_ROWS, SCORE_BYTES, SKINNY_ROWS
from ninfer.backends.cuda.device import Device
from ninfer.backends.cuda.layer_weights import ROUTER_ROWS_MULTIPLE
from ninfer.kernels_numba.gdn_chunked import CHUNK as GDN_CHUNK
from ninfer.kernels_numba.moe import GROUP_ROWS as MOE_GROUP_ROWS
from ninfer.kernels_numba.moe import LAYOUT_INFO, PADDED_LIMIT
from ninfer.targets.dims import DFlashDims, QwenDims

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


@attrs.frozen
class SideScratch:
    """The scratch a Linear on the side stream converts its inputs into (`Linear.beside`): not the serving stream's,
    which the other branch may be reading. Split projections and dequantized weights never run there."""

    x_bf16: Any
    x_fragments: Any
    split_a: None = None
    split_b: None = None
    w_bf16: None = None
