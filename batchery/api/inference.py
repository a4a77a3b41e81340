"""``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and ``/v1/embeddings``, answered synchronously
through the queue: the body is validated with the contract's models (a 400 naming the field, as a batch
line's error does), sent as the Celery task a worker runs (``batchery.client.Client``), and the worker's
answer is the response body. Waiting never blocks the event loop: the result is polled from a thread.

Which queue: a request whose ``model`` names a model a live worker serves (its name, as ``/v1/models``
lists it, or its queue) runs on that worker's queue; any other ``model`` runs on the server's own queue
(``BATCHERY_QUEUE``, or the one ``BATCHERY_MODEL`` derives), as a batch line does: the queue decides the
model, and the answer's ``model`` says which one ran.

Time: the request may take ``BATCHERY_API__REQUEST_TIMEOUT`` seconds from when it is enqueued; it is
sent with that as its deadline (capped by ``BATCHERY_MAX_TASK_TIMEOUT``) and as its expiry, so a worker
neither starts nor goes on with work nobody waits for.

Errors (OpenAI's shape, ``batchery.api.errors``):
- the body: 400 (``param`` names the first bad field); ``stream: true``: 400, as batchery serve does not
  stream (results travel whole through the result backend); a body over the limit: 413 (``app.BodyLimit``);
- the worker refused it: 400; the prompt does not fit the model: 400 ``context_length_exceeded``;
- its deadline passed in the worker (``deadline_exceeded``) or the wait did (``timeout``): 504, with
  ``x-should-retry: false`` (the SDK would otherwise send the same long request twice more);
- the engine failed it and its retries are spent: 500 ``engine_error``; poison (``engine_crash``): 500, not
  to be retried; the worker could not serve: 503;
- no worker has been seen on the queue: 503 ``no_worker`` at once, naming the queues that do have workers;
- the broker does not answer: 503 ``broker_unavailable``."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from batchery.api.auth import Tenant, tenant
from batchery.api.errors import APIError, invalid
from batchery.api.state import ApiState
from batchery.broker import presence
from batchery.broker.connection import is_redis_url
from batchery.client import Client, Handle
from batchery.contract.errors import (
    BatcheryError,
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineCrash,
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
    ResultTimeout,
    TaskExpired,
)
from batchery.contract.responses import ResponsesRequest
from batchery.contract.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    describe_validation_error,
)
from batchery.contract.settings import Settings, mask_url, queue_for_model

log = logging.getLogger("batchery.api.inference")

router = APIRouter()

LIVE_CACHE_S = 2.0  # worker presence is read at most this often (workers announce every 5 s)
POLL_FIRST_S = 0.01  # the result is polled from this interval up to POLL_MAX_S, doubling
POLL_MAX_S = 0.25
MAX_CLIENTS = 64  # queues a server keeps a client for (one per queue a request was routed to)
STREAM_REFUSED = (
    "streaming is not supported by batchery serve: the answer is delivered whole through the queue's result "
    "backend; send stream: false (the default)"
)


# -- the shared state -----------------------------------------------------------------------------------------
class Inference:
    """What the inference routes share, built once per app (``inference_of``): a ``Client`` per queue and
    a short cache of worker presence."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._clients: dict[str, Client] = {}
        self._lock = threading.Lock()
        self._live: tuple[float, dict[str, list[dict[str, Any]]] | None] | None = None
        self._live_lock = asyncio.Lock()

    @property
    def default_queue(self) -> str:
        return str(self.settings.queue)

    def client(self, queue: str | None = None) -> Client:
        """The client that sends to ``queue`` (default: the server's)."""
        queue = queue or self.default_queue
        with self._lock:
            c = self._clients.get(queue)
            if c is None:
                if len(self._clients) >= MAX_CLIENTS:
                    raise APIError(503, "too many queues in use by this server", code="too_many_queues")
                c = Client(settings=self.settings.model_copy(update={"queue": queue}))
                self._clients[queue] = c
            return c

    async def live(self) -> dict[str, list[dict[str, Any]]] | None:
        """The live workers by queue (``presence.workers``), at most ``LIVE_CACHE_S`` old; None when that
        cannot be told (the broker does not answer)."""
        cached = self._live
        if cached is not None and time.monotonic() - cached[0] < LIVE_CACHE_S:
            return cached[1]
        async with self._live_lock:
            cached = self._live
            if cached is not None and time.monotonic() - cached[0] < LIVE_CACHE_S:
                return cached[1]
            value = await asyncio.to_thread(self.client().live_workers)
            self._live = (time.monotonic(), value)
            return value

    def route(self, model: object, live: dict[str, list[dict[str, Any]]] | None) -> str:
        """The queue of a request naming ``model``: that of a live worker serving it (by model name or
        queue name; the server's own queue first when it is one of them), else the server's."""
        if not isinstance(model, str) or not model or not live:
            return self.default_queue
        candidates = sorted(
            q for q, ws in live.items() if ws and (q == model or any(w.get("model") == model for w in ws))
        )
        if not candidates:
            derived = queue_for_model(model)
            candidates = [derived] if live.get(derived) else []
        if not candidates or self.default_queue in candidates:
            return self.default_queue
        return candidates[0]

    def discard(self, queue: str, client: Client) -> None:
        """Drop ``client`` (its broker or result-store connection failed): the next request builds a fresh one,
        as Celery's result consumer may refuse to reconnect once its retries are spent."""
        with self._lock:
            if self._clients.get(queue) is client:
                del self._clients[queue]
        self._live = None  # read presence again: while the broker is down that is a fast 503 for the next request
        try:
            client.close()
        except Exception:  # noqa: BLE001 - it is broken already
            log.debug("closing a broken client failed", exc_info=True)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - shutting down
                log.debug("closing a client failed", exc_info=True)


