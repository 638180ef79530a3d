"""Where a kernel's warps wait, from Nsight Compute's source page (`ncu --import R --page source --print-source sass
--csv`): per kernel in the export, the instructions with the most warp-stall samples (address, SASS, samples,
instructions executed) and the totals, small enough to come back from the device machine when the full CSV (one row
per SASS instruction and ~40 columns) does not. Compare the addresses with `tools/sass.py`'s listing of the same
kernel, made without a GPU. Also the stall share and instructions executed of each stretch between block barriers
(BAR.SYNC), in address order: a kernel's phases.

    python bench/ncu_source_summary.py SOURCE.csv [--top 60] > summary.txt
"""

from __future__ import annotations

import argparse
import csv
import sys


def _column(header: list[str], *needles: str) -> int | None:
    """The first column whose name contains every needle (case-insensitive), or None."""
    for index, name in enumerate(header):
        if all(needle.lower() in name.lower() for needle in needles):
            return index
    return None


def _tables(rows: list[list[str]]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, body) per kernel: a table starts at a row whose first cell is "Address"; the title is the
    last row before it that is not part of a table (ncu prints the kernel's name there)."""
    tables, title, header, body = [], "", None, []
    for row in rows:
        if row and row[0].strip().strip('"') == "Address":
            if header is not None:
                tables.append((title, header, body))
            header, body = row, []
        elif header is not None and len(row) == len(header):
            body.append(row)
        elif row:
            if header is not None:
                tables.append((title, header, body))
                header, body = None, []
            title = " ".join(row)[:160]
    if header is not None:
        tables.append((title, header, body))
    return tables


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=60)
    args = parser.parse_args()
    with open(args.csv, newline="") as handle:
        rows = list(csv.reader(handle))
    tables = _tables(rows)
    if not tables:
        sys.exit(f"no source table in {args.csv}")
    for title, header, body in tables:
        source = _column(header, "source")
        stalls = _column(header, "warp stall sampling", "all")
        executed = _column(header, "instructions executed")
        if stalls is None or source is None:
            print(f"{title}: no stall-sampling or source column in {header[:12]}")
            continue
        total_stalls = sum(_number(row[stalls]) for row in body) or 1.0
        total_executed = sum(_number(row[executed]) for row in body) if executed is not None else 0.0
        print(f"== {title}")
        print(f"   {len(body)} SASS instructions, {total_stalls:.0f} stall samples, "
              f"{total_executed:.0f} warp instructions executed")
        # the kernel's phases: stretches of code between block barriers, in address order
        phases, first, samples, ran = [], body[0][0] if body else "", 0.0, 0.0
        for row in body:
            samples += _number(row[stalls])
            ran += _number(row[executed]) if executed is not None else 0.0
            if "BAR.SYNC" in row[source]:
                phases.append((first, row[0], samples, ran))
                first, samples, ran = "", 0.0, 0.0
            elif not first:
                first = row[0]
        phases.append((first, body[-1][0] if body else "", samples, ran))
        print("   phases between barriers (first, last address: stall share, warp instructions executed):")
        for start, end, phase_samples, phase_ran in phases:
            print(f"   {start:>8} - {end:>8}  {phase_samples / total_stalls:6.1%} {phase_ran:12.0f}")
        ranked = sorted(body, key=lambda row: -_number(row[stalls]))[:args.top]
        for row in ranked:
            share = _number(row[stalls]) / total_stalls
            ran = _number(row[executed]) if executed is not None else 0.0
            print(f"   {row[0]:>8} {share:6.1%} {ran:12.0f}  {row[source].strip()[:90]}")


if __name__ == "__main__":
    main()
