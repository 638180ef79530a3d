"""The server as a process: it serves after startup, reports throughput periodically, and SIGTERM drains it -
in-flight requests finish (within --drain-timeout-ms), new connections are refused, and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.server_harness import build_tiny_artifact, free_port

REPO = Path(__file__).resolve().parents[1]
# The real entry point's serve(), with the test route added to the default routing table.
SERVE_WITH_TEST_ROUTE = """
import sys
from ninfer.cli.serve import parse_serve_args
from ninfer.server.app import default_routes
from ninfer.server.service import serve
from tests.support.server_harness import harness_routes
sys.exit(serve(parse_serve_args(sys.argv[1:]), default_routes() + harness_routes()))
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return build_tiny_artifact(tmp_path_factory.mktemp("tiny"))


def start_server(artifact: Path, *options: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", SERVE_WITH_TEST_ROUTE, str(artifact), "--port", str(port),
                                "--max-context", "512", *options],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server did not start:\n{process.communicate()[0]}")
        time.sleep(0.05)


def stream_tokens(url: str, started, **body) -> dict:
    """Stream a generation; `started` is set once its first event has arrived."""
    tokens, finish = [], None
    with httpx.stream("POST", f"{url}/test/generate", json={"stream": True, **body}, timeout=60) as response:
        for line in response.iter_lines():
            if line:
                event = json.loads(line[len("data: "):])
                tokens += event["tokens"]
                finish = event["finish"] or finish
                started.set()
    return {"tokens": tokens, "finish": finish}


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


def test_sigterm_lets_in_flight_requests_finish_refuses_new_ones_and_exits_0(artifact):
    process, url = start_server(artifact, "--drain-timeout-ms", "20000", "--log-stats-interval-ms", "200")
    try:
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(stream_tokens, url, started, max_tokens=30, round_delay_ms=50)
            assert started.wait(30)
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not refused(url):
                assert time.monotonic() < deadline, "new connections are still accepted"
                time.sleep(0.02)
            result = in_flight.result(timeout=60)
        assert result["finish"] == "output_limit" and len(result["tokens"]) == 30
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    output = process.communicate()[0]
    assert "SIGTERM: shutting down" in output and "draining" in output and "[req 1] done" in output
    assert output.startswith("[") and "] [info] " in output  # the console line format
    assert "throughput: prefill=" in output and "decode_ready=" in output  # the periodic aggregate


def test_the_drain_is_bounded(artifact):
    process, url = start_server(artifact, "--drain-timeout-ms", "200")
    try:
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(stream_tokens, url, started, max_tokens=200, round_delay_ms=50)
            assert started.wait(30)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert process.wait(timeout=30) == 0
            assert time.monotonic() - signalled < 5
            try:
                cut = in_flight.result(timeout=30)
                assert len(cut["tokens"]) < 200
            except httpx.HTTPError:  # the connection was closed mid-stream
                pass
    finally:
        process.kill()