def inference_of(st: ApiState) -> Inference:
    inf = st.extras.get("inference")
    if inf is None:
        inf = st.extras["inference"] = Inference(st.settings)
    return inf


# -- the body -------------------------------------------------------------------------------------------------
def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (400 otherwise). Its size is bounded by ``app.BodyLimit``."""
    raw = await request.body()
    if not raw.strip():
        raise invalid("The request body is empty: send a JSON object.")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid(f"The request body must be a JSON object, not {type(body).__name__}.")
    return body


def _param(exc: ValidationError) -> str | None:
    """The body path of the first problem, written as the message writes it (``messages.0.content``):
    pydantic's location without its union branch names."""
    for err in exc.errors(include_url=False):
        parts: list[str] = []
        for part in err.get("loc", ()):
            if isinstance(part, str) and (
                "[" in part
                or "-" in part
                or part[:1].isupper()
                or part in ("str", "int", "float", "bool", "dict", "list")
            ):
                continue
            if parts and parts[-1] == str(part):
                continue
            parts.append(str(part))
        if parts:
            return ".".join(parts)
    return None


def validate(schema: type[BaseModel], body: dict[str, Any]) -> None:
    """400 naming the field when ``body`` is not a valid ``schema`` (``stream: true`` first, clearly)."""
    if body.get("stream") is True:
        raise invalid(STREAM_REFUSED, param="stream")
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        raise invalid(describe_validation_error(exc), param=_param(exc)) from None


# -- the routes -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    schema: type[BaseModel]
    send: Callable[..., Handle]  # (client, body, timeout, expires) -> Handle
    prompt_param: str  # the field a context-length error names


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint(
        ChatCompletionRequest, lambda c, body, t, e: c.chat(**body, timeout=t, expires=e), "messages"
    ),
    "/v1/completions": Endpoint(
        CompletionRequest, lambda c, body, t, e: c.complete(**body, timeout=t, expires=e), "prompt"
    ),
    "/v1/responses": Endpoint(
        ResponsesRequest, lambda c, body, t, e: c.responses(**body, timeout=t, expires=e), "input"
    ),
    # served by workers of an embedding model; a chat model's worker answers 400, naming its kind
    "/v1/embeddings": Endpoint(EmbeddingRequest, lambda c, body, t, e: c.embed(**body, timeout=t, expires=e), "input"),
}


def _no_worker(note: str) -> APIError:
    return APIError(503, f"{note}; nothing would answer this request", code="no_worker")


def _broker_down(settings: Settings, exc: BaseException) -> APIError:
    where = mask_url(settings.broker_url)
    return APIError(
        503, f"the queue's broker ({where}) does not answer ({type(exc).__name__}: {exc})", code="broker_unavailable"
    )


