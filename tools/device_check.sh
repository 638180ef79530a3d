#!/usr/bin/env bash
# The CUDA backend's checks on the GPU machine, one device call each (carry .whl; run tools/device_wheels.sh here
# first). Logs and JSON land in $OUT (./device-out without it).
#   bash tools/device_check.sh tests [SECONDS [TEST PATHS]]  GPU tests: device plumbing, every kernel vs its twin,
#                                                   the runner (or only the paths given)
#   bash tools/device_check.sh bench [BENCH ARGS]   bench/cuda_model.py (e.g. --models 27b --recipes bf16 --kv int8)
#   bash tools/device_check.sh served [BENCH ARGS]  bench/served_decode.py (the scheduler over the CUDA runner:
#                                                   served tokens/s of greedy and sampled requests)
#   bash tools/device_check.sh peers                bench/transformers_side_by_side.py
#   bash tools/device_check.sh cold [BENCH ARGS]    bench/cold_tier_ttft.py (needs 2 GPUs: kind nvidia-h200-x2)
#   bash tools/device_check.sh vision [BENCH ARGS]  bench/vision_tower_gpu.py
#   bash tools/device_check.sh quant [BENCH ARGS]   bench/quant_gemv.py (SIMT vs tensor-core quantized GEMV)
#   bash tools/device_check.sh dflash [BENCH ARGS]  bench/dflash_round.py (the DFlash round at the real 35B shape)
#   bash tools/device_check.sh moe [--sweep]        bench/moe_gathered.py (SIMT vs tensor-core gathered MoE experts)
#   bash tools/device_check.sh moe-chunked [--caps 80]  bench/moe_chunked.py (a v2 prefill chunk's routed experts
#                                                   from their codes vs dequantized for cuBLAS)
#   bash tools/device_check.sh linear [--sweep]     bench/kernel_linear.py (the decode GEMVs, bf16 gathered geometries)
#   bash tools/device_check.sh probes               the MoE prefill's cuBLAS probes: bench/cublas_host_cost.py (host
#                                                   time of the chunked call) and bench/grouped_lt_probe.py
#                                                   (cuBLASLt's grouped matmul with device-side sizes)
#   bash tools/device_check.sh split-k              bench/split_k_probe.py (the decode out projection's split-K:
#                                                   cuBLAS's, or sliced partials reduced in the norm after it)
#   bash tools/device_check.sh ncu MODEL RECIPE REGEX [COUNT]  Nsight Compute on the decode kernels whose names match
#                                                   REGEX (bench/ncu_decode.py: one eager step, 4 layers + head)
#   bash tools/device_check.sh ncu-source MODEL RECIPE REGEX [COUNT]  the same kernels' warp stalls per SASS
#                                                   instruction (SourceCounters), as CSV, and the report itself
#   bash tools/device_check.sh ncu-script REGEX COUNT SCRIPT [ARGS]  Nsight Compute on the first COUNT launches
#                                                   matching REGEX in any script (e.g. bench/kernel_gdn.py --models 35b
#                                                   --scenarios prefill): the headline sections and the warp stalls
#                                                   and instructions executed per SASS instruction (CSV, gzipped,
#                                                   and summarised by bench/ncu_source_summary.py)
#   bash tools/device_check.sh ncu-dram MODEL RECIPE REGEX [COUNT]  the same kernels' DRAM and L2 traffic against
#                                                   their duration (bytes read from DRAM vs requested, throughput)
# The filters run --line-buffered, so a call cut short by its time limit still brings back its log up to the cut
# (session 14 lost a whole call's figures to grep's block buffer).
# numba compiles every kernel specialization in each new process (tens of seconds in all): keep a call's work in one
# process where possible, and leave each call well inside the 10-minute limit.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/device_setup.sh || exit 1
OUT="${OUT:-$PWD/device-out}"; mkdir -p "$OUT"
what="${1:-tests}"; shift || true
quiet() { grep --line-buffered -v -i "warn"; }  # drop the warning lines, keep each other line as it comes
# At the end of every call the kernel cache (.kernel-cache, tools/device_setup.sh) comes back in $OUT, in parts of at
# most 15 MiB, where it fits the 8 files a call returns and the carry limit (45 MiB with the core wheels): unpacked
# here by tools/kernel_cache_unpack.sh, the next session's first call carries it, so a kernel whose sources did not
# change since is loaded, not compiled.
pack_kernel_cache() {
  [ -d .kernel-cache ] || return 0
  tar -czf /tmp/kernel-cache.tgz .kernel-cache || return 0
  local size parts
  size=$(stat -c %s /tmp/kernel-cache.tgz); parts=$(( (size + 15728639) / 15728640 ))
  if [ "$size" -le $(( 45 * 1048576 )) ] && [ $(( $(ls -1 "$OUT" | wc -l) + parts )) -le 8 ]; then
    split -b 15m -d /tmp/kernel-cache.tgz "$OUT/kernel-cache.tgz.part"
    echo "kernel cache: $(du -sh .kernel-cache | cut -f1) in $parts part(s) of $OUT"
  else
    echo "kernel cache: $(du -sh .kernel-cache | cut -f1), $size bytes packed: not sent back (size or file count)"
  fi
}
trap pack_kernel_cache EXIT
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"  # the ncu modes' profiler
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
case "$what" in
  tests)
    # xdist workers on 3/4 of the cores (numba compiles per process: ~3 min with 12 on 16 cores); SIGINT at the
    # limit makes pytest print the summary of what ran, failures named, instead of dying silently. -v names each
    # result as it lands: in session 13 the controller twice hung tearing its workers down after the last test,
    # summary unprinted, until the SIGINT (the failure's name then came from nowhere else).
    seconds="${1:-540}"; shift || true
    paths=("$@")
    [ ${#paths[@]} -gt 0 ] || paths=(tests/test_cuda_device.py tests/kernels tests/test_cuda_runner.py
      tests/test_cuda_vision.py tests/test_lane_image.py tests/test_cold_tier.py tests/test_cuda_dflash.py)
    timeout -s INT "$seconds" python3 -m pytest -v -n $(( $(nproc) * 3 / 4 )) -p no:cacheprovider -m gpu \
      -o addopts="-ra" --timeout 400 "${paths[@]}" > "$OUT/gpu_tests.log" 2>&1
    echo "$(grep -c " PASSED " "$OUT/gpu_tests.log") PASSED lines"
    grep -E " (FAILED|ERROR) |^(FAILED|ERROR)|passed|failed|Timeout" "$OUT/gpu_tests.log" | tail -40 ;;
  bench)
    python3 bench/cuda_model.py "$@" 2>&1 | quiet | tee "$OUT/cuda_model.log" | tail -60 ;;
  served)
    python3 bench/served_decode.py "$@" 2>&1 | quiet | tee "$OUT/served_decode.log" | tail -40 ;;
  peers)
    python3 bench/transformers_side_by_side.py 2>&1 | quiet | tee "$OUT/side_by_side.log" | tail -20 ;;
  cold)
    python3 bench/cold_tier_ttft.py "$@" 2>&1 | quiet | tee "$OUT/cold_tier_ttft.log" | tail -20 ;;
  vision)
    python3 bench/vision_tower_gpu.py "$@" 2>&1 | quiet | tee "$OUT/vision_tower_gpu.log" | tail -20 ;;
  quant)
    python3 bench/quant_gemv.py "$@" 2>&1 | quiet | tee "$OUT/quant_gemv.log" | tail -40 ;;
  dflash)
    python3 bench/dflash_round.py "$@" 2>&1 | quiet | tee "$OUT/dflash_round.log" | tail -20 ;;
  moe)
    python3 bench/moe_gathered.py "$@" 2>&1 | quiet | tee "$OUT/moe_gathered.log" | tail -20 ;;
  moe-chunked)
    python3 bench/moe_chunked.py "$@" 2>&1 | quiet | tee "$OUT/moe_chunked.log" | tail -20 ;;
  linear)
    python3 bench/kernel_linear.py "$@" 2>&1 | quiet | tee "$OUT/kernel_linear.log" | tail -60 ;;
  probes)
    python3 bench/cublas_host_cost.py 2>&1 | quiet | tee "$OUT/cublas_host_cost.log" | tail -12
    python3 bench/grouped_lt_probe.py 2>&1 | quiet | tee "$OUT/grouped_lt_probe.log" | tail -12 ;;
  split-k)
    python3 bench/split_k_probe.py 2>&1 | quiet | tee "$OUT/split_k_probe.log" | tail -12 ;;
  ncu)
    # Counters with the clocks left alone (METHOD.md); the sections that say what bounds a kernel: throughput against
    # the peaks, memory traffic per level, occupancy and its limiter, registers, and where warps stall.
    model="${1:-27b}"; recipe="${2:-ninfer-v2}"; regex="${3:-.}"; count="${4:-60}"
    log="$OUT/ncu_${model}_${recipe}.txt"
    "$NCU" --clock-control none -k "regex:$regex" --launch-count "$count" --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis \
      python3 bench/ncu_decode.py --model "$model" --recipe "$recipe" --steps 1 > "$log" 2>&1
    grep -E "^  [a-zA-Z_]|Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit Reg|Warp Cycles Per Issued|Local" "$log" | head -400 ;;
  ncu-source)
    # Where in the SASS the warps wait (compare with tools/sass.py's listing of the same kernel, made without a GPU).
    model="${1:-27b}"; recipe="${2:-ninfer-v2}"; regex="${3:-.}"; count="${4:-4}"
    "$NCU" --clock-control none -k "regex:$regex" --launch-count "$count" --section SourceCounters \
      --section WarpStateStats --section SpeedOfLight -f -o "$OUT/ncu_source" \
      python3 bench/ncu_decode.py --model "$model" --recipe "$recipe" --steps 1 > "$OUT/ncu_source_run.txt" 2>&1
    "$NCU" --import "$OUT/ncu_source.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_source.csv" \
      2> "$OUT/ncu_source_page.err"
    tail -3 "$OUT/ncu_source_run.txt"; cat "$OUT/ncu_source_page.err" | head -5
    head -c 3000 "$OUT/ncu_source.csv" ;;
  ncu-dram)
    # Whether a memory-bound kernel reads more than it needs (x re-reads missing L2, scale words, partial sectors)
    # or reads what it needs slowly: DRAM bytes and sectors against the L1 requests, with the duration.
    model="${1:-27b}"; recipe="${2:-ninfer-v2}"; regex="${3:-.}"; count="${4:-8}"
    metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
    metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum
    metrics+=,lts__t_sector_op_read_hit_rate.pct,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
    metrics+=,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,sm__warps_active.avg.pct_of_peak_sustained_active
    "$NCU" --clock-control none -k "regex:$regex" --launch-count "$count" --metrics "$metrics" --csv \
      python3 bench/ncu_decode.py --model "$model" --recipe "$recipe" --steps 1 > "$OUT/ncu_dram.csv" 2>&1
    python3 -c 'import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[0].isdigit()]
