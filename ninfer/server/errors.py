"""Error bodies in the two wire flavors (ninfer-facts §8.2).

OpenAI: `{"error": {"message", "type", "param", "code", ...extra}}`. Anthropic: `{"type": "error", "error":
{"type", "message", ...extra}}`, its type derived from the HTTP status.
"""

from __future__ import annotations

from typing import Any

from ninfer.server.context import ApiError, ErrorFlavor, JsonResponse

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error"}


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(error: ApiError, flavor: ErrorFlavor) -> dict[str, Any]:
    if flavor == "anthropic":
        return {"type": "error", "error": {"type": anthropic_type(error.status), "message": error.message,
                                           **error.extra}}
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code,
                      **error.extra}}


def error_response(error: ApiError, flavor: ErrorFlavor) -> JsonResponse:
    return JsonResponse(error_body(error, flavor), status=error.status)


def internal_error(message: str = "internal server error") -> ApiError:
    return ApiError(500, "internal_error", message, type="internal_error")
