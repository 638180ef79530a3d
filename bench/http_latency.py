"""Added latency of the HTTP layer, requests/s at 64 concurrent clients, and the demo model through the OpenAI SDK.

1. HTTP-layer overhead, tiny model (the 2-layer random llama of tests/support/server_harness.py), greedy:
   (a) in-process: Engine.submit + result on a model stack built exactly as the server builds it
       (`load_model_stack`), with the server's own output policy (`OutputAdapter`) and the prompt prepared beforehand;
   (b) the same prompt as a non-streamed Chat Completions request to `python -m ninfer` (a subprocess) via httpx.
   Added latency per request = (b) - (a), paired per prompt (the two alternate, in alternating order). Per streamed
   token: the gaps between SSE chunks that carry output text (client receive times) against the gaps between the
   engine events that carry output text, seen by an in-process consumer (the events that become those chunks).
   Both servers run with --no-prefix-reuse so a repeated prompt costs the same every time.
2. Requests/s at 64 concurrent clients: 64 asyncio tasks with one httpx.AsyncClient each against a server started
   with --max-concurrency 8 --max-pending-requests 64, max_tokens 8, for a fixed number of requests.
3. The demo model (no artifact: SmolLM2-135M) asked "What is the capital of France?" at temperature 0 through
   `openai.OpenAI(...).chat.completions.create`.

Everything is on 127.0.0.1; each server is a subprocess stopped (SIGINT, then kill) at the end. Clients and servers
share the machine's cores.

    python bench/http_latency.py [--requests 300] [--stream-requests 100] [--load-requests 1920]
                                 [--out bench/results/http_latency.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from ninfer.cli.serve import parse_serve_args  # noqa: E402
from ninfer.engine.request import PreparedPrompt, RequestOptions  # noqa: E402
from ninfer.engine.sampler import SamplingOverrides  # noqa: E402
from ninfer.frontend.prompt import PromptOptions  # noqa: E402
from ninfer.frontend.tool_calls import TextDelta  # noqa: E402
from ninfer.nursery.startup import load_model_stack  # noqa: E402
from ninfer.server.generation import OutputAdapter, ReasoningDelta, prepare_prompt  # noqa: E402
from tests.support.server_harness import build_tiny_artifact  # noqa: E402

HOST = "127.0.0.1"
TINY_OPTIONS = ("--max-context", "512", "--no-prefix-reuse", "--no-thinking")
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def quantiles_ms(seconds) -> dict:
    values = np.asarray(seconds, dtype=float) * 1000
    return {"n": int(values.size), "p50_ms": float(np.percentile(values, 50)),
            "p99_ms": float(np.percentile(values, 99)), "mean_ms": float(values.mean()),
            "min_ms": float(values.min()), "max_ms": float(values.max())}


@contextmanager
def server(artifact: Path | None, *options: str, ready_timeout: float = 600):
    """`python -m ninfer [ARTIFACT] --host 127.0.0.1 --port P ...` as a subprocess; yields its base URL once /health
    answers 200, and stops it (SIGINT, then SIGKILL) on the way out."""
    port = free_port()
    argv = [sys.executable, "-m", "ninfer", *([str(artifact)] if artifact else []), "--host", HOST,
            "--port", str(port), *options]
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited ({process.returncode}): {log.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready")
            time.sleep(0.2)
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        log.close()


# --- 1. HTTP-layer overhead ------------------------------------------------------------------------------------------


class InProcess:
    """The server's model stack in this process: prompts prepared as the Chat Completions handler prepares them,
    requests through Engine.submit with the server's OutputAdapter."""

    def __init__(self, artifact: Path) -> None:
        options = parse_serve_args([str(artifact), *TINY_OPTIONS])
        self.stack = load_model_stack(options, artifact)
        self.stack.engine.start()
        self.prompt_options = PromptOptions(thinking=False)

    def prepare(self, text: str) -> PreparedPrompt:
        built = self.stack.prompt_builder.build([{"role": "user", "content": text}], self.prompt_options)
        return prepare_prompt(self.stack.prompt_builder, built, self.prompt_options)

    def _submit(self, prompt: PreparedPrompt, max_tokens: int):
        adapter = OutputAdapter(self.stack.prompt_builder.tokenizer, thinking=prompt.thinking,
                                stop_ids=self.stack.stop_ids)
        options = RequestOptions(max_tokens=max_tokens, sampling=SamplingOverrides(temperature=0.0))
        return self.stack.engine.submit(prompt, options, adapter)

    def request(self, prompt: PreparedPrompt, max_tokens: int) -> tuple[float, int]:
        began = time.perf_counter()
        result = self._submit(prompt, max_tokens).result(60)
        return time.perf_counter() - began, len(result.tokens)

    def stream(self, prompt: PreparedPrompt, max_tokens: int) -> list[float]:
        """Submission time, then the receive times of the events whose payload carries output text (what becomes an
        SSE content chunk)."""
        times = [time.perf_counter()]  # first: the submission
        for event in self._submit(prompt, max_tokens):
            if any(isinstance(item, (TextDelta, ReasoningDelta)) for item in event.payload or ()):
                times.append(time.perf_counter())
        return times

    def close(self) -> None:
        self.stack.engine.close()


