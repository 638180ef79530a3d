"""The Gated DeltaNet in-projection's tensor-core GEMV with the causal conv in its epilogue (`quant_mma_conv`): the
same bits as the GEMV then `gdn_conv`, in the simulator and on a GPU, its twin, and the shapes it refuses."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact import codec  # noqa: E402
from ninfer.artifact.formats import Q4G64, Q5G64, Q6G64, W8G32  # noqa: E402
from ninfer.backends.cuda import host_kernels  # noqa: E402
from ninfer.kernels_numba import gdn  # noqa: E402
from ninfer.kernels_numba import quant_mma as QM  # noqa: E402
from ninfer.kernels_numba import quant_mma_conv as QC  # noqa: E402

F32 = np.float32


def _parts(rng, blocks, k, upload):
    made = []
    for fmt, rows in blocks:
        payload = codec.encode_buffer(rng.standard_normal((rows, k)).astype(F32) * 0.05, fmt)
        made.append(upload(fmt, (rows, k), payload))
    return tuple(made)


def _segments(counts, records):
    """Segments of consecutive rows, one a lane (lanes in reverse order: a segment's lane is not its index)."""
    counts = np.asarray(counts, np.int32)
    lanes = len(counts)
    first_rows = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    return np.arange(lanes - 1, -1, -1, dtype=np.int32), first_rows, counts, np.asarray(records, np.int32)


def _conv_inputs(rng, channels, lanes, max_cols):
    weight = (rng.standard_normal((gdn.CONV_TAPS, channels)) * 0.5).astype(F32)
    state = rng.standard_normal((lanes, gdn.CONV_TAPS - 1, channels)).astype(F32)
    columns = np.full((lanes, max_cols, gdn.CONV_TAPS - 1, channels), np.nan, F32)
    return weight, state, columns


def test_fused_kernel_matches_the_gemv_then_the_conv_in_the_cuda_simulator():
    """W8 whole and a Q4 | Q5 pair, the channels ending inside a tile, decode and verify segments, more segments
    than a pass of the block's threads: bit for bit (`simulated_kernels.quant_mma_conv`, ~10 s)."""
    from tests.support.simulated_kernels import run

    assert run("quant_mma_conv").count("ok quant_mma_conv") == 3


def test_the_twin_is_the_gemv_then_the_conv():
    rng = np.random.default_rng(3)
    parts = _parts(rng, ((Q4G64, 20), (Q5G64, 24)), 128, host_kernels.upload_quant_mma)
    seg = _segments([1, 3, 2], [0, 1, 1])
    rows, channels = 6, 30
    x = rng.standard_normal((rows, 128)).astype(F32)
    fragments = QM.x_fragments_reference(x)
    weight, state0, columns0 = _conv_inputs(rng, channels, 3, 4)
    y, mixed = np.full((rows, 44), np.nan, F32), np.full((rows, channels), np.nan, F32)
    state, columns = state0.copy(), columns0.copy()
    host_kernels.linear_quant_mma_conv(fragments, parts, y, weight, state, columns, *seg, mixed, channels=channels,
                                       stream=0)
    want_y = np.full((rows, 44), np.nan, F32)
    host_kernels.linear_quant_mma_pair(fragments, *parts, want_y, stream=0)
    want_mixed, want_state, want_columns = np.full((rows, channels), np.nan, F32), state0.copy(), columns0.copy()
    gdn.gdn_conv_reference(want_y, weight, want_state, want_columns, *seg, want_mixed, channels=channels)
    for got, want in ((y, want_y), (mixed, want_mixed), (state, want_state), (columns, want_columns)):
        np.testing.assert_array_equal(got, want)
    assert not np.isnan(mixed).any() and not np.isnan(state).any()


def test_only_the_compiled_formats_fuse_and_bad_shapes_are_refused():
    rng = np.random.default_rng(4)
    w8, = _parts(rng, ((W8G32, 32),), 64, host_kernels.upload_quant_mma)
    q6, = _parts(rng, ((Q6G64, 32),), 64, host_kernels.upload_quant_mma)
    q4, q5 = _parts(rng, ((Q4G64, 16), (Q5G64, 16)), 64, host_kernels.upload_quant_mma)
    assert QC.has_conv_kernel((w8,)) and QC.has_conv_kernel((q4, q5))
    assert not QC.has_conv_kernel((q6,)) and not QC.has_conv_kernel((q5, q4)) and not QC.has_conv_kernel((q4, q5, w8))
    words = QM.x_fragment_words(64)
    shapes = ((gdn.CONV_TAPS, 24), (2, gdn.CONV_TAPS - 1, 24), (2, 4, gdn.CONV_TAPS - 1, 24))
    QC.check_conv_shapes(words, (w8,), (2, 32), (2, 24), 24, shapes)
    for args, match in (((words, (q6,), (2, 32), (2, 24), 24, shapes), "W "),
                        ((words, (w8,), (2, 31), (2, 24), 24, shapes), "W "),
                        ((words, (w8,), (40, 32), (40, 24), 24, shapes), "M <= 32"),
                        ((words - 1, (w8,), (2, 32), (2, 24), 24, shapes), "x words"),
                        ((words, (w8,), (2, 32), (2, 24), 33, shapes), "33 channels"),
                        ((words, (w8,), (2, 32), (1, 24), 24, shapes), "mixed"),
                        ((words, (w8,), (2, 32), (2, 24), 24, ((3, 24),) + shapes[1:]), "conv weight")):
        with pytest.raises(ValueError, match=match):
            QC.check_conv_shapes(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks,channels", [(((W8G32, 1536),), 1024), (((Q4G64, 512), (Q5G64, 1536)), 1536)])
@pytest.mark.parametrize("counts,records", [([1], [0]), ([1] * 8, [0] * 8), ([4] * 8, [1] * 8),
                                            ([1, 2, 3, 1, 9], [0, 1, 1, 0, 0]), ([1] * 20, [1, 0] * 10)])
def test_fused_kernel_on_the_gpu_equals_the_gemv_then_the_conv(blocks, channels, counts, records):
    """The 35B-A3B's kind of in-projection (W8, its z rows past the channels) and the 27B's (Q4 query|key beside Q5
    value|z, the channels running into the second block), K 2048: a step of 1 and 8 lanes, 8 lanes of MTP verify
    rows recording their histories, mixed segments, more segments than a pass: the products, conv outputs, state
    and histories bit for bit those of `linear_quant_mma` (or `_pair`) then `gdn_conv`, and the twin's within fp32
    tolerance."""
    from ninfer.kernels_numba.numba_setup import cuda

    seed = len(counts) + channels
    rng = np.random.default_rng(seed)
    k = 2048
    parts = _parts(rng, blocks, k, QM.upload_quant_mma)
    host_parts = _parts(np.random.default_rng(seed), blocks, k, host_kernels.upload_quant_mma)
    n = sum(part.shape[0] for part in parts)
    seg = _segments(counts, records)
    rows = int(sum(counts))
    weight, state0, columns0 = _conv_inputs(rng, channels, len(counts), max(counts))
    x = rng.standard_normal((rows, k)).astype(F32)
    stream = cuda.stream()
    fragments = cuda.device_array(QM.x_sets(rows) * QM.x_fragment_words(k), np.uint32, stream=stream)
    QM.x_fragments(cuda.to_device(x, stream=stream), fragments, stream=stream)
    dseg = [cuda.to_device(a, stream=stream) for a in seg]
    dweight = cuda.to_device(weight, stream=stream)
    results = []
    for fused in (True, False):
        y = cuda.to_device(np.full((rows, n), np.nan, F32), stream=stream)
        mixed = cuda.to_device(np.full((rows, channels), np.nan, F32), stream=stream)
        state, columns = cuda.to_device(state0, stream=stream), cuda.to_device(columns0, stream=stream)
        if fused:
            QC.linear_quant_mma_conv(fragments, parts, y, dweight, state, columns, *dseg, mixed, channels=channels,
                                     stream=stream)
        elif len(parts) == 2:
            QM.linear_quant_mma_pair(fragments, *parts, y, stream=stream)
        else:
            QM.linear_quant_mma(fragments, parts[0], y, stream=stream)
        if not fused:
            gdn.gdn_conv(y, dweight, state, columns, *dseg, mixed, channels=channels, stream=stream)
        results.append([a.copy_to_host(stream=stream) for a in (y, mixed, state, columns)])
    stream.synchronize()
    for name, got, want in zip(("y", "mixed", "state", "histories"), *results):
        np.testing.assert_array_equal(got, want, err_msg=name)
    y, mixed = np.full((rows, n), np.nan, F32), np.full((rows, channels), np.nan, F32)
    state, columns = state0.copy(), columns0.copy()
    host_kernels.linear_quant_mma_conv(QM.x_fragments_reference(x), host_parts, y, weight, state, columns, *seg,
                                       mixed, channels=channels, stream=0)
    got_y, got_mixed, got_state = results[0][:3]
    assert not np.isnan(got_mixed).any()
    for got, want in ((got_y, y), (got_mixed, mixed), (got_state, state)):
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
