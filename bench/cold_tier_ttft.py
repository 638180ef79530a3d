"""Time to first token of a returning conversation: restored from the cold tier vs prefilled again (issue 8).

At the real 27B shape with random weights on GPU 0 and a cold-tier arena on GPU 1, for prompts of 8,192 and 32,768
tokens: (a) prefill the prompt and sample its first token (what a returning conversation costs without the tier);
(b) park the lane's state in the arena, device -> pinned staging -> arena (what eviction costs); (c) take it back,
stream it into another lane and run the returning turn's suffix (`SUFFIX` tokens) to its first token (the tier's
TTFT). Wall-clock seconds, device synchronised.

Run on a 2-GPU machine: `python bench/cold_tier_ttft.py [--model 27b] [--tokens 8192,32768]`; JSON to
$OUT/cold_tier_ttft.json (bench/results without OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.engine.cold_tier import ColdTier  # noqa: E402
from ninfer.engine.prefix import Residency  # noqa: E402
from ninfer.engine.request import PreparedPrompt  # noqa: E402
from ninfer.engine.runner import PrefillChunk, SequenceStart, StateSource  # noqa: E402
from ninfer.engine.sampler import SamplingParams  # noqa: E402

SUFFIX = 32  # tokens of the returning turn (a short user message)
GREEDY = SamplingParams.greedy()


def prefill(runner, lane: int, ids: np.ndarray, start: int, chunk: int) -> tuple[int, float]:
    """Prefill ids[start:] on `lane` (kv_length start) in chunks; (first token, seconds)."""
    device = runner._model.device
    device.synchronize()
    began = time.perf_counter()
    token = -1
    for first in range(start, len(ids), chunk):
        end = min(first + chunk, len(ids))
        positions = np.tile(np.arange(first, end, dtype=np.int32), (3, 1))
        tail = np.full(3, max(first - 1, 0), np.int32)
        token = runner.prefill(PrefillChunk(lane=lane, token_ids=ids[first:end], positions=positions,
                                            kv_length=first, tail_position=tail, final=end == len(ids),
                                            remaining=8)).token
    device.synchronize()
    return token, time.perf_counter() - began


def measure(runner, arena, tokens: int, chunk: int, vocab: int) -> dict:
    page_tokens = runner.info.page_tokens
    pages = -(-(tokens + SUFFIX) // page_tokens)
    ids = np.random.default_rng(tokens).integers(0, vocab, tokens + SUFFIX).astype(np.int32)
    runner.assign_pages(0, np.arange(pages, dtype=np.int32))
    runner.begin_sequence(0, SequenceStart(source=StateSource.RESET, sampling=GREEDY))
    first, cold = prefill(runner, 0, ids[:tokens], 0, chunk)

    tier = ColdTier([arena])
    began = time.perf_counter()
    image = runner.export_lane_view(0, tokens - 1)  # the frontier: the last prompt token is not materialized
    resident = Residency()
    resident.ledger.assign(ids[:tokens], np.tile(np.arange(tokens, dtype=np.int32), (3, 1)), ())
    resident.frontier = tokens - 1
    parked = tier.park(resident, image)
    park_seconds = time.perf_counter() - began
    runner.release(0)

    began = time.perf_counter()
    key, plan = tier.best_match(PreparedPrompt(token_ids=ids))
    assert plan.frontier == tokens - 1, plan
    _, restored = tier.take(key)
    runner.assign_pages(1, np.arange(pages, 2 * pages, dtype=np.int32))
    runner.import_lane(1, restored)  # streamed from the arena through the staging buffer into the lane's pages
    tier.finish(key, restored=True)
    runner.begin_sequence(1, SequenceStart(source=StateSource.RESIDENT, sampling=GREEDY))
    runner._model.device.synchronize()
    restore_seconds = time.perf_counter() - began
    _, suffix_seconds = prefill(runner, 1, ids, tokens - 1, chunk)
    runner.release(1)
    return {"prompt_tokens": tokens, "image_bytes": image.nbytes, "parked": parked,
            "prefill_seconds": round(cold, 4), "park_seconds": round(park_seconds, 4),
            "restore_seconds": round(restore_seconds, 4), "suffix_prefill_seconds": round(suffix_seconds, 4),
            "ttft_restored_seconds": round(restore_seconds + suffix_seconds, 4),
            "ttft_prefilled_seconds": round(cold, 4), "first_token": int(first)}


def run(runner, arena, token_counts, chunk: int, vocab: int) -> list[dict]:
    measure(runner, arena, token_counts[0], chunk, vocab)  # warm-up: compiles every kernel specialization
    rows = []
    for tokens in token_counts:
        row = measure(runner, arena, tokens, chunk, vocab)
        rows.append(row)
        print(f"{tokens} tokens: prefilled TTFT {row['ttft_prefilled_seconds']:.3f} s, restored TTFT "
              f"{row['ttft_restored_seconds']:.3f} s (restore {row['restore_seconds']:.3f} s + suffix "
              f"{row['suffix_prefill_seconds']:.3f} s), park {row['park_seconds']:.3f} s, image "
              f"{row['image_bytes'] / 2**30:.2f} GiB", flush=True)
    return rows


def main() -> None:
    from bench.cuda_model import MODELS
    from ninfer.backends.cuda.cold_arena import build_cold_arenas
    from ninfer.backends.cuda.device import CudaDevice
    from ninfer.backends.cuda.capacity import Capacity
    from ninfer.backends.cuda.model import CudaQwen
    from ninfer.backends.cuda.runner import CudaRunner
    from ninfer.backends.cuda.weights import RandomDeviceWeights
    from ninfer.backends.cuda_probe import cuda_device_count
    from ninfer.convert.qwen_hf import plan_qwen_tensor_specs

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="27b")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--chunk", type=int, default=8192)
    args = parser.parse_args()
    counts = [int(t) for t in args.tokens.split(",")]
    arenas, _ = build_cold_arenas(primary=0, devices=cuda_device_count(), pinned=-1, capacity_mib=0, staging_mib=64)
    if not arenas:
        raise SystemExit("needs a second GPU for the cold-tier arena")
    device, dims = CudaDevice(0), MODELS[args.model]
    specs = [s for s in plan_qwen_tensor_specs(dims) if not s.name.startswith("vision/")]
    capacity = Capacity(lanes=2, max_context=max(counts) + SUFFIX + 64, kv_dtype="bf16", prefill_rows=args.chunk,
                        draft_tokens=0)
    model = CudaQwen(dims, RandomDeviceWeights(specs, "bf16", device), device, capacity)
    model.allocate_kv(2 * capacity.max_pages_per_lane)
    rows = run(CudaRunner(model), arenas[0], counts, args.chunk, dims.vocab_ids)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"device": device.info.name, "commit": commit, "model": args.model, "suffix_tokens": SUFFIX,
              "arena_device": arenas[0].device, "rows": rows}
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "cold_tier_ttft.json"
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
