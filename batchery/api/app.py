"""The ASGI application: ``create_app(settings)``. Routers live beside it (``files``, ``batches``,
``inference``, ``models``); each takes what it needs from ``request.app.state.batchery``
(``ApiState``, in ``batchery.api.state``, so no router imports this module back), and what it builds once (a
client, a store) it keeps in ``ApiState.extras``: anything there with a ``close()`` is closed when the app shuts
down.

Every request body but a file upload is bounded by ``BATCHERY_API__MAX_BODY_BYTES`` (``BodyLimit``): a
larger Content-Length is answered 413 before the body is read, and a body without one (chunked) is counted
as it arrives, so no route ever holds more than the limit."""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchery.api.auth import Keys, tenant
from batchery.api.errors import APIError, too_large
from batchery.api.state import ApiState, state
from batchery.contract.settings import Settings

log = logging.getLogger("batchery.api")


# ApiState and state: batchery.api.state's, tenant: batchery.api.auth's, re-exported
__all__ = ["ApiState", "BodyLimit", "create_app", "state", "tenant"]


# (method, path) of the bodies BodyLimit leaves alone: uploads, bounded by BATCHERY_API__MAX_FILE_BYTES in files.py
UNBOUNDED_BODIES = frozenset({("POST", "/v1/files")})


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413 in OpenAI's shape. A Content-Length
    over it is refused before anything is read; a body that arrives without one is counted chunk by chunk
    and the read that crosses the limit raises (an ``HTTPException``, which FastAPI lets through to the
    handler, where any other exception while reading a body would become its own 400)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in UNBOUNDED_BODIES:
            await self.app(scope, receive, send)
            return
        limit = self.limit
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    err = too_large(limit)
                    body = json.dumps(err.body()).encode()
                    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                    headers.append((b"connection", b"close"))
                    await send({"type": "http.response.start", "status": 413, "headers": headers})
                    await send({"type": "http.response.body", "body": body})
                    return
        received = 0

        async def bounded() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, too_large(limit).message)
            return message

        await self.app(scope, bounded, send)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    st: ApiState = app.state.batchery
    for name, thing in list(st.extras.items()):
        close = getattr(thing, "close", None)
        if not callable(close):
            continue
        try:
            result = close()
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - shutting down: one failed close must not skip the others
            log.warning("closing %s at shutdown failed", name, exc_info=True)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(title="Batchery", version="1", docs_url=None, redoc_url=None, lifespan=_lifespan)
    app.state.batchery = ApiState(settings=settings, keys=Keys(settings.api.key_list()))
    app.add_middleware(BodyLimit, limit=settings.api.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

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
        code = {404: "unknown_url", 413: "request_too_large"}.get(exc.status_code)
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
    from batchery.api.console import routes as console  # the web console: /, /jobs/..., /workers (docs/console.md)

    app.include_router(console.router)
    return app