for r in rows: print(r[0], r[4].split("(")[0][-48:], r[12], r[13], r[14])' "$OUT/ncu_dram.csv" | head -120 ;;
  ncu-script)
    regex="$1"; count="$2"; shift 2
    "$NCU" --clock-control none -k "regex:$regex" --launch-count "$count" --section SourceCounters \
      --section WarpStateStats --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis -f -o "$OUT/ncu_script" python3 "$@" \
      > "$OUT/ncu_script_run.txt" 2>&1
    "$NCU" --import "$OUT/ncu_script.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_script_source.csv" \
      2> /dev/null
    "$NCU" --import "$OUT/ncu_script.ncu-rep" --page details > "$OUT/ncu_script_details.txt" 2>&1
    # the full source CSV did not come back in session 22: a summary (top stalls per kernel) and the CSV gzipped
    head -c 1500 "$OUT/ncu_script_source.csv" > "$OUT/ncu_script_source_head.txt"
    python3 bench/ncu_source_summary.py "$OUT/ncu_script_source.csv" > "$OUT/ncu_script_summary.txt" 2>&1
    gzip -f "$OUT/ncu_script_source.csv"
    grep -E "^  [a-zA-Z_]|Duration|Throughput|Registers Per|Occupancy|Warp Cycles Per Issued|Issued Warp|Eligible" \
      "$OUT/ncu_script_details.txt" | cut -c1-160 | head -60
    head -50 "$OUT/ncu_script_summary.txt" ;;
  *) echo "usage: $0 tests|bench|served|peers|cold|vision|quant|dflash|moe|linear|ncu|ncu-source|ncu-script|ncu-dram [args]" >&2
     exit 2 ;;
esac
