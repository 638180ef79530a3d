"""Media errors: one base class carrying the API answer (status, code, message, param), and the budget rejection
that acquisition, decoding, the cache and request preparation all raise."""

from __future__ import annotations

from typing import Any


class MediaError(ValueError):
    """A media item cannot be used. `status` / `code` / `message` / `param` mirror `ninfer.server.context.ApiError`
    (400 `invalid_media` unless a subclass says otherwise); `param` is None until the caller names the field."""

    status: int = 400
    code: str = "invalid_media"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def to_api_error(self, param: str | None = None) -> Any:
        """The equivalent `ApiError` (imported lazily: the media package does not depend on the server)."""
        from ninfer.server.context import ApiError

        return ApiError(self.status, self.code, self.message, param=param if param is not None else self.param,
                        type=self.type)


class MediaBudgetExceeded(MediaError):
    """A media resource rejection (bytes, frames, duration, pixels, patches, tokens, live memory): HTTP 400
    `media_budget_exceeded`. `needed` / `limit` say by how much, where known."""

    status, code = 400, "media_budget_exceeded"

    def __init__(self, message: str, *, needed: int | None = None, limit: int | None = None,
                 param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.needed, self.limit = needed, limit
