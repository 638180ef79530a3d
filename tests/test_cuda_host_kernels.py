"""The NumPy stand-ins of the CUDA backend: the kernel set offers every launcher the CUDA model calls, under the same
names, and the host cuBLAS stand-in writes the blocks the GPU one does."""

import numpy as np
import pytest

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.backends.cuda import host_kernels, kernels
from ninfer.backends.cuda.host import HostBlas


def test_the_host_set_defines_every_device_launcher():
    missing = [name for name in kernels.__all__ if not hasattr(host_kernels, name)]
    assert not missing
    assert host_kernels.__all__ == kernels.__all__


def test_host_gemm_writes_only_its_column_block_and_refuses_one_past_the_output():
    """HostBlas.gemm_bf16 with first_column (the split projections' prefill): the product of bf16 x and w lands in
    y[:, first:first + N], the other columns keep their values, as Blas does on the GPU."""
    rng = np.random.default_rng(0)
    x, w = f32_to_bf16_bits(rng.standard_normal((5, 8))), f32_to_bf16_bits(rng.standard_normal((3, 8)))
    y0 = rng.standard_normal((5, 10)).astype(np.float32)
    y = y0.copy()
    HostBlas().gemm_bf16(x, w, y, first_column=4)
    np.testing.assert_array_equal(np.delete(y, np.s_[4:7], axis=1), np.delete(y0, np.s_[4:7], axis=1))
    np.testing.assert_allclose(y[:, 4:7], bf16_bits_to_f32(x) @ bf16_bits_to_f32(w).T, rtol=1e-6)
    with pytest.raises(ValueError, match="gemm shapes"):
        HostBlas().gemm_bf16(x, w, y, first_column=8)


def test_host_batched_gemm_is_the_grouped_gemm_over_equal_groups_and_checks_its_shapes():
    """HostBlas.batched_gemm_bf16 (the padded MoE prefill): group g's rows times its own weight block, rounded once to
    bf16; shapes that do not split into equal groups, or an fp32 output, are refused."""
    rng = np.random.default_rng(5)
    groups, p, n, k = 3, 4, 6, 16
    x = f32_to_bf16_bits(rng.standard_normal((groups * p, k)))
    w = f32_to_bf16_bits(rng.standard_normal((groups * n, k)))
    y = np.zeros((groups * p, n), np.uint16)
    HostBlas().batched_gemm_bf16(x, w, y, groups)
    for g in range(groups):
        want = bf16_bits_to_f32(x[g * p:(g + 1) * p]) @ bf16_bits_to_f32(w[g * n:(g + 1) * n]).T
        np.testing.assert_array_equal(y[g * p:(g + 1) * p], f32_to_bf16_bits(want.astype(np.float32)))
    for bad_x, bad_y in ((x[:-1], y[:-1]), (x, y[:, :-1]), (x, y.astype(np.float32))):
        with pytest.raises(ValueError, match="batched gemm shapes"):
            HostBlas().batched_gemm_bf16(bad_x, w, bad_y, groups)


def test_host_chunked_gemm_multiplies_each_chunk_by_its_groups_weights_and_checks_its_shapes():
    """HostBlas.chunked_gemm_bf16 (the chunked MoE prefill): chunk i's rows times the weight block of its group,
    rounded once to bf16, rows past the chunks untouched, entries past `chunks` ignored; a group out of range, an
    fp32 output or more chunks than entries are refused."""
    rng = np.random.default_rng(6)
    chunk, n, k, groups = 4, 6, 16, 3
    chunk_groups = np.array([0, 0, 2, 1, 2])
    x = f32_to_bf16_bits(rng.standard_normal((len(chunk_groups) * chunk + 2, k)))
    w = f32_to_bf16_bits(rng.standard_normal((groups * n, k)))
    y = np.full((x.shape[0], n), 0x7FC1, np.uint16)
    HostBlas().chunked_gemm_bf16(x, w, y, chunk_groups, chunk)
    for i, g in enumerate(chunk_groups):
        want = bf16_bits_to_f32(x[i * chunk:(i + 1) * chunk]) @ bf16_bits_to_f32(w[g * n:(g + 1) * n]).T
        np.testing.assert_array_equal(y[i * chunk:(i + 1) * chunk], f32_to_bf16_bits(want.astype(np.float32)))
    assert np.all(y[-2:] == 0x7FC1)
    first = np.full_like(y, 0x7FC1)  # the first 3 entries only (a whole workspace map, as the model passes)
    HostBlas().chunked_gemm_bf16(x, w, first, np.concatenate([chunk_groups, [9, 9]]), chunk, chunks=3)
    np.testing.assert_array_equal(first[:3 * chunk], y[:3 * chunk])
    assert np.all(first[3 * chunk:] == 0x7FC1)
    for groups_bad, y_bad in ((np.array([0, 3]), y), (chunk_groups, y.astype(np.float32))):
        with pytest.raises(ValueError, match="chunked gemm shapes"):
            HostBlas().chunked_gemm_bf16(x, w, y_bad, groups_bad, chunk)
    with pytest.raises(ValueError, match="chunked gemm shapes"):  # more chunks than the map has entries
        HostBlas().chunked_gemm_bf16(x, w, y, chunk_groups, chunk, chunks=6)


def test_host_norm_writes_the_bf16_copy_alone_when_asked_and_refuses_no_output():
    """rms_norm_rows with out None (a prefill norm read only by cuBLAS GEMMs) writes the bf16 bits of the rows the
    fp32 call writes; with neither output it raises."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((4, 16)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    out, both, alone = np.empty((4, 16), np.float32), np.empty((4, 16), np.uint16), np.empty((4, 16), np.uint16)
    host_kernels.rms_norm_rows(x, w, out, eps=1e-6, offset=True, stream=None, out_bf16=both)
    host_kernels.rms_norm_rows(x, w, None, eps=1e-6, offset=True, stream=None, out_bf16=alone)
    np.testing.assert_array_equal(both, f32_to_bf16_bits(out))
    np.testing.assert_array_equal(alone, both)
    with pytest.raises(ValueError, match="needs an fp32 out"):
        host_kernels.rms_norm_rows(x, w, None, eps=1e-6, offset=True, stream=None)
