"""The Vision tower on the GPU (`CudaVisionTower`) at the real Qwen3.6 Vision shapes with random weights: seconds per
image of 512x512 and 1024x1024 (256 and 1,024 merged tokens), after one warm-up encode (kernel compilation), and the
relative difference to the host tower's output for the 512x512 image (the parity figure at real shapes).

Run on the GPU machine: `python bench/vision_tower_gpu.py [--sizes 512,1024]`; JSON to $OUT/vision_tower_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.artifact.codec import f32_to_bf16_bits  # noqa: E402


def time_tower(device, tower, sizes, *, parity_size: int | None, profile: bool = False) -> list[dict]:
    """Seconds per image on `device` (a CudaDevice, or a HostDevice for the CPU smoke test); with `profile`, the
    per-kernel GPU time of one more encode of each size (CUPTI, GPU machine only)."""
    from ninfer.backends.cuda.vision import CudaVisionTower

    gpu = CudaVisionTower(tower, device)
    v, rows = tower.dims, []
    for size in sizes:
        side = size // v.patch
        grid = (1, side, side)
        patches = f32_to_bf16_bits(np.random.default_rng(size).uniform(-1, 1, (side * side, v.patch_row))
                                   .astype(np.float32))
        gpu.encode_item(patches, grid)  # warm-up: compiles every kernel specialization
        device.synchronize()
        began = time.perf_counter()
        out = gpu.encode_item(patches, grid)
        seconds = time.perf_counter() - began
        row = {"image": f"{size}x{size}", "grid": list(grid), "merged_tokens": int(out.shape[0]),
               "seconds": round(seconds, 4)}
        if size == parity_size:
            want = tower.encode_item(patches, grid)
            row["relative_difference_to_host_tower"] = float(np.linalg.norm(out - want) / np.linalg.norm(want))
        if profile:
            from bench.kernel_profile import print_profile, profile_replays

            report = profile_replays(lambda: gpu.encode_item(patches, grid), device.synchronize, replays=1)
            print_profile(f"vision tower {size}x{size}", report)
            row["profile"] = report
        rows.append(row)
        print({k: v for k, v in row.items() if k != "profile"}, flush=True)
    return rows


def main() -> None:
    from bench.vision_tower_host import RandomWeights
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.models.qwen3_6 import build_vision_tower
    from ninfer.targets.registry import QWEN36_27B_DIMS

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="512,1024")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU time of each size (CUPTI)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    device = CudaDevice(0)
    tower = build_vision_tower(QWEN36_27B_DIMS, RandomWeights(QWEN36_27B_DIMS))
    rows = time_tower(device, tower, sizes, parity_size=sizes[0], profile=args.profile)
    report = {"device": device.info.name, "rows": rows}
    Path(os.environ.get("OUT", Path(__file__).parent / "results"), "vision_tower_gpu.json").write_text(
        json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
