"""The CUDA backend's plumbing on a real GPU: allocations and the ledger, cuBLAS through nvmath on raw pointers, and
graph capture of numba launches together with cuBLAS calls."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def device():
    from ninfer.backends.cuda.device import CudaDevice

    return CudaDevice(0)


def assert_bf16_rows_match(got, want, end: int, note=None) -> None:
    """bf16 bits of a GPU GEMM against its host twin: rows below `end` within one bf16 step, the rows past it (which
    the call must leave alone; NaN fill in these tests) the same bits."""
    np.testing.assert_array_equal(got[end:], want[end:])
    got32, want32 = bf16_bits_to_f32(got[:end]), bf16_bits_to_f32(want[:end])
    assert np.all(np.abs(got32 - want32) <= np.abs(want32) * 2.0 ** -7 + 1e-6), note


def test_allocations_are_charged_to_their_purpose(device):
    before = device.ledger["test"]
    zeros = device.zeros((3, 5), np.float32, "test")
    assert device.ledger["test"] - before == 60
    assert not zeros.copy_to_host().any()
    assert device.info.total_bytes > device.info.free_bytes > 0


def test_a_missing_device_index_is_a_clear_error():
    from ninfer.backends.cuda.device import CudaDevice, CudaUnavailableError

    with pytest.raises(CudaUnavailableError, match="GPU"):
        CudaDevice(99)


def test_memset_and_device_copies(device):
    from ninfer.backends.cuda.device import copy_device, memset

    a = device.upload(np.arange(10, dtype=np.float32), "test")
    b = device.empty(10, np.float32, "test")
    copy_device(b, a, device.stream_handle)
    memset(a[:5], device.stream_handle)
    device.synchronize()
    assert b.copy_to_host().tolist() == list(range(10))
    assert a.copy_to_host().tolist() == [0] * 5 + [5, 6, 7, 8, 9]


@pytest.mark.parametrize("m,n,k,width,first", [(1, 64, 64, 64, 0), (130, 200, 192, 200, 0), (512, 1024, 320, 1024, 0),
                                               (130, 96, 192, 320, 200)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_bf16_matches_numpy(device, m, n, k, width, first, accumulate):
    """y[:, first:first + N] (+)= x @ w^T; with a wider y (first_column: cuBLAS's leading dimension is y's row
    length) its other columns keep their values; a block past y's width is refused."""
    from ninfer.backends.cuda.blas import Blas

    rng = np.random.default_rng(m + n)
    x, w = f32_to_bf16_bits(rng.standard_normal((m, k))), f32_to_bf16_bits(rng.standard_normal((n, k)) * 0.1)
    y0 = rng.standard_normal((m, width)).astype(np.float32)
    y = device.upload(y0, "test")
    blas = Blas(device)
    blas.gemm_bf16(device.upload(x, "test"), device.upload(w, "test"), y, accumulate=accumulate, first_column=first)
    device.synchronize()
    block = np.s_[:, first:first + n]
    want = bf16_bits_to_f32(x).astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T
    if accumulate:
        want += y0[block]
    got = y.copy_to_host()
    assert np.linalg.norm(got[block] - want) / np.linalg.norm(want) < 1e-5
    assert np.array_equal(np.delete(got, np.s_[first:first + n], axis=1), np.delete(y0, np.s_[first:first + n], axis=1))
    with pytest.raises(ValueError, match="gemm shapes"):
        blas.gemm_bf16(device.upload(x, "test"), device.upload(w, "test"), y, first_column=width - n + 1)
    blas.close()


