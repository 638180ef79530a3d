"""Deterministic pseudo-random fills on the device: benchmark weights at real model shapes are generated on the GPU
(tens of GB), never shipped or uploaded. Values are uniform in [-scale, scale) from a counter-based hash of
(seed, index), so a fill is reproducible and its NumPy twin gives the same bits."""

from __future__ import annotations

import numpy as np
from numba import float32, uint16, uint32, uint64

from ninfer.kernels_numba.common import GOLDEN_GAMMA, blocks_for, f32_to_bf16, mix64
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel

THREADS = 256


@device_function
def _mix(seed, index):
    """A splitmix64-style mix of (seed, index) to 64 random bits."""
    return mix64(uint64(seed) + uint64(index) * uint64(GOLDEN_GAMMA))


@device_function
def _hash_uniform(seed, index):
    """(seed, index) to a float32 in [0, 1) (24 random bits)."""
    return float32(uint32(_mix(seed, index) >> uint64(40))) * float32(1.0 / 16777216.0)


@kernel((uint32[::1], uint64, uint32, uint32))
def _fill_words(out, seed, keep, set_bits):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = (uint32(_mix(seed, i) >> uint64(32)) & keep) | set_bits


@kernel((uint16[::1], uint64, float32))
def _fill_uniform_bf16(out, seed, scale):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = uint16(f32_to_bf16((float32(2.0) * _hash_uniform(seed, i) - float32(1.0)) * scale))


@kernel((float32[::1], uint64, float32))
def _fill_uniform_f32(out, seed, scale):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = (float32(2.0) * _hash_uniform(seed, i) - float32(1.0)) * scale


def fill_uniform(out, *, seed: int, scale: float, stream) -> None:
    """Fill a contiguous uint16 (bf16 bits) or float32 device array with uniform values in [-scale, scale)."""
    flat = out.reshape(out.size)
    blocks = min(blocks_for(flat.size, THREADS), 132 * 32)
    fill = _fill_uniform_bf16 if flat.dtype == np.uint16 else _fill_uniform_f32
    fill[blocks, THREADS, stream](flat, np.uint64(seed), np.float32(scale))


def fill_words(out, *, seed: int, keep: int = 0xFFFFFFFF, set_bits: int = 0, stream) -> None:
    """Fill a contiguous uint32 device array with random words: each (hash & keep) | set_bits (random quantized
    code planes, and scales with fixed exponent bits)."""
    flat = out.reshape(out.size)
    blocks = min(blocks_for(flat.size, THREADS), 132 * 32)
    _fill_words[blocks, THREADS, stream](flat, np.uint64(seed), np.uint32(keep), np.uint32(set_bits))


def _mixed(size: int, seed: int) -> np.ndarray:
    """The kernels' splitmix64 mix of (seed, index) for every index below `size`."""
    with np.errstate(over="ignore"):
        index = np.arange(size, dtype=np.uint64)
        z = np.uint64(seed) + index * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def fill_words_reference(size: int, *, seed: int, keep: int = 0xFFFFFFFF, set_bits: int = 0) -> np.ndarray:
    words = (_mixed(size, seed) >> np.uint64(32)).astype(np.uint32)
    return (words & np.uint32(keep)) | np.uint32(set_bits)


def fill_uniform_reference(size: int, dtype, *, seed: int, scale: float) -> np.ndarray:
    unit = (_mixed(size, seed) >> np.uint64(40)).astype(np.uint32).astype(np.float32) * np.float32(1.0 / 16777216.0)
    value = (np.float32(2.0) * unit - np.float32(1.0)) * np.float32(scale)
    if np.dtype(dtype) == np.uint16:
        from ninfer.artifact.codec import f32_to_bf16_bits

        return f32_to_bf16_bits(value)
    return value.astype(np.float32)


def random_quant_payload(fmt: str, shape: tuple[int, int], *, seed: int) -> np.ndarray:
    """An artifact payload of random codes and scales in [5e-4, 2e-3) for a quantized [N, K] matrix (the host
    twins' random weights, and the layouts the device cannot fill itself)."""
    from ninfer.artifact.formats import W8G32, row_split_geometry

    geometry = row_split_geometry(fmt, shape)
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, geometry.total_bytes, dtype=np.uint8)
    if fmt == W8G32:  # 0x80 (-128) is not a legal W8 code
        base = payload[: shape[0] * geometry.base_row_bytes]
        base[base == 0x80] = 0x81
    scales = rng.uniform(0.5e-3, 2e-3, shape[0] * geometry.groups_per_row).astype(np.float16)
    payload[geometry.scale_offset: geometry.total_bytes] = scales.view(np.uint8)
    return payload
