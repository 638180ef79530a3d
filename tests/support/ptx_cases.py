"""The kernel/signature pairs CI compiles to PTX, and the compile of one of them: importable by the worker processes
that tests/kernels/test_ptx.py spreads the compiles over (numba compiles one kernel at a time per process). A case is
named by its kernel's registration key and signature index, which every process agrees on whatever order it imported
the kernel modules in."""

from __future__ import annotations

import importlib
import pkgutil


def cases() -> list:
    """(registered kernel, signature index, signature) for every kernel of ninfer.kernels_numba registered so far,
    by registration key."""
    import ninfer.kernels_numba as package
    from ninfer.kernels_numba.numba_setup import REGISTRY

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return [(entry, i, signature) for entry in sorted(REGISTRY, key=lambda e: e.key)
            for i, signature in enumerate(entry.signatures)]


def compile_case(key: tuple[str, int], signature_index: int) -> str | None:
    """None when the kernel registered as `key` compiles to PTX for sm_90 with its signature `signature_index` and
    has an entry point; else why not."""
    from ninfer.kernels_numba.numba_setup import hopper_ptx

    found = [entry for entry, i, _ in cases() if entry.key == tuple(key) and i == signature_index]
    if not found:
        return f"no kernel registered as {key} with signature {signature_index} in a fresh process"
    entry = found[0]
    try:
        ptx = hopper_ptx(entry.function, entry.signatures[signature_index], entry.options)
    except Exception as exc:  # noqa: BLE001 - reported by the test that owns the case
        return f"{type(exc).__name__}: {exc}"
    if ".target sm_90" not in ptx or ".entry" not in ptx:
        return "no sm_90 entry point in the PTX"
    return None
