"""The CUDA model's launchers over the kernels' NumPy twins, on host arrays (same names, same arguments).

`HostDevice` runs `CudaQwen` and `CudaRunner` with these, so the backend's host logic (row and segment bookkeeping,
checkpoints, verify columns, MTP bridging and drafting, graph replay order) is exercised in CI without a GPU; the GPU
tests then only have to show the kernels equal their twins.
"""

from __future__ import annotations

import attrs
import numpy as np

from ninfer.artifact import codec
from ninfer.backends.cpu.ops import linear as row_linear
from ninfer.kernels_numba import attention as _attention
from ninfer.kernels_numba import attention_flash as _attention_flash
from ninfer.kernels_numba import attention_gemm as _attention_gemm
from ninfer.kernels_numba import dflash as _dflash
from ninfer.kernels_numba import elementwise as _elementwise
from ninfer.kernels_numba import gdn as _gdn
from ninfer.kernels_numba import gdn_chunked as _gdn_chunked
from ninfer.kernels_numba import layout as _layout
from ninfer.kernels_numba import linear as _linear
from ninfer.kernels_numba import linear_mma as _linear_mma
from ninfer.kernels_numba import linear_narrow as _linear_narrow
from ninfer.kernels_numba import moe as _moe
from ninfer.kernels_numba import quant_mma as _quant_mma
from ninfer.kernels_numba import quant_mma_chunked as _quant_mma_chunked
from ninfer.kernels_numba import quant_mma_conv as _quant_mma_conv
from ninfer.kernels_numba import sampling as _sampling
from ninfer.kernels_numba import vision as _vision
from ninfer.backends.cuda import kernels as _device_kernels
from ninfer.kernels_numba.fill import fill_uniform_reference, random_quant_payload


__all__ = list(_device_kernels.__all__)  # the same launchers as the device set

# Pure-Python sizing helpers are shared with the device set.
decode_partials_shape = _attention.decode_partials_shape
attention_partials_shape = _dflash.attention_partials_shape
scratch_columns = _sampling.scratch_columns


@attrs.define(eq=False)
class QuantWeight:
    """A quantized matrix kept as its artifact payload, decoded once to fp32 for the twins."""

    fmt: str
    shape: tuple[int, int]
    payload: np.ndarray
    nbytes: int
    dense: np.ndarray | None = None

    def decoded(self) -> np.ndarray:
        if self.dense is None:
            self.dense = codec.decode(self.payload, self.fmt, self.shape)
        return self.dense


def upload_quant_weight(fmt, shape, payload, *, stream=0) -> QuantWeight:
    payload = np.asarray(payload, dtype=np.uint8).copy()
    return QuantWeight(fmt, tuple(shape), payload, int(payload.nbytes))


def repack_quant(fmt, shape, payload) -> dict[str, np.ndarray]:
    """The host set keeps the artifact payload itself as its one 'plane'."""
    return {"payload": np.asarray(payload, dtype=np.uint8)}


def upload_quant_planes(fmt, shape, planes, *, stream=0) -> QuantWeight:
    return upload_quant_weight(fmt, shape, planes["payload"])


@attrs.define(eq=False)
class QuantMmaWeight(QuantWeight):
    """The tensor-core layout's stand-in: the same payload (rows in their own order: `swiglu_rows` only says which
    launchers take it), routed by `Linear` to the tensor-core launchers."""

    swiglu_rows: int = 0
    tensor_core = True


def upload_quant_mma(fmt, shape, payload, *, stream=0, swiglu_rows=0) -> QuantMmaWeight:
    payload = np.asarray(payload, dtype=np.uint8).copy()
    if swiglu_rows:
        _quant_mma.swiglu_rows_order(shape[0], swiglu_rows)  # the device layout's check
    return QuantMmaWeight(fmt, tuple(shape), payload, int(payload.nbytes), swiglu_rows=int(swiglu_rows))


def random_quant_mma_weight(fmt, shape, *, seed, stream=0, swiglu_rows=0) -> QuantMmaWeight:
    """The device's random tensor-core weight, as a random payload the twins decode."""
    return upload_quant_mma(fmt, shape, random_quant_payload(fmt, tuple(shape), seed=seed), swiglu_rows=swiglu_rows)


def repack_quant_mma(fmt, shape, payload, *, swiglu_rows=0) -> dict[str, np.ndarray]:
    return repack_quant(fmt, shape, payload)


