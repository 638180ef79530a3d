"""GET /metrics: the Prometheus text exposition (ninfer.observability.metrics) on its own and on the live server:
the ninfer_* families and the vLLM names the Gateway API Inference Extension reads, counters that move with
traffic, and the API key it requires like the APIs."""

from __future__ import annotations

import re

import httpx
import pytest

from ninfer.engine.prefix import PrefixStats
from ninfer.engine.scheduler import SchedulerSnapshot, ThroughputCounters
from ninfer.observability.metrics import Exposition, RequestCounters, render
from tests.support.server_harness import ServerThread, build_tiny_artifact

KEY = "metrics-secret"
BEARER = {"authorization": f"Bearer {KEY}"}
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> dict[str, float]:
    """Every sample line as `name{labels}` -> value; checks the text-format grammar on the way (HELP and TYPE
    precede each family's samples, every sample line is well formed, the page ends with a newline)."""
    assert text.endswith("\n")
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter") and name not in typed
            typed.add(name)
            continue
        match = SAMPLE.match(line)
        assert match, line
        name = match.group(1)
        assert name in typed or name.removesuffix("_total") in typed, line
        key = name + (match.group(2) or "")
        assert key not in samples
        samples[key] = float(match.group(4))
    return samples


class FakeEngine:
    kv_pool_usage = 0.25  # 10 of 40 pages allocated
    throughput = ThroughputCounters(prefill_tokens=100, decode_tokens=50, decode_rounds=10, decode_rows=20)
    prefix_stats = PrefixStats(requests=4, hits=1, prompt_tokens=120, cached_tokens=20)

    def snapshot(self):
        return SchedulerSnapshot(running=2, prefilling=1, decode_ready=1, waiting=3)


class FakeGate:
    outstanding, capacity = 6, 17


def test_the_page_renders_every_family_from_the_engine_and_the_gate():
    counters = RequestCounters()
    counters.count("stop_token")
    counters.count("stop_token")
    counters.count("output_limit")
    counters.reject("context_length_exceeded")
    samples = parse(render(FakeEngine(), FakeGate(), counters, model='org/"q"'))
    assert samples["ninfer_requests_running"] == 2 and samples["ninfer_requests_waiting"] == 3
    assert samples["ninfer_requests_outstanding"] == 6 and samples["ninfer_requests_capacity"] == 17
    assert samples["ninfer_kv_cache_usage_ratio"] == 0.25
    assert samples["ninfer_prompt_tokens_total"] == 120 and samples["ninfer_prefix_cache_hit_tokens_total"] == 20
    assert samples["ninfer_prefill_tokens_total"] == 100 and samples["ninfer_generation_tokens_total"] == 50
    assert samples['ninfer_requests_finished_total{finish_reason="stop_token"}'] == 2
    assert samples['ninfer_requests_finished_total{finish_reason="output_limit"}'] == 1
    assert samples['ninfer_requests_rejected_total{code="context_length_exceeded"}'] == 1
    label = '{model_name="org/\\"q\\""}'
    assert samples[f"vllm:num_requests_running{label}"] == 2
    assert samples[f"vllm:num_requests_waiting{label}"] == 3
    assert samples[f"vllm:kv_cache_usage_perc{label}"] == 0.25
    assert samples[f"vllm:gpu_cache_usage_perc{label}"] == 0.25


def test_values_render_in_the_text_format():
    page = Exposition()
    page.family("x", "gauge", "a\\b\nc", [({"l": 'a"b\\c\nd'}, float("inf"))])
    page.family("y", "counter", "y", 3)
    assert page.text() == ('# HELP x a\\\\b c\n# TYPE x gauge\nx{l="a\\"b\\\\c\\nd"} +Inf\n'
                           "# HELP y y\n# TYPE y counter\ny_total 3\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = ServerThread.start(build_tiny_artifact(tmp_path_factory.mktemp("tiny")), "--max-context", "512",
                                 "--api-key", KEY)
    yield running
    running.stop()


def metrics(server) -> httpx.Response:
    return httpx.get(f"{server.url}/metrics", headers=BEARER, timeout=30)


def test_metrics_need_the_api_key(server):
    refused = httpx.get(f"{server.url}/metrics", timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics", headers={"x-api-key": KEY}, timeout=30).status_code == 200


def test_live_metrics_move_with_traffic(server):
    before = metrics(server)
    assert before.status_code == 200
    assert before.headers["content-type"].startswith("text/plain; version=0.0.4")
    start = parse(before.text)
    assert start["ninfer_requests_running"] == 0 and start["ninfer_requests_waiting"] == 0
    assert start["ninfer_requests_outstanding"] == 0
    assert start["ninfer_requests_capacity"] == 1 + 16  # --max-concurrency 1 + --max-pending-requests 16
    assert 0.0 <= start["ninfer_kv_cache_usage_ratio"] <= 1.0
    body = {"model": "llama-custom", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5,
            "temperature": 1.0, "seed": 3}
    for _ in range(2):
        done = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=BEARER, timeout=60)
        assert done.status_code == 200
    too_long = {**body, "messages": [{"role": "user", "content": "word " * 600}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=too_long, headers=BEARER,
                      timeout=60).status_code == 400
    after = parse(metrics(server).text)
    finished = 'ninfer_requests_finished_total{finish_reason="output_limit"}'
    assert after[finished] - start.get(finished, 0) == 2
    assert after['ninfer_requests_rejected_total{code="context_length_exceeded"}'] >= 1
    prompt = done.json()["usage"]["prompt_tokens"]
    assert after["ninfer_prompt_tokens_total"] - start["ninfer_prompt_tokens_total"] == 2 * prompt
    hits = after["ninfer_prefix_cache_hit_tokens_total"] - start["ninfer_prefix_cache_hit_tokens_total"]
    computed = after["ninfer_prefill_tokens_total"] - start["ninfer_prefill_tokens_total"]
    assert computed + hits == 2 * prompt
    assert after["ninfer_generation_tokens_total"] - start["ninfer_generation_tokens_total"] == 2 * (5 - 1)
    assert after["ninfer_requests_outstanding"] == 0 and after["ninfer_requests_running"] == 0
    assert after['vllm:num_requests_waiting{model_name="llama-custom"}'] == 0
