"""The MTP head (§3.8) against a straightforward token-by-token NumPy transcription of the spec written here.

The transcription reads weights by ninfer name and splits fused rows itself; it shares nothing with the model
beyond numpy, so an error in a shared op would show up as a mismatch.
"""

from __future__ import annotations

import math

import numpy as np

from tests.support.qwen_checkpoints import QwenCase


def offset_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (1.0 + w) * x / math.sqrt(float(np.mean(x * x)) + 1e-6)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    inter = gate_up.shape[0] // 2
    projected = gate_up @ x
    return down @ (silu(projected[:inter]) * projected[inter:])


def rotate(x: np.ndarray, position: np.ndarray, d, rotary_dim: int) -> np.ndarray:
    """Partial interleaved MRoPE on one head: pair i uses axis H if i%3==1, W if i%3==2 (within their sections)."""
    out, half = x.copy(), rotary_dim // 2
    for i in range(half):
        axis = 1 if i % 3 == 1 and i < 3 * d.mrope_section[1] else 2 if i % 3 == 2 and i < 3 * d.mrope_section[2] else 0
        angle = position[axis] * d.rope_theta ** (-2.0 * i / rotary_dim)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def moe(x: np.ndarray, get, d) -> np.ndarray:
    rsg = get("mtp/layer/moe/router_shared_gate")
    logits = rsg[: d.moe_experts] @ x
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = sorted(range(d.moe_experts), key=lambda e: (-probs[e], e))[: d.moe_top_k]
    total = sum(probs[e] for e in chosen)
    gate_up, down = get("mtp/layer/moe/routed_gate_up"), get("mtp/layer/moe/routed_down")
    rows_gu, rows_down = 2 * d.moe_intermediate, d.hidden
    y = np.zeros(d.hidden)
    for e in chosen:
        y += probs[e] / total * swiglu(x, gate_up[e * rows_gu : (e + 1) * rows_gu],
                                       down[e * rows_down : (e + 1) * rows_down])
    shared = swiglu(x, get("mtp/layer/moe/shared_gate_up"), get("mtp/layer/moe/shared_down"))
    return y + sigmoid(rsg[d.moe_experts] @ x) * shared


def reference_mtp(case: QwenCase, hidden: np.ndarray, next_ids: np.ndarray, positions: np.ndarray):
    """(d, logits) for every position, one token at a time, float64."""
    d = case.dims

    def get(name):
        return case.weights.get(name).astype(np.float64)

    qw, kvw, hd = d.q_width, d.kv_width, d.head_dim
    qkgv = get("mtp/layer/attention/query_key_gate_value")
    w_q, w_k, w_g, w_v = qkgv[:qw], qkgv[qw : qw + kvw], qkgv[qw + kvw : 2 * qw + kvw], qkgv[2 * qw + kvw :]
    embedding, head = get("text/token_embedding"), get("text/output_head")
    keys, values, ds, logits = [], [], [], []
    for t in range(len(next_ids)):
        e = offset_norm(embedding[next_ids[t]], get("mtp/embedding_norm"))
        h = offset_norm(hidden[t].astype(np.float64), get("mtp/hidden_norm"))
        u = get("mtp/input_projection") @ np.concatenate([e, h])
        x = offset_norm(u, get("mtp/layer/input_norm"))
        q = [rotate(offset_norm(head_q, get("mtp/layer/attention/query_norm")), positions[:, t], d, d.rotary_dim)
             for head_q in (w_q @ x).reshape(d.attn_heads, hd)]
        keys.append([rotate(offset_norm(head_k, get("mtp/layer/attention/key_norm")), positions[:, t], d,
                            d.rotary_dim) for head_k in (w_k @ x).reshape(d.kv_heads, hd)])
        values.append((w_v @ x).reshape(d.kv_heads, hd))
        attended = []
        for head_index in range(d.attn_heads):
            kv = head_index // (d.attn_heads // d.kv_heads)
            scores = np.array([q[head_index] @ keys[s][kv] / math.sqrt(hd) for s in range(t + 1)])
            p = np.exp(scores - scores.max())
            p /= p.sum()
            attended.append(sum(p[s] * values[s][kv] for s in range(t + 1)))
        gated = np.concatenate(attended) * sigmoid(w_g @ x)
        u = u + get("mtp/layer/attention/output") @ gated
        x = offset_norm(u, get("mtp/layer/post_attention_norm"))
        if d.is_moe:
            u = u + moe(x, get, d)
        else:
            u = u + swiglu(x, get("mtp/layer/mlp/gate_up"), get("mtp/layer/mlp/down"))
        out = offset_norm(u, get("mtp/final_norm"))
        ds.append(out)
        logits.append(head @ out)
    return np.array(ds), np.array(logits)


def test_mtp_prefill_and_autoregressive_drafts_match_transcription(qwen_case: QwenCase) -> None:
    model, ids = qwen_case.model, qwen_case.prompt[:12]
    target = model.forward(model.new_state(), ids, logits="all")
    # Prefill: h_t fused with x_{t+1}; the last column uses the freshly sampled token.
    sampled = int(target.logits[-1].argmax())
    next_ids = np.append(ids[1:], sampled)
    mtp_state = model.mtp_new_state()
    results = [model.mtp_forward(mtp_state, target.hidden[:7], next_ids[:7], logits="all"),
               model.mtp_forward(mtp_state, target.hidden[7:], next_ids[7:], logits="all")]
    hidden_in, ids_in = list(target.hidden), list(next_ids)
    # Two autoregressive drafts: the previous draft token and the previous MTP output d as h.
    for _ in range(2):
        draft = int(results[-1].logits[-1].argmax())
        hidden_in.append(results[-1].hidden[-1])
        ids_in.append(draft)
        results.append(model.mtp_forward(mtp_state, results[-1].hidden[-1:], np.array([draft])))
    positions = np.tile(np.arange(len(ids_in)), (3, 1))
    ref_d, ref_logits = reference_mtp(qwen_case, np.array(hidden_in), np.array(ids_in), positions)
    # Every call returned one row per position (prefill logits="all", drafts one token each).
    ours_d = np.concatenate([r.hidden for r in results])
    ours_logits = np.concatenate([r.logits for r in results])
    error = float(np.max(np.abs(ours_logits - ref_logits)))
    print(f"{qwen_case.kind}: MTP max |logits - transcription| = {error:.3g}")
    np.testing.assert_allclose(ours_d, ref_d, atol=2e-5, rtol=0)
    assert error < 1e-4
    np.testing.assert_array_equal(ours_logits.argmax(axis=1), ref_logits.argmax(axis=1))
    assert mtp_state.next_position == len(ids_in)
