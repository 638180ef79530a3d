"""The DFlash round of the CUDA backend at the real Qwen3.6-35B-A3B shape, random weights generated on the GPU.

One round as `CudaRunner.decode` runs it for B lanes at context L, every step a replayed CUDA graph:
1. the drafter call: each lane's pending committed columns (k+1 context rows; PENDING of them real, the rest padding,
   as after a round that committed PENDING tokens) projected into the drafter's caches, then the proposal block
   [anchor, MASK x k] through the six layers (five over their 4096-slot rings, one over the paged context), the final
   norm and the full head with its argmax; a read of the proposals;
2. the verify of the k+1 columns per lane (decoder with the context-feature capture, each lane's verify rows and
   features kept in its pending rows, head, argmax); a read.
Reported per batch and context: each graph's GPU time (events), the round's wall-clock time (host work and reads
included, as in bench/cuda_model.py's `mtp_rounds`), and the tokens/s implied at 4.6 to 5.6 tokens per round.

Run on the GPU machine: `python bench/dflash_round.py [--recipes ninfer-v2,bf16] [--contexts 1024,8192]
[--batches 1,2,4] [--k 7]`; JSON goes to `$OUT/dflash_round.json` (or `bench/results/dflash_round.json` without OUT).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cuda_model import event_time  # noqa: E402  (the repository root on sys.path first)
from ninfer.backends.cuda.timing import wall_seconds  # noqa: E402
from ninfer.backends.cuda.capacity import Capacity  # noqa: E402
from ninfer.backends.cuda.model import CudaQwen  # noqa: E402
from ninfer.backends.cuda.weights import RandomDeviceWeights  # noqa: E402
from ninfer.convert.qwen_hf import plan_qwen_tensor_specs  # noqa: E402
from ninfer.targets.registry import QWEN36_35B_A3B_DFLASH_DIMS, QWEN36_35B_A3B_DIMS  # noqa: E402

TOKENS_PER_ROUND = (4.6, 5.1, 5.6)  # the acceptance range DFlash reaches at k = 7 (1 + accepted drafts per round)
PENDING = 5  # committed columns of the previous round that the drafter call projects


def bench_dflash(recipe: str, *, device=None, dims=None, drafter=None, k: int = 7, contexts=(1024, 8192),
                 batches=(1, 2, 4), repeats: int = 20, decode_quant: str = "mma") -> dict:
    """Round timings of one recipe. `device`, `dims`, `drafter` and the sizes exist for the CPU smoke test (a
    HostDevice and a tiny model); the GPU run uses the defaults."""
    from ninfer.backends.cuda.device import CudaDevice

    dims, drafter = dims or QWEN36_35B_A3B_DIMS, drafter or QWEN36_35B_A3B_DFLASH_DIMS
    device = device or CudaDevice(0)
    specs = [s for s in plan_qwen_tensor_specs(dims, drafter) if not s.name.startswith("vision/")]
    lanes = max(batches)
    capacity = Capacity(lanes=lanes, max_context=max(contexts) + k + 1, kv_dtype="bf16", prefill_rows=128,
                        draft_tokens=k, spec="dflash", tensor_core_attention=False, decode_quant=decode_quant)
    began = time.perf_counter()
    model = CudaQwen(dims, RandomDeviceWeights(specs, recipe, device), device, capacity, dflash=drafter)
    model.allocate_kv(lanes * capacity.max_pages_per_lane)
    for lane in range(lanes):
        pages = capacity.max_pages_per_lane
        model.inputs.set_page_table(lane, np.arange(lane * pages, (lane + 1) * pages, dtype=np.int32))
    device.synchronize()
    result = {"recipe": recipe, "k": k, "decode_quant": decode_quant, "pending_columns": PENDING,
              "build_seconds": time.perf_counter() - began, "ledger_bytes": dict(device.ledger), "rounds": []}
    print(f"[35B-A3B + DFlash {recipe}] built in {result['build_seconds']:.1f}s, weights "
          f"{device.ledger['weights'] / 2**30:.1f} GiB", flush=True)
    for context in contexts:
        for batch in batches:
            result["rounds"].append(time_round(model, batch, context, repeats))
    return result


def time_round(model: CudaQwen, batch: int, context: int, repeats: int) -> dict:
    device, k = model.device, model.capacity.draft_tokens
    width, drafter = k + 1, model.dflash.dims
    block_rows = context_rows = rows = batch * width
    lanes = np.repeat(np.arange(batch), width)
    column = np.tile(np.arange(width), batch)
    block_positions = context + column
    committed = np.where(column < PENDING, context - PENDING + column, -1)  # the last round's columns, then padding
    window = drafter.sliding_window
    ring_slot = np.where(committed >= 0, committed % window, -1)

    def fill_drafter_inputs():
        ids = np.where(column == 0, 100 + lanes, drafter.mask_token_id)
        model.dflash_inputs.fill(ids=ids, positions=np.concatenate([block_positions, committed]),
                                 row_lane=np.concatenate([lanes, lanes]),
                                 ring_slot=np.concatenate([np.full(block_rows, -1), ring_slot]),
                                 context_source=lanes * width + column)

    def fill_verify_inputs():
        model.inputs.fill(token_ids=200 + column, positions=np.tile(block_positions, (3, 1)), row_lane=lanes,
                          row_pos=block_positions, seg_lane=np.arange(batch), seg_row=np.arange(batch) * width,
                          seg_count=np.full(batch, width), seg_record=np.ones(batch))

    def draft():
        model.dflash_step(block_rows, context_rows, from_pending=True)

    def verify():  # as the runner's step: each lane's verify rows and features kept inside it (`keep_segment_rows`)
        model.forward(rows, batch)
        model.keep_segment_rows(batch)
        model.greedy(model.head_logits(model.workspace.final, rows))

    graphs = {}
    for name, fill, body in (("draft", fill_drafter_inputs, draft), ("verify", fill_verify_inputs, verify)):
        fill()
        body()  # eager once (compiles the kernels), then captured
        device.synchronize()
        graphs[name] = device.capture(body)

    def round_():
        fill_drafter_inputs()
        graphs["draft"].replay(device.stream_handle)
        device.read(model.argmax[:block_rows])
        fill_verify_inputs()
        graphs["verify"].replay(device.stream_handle)
        device.read(model.argmax[:rows])

    gpu = {name: float(np.median(event_time(device.stream, lambda g=graph: g.replay(device.stream_handle),
                                            repeats)[1:])) for name, graph in graphs.items()}
    seconds = wall_seconds(round_, device.synchronize, repeats=repeats, warmup=3)
    for graph in graphs.values():
        graph.close()
    row = {"batch": batch, "context": context, "draft_graph_ms": gpu["draft"] * 1e3,
           "verify_graph_ms": gpu["verify"] * 1e3, "round_ms": seconds * 1e3,
           "tok_s_at_tokens_per_round": {str(t): batch * t / seconds for t in TOKENS_PER_ROUND}}
    print(f"  B={batch} L={context}: draft {row['draft_graph_ms']:6.2f} ms + verify {row['verify_graph_ms']:6.2f} ms "
          f"(graphs); round {seconds * 1e3:6.2f} ms -> "
          + ", ".join(f"{t} tok/round: {batch * t / seconds:6.1f} tok/s" for t in TOKENS_PER_ROUND), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", default="ninfer-v2,bf16")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--decode-quant", default="mma", choices=("simt", "mma"))
    args = parser.parse_args()
    from ninfer.kernels_numba.numba_setup import cuda

    report = {"configs": []}
    for recipe in args.recipes.split(","):
        report["configs"].append(bench_dflash(
            recipe, k=args.k, contexts=tuple(int(c) for c in args.contexts.split(",")),
            batches=tuple(int(b) for b in args.batches.split(",")), decode_quant=args.decode_quant))
        gc.collect()  # the configuration's device arrays go with its model
        cuda.current_context().deallocations.clear()
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "dflash_round.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
