"""tools/ncu_regions.py on a hand-made Nsight Compute source-page CSV (the real one needs a GPU run)."""

import csv
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]


def _write(path: Path, kernels: dict[str, list[tuple[str, int, int]]]) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        for name, lines in kernels.items():
            out.writerow(["Kernel Name", name])
            out.writerow(HEADER)
            for i, (source, samples, executed) in enumerate(lines):
                out.writerow([f"0x{16 * i:04x}", source, samples, executed])


def test_regions_end_at_branches_and_barriers_and_sum_their_lines(tmp_path):
    regions = importlib.import_module("ncu_regions")
    path = tmp_path / "source.csv"
    _write(path, {"scan_kernel": [("LDS R1, [R2]", 1, 10), ("HMMA.1688.F32.TF32 R4, R8, R12, R4", 3, 10),
                                  ("@P0 BRA 0x0000", 0, 10), ("BAR.SYNC.DEFER_BLOCKING 0x0", 6, 2),
                                  ("STS [R1], R2", 0, 2), ("EXIT", 0, 2)],
                  "other_kernel": [("IMAD R1, R2, R3, RZ", 1, 4)]})
    found = regions.kernels(path)
    assert [k["name"] for k in found] == ["scan_kernel", "other_kernel"]
    scan = regions.regions(found[0])
    assert [(r["first"], r["last"], r["lines"], r["executed"], r["samples"], r["mma"]) for r in scan] == [
        ("0x0000", "0x0020", 3, 30.0, 4.0, 1), ("0x0030", "0x0030", 1, 2.0, 6.0, 0),
        ("0x0040", "0x0050", 2, 4.0, 0.0, 0)]
    assert scan[1]["closing"] == "BAR.SYNC.DEFER_BLOCKING 0x0"
    # a kernel whose last line closes nothing still ends in a region
    assert [(r["lines"], r["closing"]) for r in regions.regions(found[1])] == [(1, "")]
