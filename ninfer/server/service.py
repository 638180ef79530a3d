"""`serve`: the composition of the server - the nursery's service lifetime running this package's app."""

from __future__ import annotations

from typing import Sequence

from ninfer.nursery.options import ServeOptions
from ninfer.nursery.service import Runtime, run_service
from ninfer.observability.console import configure_console
from ninfer.server.app import App, build_app
from ninfer.server.context import Route
from ninfer.server.serving_context import ServingContext


def make_app(runtime: Runtime, routes: Sequence[Route] | None = None) -> App:
    context = ServingContext(runtime.options, runtime.stack, runtime.gate, runtime.request_log,
                             started_unix=runtime.started_unix)
    return build_app(context, routes)


def serve(options: ServeOptions, routes: Sequence[Route] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; the process exit status. `routes`: the routing table (default: /health, the
    model endpoints and every API handler in this build)."""
    configure_console()
    return run_service(options, lambda runtime: make_app(runtime, routes))
