"""Where a benchmark's JSON goes: $OUT when the device machine's command set it (what comes back from there), else
bench/results."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(name: str, report: Any) -> Path:
    """Write `report` as indented JSON to <$OUT or bench/results>/<name>.json, say so, and return the path."""
    folder = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}", flush=True)
    return path
