"""One eager decode step of a reduced-layer model at the real Qwen3.6 widths: the program Nsight Compute profiles.

The first LAYERS decoder layers (3 Gated DeltaNet + 1 gated attention) and the head, random weights on the GPU, one
lane with CONTEXT tokens of KV, batch `--batch`. The step runs `--steps` times eagerly (graph replay would hide the
kernels' launch order from `--launch-skip`), so `ncu -k regex:NAME --launch-count N` sees every decode kernel of the
real model, with the real grid, at a fraction of the build time.

Run on the GPU machine (tools/device_check.sh ncu wraps it):
  ncu --clock-control none --set full -k regex:quant_mma python3 bench/ncu_decode.py --model 27b --recipe ninfer-v2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402,F401  (numpy shim first)

from bench.cuda_model import MODELS, setup_lanes  # noqa: E402
from ninfer.backends.cuda.device import CudaDevice  # noqa: E402
from ninfer.backends.cuda.capacity import Capacity  # noqa: E402
from ninfer.backends.cuda.model import CudaQwen  # noqa: E402
from ninfer.backends.cuda.weights import RandomDeviceWeights  # noqa: E402
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs  # noqa: E402

LAYERS = 4
CONTEXT = 1024


def eager_steps(device, dims, recipe: str, batch: int, steps: int, *, context: int = CONTEXT) -> list[int]:
    """`steps` eager decode steps of the first LAYERS layers of `dims` on `device`; the greedy tokens of the last
    one (a check that the step ran, not a result)."""
    dims = attrs.evolve(dims, layer_types=dims.layer_types[:LAYERS], vision=None)
    specs = [s for s in plan_qwen_tensor_specs(dims) if not s.name.startswith(("vision/", "mtp/"))]
    capacity = Capacity(lanes=8, max_context=context + 64, kv_dtype="bf16", prefill_rows=64, draft_tokens=0)
    model = CudaQwen(dims, RandomDeviceWeights(specs, recipe, device), device, capacity)
    model.allocate_kv(8 * capacity.max_pages_per_lane)
    setup_lanes(model, batch, context)
    tokens = None
    for _ in range(steps):
        tokens = model.greedy(model.head_logits(model.forward(batch, batch), batch))
    device.synchronize()
    return [int(t) for t in device.read(tokens)[:batch]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="27b", choices=sorted(MODELS))
    parser.add_argument("--recipe", default="ninfer-v2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    eager_steps(CudaDevice(0), MODELS[args.model], args.recipe, args.batch, args.steps)
    print(f"{args.model} {args.recipe} B={args.batch}: {args.steps} eager steps of {LAYERS} layers", flush=True)


if __name__ == "__main__":
    main()
