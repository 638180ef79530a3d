"""The Gated DeltaNet and MoE ops on their own: against transformers' torch reference functions, and split calls
against one call (carried state)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.backends.cpu.gdn import causal_conv, gated_delta_rule
from ninfer.backends.cpu.moe import route_top_k
from ninfer.backends.cpu.ops import l2_normalize

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def test_causal_conv_matches_torch_and_carries_history() -> None:
    rng = np.random.default_rng(0)
    t, c, taps = 11, 6, 4
    x = rng.normal(size=(t, c)).astype(np.float32)
    weight = rng.normal(size=(taps, c)).astype(np.float32)  # tap-major, tap 3 = current column
    history = rng.normal(size=(taps - 1, c)).astype(np.float32)
    y, new_history = causal_conv(x, history, weight)
    padded = torch.from_numpy(np.concatenate([history, x]).T[None])
    expected = torch.nn.functional.conv1d(padded, torch.from_numpy(weight.T.copy())[:, None, :], groups=c)[0].T
    np.testing.assert_allclose(y, expected.numpy(), atol=1e-5)
    np.testing.assert_array_equal(new_history, x[-(taps - 1) :])
    y1, h1 = causal_conv(x[:5], history, weight)
    y2, h2 = causal_conv(x[5:], h1, weight)
    np.testing.assert_allclose(np.concatenate([y1, y2]), y, atol=1e-6)
    np.testing.assert_array_equal(h2, new_history)


@pytest.mark.parametrize("reference", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_gated_delta_rule_matches_transformers(reference: str) -> None:
    rng = np.random.default_rng(1)
    t, hk, hv, dk, dv = 37, 2, 6, 16, 8
    q = rng.normal(size=(t, hk, dk)).astype(np.float32)
    k = rng.normal(size=(t, hk, dk)).astype(np.float32)
    v = rng.normal(size=(t, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, size=(t, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(t, hv)).astype(np.float32)
    state = rng.normal(size=(hv, dk, dv)).astype(np.float32)
    fn = getattr(qwen3_5, reference)
    expected, expected_state = fn(*(torch.from_numpy(a)[None] for a in (q, k, v, g, beta)),
                                  initial_state=torch.from_numpy(state)[None], output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
    group = hv // hk
    qn = np.repeat(l2_normalize(q), group, axis=1) / np.sqrt(dk)
    kn = np.repeat(l2_normalize(k), group, axis=1)
    out, new_state = gated_delta_rule(qn, kn, v, g, beta, state)
    np.testing.assert_allclose(out, expected[0].numpy(), atol=2e-4)
    np.testing.assert_allclose(new_state, expected_state[0].numpy(), atol=2e-4)
    # Split in two calls with the carried state: the same as one call.
    first, mid = gated_delta_rule(qn[:20], kn[:20], v[:20], g[:20], beta[:20], state)
    second, end = gated_delta_rule(qn[20:], kn[20:], v[20:], g[20:], beta[20:], mid)
    np.testing.assert_allclose(np.concatenate([first, second]), out, atol=1e-6)
    np.testing.assert_allclose(end, new_state, atol=1e-6)


def test_route_top_k_ties_go_to_lower_ids_and_weights_renormalise() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    ids, weights = route_top_k(logits, 2)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 1]])
    np.testing.assert_allclose(weights, [[0.5, 0.5], [0.5, 0.5]], atol=1e-7)
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 8)).astype(np.float32)
    ids, weights = route_top_k(logits, 3)
    chosen = np.take_along_axis(logits, ids, axis=1)
    expected = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    np.testing.assert_allclose(weights, expected / expected.sum(axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_array_equal(ids[:, 0], logits.argmax(axis=1))
