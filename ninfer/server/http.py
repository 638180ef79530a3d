"""Transport rules applied before a handler runs: the body limit (checked before any JSON parsing), API-key
authentication, and the CORS headers."""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

from ninfer.server.context import ApiError

Receive = Callable[[], Awaitable[dict]]

CORS_HEADERS = (("access-control-allow-origin", "*"),)
CORS_PREFLIGHT_HEADERS = (("access-control-allow-methods", "GET, POST, DELETE, OPTIONS"),
                          ("access-control-allow-headers", "Authorization, Content-Type, x-api-key, anthropic-version"),
                          ("access-control-max-age", "600"))
OPEN_PATHS = frozenset({"/health"})  # never authenticated


class ClientDisconnected(Exception):
    """The client went away while the request body was being read."""


def too_large(limit: int) -> ApiError:
    return ApiError(413, "request_too_large", f"the request body exceeds --max-request-mib ({limit} bytes)")


async def read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    """The whole body, or ApiError 413 request_too_large as soon as it is known to exceed `limit` bytes: from a
    declared Content-Length before reading anything, else once the chunks read so far exceed it."""
    declared = headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def presented_key(headers: dict[str, str]) -> str | None:
    """The API key a client sent: an OpenAI bearer token or an Anthropic x-api-key."""
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key")


def check_api_key(headers: dict[str, str], api_key: str) -> None:
    """ApiError 401 invalid_api_key unless the client presented `api_key` (compared in constant time)."""
    presented = presented_key(headers)
    if presented is None or not hmac.compare_digest(presented.encode(), api_key.encode()):
        raise ApiError(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY or "
                       "x-api-key: KEY)" if presented is None else "the API key is not valid")
