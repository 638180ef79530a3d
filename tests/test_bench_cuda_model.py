"""bench/cuda_model.py's measurement code runs end to end on a HostDevice with a tiny model (CPU), so the GPU run
spends its minutes measuring, not finding bugs in the script."""

from __future__ import annotations

import importlib

import attrs
import pytest

from tests.support.cuda_models import cuda_tiny_dims


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench.cuda_model")


def test_chosen_batches_and_prefill_paths_and_the_host_profile(bench):
    from ninfer.backends.cuda.host import HostDevice
    from ninfer.backends.cuda.capacity import Capacity
    from ninfer.kernels_numba.attention import row_splits

    default_floor = attrs.fields(Capacity).attention_min_split_keys.default

    dims = cuda_tiny_dims(moe=True)
    result = bench.bench_config("tiny", "bf16", "bf16", 1e12, 1e14, device=HostDevice(), dims=dims,
                                context=70, prefill_tokens=128, repeats=4, batches=(1, 8),
                                prefill_attentions=("gemm",), moe_chunks=(None, 16), moe_chunk_steps=(None, 4),
                                moe_sync_frees=(None, True),
                                profile=False,
                                branches=(False, True),
                                programmatic=(False, True), narrow=(False, True), attention_splits=(None, 96),
                                split_floors=(None, 128))
    # None: the model's own splits, the capacity's floor
    assert [(row["attention_splits"], row["min_split_keys"], row["branches"], row["programmatic"], row["narrow"],
             row["batch"]) for row in result["decode"]] == [
        (splits, floor, side, pdl, thin, batch) for splits in (row_splits(dims.kv_heads), 96)
        for floor in (default_floor, 128)
        for side in (False, True) for pdl in (False, True) for thin in (False, True) for batch in (1, 8)]
    assert all(row["context"] == 70 for row in result["decode"])
    assert result["branches_after_decode"] is True and result["programmatic_after_decode"] is True
    assert result["narrow_after_decode"] is True
    # the sync-free layout takes the chunk rows asked for too; a 128-row chunk is sync-free by default (None), so
    # every setting's chunk replays graphs in pieces
    assert [(row["moe_chunk_rows"], row["moe_sync_free_chunk_rows"], row["moe_chunk_step"], row["moe_sync_free"],
             row["prefill_graphs"]) for row in result["prefill"]] == [
        (chunk, 32 if chunk == 128 else chunk, step, free, [128]) for chunk in (128, 16) for step in (1, 4)
        for free in (None, True)]
    from bench.kernel_profile import host_profile

    assert "function calls" in host_profile(lambda: sum(range(100)), sort="tottime", top=3)


def test_a_prompt_shorter_than_the_chunk_runs_eagerly_or_padded_to_its_bucket_in_graphs(bench):
    """A 100-token prompt with a 128-row chunk (the server's workspace): unpadded it runs eagerly (no graph has
    its length); with prefill buckets it runs the full-size chunk's graphs, padded to 128 rows."""
    from ninfer.backends.cuda.host import HostDevice

    result = bench.bench_config("tiny", "bf16", "bf16", 1e12, 1e14, device=HostDevice(), dims=cuda_tiny_dims(moe=True),
                                context=70, prefill_tokens=100, prefill_chunk=128, repeats=4, prefill_only=True,
                                prefill_attentions=("flash",), prefill_buckets=(False, True))
    assert [(row["prefill_buckets"], row["padded_rows"], row["prefill_graphs"], row["chunk"], row["tokens"])
            for row in result["prefill"]] == [(False, [100], [], 128, 100), (True, [128], [128], 128, 100)]


def test_several_prompt_lengths_are_timed_on_one_build(bench):
    """--prefill-tokens 100,256 with a 128-row chunk: each setting times each length (one chunk padded to its
    bucket, then two full chunks replaying the captured graphs), the workspace the chunk's."""
    from ninfer.backends.cuda.host import HostDevice

    result = bench.bench_config("tiny", "bf16", "bf16", 1e12, 1e14, device=HostDevice(), dims=cuda_tiny_dims(moe=True),
                                context=70, prefill_tokens=(100, 256), prefill_chunk=128, repeats=4, prefill_only=True,
                                prefill_attentions=("flash",), prefill_buckets=(False, True))
    assert [(row["prefill_buckets"], row["tokens"], row["padded_rows"], row["prefill_graphs"], row["chunk"])
            for row in result["prefill"]] == [(False, 100, [100], [], 128), (False, 256, [128, 128], [128], 128),
                                              (True, 100, [128], [128], 128), (True, 256, [128, 128], [128], 128)]
    assert all(row["flops"] > 0 for row in result["prefill"])
    assert result["prefill"][1]["flops"] > 2 * result["prefill"][0]["flops"]


