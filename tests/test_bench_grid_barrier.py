"""bench/grid_barrier.py's kernels (a phase a launch, grid sync, arrival counters) compile to PTX for sm_90 without a
GPU, so the device call that runs the bench does not find a typing error first."""

import pytest

pytest.importorskip("numba.cuda")


def test_the_barrier_kernels_compile_for_hopper():
    from numba import float32, int32

    from bench import grid_barrier
    from ninfer.kernels_numba.numba_setup import hopper_ptx

    signatures = {grid_barrier.one_phase: (float32[::1],),
                  grid_barrier.phases_grid_sync: (float32[::1], int32),
                  grid_barrier.phases_counters: (float32[::1], int32[::1], int32)}
    for kernel, signature in signatures.items():
        ptx = hopper_ptx(kernel.py_func, signature, {})
        assert ".target sm_90" in ptx and ".entry" in ptx, kernel.py_func.__name__
    assert "atom.global.add" in hopper_ptx(grid_barrier.phases_counters.py_func,
                                           signatures[grid_barrier.phases_counters], {})
