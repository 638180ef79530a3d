"""The server under test: a tiny llama artifact, a generation route that needs no API handler, and the real app on
hypercorn in a background thread (or a subprocess, for signals)."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Sequence

import attrs
import trio

from ninfer.cli.serve import parse_serve_args
from ninfer.convert.driver import convert
from ninfer.convert.gguf_llama import plan_gguf_llama
from ninfer.engine.request import FinishReason, PreparedPrompt, RequestOptions, Verdict
from ninfer.frontend.prompt import PromptOptions
from ninfer.nursery.admission import AdmissionGate
from ninfer.nursery.service import Runtime, bind_listener, serve_http
from ninfer.nursery.startup import load_model_stack
from ninfer.observability.request_log import RequestLog
from ninfer.server.app import default_routes
from ninfer.server.context import HttpRequest, JsonResponse, Route, SseEvent, StreamResponse
from ninfer.server.service import make_app
from ninfer.server.sse import json_event


def build_tiny_artifact(folder: Path) -> Path:
    """A 2-layer random llama (`llama-custom`) with a byte-level tokenizer and a ChatML template."""
    from tests.test_llama import random_hf_weights, write_llama_gguf

    write_llama_gguf(folder / "tiny.gguf", random_hf_weights(tied=True))
    convert(plan_gguf_llama(folder / "tiny.gguf"), folder / "tiny.ninfer", "bf16", progress=False)
    return folder / "tiny.ninfer"


class SlowPolicy:
    """Accepts every token and never stops early (the request runs to its output limit), sleeping on the engine
    thread each round so a test can catch a generation in flight."""

    def __init__(self, round_seconds: float) -> None:
        self.round_seconds = round_seconds

    def accept(self, tokens: Sequence[int]) -> Verdict:
        time.sleep(self.round_seconds)
        return Verdict(len(tokens))

    def close(self, reason: FinishReason) -> None:
        return None


async def _test_generate(ctx, request: HttpRequest):
    """POST {"text"|"ids", "max_tokens", "round_delay_ms", "stream"}: raw token ids back, as JSON or SSE."""
    body = request.json()
    ctx.begin_preparation(api="test", shape={"stream": bool(body.get("stream"))})
    if "ids" in body:
        prompt = PreparedPrompt(token_ids=body["ids"])
    else:
        built = ctx.prompt_builder.build([{"role": "user", "content": body.get("text", "hi")}],
                                         PromptOptions(thinking=False))
        prompt = PreparedPrompt(token_ids=built.ids)
    events = ctx.generate(prompt, RequestOptions(max_tokens=body.get("max_tokens", 8)),
                          SlowPolicy(body.get("round_delay_ms", 0) / 1000), api="test")
    if body.get("stream"):
        return StreamResponse(_token_events(events))
    tokens, finish = [], None
    async for event in events:
        tokens += event.tokens
        finish = event.finish
    return JsonResponse({"tokens": tokens, "finish": finish.value})


async def _token_events(events) -> AsyncIterator[SseEvent]:
    async for event in events:
        yield json_event({"tokens": list(event.tokens), "finish": event.finish and event.finish.value})


async def _anthropic_echo(ctx, request: HttpRequest) -> JsonResponse:
    return JsonResponse({"type": "message", "bytes": len(request.body)})


def harness_routes() -> list[Route]:
    return [Route("POST", "/test/generate", _test_generate),
            Route("POST", "/test/anthropic", _anthropic_echo, flavor="anthropic")]



def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@attrs.define
class ServerThread:
    """The real app on hypercorn in a background thread (trio.run there: signals are the main thread's, so the
    drain is triggered directly)."""

    runtime: Runtime
    url: str
    _thread: threading.Thread
    _token: trio.lowlevel.TrioToken
    _stop: trio.Event

    @classmethod
    def start(cls, artifact: Path, *options: str, request_log: Path | None = None) -> ServerThread:
        parsed = parse_serve_args([str(artifact), *options])
        stack = load_model_stack(parsed, artifact)
        stack.engine.start()
        runtime = Runtime(options=parsed, stack=stack, gate=AdmissionGate(parsed.capacity),
                          request_log=RequestLog.open(request_log, artifact=artifact), started_unix=int(time.time()))
        listener = bind_listener("127.0.0.1", 0)
        url = "http://127.0.0.1:%d" % listener.getsockname()[1]
        ready, handoff = threading.Event(), {}

        async def main() -> None:
            handoff["token"], handoff["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
            app = make_app(runtime, default_routes() + harness_routes())
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(serve_http, app, listener, runtime.gate, handoff["stop"],
                                                      drain_seconds=parsed.drain_timeout_ms / 1000))
                ready.set()

        thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
        thread.start()
        if not ready.wait(30):
            raise RuntimeError("the test server did not start")
        return cls(runtime, url, thread, handoff["token"], handoff["stop"])

    @property
    def engine(self):
        return self.runtime.stack.engine

    def stop(self, timeout: float = 30) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout)
        self.engine.close()
        self.runtime.request_log.close()


@contextlib.contextmanager
def server_starter(artifact: Path, *common: str):
    """A `start(*options)` that launches ServerThreads on `artifact` (with `common` options first) and stops every
    one of them on exit."""
    servers: list[ServerThread] = []

    def started(*options: str, **kwargs) -> ServerThread:
        servers.append(ServerThread.start(artifact, *common, *options, **kwargs))
        return servers[-1]

    try:
        yield started
    finally:
        for server in servers:
            server.stop()
