"""`ninfer generate` end to end on the bundled demo model."""

import json

import pytest

from ninfer.cli.main import main
from ninfer.convert.demo import ensure_demo_artifact

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def demo():
    return str(ensure_demo_artifact(progress=False))


def generate(capsys, *args):
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_greedy_answer_and_timings(demo, capsys):
    code, out, err = generate(capsys, demo, "--prompt", QUESTION, "--greedy", "--max-new", "24")
    assert code == 0
    assert "Paris" in out
    assert "finish=stop_token" in err and "prefill=" in err and "decode=" in err


def test_default_artifact_is_the_demo_model(demo, capsys):
    code, out, _ = generate(capsys, "--prompt", QUESTION, "--greedy", "--max-new", "24")
    assert code == 0 and "Paris" in out


def test_print_token_ids_and_raw_output_show_the_stop_token(demo, capsys):
    code, out, err = generate(capsys, demo, "--prompt", QUESTION, "--greedy", "--max-new", "24", "--raw-output",
                              "--print-token-ids")
    assert code == 0
    assert out.rstrip("\n").endswith("<|im_end|>")
    generated = json.loads(err.split("generated ids (")[1].split(": ", 1)[1].splitlines()[0])
    assert generated[-1] == 2  # SmolLM2's <|im_end|>


def test_max_new_ends_with_length(demo, capsys):
    code, out, err = generate(capsys, demo, "--prompt", QUESTION, "--greedy", "--max-new", "3")
    assert code == 0 and "finish=length" in err and "completion_tokens=3" in err


def test_stop_string_cuts_content(demo, capsys):
    code, out, err = generate(capsys, demo, "--prompt", QUESTION, "--greedy", "--max-new", "24", "--stop", "Paris")
    assert code == 0 and "Paris" not in out and "finish=stop_string" in err


def test_sampling_is_reproducible_by_seed(demo, capsys):
    args = [demo, "--prompt", "Tell me a story.", "--max-new", "12", "--temperature", "1.0", "--seed"]
    runs = [generate(capsys, *args, seed)[1] for seed in ("5", "5", "6")]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_messages_file_with_system_turn(demo, capsys, tmp_path):
    path = tmp_path / "messages.json"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "Answer in one word."},
                                             {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]}))
    code, out, _ = generate(capsys, demo, "--messages", str(path), "--greedy", "--max-new", "8")
    assert code == 0 and "Paris" in out


@pytest.mark.parametrize("args,message", [
    (["--prefill-chunk", "100"], "multiple of 128"),
    (["--max-new", "0"], "--max-new"),
    (["--temperature", "3"], "temperature"),
    (["--max-context", "5"], "more than --max-context"),
    (["--stop", ""], "stop strings"),
    (["--reasoning-effort", "low"], "not supported by the loaded chat template"),
])
def test_bad_options_exit_1_with_a_message(demo, capsys, args, message):
    code, _, err = generate(capsys, demo, "--prompt", QUESTION, *args)
    assert code == 1 and message in err


def test_bad_messages_files_exit_1(demo, capsys, tmp_path):
    cases = {"not json": "{", "media": json.dumps([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}]),
             "extra key": json.dumps([{"role": "user", "content": "hi", "name": "bob"}]), "empty": "[]"}
    for label, text in cases.items():
        path = tmp_path / f"{label.replace(' ', '_')}.json"
        path.write_text(text)
        code, _, err = generate(capsys, demo, "--messages", str(path))
        assert code == 1 and "--messages" in err, label


def test_missing_artifact_exit_1(capsys, tmp_path):
    code, _, err = generate(capsys, str(tmp_path / "nope.ninfer"), "--prompt", "hi")
    assert code == 1 and "nope.ninfer" in err
