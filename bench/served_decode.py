"""Served decode throughput: the engine's scheduler over the CUDA runner at the real shapes (random weights), as a
server runs it, against the decode graphs' own time.

bench/cuda_model.py times the captured graphs back to back; a served token also pays the scheduler's round (batch
assembly, output policies, events), the runner's Python (its inputs, the read of the tokens, the accept rules of a
speculative round) and the host's turn-around between graphs. This bench builds the model and runner as the
server does (startup graph captures included), admits `batch` requests of `--prompt` tokens with `--output`
tokens each, lets their prefills finish, then times the decode rounds until every request completes: served
tokens/s, the seconds a round, the share spent inside `runner.decode`, and the share the scheduler adds around it.

Sampled requests use a Qwen preset (temperature 0.7, top_p 0.8, presence penalty 1.5) and draw on the device;
greedy ones take the argmax. With `--draft-tokens k` the runner speculates with the MTP head; random weights make
its drafts all but never accepted, so those rounds are the worst case of a speculative round's host work (a token a
round), not a model's speed.

    python bench/served_decode.py --models 35b --recipes bf16 --batches 1,8 --modes greedy,sampled
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels_numba import numba_setup  # noqa: E402,F401  (numpy shim first)

from bench.cuda_model import MODELS, SAMPLED_PRESET  # noqa: E402
from bench.host_trace import HostTrace  # noqa: E402
from ninfer.backends.cuda.capacity import Capacity  # noqa: E402
from ninfer.backends.cuda.device import CudaDevice  # noqa: E402
from ninfer.backends.cuda.model import CudaQwen  # noqa: E402
from ninfer.backends.cuda.runner import CudaRunner  # noqa: E402
from ninfer.backends.cuda.weights import RandomDeviceWeights  # noqa: E402
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs  # noqa: E402
from ninfer.engine.config import EngineConfig  # noqa: E402
from ninfer.engine.request import PreparedPrompt, StopTokenPolicy  # noqa: E402
from ninfer.engine.sampler import SamplingParams  # noqa: E402
from ninfer.engine.scheduler import Scheduler  # noqa: E402

MODES = {"greedy": SamplingParams.greedy(), "sampled": SAMPLED_PRESET}


def build(dims, recipe: str, device, *, lanes: int, max_context: int, prefill_chunk: int,
          draft_tokens: int) -> CudaRunner:
    """The model and runner as the server builds them (`backends.cuda.build`), over random weights: a KV pool for
    every lane's whole context, the decode graphs and the full-size prefill chunk captured at startup."""
    specs = [s for s in plan_qwen_tensor_specs(dims) if not s.name.startswith("vision/")]
    capacity = Capacity(lanes=lanes, max_context=max_context, kv_dtype="bf16", prefill_rows=prefill_chunk,
                        draft_tokens=draft_tokens)
    model = CudaQwen(dims, RandomDeviceWeights(specs, recipe, device), device, capacity)
    model.allocate_kv(lanes * capacity.max_pages_per_lane)
    runner = CudaRunner(model, draft_tokens=draft_tokens)
    runner.capture_decode_graphs()
    runner.capture_prefill_graph()
    device.synchronize()
    return runner