def upload_quant_mma_planes(fmt, shape, planes, *, stream=0, swiglu_rows=0) -> QuantMmaWeight:
    return upload_quant_mma(fmt, shape, planes["payload"], swiglu_rows=swiglu_rows)


x_fragment_words = _quant_mma.x_fragment_words
ROW_SETS = _quant_mma.ROW_SETS
SILU_QUADS = _elementwise.SILU_QUADS


def x_fragments(x, out, *, stream):
    words = _quant_mma.x_sets(x.shape[0]) * _quant_mma.x_fragment_words(x.shape[1])
    if out.shape[0] < words:
        raise ValueError(f"x fragments: x{tuple(x.shape)} into {out.shape[0]} words ({words} needed)")
    out[:words] = _quant_mma.x_fragments_reference(x)


def x_slot_fragments(x, out, *, stream):
    words = x.shape[1] * _quant_mma.x_fragment_words(x.shape[2])
    out[:words] = _quant_mma.x_slot_fragments_reference(x)


def linear_quant_mma(xf, qw, y, *, stream, accumulate=False, programmatic=False):  # host launches run in order
    rows, K = y.shape[0], qw.shape[1]
    if rows > _quant_mma.MAX_X_ROWS * ROW_SETS or xf.shape[0] < _quant_mma.x_sets(rows) * x_fragment_words(K):
        raise ValueError(f"tensor-core linear: y{tuple(y.shape)} (at most {_quant_mma.MAX_X_ROWS * ROW_SETS} rows), "
                         f"{xf.shape[0]} x words")
    if qw.swiglu_rows:
        raise ValueError("a weight stored in swiglu_order multiplies through linear_quant_mma_swiglu")
    out = row_linear(_quant_mma.x_from_fragments(xf, rows, K), qw.decoded())
    y[...] = (y + out) if accumulate else out


