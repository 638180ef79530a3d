"""`ninfer convert SOURCE --out FILE.ninfer [--recipe bf16|ninfer-v2] [--model-id ID] [--dflash-model DIR]
[--no-progress]`.

SOURCE is a Hugging Face Qwen3.5/3.6 checkpoint directory or a llama-architecture `.gguf` file. --dflash-model adds
the DFlash drafter of a 35B-A3B checkpoint (z-lab/Qwen3.6-35B-A3B-DFlash: config.json and model.safetensors, in DIR
or its dflash-bf16/ folder) as the artifact's `dflash/...` objects, for `--spec dflash`. The artifact is written
atomically, with its report `FILE.ninfer.conversion.json` beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ninfer.artifact.errors import ArtifactError
from ninfer.convert.plan import RECIPES, ConversionPlan

MB = 1_000_000


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("convert", help="convert a checkpoint or GGUF file into a .ninfer artifact",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, metavar="SOURCE", help="a Hugging Face checkpoint directory or a .gguf file")
    p.add_argument("--out", type=Path, required=True, metavar="FILE.ninfer", help="the artifact to write")
    p.add_argument("--recipe", choices=RECIPES, default="bf16",
                   help="bf16: every float tensor as BF16 (default); ninfer-v2: the per-role quantized formats")
    p.add_argument("--model-id", metavar="ID", help="the registered model_id to write (default: from the source)")
    p.add_argument("--dflash-model", type=Path, metavar="DIR",
                   help="a DFlash drafter checkpoint for a 35B-A3B SOURCE (adds the dflash/... objects)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def _plan(source: Path, model_id: str | None, dflash_dir: Path | None) -> ConversionPlan:
    if source.is_dir():
        from ninfer.convert.qwen_hf import plan_qwen_checkpoint

        return plan_qwen_checkpoint(source, model_id=model_id, dflash_dir=dflash_dir)
    if source.is_file() and source.suffix.lower() == ".gguf":
        if dflash_dir is not None:
            raise ValueError(f"{source}: --dflash-model needs a Qwen3.6-35B-A3B checkpoint directory, not a GGUF file")
        from ninfer.convert.gguf_llama import plan_gguf_llama

        return plan_gguf_llama(source, model_id=model_id)
    raise ValueError(f"{source}: not a checkpoint directory or a .gguf file")


def run(args: argparse.Namespace) -> int:
    from ninfer.convert.driver import convert
    from ninfer.convert.report import report_path

    try:
        report = convert(_plan(args.source, args.model_id, args.dflash_model), args.out, args.recipe,
                         progress=not args.no_progress)
    # Bad sources, config/target mismatches, unreadable files and artifact errors are the user's to fix: no traceback.
    except (ValueError, LookupError, OSError, ArtifactError) as exc:
        print(f"ninfer convert: error: {exc}", file=sys.stderr)
        return 1
    objects = report["objects"]
    print(f"wrote {args.out}: {report['model_id']} ({report['recipe_id']}), {objects['count']} objects, "
          f"{report['file_bytes'] / MB:.1f} MB in {report['elapsed_s']:.1f} s "
          f"({report['written_mb_per_s'] or 0:.1f} MB/s written), peak RSS {report['peak_rss_bytes'] / MB:.0f} MB; "
          f"report {report_path(args.out)}")
    return 0
