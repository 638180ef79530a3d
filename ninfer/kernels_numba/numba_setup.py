"""The one place that makes numba importable on the GPU image, and the kernel registry.

numba 0.68 calls `numpy.row_stack`, which numpy 2.5 removed; `numpy.vstack` is the same function. The alias is set
here, before numba is imported, and nowhere else: every kernel module imports `cuda` from this module.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import attrs
import numpy

if not hasattr(numpy, "row_stack"):
    numpy.row_stack = numpy.vstack

from numba import config, cuda  # noqa: E402  (after the shim on purpose)

COMPUTE_CAPABILITY = (9, 0)  # H100/H200
# `cuda.shared.array(..., alignment=COPY_ALIGNMENT)` for a static shared array that 16-byte copies (cp.async, vector
# stores) fill: numba aligns one to its element's size otherwise. The simulator refuses the argument (None there).
COPY_ALIGNMENT = None if config.ENABLE_CUDASIM else 16


@attrs.frozen
class RegisteredKernel:
    name: str
    function: Callable[..., Any]  # the Python source function (compile_ptx takes it)
    signatures: tuple[Any, ...]  # numba signatures CI compiles to PTX
    options: dict[str, Any]  # cuda.jit options (fastmath, ...)
    # (defining module, registrations in that module before this one): the same in every process that imports the
    # module, whatever order modules were imported in (kernel factories share a function name)
    key: tuple[str, int] = ("", 0)


REGISTRY: list[RegisteredKernel] = []
_REGISTERED_PER_MODULE: dict[str, int] = {}


def register_options(max_registers: int | None) -> dict:
    """`kernel` options for a register cap (a tuning knob: more resident warps, maybe spills); None: no cap."""
    return {} if max_registers is None else {"max_registers": int(max_registers)}


def kernel(*signatures: Any, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`cuda.jit(**options)` that also records the kernel with the signatures its launchers use, so CI can compile
    each one to PTX. Signatures are those of real launches: a kernel launched with other argument types recompiles.
    Launches go through `fast_launch.FastKernel` (8-11 us of host time a launch against numba's own 27-33); each
    specialization compiles once and is kept in the disk cache (`kernel_cache`)."""

    def wrap(function: Callable[..., Any]) -> Any:
        module = function.__module__
        sequence = _REGISTERED_PER_MODULE.get(module, 0)
        _REGISTERED_PER_MODULE[module] = sequence + 1
        REGISTRY.append(RegisteredKernel(f"{module}.{function.__qualname__}", function, signatures, dict(options),
                                         (module, sequence)))
        if config.ENABLE_CUDASIM:  # the simulator runs Python: it takes no register cap
            return cuda.jit(**{k: v for k, v in options.items() if k != "max_registers"})(function)
        from ninfer.kernels_numba import kernel_cache
        from ninfer.kernels_numba.fast_launch import FastKernel

        dispatcher = cuda.jit(**options)(function)
        kernel_cache.attach(dispatcher, function, options)  # compiled once, then loaded by every later process
        return FastKernel(dispatcher)

    return wrap


def device_function(function: Callable[..., Any]) -> Any:
    """An inlined `cuda.jit(device=True)` helper, inlined by numba into its caller's IR before typing."""
    return cuda.jit(device=True, inline=True)(function)


def large_device_function(function: Callable[..., Any]) -> Any:
    """A `cuda.jit(device=True)` helper that NVVM inlines (`forceinline`: LLVM's alwaysinline), for the large nested
    helpers of the quantized linear kernels.

    Why: numba's own inlining deep-copies the callee's IR into every call site, which took the tensor-core GEMVs 8-22 s
    each to PTX (the pair kernel 21 s) and kept the GPU runner tests compiling for minutes; NVVM's takes 1.5-4 s and
    gives those kernels the same SASS (registers and instruction counts, bench/cuda_notes.md, session 11). Not the
    default: the flash attention kernel went from 228 registers to 255 plus a 40-byte stack with NVVM inlining of its
    small helpers. The CUDA simulator runs Python and takes no inlining option."""
    if config.ENABLE_CUDASIM:
        return cuda.jit(device=True)(function)
    return cuda.jit(device=True, forceinline=True)(function)


def hopper_ptx(function: Callable[..., Any], signature: Any, options: dict[str, Any]) -> str:
    """A kernel's PTX for sm_90, on a machine with or without a GPU (CI's compile check, tools/sass.py).

    numba-cuda compiles a called device function for the current device's compute capability, which asks the
    driver; on a machine without one, the device functions are compiled for COMPUTE_CAPABILITY, as the kernel is."""
    from numba.cuda import dispatcher
    from numba.cuda.cudadrv.error import CudaSupportError

    current_device = dispatcher.get_current_device

    def current_or_hopper() -> Any:
        try:
            return current_device()
        except CudaSupportError:
            return types.SimpleNamespace(compute_capability=COMPUTE_CAPABILITY)

    kept = {k: v for k, v in options.items() if k in ("fastmath", "lineinfo", "debug", "opt")}
    dispatcher.get_current_device = current_or_hopper
    try:
        ptx, _ = cuda.compile_ptx(function, signature, cc=COMPUTE_CAPABILITY, **kept)
    finally:
        dispatcher.get_current_device = current_device
    return ptx


_DYNAMIC_SHARED_ALLOWED: dict[tuple[int, int], int] = {}


def allow_dynamic_shared(dispatcher: Any, signature: Any, nbytes: int) -> None:
    """Let `dispatcher`'s `signature` variant launch with `nbytes` of dynamic shared memory on the current device
    (past 48 KiB a kernel must opt in; Hopper allows up to 227 KiB a block). numba has no API for this attribute:
    this is the driver call numba's own `set_shared_memory_carveout` makes, on the same kernel handle. The attribute
    is a ceiling, so it only ever rises: lowering it for a smaller launch would make a later, larger launch of the
    same kernel fail with CUDA_ERROR_INVALID_VALUE (a GPU test met that, widths 2048 then 64 then 2048)."""
    from numba.cuda.cudadrv.driver import binding, driver

    compiled = dispatcher.compile(signature)
    function = compiled.library.get_cufunc()
    key = (id(function), function.device.id)
    if _DYNAMIC_SHARED_ALLOWED.get(key, -1) >= nbytes:
        return
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, nbytes, function.handle, function.device.id)
    _DYNAMIC_SHARED_ALLOWED[key] = nbytes
