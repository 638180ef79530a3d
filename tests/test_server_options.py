"""`python -m ninfer`'s option table (serving.md): defaults, validation, --help, and the startup failures of options
this build cannot honour (or this artifact: --spec dflash needs a 35B-A3B-shaped artifact with the drafter; either
backend runs it)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.backends import cuda_probe
from ninfer.cli.serve import parse_serve_args
from ninfer.nursery.service import run_service
from ninfer.observability.request_log import redact_argv
from tests.support.cuda_models import write_tiny_qwen_artifact
from tests.support.server_harness import free_port
from tests.support.tiny_dflash import write_tiny_dflash_artifact

TABLE_OPTIONS = [  # serving.md's "Server options", in its order
    "--host", "--port", "--api-key", "--model-id", "--max-context", "--kv-capacity", "--max-concurrency",
    "--max-pending-requests", "--pending-timeout-ms", "--prefill-chunk", "--log-stats-interval-ms", "--device",
    "--max-request-mib", "--media-cache-mib", "--media-live-mib", "--media-preprocess-threads", "--request-log-jsonl",
    "--response-store-max-records", "--response-store-max-mib", "--kv-dtype", "--spec", "--draft-tokens",
    "--lm-head-draft", "--default-max-tokens", "--vision", "--no-cuda-graph", "--no-prefix-reuse",
    "--cold-tier-device", "--cold-tier-capacity-mib", "--cold-tier-staging-mib", "--no-cold-tier", "--no-thinking",
    "--preserve-thinking", "--cors", "--temperature", "--top-p", "--top-k", "--min-p", "--presence-penalty",
    "--frequency-penalty", "--seed", "--greedy"]


def test_defaults_follow_the_table():
    options = parse_serve_args([])
    assert options.artifact is None and options.host == "127.0.0.1" and options.port == 8080
    assert options.api_key is None and options.model_id is None and options.max_context == 8192
    assert options.kv_capacity is None and options.max_concurrency == 1 and options.max_pending_requests == 16
    assert options.pending_timeout_ms == 30000 and options.prefill_chunk == 1024
    assert options.log_stats_interval_ms == 5000 and options.device == 0 and options.max_request_mib == 384
    assert (options.media_cache_mib, options.media_live_mib, options.media_preprocess_threads) == (1024, 2048, 0)
    assert (options.response_store_max_records, options.response_store_max_mib) == (1024, 256)
    assert options.kv_dtype == "bf16" and options.spec is None and options.draft_tokens is None
    assert options.default_max_tokens == 8192
    assert (options.cold_tier_device, options.cold_tier_capacity_mib, options.cold_tier_staging_mib) == (-1, 0, 64)
    assert not any([options.lm_head_draft, options.vision, options.no_cuda_graph, options.no_prefix_reuse,
                    options.no_cold_tier, options.no_thinking, options.preserve_thinking, options.cors,
                    options.greedy])
    assert options.temperature is options.top_p is options.top_k is options.min_p is options.seed is None
    assert options.capacity == 17 and options.max_request_bytes == 384 << 20 and options.default_thinking


def test_dflash_values_reach_the_engine_config():
    config = parse_serve_args(["model.ninfer", "--spec", "dflash", "--draft-tokens", "15", "--lm-head-draft"]) \
        .engine_config()
    assert (config.spec, config.draft_tokens, config.lm_head_draft) == ("dflash", 15, True)


def test_values_reach_the_engine_config():
    options = parse_serve_args(["model.ninfer", "--max-concurrency", "4", "--kv-capacity", "auto", "--spec", "mtp",
                                "--draft-tokens", "3", "--lm-head-draft", "--no-prefix-reuse", "--greedy",
                                "--temperature", "0.5", "--seed", "18446744073709551615"])
    config = options.engine_config()
    assert options.artifact == Path("model.ninfer") and config.kv_capacity == "auto"
    assert (config.max_concurrency, config.spec, config.draft_tokens, config.lm_head_draft) == (4, "mtp", 3, True)
    assert not config.prefix_reuse and config.greedy
    assert config.sampling.temperature == 0.5 and config.sampling.seed == (1 << 64) - 1


@pytest.mark.parametrize("argv, message", [
    (["--port", "0"], "--port: must be in 1..65535"),
    (["--port", "http"], "--port: expected an integer"),
    (["--max-concurrency", "9"], "--max-concurrency: must be in 1..8"),
    (["--max-context", "262145"], "--max-context: must be in 1..262144"),
    (["--prefill-chunk", "100"], "--prefill-chunk: must be a positive multiple of 128"),
    (["--kv-capacity", "lots"], "--kv-capacity: expected an integer"),
    (["--kv-capacity", "4096"], "smaller than one --max-context 8192"),
    (["--kv-dtype", "fp8"], "--kv-dtype: invalid choice"),
    (["--pending-timeout-ms", "0"], "--pending-timeout-ms: must be at least 1"),
    (["--max-pending-requests", "-1"], "--max-pending-requests: must be at least 0"),
    (["--max-request-mib", "0"], "--max-request-mib: must be at least 1"),
    (["--media-cache-mib", "4096"], "--media-cache-mib cannot exceed --media-live-mib"),
    (["--draft-tokens", "3"], "--draft-tokens and --lm-head-draft need --spec"),
    (["--lm-head-draft"], "--draft-tokens and --lm-head-draft need --spec"),
    (["--spec", "mtp"], "--spec mtp needs --draft-tokens in 1..5"),
    (["--spec", "mtp", "--draft-tokens", "6"], "--spec mtp needs --draft-tokens in 1..5"),
    (["--spec", "dflash", "--draft-tokens", "16"], "--spec dflash needs --draft-tokens in 1..15"),
    (["--spec", "dflash", "--draft-tokens", "7", "--vision"], "cannot be combined with --vision"),
    (["--temperature", "2.5"], "--temperature: must be a finite number in [0.0, 2.0]"),
    (["--top-p", "nan"], "--top-p: must be a finite number"),
    (["--presence-penalty", "-3"], "--presence-penalty: must be a finite number in [-2.0, 2.0]"),
    (["--seed", "-1"], "--seed: must be in 0..18446744073709551615"),
    (["--cold-tier-device", "-2"], "--cold-tier-device: must be at least -1"),
    (["--api-key", ""], "--api-key: must not be empty"),
])
def test_invalid_options_exit_2_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_serve_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: python -m ninfer [ARTIFACT] [options]" in err


def test_help_lists_every_option_of_the_table():
    shown = subprocess.run([sys.executable, "-m", "ninfer", "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    for option in TABLE_OPTIONS + ["--drain-timeout-ms"]:
        assert option in shown.stdout, option
    assert "generate" in shown.stdout and "convert" in shown.stdout


@pytest.mark.parametrize("argv, message", [
    (["--device", "1"], "--device 1 needs the CUDA backend"),
    (["--cold-tier-device", "1"], "--cold-tier-device 1 needs a secondary CUDA device"),
])
def test_options_this_build_cannot_honour_fail_at_startup(argv, message, caplog):
    with caplog.at_level(logging.ERROR, logger="ninfer"):
        assert run_service(parse_serve_args(["missing.ninfer", *argv]), make_app=None) == 1
    assert message in caplog.text


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash-startup")
    return {"dense": write_tiny_qwen_artifact(folder / "dense.ninfer", moe=False, recipe="bf16"),
            "moe": write_tiny_qwen_artifact(folder / "moe.ninfer", moe=True, recipe="bf16"),
            "dflash": write_tiny_dflash_artifact(folder / "dflash.ninfer")}


@pytest.mark.parametrize("artifact, gpus, message", [
    ("dense", 0, "--spec dflash needs the 35B-A3B (MoE) target, whose drafter it is; qwen3.6-custom is a dense model"),
    ("moe", 0, "--spec dflash needs the DFlash drafter, and the artifact (qwen3.6-custom) has none"),
    ("moe", 1, "--spec dflash needs the DFlash drafter, and the artifact (qwen3.6-custom) has none"),
])
def test_dflash_is_refused_where_it_cannot_run(artifacts, artifact, gpus, message, caplog, monkeypatch):
    monkeypatch.setattr(cuda_probe, "cuda_device_count", lambda: gpus)
    with caplog.at_level(logging.ERROR, logger="ninfer"):
        code = run_service(parse_serve_args([str(artifacts[artifact]), "--port", str(free_port()), "--spec", "dflash",
                                             "--draft-tokens", "7"]), make_app=None)
    assert code == 1 and message in caplog.text


def test_dflash_with_its_drafter_is_accepted_on_either_backend(artifacts):
    """The drafter's artifact passes the --spec dflash checks; nothing about them depends on the backend any more
    (startup then builds the CUDA runner with the drafter on a GPU, the CPU runner otherwise)."""
    from ninfer.artifact.reader import Artifact
    from ninfer.models.loader import artifact_dims
    from ninfer.nursery.startup import dflash_problem

    options = parse_serve_args([str(artifacts["dflash"]), "--spec", "dflash", "--draft-tokens", "7"])
    artifact = Artifact.open(artifacts["dflash"])
    assert dflash_problem(options, artifact, artifact_dims(artifact)) is None


def test_options_the_cpu_backend_honours_trivially_start(tmp_path, caplog):
    """--no-cuda-graph and an inactive default cold tier get past the capability checks, to the artifact."""
    with caplog.at_level(logging.ERROR, logger="ninfer"):
        code = run_service(parse_serve_args([str(tmp_path / "missing.ninfer"), "--no-cuda-graph",
                                             "--port", str(free_port()), "--cold-tier-capacity-mib", "64"]),
                           make_app=None)
    assert code == 1 and "cannot serve" in caplog.text and "missing.ninfer" in caplog.text


def test_a_taken_port_fails_before_loading(tmp_path, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="ninfer"):
            code = run_service(parse_serve_args([str(tmp_path / "never-opened.ninfer"), "--port", str(port)]),
                               make_app=None)
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in caplog.text


@pytest.mark.parametrize("log_name, message", [("missing-dir/requests.jsonl", "does not exist"),
                                               ("model.ninfer", "is the model artifact")])
def test_an_unusable_request_log_aborts_startup(tmp_path, log_name, message, caplog):
    artifact = tmp_path / "model.ninfer"
    artifact.write_bytes(b"")
    with caplog.at_level(logging.ERROR, logger="ninfer"):
        code = run_service(parse_serve_args([str(artifact), "--port", str(free_port()),
                                             "--request-log-jsonl", str(tmp_path / log_name)]), make_app=None)
    assert code == 1 and message in caplog.text


def test_the_api_key_is_redacted_from_argv():
    assert redact_argv(["m.ninfer", "--api-key", "s3cret", "--api-key=other", "--cors"]) == \
        ["m.ninfer", "--api-key", "<redacted>", "--api-key=<redacted>", "--cors"]