def test_sampled_lanes_are_timed_beside_greedy_ones(bench):
    """--sampled off,on: each batch's decode step and each MTP round as greedy and as sampled lanes run them (the
    draw in the step's graph; the verify's candidates with its drafts counted, read by the host); the sampled
    steps' tokens are draws, counted for the lanes' penalties."""
    from ninfer.backends.cuda.host import HostDevice

    result = bench.bench_config("tiny", "bf16", "bf16", 1e12, 1e14, device=HostDevice(), dims=cuda_tiny_dims(moe=True),
                                context=70, prefill_tokens=128, repeats=4, batches=(1, 2), mtp_only=True,
                                sampled=(False, True))
    assert [(row["batch"], row["sampled"]) for row in result["decode"]] == [(1, False), (1, True), (2, False),
                                                                            (2, True)]
    assert [(row["k"], row["sampled"]) for row in result["mtp_round"]] == [
        (k, sampled) for sampled in (False, True) for k in (1, 2, 3)]


def test_direct_quant_experts_are_timed_beside_the_dequantizing_path(bench):
    """--direct-quant-experts off,on on a ninfer-v2 MoE model: one prefill row each, the second without
    dequantizing the experts (fewer matrices dequantized: the routed gate|up and down of every layer)."""
    from ninfer.backends.cuda.host import HostDevice

    dims = cuda_tiny_dims(moe=True)
    result = bench.bench_config("tiny", "ninfer-v2", "bf16", 1e12, 1e14, device=HostDevice(), dims=dims, context=70,
                                prefill_tokens=256, prefill_chunk=128, repeats=4, prefill_only=True,
                                prefill_attentions=("flash",), prefill_graphs=(False,), decode_quant="mma",
                                direct_quant_experts=(False, True))
    rows = result["prefill"]
    assert [row["direct_quant_experts"] for row in rows] == [False, True]
    chunks_timed = rows[0]["dequantized"] - rows[1]["dequantized"]
    assert chunks_timed > 0 and chunks_timed % (2 * len(dims.layer_types)) == 0, rows


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("recipe,decode_quant", [("bf16", "simt"), ("ninfer-v2", "simt"), ("ninfer-v2", "mma")])
def test_every_measurement_runs_on_the_host_device(bench, moe, recipe, decode_quant):
    from ninfer.backends.cuda.host import HostDevice

    result = bench.bench_config("tiny", recipe, "bf16", 1e12, 1e14, device=HostDevice(), dims=cuda_tiny_dims(moe=moe),
                                context=70, prefill_tokens=128, repeats=4,
                                decode_linears=("kernels", "mma", "cublas", "auto"), decode_quant=decode_quant,
                                split_k_norms=(0, 2))
    assert result["decode_quant"] == decode_quant
    assert [(row["linear"], row["split_k_norm"], row["batch"]) for row in result["decode"]] == [
        (linear, sliced, batch) for linear in ("kernels", "mma", "cublas", "auto") for sliced in (0, 2)
        for batch in (1, 2, 4, 8)]
    tuned = result["decode_paths"]  # each bf16 shape the Linear multiplies at decode
    assert tuned or recipe != "bf16"
    assert all(row["path"] in row["us"] and row["us"][row["path"]] == min(row["us"].values()) for row in tuned)
    assert all(row["bytes"] > 0 and row["step_ms"] > 0 and row["graph_device_bytes"] >= 0 for row in result["decode"])
    assert [row["attention"] for row in result["prefill"]] == ["kernel", "gemm"]
    assert all(row["tokens"] == 128 and row["flops"] > 0 and row["prefill_graphs"] for row in result["prefill"])
    suffix = result["suffix_prefill"]
    assert suffix["context"] == 128 and suffix["seconds"] > 0 and suffix["graph_seconds"] > 0
    # the MTP rounds with each serving decode linear asked for (the bench passes the quantized recipes cublas only)
    assert [(row["decode_linear"], row["k"], row["proposals"]) for row in result["mtp_round"]] == [
        (linear, k, "full") for linear in ("kernels", "mma", "cublas") for k in (1, 2, 3)]


def test_moe_prefill_with_each_expert_gemm_layout(bench):
    from ninfer.backends.cuda.host import HostDevice

    result = bench.bench_config("tiny", "bf16", "bf16", 1e12, 1e14, device=HostDevice(), dims=cuda_tiny_dims(moe=True),
                                context=70, prefill_tokens=128, repeats=4, batches=(1,), prefill_attentions=("gemm",),
                                moe_gemms=("auto", "chunked"))
    assert [(row["attention"], row["moe_gemm"]) for row in result["prefill"]] == [("gemm", "auto"), ("gemm", "chunked")]


