"""moe_decode.py: the decode MoE's routed experts in one launch (router, routing, gate | up, SwiGLU down as items
of one grid). CPU: the twin against exact arithmetic, the launch's typed errors, the kernel in the CUDA simulator.
GPU: bit for bit the separate kernels on every grid, counters left at zero, launch after launch."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda")

from ninfer.artifact.codec import bf16_bits_to_f32  # noqa: E402
from ninfer.kernels_numba import moe_decode as MD  # noqa: E402
from tests.support.simulated_kernels import moe_decode_case, moe_decode_separately  # noqa: E402


from tests.support.simulated_kernels import moe_decode_launch, moe_decode_outputs  # noqa: E402

EVERY_INPUT_ROUNDED = MD.ROUND_ROUTER | MD.ROUND_SHARED_GATE_UP | MD.ROUND_SHARED_DOWN


def _twin(case, rounding=0):
    return MD.moe_decode_bf16_reference(case["h"], case["router_w"], case["top_k"], case["gate_up_w"], case["down_w"],
                                        case["shared_gate_up_w"], case["shared_down_w"], experts=case["experts"],
                                        rounding=rounding)


def _swiglu_down(gate_up, down):
    g, u = np.split(gate_up, 2)
    return down @ (g / (1 + np.exp(-g)) * u)


def test_twin_is_exact_arithmetic_rounded_to_fp32():
    case = moe_decode_case(np.random.default_rng(1), 3, top_k=8)
    logits, ids, weights, _, out, _, shared_out = _twin(case)
    h = case["h"].astype(np.float64)
    w = {name: bf16_bits_to_f32(case[name]).astype(np.float64)
         for name in ("router_w", "gate_up_w", "down_w", "shared_gate_up_w", "shared_down_w")}
    np.testing.assert_allclose(logits, h @ w["router_w"].T, rtol=1e-5, atol=1e-4)
    assert np.all(np.diff(ids, axis=1) > 0) and np.allclose(weights.sum(axis=1), 1.0)
    experts, hidden = case["experts"], h.shape[1]
    inter2 = w["gate_up_w"].shape[0] // experts
    for m in range(h.shape[0]):
        for s, e in enumerate(ids[m]):
            gate_up = w["gate_up_w"][e * inter2:(e + 1) * inter2] @ h[m]
            np.testing.assert_allclose(out[m, s], _swiglu_down(gate_up, w["down_w"][e * hidden:(e + 1) * hidden]),
                                       rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(shared_out[m], _swiglu_down(w["shared_gate_up_w"] @ h[m], w["shared_down_w"]),
                                   rtol=1e-4, atol=1e-3)


def test_rounding_rounds_only_what_it_names():
    case = moe_decode_case(np.random.default_rng(2), 2, top_k=4)
    plain, rounded = _twin(case), _twin(case, EVERY_INPUT_ROUNDED)
    for i in (3, 4):  # the routed experts read fp32 rows whatever the rounding (as the gathered kernels do)
        if np.array_equal(plain[1], rounded[1]):
            np.testing.assert_array_equal(plain[i], rounded[i])
    assert not np.array_equal(plain[0], rounded[0]) and not np.array_equal(plain[5], rounded[5])
    np.testing.assert_allclose(rounded[0], plain[0], rtol=2e-2, atol=5e-2)


def _launch_args(rows=1, hidden=64, inter=32, experts=16, top_k=4, router_rows=24, columns=24, shared=24,
                 counters=None):
    outputs = moe_decode_outputs(rows, top_k, hidden=hidden, inter=inter, shared_inter=shared, columns=columns)
    case = dict(h=np.zeros((rows, hidden), np.float32), router_w=np.zeros((router_rows, hidden), np.uint16),
                gate_up_w=np.zeros((experts * 2 * inter, hidden), np.uint16),
                down_w=np.zeros((experts * hidden, inter), np.uint16),
                shared_gate_up_w=np.zeros((2 * shared, hidden), np.uint16),
                shared_down_w=np.zeros((hidden, shared), np.uint16), experts=16, top_k=top_k)
    return case, np.zeros(MD.COUNTERS if counters is None else counters, np.int32), outputs


@pytest.mark.parametrize("changes,message", [
    (dict(rows=9), "at most 8 rows"),
    (dict(top_k=9), "routing supports|at most 8 rows of at most 8 experts"),
    (dict(columns=16), "router"),
    (dict(hidden=12), "a multiple of 8"),
    (dict(shared=12), "a multiple of 8"),
    (dict(counters=4), "counters"),
])
def test_launch_rejects_what_its_kernel_cannot_run(changes, message):
    case, counters, outputs = _launch_args(**changes)
    with pytest.raises(ValueError, match=message):
        moe_decode_launch(MD, case, counters, outputs, rounding=0, stream=0)


@pytest.mark.slow
def test_kernel_in_cuda_simulator():
    """One, three and two rows, thread by thread: the separate kernels' bits, the twin's values, inputs plain and
    rounded, counters back at zero (`simulated_kernels.moe_decode`)."""
    from tests.support.simulated_kernels import run

    assert len([line for line in run("moe_decode").splitlines() if line.startswith("ok moe_decode ")]) == 3


# ---- GPU ----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_one_launch_equals_the_separate_kernels_on_every_grid(rows):
    """At the 35B-A3B's shapes (256 experts, 8 a row, hidden 2048, intermediate 512, the router's 257 rows padded to
    264, a shared expert of 512): logits, ids, weights, the routed and the shared expert's outputs bit for bit the
    separate kernels' (gathered GEMVs, route_top_k, silu_mul_rows), on the default grid, one block and 7 blocks,
    inputs plain and rounded to bf16, and the counters back at zero after each launch."""
    from ninfer.kernels_numba import elementwise, linear, moe
    from ninfer.kernels_numba.numba_setup import cuda

    rng = np.random.default_rng(rows)
    case = moe_decode_case(rng, rows, hidden=2048, inter=512, experts=256, top_k=8, router_rows=264,
                           shared_inter=512)
    case["h"] *= 0.5
    stream = cuda.stream()

    def on_device(array):
        return cuda.to_device(array, stream=stream)

    def host(array):
        out = array.copy_to_host(stream=stream)
        stream.synchronize()
        return out

    class DeviceKernels:  # the separate kernels on device copies, results back into the host arrays
        def __getattr__(self, name):
            function = next(getattr(module, name) for module in (linear, moe, elementwise) if hasattr(module, name))

            def call(*args, **kwargs):
                device_args = [on_device(a) if isinstance(a, np.ndarray) else a for a in args]
                device_kwargs = {k: on_device(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
                function(*device_args, **{**device_kwargs, "stream": stream})
                for a, d in [*zip(args, device_args), *((kwargs[k], device_kwargs[k]) for k in kwargs)]:
                    if isinstance(a, np.ndarray):
                        a[...] = host(d)
            return call

    wants = {rounding: moe_decode_separately(DeviceKernels(), case, 264, rounding=rounding)
             for rounding in (0, EVERY_INPUT_ROUNDED)}
    counters = on_device(np.zeros(MD.COUNTERS, np.int32))
    inputs = {k: on_device(v) if isinstance(v, np.ndarray) else v for k, v in case.items()}
    for blocks, rounding in ((None, 0), (1, 0), (7, EVERY_INPUT_ROUNDED), (None, EVERY_INPUT_ROUNDED)):
        outputs = [on_device(a) for a in moe_decode_outputs(rows, 8, hidden=2048, inter=512, shared_inter=512,
                                                            columns=264)]
        moe_decode_launch(MD, inputs, counters, outputs, rounding=rounding, stream=stream, blocks=blocks)
        for got, expected in zip(outputs, wants[rounding]):
            np.testing.assert_array_equal(host(got), expected)
        assert not host(counters).any(), blocks
