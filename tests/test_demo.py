"""The bundled demo model end to end: cached conversion, its tokenizer, and a greedy answer from the CPU model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ninfer.artifact.reader import Artifact
from ninfer.convert.demo import DEMO_GGUF, DEMO_MODEL_ID, DEMO_PACKAGE, ensure_demo_artifact
from ninfer.convert.report import report_path
from ninfer.frontend.chat import ChatTemplate
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.models.loader import load_model

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
# SmolLM2's own ids for QUESTION (llama.cpp and transformers agree): What, Ġis, Ġthe, Ġcapital, Ġof, ĠFrance, ?
QUESTION_IDS = [1780, 314, 260, 3575, 282, 4649, 47]
IM_END = 2


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path | None:
    """NINFER_CACHE_DIR when set (a warm cache is reused), else a fresh directory for this test session."""
    return None if os.environ.get("NINFER_CACHE_DIR") else tmp_path_factory.mktemp("ninfer-cache")


@pytest.fixture(scope="module")
def demo(demo_cache) -> Path:
    return ensure_demo_artifact(demo_cache, progress=False)


def test_demo_artifact_is_built_once_and_reused(demo, demo_cache):
    with Artifact.open(demo) as artifact:
        assert artifact.model_id == DEMO_MODEL_ID
    built = demo.stat().st_mtime_ns
    assert ensure_demo_artifact(demo_cache, progress=False) == demo
    assert demo.stat().st_mtime_ns == built


def test_a_broken_cached_artifact_is_converted_again(tmp_path, capsys):
    broken = tmp_path / "smollm2-135m-instruct-bf16.ninfer"
    broken.write_bytes(b"NINFER\x00\x01 truncated")
    path = ensure_demo_artifact(tmp_path, progress=True)
    assert path == broken
    with Artifact.open(path) as artifact:
        assert artifact.model_id == DEMO_MODEL_ID
    report = report_path(path).read_text()
    assert '"recipe_id": "smollm2_135m_instruct-bf16"' in report
    err = capsys.readouterr().err
    assert "not a valid demo artifact" in err and "converting the demo model" in err
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        path.name, report_path(path).name]  # no leftover download or partial files


def test_concurrent_first_use_converts_once(tmp_path):
    script = ("import sys; from ninfer.convert.demo import ensure_demo_artifact; "
              "print(ensure_demo_artifact(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert {out.strip() for out, _ in results} == {str(tmp_path / "smollm2-135m-instruct-bf16.ninfer")}
    assert sum("converting the demo model" in err for _, err in results) == 1


def test_tokenizer_matches_the_gguf_vocabulary(demo):
    with Artifact.open(demo) as artifact:
        tokenizer = Tokenizer.from_artifact(artifact)
    assert tokenizer.encode(QUESTION) == QUESTION_IDS
    package = importlib.util.find_spec(DEMO_PACKAGE)
    if package is None:
        pytest.skip(f"{DEMO_PACKAGE} is not installed: no GGUF for transformers' tokenizer to compare with")
    transformers = pytest.importorskip("transformers")
    folder = package.submodule_search_locations[0]
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=DEMO_GGUF)
    samples = [QUESTION, "<|im_start|>user\nHi there!<|im_end|>\n",
               "Année 2024: 3.14159 × 42 — naïve café 東京",
               "  leading spaces\n\n\ttabs and    runs  ", "def f(x):\n    return x**2  # comment"]
    for text in samples:
        assert tokenizer.encode(text) == reference(text, add_special_tokens=False)["input_ids"], text


def test_greedy_answer_names_paris(demo):
    with Artifact.open(demo) as artifact:
        tokenizer = Tokenizer.from_artifact(artifact)
        template = ChatTemplate.from_artifact(artifact)
    prompt = template.render([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    assert prompt.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    model = load_model(demo)
    state = model.new_state()
    logits = model.forward(state, np.array(tokenizer.encode(prompt))).logits
    answer: list[int] = []
    started = time.perf_counter()
    while len(answer) < 32:
        token = int(np.argmax(logits[-1]))
        if token == IM_END:
            break
        answer.append(token)
        logits = model.forward(state, np.array([token])).logits
    elapsed = time.perf_counter() - started
    text = tokenizer.decode(answer)
    print(f"demo answer: {text!r} ({len(answer)} tokens, {len(answer) / elapsed:.1f} tok/s)")
    assert "Paris" in text
