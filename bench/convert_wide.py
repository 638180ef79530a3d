"""Conversion throughput and peak RSS on a checkpoint with the real Qwen3.6-27B widths and 4 layers.

Builds a random BF16 safetensors checkpoint (27B config cut to 4 layers: 3 Gated DeltaNet + 1 full attention, plus
the real-size embedding, head, MTP layer and full Vision tower) in shards of at most 2 GiB, then runs
`python -m ninfer convert` for each recipe in a fresh process and collects its conversion report.

    python bench/convert_wide.py --work /tmp/ninfer-wide [--layers 4] [--out bench/results/convert_wide.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ninfer.artifact.codec import f32_to_bf16_bits  # noqa: E402
from tests.support.qwen_checkpoints import FIXTURES, checkpoint_shapes, copy_frontend  # noqa: E402
from tests.support.qwen_tokenizer import build_qwen_tokenizer_json  # noqa: E402

SHARD_BYTES = 2 << 30
BLOCK_ELEMENTS = 8 << 20  # random values generated per step (bounds the builder's memory)


def cut_config(layers: int) -> dict:
    config = json.loads((FIXTURES / "Qwen3.6-27B" / "config.json").read_text())
    text = config["text_config"]
    text["num_hidden_layers"] = layers
    text["layer_types"] = text["layer_types"][:layers]
    return config


def write_random_shard(path: Path, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> None:
    """A safetensors file of BF16 tensors with N(0, 0.02) values, written block by block."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for shape in shapes.values():
            remaining = int(np.prod(shape))
            while remaining:
                n = min(remaining, BLOCK_ELEMENTS)
                f.write(f32_to_bf16_bits(rng.normal(0.0, 0.02, n).astype(np.float32)).tobytes())
                remaining -= n


def build_checkpoint(work: Path, layers: int) -> tuple[Path, int]:
    from transformers import AutoConfig

    hf_dir = work / f"qwen3.6-27b-widths-{layers}-layers"
    done = hf_dir / "model.safetensors.index.json"
    config = cut_config(layers)
    hf_dir.mkdir(parents=True, exist_ok=True)
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    shapes = checkpoint_shapes(AutoConfig.from_pretrained(hf_dir))
    total = sum(2 * int(np.prod(s)) for s in shapes.values())
    if done.exists():
        return hf_dir, total
    copy_frontend("Qwen3.6-27B", hf_dir, build_qwen_tokenizer_json(work / "tokenizer.json"))
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in sorted(shapes.items()):
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, group in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_random_shard(hf_dir / file, group, rng)
        weight_map.update({n: file for n in group})
        print(f"wrote {file} ({len(group)} tensors)", file=sys.stderr)
    done.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return hf_dir, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (needs ~20 GB)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "convert_wide.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    hf_dir, source_bytes = build_checkpoint(args.work, args.layers)
    print(f"checkpoint ready: {source_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    runs = []
    for recipe in ("bf16", "ninfer-v2"):
        out = args.work / f"wide-{recipe}.ninfer"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ninfer", "convert", str(hf_dir), "--out", str(out), "--recipe", recipe,
                        "--no-progress"], check=True, cwd=REPO)
        wall = time.perf_counter() - started
        report = json.loads(out.with_name(out.name + ".conversion.json").read_text())
        runs.append({"recipe": recipe, "wall_seconds": round(wall, 2), "source_bytes": source_bytes,
                     "source_mb_per_s": round(source_bytes / 1e6 / wall, 1), "report": report})
        print(f"{recipe}: {source_bytes / 1e6 / wall:.0f} MB/s of source over {wall:.1f} s (process wall), "
              f"peak RSS {report.get('peak_rss_bytes', 0) / 2**20:.0f} MiB, output {out.stat().st_size / 1e9:.2f} GB",
              file=sys.stderr)
        out.unlink()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    result = {"benchmark": "convert_wide", "layers": args.layers, "machine": platform.platform(),
              "cpus": os.cpu_count(), "commit": commit.strip(), "date": time.strftime("%Y-%m-%d"),
              "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
