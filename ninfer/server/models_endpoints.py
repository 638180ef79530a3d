"""GET /health, /v1/models and /v1/models/{id}: process health and the one public model alias."""

from __future__ import annotations

from typing import Any

from ninfer.server.context import ApiError, HttpRequest, JsonResponse, Route, ServerContext

OWNER = "ninfer"


def model_object(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.public_model_id, "object": "model", "created": ctx.started_unix, "owned_by": OWNER}


async def health(ctx: ServerContext, request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


async def list_models(ctx: ServerContext, request: HttpRequest) -> JsonResponse:
    return JsonResponse({"object": "list", "data": [model_object(ctx)]})


async def get_model(ctx: ServerContext, request: HttpRequest) -> JsonResponse:
    model_id = request.path_params["id"]
    if model_id != ctx.public_model_id:
        raise ApiError(404, "model_not_found", f"the model {model_id!r} does not exist (this server serves "
                       f"{ctx.public_model_id!r})", param="model")
    return JsonResponse(model_object(ctx))


def routes() -> list[Route]:
    return [Route("GET", "/health", health), Route("GET", "/v1/models", list_models),
            Route("GET", "/v1/models/{id:path}", get_model)]
