"""bench/host_trace.py: the wrapped calls' stamps, the originals restored, and the per-layer reading of a MoE
prefill's host time."""

from __future__ import annotations

import gc

from bench.host_trace import GcPauses, HostTrace, host_gap_us, moe_waits


class Gemms:
    def gemm(self, x: int) -> int:
        return 2 * x


def test_wrapped_calls_are_stamped_in_order_and_restored():
    instance, trace = Gemms(), HostTrace()
    trace.wrap(instance, "gemm", "instance gemm")
    other = Gemms()
    trace.wrap(Gemms, "gemm", "class gemm")
    events = trace.run(lambda: (instance.gemm(3), other.gemm(4)))
    assert [label for label, _, _ in events] == ["instance gemm", "class gemm"]
    assert all(end >= start for _, start, end in events)
    assert "gemm" not in vars(instance) and Gemms.gemm.__name__ == "gemm"  # the originals are back
    assert instance.gemm(5) == 10 and trace.events == events


def test_moe_waits_reads_each_layer_from_its_wait_to_its_first_expert_gemm():
    us = 1e-6
    events = [("norm", 0 * us, 5 * us),
              ("sizes wait", 10 * us, 110 * us), ("staging write", 120 * us, 130 * us),
              ("chunked_gemm_bf16", 140 * us, 200 * us), ("silu", 210 * us, 215 * us),
              ("chunked_gemm_bf16", 220 * us, 260 * us),
              ("sizes wait", 300 * us, 350 * us), ("batched_gemm_bf16", 400 * us, 450 * us),
              ("sizes wait", 500 * us, 520 * us)]  # the last token's read: no GEMM follows, not a layer
    report = moe_waits(events, wait="sizes wait", gemms=("chunked_gemm_bf16", "batched_gemm_bf16"))
    layers = report["layers"]
    assert [round(layer["wait_us"]) for layer in layers] == [100, 50]
    assert [round(layer["to_first_gemm_us"]) for layer in layers] == [90, 100]
    assert [call["call"] for call in layers[0]["calls"]] == ["staging write", "chunked_gemm_bf16"]
    assert round(report["median_to_first_gemm_us"]) == 95
    assert report["call_us"]["chunked_gemm_bf16"]["calls"] == 2
    assert round(report["call_us"]["chunked_gemm_bf16"]["total"]) == 100


def test_host_gap_is_from_the_first_call_to_the_next_of_the_other():
    us = 1e-6
    events = [("rms_norm_rows", 0 * us, 2 * us), ("embed_rows", 5 * us, 9 * us), ("gemm", 10 * us, 20 * us),
              ("rms_norm_rows", 2709 * us, 2712 * us), ("rms_norm_rows", 3000 * us, 3003 * us)]
    assert round(host_gap_us(events, after="embed_rows", before="rms_norm_rows")) == 2700
    assert host_gap_us(events, after="embed_rows", before="moe_gather") is None
    assert host_gap_us(events, after="head", before="rms_norm_rows") is None


def test_gc_pauses_records_each_collection_while_open_and_none_after():
    gc.disable()  # only the two collections asked for
    try:
        with GcPauses() as pauses:
            gc.collect(2)
            gc.collect(0)
        gc.collect()
    finally:
        gc.enable()
    summary = pauses.summary()
    assert [g for g, _ in pauses.pauses] == [2, 0]
    assert summary["collections"] == 2 and summary["by_generation"] == {0: 1, 1: 0, 2: 1}
    assert 0 <= summary["max_ms"] <= summary["total_ms"]
