"""Generation through the app (the test route of `server_harness`, so no API handler is needed): JSON and SSE
results, context-length errors with counts, 429 at capacity, 503 after the pending timeout, a disconnect that
cancels the generation and frees its pages, the request log, and the throughput meter."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import attrs
import httpx
import pytest

from ninfer.engine.scheduler import SchedulerSnapshot, ThroughputCounters
from ninfer.observability.request_log import ARTIFACT_TYPE, SCHEMA_VERSION
from ninfer.observability.stats import ThroughputMeter
from tests.support import server_harness
from tests.support.server_harness import build_tiny_artifact
from tests.support.waiting import wait_until

SLOW = {"text": "hello", "max_tokens": 25, "round_delay_ms": 40}  # about a second in the engine


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return build_tiny_artifact(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def start(artifact):
    with server_harness.server_starter(artifact, "--max-context", "512") as started:
        yield started


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_json_and_stream_results_and_their_log_records(start, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    server = start("--max-concurrency", "2", "--seed", "7", request_log=log_path)
    body = httpx.post(f"{server.url}/test/generate", json={"text": "hello", "max_tokens": 5}).json()
    assert len(body["tokens"]) == 5 and body["finish"] == "output_limit"
    with httpx.stream("POST", f"{server.url}/test/generate",
                      json={"text": "hello", "max_tokens": 3, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line]
    assert [len(e["tokens"]) for e in events] == [1, 1, 1, 0] and events[-1]["finish"] == "output_limit"

    records = read_log(log_path)
    assert all(r["artifact_type"] == ARTIFACT_TYPE and r["schema_version"] == SCHEMA_VERSION for r in records)
    assert len({r["server_instance_id"] for r in records}) == 1
    starts = [r for r in records if r["event"] == "request_start"]
    done = [r for r in records if r["event"] == "request_done"]
    assert [r["request_id"] for r in starts] == [r["request_id"] for r in done] == [1, 2]
    assert starts[0]["protocol"] == "test" and starts[0]["seed"] == 7 and starts[0]["sampler"]["seed"] == 7
    assert starts[0]["output_budget"] == 5 and starts[1]["shape"] == {"stream": True}
    assert done[0]["finish_reason"] == "output_limit" and done[0]["completion_tokens"] == 5
    assert done[0]["prompt_tokens"] == starts[0]["prompt_tokens"]
    timings = done[0]["timings_seconds"]
    assert set(timings) >= {"prepare", "ttft", "vision", "prefill", "decode", "total"}
    assert 0 < timings["ttft"] <= timings["total"] and timings["prefill"] > 0
    assert done[0]["speculative"]["backend"] is None and done[0]["speculative"]["rounds"] == 0
    assert done[0]["cached_tokens"] == 0 and done[0]["prefix_reuse_path"] == "full_reset"


def test_a_prompt_over_the_context_is_400_with_its_counts(start, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    server = start(request_log=log_path)
    response = httpx.post(f"{server.url}/test/generate", json={"ids": [5] * 600})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["prompt_tokens"] == 600 and error["max_context"] == 512
    [rejected] = [r for r in read_log(log_path) if r["event"] == "request_rejected"]
    assert rejected["phase"] == "prepare" and rejected["status"] == 400
    assert rejected["code"] == "context_length_exceeded" and rejected["request_id"] == 1
    wait_until(lambda: server.runtime.gate.outstanding == 0)


def test_a_full_server_answers_429(start):
    server = start("--max-concurrency", "1", "--max-pending-requests", "1")
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(httpx.post, f"{server.url}/test/generate", json=SLOW, timeout=30) for _ in range(2)]
        wait_until(lambda: server.runtime.gate.outstanding == 2)
        refused = httpx.post(f"{server.url}/test/generate", json=SLOW)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "server_overloaded"
        assert [f.result().status_code for f in running] == [200, 200]
    wait_until(lambda: server.runtime.gate.outstanding == 0)
    assert httpx.post(f"{server.url}/test/generate", json={"max_tokens": 2}).status_code == 200


def test_a_request_not_admitted_in_time_is_503_and_leaves_the_queue(start):
    server = start("--max-concurrency", "1", "--pending-timeout-ms", "300")
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(httpx.post, f"{server.url}/test/generate", json=SLOW, timeout=30)
        wait_until(lambda: server.engine.snapshot().running == 1)
        began = time.monotonic()
        late = httpx.post(f"{server.url}/test/generate", json={"max_tokens": 2})
        waited = time.monotonic() - began
        assert late.status_code == 503 and late.json()["error"]["code"] == "request_queue_timeout"
        assert 0.25 < waited < 1.5
        wait_until(lambda: server.engine.snapshot().waiting == 0)
        assert busy.result().json()["finish"] == "output_limit"


def test_a_disconnect_cancels_the_generation_and_frees_its_pages(start, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    server = start("--no-prefix-reuse", request_log=log_path)
    pool = server.engine._scheduler.pool
    with httpx.stream("POST", f"{server.url}/test/generate", timeout=30,
                      json={"text": "hello", "max_tokens": 400, "round_delay_ms": 20, "stream": True}) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines)[len("data: "):])["tokens"]
        wait_until(lambda: server.engine.snapshot().running == 1)
        assert pool.free < pool.pages
    left = time.monotonic()  # leaving the block closed the connection
    wait_until(lambda: server.engine.snapshot().running == 0 and pool.free == pool.pages, timeout=5)
    assert time.monotonic() - left < 1.0  # a few 20 ms rounds at most
    wait_until(lambda: any(r["event"] == "request_done" for r in read_log(log_path)))
    [done] = [r for r in read_log(log_path) if r["event"] == "request_done"]
    assert done["finish_reason"] == "cancelled" and done["completion_tokens"] < 400
    wait_until(lambda: server.runtime.gate.outstanding == 0)


def test_draining_refuses_new_generations_with_503(start):
    server = start()
    server.runtime.gate.close()
    response = httpx.post(f"{server.url}/test/generate", json={"max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutting_down"


def test_the_throughput_meter_reports_interval_deltas():
    counters = ThroughputCounters()
    meter = ThroughputMeter(counters, now=0.0)
    idle = SchedulerSnapshot(running=0, prefilling=0, decode_ready=0, waiting=0)
    assert meter.read(idle, now=1.0).idle
    counters.prefill_tokens, counters.decode_tokens, counters.decode_rounds, counters.decode_rows = 100, 30, 20, 30
    busy = SchedulerSnapshot(running=2, prefilling=0, decode_ready=2, waiting=1)
    interval = meter.read(busy, now=3.0)
    record = interval.record()
    assert not interval.idle and record["interval_seconds"] == 2.0
    assert record["prefill_tokens"] == 100 and record["prefill_tok_s"] == 50.0 and record["decode_tok_s"] == 15.0
    assert record["avg_decode_batch"] == 1.5 and record["waiting"] == 1
    assert "avg_decode_batch=1.50" in interval.line()
    counters.decode_tokens += 4
    assert meter.read(idle, now=4.0).decode_tokens == 4  # deltas since the previous reading
    assert attrs.asdict(counters)["decode_tokens"] == 34


def test_events_reach_trio_from_the_engine_thread_in_order(start):
    """Concurrent streams: every stream's tokens arrive whole and in order, each stream ends once."""
    server = start("--max-concurrency", "2")
    results = {}

    def run(index: int) -> None:
        with httpx.stream("POST", f"{server.url}/test/generate", timeout=30,
                          json={"text": f"n{index}", "max_tokens": 12, "stream": True}) as response:
            results[index] = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for events in results.values():
        assert sum(len(e["tokens"]) for e in events) == 12
        assert [e["finish"] for e in events].count("output_limit") == 1 and events[-1]["finish"] == "output_limit"
    assert len(results) == 4
