"""The SASS a registered numba kernel becomes on sm_90, without a GPU: what ptxas made of a loop (which loads come
before which mma, registers, spills) decides a memory-bound kernel's speed, and reading it here costs no device
time.

    python tools/sass.py quant_mma_kernel            # list the matching kernels and signatures
    python tools/sass.py quant_mma_kernel 4 [-o DIR] # kernel 4 of that list: registers, instruction mix, the
                                                     # loads/mma/branches in order; DIR keeps the .ptx/.cubin/.sass

Needs `ptxas` (a CUDA toolkit's, on PATH or under /usr/local/cuda*/bin) and `nvdisasm`: the PyPI wheel
nvidia-cuda-nvdisasm is fetched into ~/.cache/ninfer-nvdisasm when no nvdisasm is on PATH. numba's NVVM may emit a
newer PTX ISA version than the local ptxas knows; the kernels use nothing newer than 9.0, so the version line is
lowered to what ptxas reports.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CACHE = Path.home() / ".cache" / "ninfer-nvdisasm"
SHOWN = re.compile(r"\b(LDG|STG|LDS|STS|LDGSTS|HMMA|BRA|BAR|WARPSYNC|SHFL|ATOM|RED|PREEXIT|ACQBULK)\b")


def find_tool(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))), None)
    if found:
        return found
    if name != "nvdisasm":
        raise SystemExit(f"{name} not found: install a CUDA toolkit")
    cached = sorted(CACHE.glob("**/bin/nvdisasm"))
    if not cached:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "nvidia-cuda-nvdisasm", "-d",
                        str(CACHE)], check=True)
        for wheel in CACHE.glob("*.whl"):
            shutil.unpack_archive(str(wheel), str(CACHE / wheel.stem), format="zip")
        cached = sorted(CACHE.glob("**/bin/nvdisasm"))
        os.chmod(cached[0], 0o755)
    return str(cached[0])


def ptxas_isa(ptxas: str) -> str:
    """The newest PTX ISA version the local ptxas accepts (its error names it for a too-new one)."""
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe.ptx"
        probe.write_text(".version 99.9\n.target sm_90\n.address_size 64\n")
        text = subprocess.run([ptxas, "-arch=sm_90", str(probe), "-o", os.devnull], capture_output=True,
                              text=True).stderr
    match = re.search(r"current version is '([0-9.]+)'", text)
    return match.group(1) if match else "9.0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="part of a registered kernel's qualified name")
    parser.add_argument("index", nargs="?", type=int, help="which of the listed (kernel, signature) cases")
    parser.add_argument("-o", "--out", help="folder that keeps the .ptx, .cubin and .sass")
    args = parser.parse_args()

    from ninfer.kernels_numba.numba_setup import hopper_ptx
    from tests.support.ptx_cases import cases

    found = [(entry, i, signature) for entry, i, signature in cases() if args.name in entry.name]
    if args.index is None or not 0 <= args.index < len(found):
        for n, (entry, i, signature) in enumerate(found):
            print(f"{n:3d}  {entry.name} (registration {entry.key[1]}, signature {i}): {signature}")
        return
    entry, _, signature = found[args.index]
    ptx = hopper_ptx(entry.function, signature, entry.options)
    ptxas = find_tool("ptxas")
    ptx = re.sub(r"^\.version [0-9.]+", f".version {ptxas_isa(ptxas)}", ptx, count=1, flags=re.M)
    folder = Path(args.out or tempfile.mkdtemp(prefix="ninfer-sass-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.ptx").write_text(ptx)
    cap = entry.options.get("max_registers")  # numba hands a register cap to the linker, not to the PTX
    report = subprocess.run([ptxas, "-arch=sm_90", "-v", *([f"-maxrregcount={cap}"] if cap else []),
                             str(folder / "kernel.ptx"), "-o", str(folder / "kernel.cubin")],
                            capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([find_tool("nvdisasm"), "-c", str(folder / "kernel.cubin")], capture_output=True, text=True,
                          check=True).stdout
    (folder / "kernel.sass").write_text(sass)
    lines = [line.strip() for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    print(entry.name, signature)
    print("\n".join(line for line in report.splitlines() if "registers" in line or "spill" in line))
    opcodes = (re.sub(r"^/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split(" ")[0] for line in lines)
    mix = collections.Counter(opcode.split(".")[0].rstrip(";") for opcode in opcodes)
    print(f"{len(lines)} instructions: " + ", ".join(f"{op} {n}" for op, n in mix.most_common(16)))
    for line in lines:
        if SHOWN.search(line):
            print("  " + line.rstrip(" ;"))
    print(f"files in {folder}")


if __name__ == "__main__":
    main()
