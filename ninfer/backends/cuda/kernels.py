"""The launchers the CUDA model calls, in one namespace. `host_kernels` provides the same names over the kernels'
NumPy twins, so the model and runner glue also runs (and is tested) without a GPU."""

from ninfer.kernels_numba.attention import (attention_decode, attention_prefill, attention_prepare,
                                            decode_partials_shape)
from ninfer.kernels_numba.attention_flash import flash_prefill
from ninfer.kernels_numba.attention_gemm import causal_softmax, gather_kv, pack_queries, unpack_gated
from ninfer.kernels_numba.dflash import attention_partials_shape, copy_columns, dflash_attention, dflash_heads
from ninfer.kernels_numba.elementwise import (add_slices_rms_norm_rows, embed_rows, rms_norm_rows, sigmoid_gate_add,
                                              silu_mul_bf16_rows, SILU_QUADS, silu_mul_rows, silu_mul_slots,
                                              silu_mul_to_bf16_rows, to_bf16_rows)
from ninfer.kernels_numba.fill import fill_uniform
from ninfer.kernels_numba.gdn import (gdn_conv, gdn_conv_normed, gdn_gates, gdn_output, gdn_recurrent,
                                      gdn_recurrent_gated, gdn_recurrent_projected)
from ninfer.kernels_numba.gdn_chunked import gdn_chunked
from ninfer.kernels_numba.layout import (concat_columns, copy_segments, gather_rows, gather_two_sources,
                                         keep_segment_rows, select_columns)
from ninfer.kernels_numba.linear import linear_bf16, linear_bf16_gathered, linear_bf16_gathered_swiglu
from ninfer.kernels_numba.linear_mma import linear_bf16_mma
from ninfer.kernels_numba.linear_narrow import linear_bf16_narrow, linear_bf16_narrow_route
from ninfer.kernels_numba.moe import (moe_chunk_groups, moe_combine, moe_combine_rms_norm, moe_gather, moe_group,
                                     moe_layout, moe_pad_positions, moe_scatter_combine, route_top_k)
from ninfer.kernels_numba.quant_linear import (QuantWeight, dequantize_bf16, linear_quant,
                                               linear_quant_gathered, repack_quant, upload_quant_planes,
                                               upload_quant_weight)
from ninfer.kernels_numba.quant_mma import (ROW_SETS, dequantize_mma_bf16, has_pair_kernel, linear_quant_mma,
                                            linear_quant_mma_gathered, linear_quant_mma_gathered_swiglu,
                                            linear_quant_mma_pair, linear_quant_mma_swiglu, random_quant_mma_weight,
                                            repack_quant_mma, upload_quant_mma, upload_quant_mma_planes, x_fragment_words, x_fragments, x_slot_fragments)
from ninfer.kernels_numba.quant_mma_chunked import linear_quant_mma_chunked
from ninfer.kernels_numba.quant_mma_conv import has_conv_kernel, linear_quant_mma_conv
from ninfer.kernels_numba.sampling import (argmax_rows, count_tokens, sample_candidates, scratch_columns,
                                          top_candidates_rows, verify_counts)
from ninfer.kernels_numba.vision import (add_rows, bias_gelu_bf16, layer_norm_bf16, vision_heads, vision_merge_heads,
                                         vision_softmax)

__all__ = [
    "causal_softmax",
    "gather_kv",
    "pack_queries",
    "unpack_gated",
    "QuantWeight",
    "argmax_rows",
    "attention_decode",
    "attention_prefill",
    "attention_prepare",
    "attention_partials_shape",
    "concat_columns",
    "copy_segments",
    "copy_columns",
    "count_tokens",
    "decode_partials_shape",
    "dequantize_bf16",
    "dflash_attention",
    "dflash_heads",
    "embed_rows",
    "fill_uniform",
    "flash_prefill",
    "gather_rows",
    "gather_two_sources",
    "keep_segment_rows",
    "gdn_chunked",
    "gdn_conv",
    "gdn_conv_normed",
    "gdn_gates",
    "gdn_output",
    "gdn_recurrent",
    "gdn_recurrent_gated",
    "gdn_recurrent_projected",
    "linear_bf16",
    "linear_bf16_gathered",
    "linear_bf16_gathered_swiglu",
    "linear_bf16_mma",
    "linear_bf16_narrow",
    "linear_bf16_narrow_route",
    "linear_quant",
    "linear_quant_gathered",
    "moe_chunk_groups",
    "moe_combine",
    "moe_combine_rms_norm",
    "moe_gather",
    "moe_group",
    "moe_layout",
    "moe_pad_positions",
    "moe_scatter_combine",
    "repack_quant",
    "rms_norm_rows",
    "add_slices_rms_norm_rows",
    "route_top_k",
    "sample_candidates",
    "scratch_columns",
    "select_columns",
    "sigmoid_gate_add",
    "silu_mul_bf16_rows",
    "silu_mul_rows",
    "silu_mul_slots",
    "silu_mul_to_bf16_rows",
    "to_bf16_rows",
    "top_candidates_rows",
    "verify_counts",
    "upload_quant_planes",
    "upload_quant_weight",
    "add_rows",
    "bias_gelu_bf16",
    "layer_norm_bf16",
    "vision_heads",
    "vision_merge_heads",
    "vision_softmax",
    "dequantize_mma_bf16",
    "linear_quant_mma",
    "linear_quant_mma_gathered",
    "linear_quant_mma_gathered_swiglu",
    "linear_quant_mma_swiglu",
    "linear_quant_mma_pair",
    "has_pair_kernel",
    "linear_quant_mma_chunked",
    "linear_quant_mma_conv",
    "has_conv_kernel",
    "random_quant_mma_weight",
    "repack_quant_mma",
    "upload_quant_mma",
    "upload_quant_mma_planes",
    "ROW_SETS",
    "SILU_QUADS",
    "x_fragment_words",
    "x_fragments",
    "x_slot_fragments",
]