def test_views_are_built_once_and_element_reads_are_read_every_time(device):
    from ninfer.backends.cuda.views import VIEWS_PER_ARRAY, ViewMemoArray
    from ninfer.kernels_numba.elementwise import to_bf16_rows

    a = device.upload(np.arange(24, dtype=np.float32).reshape(6, 4), "test")
    rows = a[:3]
    assert isinstance(rows, ViewMemoArray) and a[:3] is rows and a[:4] is not rows
    assert rows.copy_to_host().tolist() == np.arange(12).reshape(3, 4).tolist()
    assert a.reshape(24) is a.reshape((24,)) and a.reshape(24)[5:7].copy_to_host().tolist() == [5, 6]
    halves = a.view(np.uint16)
    assert halves is a.view("uint16") and isinstance(halves, ViewMemoArray) and halves.shape == (6, 8)
    assert halves[:1].copy_to_host().tolist() == [np.arange(4, dtype=np.float32).view(np.uint16).tolist()]
    assert a[:, 1].copy_to_host().tolist() == [1, 5, 9, 13, 17, 21]
    assert a[1, 2] == 6.0
    device.write(a, np.zeros((6, 4), np.float32))
    device.synchronize()  # the write is queued on the serving stream; numba's element read is not ordered after it
    assert a[1, 2] == 0.0 and not rows.copy_to_host().any()
    for stop in range(2 * VIEWS_PER_ARRAY):  # ever new bounds: the memo stays bounded
        a[: stop % 6 + 1, stop % 4 :]
    assert len(a.__dict__["_memo"]) <= VIEWS_PER_ARRAY
    out = device.empty((3, 4), np.uint16, "test")
    device.write(a, np.full((6, 4), 1.5, np.float32))
    to_bf16_rows(a[:3], out[:3], stream=device.stream)  # kernels take remembered views
    assert device.read(out).tolist() == [[0x3FC0] * 4] * 3


