"""The ASGI application: ``create_app(settings)``. Routers live beside it (``files``, ``batches``,
``inference``, ``models``); each takes what it needs from ``request.app.state.batchery``
(``ApiState``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchery.api.auth import Keys, Tenant
from batchery.api.errors import APIError
from batchery.contract.settings import Settings

log = logging.getLogger("batchery.api")


@dataclass
class ApiState:
    """What the routes share: settings, keys and the lazily built Redis-backed services."""

    settings: Settings
    keys: Keys
    extras: dict[str, Any] = field(default_factory=dict)  # per-router singletons (file store, job store, ...)


def state(request: Request) -> ApiState:
    return request.app.state.batchery


def tenant(request: Request) -> Tenant:
    """Dependency: the caller's tenant (401 in OpenAI's shape for a missing or wrong key)."""
    return state(request).keys.tenant(request.headers.get("authorization"))


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(title="Batchery", version="1", docs_url=None, redoc_url=None)
    app.state.batchery = ApiState(settings=settings, keys=Keys(settings.api.key_list()))

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        msg = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p not in ('body', 'query', 'path')) or '(body)'}: "
            f"{e.get('msg', 'invalid')}"
            for e in errs[:5]
        )
        return JSONResponse(APIError(400, f"invalid request: {msg}", param=loc or None).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "unknown_url" if exc.status_code == 404 else None
        message = str(exc.detail) if exc.status_code != 404 else "Unknown request URL."
        return JSONResponse(APIError(exc.status_code, message, code=code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the API")
        return JSONResponse(APIError(500, f"internal error ({type(exc).__name__})").body(), status_code=500)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    # the routers, each owned by its own module
    from batchery.api import batches, files, inference, models

    for module in (files, batches, inference, models):
        app.include_router(module.router, prefix="/v1")
    return app
