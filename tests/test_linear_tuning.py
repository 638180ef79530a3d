"""The choice of decode paths (`linear_tuning.fastest_paths`): the fastest candidate, ties to the default."""

from __future__ import annotations

from ninfer.backends.cuda.linear_tuning import DECODE_PATHS, candidate_paths, fastest_paths
from ninfer.kernels_numba.linear_narrow import NARROW_MAX_K


def test_the_narrow_kernel_is_a_candidate_only_up_to_its_widest_k():
    assert candidate_paths((2048, NARROW_MAX_K)) == DECODE_PATHS
    assert candidate_paths((2048, NARROW_MAX_K + 64)) == ("cublas", "mma", "kernels")


def test_the_tensor_core_kernel_is_a_candidate_only_for_whole_64_column_blocks():
    assert candidate_paths((2048, 4096)) == DECODE_PATHS
    assert candidate_paths((2048, 4104)) == ("cublas", "kernels", "narrow")


def test_each_shape_takes_its_fastest_path_and_ties_keep_cublas():
    times = {((2048, 4096), "cublas"): 14.2, ((2048, 4096), "mma"): 7.0, ((2048, 4096), "kernels"): 9.0,
             ((2048, 4096), "narrow"): 6.5,
             ((12288, 2048), "cublas"): 16.2, ((12288, 2048), "mma"): 17.0, ((12288, 2048), "kernels"): 18.0,
             ((12288, 2048), "narrow"): 30.0,
             ((264, 2048), "cublas"): 5.0, ((264, 2048), "mma"): 5.0, ((264, 2048), "kernels"): 5.0,
             ((264, 2048), "narrow"): 6.0,
             ((64, 16384), "cublas"): 8.0, ((64, 16384), "mma"): 7.5, ((64, 16384), "kernels"): 7.0}
    calls = []

    def seconds(shape, path):
        calls.append((shape, path))
        return times[shape, path]

    shapes = [(2048, 4096), (12288, 2048), (2048, 4096), (264, 2048), (64, 16384)]
    paths, timings = fastest_paths(shapes, seconds)
    assert paths == {(2048, 4096): "narrow", (12288, 2048): "cublas", (264, 2048): "cublas",
                     (64, 16384): "kernels"}
    assert timings[(64, 16384)] == {"cublas": 8.0, "mma": 7.5, "kernels": 7.0}
    assert len(calls) == len(set(calls)) == len(times)  # each distinct shape and path timed once
