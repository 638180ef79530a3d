"""Every registered kernel compiles to PTX for sm_90 with the signatures its launchers use (no GPU needed)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

pytest.importorskip("numba.cuda")

import ninfer.kernels_numba as package  # noqa: E402
from ninfer.kernels_numba.numba_setup import COMPUTE_CAPABILITY, REGISTRY, cuda  # noqa: E402

for module in pkgutil.iter_modules(package.__path__):
    importlib.import_module(f"{package.__name__}.{module.name}")

CASES = [(entry, signature) for entry in REGISTRY for signature in entry.signatures]


def test_every_kernel_is_registered_with_a_signature():
    assert REGISTRY, "no kernels registered"
    assert all(entry.signatures for entry in REGISTRY), [e.name for e in REGISTRY if not e.signatures]


@pytest.mark.parametrize("entry,signature", CASES, ids=[f"{e.name}:{i}" for i, (e, _) in enumerate(CASES)])
def test_kernel_compiles_to_ptx_for_hopper(entry, signature):
    options = {k: v for k, v in entry.options.items() if k in ("fastmath", "lineinfo", "debug", "opt")}
    ptx, _ = cuda.compile_ptx(entry.function, signature, cc=COMPUTE_CAPABILITY, **options)
    assert ".target sm_90" in ptx
    assert ".entry" in ptx
