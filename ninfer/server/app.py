"""The ASGI application: lifespan, routing, the transport rules (`http`), and writing JSON or SSE responses.

The model is loaded and warmed up before the app is served, so lifespan has nothing left to do but answer. Each
HTTP request runs in a nursery next to a task that waits for `http.disconnect`: hypercorn's `send` does not fail
after a client leaves, so this watcher is what notices, and cancelling the handler closes its generation (the
engine frees the request's pages at its next round boundary).
"""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence
from urllib.parse import parse_qs

import trio

from ninfer.server import metrics_endpoint, models_endpoints
from ninfer.server.context import ApiError, ErrorFlavor, HttpRequest, JsonResponse, Route, StreamResponse, TextResponse
from ninfer.server.errors import error_body, error_response, internal_error
from ninfer.server.http import (CORS_HEADERS, CORS_PREFLIGHT_HEADERS, OPEN_PATHS, ClientDisconnected, Receive,
                                check_api_key, read_body)
from ninfer.server.routing import Router
from ninfer.server.serving_context import RequestScope, ServingContext
from ninfer.server.sse import SSE_HEADERS, frame, json_event

log = logging.getLogger("ninfer.http")

Send = Callable[[dict], Awaitable[None]]
HANDLER_MODULES = ("ninfer.server.openai_chat", "ninfer.server.anthropic", "ninfer.server.openai_responses")
CLOSE_TIMEOUT_SECONDS = 1.0  # how long a cancelled stream's cleanup may take before it is abandoned


def default_routes() -> list[Route]:
    """/health and the model endpoints, then every API handler module that exists in this build."""
    routes = models_endpoints.routes() + metrics_endpoint.routes()
    for name in HANDLER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module is there but one of its imports is not: a real error
                raise
            continue
        routes += module.routes()
    return routes


def _headers(scope: dict) -> dict[str, str]:
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


class App:
    def __init__(self, context: ServingContext, routes: Sequence[Route]) -> None:
        self.context = context
        self.router = Router(routes)
        options = context.options
        self._api_key = options.api_key
        self._cors = CORS_HEADERS if options.cors else ()
        self._body_limit = options.max_request_bytes

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            with self.context.request_scope() as request_scope:
                await self._serve(scope, receive, send, request_scope)

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _serve(self, scope: dict, receive: Receive, send: Send, request_scope: RequestScope) -> None:
        method, path, headers = scope["method"], scope["path"], _headers(scope)
        if method == "OPTIONS":  # CORS preflight: open, and answered whatever the path
            await self._send_json(send, JsonResponse(None, 204, CORS_PREFLIGHT_HEADERS if self._cors else ()))
            return
        flavor = self.router.flavor_of(path)
        try:
            if self._api_key is not None and path not in OPEN_PATHS:
                check_api_key(headers, self._api_key)
            route, params = self.router.match(method, path)
            body = await read_body(receive, headers, self._body_limit)
        except ApiError as error:
            await self._send_json(send, error_response(error, flavor))
            return
        except ClientDisconnected:
            return
        request = HttpRequest(method=method, path=path, path_params=params, headers=headers, body=body,
                              query=parse_qs(scope.get("query_string", b"").decode("latin-1")))
        # The body is read: the only message left is the disconnect, which cancels the handler and its stream.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
            try:
                response = await self._respond(route, request, request_scope)
                await self._send(send, response, route.flavor, request_scope)
            finally:
                nursery.cancel_scope.cancel()

    async def _respond(self, route: Route, request: HttpRequest,
                       request_scope: RequestScope) -> JsonResponse | StreamResponse | TextResponse:
        """The handler's response, or the error it raised as a response in the route's flavor."""
        try:
            return await route.handler(self.context, request)
        except Exception as exc:
            return error_response(self._failure(exc, request_scope), route.flavor)

    @staticmethod
    async def _watch_disconnect(receive: Receive, handler_scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        handler_scope.cancel()

    async def _send(self, send: Send, response: JsonResponse | StreamResponse | TextResponse, flavor: ErrorFlavor,
                    request_scope: RequestScope) -> None:
        if isinstance(response, StreamResponse):
            await self._send_stream(send, response, flavor, request_scope)
        elif isinstance(response, TextResponse):
            headers = [("content-type", response.content_type), *self._cors]
            await send({"type": "http.response.start", "status": response.status, "headers": _encode(headers)})
            await send({"type": "http.response.body", "body": response.text.encode("utf-8")})
        else:
            await self._send_json(send, response)

    async def _send_json(self, send: Send, response: JsonResponse) -> None:
        headers = [*response.headers, *self._cors]
        body = b""
        if response.status != 204:
            body = json.dumps(response.body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            headers.append(("content-type", "application/json"))
        await send({"type": "http.response.start", "status": response.status, "headers": _encode(headers)})
        await send({"type": "http.response.body", "body": body})

    async def _send_stream(self, send: Send, response: StreamResponse, flavor: ErrorFlavor,
                           request_scope: RequestScope) -> None:
        """The first event is awaited before the status line, so a stream that fails before producing anything
        (capacity, queue timeout, context length) is still an ordinary HTTP error. A failure after that ends the
        stream with an error event in the route's flavor."""
        events = response.events
        try:
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                first = None
            except Exception as exc:
                await self._send_json(send, error_response(self._failure(exc, request_scope), flavor))
                return
            headers = [*SSE_HEADERS, *response.headers, *self._cors]
            await send({"type": "http.response.start", "status": response.status, "headers": _encode(headers)})
            if first is not None:
                await send({"type": "http.response.body", "body": frame(first), "more_body": True})
                try:
                    async for event in events:
                        await send({"type": "http.response.body", "body": frame(event), "more_body": True})
                except Exception as exc:
                    payload = error_body(self._failure(exc, request_scope), flavor)
                    await send({"type": "http.response.body", "more_body": True,
                                "body": frame(json_event(payload, "error" if flavor == "anthropic" else None))})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await _close(events)

    def _failure(self, exc: Exception, request_scope: RequestScope) -> ApiError:
        """What a client is told about a failed handler: its ApiError (logged as a rejection when preparation had
        begun), or an internal error (logged with its traceback)."""
        if isinstance(exc, ApiError):
            self.context.note_rejection(request_scope, exc)
            return exc
        log.error("handler failed", exc_info=exc)
        return internal_error()


def _encode(headers: Sequence[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]


async def _close(events: AsyncIterator[Any]) -> None:
    """Close a handler's event iterator, which closes the generation inside it. A cancelled request gets a short,
    shielded grace for that cleanup."""
    aclose = getattr(events, "aclose", None)
    if aclose is None:
        return
    with trio.move_on_after(CLOSE_TIMEOUT_SECONDS) as scope:
        scope.shield = True
        await aclose()


def build_app(context: ServingContext, routes: Sequence[Route] | None = None) -> App:
    return App(context, default_routes() if routes is None else routes)
