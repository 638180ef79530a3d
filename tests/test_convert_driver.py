"""The conversion driver on a small synthetic plan: payloads, report, atomicity, and the checks on produced tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ninfer.artifact.reader import Artifact
from ninfer.convert.driver import ConversionError, convert
from ninfer.convert.plan import ConversionPlan, PlannedResource, PlannedTensor, RecipeError
from ninfer.convert.report import report_path


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


class CountingPlan:
    """A synthetic plan whose tensors count how often they are produced."""

    def __init__(self, overrides: dict[str, np.ndarray] | None = None) -> None:
        rng = np.random.default_rng(7)
        self.arrays = {
            "text/norm": rng.standard_normal(8).astype(np.float32),
            "text/table": rng.standard_normal((3, 5)).astype(np.float32),
            "text/ids": np.arange(4, dtype=np.int32) * 7,
            "text/matrix": rng.standard_normal((16, 130)).astype(np.float32),
        }
        self.formats = {"text/norm": "BF16", "text/table": "FP32", "text/ids": "I32", "text/matrix": "Q4G64_F16S"}
        self.produced = {name: 0 for name in self.arrays}
        self.overrides = overrides or {}

    def _producer(self, name: str):
        def produce() -> np.ndarray:
            self.produced[name] += 1
            return self.overrides.get(name, self.arrays[name])

        return produce

    def plan(self) -> ConversionPlan:
        return ConversionPlan(
            model_id="llama-custom",
            resources=(PlannedResource("frontend/a.json", b'{"a": 1}'),
                       PlannedResource("model/b.bin", b"\x00\x01\x02")),
            tensors=tuple(PlannedTensor(name, array.shape, self.formats[name], self._producer(name))
                          for name, array in self.arrays.items()),
            source={"kind": "synthetic", "source_bytes": 1000},
            target_key="tiny",
        )


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_bf16_artifact_decodes_to_the_produced_arrays(tmp_path):
    source = CountingPlan()
    out = tmp_path / "tiny.ninfer"
    convert(source.plan(), out, "bf16", progress=False)

    assert source.produced == {name: 1 for name in source.arrays}
    with Artifact.open(out) as artifact:
        assert artifact.model_id == "llama-custom"
        assert [o.name for o in artifact.objects] == ["frontend/a.json", "model/b.bin", *source.arrays]
        assert artifact.resource("frontend/a.json") == b'{"a": 1}'
        assert artifact.resource("model/b.bin") == b"\x00\x01\x02"
        np.testing.assert_array_equal(artifact.tensor("text/norm").to_numpy(), bf16_rounded(source.arrays["text/norm"]))
        np.testing.assert_array_equal(artifact.tensor("text/table").to_numpy(), source.arrays["text/table"])
        np.testing.assert_array_equal(artifact.tensor("text/ids").to_numpy(), source.arrays["text/ids"])
        # bf16 stores the v2-quantized matrix as BF16.
        assert artifact.entry("text/matrix").format == "BF16"
        np.testing.assert_array_equal(artifact.tensor("text/matrix").to_numpy(),
                                      bf16_rounded(source.arrays["text/matrix"]))
    assert leftovers(tmp_path) == ["tiny.ninfer", "tiny.ninfer.conversion.json"]


def test_ninfer_v2_keeps_the_planned_formats(tmp_path):
    source = CountingPlan()
    out = tmp_path / "tiny.ninfer"
    convert(source.plan(), out, "ninfer-v2", progress=False)
    with Artifact.open(out) as artifact:
        assert {o.name: o.format for o in artifact.objects if o.kind == "tensor"} == source.formats
        matrix = source.arrays["text/matrix"]
        decoded = artifact.tensor("text/matrix").to_numpy()
        # Q4 with a max-abs scale per 64 columns: each value within half a step (amax / 7 / 2) of the source.
        group_amax = np.abs(np.pad(matrix, ((0, 0), (0, 62))).reshape(16, 3, 64)).max(axis=2)
        tolerance = np.repeat(group_amax / 7 * 0.5 * 1.01, 64, axis=1)[:, :130]
        assert np.all(np.abs(decoded - matrix) <= tolerance)


def test_report_describes_the_conversion(tmp_path):
    out = tmp_path / "tiny.ninfer"
    report = convert(CountingPlan().plan(), out, "ninfer-v2", progress=False)

    assert json.loads(report_path(out).read_text()) == report
    assert report_path(out) == tmp_path / "tiny.ninfer.conversion.json"
    assert report["model_id"] == "llama-custom"
    assert report["target_key"] == "tiny"
    assert (report["recipe"], report["recipe_id"]) == ("ninfer-v2", "tiny-v2")
    assert report["source"] == {"kind": "synthetic", "source_bytes": 1000}
    assert report["file_bytes"] == out.stat().st_size
    objects = report["objects"]
    assert objects["count"] == 6
    assert objects["resources"] == {"count": 2, "bytes": 11}
    assert objects["tensors"]["by_format"] == {
        "BF16": {"count": 1, "bytes": 16},
        "FP32": {"count": 1, "bytes": 60},
        "I32": {"count": 1, "bytes": 16},
        "Q4G64_F16S": {"count": 1, "bytes": 16 * 4 * 32 + 16 * 4 * 2},  # K 130 pads to 256: 4 groups of 64 a row
    }
    assert objects["tensors"]["count"] == 4
    assert report["elapsed_s"] >= 0 and report["peak_rss_bytes"] > 0
    assert report["source_mb_per_s"] is None or report["source_mb_per_s"] > 0
    assert report["converter"]["ninfer_version"]
    assert {"python", "numpy"} <= set(report["environment"])

    bf16_report = convert(CountingPlan().plan(), tmp_path / "b.ninfer", "bf16", progress=False)
    assert bf16_report["recipe_id"] == "tiny-bf16"


def test_progress_goes_to_stderr_only_when_asked(tmp_path, capsys):
    convert(CountingPlan().plan(), tmp_path / "quiet.ninfer", "bf16", progress=False)
    assert capsys.readouterr() == ("", "")
    convert(CountingPlan().plan(), tmp_path / "loud.ninfer", "bf16", progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "converting llama-custom" in captured.err


def test_failed_produce_leaves_no_output(tmp_path):
    source = CountingPlan()
    plan = source.plan()

    def broken() -> np.ndarray:
        raise RuntimeError("source shard unreadable")

    tensors = list(plan.tensors)
    tensors[2] = PlannedTensor(tensors[2].name, tensors[2].shape, tensors[2].v2_format, broken)
    out = tmp_path / "tiny.ninfer"
    out.write_bytes(b"the previous artifact")
    with pytest.raises(RuntimeError, match="unreadable"):
        convert(ConversionPlan(plan.model_id, plan.resources, tuple(tensors), plan.source, plan.target_key), out,
                "bf16", progress=False)
    assert out.read_bytes() == b"the previous artifact"  # replaced only by a complete artifact
    assert leftovers(tmp_path) == ["tiny.ninfer"]


def test_shape_mismatch_is_rejected_naming_the_tensor(tmp_path):
    source = CountingPlan({"text/table": np.zeros((5, 3), np.float32)})
    with pytest.raises(ConversionError, match=r"text/table: produced shape \[5, 3\], planned \[3, 5\]"):
        convert(source.plan(), tmp_path / "tiny.ninfer", "bf16", progress=False)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_rejected_naming_the_tensor(tmp_path, bad):
    matrix = np.ones((16, 130), np.float32)
    matrix[3, 100] = bad
    with pytest.raises(ConversionError, match=r"text/matrix: 1 of 2080 values are not finite"):
        convert(CountingPlan({"text/matrix": matrix}).plan(), tmp_path / "tiny.ninfer", "bf16", progress=False)
    assert leftovers(tmp_path) == []


def test_unknown_recipe_fails_before_writing(tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe"):
        convert(CountingPlan().plan(), tmp_path / "tiny.ninfer", "fp8", progress=False)
    assert leftovers(tmp_path) == []
