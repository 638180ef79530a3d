"""The prefill's chunked expert GEMM from quantized experts (`quant_mma_chunked`): the twin against a row-by-row
product, the shapes it refuses, the kernel in the CUDA simulator and on a GPU against the twin."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact import codec  # noqa: E402
from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32  # noqa: E402
from ninfer.kernels_numba import quant_mma as QM  # noqa: E402
from ninfer.kernels_numba import quant_mma_chunked as QC  # noqa: E402
from tests.support.simulated_kernels import check_chunked_output, quant_mma_chunked_case  # noqa: E402


def test_chunked_rows_name_each_chunks_expert_first_row_and_routed_rows():
    """Experts with 5, 40, 0 and 33 rows in chunks of 32: expert 1 takes chunks 1-2 (32 + 8), expert 3 chunks 3-4
    (32 + 1); the surplus chunk 5 (the last expert's, past its rows) holds none."""
    offsets = np.array([0, 5, 45, 45, 78], np.int32)
    starts = np.array([0, 32, 96, 96], np.int32)
    groups = np.array([0, 1, 1, 3, 3, 3], np.int32)
    assert QC.chunked_rows(groups, offsets, starts, chunk=32, chunks=6) == [
        (0, 0, 5), (1, 32, 32), (1, 64, 8), (3, 96, 32), (3, 128, 1)]
    assert QC.chunked_rows(groups, offsets, starts, chunk=32, chunks=2) == [(0, 0, 5), (1, 32, 32)]


@pytest.mark.parametrize("swiglu", [False, True])
def test_the_twin_is_each_routed_rows_product_with_its_expert_rounded_once(swiglu):
    rng = np.random.default_rng(3)
    case = quant_mma_chunked_case(rng, Q4G64, counts=[5, 40, 0, 33], chunk=32, rpe=128, k=128, swiglu=swiglu,
                                  upload=False)
    want, x = case["want"], case["x"]
    stacked = codec.decode(case["payload"], Q4G64, (4 * 128, 128)).astype(np.float64)
    found = QC.chunked_rows(case["chunk_groups"], case["offsets"], case["starts"], chunk=32, chunks=case["chunks"])
    for e, first, rows in found:
        for p in range(first, first + rows):
            product = codec.bf16_bits_to_f32(x[p]).astype(np.float64) @ stacked[e * 128:(e + 1) * 128].T
            if swiglu:
                gate, up = product[:64], product[64:]
                product = gate / (1 + np.exp(-gate)) * up
            np.testing.assert_allclose(codec.bf16_bits_to_f32(want[p]), product, rtol=1e-2, atol=1e-3)
    routed = sum(rows for *_, rows in found)
    assert routed == 78 and np.count_nonzero((want != 0xFFFF).all(axis=1)) == routed


@pytest.mark.parametrize("change,match", [
    (dict(chunk=48), "multiple of 32"),
    (dict(rows_per_expert=24), "multiple of 16"),
    (dict(chunks=9), "pass x's"),
    (dict(swiglu=False), "SwiGLU output only"),
])
def test_shapes_are_checked_before_launch(change, match):
    weight = QM.QuantMmaWeight(Q4G64, (256, 128), None, None, None, 2, 0, swiglu_rows=128)
    arguments = dict(rows_per_expert=128, chunk=32, chunks=2, swiglu=True) | change
    with pytest.raises(ValueError, match=match):
        QC.check_chunked_shapes((64, 128), weight, (64, 64), **arguments)
    QC.check_chunked_shapes((64, 128), weight, (64, 64), rows_per_expert=128, chunk=32, chunks=2, swiglu=True)


@pytest.mark.slow
def test_the_kernel_matches_its_twin_in_the_cuda_simulator():
    """Every format's decode, the SwiGLU output, chunks of one and two 32-row pieces, pieces of 1 to 32 routed
    rows, warps past an expert's tiles and a surplus chunk (`simulated_kernels.quant_mma_chunked`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("quant_mma_chunked").splitlines()
                if line.startswith("ok quant_mma_chunked")]) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [Q4G64, Q5G64, Q6G64, W8G32])
@pytest.mark.parametrize("swiglu,rpe,k", [(True, 1024, 2048), (False, 2048, 512), (False, 48, 192)])
@pytest.mark.parametrize("chunk", [32, 128])
def test_the_gpu_kernel_matches_its_twin(fmt, swiglu, rpe, k, chunk):
    """The 35B-A3B's expert shapes (gate|up 1024 x 2048 stored for SwiGLU, down 2048 x 512) and a small one (3 tiles
    an expert), 24 experts with 0 to ~70 routed rows each, on the GPU against the twin; rows nothing routes keep
    y's contents."""
    from numba import cuda

    rng = np.random.default_rng(5)
    counts = [int(c) for c in rng.poisson(24, 24)]
    counts[3] = 0
    counts[7] = 70
    case = quant_mma_chunked_case(rng, fmt, counts=counts, chunk=chunk, rpe=rpe, k=k, swiglu=swiglu)
    maps = [cuda.to_device(case[name]) for name in ("chunk_groups", "offsets", "starts")]
    y = cuda.to_device(case["y"])
    QC.linear_quant_mma_chunked(cuda.to_device(case["x"]), case["weight"], *maps, y, rows_per_expert=rpe,
                                chunk=chunk, chunks=case["chunks"], swiglu=swiglu, stream=0)
    check_chunked_output(y.copy_to_host(), case["want"], f"{fmt} swiglu {swiglu} rpe {rpe} chunk {chunk}")
