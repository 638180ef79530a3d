"""bench/dram_streams.py's probe kernels compile to PTX for sm_90 without a GPU, each with the loads its variant
names, so the device call that runs the probe does not find a typing error first."""

import pytest

pytest.importorskip("numba.cuda")


def test_every_probe_variant_compiles_with_its_loads():
    from numba import int32, int64, uint32

    from bench import dram_streams as D
    from ninfer.kernels_numba.numba_setup import hopper_ptx

    signature = (uint32[::1], uint32[::1], int32, uint32[::1], uint32[::1], uint32[::1], int32)
    for unroll in D.UNROLLS:
        for striped, chained, extras in D.VARIANTS:
            ptx = hopper_ptx(D.stream_kernel(unroll, striped, chained, extras).py_func, signature, {})
            assert ".target sm_90" in ptx and "ld.global.v4.u32" in ptx, (unroll, extras)
            assert ("ld.shared.v4.u32" in ptx) == bool(extras & D.X_SHARED), (unroll, extras)
            assert ("ld.global.nc.L1::no_allocate.v4.u32" in ptx) == bool(extras & D.NO_ALLOCATE), (unroll, extras)
            if extras & D.SCALES_WIDE:  # the step's scale words of a lane as one load
                assert f"ld.global.v{unroll}.u32" in ptx, (unroll, extras)
    ptx = hopper_ptx(D.read_grid_stride.py_func, (uint32[::1], uint32[::1], int64), {})
    assert "ld.global.v4.u32" in ptx
