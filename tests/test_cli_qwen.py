"""The command line on a tiny Qwen artifact: convert, inspect, generate (greedy tokens equal the model's own)."""

import json
import re

import numpy as np
import pytest

from ninfer.artifact.reader import Artifact
from ninfer.artifact.writer import ResourceSpec, write_artifact
from ninfer.cli.main import main
from ninfer.frontend.chat import ChatTemplate
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.models.loader import load_model
from ninfer.targets.registry import UnknownModelError


@pytest.fixture(scope="module")
def tiny_artifact(dense_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-qwen") / "tiny.ninfer"
    assert main(["convert", str(dense_checkpoint), "--out", str(out), "--no-progress"]) == 0
    yield out
    out.unlink()  # 115 MB: CI machines can be short of disk, and later modules build their own


def test_inspect_shows_the_custom_target(tiny_artifact, capsys):
    assert main(["inspect", str(tiny_artifact), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["model_id"] == "qwen3.6-custom"


def test_generate_greedy_equals_the_models_own_greedy_loop(tiny_artifact, capsys):
    code = main(["generate", str(tiny_artifact), "--prompt", "hello", "--greedy", "--max-new", "6",
                 "--print-token-ids", "--raw-output"])
    err = capsys.readouterr().err
    assert code == 0
    prompt_ids = json.loads(re.search(r"prompt ids \(\d+\): (\[.*\])", err).group(1))
    generated = json.loads(re.search(r"generated ids \(\d+\): (\[.*\])", err).group(1))

    artifact = Artifact.open(tiny_artifact)
    prompt = ChatTemplate.from_artifact(artifact).render([{"role": "user", "content": "hello"}])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert prompt_ids == Tokenizer.from_artifact(artifact).encode(prompt)
    model = load_model(tiny_artifact)
    state = model.new_state()
    logits = model.forward(state, np.array(prompt_ids)).logits[-1]
    expected = []
    for _ in range(len(generated)):
        expected.append(int(np.argmax(logits[: model.dims.vocab_ids])))
        logits = model.forward(state, np.array(expected[-1:])).logits[-1]
    assert generated == expected


def test_unknown_model_id_fails_at_load(tmp_path):
    path = tmp_path / "alien.ninfer"
    write_artifact(path, "alien-9b", [(ResourceSpec("frontend/tokenizer.json", 2), b"{}")])
    with pytest.raises(UnknownModelError, match="alien-9b"):
        load_model(path)