def test_small_writes_go_through_pinned_slots_in_stream_order(device):
    """Three times as many writes as there are slots, each host array changed right after its write returns, two
    writes to one row (the later wins), then one read sees them all; values past a slot and a strided read take
    numba's copies."""
    from ninfer.backends.cuda.staging import SLOT_BYTES, SLOTS

    rows = 3 * SLOTS
    a = device.zeros((rows, 16), np.int32, "test")
    host = np.zeros(16, np.int32)
    for r in range(rows):
        host[:] = r
        device.write(a[r], host)
        host[:] = -1
    device.write(a[0], np.full(16, 7, np.int32))
    got = device.read(a)
    assert got[0].tolist() == [7] * 16 and got[1:].tolist() == [[r] * 16 for r in range(1, rows)]
    assert device.read(a[:, 3]).tolist() == [7] + list(range(1, rows))
    big = device.empty((SLOT_BYTES // 4 + 1,), np.float32, "test")
    values = np.arange(big.shape[0], dtype=np.float32)
    device.write(big, values)
    assert np.array_equal(device.read(big), values)


def test_pitched_writes_fill_the_first_columns_of_some_rows_in_stream_order(device):
    """`write_rows`: the first W columns of rows 2..4 of a wider array in one pitched copy, the rest untouched;
    more such writes than there are slots, each host array changed once its write returns, the later write to a
    cell winning; values past a slot go down a row at a time."""
    from ninfer.backends.cuda.staging import SLOT_BYTES, SLOTS

    a = device.upload(np.full((6, 16), -1, np.int32), "test")
    host = np.zeros((3, 5), np.int32)
    for r in range(3 * SLOTS):
        host[:] = np.arange(15).reshape(3, 5) + 100 * r
        device.write_rows(a[2:5, :5], host)
        host[:] = -7
    want = np.full((6, 16), -1, np.int32)
    want[2:5, :5] = np.arange(15).reshape(3, 5) + 100 * (3 * SLOTS - 1)
    assert device.read(a).tolist() == want.tolist()
    wide = SLOT_BYTES // 8 + 16  # two rows of it pass a slot
    big = device.zeros((3, wide + 4), np.int32, "test")
    values = np.arange(2 * wide, dtype=np.int32).reshape(2, wide)
    device.write_rows(big[:2, :wide], values)
    got = device.read(big)
    assert np.array_equal(got[:2, :wide], values) and not got[2].any() and not got[:, wide:].any()


def test_grouped_gemm_multiplies_each_row_group_by_its_own_weight_block(device):
    """The MoE prefill's grouped GEMM: groups of varied size, empty ones included, bf16 outputs (fp32 sums rounded
    once), rows past the last group left as they were; the same call again on other sizes reuses the address table
    in stream order."""
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.host import HostBlas

    rng = np.random.default_rng(3)
    n, k = 48, 128
    blas = Blas(device)
    for sizes in ([5, 0, 130, 1, 0, 17], [0, 64, 3, 3, 0, 200]):
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        rows = int(offsets[-1]) + 3
        x = f32_to_bf16_bits(rng.standard_normal((rows, k)))
        w = f32_to_bf16_bits(rng.standard_normal((len(sizes) * n, k)) * 0.1)
        y = device.upload(np.full((rows, n), 0x7FC1, np.uint16), "test")
        blas.grouped_gemm_bf16(device.upload(x, "test"), device.upload(w, "test"), y, offsets, n)
        device.synchronize()
        want = np.full((rows, n), 0x7FC1, np.uint16)
        HostBlas().grouped_gemm_bf16(x, w, want, offsets, n)
        assert_bf16_rows_match(y.copy_to_host(), want, int(offsets[-1]), sizes)
    with pytest.raises(ValueError, match="grouped gemm"):
        blas.grouped_gemm_bf16(device.upload(x, "test"), device.upload(w[:-1], "test"), y, offsets, n)
    with pytest.raises(ValueError, match="grouped gemm"):
        blas.grouped_gemm_bf16(device.upload(x, "test"), device.upload(w, "test"),
                               device.upload(np.zeros((rows, n), np.float32), "test"), offsets, n)
    blas.close()


def test_batched_gemm_multiplies_each_padded_group_by_its_own_weight_block(device):
    """The padded MoE prefill's strided-batched GEMM: equal groups of rows, bf16 outputs within one bf16 step of the
    host twin; a shape that does not split into equal groups is refused."""
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.host import HostBlas

    rng = np.random.default_rng(4)
    groups, p, n, k = 5, 37, 48, 128
    x = f32_to_bf16_bits(rng.standard_normal((groups * p, k)))
    w = f32_to_bf16_bits(rng.standard_normal((groups * n, k)) * 0.1)
    y = device.upload(np.full((groups * p, n), 0x7FC1, np.uint16), "test")
    blas = Blas(device)
    blas.batched_gemm_bf16(device.upload(x, "test"), device.upload(w, "test"), y, groups)
    device.synchronize()
    want = np.zeros((groups * p, n), np.uint16)
    HostBlas().batched_gemm_bf16(x, w, want, groups)
    assert_bf16_rows_match(y.copy_to_host(), want, groups * p)
    with pytest.raises(ValueError, match="batched gemm shapes"):
        blas.batched_gemm_bf16(device.upload(x[:-1], "test"), device.upload(w, "test"), y, groups)
    blas.close()


def test_split_k_gemm_slices_sum_to_the_whole_product(device):
    """The out projection's sliced GEMM (each K slice a batch entry): the slices' fp32 partials sum to gemm_bf16's
    product within fp32 rounding, each slice is its own block of K; shapes that do not slice are refused."""
    from ninfer.backends.cuda.blas import Blas

    rng = np.random.default_rng(6)
    m, n, k, slices = 8, 96, 512, 4
    x = f32_to_bf16_bits(rng.standard_normal((m, k)))
    w = f32_to_bf16_bits(rng.standard_normal((n, k)) * 0.1)
    blas = Blas(device)
    partials = device.upload(np.full((slices, m, n), np.nan, np.float32), "test")
    whole = device.upload(np.zeros((m, n), np.float32), "test")
    dx, dw = device.upload(x, "test"), device.upload(w, "test")
    blas.split_k_gemm_bf16(dx, dw, partials, slices)
    blas.gemm_bf16(dx, dw, whole)
    device.synchronize()
    got, want = partials.copy_to_host(), whole.copy_to_host()
    assert np.abs(got.sum(axis=0) - want).max() < 1e-5 * np.abs(want).max()
    part = k // slices
    last = bf16_bits_to_f32(x[:, -part:]) @ bf16_bits_to_f32(w[:, -part:]).T
    assert np.abs(got[-1] - last).max() < 1e-5 * np.abs(last).max()
    with pytest.raises(ValueError, match="split-K gemm shapes"):
        blas.split_k_gemm_bf16(dx, dw, partials, 3)
    blas.close()


def test_chunked_gemm_multiplies_each_chunk_by_its_groups_weight_block(device):
    """The chunked MoE prefill's pointer-array batched GEMM: chunks of one group or another in any order, bf16
    outputs within one bf16 step of the host twin, rows past the chunks untouched, the same bits with the groups on
    the device; the same call again on other chunks reuses the address table in stream order."""
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.host import HostBlas

    rng = np.random.default_rng(5)
    chunk, n, k, groups = 32, 48, 128, 5
    blas = Blas(device)
    w = f32_to_bf16_bits(rng.standard_normal((groups * n, k)) * 0.1)
    for chunk_groups in (np.array([0, 0, 3, 1, 4, 4, 4]), np.array([2, 1])):
        rows = len(chunk_groups) * chunk + 5
        x = f32_to_bf16_bits(rng.standard_normal((rows, k)))
        y = device.upload(np.full((rows, n), 0x7FC1, np.uint16), "test")
        blas.chunked_gemm_bf16(device.upload(x, "test"), device.upload(w, "test"), y, chunk_groups, chunk)
        device.synchronize()
        want = np.full((rows, n), 0x7FC1, np.uint16)
        HostBlas().chunked_gemm_bf16(x, w, want, chunk_groups, chunk)
        assert_bf16_rows_match(y.copy_to_host(), want, len(chunk_groups) * chunk, chunk_groups)
        # the groups on the device (the model's moe_chunk_groups): a kernel writes the addresses; the same call
        on_device = device.upload(np.full((rows, n), 0x7FC1, np.uint16), "test")
        longer = np.concatenate([chunk_groups, [groups - 1] * 3]).astype(np.int32)  # entries past `chunks` unused
        blas.chunked_gemm_bf16(device.upload(x, "test"), device.upload(w, "test"), on_device,
                               device.upload(longer, "test"), chunk, chunks=len(chunk_groups))
        device.synchronize()
        np.testing.assert_array_equal(on_device.copy_to_host(), y.copy_to_host())
    with pytest.raises(ValueError, match="chunked gemm shapes"):
        blas.chunked_gemm_bf16(device.upload(x, "test"), device.upload(w, "test"), y, np.array([groups]), chunk)
    blas.close()


def test_a_captured_graph_replays_numba_launches_and_cublas_together(device):
    from ninfer.backends.cuda.blas import Blas
    from ninfer.backends.cuda.graphs import capture
    from ninfer.kernels_numba.fill import fill_uniform, fill_uniform_reference
    from ninfer.kernels_numba.elementwise import to_bf16_rows

    blas = Blas(device)
    w_host = f32_to_bf16_bits(np.random.default_rng(1).standard_normal((96, 128)) * 0.1)
    w = device.upload(w_host, "test")
    x = device.empty((4, 128), np.float32, "test")
    x_bf16 = device.empty((4, 128), np.uint16, "test")
    y = device.empty((4, 96), np.float32, "test")
    seed = [5]

    def step():
        fill_uniform(x, seed=seed[0], scale=1.0, stream=device.stream)
        to_bf16_rows(x, x_bf16, stream=device.stream)
        blas.gemm_bf16(x_bf16, w, y)

    step()
    device.synchronize()
    graph = capture(device.stream_handle, step)
    y.copy_to_device(np.full((4, 96), np.nan, np.float32))
    graph.replay(device.stream_handle)
    device.synchronize()
    x_want = bf16_bits_to_f32(f32_to_bf16_bits(fill_uniform_reference(4 * 128, np.float32, seed=5, scale=1.0)))
    want = x_want.reshape(4, 128).astype(np.float64) @ bf16_bits_to_f32(w_host).astype(np.float64).T
    got = y.copy_to_host()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    graph.close()
    blas.close()
