"""GET /metrics: Prometheus text exposition (ninfer.observability.metrics). Authenticated like the APIs when
--api-key is set (serving.md leaves only /health and CORS preflight open)."""

from __future__ import annotations

from ninfer.observability.metrics import CONTENT_TYPE, render
from ninfer.server.context import HttpRequest, Route, TextResponse


async def metrics(ctx, request: HttpRequest) -> TextResponse:
    text = render(ctx.engine, ctx.gate, getattr(ctx, "request_counters", None), model=ctx.public_model_id)
    return TextResponse(text, content_type=CONTENT_TYPE)


def routes() -> list[Route]:
    return [Route("GET", "/metrics", metrics)]
