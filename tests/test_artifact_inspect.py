"""`describe`, `describe_json` and the `ninfer inspect` command."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from ninfer.artifact import (
    BF16,
    I32,
    Q4G64,
    W8G32,
    Artifact,
    ResourceSpec,
    TensorSpec,
    describe,
    describe_json,
    write_artifact,
)
from ninfer.cli import inspect as inspect_command


@pytest.fixture()
def artifact_path(tmp_path):
    path = tmp_path / "small.ninfer"
    write_artifact(
        path,
        "qwen3.6-27b",
        [
            (ResourceSpec("frontend/tokenizer.json", 4), b"{}\n\n"),
            (TensorSpec("text/layers/0/input_norm", (8,), BF16), np.ones(8, np.float32)),
            (TensorSpec("text/layers/0/mlp/gate_up", (4, 64), Q4G64), np.ones((4, 64), np.float32)),
            (TensorSpec("text/layers/1/mlp/gate_up", (4, 64), Q4G64), np.ones((4, 64), np.float32)),
            (TensorSpec("mtp/input_projection", (2, 32), W8G32), np.ones((2, 32), np.float32)),
            (TensorSpec("text/draft_head_token_ids", (3,), I32), np.arange(3)),
        ],
    )
    return path


def test_describe_summarises_header_formats_and_resources(artifact_path):
    with Artifact.open(artifact_path) as artifact:
        text = describe(artifact)
        size = artifact.file_size
    lines = text.splitlines()
    assert "qwen3.6-27b" in lines[0]
    assert f"{size:,} bytes" in text and "payload at offset 4,096" in text
    q4_line = next(line for line in lines if line.startswith("Q4G64_F16S"))
    assert q4_line.split() == ["Q4G64_F16S", "2", "544"]  # 2 x (4 rows x 2 groups x 32 B base + 16 B scales)
    assert any(line.split() == ["all", "5", "844"] for line in lines)  # + BF16 16 + W8 272 + I32 12
    assert "frontend/tokenizer.json  4 bytes" in text
    assert "text/layers/0/input_norm" not in text


def test_describe_lists_objects_on_request(artifact_path):
    with Artifact.open(artifact_path) as artifact:
        text = describe(artifact, objects=True)
    table = text.split("name\n", 1)[1].splitlines()
    assert len(table) == 6
    assert table[1].split() == ["1", "256", "16", "BF16", "[8]", "text/layers/0/input_norm"]
    assert table[0].split() == ["0", "0", "4", "raw-bytes-v1", "-", "frontend/tokenizer.json"]


def test_describe_json_matches_the_directory(artifact_path):
    with Artifact.open(artifact_path) as artifact:
        summary = describe_json(artifact)
    assert summary["model_id"] == "qwen3.6-27b" and summary["payload_offset"] == 4096
    assert summary["formats"] == {
        "BF16": {"count": 1, "bytes": 16},
        "I32": {"count": 1, "bytes": 12},
        "Q4G64_F16S": {"count": 2, "bytes": 544},
        "W8G32_F16S": {"count": 1, "bytes": 272},  # 2 rows x 4 groups x 32 B base, then 16 B of scales
    }
    assert summary["resources"] == [{"name": "frontend/tokenizer.json", "bytes": 4}]
    raw = json.loads(artifact_path.read_bytes()[16 : 16 + summary["json_bytes"]])
    assert summary["objects"] == raw["objects"]


def run(path, *, objects=False, as_json=False) -> int:
    return inspect_command.run(argparse.Namespace(file=str(path), objects=objects, json=as_json))


def test_cli_prints_the_description(artifact_path, capsys):
    assert run(artifact_path, objects=True) == 0
    out = capsys.readouterr().out
    with Artifact.open(artifact_path) as artifact:
        assert out == describe(artifact, objects=True) + "\n"
    assert run(artifact_path, as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["model_id"] == "qwen3.6-27b"


def test_cli_reports_bad_files_on_stderr(tmp_path, artifact_path, capsys):
    broken = tmp_path / "broken.ninfer"
    broken.write_bytes(b"NOTNINFR" + artifact_path.read_bytes()[8:])
    assert run(broken) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "rule magic" in captured.err
    assert run(tmp_path / "missing.ninfer") == 1
    assert "missing.ninfer" in capsys.readouterr().err


def test_cli_registers_the_inspect_command(artifact_path):
    parser = argparse.ArgumentParser()
    inspect_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["inspect", str(artifact_path), "--objects", "--json"])
    assert (args.file, args.objects, args.json, args.func) == (str(artifact_path), True, True, inspect_command.run)
