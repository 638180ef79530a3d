"""The real path: Hugging Face checkpoint -> plan -> `.ninfer` artifact -> loaded CPU model, against transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ninfer.convert import driver
from ninfer.models import loader
from tests.support.qwen_checkpoints import QwenCase, hf_logits
from tests.test_qwen_model import LOGITS_ATOL

# Measured on the tiny random models: relative logits error 0.39 (dense) / 0.32 (MoE), smallest per-position cosine
# 0.72 / 0.76, argmax agreement 35% / 49% over 37 positions. Each quantized matrix alone is as expected (Q4 ~11%,
# Q5 ~5%, Q6 ~2.4% relative error); a random network amplifies early-layer noise (layer 0 alone: 0.32), so these
# figures say nothing about trained weights. The bounds below leave about 25% margin.
V2_RELATIVE_ERROR_BOUND = 0.5
V2_MIN_COSINE = 0.6


def convert_and_load(case: QwenCase, recipe: str, tmp_path: Path):
    out = tmp_path / f"{case.kind}-{recipe}.ninfer"
    driver.convert(case.plan, out, recipe=recipe, progress=False)
    return loader.load_model(out)


def test_bf16_artifact_matches_transformers(qwen_case: QwenCase, tmp_path: Path) -> None:
    model = convert_and_load(qwen_case, "bf16", tmp_path)
    ids = qwen_case.prompt
    result = model.forward(model.new_state(), ids, logits="all")
    reference = hf_logits(qwen_case.hf_model, ids)
    error = float(np.max(np.abs(result.logits - reference)))
    print(f"{qwen_case.kind} bf16 artifact: max |logits - transformers| = {error:.3g}")
    np.testing.assert_array_equal(result.logits.argmax(axis=1), reference.argmax(axis=1))
    assert error < LOGITS_ATOL
    # The MTP head reads its weights from the artifact too.
    in_memory = qwen_case.model
    expected = in_memory.mtp_forward(in_memory.mtp_new_state(), result.hidden[:-1], ids[1:], logits="all")
    drafted = model.mtp_forward(model.mtp_new_state(), result.hidden[:-1], ids[1:], logits="all")
    np.testing.assert_allclose(drafted.logits, expected.logits, atol=1e-5, rtol=0)


def test_ninfer_v2_artifact_error_is_bounded(qwen_case: QwenCase, tmp_path: Path) -> None:
    model = convert_and_load(qwen_case, "ninfer-v2", tmp_path)
    ids = qwen_case.prompt
    ours = model.forward(model.new_state(), ids, logits="all").logits
    reference = hf_logits(qwen_case.hf_model, ids)
    relative = float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))
    cosine = np.sum(ours * reference, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    agreement = float(np.mean(ours.argmax(axis=1) == reference.argmax(axis=1)))
    print(f"{qwen_case.kind} ninfer-v2 artifact: relative logits error {relative:.3f}, min cosine "
          f"{cosine.min():.3f}, argmax agreement {agreement:.0%} over {len(ids)} positions")
    assert relative < V2_RELATIVE_ERROR_BOUND
    assert cosine.min() > V2_MIN_COSINE
