"""Whether this process can use NVIDIA GPUs, without importing the CUDA backend (or failing when it is absent)."""

from __future__ import annotations

import functools


@functools.cache
def cuda_device_count() -> int:
    """Usable NVIDIA GPUs: 0 when numba-cuda is not installed, the driver is missing, or no device is visible."""
    try:
        from ninfer.kernels_numba.numba_setup import cuda
    except ImportError:
        return 0
    try:
        return len(cuda.gpus) if cuda.is_available() else 0
    except Exception:  # a driver without a usable device raises from the probe on some versions
        return 0
