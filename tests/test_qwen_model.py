"""The CPU Qwen3.6 model against transformers' Qwen3.5 implementation (the numerical oracle), and its own carried state.

Both sides use the same BF16-representable weights with fp32 math, so the remaining difference is summation order
(transformers runs GDN prefill with the chunked algorithm; ninfer with the recurrence).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.qwen_checkpoints import QwenCase, hf_logits

# Measured max |logit difference| is about 2.5e-5 (dense) and 1.0e-5 (MoE) at logit magnitudes up to ~6.
LOGITS_ATOL = 2e-4


def test_logits_match_transformers_at_every_position(qwen_case: QwenCase) -> None:
    ids = qwen_case.prompt
    assert 35 <= len(ids) <= 45
    ours = qwen_case.model.forward(qwen_case.model.new_state(), ids, logits="all").logits
    reference = hf_logits(qwen_case.hf_model, ids)
    error = float(np.max(np.abs(ours - reference)))
    print(f"{qwen_case.kind}: max |logits - transformers| over {len(ids)} positions = {error:.3g}")
    assert ours.shape == (len(ids), qwen_case.dims.vocab_rows)
    np.testing.assert_array_equal(ours.argmax(axis=1), reference.argmax(axis=1))
    assert error < LOGITS_ATOL


def test_mrope_positions_match_transformers(qwen_case: QwenCase) -> None:
    """Explicit [3, T] positions as a media run produces them (H and W differ from T), then text continuing."""
    ids = qwen_case.prompt
    positions = np.tile(np.arange(len(ids)), (3, 1))
    # Tokens 10..21 as a 3x4 merged media grid (§3.12): T = 10, H = 10 + row, W = 10 + column ...
    rows, columns = np.divmod(np.arange(12), 4)
    positions[:, 10:22] = [np.full(12, 10), 10 + rows, 10 + columns]
    # ... after which text continues from current + max(3, 4).
    positions[:, 22:] = 14 + np.arange(len(ids) - 22)
    model, state = qwen_case.model, qwen_case.model.new_state()
    ours = model.forward(state, ids, positions=positions, logits="all").logits
    reference = hf_logits(qwen_case.hf_model, ids, positions)
    np.testing.assert_array_equal(ours.argmax(axis=1), reference.argmax(axis=1))
    assert np.max(np.abs(ours - reference)) < LOGITS_ATOL
    assert state.next_position == positions.max() + 1


def test_incremental_decode_equals_full_forward(qwen_case: QwenCase) -> None:
    model, ids = qwen_case.model, qwen_case.prompt
    full = model.forward(model.new_state(), ids, logits="all")
    state = model.new_state()
    prefill = 17
    first = model.forward(state, ids[:prefill], logits="all")
    rows, hidden = [first.logits], [first.hidden]
    for token in ids[prefill:]:
        step = model.forward(state, np.array([token]))
        rows.append(step.logits)
        hidden.append(step.hidden)
    np.testing.assert_allclose(np.concatenate(rows), full.logits, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate(hidden), full.hidden, atol=2e-5, rtol=0)
    assert state.next_position == len(ids)


def test_last_logits_and_hidden_rows(qwen_case: QwenCase) -> None:
    model, ids = qwen_case.model, qwen_case.prompt[:9]
    full = model.forward(model.new_state(), ids, logits="all")
    last = model.forward(model.new_state(), ids)
    assert last.logits.shape == (1, qwen_case.dims.vocab_rows)
    np.testing.assert_allclose(last.logits[0], full.logits[-1], atol=1e-5, rtol=0)  # BLAS blocking differs
    assert last.hidden.shape == (len(ids), qwen_case.dims.hidden)


def test_rejects_bad_inputs(qwen_case: QwenCase) -> None:
    model = qwen_case.model
    with pytest.raises(ValueError, match="token ids"):
        model.forward(model.new_state(), np.array([qwen_case.dims.vocab_rows]))
    with pytest.raises(ValueError, match="positions"):
        model.forward(model.new_state(), np.array([1, 2]), positions=np.zeros((3, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="logits"):
        model.forward(model.new_state(), np.array([1]), logits="first")
