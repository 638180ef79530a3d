"""Where a kernel's instructions and warp stalls go, region by region of its SASS, from the source-page CSV that
`tools/device_check.sh ncu-script` (or `ncu-source`) writes. A region ends at each branch or barrier, so a loop body,
a copy block or a phase between two `syncthreads` reads as one line; dividing by warps and loop trips (--per) turns
the executed counts into instructions a warp an iteration (how the GDN scan's ~2,970 a chunk were found).

    python tools/ncu_regions.py ncu_script_source.csv [--kernel NAME_PART] [--per WARPS_X_TRIPS] [--min PERCENT]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def kernels(path: Path) -> list[dict]:
    """[{"name", "header", "rows"}...] of the CSV: each kernel's block starts with a "Kernel Name" row."""
    found: list[dict] = []
    for row in csv.reader(path.open()):
        if not row:
            continue
        if row[0] == "Kernel Name":
            found.append({"name": row[1], "header": None, "rows": []})
        elif row[0] == "Address" and found:
            found[-1]["header"] = row
        elif found and found[-1]["header"]:
            found[-1]["rows"].append(row)
    return found


def regions(kernel: dict) -> list[dict]:
    """Consecutive SASS lines up to and including each branch or barrier: first and last address, line count,
    instructions executed, stall samples, mma count, and the closing instruction."""
    header = kernel["header"]
    executed, samples, source = (header.index(name) for name in (
        "Instructions Executed", "Warp Stall Sampling (All Samples)", "Source"))
    out, current = [], None
    for row in kernel["rows"]:
        if current is None:
            current = {"first": row[0], "lines": 0, "executed": 0.0, "samples": 0.0, "mma": 0}
        current["lines"] += 1
        current["executed"] += float(row[executed] or 0)
        current["samples"] += float(row[samples] or 0)
        current["mma"] += "MMA" in row[source]
        if any(word in row[source] for word in ("BRA", "BAR", "EXIT")):
            current.update(last=row[0], closing=" ".join(row[source].split()))
            out.append(current)
            current = None
    if current is not None:
        current.update(last=kernel["rows"][-1][0], closing="")
        out.append(current)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--kernel", default="", help="part of the kernel's name (default: every kernel)")
    parser.add_argument("--per", type=float, default=1.0,
                        help="divide executed counts by this (warps x loop trips: per warp and iteration)")
    parser.add_argument("--min", type=float, default=0.5, help="hide regions under this percent of instructions")
    args = parser.parse_args()
    for kernel in kernels(args.csv):
        if args.kernel not in kernel["name"]:
            continue
        found = regions(kernel)
        total = sum(r["executed"] for r in found) or 1.0
        stalls = sum(r["samples"] for r in found) or 1.0
        print(f"{kernel['name'][:100]}\n  {total:.0f} warp instructions executed ({total / args.per:.1f} per --per), "
              f"{stalls:.0f} stall samples")
        for r in found:
            if 100 * r["executed"] / total < args.min and 100 * r["samples"] / stalls < args.min:
                continue
            print(f"  {r['first'][-6:]}..{r['last'][-6:]} {r['lines']:4d} lines {r['executed'] / args.per:9.1f} "
                  f"({100 * r['executed'] / total:4.1f}%) stalls {100 * r['samples'] / stalls:4.1f}% mma {r['mma']:3d}"
                  f"  {r['closing'][:48]}")


if __name__ == "__main__":
    main()
