"""Deterministic pseudo-random fills on the device: benchmark weights at real model shapes are generated on the GPU
(tens of GB), never shipped or uploaded. Values are uniform in [-scale, scale) from a counter-based hash of
(seed, index), so a fill is reproducible and its NumPy twin gives the same bits."""

from __future__ import annotations

import numpy as np
from numba import float32, uint16, uint32, uint64

from ninfer.kernels_numba.common import blocks_for, f32_to_bf16
from ninfer.kernels_numba.numba_setup import cuda, device_function, kernel

THREADS = 256


@device_function
def _hash_uniform(seed, index):
    """A splitmix64-style mix of (seed, index) to a float32 in [0, 1) (24 random bits)."""
    z = uint64(seed) + uint64(index) * uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
    z = z ^ (z >> uint64(31))
    return float32(uint32(z >> uint64(40))) * float32(1.0 / 16777216.0)


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


def fill_uniform_reference(size: int, dtype, *, seed: int, scale: float) -> np.ndarray:
    with np.errstate(over="ignore"):
        index = np.arange(size, dtype=np.uint64)
        z = np.uint64(seed) + index * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    unit = (z >> np.uint64(40)).astype(np.uint32).astype(np.float32) * np.float32(1.0 / 16777216.0)
    value = (np.float32(2.0) * unit - np.float32(1.0)) * np.float32(scale)
    if np.dtype(dtype) == np.uint16:
        from ninfer.artifact.codec import f32_to_bf16_bits

        return f32_to_bf16_bits(value)
    return value.astype(np.float32)