def linear_quant_mma_swiglu(xf, qw, y, act, *, stream, programmatic=False):
    _quant_mma.check_swiglu_shapes(xf.shape[0], qw, y.shape, act.shape[0])
    rows, N = y.shape
    gate_up = row_linear(_quant_mma.x_from_fragments(xf, rows, qw.shape[1]), qw.decoded())
    values = _elementwise.silu_mul_rows_reference(gate_up)
    words = _quant_mma.x_sets(rows) * x_fragment_words(N // 2)
    act[:words] = _quant_mma.x_fragments_reference(values)


def has_pair_kernel(first, second):
    return _quant_mma.has_pair_kernel(first, second)


def linear_quant_mma_pair(xf, first, second, y, *, stream, programmatic=False):
    _quant_mma.check_pair_shapes(xf.shape[0], first, second, y.shape)
    rows = first.shape[0]
    linear_quant_mma(xf, first, y[:, :rows], stream=stream)
    linear_quant_mma(xf, second, y[:, rows:], stream=stream)


def has_conv_kernel(parts):
    return _quant_mma_conv.has_conv_kernel(parts)


def linear_quant_mma_conv(xf, parts, y, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count,
                          seg_record, mixed, *, channels, stream, programmatic=False):
    _quant_mma_conv.check_conv_shapes(xf.shape[0], parts, y.shape, mixed.shape, channels,
                                      (conv_weight.shape, conv_state.shape, conv_columns.shape))
    column = 0
    for part in parts:
        linear_quant_mma(xf, part, y[:, column:column + part.shape[0]], stream=stream)
        column += part.shape[0]
    _gdn.gdn_conv_reference(y, conv_weight, conv_state, conv_columns, seg_lane, seg_row, seg_count, seg_record, mixed,
                            channels=channels)


def linear_quant_mma_gathered(xf, qw, expert_ids, y, *, rows_per_expert, x_per_slot, stream, programmatic=False):
    _quant_mma.check_gathered_shapes(xf.shape[0], qw.shape, expert_ids.shape, y.shape,
                                     rows_per_expert=rows_per_expert, x_per_slot=x_per_slot)
    if qw.swiglu_rows:
        raise ValueError("experts stored in swiglu_order multiply through linear_quant_mma_gathered_swiglu")
    (rows, slots), K = expert_ids.shape, qw.shape[1]
    x = (_quant_mma.x_from_slot_fragments(xf, rows, slots, K) if x_per_slot
         else _quant_mma.x_from_fragments(xf, rows, K))
    y[...] = _linear.gathered_reference(x, qw.decoded(), expert_ids, rows_per_expert=rows_per_expert,
                                        x_per_slot=x_per_slot)


def linear_quant_mma_gathered_swiglu(xf, qw, expert_ids, y, act, *, rows_per_expert, stream, programmatic=False):
    _quant_mma.check_gathered_shapes(xf.shape[0], qw.shape, expert_ids.shape, y.shape,
                                     rows_per_expert=rows_per_expert, x_per_slot=False)
    _quant_mma.check_gathered_swiglu(qw, expert_ids.shape[1], rows_per_expert, act.shape[0])
    (rows, slots), K = expert_ids.shape, qw.shape[1]
    gate_up = _linear.gathered_reference(_quant_mma.x_from_fragments(xf, rows, K), qw.decoded(), expert_ids,
                                         rows_per_expert=rows_per_expert, x_per_slot=False)
    _fragment_rows(_elementwise.silu_mul_rows_reference(gate_up), act, slots)


def linear_quant_mma_chunked(x, qw, chunk_groups, offsets, starts, y, *, rows_per_expert, chunk, chunks, swiglu,
                             stream):
    _quant_mma_chunked.check_chunked_shapes(x.shape, qw, y.shape, rows_per_expert=rows_per_expert, chunk=chunk,
                                            chunks=chunks, swiglu=swiglu)
    _quant_mma_chunked.linear_quant_mma_chunked_reference(x, qw.decoded(), chunk_groups, offsets, starts, y,
                                                          rows_per_expert=rows_per_expert, chunk=chunk, chunks=chunks,
                                                          swiglu=swiglu)


def dequantize_mma_bf16(qw, out, *, stream):
    out[...] = codec.f32_to_bf16_bits(qw.decoded())


def embed_rows(table, ids, out, *, stream):
    out[...] = _elementwise.embed_rows_reference(table, ids)


def _bf16_copy(values, out_bf16) -> None:
    if out_bf16 is not None:
        out_bf16.reshape(values.shape)[...] = codec.f32_to_bf16_bits(values)


def _fragment_rows(values, fragments, slots: int = 1) -> None:
    """The x fragments a producer kernel writes beside its fp32 output (one set per slot of [R, S, K])."""
    if fragments is None:
        return
    per_slot = values if values.ndim == 3 else values[:, None, :]
    _quant_mma.check_fragment_output(per_slot.shape[0], per_slot.shape[2], fragments, slots)
    words = _quant_mma.x_fragment_words(per_slot.shape[2])
    for s in range(slots):
        _quant_mma.write_fragment_rows_reference(fragments[s * words : (s + 1) * words], per_slot[:, s])


def rms_norm_rows(x, weight, out, *, eps, offset, stream, out_bf16=None, out_fragments=None):
    if out is None and out_bf16 is None:
        raise ValueError("rms_norm_rows needs an fp32 out, a bf16 out or both")
    _write_normed(_elementwise.rms_norm_rows_reference(x, weight, eps=eps, offset=offset), out, out_bf16,
                  out_fragments)


def _write_normed(normed, out, out_bf16, out_fragments):
    """A row norm's outputs as the kernels write them: fp32 (unless out is None), the bf16 copy, the x fragments."""
    if out is not None:
        out[...] = normed
    _bf16_copy(normed, out_bf16)
    _fragment_rows(normed, out_fragments)


def add_slices_rms_norm_rows(partials, residual, weight, out, *, eps, offset, stream, out_bf16=None,
                             out_fragments=None):
    if out is None and out_bf16 is None:
        raise ValueError("add_slices_rms_norm_rows needs an fp32 out, a bf16 out or both")
    residual[...], normed = _elementwise.add_slices_rms_norm_rows_reference(partials, residual, weight, eps=eps,
                                                                           offset=offset)
    _write_normed(normed, out, out_bf16, out_fragments)


def silu_mul_rows(gate_up, out, *, stream, out_bf16=None, out_fragments=None):
    out[...] = _elementwise.silu_mul_rows_reference(gate_up)
    _bf16_copy(out, out_bf16)
    _fragment_rows(out, out_fragments, out.shape[1] if out.ndim == 3 else 1)


def silu_mul_bf16_rows(gate_up, out, *, stream):
    out[...] = _elementwise.silu_mul_bf16_rows_reference(gate_up)


def silu_mul_to_bf16_rows(gate_up, out, *, stream):
    _elementwise.check_silu_to_bf16_shapes(gate_up.shape, out.shape)
    out[...] = _elementwise.silu_mul_to_bf16_rows_reference(gate_up)


def silu_mul_slots(gate_up, out, *, stream, out_fragments=None):
    silu_mul_rows(gate_up, out, stream=stream, out_fragments=out_fragments)


def to_bf16_rows(x, out, *, stream):
    out[...] = _elementwise.to_bf16_rows_reference(x)


def sigmoid_gate_add(residual, delta, gate_logit, *, stream):
    residual[...] = _elementwise.sigmoid_gate_add_reference(residual, delta, gate_logit)


def attention_prepare(qkgv, q_norm, k_norm, inv_freq, positions, *args, stream, **kwargs):
    # The device kernel reads only the first R columns of a (possibly wider) positions buffer.
    _attention.attention_prepare_reference(qkgv, q_norm, k_norm, inv_freq, positions[:, : qkgv.shape[0]], *args,
                                           **kwargs)


def attention_decode(*args, stream, out_bf16=None, out_fragments=None, **kwargs):
    out = _attention.attention_decode_reference(*args, **kwargs)
    _bf16_copy(out, out_bf16)
    _fragment_rows(out, out_fragments)


def attention_prefill(*args, stream, **kwargs):
    _attention.attention_prefill_reference(*args, **kwargs)


def gdn_conv(*args, stream, **kwargs):
    _gdn.gdn_conv_reference(*args, **kwargs)


def gdn_conv_normed(*args, stream, **kwargs):
    _gdn.gdn_conv_normed_reference(*args, **kwargs)


def gdn_gates(*args, stream, **kwargs):
    _gdn.gdn_gates_reference(*args, **kwargs)


def gdn_recurrent(*args, stream, **kwargs):
    _gdn.gdn_recurrent_reference(*args, **kwargs)


# host launches run in order; the twins sum in their own order whatever the key groups
def gdn_recurrent_gated(*args, stream, programmatic=False, groups=None, **kwargs):
    _gdn.gdn_recurrent_gated_reference(*args, **kwargs)


def gdn_recurrent_projected(*args, stream, programmatic=False, groups=None, **kwargs):
    _gdn.gdn_recurrent_projected_reference(*args, **kwargs)


def gdn_chunked(*args, stream, multiprocessors, **kwargs):  # the SM count only picks the kernel's slice
    _gdn_chunked.gdn_chunked_reference(*args, **kwargs)


def gdn_output(out, z_source, norm_weight, result, *, stream, result_bf16=None, result_fragments=None, **kwargs):
    if result is None and result_bf16 is None:
        raise ValueError("gdn_output needs a result, a bf16 result or both")
    values = np.empty((out.shape[0], kwargs["v_heads"] * kwargs["v_dim"]), np.float32) if result is None else result
    _gdn.gdn_output_reference(out, z_source, norm_weight, values, **kwargs)
    _bf16_copy(values, result_bf16)
    _fragment_rows(values, result_fragments)


def route_top_k(router_logits, top_k, expert_ids, weights, *, stream, experts=None, programmatic=False):
    columns = router_logits.shape[1] if experts is None else experts
    expert_ids[...], weights[...] = _moe.route_top_k_reference(router_logits[:, :columns], top_k)


def moe_combine(expert_out, weights, residual, *, stream, shared_out=None, gate_logit=None):
    residual[...] = _moe.moe_combine_reference(expert_out, weights, residual, shared_out, gate_logit)


def moe_combine_rms_norm(expert_out, weights, residual, shared_out, gate_logit, norm_weight, out, *, eps, offset,
                         stream, out_bf16=None, out_fragments=None):
    _moe.check_combine_slots(weights.shape[1])
    residual[...], out[...] = _moe.moe_combine_rms_norm_reference(expert_out, weights, residual, shared_out,
                                                                  gate_logit, norm_weight, eps=eps, offset=offset)
    _bf16_copy(out, out_bf16)
    _fragment_rows(out, out_fragments)


def moe_group(expert_ids, counts, offsets, slot_of, *, experts, position_of, block_counts, stream):
    """(the twin needs no scratch: block_counts is left alone)"""
    counts[...], offsets[...], slot_of[...], position_of[...] = _moe.moe_group_reference(expert_ids, experts)


def moe_gather(x, slot_of, top_k, out, *, stream, position_of=None):
    if position_of is None:
        out[...] = _moe.moe_gather_reference(x, slot_of, top_k)
    else:
        out[...] = _moe.moe_scatter_rows_reference(x, position_of, top_k, out)


def moe_layout(offsets, info, starts, *, choice, chunk, room, max_chunks, stream):
    info[...], starts[...] = _moe.moe_layout_reference(offsets, choice=choice, chunk=chunk, room=room,
                                                        max_chunks=max_chunks)


def moe_chunk_groups(info, offsets, starts, chunk_groups, *, chunk, step, room, stream):
    _moe.moe_chunk_groups_reference(info, offsets, starts, chunk_groups, chunk=chunk, step=step, room=room)


def moe_pad_positions(expert_ids, position_of, offsets, starts, placed, *, stream):
    placed[...] = _moe.moe_pad_positions_reference(expert_ids, position_of, offsets, starts)


def moe_scatter_combine(permuted_out, slot_of, weights, top_k, residual, *, position_of, stream, shared_out=None,
                        gate_logit=None):
    residual[...] = _moe.moe_scatter_combine_reference(permuted_out, position_of, weights, top_k, residual, shared_out,
                                                       gate_logit)


def linear_bf16(x, w, y, *, stream, accumulate=False):
    y[...] = _linear.linear_bf16_reference(x, w, y, accumulate=accumulate)


def linear_bf16_mma(x, w, y, *, stream, accumulate=False, programmatic=False):
    _linear_mma.check_shapes(x.shape, w.shape, y.shape)
    y[...] = _linear_mma.linear_bf16_mma_reference(x, w, y, accumulate=accumulate)


def linear_bf16_narrow(x, w, y, *, stream, accumulate=False):
    y[...] = _linear_narrow.linear_bf16_narrow_reference(x, w, y, accumulate=accumulate)


def linear_bf16_narrow_route(x, w, logits, counter, top_k, expert_ids, weights, *, stream, experts):
    _linear_narrow.check_fused_route(top_k, experts, logits.shape)
    logits[...], expert_ids[...], weights[...] = _linear_narrow.linear_bf16_narrow_route_reference(
        x, w, top_k, experts=experts)


def linear_bf16_gathered(x, w, expert_ids, y, *, rows_per_expert, x_per_slot, stream, programmatic=False):
    y[...] = _linear.linear_bf16_gathered_reference(x, w, expert_ids, rows_per_expert=rows_per_expert,
                                                    x_per_slot=x_per_slot)


def linear_bf16_gathered_swiglu(gate_up, w, expert_ids, y, *, rows_per_expert, stream, programmatic=False):
    y[...] = _linear.linear_bf16_gathered_swiglu_reference(gate_up, w, expert_ids, rows_per_expert=rows_per_expert)


def linear_quant(x, qw, y, *, stream, accumulate=False):
    out = row_linear(np.asarray(x, np.float32), qw.decoded())
    y[...] = (y + out) if accumulate else out


def linear_quant_gathered(x, qw, expert_ids, y, *, rows_per_expert, x_per_slot, stream):
    y[...] = _linear.gathered_reference(x, qw.decoded(), expert_ids, rows_per_expert=rows_per_expert,
                                        x_per_slot=x_per_slot)


def dequantize_bf16(qw, out, *, stream):
    out[...] = codec.f32_to_bf16_bits(qw.decoded())


def argmax_rows(logits, vocab_ids, out, *, stream, scratch=None):
    out[...] = _sampling.argmax_rows_reference(logits, vocab_ids)


def concat_columns(left, right, out, *, stream):
    out[...] = _layout.concat_columns_reference(left, right)


def gather_rows(source, index, out, *, stream):
    out[...] = _layout.gather_rows_reference(source, index)


def gather_two_sources(first, second, index, out, *, stream):
    out[...] = _layout.gather_two_sources_reference(first, second, index)


def copy_segments(source, seg_lane, seg_row, seg_count, slots, *, stream):
    _layout.copy_segments_reference(source, seg_lane, seg_row, seg_count, slots)


def keep_segment_rows(final, seg_lane, seg_row, seg_count, tails, columns, *, stream):
    _layout.keep_segment_rows_reference(final, seg_lane, seg_row, seg_count, tails, columns)


def select_columns(live, columns, lanes, chosen, *, stream):
    live[...] = _layout.select_columns_reference(live, columns, lanes, chosen)


def fill_uniform(out, *, seed, scale, stream):
    out.reshape(-1)[...] = fill_uniform_reference(out.size, out.dtype, seed=seed, scale=scale)


def pack_queries(q, out, *, first, rows, group, scale, stream):
    out[...] = _attention_gemm.pack_queries_reference(q, first=first, rows=rows, group=group, scale=scale,
                                                      kv_heads=out.shape[0])


def gather_kv(page_tables, lane, length, pool, scales, out, *, stream, transposed=False):
    values = _attention_gemm.gather_kv_reference(page_tables, lane, length, pool, scales)
    if transposed:
        out[:, :, :length] = values.transpose(0, 2, 1)
    else:
        out[:, :length] = values


def flash_prefill(packed, keys, values_t, qkgv, out, *, stream, out_bf16=None, **kwargs):
    if out is None and out_bf16 is None:
        raise ValueError("flash_prefill needs an fp32 out, a bf16 out or both")
    if out is not None:
        _attention_flash.flash_prefill_reference(packed, keys, values_t, qkgv, out, **kwargs)
    if out_bf16 is not None:
        _attention_flash.flash_prefill_bf16_reference(packed, keys, values_t, qkgv, out_bf16, **kwargs)


def causal_softmax(scores, probs, *, rows, first_position, stream):
    probs[...] = _attention_gemm.causal_softmax_reference(scores, rows=rows, first_position=first_position)


def unpack_gated(o, qkgv, out, *, first, rows, group, stream):
    _attention_gemm.unpack_gated_reference(o, qkgv, out, first=first, rows=rows, group=group)


def sample_candidates(ids, values, params, row_lane, counts, out, *, stream) -> None:
    _sampling.sample_candidates_reference(ids, values, params, row_lane, counts, out)


def verify_counts(counts, row_lane, token_ids, seg_row, seg_count, out, *, vocab_ids, stream) -> None:
    out[...] = _sampling.verify_counts_reference(counts, row_lane, token_ids, seg_row, seg_count, rows=out.shape[0],
                                                 vocab_ids=vocab_ids)


def top_candidates_rows(logits, vocab_ids, counts, row_lane, presence, frequency, out_ids, out_values, *, stream,
                        scratch=None):
    out_ids[...], out_values[...] = _sampling.top_candidates_rows_reference(logits, vocab_ids, counts, row_lane,
                                                                            presence, frequency)


def count_tokens(counts, lanes, tokens, valid, *, stream):
    counts[...] = _sampling.count_tokens_reference(counts, lanes, tokens, valid)


# ---- the DFlash drafter's kernels ----

def copy_columns(source, out, *, first_column, stream):
    _dflash.copy_columns_reference(source, out, first_column=first_column)


def dflash_heads(*args, stream, **kwargs):
    _dflash.check_geometry(kwargs["heads"], kwargs["kv_heads"], kwargs["head_dim"])
    _dflash.dflash_heads_reference(*args, **kwargs)


def dflash_attention(q, k_block, v_block, positions, row_lane, page_tables, cache_k, cache_v, partials, out, *,
                     stream, **kwargs):
    _dflash.check_geometry(kwargs["heads"], kwargs["kv_heads"], kwargs["head_dim"])
    _dflash.dflash_attention_reference(q, k_block, v_block, positions, row_lane, page_tables, cache_k, cache_v, out,
                                       **kwargs)


# ---- the Vision tower's kernels ----

def layer_norm_bf16(x, weight, bias, out, *, eps, stream, pending_bias=None):
    if pending_bias is not None:
        x[...] = _vision.add_rows_reference(x, pending_bias)
    out[...] = _vision.layer_norm_bf16_reference(x, weight, bias, eps=eps)


def add_rows(x, bias, *, stream):
    x[...] = _vision.add_rows_reference(x, bias)


def bias_gelu_bf16(y, bias, out, *, exact, stream):
    out[...] = _vision.bias_gelu_bf16_reference(y, bias, exact=exact)


def vision_heads(qkv, bias, cos, sin, q, k, v, *, scale, first, stream):
    rows = slice(first, first + qkv.shape[0])
    q[:, rows], k[:, rows], v[:, rows] = _vision.vision_heads_reference(qkv, bias, cos[rows], sin[rows],
                                                                        heads=q.shape[0], scale=scale)


def vision_softmax(scores, probs, *, stream):
    probs[...] = _vision.vision_softmax_reference(scores)


def vision_merge_heads(o, out, *, stream):
    out[...] = _vision.vision_merge_heads_reference(o)
