"""Run a ConversionPlan: encode every object into a `.ninfer` file, one tensor in memory at a time.

The artifact is written to a temporary file beside the output and renamed into place only once complete, so a failed
or interrupted conversion never leaves a half-written `.ninfer` that could be mistaken for a real one. The conversion
report is written beside the output afterwards (see `ninfer.convert.report`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ninfer.artifact.formats import encoded_size
from ninfer.artifact.writer import ArtifactWriter, ResourceSpec, TensorSpec
from ninfer.convert.plan import ConversionPlan, PlannedTensor, recipe_format
from ninfer.convert.report import build_report, report_path, write_report

FINITE_CHECK_BLOCK = 16 * 1024 * 1024  # elements per isfinite pass


class ConversionError(ValueError):
    """A produced tensor does not match its plan (shape, non-finite values)."""


def _object_specs(plan: ConversionPlan, recipe: str) -> list[TensorSpec | ResourceSpec]:
    resources = [ResourceSpec(r.name, len(r.data)) for r in plan.resources]
    tensors = [TensorSpec(t.name, t.shape, recipe_format(recipe, t)) for t in plan.tensors]
    return resources + tensors


def _all_finite(array: np.ndarray) -> bool:
    """np.isfinite in slabs along the first axis, so the boolean temporary stays small for huge tensors."""
    if array.ndim == 0:
        return bool(np.isfinite(array))
    rows = max(1, FINITE_CHECK_BLOCK // max(1, array[0].size))
    return all(np.isfinite(array[start : start + rows]).all() for start in range(0, array.shape[0], rows))


def _produce_checked(tensor: PlannedTensor) -> np.ndarray:
    array = tensor.produce()
    if not isinstance(array, np.ndarray):
        raise ConversionError(f"{tensor.name}: produced a {type(array).__name__}, not an array")
    if array.shape != tuple(tensor.shape):
        raise ConversionError(f"{tensor.name}: produced shape {list(array.shape)}, planned {list(tensor.shape)}")
    if array.dtype.kind == "f" and not _all_finite(array):
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise ConversionError(f"{tensor.name}: {bad} of {array.size} values are not finite (NaN or inf)")
    return array


def _write(plan: ConversionPlan, path: Path, specs: list[TensorSpec | ResourceSpec], progress: bool) -> None:
    tensor_specs = specs[len(plan.resources) :]
    total = sum(len(r.data) for r in plan.resources) + sum(encoded_size(s.format, s.shape) for s in tensor_specs)
    with (
        tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"converting {plan.model_id}",
             file=sys.stderr, disable=not progress) as bar,
        ArtifactWriter(path, plan.model_id, specs) as writer,
    ):
        for resource in plan.resources:
            writer.write_next(resource.data)
            bar.update(len(resource.data))
        for tensor, spec in zip(plan.tensors, tensor_specs):
            bar.set_postfix_str(tensor.name, refresh=False)
            array = _produce_checked(tensor)
            writer.write_next(array)
            del array  # before the next produce(): only one source tensor is ever alive
            bar.update(encoded_size(spec.format, spec.shape))


def convert(plan: ConversionPlan, out_path: Path, recipe: str, *, progress: bool = True) -> dict[str, Any]:
    """Write `plan` to `out_path` under `recipe` ("bf16" or "ninfer-v2") and return the conversion report."""
    out_path = Path(out_path)
    specs = _object_specs(plan, recipe)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".partial")
    os.close(fd)
    os.chmod(partial, 0o644)  # mkstemp makes it owner-only; an artifact is an ordinary readable file
    started = time.perf_counter()
    try:
        _write(plan, Path(partial), specs, progress)
        os.replace(partial, out_path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    report = build_report(plan, recipe, out_path, specs, time.perf_counter() - started)
    write_report(report_path(out_path), report)
    return report