def test_mtp_rounds_with_the_shortlist_head_time_both_proposal_heads(bench):
    from ninfer.backends.cuda.host import HostDevice

    result = bench.bench_config("tiny", "ninfer-v2", "bf16", 1e12, 1e14, device=HostDevice(),
                                dims=cuda_tiny_dims(moe=False), context=70, prefill_tokens=128, repeats=4,
                                batches=(1,), prefill_attentions=("gemm",), draft_head=True)
    assert [(row["k"], row["proposals"]) for row in result["mtp_round"]] == [
        (k, head) for head in ("full", "shortlist") for k in (1, 2, 3)]
    assert all(row["round_ms"] > 0 for row in result["mtp_round"])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_ncu_program_runs_its_eager_steps_on_the_host_device(moe):
    from ninfer.backends.cuda.host import HostDevice

    ncu = importlib.import_module("bench.ncu_decode")
    dims = cuda_tiny_dims(moe=moe)
    tokens = ncu.eager_steps(HostDevice(), dims, "ninfer-v2", 2, 1, context=70)
    assert len(tokens) == 2 and all(0 <= t < dims.vocab_ids for t in tokens)


def test_off_on_options_parse_to_booleans_and_refuse_anything_else(bench):
    import argparse

    parser = argparse.ArgumentParser()
    assert bench.on_off(parser, "--programmatic", "on") == (True,)
    with pytest.raises(SystemExit):
        bench.on_off(parser, "--programmatic", "yes")


def test_prefill_only_times_the_prefill_and_nothing_else(bench):
    from ninfer.backends.cuda.host import HostDevice

    result = bench.bench_config("tiny", "bf16", "bf16", 1e12, 1e14, device=HostDevice(),
                                dims=cuda_tiny_dims(moe=True), context=70, prefill_tokens=128, repeats=4,
                                prefill_attentions=("gemm",), prefill_only=True)
    assert result["decode"] == []
    assert [(row["attention"], row["tokens"]) for row in result["prefill"]] == [("gemm", 128)]
    assert result["prefill"][0]["seconds"] > 0
    assert "suffix_prefill" not in result and "mtp_round" not in result


def test_the_prefill_in_server_sized_chunks(bench):
    """--prefill-chunk: the prompt prefilled chunk after chunk into one lane, the workspace sized for a chunk; a
    quantized model dequantizes its weights again for every chunk past the skinny rows."""
    from ninfer.backends.cuda.host import HostDevice

    runs = {chunk: bench.bench_config("tiny", "ninfer-v2", "bf16", 1e12, 1e14, device=HostDevice(),
                                      dims=cuda_tiny_dims(moe=True), context=70, prefill_tokens=192, repeats=4,
                                      prefill_attentions=("gemm",), prefill_only=True, prefill_chunk=chunk)
            for chunk in (None, 96)}
    assert [(row["tokens"], row["chunk"]) for row in runs[96]["prefill"]] == [(192, 96)]
    assert [(row["tokens"], row["chunk"]) for row in runs[None]["prefill"]] == [(192, 192)]
    assert runs[96]["ledger_bytes"]["workspace"] < runs[None]["ledger_bytes"]["workspace"]
    assert runs[96]["prefill"][0]["dequantized"] == 2 * runs[None]["prefill"][0]["dequantized"] > 0


def test_mtp_only_times_decode_and_the_rounds_with_each_graph_apart(bench):
    from ninfer.backends.cuda.host import HostDevice

    result = bench.bench_config("tiny", "bf16", "bf16", 1e12, 1e14, device=HostDevice(),
                                dims=cuda_tiny_dims(moe=False), context=70, prefill_tokens=128, repeats=4,
                                batches=(1,), mtp_only=True, tensor_core_decodes=(False, True))
    assert [(row["tensor_core_decode"], row["batch"]) for row in result["decode"]] == [(False, 1), (True, 1)]
    assert "prefill" not in result and "suffix_prefill" not in result
    assert [(row["tensor_core_decode"], row["k"]) for row in result["mtp_round"]] == [
        (tc, k) for tc in (False, True) for k in (1, 2, 3)]
    for row in result["mtp_round"]:
        assert set(row["graph_ms"]) == {"verify", "mtp", "propose", "advance", "drafts", "select"}
        assert all(ms > 0 for ms in row["graph_ms"].values())
        parts = row["graph_ms"]  # the host's share: the round less its parts (the chain's own parts apart)
        assert row["host_ms"] == pytest.approx(row["round_ms"] - parts["verify"] - parts["mtp"] - parts["drafts"]
                                               - parts["select"])


def test_quantized_prefill_times_each_dequant_ahead_and_bf16_ignores_it(bench):
    from ninfer.backends.cuda.host import HostDevice

    for recipe, aheads in (("ninfer-v2", [0, 2]), ("bf16", [0])):
        result = bench.bench_config("tiny", recipe, "bf16", 1e12, 1e14, device=HostDevice(),
                                    dims=cuda_tiny_dims(moe=True), context=70, prefill_tokens=128, repeats=4,
                                    prefill_attentions=("gemm",), prefill_only=True, dequant_aheads=(0, 2))
        rows = result["prefill"]
        assert [row["dequant_ahead"] for row in rows] == aheads, recipe
        if recipe == "ninfer-v2":  # the warm-up chunks taught the order: the timed ones run ahead
            assert rows[0]["dequant_hits"] == 0 and rows[1]["dequant_hits"] > 0
