"""GPU timings of the Gated DeltaNet kernels at the real model shapes (Qwen3.6-27B and 35B-A3B).

Scenarios per model: decode (8 segments x 1 row), verify (8 segments x 4 rows, recording columns), prefill (1 segment x
8192 rows; the model runs the chunked gated delta rule there, `gdn_chunked`, and the recurrent kernel is shown as the
alternative, as is `chunked_64`: the chunked rule with its scan at 64 value columns a block whatever the grid;
`prepare` is its first launch alone, `prepare_rN` the same under a register cap of N). Each
launcher is timed with CUDA events (3 warm-ups, median of RUNS), queued behind a sleeping kernel so the ~26 us Python
launch cost is not in the measurement; small scenarios rotate 3 input sets (states included) so they do not sit in the
60 MB L2. `recurrent_g8` is the recurrent kernel with 8 key groups (alternatives are not counted in the layer total,
which uses what the model runs). Prints a table and writes JSON to $OUT/kernel_gdn.json when OUT is set.

Run on the GPU box: `python bench/kernel_gdn.py [--models 27b,35b] [--scenarios decode,verify,prefill]
[--kernels prepare,chunked]` (--kernels: only those timed, and only those alternatives compiled; no layer total).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels_numba import gdn, gdn_chunked  # noqa: E402
from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402

F32 = np.float32
COPY_BW = 4.3e12  # measured device copy bandwidth, bytes/s
RUNS = 20
WARMUP = 3
K = 4
# register caps the prepare kernel is also timed under (6 and 4 blocks of 128 threads an SM), beside `prepare` at
# the default PREPARE_MAX_REGISTERS (96, 5 blocks; the K and Q staging spills 36 bytes under it)
PREPARE_CAPS = (80, 128)

MODELS = {
    "27b": dict(qk_heads=16, v_heads=48, k_dim=128, v_dim=128),
    "35b": dict(qk_heads=16, v_heads=32, k_dim=128, v_dim=128),
}
SCENARIOS = {
    "decode": dict(segments=8, rows_each=1, record=0),
    "verify": dict(segments=8, rows_each=4, record=1),
    "prefill": dict(segments=1, rows_each=8192, record=0),
}


@cuda.jit
def _sleep(iterations):
    for _ in range(iterations):
        cuda.nanosleep(1000)


def _timed(stream, launch, sets, sleep_iterations):
    for i in range(WARMUP):
        launch(sets[i % len(sets)])
    stream.synchronize()
    _sleep[1, 1, stream](sleep_iterations)
    pairs = []
    for i in range(RUNS):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        launch(sets[i % len(sets)])
        end.record(stream)
        pairs.append((start, end))
    stream.synchronize()
    return statistics.median(cuda.event_elapsed_time(a, b) * 1e3 for a, b in pairs)  # us


def _make_set(rng, m, sc, stream):
    hq, hv, dk, dv = m["qk_heads"], m["v_heads"], m["k_dim"], m["v_dim"]
    c, vw = 2 * hq * dk + hv * dv, hv * dv
    s, each = sc["segments"], sc["rows_each"]
    rows = s * each
    cols = each if sc["record"] else 1
    lanes = s

    def dev(a):
        return cuda.to_device(np.ascontiguousarray(a), stream=stream)

    def empty(*shape):
        return cuda.device_array(shape, F32, stream=stream)

    d = dict(
        projected=dev(rng.standard_normal((rows, c + vw), dtype=F32)),
        conv_weight=dev(rng.standard_normal((K, c), dtype=F32) * F32(0.5)),
        conv_state=dev(rng.standard_normal((lanes, K - 1, c), dtype=F32)),
        conv_columns=dev(np.zeros((lanes, cols, K - 1, c), F32)),
        ab=dev(rng.standard_normal((rows, 2 * hv), dtype=F32)),
        neg_a=dev(-np.exp(rng.uniform(-1.5, 0.5, hv)).astype(F32)),
        dt_bias=dev(rng.standard_normal(hv, dtype=F32) * F32(0.5)),
        ssm_state=dev(rng.standard_normal((lanes, hv, dk, dv), dtype=F32) * F32(0.1)),
        ssm_columns=dev(np.zeros((lanes, cols, hv, dk, dv), F32)),
        norm=dev(np.ones(dv, F32)),
        seg_lane=dev(np.arange(s, dtype=np.int32)),
        seg_row=dev((np.arange(s) * each).astype(np.int32)),
        seg_count=dev(np.full(s, each, np.int32)),
        seg_record=dev(np.full(s, sc["record"], np.int32)),
        result_bf16=cuda.device_array((rows, hv * dv), np.uint16, stream=stream), mixed=empty(rows, c),
        q=empty(rows, hq, dk), k=empty(rows, hq, dk), log_decay=empty(rows, hv),
        beta=empty(rows, hv), out=empty(rows, hv, dv), result=empty(rows, hv * dv),
        cum=empty(rows, hv), mats=empty(rows, hv, gdn_chunked.CHUNK),
    )
    d.update(rows=rows, c=c, vw=vw, lanes=lanes)
    return d


def _launchers(m, stream, scenario):
    """(launchers in layer order, the names of alternatives not counted in the layer total)."""
    hq, hv, dk, dv = m["qk_heads"], m["v_heads"], m["k_dim"], m["v_dim"]

    def seg(d):
        return d["seg_lane"], d["seg_row"], d["seg_count"], d["seg_record"]

    launchers = {
        "conv": lambda d: gdn.gdn_conv(d["projected"], d["conv_weight"], d["conv_state"], d["conv_columns"], *seg(d),
                                       d["mixed"], channels=d["c"], stream=stream, quads=False),
        # the scalar conv, and with 2 or 4 threads a block along rows (the default is 1: at 72 registers a
        # 512-thread block fits once an SM)
        "conv_r2": lambda d: gdn.gdn_conv(d["projected"], d["conv_weight"], d["conv_state"], d["conv_columns"],
                                          *seg(d), d["mixed"], channels=d["c"], stream=stream, row_threads=2,
                                          quads=False),
        "conv_r4": lambda d: gdn.gdn_conv(d["projected"], d["conv_weight"], d["conv_state"], d["conv_columns"],
                                          *seg(d), d["mixed"], channels=d["c"], stream=stream, row_threads=4,
                                          quads=False),
        # the conv with 4 channels a thread (16-byte rows, weights, outputs and histories; the same bits)
        "conv_quads": lambda d: gdn.gdn_conv(d["projected"], d["conv_weight"], d["conv_state"], d["conv_columns"],
                                             *seg(d), d["mixed"], channels=d["c"], stream=stream, quads=True),
        "gates": lambda d: gdn.gdn_gates(d["mixed"], d["ab"], d["neg_a"], d["dt_bias"], d["q"], d["k"],
                                         d["log_decay"], d["beta"], qk_heads=hq, v_heads=hv, k_dim=dk,
                                         stream=stream, tf32=scenario == "prefill"),  # as the model's prefill
        "recurrent": lambda d: gdn.gdn_recurrent(d["q"], d["k"], d["mixed"], d["log_decay"], d["beta"],
                                                 d["ssm_state"], d["ssm_columns"], *seg(d), d["out"], qk_heads=hq,
                                                 v_heads=hv, k_dim=dk, v_dim=dv, channels_qk=2 * hq * dk,
                                                 stream=stream),
        "recurrent_g8": lambda d: gdn.gdn_recurrent(d["q"], d["k"], d["mixed"], d["log_decay"], d["beta"],
                                                    d["ssm_state"], d["ssm_columns"], *seg(d), d["out"],
                                                    qk_heads=hq, v_heads=hv, k_dim=dk, v_dim=dv,
                                                    channels_qk=2 * hq * dk, stream=stream, groups=8),
        "output": lambda d: gdn.gdn_output(d["out"], d["projected"], d["norm"], d["result"], v_heads=hv, v_dim=dv,
                                           z_offset=d["c"], eps=1e-6, stream=stream),
    }
    if scenario != "prefill":
        return launchers, {"recurrent_g8", "conv_r2", "conv_r4"}

    def chunked(multiprocessors):
        return lambda d: gdn_chunked.gdn_chunked(
            d["q"], d["k"], d["mixed"], d["log_decay"], d["beta"], d["ssm_state"], d["seg_lane"], d["seg_row"],
            d["seg_count"], d["out"], d["cum"], d["mats"], rows=d["rows"], qk_heads=hq, v_heads=hv, k_dim=dk,
            v_dim=dv, channels_qk=2 * hq * dk, multiprocessors=multiprocessors, stream=stream)

    def prepare(max_registers):
        return lambda d: gdn_chunked.gdn_chunk_prepare(
            d["q"], d["k"], d["log_decay"], d["beta"], d["seg_row"], d["seg_count"], d["cum"], d["mats"],
            rows=d["rows"], qk_heads=hq, v_heads=hv, k_dim=dk, stream=stream, max_registers=max_registers)

    # the model's prefill form of the conv and the gates: q and k normalised in the conv's pass (at k_dim 128), the
    # gates then only the decays and betas; the output's bf16 copy alone (its reader is a cuBLAS GEMM)
    launchers["conv_normed"] = lambda d: gdn.gdn_conv_normed(
        d["projected"], d["conv_weight"], d["conv_state"], d["conv_columns"], *seg(d), d["mixed"], d["q"], d["k"],
        channels=d["c"], qk_heads=hq, k_dim=dk, stream=stream)
    launchers["gates_decays"] = lambda d: gdn.gdn_gates(
        d["mixed"], d["ab"], d["neg_a"], d["dt_bias"], d["q"], d["k"], d["log_decay"], d["beta"], qk_heads=hq,
        v_heads=hv, k_dim=dk, stream=stream, tf32=True, norms=False)
    launchers["output_bf16"] = lambda d: gdn.gdn_output(d["out"], d["projected"], d["norm"], None, v_heads=hv,
                                                        v_dim=dv, z_offset=d["c"], eps=1e-6, stream=stream,
                                                        result_bf16=d["result_bf16"])
    launchers["chunked"] = chunked(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    launchers["chunked_64"] = chunked(0)  # no SMs to fill: `scan_slice` keeps 64 columns
    launchers["prepare"] = prepare(gdn_chunked.PREPARE_MAX_REGISTERS)  # the chunked rule's first launch alone
    for cap in PREPARE_CAPS:  # the same kernel under register caps (more blocks an SM; the same bits)
        launchers[f"prepare_r{cap}"] = prepare(cap)
    return launchers, {"recurrent", "recurrent_g8", "conv_r2", "conv_r4", "conv_quads", "chunked_64", "prepare",
                       "conv", "gates", "output", *(f"prepare_r{cap}" for cap in PREPARE_CAPS)}


def _bytes_and_flops(name, m, sc, d):
    hq, hv, dk, dv = m["qk_heads"], m["v_heads"], m["k_dim"], m["v_dim"]
    rows, c, vw, lanes = d["rows"], d["c"], d["vw"], d["lanes"]
    rec = sc["record"]
    if name.startswith("conv"):
        return 4 * (2 * rows * c + K * c + 2 * lanes * (K - 1) * c + rec * rows * (K - 1) * c), 2 * K * rows * c
    if name == "gates":
        return 4 * (2 * rows * 2 * hq * dk + 2 * rows * 2 * hv), 0
    if name == "gates_decays":
        return 4 * (2 * rows * 2 * hv), 0
    if name.startswith("prepare"):  # q and k read, G and the packed T / P written
        return 4 * (2 * rows * hq * dk + 2 * rows * hv + rows * hv * (1 + 64)), 0
    if name.startswith(("recurrent", "chunked")):  # the recurrence's FLOPs for both forms
        state = hv * dk * dv
        return (4 * (2 * lanes * state + rows * (2 * hq * dk + 2 * hv + 2 * hv * dv) + rec * rows * state),
                8 * rows * state)
    if name == "output":
        return 4 * (3 * rows * vw + dv), 0
    if name == "output_bf16":  # o and z read in fp32, the result written in bf16
        return 4 * (2 * rows * vw + dv) + 2 * rows * vw, 0
    raise KeyError(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--kernels", default="", help="time only these launchers (e.g. prepare,prepare_r128,chunked);"
                        " the model's own launchers still run once to make their inputs. Default: all, and the total")
    args = parser.parse_args()
    only = set(filter(None, args.kernels.split(",")))
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    records = []
    header = f"{'model':5} {'scenario':8} {'kernel':10} {'us':>10} {'GB/s':>9} {'of 4.3TB/s':>10} {'TFLOP/s':>8}"
    print(header)
    print("-" * len(header))
    for model_name in args.models.split(","):
        m = MODELS[model_name]
        for sc_name in args.scenarios.split(","):
            sc = SCENARIOS[sc_name]
            n_sets = 1 if sc_name == "prefill" else 3
            sets = [_make_set(rng, m, sc, stream) for _ in range(n_sets)]
            launchers, alternatives = _launchers(m, stream, sc_name)
            if only:  # each alternative compiles a kernel of its own: skip those not asked for
                unknown = only - set(launchers)
                if unknown:
                    raise SystemExit(f"no launcher {sorted(unknown)} in {sc_name}; there are {sorted(launchers)}")
                launchers = {name: launch for name, launch in launchers.items()
                             if name in only or name not in alternatives}
            for d in sets:  # realistic inputs for each stage (normalised q/k, real gates)
                for launch in launchers.values():
                    launch(d)
            stream.synchronize()
            sleep_iterations = 3000
            total = 0.0
            for kname, launch in launchers.items():
                if only and kname not in only:
                    continue
                us = _timed(stream, launch, sets, sleep_iterations)
                if kname not in alternatives:
                    total += us
                nbytes, flops = _bytes_and_flops(kname, m, sc, sets[0])
                gbs = nbytes / (us * 1e-6) / 1e9
                tflops = flops / (us * 1e-6) / 1e12
                rec = dict(model=model_name, scenario=sc_name, kernel=kname, rows=sets[0]["rows"], us=us,
                           bytes=nbytes, gb_per_s=gbs, ratio_to_copy_bw=gbs * 1e9 / COPY_BW, tflops=tflops)
                records.append(rec)
                print(f"{model_name:5} {sc_name:8} {kname:10} {us:10.1f} {gbs:9.1f} {gbs * 1e9 / COPY_BW:10.3f} "
                      f"{tflops:8.3f}")
            rows = sets[0]["rows"]
            if only:  # a partial list has no layer total
                del sets
                continue
            layer = dict(model=model_name, scenario=sc_name, kernel="layer_total", rows=rows, us=total,
                         tokens_per_s_per_layer=rows / (total * 1e-6))
            records.append(layer)
            print(f"{model_name:5} {sc_name:8} {'TOTAL':10} {total:10.1f}   rows {rows}: "
                  f"{rows / (total * 1e-6):,.0f} tokens/s per layer")
            del sets
    out = os.environ.get("OUT")
    if out:
        Path(out, "kernel_gdn.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
