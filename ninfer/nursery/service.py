"""The serving process's lifetime, as one trio nursery tree:

    service
    |-- signal watcher      SIGTERM/SIGINT: before serving, exit; while serving, drain; a second one, exit now
    |-- startup             the model stack loads in a worker thread, then one warm-up generation
    |-- throughput reporter every --log-stats-interval-ms
    `-- hypercorn           serves the app until the drain: the gate closes (new generation requests get 503),
                            the listener closes (new connections are refused), and in-flight requests get
                            --drain-timeout-ms to finish before they are cancelled

The port is bound before anything is loaded, so a taken port fails at once; requests are served only after the
load and the warm-up. The engine thread stops when the tree has finished.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import hypercorn.config
import hypercorn.trio
import trio

from ninfer.nursery.admission import AdmissionGate
from ninfer.nursery.options import ServeOptions
from ninfer.nursery.startup import (ModelStack, StartupError, load_model_stack, server_start_record,
                                    unsupported_options, warm_up)
from ninfer.observability.request_log import RequestLog, RequestLogError
from ninfer.observability.stats import report_throughput

log = logging.getLogger("ninfer.service")

AsgiApp = Callable[..., Any]


@attrs.frozen(kw_only=True)
class Runtime:
    """Everything the HTTP app is built from, once startup has finished."""

    options: ServeOptions
    stack: ModelStack
    gate: AdmissionGate
    request_log: RequestLog
    started_unix: int


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (it listens once hypercorn serves)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    return listener


async def serve_http(app: AsgiApp, listener: socket.socket, gate: AdmissionGate, stop: trio.Event, *,
                     drain_seconds: float, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on `listener` (handed over to hypercorn) until `stop` is set, then drain and return."""
    config = hypercorn.config.Config()
    config.bind = [f"fd://{listener.detach()}"]
    config.errorlog = logging.getLogger("ninfer.http")
    config.accesslog = None
    config.graceful_timeout = drain_seconds  # hypercorn's grace for in-flight requests after the trigger

    async def drain_trigger() -> None:
        await stop.wait()
        gate.close()
        log.info("draining: no new requests; in-flight ones have %.1f s to finish", drain_seconds)

    await hypercorn.trio.serve(app, config, shutdown_trigger=drain_trigger, task_status=task_status)


class _Lifecycle:
    """What a signal does depends on how far the service got."""

    def __init__(self, cancel_scope: trio.CancelScope) -> None:
        self.serving = False
        self.stop = trio.Event()
        self._cancel_scope = cancel_scope

    async def watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if self.serving and not self.stop.is_set():
                    log.info("%s: shutting down", name)
                    self.stop.set()
                else:
                    log.info("%s: exiting now", name)
                    self._cancel_scope.cancel()


async def _run(options: ServeOptions, artifact_path: Path, listener: socket.socket, request_log: RequestLog,
               make_app: Callable[[Runtime], AsgiApp]) -> int:
    async with trio.open_nursery() as service:
        lifecycle = _Lifecycle(service.cancel_scope)
        service.start_soon(lifecycle.watch_signals)
        log.info("loading %s", artifact_path)
        try:
            stack = await trio.to_thread.run_sync(load_model_stack, options, artifact_path, abandon_on_cancel=True)
        except StartupError as exc:
            log.error("startup failed: %s", exc)
            service.cancel_scope.cancel()
            return 1
        stack.engine.start()
        try:
            warm_up_seconds = await warm_up(stack, options)
            runtime = Runtime(options=options, stack=stack, gate=AdmissionGate(options.capacity),
                              request_log=request_log, started_unix=int(time.time()))
            request_log.write("server_start", **server_start_record(options, stack, warm_up_seconds))
            if options.log_stats_interval_ms:
                service.start_soon(report_throughput, stack.engine, request_log,
                                   options.log_stats_interval_ms / 1000)
            lifecycle.serving = True
            log.info("serving %s on http://%s:%d (load %.2f s, warm-up %s)", stack.public_model_id, options.host,
                     options.port, stack.load_seconds,
                     "failed" if warm_up_seconds is None else f"{warm_up_seconds:.2f} s")
            await serve_http(make_app(runtime), listener, runtime.gate, lifecycle.stop,
                             drain_seconds=options.drain_timeout_ms / 1000)
            log.info("stopped")
        finally:
            stack.engine.close()
            if stack.media_preparer is not None:
                stack.media_preparer.close()  # its worker pool; requests are drained by now
        service.cancel_scope.cancel()
    return 0


def run_service(options: ServeOptions, make_app: Callable[[Runtime], AsgiApp]) -> int:
    """Run the server until it is stopped; the process exit status."""
    problems = unsupported_options(options)
    for problem in problems:
        log.error("startup failed: %s", problem)
    if problems:
        return 1
    try:
        listener = bind_listener(options.host, options.port)
    except OSError as exc:
        log.error("startup failed: cannot listen on %s:%d: %s", options.host, options.port, exc)
        return 1
    try:
        artifact_path = options.artifact
        if artifact_path is None:
            from ninfer.convert.demo import ensure_demo_artifact

            artifact_path = ensure_demo_artifact()
        request_log = RequestLog.open(options.request_log_jsonl, artifact=artifact_path)
    except (RequestLogError, RuntimeError, OSError) as exc:  # the demo model's DemoModelError is a RuntimeError
        listener.close()
        log.error("startup failed: %s", exc)
        return 1
    try:
        return trio.run(_run, options, artifact_path, listener, request_log, make_app)
    finally:
        listener.close()  # a no-op once hypercorn has taken it over
        request_log.close()