def _worker_error(exc: BaseException, endpoint: Endpoint, timeout: float, note: str | None) -> APIError:
    """The HTTP error of a request that did not complete."""
    if isinstance(exc, ContextLengthExceeded):
        return APIError(400, str(exc), param=endpoint.prompt_param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), code="invalid_request")
    if isinstance(exc, DeadlineExceeded):
        return APIError(504, str(exc), code="deadline_exceeded", retry=False)
    if isinstance(exc, (ResultTimeout, TaskExpired)):
        if note:
            return _no_worker(note)
        return APIError(
            504,
            f"no answer within {timeout:g} s (BATCHERY_API__REQUEST_TIMEOUT); the queue may be busy",
            code="timeout",
            retry=False,
        )
    if isinstance(exc, EngineCrash):
        return APIError(500, str(exc), code="engine_crash", retry=False)
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, EngineFailure):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, BatcheryError):
        return APIError(500, str(exc), code="internal_error")
    return APIError(500, f"the worker failed ({type(exc).__name__}: {exc})", code="internal_error")


def _broker_errors() -> tuple[type[BaseException], ...]:
    """What a broker or result store that does not answer raises through Celery: Redis' and kombu's errors,
    socket errors, and Celery's RuntimeError once its result consumer has spent its reconnection retries."""
    from kombu.exceptions import OperationalError
    from redis.exceptions import RedisError

    return (RedisError, OperationalError, ConnectionError, OSError, RuntimeError)


async def _wait(handle: Handle, timeout: float) -> Any:
    """``handle.get`` without blocking the loop: poll ``ready`` from a thread, then fetch."""
    deadline = time.monotonic() + timeout
    delay = POLL_FIRST_S
    while not await asyncio.to_thread(handle.ready):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ResultTimeout(f"no result within {timeout:g} s")
        await asyncio.sleep(min(delay, left))
        delay = min(POLL_MAX_S, delay * 2)
    return await asyncio.to_thread(handle.get, 10.0)


def _failed(path: str, queue: str, error: APIError) -> APIError:
    if error.status_code >= 500:
        log.warning("%s on queue %s: %s %s: %s", path, queue, error.status_code, error.code, error.message)
    return error


async def answer(request: Request, path: str) -> JSONResponse:
    st: ApiState = request.app.state.batchery
    endpoint = ENDPOINTS[path]
    body = await read_json_object(request)
    validate(endpoint.schema, body)
    inf = inference_of(st)
    live = await inf.live()
    queue = inf.route(body.get("model"), live)
    settings = st.settings
    if live is None and is_redis_url(settings.broker_url):
        # presence is read from the broker: when that fails, sending would only wait on the same Redis
        raise APIError(
            503, f"the queue's broker ({mask_url(settings.broker_url)}) does not answer", code="broker_unavailable"
        )
    note = None if live is None else presence.absence_note(live, queue)
    if note:
        raise _no_worker(note)
    timeout = settings.api.request_timeout
    deadline = min(timeout, settings.max_task_timeout)
    client = inf.client(queue)
    try:
        handle = await asyncio.to_thread(endpoint.send, client, body, deadline, timeout)
    except InvalidRequest as exc:  # the client's own checks (the body passed ours)
        raise invalid(str(exc)) from None
    except _broker_errors() as exc:
        inf.discard(queue, client)
        raise _failed(path, queue, _broker_down(settings, exc)) from None
    try:
        value = await _wait(handle, timeout)
    except BatcheryError as exc:  # before OSError: ResultTimeout is a TimeoutError
        now_note = None
        if isinstance(exc, (ResultTimeout, TaskExpired)):
            live = await inf.live()
            now_note = None if live is None else presence.absence_note(live, queue)
        raise _failed(path, queue, _worker_error(exc, endpoint, timeout, now_note)) from None
    except _broker_errors() as exc:
        inf.discard(queue, client)
        raise _failed(path, queue, _broker_down(settings, exc)) from None
    except Exception as exc:  # noqa: BLE001 - a worker exception Celery rebuilt as another type
        raise _failed(path, queue, _worker_error(exc, endpoint, timeout, None)) from None
    # the stored result is not needed once answered: drop it (and its subscription) after the response
    return JSONResponse(value.model_dump(mode="json", exclude_unset=True), background=BackgroundTask(handle.forget))


@router.post("/chat/completions")
async def chat_completions(request: Request, _: Tenant = Depends(tenant)) -> JSONResponse:
    return await answer(request, "/v1/chat/completions")


@router.post("/completions")
async def completions(request: Request, _: Tenant = Depends(tenant)) -> JSONResponse:
    return await answer(request, "/v1/completions")


@router.post("/responses")
async def responses(request: Request, _: Tenant = Depends(tenant)) -> JSONResponse:
    return await answer(request, "/v1/responses")


@router.post("/embeddings")
async def embeddings(request: Request, _: Tenant = Depends(tenant)) -> JSONResponse:
    return await answer(request, "/v1/embeddings")
