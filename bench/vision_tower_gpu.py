"""The Vision tower on the GPU (`CudaVisionTower`) at the real Qwen3.6 Vision shapes with random weights: seconds per
image of 512x512 and 1024x1024 (256 and 1,024 merged tokens), the median of 3 encodes after one warm-up encode
(kernel compilation), and the relative difference to the host tower's output for the first size (the parity figure
at real shapes). The tower's scratch arena is sized like the server's largest (131,072 patches; --max-patches
changes it); its bytes are in the report. --score-mib sets the attention score block (default the tower's 256 MiB).

With --profile, per size also: the per-kernel GPU time of one more encode (CUPTI) and the top host functions of
another under cProfile (by cumulative time), so the gap between wall time and GPU busy time has names.

Run on the GPU machine: `python bench/vision_tower_gpu.py [--sizes 512,1024] [--profile]`; JSON to
$OUT/vision_tower_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.artifact.codec import f32_to_bf16_bits  # noqa: E402
from bench.kernel_profile import host_profile  # noqa: E402
from ninfer.backends.cuda.vision import SCORE_BYTES, CudaVisionTower  # noqa: E402

TIMED_ENCODES = 3


def time_tower(device, tower, sizes, *, parity_size: int | None, max_patches: int, score_bytes: int = SCORE_BYTES,
               profile: bool = False) -> list[dict]:
    """Seconds per image on `device` (a CudaDevice, or a HostDevice for the CPU smoke test); with `profile`, the
    per-kernel GPU time (CUPTI, GPU machine only) and the host profile of one more encode each."""
    gpu = CudaVisionTower(tower, device, max_patches=max_patches, score_bytes=score_bytes)
    v, rows = tower.dims, []
    print(f"scratch arena for {max_patches} patches: {gpu.scratch_bytes / 2**30:.3f} GiB, attention scores "
          f"{score_bytes >> 20} MiB", flush=True)
    for size in sizes:
        side = size // v.patch
        grid = (1, side, side)
        patches = f32_to_bf16_bits(np.random.default_rng(size).uniform(-1, 1, (side * side, v.patch_row))
                                   .astype(np.float32))
        gpu.encode_item(patches, grid)  # warm-up: compiles every kernel specialization
        device.synchronize()
        seconds = []
        for _ in range(TIMED_ENCODES):
            began = time.perf_counter()
            out = gpu.encode_item(patches, grid)
            seconds.append(time.perf_counter() - began)
        row = {"image": f"{size}x{size}", "grid": list(grid), "merged_tokens": int(out.shape[0]),
               "seconds": round(statistics.median(seconds), 4), "seconds_each": [round(s, 4) for s in seconds],
               "scratch_bytes": gpu.scratch_bytes, "score_bytes": score_bytes}
        if size == parity_size:
            want = tower.encode_item(patches, grid)
            row["relative_difference_to_host_tower"] = float(np.linalg.norm(out - want) / np.linalg.norm(want))
        if profile:
            from bench.kernel_profile import print_profile, profile_replays

            report = profile_replays(lambda: gpu.encode_item(patches, grid), device.synchronize, replays=1)
            print_profile(f"vision tower {size}x{size}", report)
            row["profile"] = report
            row["host_profile"] = host_profile(lambda: gpu.encode_item(patches, grid))
            print(row["host_profile"], flush=True)
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("profile", "host_profile")}, flush=True)
    return rows


def main() -> None:
    from bench.vision_tower_host import RandomWeights
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.media.prepare import MAX_RAW_PATCHES
    from ninfer.models.qwen3_6 import build_vision_tower
    from ninfer.targets.registry import QWEN36_27B_DIMS

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="512,1024")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel GPU time (CUPTI) and the top host functions (cProfile) of each size")
    parser.add_argument("--max-patches", type=int, default=MAX_RAW_PATCHES,
                        help="size the scratch arena for this many patches (default: the serving envelope)")
    parser.add_argument("--score-mib", type=int, default=SCORE_BYTES >> 20,
                        help="attention scores of one query block (smaller blocks may stay in L2, at more launches)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    device = CudaDevice(0)
    v = QWEN36_27B_DIMS.vision
    tower = build_vision_tower(QWEN36_27B_DIMS, RandomWeights(QWEN36_27B_DIMS))
    max_patches = max(args.max_patches, max(size // v.patch for size in sizes) ** 2)
    rows = time_tower(device, tower, sizes, parity_size=sizes[0], max_patches=max_patches,
                      score_bytes=args.score_mib << 20, profile=args.profile)
    report = {"device": device.info.name, "rows": rows}
    Path(os.environ.get("OUT", Path(__file__).parent / "results"), "vision_tower_gpu.json").write_text(
        json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
