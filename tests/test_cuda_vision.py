"""The GPU Vision tower (`backends.cuda.vision`) against the CPU tower: on HostDevice over the kernels' twins (CPU),
and on the GPU with the `gpu` marker; plus each vision kernel against its twin on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from tests.support.tiny_vision_artifact import tiny_vision_qwen

GRIDS = [(1, 4, 8), (4, 4, 4)]  # an image; a video of 4 temporal slices (attention stays inside each)


def make_device(kind: str):
    if kind == "host":
        from ninfer.backends.cuda.host import HostDevice

        return HostDevice(8 << 30)
    from ninfer.backends.cuda.device import CudaDevice

    return CudaDevice(0)


@pytest.fixture(scope="module")
def tower():
    return tiny_vision_qwen().vision_tower


@pytest.mark.parametrize("kind", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("grid", GRIDS)
def test_the_device_tower_matches_the_cpu_tower(tower, kind, grid):
    from ninfer.backends.cuda.vision import CudaVisionTower

    t, h, w = grid
    patches = f32_to_bf16_bits(np.random.default_rng(t * h * w).uniform(-1, 1, (t * h * w, tower.dims.patch_row))
                               .astype(np.float32))
    want = tower.encode(bf16_bits_to_f32(patches), [grid])
    got = CudaVisionTower(tower, make_device(kind)).encode_item(patches, grid)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # bf16 weights and activations (~3e-3)


@pytest.mark.gpu
def test_vision_kernels_match_their_twins():
    from ninfer.kernels_numba import vision as V
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(0)
    stream = cuda.stream()
    rows, width, heads, head_dim = 37, 144, 2, 72
    x = rng.standard_normal((rows, width)).astype(np.float32)
    weight, bias = rng.standard_normal(width).astype(np.float32), rng.standard_normal(width).astype(np.float32)
    out = cuda.device_array((rows, width), np.uint16)
    V.layer_norm_bf16(cuda.to_device(x), cuda.to_device(weight), cuda.to_device(bias), out, eps=1e-6, stream=stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    want = V.layer_norm_bf16_reference(x, weight, bias, eps=1e-6)
    assert np.mean(got != want) < 0.02  # bf16 ties of a differently ordered fp32 sum
    for exact in (False, True):
        V.bias_gelu_bf16(cuda.to_device(x), cuda.to_device(bias), out, exact=exact, stream=stream)
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        assert np.mean(got != V.bias_gelu_bf16_reference(x, bias, exact=exact)) < 0.02
    dx = cuda.to_device(x)
    V.add_rows(dx, cuda.to_device(bias), extra=cuda.to_device(2 * x), stream=stream)
    np.testing.assert_allclose(dx.copy_to_host(stream=stream), V.add_rows_reference(x, bias, 2 * x), rtol=1e-6)
    qkv = rng.standard_normal((rows, 3 * heads * head_dim)).astype(np.float32)
    qkv_bias = rng.standard_normal(3 * heads * head_dim).astype(np.float32)
    angles = rng.uniform(0, 6, (rows, head_dim // 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    outs = [cuda.device_array((heads, rows, head_dim), np.uint16) for _ in range(3)]
    V.vision_heads(cuda.to_device(qkv), cuda.to_device(qkv_bias), cuda.to_device(cos), cuda.to_device(sin), *outs,
                   scale=0.125, stream=stream)
    for got, want in zip(outs, V.vision_heads_reference(qkv, qkv_bias, cos, sin, heads=heads, scale=0.125)):
        assert np.mean(got.copy_to_host(stream=stream) != want) < 0.02
    o = rng.standard_normal((heads, 5, head_dim)).astype(np.float32)
    merged = cuda.to_device(np.zeros((rows, heads * head_dim), np.uint16))
    V.vision_merge_heads(cuda.to_device(o), merged, first=3, stream=stream)
    np.testing.assert_array_equal(merged.copy_to_host(stream=stream)[3:8], V.vision_merge_heads_reference(o))


def test_the_gpu_tower_bench_runs_on_the_host_device(tower):
    import importlib.util
    from pathlib import Path

    from ninfer.backends.cuda.host import HostDevice

    path = Path(__file__).resolve().parents[1] / "bench" / "vision_tower_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_vision_tower_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.time_tower(HostDevice(8 << 30), tower, [8, 16], parity_size=8)  # 4x4 and 8x8 patches
    assert [row["merged_tokens"] for row in rows] == [4, 16]
    assert rows[0]["relative_difference_to_host_tower"] < 1e-2
