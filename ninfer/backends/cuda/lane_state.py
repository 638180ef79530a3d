"""The per-lane state a CUDA model keeps: paged KV pools, the Gated DeltaNet conv and recurrent states with
their checkpoint slots and verify-column records, the DFlash drafter's window rings."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from ninfer.backends.cuda.capacity import Capacity, PAGE_TOKENS
from ninfer.backends.cuda.device import Device
from ninfer.targets.dims import DFlashDims, QwenDims

# checkpoint copies of a lane's recurrent state (`RunnerInfo.checkpoint_slots`: the engine's prefix reuse saves
# and restores a lane through them)
CHECKPOINT_SLOTS = 2


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


def make_dflash_ring(device: Device, dims: DFlashDims, lanes: int, slots: int) -> DFlashRing:
    shape = (dims.sliding_window, dims.kv_heads, dims.head_dim)
    return DFlashRing(device.zeros((lanes,) + shape, np.uint16, "state"),
                      device.zeros((lanes,) + shape, np.uint16, "state"),
                      device.zeros((lanes, slots) + shape, np.uint16, "state"),
                      device.zeros((lanes, slots) + shape, np.uint16, "state"))


def make_kv_pool(device: Device, dims: QwenDims | DFlashDims, kv_dtype: str, pages: int) -> KvPool:
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


def make_gdn_states(device: Device, dims: QwenDims, cap: Capacity, slots: int,
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
