"""Every registered kernel compiles to PTX for sm_90 with the signatures its launchers use (no GPU needed). The
compiles (minutes in all) are spread over one worker process per core, once per session; each case's test reports its
own result."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("numba.cuda")

from ninfer.kernels_numba.numba_setup import REGISTRY  # noqa: E402
from tests.support.ptx_cases import cases, compile_case  # noqa: E402

CASES = cases()


@pytest.fixture(scope="module")
def compiled() -> dict[int, str | None]:
    workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {n: pool.submit(compile_case, entry.key, i) for n, (entry, i, _) in enumerate(CASES)}
        return {n: future.result() for n, future in futures.items()}


def test_every_kernel_is_registered_with_a_signature():
    assert REGISTRY, "no kernels registered"
    assert all(entry.signatures for entry in REGISTRY), [e.name for e in REGISTRY if not e.signatures]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{e.name}#{e.key[1]}:{i}" for e, i, _ in CASES])
def test_kernel_compiles_to_ptx_for_hopper(compiled, index):
    assert compiled[index] is None, compiled[index]
