"""The GPU Vision tower (`backends.cuda.vision`) against the CPU tower: on HostDevice over the kernels' twins (CPU),
and on the GPU with the `gpu` marker; plus each vision kernel against its twin on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from tests.support.tiny_vision_artifact import tiny_vision_qwen

# an image; a video of 4 temporal slices (attention stays inside each); a video whose 12-patch slices straddle the
# small arena's 8-row chunks
GRIDS = [(1, 4, 8), (4, 4, 4), (2, 2, 6)]


def make_device(kind: str):
    if kind == "host":
        from ninfer.backends.cuda.host import HostDevice

        return HostDevice(8 << 30)
    from ninfer.backends.cuda.device import CudaDevice

    return CudaDevice(0)


@pytest.fixture(scope="module")
def tower():
    return tiny_vision_qwen().vision_tower


SMALL_ARENA = {"chunk_rows": 8, "score_bytes": 2048}  # 8-row chunks; query blocks of 8 rows over 32 keys (2 heads)


@pytest.mark.parametrize("kind", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arena", [{}, SMALL_ARENA], ids=["default", "small"])
@pytest.mark.parametrize("grid", GRIDS)
def test_the_device_tower_matches_the_cpu_tower(tower, kind, arena, grid):
    from ninfer.backends.cuda.vision import CudaVisionTower

    t, h, w = grid
    patches = f32_to_bf16_bits(np.random.default_rng(t * h * w).uniform(-1, 1, (t * h * w, tower.dims.patch_row))
                               .astype(np.float32))
    want = tower.encode(bf16_bits_to_f32(patches), [grid])
    got = CudaVisionTower(tower, make_device(kind), max_patches=64, **arena).encode_item(patches, grid)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # bf16 weights and activations (~3e-3)


def test_the_arena_is_allocated_once_and_reused(tower):
    from ninfer.backends.cuda.host import HostDevice
    from ninfer.backends.cuda.vision import CudaVisionTower

    device = HostDevice(8 << 30)
    gpu = CudaVisionTower(tower, device, max_patches=64, **SMALL_ARENA)
    assert device.ledger["vision scratch"] == gpu.scratch_bytes
    items = [(grid, f32_to_bf16_bits(np.random.default_rng(i).uniform(-1, 1, (np.prod(grid), tower.dims.patch_row))
                                     .astype(np.float32))) for i, grid in enumerate(GRIDS)]
    first = [gpu.encode_item(patches, grid) for grid, patches in items]
    again = [gpu.encode_item(patches, grid) for grid, patches in reversed(items)]
    for a, b in zip(first, reversed(again)):
        np.testing.assert_array_equal(a, b)  # nothing of the previous item leaks through the shared scratch
    # the second pass reused every grid's position embeddings (computed once each, unchanged by the encodes)
    assert gpu._slice_embedding.cache_info().hits >= len(GRIDS)
    assert device.ledger["vision scratch"] == gpu.scratch_bytes
    with pytest.raises(ValueError, match="exceeds"):
        gpu.encode_item(np.zeros((128, tower.dims.patch_row), np.uint16), (2, 8, 8))


def test_the_arena_for_the_largest_admitted_item():
    from ninfer.backends.cuda.vision import scratch_bytes, scratch_plan
    from ninfer.targets.registry import QWEN36_27B_DIMS

    size = scratch_bytes(scratch_plan(QWEN36_27B_DIMS.vision, max_patches=131072))
    assert 2.0 * 2**30 < size < 2.1 * 2**30  # residual + q/k/v + RoPE tables (1.44 GiB), chunks, one query block


def test_the_vision_softmax_twin_is_the_unmasked_attention_softmax():
    from ninfer.kernels_numba.attention_gemm import causal_softmax_reference
    from ninfer.kernels_numba.vision import vision_softmax_reference

    scores = np.random.default_rng(1).standard_normal((2, 3, 10)).astype(np.float32) * 8
    got = vision_softmax_reference(scores)
    np.testing.assert_array_equal(got, causal_softmax_reference(scores, rows=3, first_position=10))
    np.testing.assert_allclose(bf16_bits_to_f32(got).sum(-1), 1.0, rtol=2e-2)


@pytest.mark.gpu
def test_vision_kernels_match_their_twins():
    from ninfer.kernels_numba import vision as V
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(0)
    stream = cuda.stream()

    def host(array):
        values = array.copy_to_host(stream=stream)
        stream.synchronize()
        return values

    rows, width, heads, head_dim = 37, 144, 2, 72
    x = rng.standard_normal((rows, width)).astype(np.float32)
    weight, bias = rng.standard_normal(width).astype(np.float32), rng.standard_normal(width).astype(np.float32)
    out = cuda.device_array((rows, width), np.uint16)
    d_weight, d_bias = cuda.to_device(weight), cuda.to_device(bias)
    V.layer_norm_bf16(cuda.to_device(x), d_weight, d_bias, out, eps=1e-6, stream=stream)
    # bf16 ties of a differently ordered fp32 sum
    assert np.mean(host(out) != V.layer_norm_bf16_reference(x, weight, bias, eps=1e-6)) < 0.02
    dx = cuda.to_device(x)
    V.layer_norm_bf16(dx, d_weight, d_bias, out, eps=1e-6, pending_bias=d_bias, stream=stream)
    np.testing.assert_array_equal(host(dx), V.add_rows_reference(x, bias))
    assert np.mean(host(out) != V.layer_norm_bf16_reference(x + bias, weight, bias, eps=1e-6)) < 0.02
    for exact in (False, True):
        V.bias_gelu_bf16(cuda.to_device(x), d_bias, out, exact=exact, stream=stream)
        assert np.mean(host(out) != V.bias_gelu_bf16_reference(x, bias, exact=exact)) < 0.02
    dx = cuda.to_device(x)
    V.add_rows(dx, d_bias, stream=stream)
    np.testing.assert_array_equal(host(dx), V.add_rows_reference(x, bias))
    total, first = 50, 9  # the launch covers rows first..first+rows-1 of the item
    qkv = rng.standard_normal((rows, 3 * heads * head_dim)).astype(np.float32)
    qkv_bias = rng.standard_normal(3 * heads * head_dim).astype(np.float32)
    angles = rng.uniform(0, 6, (total, head_dim // 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    outs = [cuda.to_device(np.zeros((heads, total, head_dim), np.uint16)) for _ in range(3)]
    V.vision_heads(cuda.to_device(qkv), cuda.to_device(qkv_bias), cuda.to_device(cos), cuda.to_device(sin), *outs,
                   scale=0.125, first=first, stream=stream)
    wants = V.vision_heads_reference(qkv, qkv_bias, cos[first:first + rows], sin[first:first + rows], heads=heads,
                                     scale=0.125)
    for got, want in zip(outs, wants):
        got = host(got)
        assert not got[:, :first].any() and not got[:, first + rows:].any()
        assert np.mean(got[:, first:first + rows] != want) < 0.02
    for keys in (32, 4096, 20000):  # one warp; held in registers; streamed twice (longer than HELD_KEYS)
        scores = (rng.standard_normal((heads, 3, keys)) * 6).astype(np.float32)
        probs = cuda.device_array(scores.shape, np.uint16)
        V.vision_softmax(cuda.to_device(scores), probs, stream=stream)
        got, want = bf16_bits_to_f32(host(probs)), bf16_bits_to_f32(V.vision_softmax_reference(scores))
        assert np.mean(got != want) < 0.02
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-30)  # at most one bf16 step apart
    o = rng.standard_normal((heads, 5, head_dim)).astype(np.float32)
    merged = cuda.device_array((5, heads * head_dim), np.uint16)
    V.vision_merge_heads(cuda.to_device(o), merged, stream=stream)
    np.testing.assert_array_equal(host(merged), V.vision_merge_heads_reference(o))


def test_the_gpu_tower_bench_runs_on_the_host_device(tower):
    import importlib.util
    from pathlib import Path

    from ninfer.backends.cuda.host import HostDevice

    path = Path(__file__).resolve().parents[1] / "bench" / "vision_tower_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_vision_tower_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.time_tower(HostDevice(8 << 30), tower, [8, 16], parity_size=8, max_patches=64)  # 4x4, 8x8 patches
    assert [row["merged_tokens"] for row in rows] == [4, 16]
    assert rows[0]["relative_difference_to_host_tower"] < 1e-2
    assert "encode_item" in bench.host_profile(lambda: tower.encode_item(np.zeros((16, tower.dims.patch_row),
                                                                                  np.uint16), (1, 4, 4)))
