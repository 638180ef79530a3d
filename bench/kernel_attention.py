"""Time the gated-attention kernels at the real Qwen3.6 shapes on a GPU (CUDA events, median of >= 20 runs).

    python bench/kernel_attention.py            # prints a table; writes $OUT/kernel_attention.json when OUT is set
    python bench/kernel_attention.py flash      # only the flash prefill kernel (`attention_flash`) at 8K tokens
    python bench/kernel_attention.py verify [ROWS...]  # decode attention for MTP verify runs (rows of one lane),
                                                       # staged vs tensor cores, bf16 and INT8 KV
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels_numba import attention as A  # noqa: E402
from ninfer.kernels_numba import attention_flash as F  # noqa: E402
from ninfer.kernels_numba.numba_setup import cuda  # noqa: E402

COPY_BW = 4.3e12
PAGE = 64
MODELS = {"27B": (24, 4, 256), "35B": (16, 2, 256)}
RUNS = 20
FLOORS = (64, 128, 256)  # fewest keys a decode split takes (`min_split_keys`), timed at the model's splits


@cuda.jit
def _spin(buf, iters):
    x = buf[0]
    for _ in range(iters):
        x = x * 0.9999999 + 1e-7
    buf[0] = x


_SPIN = {}


def _spin_iters(stream):
    """Iterations of the one-thread spin kernel that keep the GPU busy ~20 ms (so queued launches run back to back
    and the events time the kernels, not Python's launch overhead)."""
    if "iters" not in _SPIN:
        buf = cuda.to_device(np.ones(1, np.float32))
        _spin[1, 1, stream](buf, 1000)
        start, stop = cuda.event(), cuda.event()
        start.record(stream)
        _spin[1, 1, stream](buf, 200000)
        stop.record(stream)
        stop.synchronize()
        ms = cuda.event_elapsed_time(start, stop)
        _SPIN["iters"], _SPIN["buf"] = int(200000 * 20.0 / max(ms, 1e-3)), buf
    return _SPIN["iters"], _SPIN["buf"]


def timed(launch, sets, stream, warm=3, runs=RUNS):
    """Median GPU microseconds of `launch(set)` over `runs` launches rotating through `sets`."""
    for i in range(warm):
        launch(sets[i % len(sets)])
    stream.synchronize()
    iters, buf = _spin_iters(stream)
    _spin[1, 1, stream](buf, iters)
    events = []
    for i in range(runs):
        start, stop = cuda.event(), cuda.event()
        start.record(stream)
        launch(sets[i % len(sets)])
        stop.record(stream)
        events.append((start, stop))
    stream.synchronize()
    return float(np.median([cuda.event_elapsed_time(a, b) * 1e3 for a, b in events]))


def make_pools(rng, pages, kv_heads, d, dtype):
    shape = (pages, PAGE, kv_heads, d)
    if dtype == "bf16":
        k = cuda.to_device((rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))
        v = cuda.to_device((rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))
        return k, v, None, None
    sshape = shape[:-1] + (d // 64,)
    k = cuda.to_device(rng.integers(-127, 128, shape, dtype=np.int8))
    v = cuda.to_device(rng.integers(-127, 128, shape, dtype=np.int8))
    ks = cuda.to_device(np.full(sshape, 0.01, np.float16).view(np.uint16))
    vs = cuda.to_device(np.full(sshape, 0.01, np.float16).view(np.uint16))
    return k, v, ks, vs


def kv_token_bytes(kv_heads, d, dtype):
    per = 2 * d if dtype == "bf16" else d + 2 * (d // 64)
    return 2 * kv_heads * per


def bench_decode(rows_out, stream):
    """The head_dim 256 decode kernel at 1K / 8K / 32K context, B = 1 and 8, over several splits: the best split,
    the time at the model's own (`row_splits`) and there with each split floor."""
    rng = np.random.default_rng(0)
    for model, (heads, kv_heads, d) in MODELS.items():
        for dtype in ("bf16", "int8"):
            for ctx in (1024, 8192, 32768):
                for batch in (1, 8):
                    sets_n = 3
                    lanes = batch * sets_n
                    max_pages = ctx // PAGE
                    pools = make_pools(rng, lanes * max_pages, kv_heads, d, dtype)
                    tables = cuda.to_device(np.arange(lanes * max_pages, dtype=np.int32).reshape(lanes, max_pages))
                    q = cuda.to_device(rng.standard_normal((batch, heads, d), dtype=np.float32))
                    qkgv = cuda.to_device(rng.standard_normal((batch, 2 * (heads + kv_heads) * d), dtype=np.float32))
                    pos = cuda.to_device(np.full(batch, ctx - 1, np.int32))
                    row_lanes = [cuda.to_device(np.arange(s * batch, (s + 1) * batch, dtype=np.int32))
                                 for s in range(sets_n)]
                    out = cuda.device_array((batch, heads * d), np.float32)
                    compulsory = batch * ctx * kv_token_bytes(kv_heads, d, dtype)
                    model_splits = A.row_splits(kv_heads)

                    def time_at(split, floor, pools=pools):
                        """Median us of the kernel with `split` splits of at least `floor` keys."""
                        partials = cuda.device_array(A.decode_partials_shape(batch, heads, d, split), np.float32)

                        def launch(row_lane):
                            A.attention_decode(q, qkgv, tables, row_lane, pos, *pools, out, partials, heads=heads,
                                               kv_heads=kv_heads, head_dim=d, stream=stream, min_split_keys=floor)

                        return timed(launch, row_lanes, stream)

                    by_split = {split: time_at(split, 0) for split in sorted({16, 32, 64, 128, 256, model_splits})}
                    split, us = min(by_split.items(), key=lambda item: item[1])
                    model_us = by_split[model_splits]
                    # at the model's splits, at least FLOORS keys a split (`min_split_keys`)
                    floors = {floor: time_at(model_splits, floor) for floor in FLOORS}
                    bw = compulsory / (us * 1e-6)
                    rows_out.append(dict(kernel="decode_staged", model=model, kv=dtype, ctx=ctx, rows=batch,
                                         splits=split, us=us, gbps=bw / 1e9, of_copy=bw / COPY_BW,
                                         us_default_split=model_us, us_model_splits_floor=floors))
                    print(f"decode_staged {model} {dtype} ctx {ctx:6d} B={batch}: best split {split:3d} {us:8.1f} us "
                          f"({bw / COPY_BW:.2f} of copy), at {model_splits} splits {model_us:8.1f} us; with a floor "
                          "of " + ", ".join(f"{f}: {t:.1f}" for f, t in floors.items()), flush=True)
                    del pools, time_at


def bench_verify(rows_out, stream, ctx=8192, only=()):
    """The 27B's decode attention at `ctx` keys for MTP verify runs (1, 2 and 4 rows of one lane: the tensor-core
    kernel takes a run in one block) and 8 lanes of one row, bf16 and INT8 pools, staged SIMT kernel against tensor
    cores, both launches (split, combine) timed together at the model's splits and split floor. `only`: those row
    counts alone."""
    rng = np.random.default_rng(1)
    heads, kv_heads, d = MODELS["27B"]
    splits = A.row_splits(kv_heads)
    max_pages = ctx // PAGE + 1
    for dtype, (rows, lanes) in ((t, shape) for t in ("bf16", "int8") for shape in ((1, 1), (2, 1), (4, 1), (8, 8))):
        if only and rows not in only:
            continue
        sets_n = 3
        pools = make_pools(rng, sets_n * lanes * max_pages, kv_heads, d, dtype)
        tables = cuda.to_device(np.arange(sets_n * lanes * max_pages, dtype=np.int32).reshape(sets_n * lanes,
                                                                                               max_pages))
        q = cuda.to_device(rng.standard_normal((rows, heads, d), dtype=np.float32))
        qkgv = cuda.to_device(rng.standard_normal((rows, 2 * (heads + kv_heads) * d), dtype=np.float32))
        per_lane = rows // lanes
        pos = cuda.to_device(np.tile(ctx + np.arange(per_lane, dtype=np.int32), lanes))
        row_lanes = [cuda.to_device(np.repeat(np.arange(s * lanes, (s + 1) * lanes, dtype=np.int32), per_lane))
                     for s in range(sets_n)]
        out = cuda.device_array((rows, heads * d), np.float32)
        partials = cuda.device_array(A.decode_partials_shape(rows, heads, d, splits), np.float32)
        entry = dict(kernel="decode_verify", model="27B", kv=dtype, ctx=ctx, rows=rows, lanes=lanes, splits=splits)
        for tensor_cores in (False, True):
            def launch(row_lane, tensor_cores=tensor_cores):
                A.attention_decode(q, qkgv, tables, row_lane, pos, *pools, out, partials, heads=heads,
                                   kv_heads=kv_heads, head_dim=d, stream=stream, min_split_keys=64,
                                   tensor_cores=tensor_cores)

            entry["tensor_cores_us" if tensor_cores else "staged_us"] = timed(launch, row_lanes, stream)
        entry["us"] = entry["tensor_cores_us"]
        rows_out.append(entry)
        print(f"decode_verify 27B {dtype} ctx {ctx} rows {rows} lanes {lanes}: staged {entry['staged_us']:.1f} us, "
              f"tensor cores {entry['tensor_cores_us']:.1f} us", flush=True)


def bench_prefill(rows_out, stream, count=8192):
    rng = np.random.default_rng(1)
    for model, (heads, kv_heads, d) in MODELS.items():
        for dtype in ("bf16", "int8"):
            pages = count // PAGE
            pools = make_pools(rng, pages, kv_heads, d, dtype)
            tables = cuda.to_device(np.arange(pages, dtype=np.int32).reshape(1, pages))
            q = cuda.to_device(rng.standard_normal((count, heads, d), dtype=np.float32))
            qkgv = cuda.to_device(rng.standard_normal((count, 2 * (heads + kv_heads) * d), dtype=np.float32))
            out = cuda.device_array((count, heads * d), np.float32)

            def launch(_):
                A.attention_prefill(q, qkgv, tables, 0, 0, count, *pools, out, heads=heads, kv_heads=kv_heads,
                                    head_dim=d, stream=stream)

            us = timed(launch, [None], stream, warm=1, runs=RUNS)
            flops = 4 * heads * d * count * count / 2
            rows_out.append(dict(kernel="attention_prefill", model=model, kv=dtype, ctx=count, rows=count, us=us,
                                 tflops=flops / (us * 1e-6) / 1e12))


def bench_flash(rows_out, stream, count=8192):
    """The flash prefill kernel alone on gathered bf16 K / V^T and packed queries (random bits of moderate bf16
    values), one lane prefilling `count` tokens from position 0."""
    rng = np.random.default_rng(3)
    for model, (heads, kv_heads, d) in MODELS.items():
        group = heads // kv_heads

        def bf16(*shape):
            bits = rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16
            return cuda.to_device(bits.astype(np.uint16))

        packed, keys, values_t = bf16(kv_heads, group * count, d), bf16(kv_heads, count, d), bf16(kv_heads, d, count)
        qkgv = cuda.to_device(rng.standard_normal((count, 2 * (heads + kv_heads) * d), dtype=np.float32))
        out = cuda.device_array((count, heads * d), np.float32)

        def launch(_):
            F.flash_prefill(packed, keys, values_t, qkgv, out, rows=count, first_position=0, length=count,
                            group=group, stream=stream)

        us = timed(launch, [None], stream, warm=1, runs=RUNS)
        flops = 4 * heads * d * count * count / 2
        rows_out.append(dict(kernel="flash_prefill", model=model, kv="bf16", ctx=count, rows=count, us=us,
                             tflops=flops / (us * 1e-6) / 1e12))


def bench_prepare(rows_out, stream):
    rng = np.random.default_rng(2)
    for model, (heads, kv_heads, d) in MODELS.items():
        for dtype in ("bf16", "int8"):
            for rows in (1, 8, 48, 8192):
                pages = -(-rows // PAGE) + 1
                pools = make_pools(rng, pages, kv_heads, d, dtype)
                tables = cuda.to_device(np.arange(pages, dtype=np.int32).reshape(1, pages))
                sets = []
                for _ in range(3):
                    qkgv = cuda.to_device(rng.standard_normal((rows, 2 * (heads + kv_heads) * d), dtype=np.float32))
                    sets.append(qkgv)
                q_out = cuda.device_array((rows, heads, d), np.float32)
                norm = cuda.to_device(rng.standard_normal(d, dtype=np.float32))
                inv_freq = cuda.to_device((1e7 ** (-np.arange(0, 64, 2) / 64)).astype(np.float32))
                pos = cuda.to_device(np.arange(rows, dtype=np.int32))
                positions = cuda.to_device(np.tile(np.arange(rows, dtype=np.int32), (3, 1)))
                lanes = cuda.to_device(np.zeros(rows, np.int32))

                def launch(qkgv):
                    A.attention_prepare(qkgv, norm, norm, inv_freq, positions, lanes, pos, tables, *pools, q_out,
                                        heads=heads, kv_heads=kv_heads, head_dim=d, rotary_dim=64,
                                        sections=(11, 11, 10), eps=1e-6, stream=stream)

                us = timed(launch, sets, stream)
                moved = rows * ((heads + 2 * kv_heads) * d * 4 + heads * d * 4 + kv_token_bytes(kv_heads, d, dtype))
                bw = moved / (us * 1e-6)
                rows_out.append(dict(kernel="attention_prepare", model=model, kv=dtype, rows=rows, us=us,
                                     gbps=bw / 1e9, of_copy=bw / COPY_BW))


def main() -> None:
    stream = cuda.stream()
    results: list[dict] = []
    which = [arg for arg in sys.argv[1:] if not arg.isdigit()] or ["prepare", "decode", "prefill"]
    if "prepare" in which:
        bench_prepare(results, stream)
    if "decode" in which:
        bench_decode(results, stream)
    if "verify" in which:
        bench_verify(results, stream, only=tuple(int(arg) for arg in sys.argv[1:] if arg.isdigit()))
    if "prefill" in which:
        bench_prefill(results, stream)
    if "flash" in which:
        bench_flash(results, stream)
    print(f"{'kernel':18} {'model':5} {'kv':5} {'ctx':>6} {'rows':>5} {'split':>5} {'us':>10} {'GB/s':>8} "
          f"{'of4.3':>6} {'TFLOP/s':>8} {'us@model_split':>16}")
    for r in results:
        print(f"{r['kernel']:18} {r['model']:5} {r['kv']:5} {r.get('ctx', ''):>6} {r['rows']:>5} "
              f"{r.get('splits', ''):>5} {r['us']:10.1f} {r.get('gbps', float('nan')):8.0f} "
              f"{r.get('of_copy', float('nan')):6.2f} {r.get('tflops', float('nan')):8.2f} "
              f"{r.get('us_default_split') or float('nan'):16.1f}")
    dispatchers = {name: getattr(A, name)
                   for name in ("decode_split_kernel", "decode_combine_kernel", "prefill_kernel")}
    dispatchers.update({f"decode_staged_kernel[{'int8' if quant else 'bf16'}]": dispatcher
                        for quant, dispatcher in A.DECODE_STAGED_KERNELS.items()})
    for name, dispatcher in dispatchers.items():
        try:
            print(name, "regs", sorted(set(dispatcher.get_regs_per_thread().values())),
                  "local bytes", sorted(set(dispatcher.get_local_mem_per_thread().values())),
                  "shared bytes", sorted(set(dispatcher.get_shared_mem_per_block().values())))
        except Exception as error:  # noqa: BLE001 (diagnostics only)
            print(name, "no info:", error)
    out = os.environ.get("OUT")
    if out:
        Path(out, "kernel_attention.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
