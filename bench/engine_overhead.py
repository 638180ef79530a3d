"""Scheduler overhead per decode round at batch 8, excluding model compute.

The engine-side work of one round (batch assembly, the runner call's inputs and outputs, output policies, ledger and
frontier commits, counters, events into per-request queues), measured two ways:
* null runner: a runner that answers instantly with fixed tokens, so all of `Scheduler.step()` is overhead;
* tiny model: the CPU runner on the tiny 4-layer Qwen, step time minus the time spent inside `runner.decode`.
Each in plain decoding and with MTP (k = 3).

    python bench/engine_overhead.py [--rounds 3000] [--out bench/results/engine_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ninfer.backends.cpu.runner import build_cpu_runner  # noqa: E402
from ninfer.engine.config import EngineConfig  # noqa: E402
from ninfer.engine.request import PreparedPrompt, StopTokenPolicy  # noqa: E402
from ninfer.engine.runner import DecodeResult, PrefillResult, RunnerInfo  # noqa: E402
from ninfer.engine.sampler import SamplingParams  # noqa: E402
from ninfer.engine.scheduler import Scheduler  # noqa: E402
from tests.test_runner_cpu import tiny_qwen  # noqa: E402

BATCH = 8


class NullRunner:
    """The runner interface with no model behind it: every round returns the same precomputed answer."""

    def __init__(self, *, lanes: int, pages: int, draft_tokens: int) -> None:
        self.info = RunnerInfo(lanes=lanes, pages=pages, page_tokens=64, checkpoint_slots=2, vocab_ids=1000,
                               draft_tokens=draft_tokens, kv_bytes_per_token=1)
        produced = draft_tokens + 1
        self._result = DecodeResult(tokens=np.full((lanes, produced), 7, np.int32),
                                    counts=np.full(lanes, produced, np.int32),
                                    accepted=np.full(lanes, draft_tokens, np.int32),
                                    drafts_ready=np.full(lanes, draft_tokens > 0))

    def assign_pages(self, lane, page_table): pass
    def begin_sequence(self, lane, start): pass
    def save_checkpoint(self, lane, slot): pass
    def rewind(self, lane, kept): pass
    def release(self, lane): pass

    def prefill(self, chunk):
        return PrefillResult(7 if chunk.final else -1, self.info.draft_tokens > 0)

    def decode(self, batch):
        return self._result


def decode_ready_scheduler(runner, config: EngineConfig) -> Scheduler:
    """A scheduler whose BATCH requests are all past prefill, with output limits far away."""
    scheduler = Scheduler(runner, config)
    rng = np.random.default_rng(0)
    for request_id in range(BATCH):
        prompt = PreparedPrompt(token_ids=rng.integers(0, 400, 64), assistant_boundary=60, prologue_end=64)
        events: queue.SimpleQueue = queue.SimpleQueue()
        scheduler.enqueue(scheduler.new_request(request_id, prompt, config.max_context - 64, SamplingParams.greedy(),
                                                StopTokenPolicy({999}), events.put))
    while scheduler.snapshot().decode_ready < BATCH:
        scheduler.step()
    return scheduler


def measure(runner, config: EngineConfig, rounds: int) -> dict:
    scheduler = decode_ready_scheduler(runner, config)
    inside = []
    decode = runner.decode

    def timed_decode(batch):
        began = time.perf_counter_ns()
        result = decode(batch)
        inside.append(time.perf_counter_ns() - began)
        return result

    runner.decode = timed_decode
    totals = []
    for _ in range(rounds):
        began = time.perf_counter_ns()
        scheduler.step()
        totals.append(time.perf_counter_ns() - began)
    assert scheduler.snapshot().decode_ready == BATCH, "a request finished during the measurement"
    overhead = (np.array(totals) - np.array(inside)) / 1000.0
    return {"rounds": rounds, "batch": BATCH, "overhead_us_median": float(np.median(overhead)),
            "overhead_us_mean": float(np.mean(overhead)), "overhead_us_p90": float(np.percentile(overhead, 90)),
            "runner_us_median": float(np.median(inside) / 1000.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3000, help="decode rounds per null-runner measurement")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine_overhead.json")
    args = parser.parse_args()
    model = tiny_qwen()
    figures = {}
    for k in (0, 3):
        mode = f"mtp{k}" if k else "plain"
        for kind, context, rounds in (("null_runner", 32768, args.rounds), ("tiny_model", 2048, 200)):
            spec = dict(spec="mtp", draft_tokens=k) if k else {}
            config = EngineConfig(max_concurrency=BATCH, max_context=context, prefill_chunk=128,
                                  kv_capacity=BATCH * context, **spec)
            runner = NullRunner(lanes=BATCH, pages=BATCH * context // 64, draft_tokens=k) if kind == "null_runner" \
                else build_cpu_runner(model, config)
            figures[f"{kind}_{mode}"] = measure(runner, config, rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    result = {"benchmark": "engine_overhead", "date": time.strftime("%Y-%m-%d"), "commit": commit.stdout.strip(),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "python": platform.python_version(), **figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, values in figures.items():
        print(f"{name:22s} overhead median {values['overhead_us_median']:7.1f} us/round "
              f"(p90 {values['overhead_us_p90']:.1f}); runner {values['runner_us_median']:.1f} us")


if __name__ == "__main__":
    main()
