"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models live workers serve, read from worker
presence (``batchery.broker.presence``: each worker announces its queue and model in the broker's Redis
every few seconds, and is forgotten about 20 s after it stops), in OpenAI's list shape. A model's
``created`` is when the longest-running worker serving it started. The server's own ``BATCHERY_MODEL``
is listed too while its queue has a worker, as a request naming it runs there; a request naming a listed
model runs on that model's queue (``inference.Inference.route``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from batchery.api.auth import Tenant, tenant
from batchery.api.errors import APIError
from batchery.api.inference import inference_of
from batchery.api.state import ApiState

router = APIRouter()


def model_objects(live: dict[str, list[dict[str, Any]]], own_model: str, own_queue: str) -> list[dict[str, Any]]:
    """OpenAI Model objects, one per model name, sorted by id."""
    started: dict[str, float] = {}
    for workers in live.values():
        for w in workers:
            model = w.get("model")
            if not isinstance(model, str) or not model:
                continue
            t = w.get("started_at")
            t = float(t) if isinstance(t, (int, float)) else 0.0
            started[model] = min(started.get(model, t), t)
    if live.get(own_queue) and own_model not in started:
        started[own_model] = min(float(w.get("started_at") or 0.0) for w in live[own_queue])
    return [
        {"id": model, "object": "model", "created": int(t), "owned_by": "batchery"}
        for model, t in sorted(started.items())
    ]


async def _models(request: Request) -> list[dict[str, Any]]:
    st: ApiState = request.app.state.batchery
    live = await inference_of(st).live()
    if live is None:
        raise APIError(503, "cannot tell which workers are live: the broker does not answer", code="broker_unavailable")
    return model_objects(live, st.settings.model, str(st.settings.queue))


@router.get("/models")
async def list_models(request: Request, _: Tenant = Depends(tenant)) -> dict[str, Any]:
    return {"object": "list", "data": await _models(request)}


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request, _: Tenant = Depends(tenant)) -> dict[str, Any]:
    for m in await _models(request):
        if m["id"] == model_id:
            return m
    raise APIError(
        404,
        f"The model '{model_id[:200]}' does not exist or no live worker serves it.",
        param="model",
        code="model_not_found",
    )