def chat_body(model: str, text: str, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}
    if stream:
        body["stream"] = True
    return body


def http_request(client: httpx.Client, url: str, body: dict) -> tuple[float, int]:
    began = time.perf_counter()
    response = client.post(f"{url}/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - began
    response.raise_for_status()
    return elapsed, response.json()["usage"]["completion_tokens"]


def http_stream(client: httpx.Client, url: str, body: dict) -> list[float]:
    """Send time, then the receive times of the SSE chunks whose delta carries output text."""
    times = [time.perf_counter()]
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            choices = json.loads(line[6:])["choices"]
            delta = choices[0]["delta"] if choices else {}
            if delta.get("content") or delta.get("reasoning_content"):
                times.append(now)
    return times


def measure_overhead(artifact: Path, args) -> dict:
    prompts = [f"Question {i}: tell me something about the number {i * 37 % 1000}." for i in range(args.requests)]
    local = InProcess(artifact)
    try:
        prepared = [local.prepare(p) for p in prompts]
        for p in prepared[:5]:
            local.request(p, args.max_tokens)  # warm-up (the first generation dequantizes the weights)
        with server(artifact, *TINY_OPTIONS) as url, httpx.Client(timeout=60) as client:
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            for p in prompts[:5]:
                http_request(client, url, chat_body(model, p, args.max_tokens))

            inproc, over_http, mismatched = [], [], 0
            for i, (text, prompt) in enumerate(zip(prompts, prepared)):
                if i % 2 == 0:
                    a = local.request(prompt, args.max_tokens)
                    b = http_request(client, url, chat_body(model, text, args.max_tokens))
                else:
                    b = http_request(client, url, chat_body(model, text, args.max_tokens))
                    a = local.request(prompt, args.max_tokens)
                inproc.append(a[0])
                over_http.append(b[0])
                mismatched += a[1] != b[1]
            added = np.asarray(over_http) - np.asarray(inproc)

            seen = {"local": {"gaps": [], "chunks": [], "ttft": [], "span": []},
                    "http": {"gaps": [], "chunks": [], "ttft": [], "span": []}}
            for i in range(args.stream_requests):
                text, prompt = prompts[i], prepared[i]
                order = (0, 1) if i % 2 == 0 else (1, 0)
                for which in order:
                    if which == 0:
                        times, into = local.stream(prompt, args.stream_tokens), seen["local"]
                    else:
                        times = http_stream(client, url, chat_body(model, text, args.stream_tokens, stream=True))
                        into = seen["http"]
                    into["ttft"].append(times[1] - times[0])
                    into["gaps"] += list(np.diff(times[1:]))
                    into["chunks"].append(len(times) - 1)
                    into["span"].append((times[-1] - times[1]) / (len(times) - 2))  # mean gap of this request
    finally:
        local.close()

    gl, gh = quantiles_ms(seen["local"]["gaps"]), quantiles_ms(seen["http"]["gaps"])
    sl, sh = quantiles_ms(seen["local"]["span"]), quantiles_ms(seen["http"]["span"])
    tl, th = quantiles_ms(seen["local"]["ttft"]), quantiles_ms(seen["http"]["ttft"])
    return {
        "requests": {
            "n": args.requests, "max_tokens": args.max_tokens, "completion_token_count_mismatches": int(mismatched),
            "in_process": quantiles_ms(inproc), "http": quantiles_ms(over_http),
            "added_paired": quantiles_ms(added),
            "added_p50_ms": quantiles_ms(over_http)["p50_ms"] - quantiles_ms(inproc)["p50_ms"],
            "added_p99_ms": quantiles_ms(over_http)["p99_ms"] - quantiles_ms(inproc)["p99_ms"],
        },
        "stream": {
            "n_requests": args.stream_requests, "max_tokens": args.stream_tokens,
            "text_chunks_per_request_mean": {"in_process": float(np.mean(seen["local"]["chunks"])),
                                             "http": float(np.mean(seen["http"]["chunks"]))},
            "gap_in_process": gl, "gap_http": gh,
            "added_per_token_p50_ms": gh["p50_ms"] - gl["p50_ms"],
            "added_per_token_p99_ms": gh["p99_ms"] - gl["p99_ms"],
            "note": "gaps between consecutive text chunks/events; the client's reads batch chunks that arrive "
                    "together, so single HTTP gaps can be shorter than the engine's rounds (mean_gap_per_request "
                    "is not affected by that batching)",
            "mean_gap_per_request_in_process": sl, "mean_gap_per_request_http": sh,
            "added_mean_gap_per_request_p50_ms": sh["p50_ms"] - sl["p50_ms"],
            "added_mean_gap_per_request_p99_ms": sh["p99_ms"] - sl["p99_ms"],
            "first_text_in_process": tl, "first_text_http": th,
            "added_first_text_p50_ms": th["p50_ms"] - tl["p50_ms"],
            "added_first_text_p99_ms": th["p99_ms"] - tl["p99_ms"],
        },
    }


# --- 2. requests/s at 64 concurrent clients --------------------------------------------------------------------------


async def _load(url: str, model: str, clients: int, total: int, max_tokens: int) -> dict:
    counter = iter(range(total))
    latencies, statuses = [], {}

    async def client_task(index: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            for n in counter:  # shared: the tasks take requests until `total` have been sent
                body = chat_body(model, f"Client {index} request {n}: say something.", max_tokens)
                began = time.perf_counter()
                response = await client.post(f"{url}/v1/chat/completions", json=body)
                elapsed = time.perf_counter() - began
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code == 200:
                    latencies.append(elapsed)

    began = time.perf_counter()
    await asyncio.gather(*(client_task(i) for i in range(clients)))
    wall = time.perf_counter() - began
    return {"clients": clients, "requests": total, "max_tokens": max_tokens, "wall_s": wall,
            "requests_per_s": statuses.get(200, 0) / wall, "statuses": {str(k): v for k, v in statuses.items()},
            "rejected_429": statuses.get(429, 0), "latency": quantiles_ms(latencies)}


def measure_load(artifact: Path, args) -> dict:
    options = ("--max-context", "512", "--no-thinking", "--max-concurrency", "8", "--max-pending-requests",
               str(args.clients))
    with server(artifact, *options) as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(_load(url, model, args.clients, args.clients, args.load_tokens))  # warm-up round
        result = asyncio.run(_load(url, model, args.clients, args.load_requests, args.load_tokens))
    result["server_options"] = list(options)
    return result


# --- 3. the demo model through the OpenAI SDK ------------------------------------------------------------------------


def demo_answer() -> dict:
    import openai

    began = time.perf_counter()
    with server(None) as url:
        ready = time.perf_counter() - began
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        model = client.models.list().data[0].id
        asked = time.perf_counter()
        completion = client.chat.completions.create(model=model, temperature=0,
                                                    messages=[{"role": "user", "content": QUESTION}])
        seconds = time.perf_counter() - asked
    return {"openai_sdk": openai.__version__, "model": completion.model, "question": QUESTION, "temperature": 0,
            "answer": completion.choices[0].message.content, "finish_reason": completion.choices[0].finish_reason,
            "usage": completion.usage.model_dump(), "request_s": seconds, "server_ready_s": ready}


# --- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="paired non-streamed requests (default 300)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output limit of those requests (default 16)")
    parser.add_argument("--stream-requests", type=int, default=100, help="paired streamed requests (default 100)")
    parser.add_argument("--stream-tokens", type=int, default=32, help="output limit when streaming (default 32)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--load-requests", type=int, default=1920, help="requests in the load run (default 1920)")
    parser.add_argument("--load-tokens", type=int, default=8, help="output limit in the load run (default 8)")
    parser.add_argument("--skip-demo", action="store_true", help="skip the demo model / OpenAI SDK part")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/http_latency.json")
    args = parser.parse_args()

    started, load_before = time.perf_counter(), os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.split("\n")
    dirty = [line[3:] for line in dirty if line.strip()]  # tracked files changed since the commit (measured as is)
    with tempfile.TemporaryDirectory() as folder:
        artifact = build_tiny_artifact(Path(folder))
        overhead = measure_overhead(artifact, args)
        load = measure_load(artifact, args)
    demo = None if args.skip_demo else demo_answer()

    record = {
        "benchmark": "http_latency",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit, "uncommitted_changes": dirty,
        "machine": {"arch": platform.machine(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "note": "clients and servers share these cores (server in a subprocess, clients here)",
                    "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg()},
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "tiny_model": "2-layer random llama (tests/support/server_harness.build_tiny_artifact), bf16",
                     "tiny_server_options": list(TINY_OPTIONS), "sampling": "temperature 0 (greedy)",
                     "host": HOST},
        "overhead": overhead, "load": load, "demo": demo,
        "script_seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")

    r, s = overhead["requests"], overhead["stream"]
    print(f"{'':34} {'p50 ms':>9} {'p99 ms':>9}")
    print(f"{'request, in-process engine':34} {r['in_process']['p50_ms']:9.2f} {r['in_process']['p99_ms']:9.2f}")
    print(f"{'request, HTTP (non-streamed)':34} {r['http']['p50_ms']:9.2f} {r['http']['p99_ms']:9.2f}")
    print(f"{'request, added (paired)':34} {r['added_paired']['p50_ms']:9.2f} {r['added_paired']['p99_ms']:9.2f}")
    print(f"{'token gap, in-process events':34} {s['gap_in_process']['p50_ms']:9.3f} "
          f"{s['gap_in_process']['p99_ms']:9.3f}")
    print(f"{'token gap, HTTP SSE chunks':34} {s['gap_http']['p50_ms']:9.3f} {s['gap_http']['p99_ms']:9.3f}")
    print(f"{'token gap, added':34} {s['added_per_token_p50_ms']:9.3f} {s['added_per_token_p99_ms']:9.3f}")
    print(f"{'mean gap per stream, added':34} {s['added_mean_gap_per_request_p50_ms']:9.3f} "
          f"{s['added_mean_gap_per_request_p99_ms']:9.3f}")
    print(f"{'first text chunk, added':34} {s['added_first_text_p50_ms']:9.2f} {s['added_first_text_p99_ms']:9.2f}")
    print(f"{load['clients']} clients: {load['requests_per_s']:.1f} requests/s, latency p50 "
          f"{load['latency']['p50_ms']:.1f} ms p99 {load['latency']['p99_ms']:.1f} ms, 429s {load['rejected_429']}, "
          f"statuses {load['statuses']}")
    if demo:
        print(f"demo ({demo['model']}): {demo['answer']!r} usage {demo['usage']}")
    print(f"script: {record['script_seconds']:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
