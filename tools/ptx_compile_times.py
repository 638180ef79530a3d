"""How long each of CI's PTX compile cases takes (tests/kernels/test_ptx.py), to see where that test's minutes go.

    python tools/ptx_compile_times.py [--workers N] [--match TEXT] [--fresh] [--json PATH]

The cases compile in a pool of worker processes, as the test's fixture compiles them: a process keeps the helpers
numba has typed for its earlier cases, so a case's time depends on what its process compiled before. `--fresh`
gives every case a process of its own (each time then includes typing its helpers). The total is the cases'
seconds, the wall time what the pool took. No GPU needed."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.support.ptx_cases import cases, compile_case  # noqa: E402


def timed_case(key: tuple[str, int], signature_index: int) -> tuple[float, str | None]:
    start = time.perf_counter()
    outcome = compile_case(key, signature_index)
    return time.perf_counter() - start, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--match", default="", help="only the cases whose name holds this text")
    parser.add_argument("--fresh", action="store_true", help="a new process for every case")
    parser.add_argument("--json", default=None, help="write the per-case seconds here")
    args = parser.parse_args()

    chosen = [(f"{entry.name}#{entry.key[1]}:{i}", entry.key, i) for entry, i, _ in cases()
              if args.match in f"{entry.name}#{entry.key[1]}:{i}"]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1 if args.fresh else None) as pool:
        futures = [(name, pool.submit(timed_case, key, i)) for name, key, i in chosen]
        results = [(name, *future.result()) for name, future in futures]
    wall = time.perf_counter() - start

    for name, seconds, outcome in sorted(results, key=lambda r: -r[1]):
        print(f"{seconds:7.1f} s  {name}{'' if outcome is None else '  FAILED: ' + outcome[:200]}")
    total = sum(seconds for _, seconds, _ in results)
    print(f"{len(results)} cases, {total:.0f} s of compiles, {wall:.0f} s wall on {args.workers} workers")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"workers": args.workers, "fresh": args.fresh, "wall_s": wall, "total_s": total,
                       "cases": {name: {"seconds": seconds, "failed": outcome} for name, seconds, outcome in results}},
                      out, indent=1)


if __name__ == "__main__":
    main()
