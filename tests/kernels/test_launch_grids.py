"""Launch geometry of the kernels whose grid grows with a prompt or a context: CUDA caps grid y and z at 65,535
blocks (x at 2^31 - 1), so the dimension that grows must be x. The flash prefill of the 35B-A3B failed on the GPU
for this (8 query heads a KV head x 8192 rows on y). The launchers run here against a recorder instead of the
kernel: nothing compiles, nothing runs."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.kernels_numba import attention_gemm, layout

GRID_YZ_LIMIT = 65_535
GRID_X_LIMIT = 2**31 - 1


class LaunchRecorder:
    """Stands in for a numba kernel: records the grid of `kernel[grid, block, stream](...)`."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, config):
        grid = config[0] if isinstance(config[0], tuple) else (config[0],)
        self.grids.append(tuple(int(v) for v in grid) + (1,) * (3 - len(grid)))
        return lambda *args: None


def assert_launchable(grids) -> None:
    assert grids
    for x, y, z in grids:
        assert 1 <= x <= GRID_X_LIMIT and 1 <= y <= GRID_YZ_LIMIT and 1 <= z <= GRID_YZ_LIMIT, (x, y, z)


@pytest.fixture
def record(monkeypatch):
    def install(module, name):
        recorder = LaunchRecorder()
        monkeypatch.setattr(module, name, recorder)
        return recorder

    return install


LONG = 262_144  # the models' context length, and far past grid y's limit


def test_prefill_attention_glue_launches_at_long_prompts_and_contexts(record):
    kv_heads, group, head_dim = 2, 8, 256  # the 35B-A3B: group x rows is what overflowed
    pack = record(attention_gemm, "_pack_queries")
    attention_gemm.pack_queries(np.zeros((1, kv_heads * group, head_dim), np.float32),
                                np.zeros((kv_heads, 1, head_dim), np.uint16), first=0, rows=LONG, group=group,
                                scale=0.0625, stream=0)
    assert_launchable(pack.grids)
    gather = record(attention_gemm, "_gather_kv")
    pool = np.zeros((1, 16, kv_heads, head_dim), np.uint16)
    attention_gemm.gather_kv(np.zeros((1, 1), np.int32), 0, LONG, pool, None, np.zeros((kv_heads, 1, head_dim),
                                                                                    np.uint16), stream=0)
    assert_launchable(gather.grids)
    turned = record(attention_gemm, "_gather_kv_transposed")
    attention_gemm.gather_kv(np.zeros((1, 1), np.int32), 0, LONG, pool, None, np.zeros((kv_heads, head_dim, 8),
                                                                                    np.uint16), stream=0,
                             transposed=True)
    assert_launchable(turned.grids)
    unpack = record(attention_gemm, "_unpack_gated")
    attention_gemm.unpack_gated(np.zeros((kv_heads, group * 8192, head_dim), np.float32),
                                np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), first=0, rows=8192,
                                group=group, stream=0)
    assert_launchable(unpack.grids)
    softmax = record(attention_gemm, "_causal_softmax")
    attention_gemm.causal_softmax(np.zeros((kv_heads, group * 8192, 1), np.float32),
                                  np.zeros((kv_heads, group * 8192, 1), np.uint16), rows=8192, first_position=0,
                                  stream=0)
    assert_launchable(softmax.grids)


def test_row_layout_kernels_launch_for_any_prefill_chunk(record):
    rows = 131_072  # --prefill-chunk has no upper bound
    concat = record(layout, "_concat_columns")
    layout.concat_columns(np.zeros((rows, 2), np.float32), np.zeros((rows, 3), np.float32),
                          np.zeros((rows, 5), np.float32), stream=0)
    assert_launchable(concat.grids)
    gather = record(layout, "_gather_rows")
    layout.gather_rows(np.zeros((4, 3), np.float32), np.zeros(rows, np.int32), np.zeros((rows, 3), np.float32),
                       stream=0)
    assert_launchable(gather.grids)


def test_gdn_conv_launches_for_a_whole_context_in_one_chunk(record):
    """The conv puts rows on grid y (8 rows a thread, one thread a block along rows): a chunk of the models' whole
    context stays within the limit."""
    from ninfer.kernels_numba import gdn

    conv = record(gdn, "_gdn_conv_kernel")
    channels = 8192
    segments = [np.zeros(1, np.int32)] * 4
    gdn.gdn_conv(np.zeros((LONG, 1), np.float32), np.zeros((gdn.CONV_TAPS, channels), np.float32), None, None,
                 *segments, None, channels=channels, stream=0)
    assert_launchable(conv.grids)
