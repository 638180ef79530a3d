"""ninfer's CUDA backend next to transformers on the same GPU, at a reduced-layer real shape.

Both run the real Qwen3.6 widths (27B, 35B-A3B) with the first LAYERS decoder layers (3 Gated DeltaNet + 1 gated
attention), the full 248,320-row head, bf16 weights, batch 1, a CONTEXT-token prompt already in the cache. Weights
are random on both sides (each side draws its own; decode time does not depend on the values). transformers runs
eagerly with its cache (`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` from the official configs); ninfer replays
its captured decode graph. Reported: ms per decode step, and ms per layer after subtracting the head step.

Run on the GPU machine: `python bench/transformers_side_by_side.py`; JSON to `$OUT/transformers_side_by_side.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import attrs
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402  (numpy shim first)

from ninfer.backends.cuda.device import CudaDevice  # noqa: E402
from ninfer.backends.cuda.graphs import capture  # noqa: E402
from ninfer.backends.cuda.capacity import Capacity  # noqa: E402
from ninfer.backends.cuda.model import CudaQwen  # noqa: E402
from ninfer.backends.cuda.weights import RandomDeviceWeights  # noqa: E402
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs  # noqa: E402
from ninfer.targets.registry import QWEN36_27B_DIMS, QWEN36_35B_A3B_DIMS  # noqa: E402

LAYERS = 4
CONTEXT = 1024
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen"
CASES = {"27b": (QWEN36_27B_DIMS, "Qwen3.6-27B"), "35b": (QWEN36_35B_A3B_DIMS, "Qwen3.6-35B-A3B")}


def hf_step_ms(fixture: str) -> float:
    import torch
    import transformers

    config = json.loads((FIXTURES / fixture / "config.json").read_text())
    text = config.get("text_config", config)
    moe = "num_experts" in text and int(text["num_experts"]) > 0
    text = dict(text, num_hidden_layers=LAYERS, layer_types=text["layer_types"][:LAYERS])
    text.pop("architectures", None)
    if moe:
        cfg, cls = transformers.Qwen3_5MoeTextConfig(**text), transformers.Qwen3_5MoeForCausalLM
    else:
        cfg, cls = transformers.Qwen3_5TextConfig(**text), transformers.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 200_000, (1, CONTEXT), device="cuda")
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    del model, cache, out
    torch.cuda.empty_cache()
    return float(np.median(times))


def ninfer_step_ms(dims) -> dict:
    dims = attrs.evolve(dims, layer_types=dims.layer_types[:LAYERS], vision=None)
    device = CudaDevice(0)
    specs = [s for s in plan_qwen_tensor_specs(dims) if not s.name.startswith(("vision/", "mtp/"))]
    model = CudaQwen(dims, RandomDeviceWeights(specs, "bf16", device), device,
                     Capacity(lanes=1, max_context=CONTEXT + 64, kv_dtype="bf16", prefill_rows=64, draft_tokens=0))
    model.allocate_kv(model.capacity.max_pages_per_lane)
    stream = device.stream
    model.inputs.set_page_table(0, np.arange(model.capacity.max_pages_per_lane, dtype=np.int32))
    model.inputs.fill(token_ids=[7], positions=np.full((3, 1), CONTEXT), row_lane=[0], row_pos=[CONTEXT],
                      seg_lane=[0], seg_row=[0], seg_count=[1], seg_record=[0])

    def step():
        model.greedy(model.head_logits(model.forward(1, 1)))

    def head_only():
        model.greedy(model.head_logits(model.workspace.final[:1]))

    out = {}
    for name, body in (("step", step), ("head", head_only)):
        body()
        device.synchronize()
        graph = capture(device.stream_handle, body)
        times = []
        for _ in range(30):
            start, end = cuda.event(), cuda.event()
            start.record(stream)
            graph.replay(device.stream_handle)
            end.record(stream)
            end.synchronize()
            times.append(cuda.event_elapsed_time(start, end))
        out[name] = float(np.median(times[3:]))
        graph.close()
    eager = []
    for _ in range(10):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        step()
        end.record(stream)
        end.synchronize()
        eager.append(cuda.event_elapsed_time(start, end))
    out["eager_step"] = float(np.median(eager[2:]))
    return out


def main() -> None:
    report = {"layers": LAYERS, "context": CONTEXT, "cases": []}
    for name, (dims, fixture) in CASES.items():
        ours = ninfer_step_ms(dims)
        theirs = hf_step_ms(fixture)
        case = {"model": name, "ninfer_graph_step_ms": ours["step"], "ninfer_eager_step_ms": ours["eager_step"],
                "ninfer_head_ms": ours["head"], "transformers_step_ms": theirs,
                "ninfer_ms_per_layer": (ours["step"] - ours["head"]) / LAYERS,
                "speedup": theirs / ours["step"]}
        report["cases"].append(case)
        print(f"{name}: ninfer graph {ours['step']:.3f} ms/step (eager {ours['eager_step']:.2f}, head "
              f"{ours['head']:.3f}), transformers {theirs:.2f} ms/step, x{theirs / ours['step']:.1f}", flush=True)
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "transformers_side_by_side.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
