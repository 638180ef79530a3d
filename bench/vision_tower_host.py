"""The Vision tower's time per image on the host (NumPy), at the real Qwen3.6 Vision shapes with random weights.

The CPU backend encodes media with this tower, and so does the CUDA runner built with `vision_on_device=False` (by
default it uses the GPU tower, `bench/vision_tower_gpu.py`); these are the seconds a --vision request's image costs
there. Images of 512x512 and 1024x1024 (smart-resized to 32x32 and 64x64 patches: 256 and 1,024 merged tokens).

Run: `python bench/vision_tower_host.py [--sizes 512,1024]`; JSON to bench/results/vision_tower_host.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.convert.qwen_hf import plan_qwen_tensor_specs  # noqa: E402
from ninfer.models.qwen3_6 import build_vision_tower  # noqa: E402
from ninfer.targets.registry import QWEN36_27B_DIMS  # noqa: E402


class RandomWeights:
    """Random float32 tensors of the planned Vision shapes (scaled so activations stay finite)."""

    def __init__(self, dims) -> None:
        rng = np.random.default_rng(0)
        self._values = {}
        for spec in plan_qwen_tensor_specs(dims):
            if spec.name.startswith("vision/"):
                fan_in = spec.shape[-1] if len(spec.shape) > 1 else 1
                self._values[spec.name] = (rng.standard_normal(spec.shape, dtype=np.float32)
                                           / np.float32(np.sqrt(fan_in)))

    def get(self, name: str) -> np.ndarray:
        return self._values[name]

    def has(self, name: str) -> bool:
        return name in self._values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="512,1024")
    args = parser.parse_args()
    dims = QWEN36_27B_DIMS
    began = time.perf_counter()
    tower = build_vision_tower(dims, RandomWeights(dims))
    print(f"tower built in {time.perf_counter() - began:.1f} s", flush=True)
    v = dims.vision
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        side = size // v.patch
        grid = (1, side, side)
        patches = np.random.default_rng(size).uniform(-1, 1, (side * side, v.patch_row)).astype(np.float32)
        began = time.perf_counter()
        out = tower.encode(patches, [grid])
        seconds = time.perf_counter() - began
        rows.append({"image": f"{size}x{size}", "grid": list(grid), "merged_tokens": int(out.shape[0]),
                     "seconds": round(seconds, 2)})
        print(f"{size}x{size}: grid {grid}, {out.shape[0]} tokens, {seconds:.2f} s", flush=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "backend": "NumPy (host)", "rows": rows}
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    (out_dir / "vision_tower_host.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
