"""The conversion report `<out>.conversion.json`: what was converted, from what, how, and how fast.

The report is descriptive only (no part of the artifact's validity): provenance (source, recipe, converter revision,
environment) and the numbers worth comparing between runs (object statistics, throughput, peak memory).
"""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import ninfer
from ninfer.artifact.formats import encoded_size
from ninfer.artifact.writer import ResourceSpec, TensorSpec
from ninfer.convert.plan import ConversionPlan

MB = 1_000_000


def report_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".conversion.json")


def recipe_id(target_key: str, recipe: str) -> str:
    """e.g. `qwen3_6_27b-v2` for the ninfer-v2 recipe, `qwen3_6_27b-bf16` for bf16."""
    return f"{target_key}-{'v2' if recipe == 'ninfer-v2' else recipe}"


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def git_revision() -> str | None:
    """The commit of the ninfer checkout doing the conversion; None for an installed copy outside git."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(ninfer.__file__).parent,
                              capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def object_stats(specs: Sequence[TensorSpec | ResourceSpec]) -> dict[str, Any]:
    """Object counts and payload bytes: resources, and tensors per storage format."""
    by_format: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    resources = {"count": 0, "bytes": 0}
    for spec in specs:
        if isinstance(spec, ResourceSpec):
            resources["count"] += 1
            resources["bytes"] += spec.nbytes
        else:
            entry = by_format[spec.format]
            entry["count"] += 1
            entry["bytes"] += encoded_size(spec.format, spec.shape)
    tensors = dict(sorted(by_format.items()))
    return {
        "count": len(specs),
        "resources": resources,
        "tensors": {"count": sum(e["count"] for e in tensors.values()),
                    "bytes": sum(e["bytes"] for e in tensors.values()),
                    "by_format": tensors},
    }


def _per_second(nbytes: int | None, seconds: float) -> float | None:
    if nbytes is None or seconds <= 0:
        return None
    return round(nbytes / MB / seconds, 3)


def build_report(plan: ConversionPlan, recipe: str, out_path: Path,
                 specs: Sequence[TensorSpec | ResourceSpec], elapsed_s: float) -> dict[str, Any]:
    """The report of a finished conversion; `plan.source["source_bytes"]`, when the planner gives it, is the size
    of the source files read (for the read throughput)."""
    file_bytes = out_path.stat().st_size
    source_bytes = plan.source.get("source_bytes")
    return {
        "model_id": plan.model_id,
        "target_key": plan.target_key,
        "recipe": recipe,
        "recipe_id": recipe_id(plan.target_key, recipe),
        "source": plan.source,
        "output": str(out_path.resolve()),
        "file_bytes": file_bytes,
        "objects": object_stats(specs),
        "elapsed_s": round(elapsed_s, 3),
        "source_mb_per_s": _per_second(source_bytes, elapsed_s),
        "written_mb_per_s": _per_second(file_bytes, elapsed_s),
        "peak_rss_bytes": peak_rss_bytes(),
        "converter": {"ninfer_version": ninfer.__version__, "git_revision": git_revision()},
        "environment": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "platform": platform.platform(),
        },
    }


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
