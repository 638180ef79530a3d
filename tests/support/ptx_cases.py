"""The kernel/signature pairs CI compiles to PTX, and the compile of one of them: importable by the worker processes
that tests/kernels/test_ptx.py spreads the compiles over (numba compiles one kernel at a time per process)."""

from __future__ import annotations

import importlib
import pkgutil


def cases() -> list:
    """(registered kernel, signature) for every kernel module of ninfer.kernels_numba, in a fixed order."""
    import ninfer.kernels_numba as package
    from ninfer.kernels_numba.numba_setup import REGISTRY

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return [(entry, signature) for entry in REGISTRY for signature in entry.signatures]


def compile_case(index: int, name: str) -> str | None:
    """None when case `index` (whose kernel is `name`) compiles to PTX for sm_90 with an entry point; else why not."""
    from ninfer.kernels_numba.numba_setup import COMPUTE_CAPABILITY, cuda

    entry, signature = cases()[index]
    if entry.name != name:
        return f"case {index} is {entry.name} in the worker, {name} in the test"
    options = {k: v for k, v in entry.options.items() if k in ("fastmath", "lineinfo", "debug", "opt")}
    try:
        ptx, _ = cuda.compile_ptx(entry.function, signature, cc=COMPUTE_CAPABILITY, **options)
    except Exception as exc:  # noqa: BLE001 - reported by the test that owns the case
        return f"{type(exc).__name__}: {exc}"
    if ".target sm_90" not in ptx or ".entry" not in ptx:
        return "no sm_90 entry point in the PTX"
    return None