def served(runner: CudaRunner, *, batch: int, prompt: int, output: int, sampling: SamplingParams,
           max_context: int, prefill_chunk: int, draft_tokens: int) -> dict:
    """`batch` requests through the scheduler: their prefills, then the timed decode rounds until all finish."""
    config = EngineConfig(max_concurrency=runner.info.lanes, max_context=max_context, prefill_chunk=prefill_chunk,
                          spec="mtp" if draft_tokens else None, draft_tokens=draft_tokens)
    scheduler = Scheduler(runner, config)
    rng = np.random.default_rng(batch)
    sinks = []
    for request_id in range(batch):
        ids = rng.integers(0, runner.info.vocab_ids, prompt)
        events: queue.SimpleQueue = queue.SimpleQueue()
        sinks.append(events)
        scheduler.enqueue(scheduler.new_request(
            request_id, PreparedPrompt(token_ids=ids, assistant_boundary=prompt, prologue_end=prompt), output,
            sampling, StopTokenPolicy(), events.put))
    while scheduler.snapshot().decode_ready < batch:
        scheduler.step()
    produced_before = _drain_tokens(sinks)  # the prefills' tokens, and a first round's with the last prefill
    trace, rounds = HostTrace(), 0
    trace.wrap(runner, "decode")  # each round's seconds inside the runner

    def decode_all() -> None:
        nonlocal rounds
        while scheduler.snapshot().running:
            scheduler.step()
            rounds += 1

    began = time.perf_counter()
    events = trace.run(decode_all)
    seconds = time.perf_counter() - began
    inside = [end - start for _, start, end in events]
    tokens = _drain_tokens(sinks)  # the timed rounds'
    if produced_before + tokens != batch * output:
        raise RuntimeError(f"{produced_before + tokens} tokens reached the sinks, not {batch} x {output}")
    return {"batch": batch, "prompt": prompt, "output": output, "rounds": rounds, "tokens": tokens,
            "seconds": seconds, "tok_s": tokens / seconds, "round_ms": seconds / rounds * 1e3,
            "runner_ms": float(np.median(inside)) * 1e3 if inside else 0.0,
            "scheduler_ms": (seconds - sum(inside)) / rounds * 1e3}


def _drain_tokens(sinks: list[queue.SimpleQueue]) -> int:
    """The tokens the requests' events carried since the last drain."""
    count = 0
    for events in sinks:
        while not events.empty():
            count += len(events.get().tokens)
    return count


def bench_served(device, models: dict, recipes: list[str], batches: list[int], modes: list[str], *, prompt: int,
                 output: int, draft_tokens: int, prefill_chunk: int) -> list[dict]:
    """Every (model, recipe) built once, then each batch size and request mode served on it."""
    max_context = prompt + output + 64
    runs = []
    for name, dims in models.items():
        for recipe in recipes:
            began = time.perf_counter()
            runner = build(dims, recipe, device, lanes=max(batches), max_context=max_context,
                           prefill_chunk=prefill_chunk, draft_tokens=draft_tokens)
            print(f"[{name} {recipe}] built and captured in {time.perf_counter() - began:.1f}s", flush=True)
            for batch in batches:
                for mode in modes:
                    run = served(runner, batch=batch, prompt=prompt, output=output, sampling=MODES[mode],
                                 max_context=max_context, prefill_chunk=prefill_chunk, draft_tokens=draft_tokens)
                    runs.append({"model": name, "recipe": recipe, "mode": mode, **run})
                    print(f"  B={batch} {mode:7s}: {run['tok_s']:8.1f} tok/s served, {run['round_ms']:6.2f} ms a "
                          f"round (runner {run['runner_ms']:.2f}, scheduler {run['scheduler_ms']:.2f})", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="35b", help="27b and/or 35b")
    parser.add_argument("--recipes", default="bf16", help="bf16 and/or ninfer-v2")
    parser.add_argument("--batches", default="1,8", help="concurrent requests (1..8)")
    parser.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled requests")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens a request")
    parser.add_argument("--output", type=int, default=128, help="generated tokens a request")
    parser.add_argument("--draft-tokens", type=int, default=0, help="MTP draft window (0: no speculation)")
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or not all(1 <= b <= 8 for b in batches):
        parser.error("--modes takes greedy and/or sampled; --batches counts of 1..8")
    device = CudaDevice(0)
    report = {"device": device.info.name, "settings": vars(args),
              "runs": bench_served(device, {name: MODELS[name] for name in args.models.split(",")},
                                   args.recipes.split(","), batches, modes, prompt=args.prompt, output=args.output,
                                   draft_tokens=args.draft_tokens, prefill_chunk=args.prefill_chunk)}
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "served_decode.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
