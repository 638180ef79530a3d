"""The contract between the HTTP layer and the per-API handlers.

The app (`ninfer.server.app`) owns transport: routing, auth, CORS, the body limit before JSON parsing, error
rendering, SSE framing on the wire, and noticing client disconnects. A handler owns one API's semantics: it parses
its body with `ninfer.protocol`, prepares the prompt with the frontend, runs the generation through
`ServerContext.generate`, and returns a JSON body or an async stream of SSE events.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Mapping, Protocol

import attrs

from ninfer.engine.request import OutputPolicy, PreparedPrompt, RequestEvent, RequestOptions

ErrorFlavor = Literal["openai", "anthropic"]


class ApiError(Exception):
    """A failure a client should see as an HTTP error. The app renders it in the route's flavor:
    OpenAI `{"error": {"message", "type", "param", "code"}}` or Anthropic `{"type": "error", "error": {"type",
    "message"}}` (Anthropic error types come from the status: 400 invalid_request_error, 401 authentication_error,
    404 not_found_error, 413 request_too_large, 429 rate_limit_error, 5xx api_error / overloaded_error)."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.type = status, code, message, param, type
        self.extra = extra or {}  # more members for the error object, e.g. prompt_tokens / max_context


@attrs.frozen(kw_only=True)
class HttpRequest:
    method: str
    path: str
    path_params: dict[str, str]
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names
    body: bytes  # already within --max-request-mib

    def json(self) -> Any:
        """The body as JSON; a body that is not JSON is an ApiError (400 invalid_json)."""
        import json

        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, "invalid_json", f"the request body is not valid JSON: {exc}") from None


@attrs.frozen
class JsonResponse:
    body: Any  # JSON-serialisable
    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class SseEvent:
    """One server-sent event: `event: NAME` (when set) and `data: DATA`, then a blank line."""

    data: str
    event: str | None = None


@attrs.frozen
class StreamResponse:
    """An SSE response. The app writes each event as it comes and cancels the iterator when the client leaves."""

    events: AsyncIterator[SseEvent] = attrs.field(eq=False)
    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class TextResponse:
    """A plain-text body (GET /metrics)."""

    text: str
    status: int = 200
    content_type: str = "text/plain; charset=utf-8"


Response = JsonResponse | StreamResponse | TextResponse


class ServerContext(Protocol):
    """What a handler may use. One instance per server, built at startup."""

    public_model_id: str  # the artifact's model_id, or --model-id
    options: Any  # the parsed serve options (ninfer.cli.serve)
    prompt_builder: Any  # ninfer.frontend.prompt.PromptBuilder for the loaded artifact
    stop_ids: frozenset[int]  # the model's default stop tokens (generation_config eos ids)
    max_context: int
    started_unix: int  # when the server started serving (the model objects' `created`)
    # ninfer.media.prepare.MediaPreparer with --vision, else None (media requests are then 400 vision_disabled).
    # A context may also define `async prepare_media(items) -> PreparedMedia` (the server's does: the request's
    # pending deadline, its log record, a release when the request ends); ninfer.server.generation.prepare_media
    # runs the preparer itself for a context without one.
    media_preparer: Any

    def begin_preparation(self, *, api: str, shape: Mapping[str, Any] | None = None) -> None:
        """Call after schema and model validation, just before preparing the prompt. The request takes its
        capacity slot here (ApiError 429 server_overloaded when full, 503 server_shutting_down while the server
        drains) and its request id; an ApiError raised after this is logged as request_rejected (phase "prepare").
        `shape` describes the request for the log without its content, e.g. {"stream": true, "messages": 3,
        "tools": 1, "media_items": 0}. Optional: `generate` begins preparation itself when a handler did not (then
        the preparation is neither counted against capacity nor logged as such)."""
        ...

    def generate(self, prompt: PreparedPrompt, options: RequestOptions, policy: OutputPolicy, *,
                 api: str) -> AsyncIterator[RequestEvent]:
        """Admit and run one generation; yields its events until the final one (which carries finish + usage).
        `api` ("chat", "responses", "messages") labels the request in the request log.

        Raises ApiError before the first event: 429 server_overloaded when max_concurrency + max_pending requests
        are outstanding, 503 request_queue_timeout when admission does not happen within --pending-timeout-ms,
        400 context_length_exceeded. Leaving the iteration early (client disconnect, handler error) cancels the
        request in the engine and frees its pages."""
        ...


Handler = Callable[[ServerContext, HttpRequest], Awaitable[Response]]


@attrs.frozen
class Route:
    method: str
    pattern: str  # e.g. "/v1/responses/{id}/input_items"
    handler: Handler = attrs.field(eq=False)
    flavor: ErrorFlavor = "openai"
