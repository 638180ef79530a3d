"""A layer's device weights as the model reads them (attention, Gated DeltaNet, dense and MoE FFN, MTP, the
DFlash drafter), and their loading from `DeviceWeights`."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ninfer.artifact.formats import align_up
from ninfer.backends.cpu.ops import rope_inv_freq
from ninfer.backends.cuda.device import Device
from ninfer.backends.cuda.weights import Bf16Matrix, DeviceWeights, Matrix, is_quantized, tensor_core
from ninfer.models.dflash import DFlashMismatchError
from ninfer.targets.dims import DFlashDims, QwenDims, SLIDING_ATTENTION

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


def load_dflash(w: DeviceWeights, device: Device, target: QwenDims, dims: DFlashDims | None,
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


def load_attention(w: DeviceWeights, prefix: str, fused: bool) -> AttentionWeights:
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
    return w.matrix(name, gathered=gathered, swiglu_rows=2 * inter if tensor_core(down) else 0)


def load_ffn(w: DeviceWeights, device: Device, dims: QwenDims, prefix: str) -> DenseFfn | MoeFfn:
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


def load_layer(w: DeviceWeights, device: Device, dims: QwenDims, prefix: str, kind: str,
                   fused: bool) -> LayerWeights:
    attention = gdn_weights = gdn_output = None
    if kind == "full_attention":
        attention = load_attention(w, prefix + "attention/", fused)
    else:
        gdn_weights = _gdn_weights(w, device, prefix + "gdn/", fused)
        gdn_output = w.matrix(prefix + "gdn/output")
    return LayerWeights(w.vector(prefix + "input_norm"), w.vector(prefix + "post_attention_norm"), attention,
                        gdn_weights, gdn_output, load_ffn(w, device, dims, prefix))
