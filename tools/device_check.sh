#!/usr/bin/env bash
# One device call that checks and measures the CUDA backend: GPU tests first (correctness), then the benchmarks.
# Usage (device run, carry .whl): bash tools/device_check.sh [TEST_SECONDS] [BENCH_ARGS...]
# Logs and JSON land in $OUT (or ./device-out without it).
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/device_setup.sh || exit 1
OUT="${OUT:-$PWD/device-out}"; mkdir -p "$OUT"
TEST_SECONDS="${1:-300}"; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout "$TEST_SECONDS" python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --timeout 240 \
  tests/test_cuda_device.py tests/kernels tests/test_cuda_runner.py 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -E "passed|failed|FAILED|ERROR|Error" | tail -40
timeout "${BENCH_SECONDS:-300}" python3 bench/cuda_model.py "$@" 2>&1 | tee "$OUT/cuda_model.log" | grep -v "^\s*$" | tail -40
