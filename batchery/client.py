"""Python client: enqueue OpenAI-style requests on a model's queue and collect typed results.

    from batchery.client import Client
    c = Client()                                   # or Client(broker_url="redis://...")
    h = c.chat([{"role": "user", "content": "Hi"}], max_tokens=32, temperature=0, timeout=60)
    r = h.get(timeout=120)                         # ChatCompletion; r.choices[0].message.content
    hs = c.chat_many([[...], [...]], max_tokens=32)
    c.chat(msgs, response_format={"type": "json_schema", "json_schema": {...}}, n=3)  # also tools=, tool_choice=
    c.responses("Write a haiku", max_output_tokens=64).get().output_text
    r = await h.aget()

    job = c.submit_batch("input.jsonl")            # or an iterable of dicts; returns the job id
    st = c.batch_status(job)                       # BatchJob: status, request_counts{total,completed,failed}
    c.wait_batch(job, timeout=None, progress=True)
    for line in c.batch_results(job): ...          # records in input order (errors have "error" set)
    c.cancel_batch(job)

Bodies are validated here too, so a bad request fails at once, before it is enqueued. ``get``
raises ``InvalidRequest``, ``DeadlineExceeded``, ``EngineFailure`` (retries exhausted),
``TaskExpired`` or ``ResultTimeout``. A Redis that refuses the URL's password fails the first send
at once with ``batchery.broker.check.RedisAuthError`` (a ``ConnectionError``). Light: no torch, no
engine."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import TypeVar

from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from pydantic import BaseModel, ValidationError

from batchery.broker import presence
from batchery.broker.celery_app import make_celery
from batchery.broker.connection import is_redis_url, redis_from_url, retry_through_outage
from batchery.contract.errors import (
    BatcheryError,
    DeadlineExceeded,
    EngineFailure,
    InvalidRequest,
    ResultTimeout,
    TaskExpired,
)
from batchery.contract.names import CHAT_TASK, COMPLETION_TASK, EMBEDDINGS_TASK, ENQUEUED_AT_HEADER, RESPONSES_TASK
from batchery.contract.responses import Response, ResponsesRequest
from batchery.contract.schemas import (
    BatchJob,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    check_timeout,
    describe_validation_error,
)
from batchery.contract.settings import Settings, mask_url
from batchery.jobs.store import JobStore

log = logging.getLogger("batchery.client")

T = TypeVar("T")

__all__ = [
    "Client",
    "Handle",
    "BatcheryError",
    "InvalidRequest",
    "DeadlineExceeded",
    "EngineFailure",
    "TaskExpired",
    "ResultTimeout",
]


PRESENCE_TIMEOUT_S = 1.0  # the worker-presence look-up after a timeout: a Redis that does not answer is skipped


class Handle:
    """One enqueued request. ``get``/``aget`` return the pydantic response object."""

    def __init__(
        self,
        result: AsyncResult,
        response_model: type[BaseModel],
        enqueued_at: float,
        queue: str | None = None,
        queue_note: Callable[[str], str | None] | None = None,
    ) -> None:
        self._result = result
        self._model = response_model
        self.enqueued_at = enqueued_at  # time.time() just before the message was published
        self.queue = queue
        self._queue_note = queue_note

    def _timeout(self, timeout: float, state: str | None = None) -> ResultTimeout:
        """The error of a wait that gave up: names the queue, and whether any worker consumes it."""
        where = "" if self.queue is None else f", queue '{self.queue}'"
        head = f"no result for task {self.id} within {timeout:g} s (state {state or self._result.state}{where})"
        note = None
        if self.queue is not None and self._queue_note is not None:
            try:
                note = self._queue_note(self.queue)
            except Exception:  # noqa: BLE001 - the note is a courtesy; the timeout is the error
                note = None
        if note:
            return ResultTimeout(f"{head}: {note}")
        return ResultTimeout(f"{head}; it may still complete")

    @property
    def id(self) -> str:
        return self._result.id

    @property
    def state(self) -> str:
        return self._result.state

    def ready(self) -> bool:
        return self._result.ready()

    def get(self, timeout: float | None = None):
        """Wait for the result (at most ``timeout`` seconds; None waits forever)."""
        try:
            value = self._result.get(timeout=timeout, propagate=True, disable_sync_subtasks=False)
        except CeleryTimeoutError:
            raise self._timeout(timeout or 0.0) from None
        except TaskRevokedError as exc:
            raise TaskExpired(f"task {self.id} was not run: it expired or was revoked ({exc})") from None
        return self._model.model_validate(value)

    async def aget(self, timeout: float | None = None, poll_interval: float = 0.25):
        """``get`` for asyncio: polls the result backend from a worker thread, never blocking the loop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while not await asyncio.to_thread(self._result.ready):
            if deadline is not None and time.monotonic() >= deadline:
                raise self._timeout(timeout or 0.0, "PENDING")
            await asyncio.sleep(delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(poll_interval, delay * 2)
        return await asyncio.to_thread(self.get, 5.0)

    def forget(self) -> None:
        """Drop the stored result from the backend."""
        self._result.forget()


class Client:
    """Enqueue requests for a model's worker pool. Settings default to ``BATCHERY_*`` variables."""

    def __init__(
        self,
        broker_url: str | None = None,
        *,
        result_backend: str | None = None,
        queue: str | None = None,
        model: str | None = None,
        settings: Settings | None = None,
    ) -> None:
        if settings is None:
            overrides = {
                k: v
                for k, v in (
                    ("broker_url", broker_url),
                    ("result_backend", result_backend),
                    ("queue", queue),
                    ("model", model),
                )
                if v is not None
            }
            if broker_url is not None and result_backend is None:
                overrides["result_backend"] = broker_url
            settings = Settings(**overrides)
        self.settings = settings
        self.queue = settings.queue
        self.app = make_celery(settings)  # the worker's configuration: JSON only, routes
        self._jobs = None
        self._broker_redis = None  # for batchery.jobs.recover, on first use
        self._presence_redis = None  # for worker presence: short timeouts, no retries
        self._credentials_checked = False

    def close(self) -> None:
        for r in (self._jobs.r if self._jobs is not None else None, self._broker_redis, self._presence_redis):
            if r is not None:
                r.close()
        self.app.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- single requests ------------------------------------------------------------------------
    def chat(
        self,
        messages: list[dict],
        *,
        response_format: dict | None = None,
        n: int | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        logit_bias: dict[str | int, float] | None = None,
        timeout: float | None = None,
        expires: float | datetime | None = None,
        **params,
    ) -> Handle:
        """Enqueue a chat completion. The keyword arguments are the OpenAI body fields
        (``max_tokens``, ``temperature``, ``seed``, ..., and vLLM's ``structured_outputs`` /
        ``guided_*``); those named here are the ones worth knowing: ``response_format``
        (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
        "schema", "strict"}}``), ``n`` choices, ``tools`` and ``tool_choice`` (``"auto"``,
        ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``), and
        ``logit_bias`` (token id to -100..100). ``timeout`` is the task's deadline in seconds
        (default: the worker's BATCHERY_TASK_TIMEOUT), counted from when a worker starts an
        attempt; an attempt retried after an engine failure gets a fresh deadline. ``expires``
        (seconds from now, or a datetime) drops the task if no worker has started it by then."""
        named = dict(response_format=response_format, n=n, tools=tools, tool_choice=tool_choice)
        if logit_bias is not None:
            named["logit_bias"] = {str(k): v for k, v in logit_bias.items()}  # JSON keys, as OpenAI sends them
        body = {"messages": messages, **{k: v for k, v in named.items() if v is not None}, **params}
        return self._send(CHAT_TASK, ChatCompletionRequest, ChatCompletion, body, timeout, expires)

    def responses(
        self,
        input: str | list[dict],
        *,
        timeout: float | None = None,
        expires: float | datetime | None = None,
        **fields,
    ) -> Handle:
        """Enqueue an OpenAI Responses request: ``input`` is a string or a list of messages; the
        other fields are the body's (``instructions``, ``max_output_tokens``, ``temperature``,
        ``top_p``, ``text={"format": {...}}``, ``tools``, ``tool_choice``, ...). ``get`` returns a
        ``Response`` (``output``, ``output_text``, ``usage``, ``status``)."""
        return self._send(RESPONSES_TASK, ResponsesRequest, Response, {"input": input, **fields}, timeout, expires)

    def complete(
        self,
        prompt: str | list[int],
        *,
        timeout: float | None = None,
        expires: float | datetime | None = None,
        **params,
    ) -> Handle:
        """Enqueue a (legacy) completion of ``prompt`` (text or token ids)."""
        return self._send(
            COMPLETION_TASK, CompletionRequest, Completion, {"prompt": prompt, **params}, timeout, expires
        )

    def embed(
        self,
        input: str | list[str] | list[int] | list[list[int]],
        *,
        dimensions: int | None = None,
        encoding_format: str | None = None,
        timeout: float | None = None,
        expires: float | datetime | None = None,
        **fields,
    ) -> Handle:
        """Enqueue an embeddings request (OpenAI's ``/v1/embeddings`` body) for a worker of an embedding model
        (``BATCHERY_MODEL=all-minilm-l6-v2``): ``input`` is a string, a list of up to 2,048 strings, a list of token
        ids or a list of such lists. ``get`` returns an ``EmbeddingResponse`` (``data[i].embedding``, ``usage``).
        Other fields: ``truncate_prompt_tokens`` (vLLM's), ``user``. A worker of a generative model answers with
        ``InvalidRequest``, naming its model's kind."""
        named = dict(dimensions=dimensions, encoding_format=encoding_format)
        body = {"input": input, **{k: v for k, v in named.items() if v is not None}, **fields}
        return self._send(EMBEDDINGS_TASK, EmbeddingRequest, EmbeddingResponse, body, timeout, expires)

    # -- bulk -----------------------------------------------------------------------------------
    def chat_many(
        self,
        conversations: Iterable[list[dict] | dict],
        *,
        timeout: float | None = None,
        expires: float | datetime | None = None,
        **params,
    ) -> list[Handle]:
        """Enqueue many chat completions over one broker connection. Each item is a message list,
        or a body dict (``{"messages": ..., "max_tokens": ...}``) whose fields override ``params``.
        All are validated first, so either every request is enqueued or none is."""
        bodies = [{**params, **c} if isinstance(c, dict) else {**params, "messages": c} for c in conversations]
        return self._send_many(CHAT_TASK, ChatCompletionRequest, ChatCompletion, bodies, timeout, expires)

    def complete_many(
        self,
        prompts: Iterable[str | list[int] | dict],
        *,
        timeout: float | None = None,
        expires: float | datetime | None = None,
        **params,
    ) -> list[Handle]:
        """Like ``chat_many``; each item is a prompt or a body dict with ``"prompt"``."""
        bodies = [{**params, **p} if isinstance(p, dict) else {**params, "prompt": p} for p in prompts]
        return self._send_many(COMPLETION_TASK, CompletionRequest, Completion, bodies, timeout, expires)

    # -- internals ------------------------------------------------------------------------------
    @staticmethod
    def _check(schema: type[BaseModel], body: dict, index: int | None = None) -> None:
        try:
            schema.model_validate(body)
        except ValidationError as exc:
            what = "request body" if index is None else f"request body #{index}"
            raise InvalidRequest(describe_validation_error(exc, what)) from None

    def _check_credentials(self) -> None:
        """Before the first send: a refused password fails now, clearly, instead of after Celery's
        reconnect attempts (about 20 s). An unreachable Redis is left to those attempts."""
        if self._credentials_checked:
            return
        from batchery.broker.check import check_redis

        check_redis(self.settings.broker_url, "the broker URL")
        if self.settings.result_backend != self.settings.broker_url:
            check_redis(self.settings.result_backend, "the result backend URL")
        self._credentials_checked = True

    def _publish(self, name: str, body: dict, timeout, expires, model, producer=None) -> Handle:
        now = time.time()
        result = self.app.send_task(
            name,
            kwargs={"body": body, "timeout": timeout},
            queue=self.queue,
            task_id=str(uuid.uuid4()),
            expires=expires,
            producer=producer,
            headers={ENQUEUED_AT_HEADER: now},
        )  # the worker's queue-wait metric
        return Handle(result, model, now, self.queue, self.queue_note)

    def _send(self, name, schema, model, body, timeout, expires) -> Handle:
        self._check(schema, body)
        check_timeout(timeout)
        self._check_credentials()
        return self._publish(name, body, timeout, expires, model)

    def _send_many(self, name, schema, model, bodies, timeout, expires) -> list[Handle]:
        for i, body in enumerate(bodies):
            self._check(schema, body, i)
        check_timeout(timeout)
        self._check_credentials()
        with self.app.producer_or_acquire() as producer:
            return [self._publish(name, body, timeout, expires, model, producer) for body in bodies]

    # -- workers --------------------------------------------------------------------------------
    def live_workers(self) -> dict[str, list[dict]] | None:
        """The workers announced in the broker's Redis, by queue (``batchery.broker.presence``); None when
        that cannot be told (a broker other than Redis, or one that does not answer within a second)."""
        if not is_redis_url(self.settings.broker_url):
            return None
        if self._presence_redis is None:
            self._presence_redis = redis_from_url(
                self.settings.broker_url,
                socket_timeout=PRESENCE_TIMEOUT_S,
                socket_connect_timeout=PRESENCE_TIMEOUT_S,
                retry=None,
            )
        try:
            return presence.workers(self._presence_redis)
        except Exception as exc:  # noqa: BLE001 - unknown is an answer too
            log.debug("cannot read worker presence: %s", exc)
            return None

    def queue_note(self, queue: str | None = None) -> str | None:
        """A sentence when no worker has been seen on ``queue`` (default: this client's), naming the queues
        that have workers; None when one has been seen, or when that cannot be told."""
        live = self.live_workers()
        return None if live is None else presence.absence_note(live, queue or str(self.queue))

    # -- batch jobs -----------------------------------------------------------------------------
    @property
    def jobs(self):
        """The ``JobStore`` on the result backend's Redis."""
        if self._jobs is None:
            b = self.settings.batch
            self._jobs = JobStore(redis_from_url(self.settings.result_backend), b.key_prefix, b.ttl, b.drain_at)
        return self._jobs

    def submit_batch(
        self,
        source,
        *,
        timeout: float | None = None,
        priority: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> str:
        """Submit a batch job and return its id once its lines are enqueued. ``source`` is a JSONL
        path (OpenAI Batch input lines) or an iterable of line dicts (or JSON strings). It is
        streamed; bad lines become error records and the rest goes on. ``timeout`` is each
        request's deadline in seconds; ``priority`` 0 (first, the default) to 9 (last).

        A job keeps at most a window of lines queued or running (``BATCHERY_BATCH__WINDOW_MIN`` / ``__MAX``). A
        path with more lines is copied into the store (``BATCHERY_STORAGE_URL``) first, and this returns once
        the first window is queued: the workers feed the rest (``batchery.jobs.feeder``). An iterable with more
        lines is fed from here, window by window, so this returns when its last window is queued.
        ``StorageError`` (nothing created) when the store cannot take the copy."""
        from batchery.jobs.submit import make_submitter

        self._check_credentials()
        return make_submitter(self).run(source, timeout=timeout, priority=priority, metadata=metadata)

    def batch_status(self, job: str | BatchJob) -> BatchJob:
        """The job's state; raises ``batchery.jobs.store.JobNotFound`` (a ``KeyError``) if there is none
        (``JobMalformed``, a subclass, for a job hash left without a status). Timestamps are the Redis server's."""
        return self.jobs.status(_job_id(job))

    def wait_batch(
        self,
        job: str | BatchJob,
        timeout: float | None = None,
        progress: bool = False,
        poll_interval: float = 0.5,
        on_update: Callable[[BatchJob], None] | None = None,
        recover_after: float | None = 10.0,
    ) -> BatchJob:
        """Wait until the job ends (completed, failed or cancelled) and return its final state.
        ``progress`` draws a live bar on stderr (on a terminal; else a line now and then).
        ``on_update`` sees every polled state (and may raise to stop waiting). Rides out Redis
        outages. When the job has made no progress for ``recover_after`` seconds, looks for lines
        whose messages the broker lost and queues them again (``requeue_lost``; None: never).
        Raises ``ResultTimeout`` after ``timeout`` seconds."""
        from batchery.progress import Progress

        job_id = _job_id(job)
        bar = Progress(sys.stderr) if progress else None
        deadline = None if timeout is None else time.monotonic() + timeout
        last_done, last_change = -1, time.monotonic()
        st: BatchJob | None = None
        try:
            while True:
                if deadline is not None and st is not None and time.monotonic() >= deadline:
                    raise self._still_running(job_id, timeout, st)  # not a Redis that did not answer
                try:
                    st = self._status_through_outages(job_id, deadline)
                except (_NoAnswer, *_redis_unavailable()) as exc:
                    raise self._redis_timeout(job_id, timeout, st, exc) from None
                if bar is not None:
                    bar.update(st)
                if on_update is not None:
                    on_update(st)
                if st.is_terminal:
                    return st
                now = time.monotonic()
                if st.num_done != last_done:
                    last_done, last_change = st.num_done, now
                elif recover_after is not None and now - last_change >= recover_after:
                    last_change = now  # look again only after another quiet period
                    try:
                        _call_by(deadline, lambda st=st: self.requeue_lost(st))
                    except _NoAnswer:
                        pass  # the wait's time is up: said below
                    except Exception as exc:  # noqa: BLE001 - a failed look must not stop the wait
                        log.warning("could not check batch job %s for lost lines: %s", job_id, exc)
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._still_running(job_id, timeout, st)
                left = poll_interval if deadline is None else min(poll_interval, max(0.0, deadline - time.monotonic()))
                time.sleep(left)
        finally:
            if bar is not None:
                bar.close()

    def requeue_lost(self, job: str | BatchJob) -> int:
        """Queue again the lines of a running job whose task messages the broker lost (a Redis
        restart or a worker death at the wrong moment: see ``batchery.jobs.recover``). Returns how many;
        0 on a broker other than Redis."""
        from batchery.jobs.recover import requeue_lost

        if not is_redis_url(self.settings.broker_url):
            return 0
        st = job if isinstance(job, BatchJob) else self.jobs.status(_job_id(job))
        if self._broker_redis is None:
            self._broker_redis = redis_from_url(self.settings.broker_url)
        return requeue_lost(self.jobs, self._broker_redis, st.id, st.queue)

    def _status_through_outages(self, job_id: str, deadline: float | None) -> BatchJob:
        """``jobs.status``, waiting out a Redis outage (restart, failover) with backoff and saying
        so in the log; gives up at ``deadline`` (None: never), also when Redis stops answering in the middle of
        a call (``_NoAnswer``)."""
        return retry_through_outage(
            lambda: _call_by(deadline, lambda: self.jobs.status(job_id)),
            f"waiting for batch job {job_id}",
            deadline=deadline,
            logger=log,
        )

    @staticmethod
    def _still_running(job_id: str, timeout: float | None, st: BatchJob) -> ResultTimeout:
        return ResultTimeout(
            f"batch job {job_id} is still {st.status} after {timeout or 0:g} s "
            f"({st.num_done}/{st.request_counts.total} done)"
        )

    def _redis_timeout(self, job_id: str, timeout: float | None, st: BatchJob | None, exc: Exception) -> ResultTimeout:
        seen = "" if st is None else f"; last seen {st.status}, {st.num_done}/{st.request_counts.total} done"
        why = "did not answer" if isinstance(exc, _NoAnswer) else f"did not answer ({type(exc).__name__}: {exc})"
        return ResultTimeout(
            f"batch job {job_id}: Redis at {mask_url(self.settings.result_backend)} {why} within the "
            f"{timeout or 0:g} s timeout{seen}; the job may still be running"
        )

    def batch_results(self, job: str | BatchJob) -> Iterator[dict]:
        """The job's records in input order, streamed: output lines (``"error": None``) and error
        lines (``"error": {"code", "message", "line"}``). A cancelled or still running job gives
        the records written so far. A big job's records come from the file store (``BATCHERY_STORAGE_URL``), where
        the workers move them while it runs, merged with those still in Redis."""
        from batchery.jobs.storage import open_storage

        return self.jobs.iter_results(_job_id(job), storage=lambda: open_storage(self.settings.storage_url))

    def cancel_batch(self, job: str | BatchJob) -> BatchJob:
        """Cancel: lines not started are skipped, running ones aborted in the engine. Returns the
        state (``cancelling`` until the running lines have stopped, then ``cancelled``)."""
        job_id = _job_id(job)
        self.jobs.cancel(job_id)
        return self.jobs.status(job_id)

    def list_batches(self, limit: int = 20) -> list[BatchJob]:
        """The newest jobs first."""
        return self.jobs.list(limit)


def _job_id(job) -> str:
    return job.id if isinstance(job, BatchJob) else str(job)


class _NoAnswer(ResultTimeout):
    """A Redis call still unanswered at the wait's deadline (it goes on in a daemon thread)."""


def _redis_unavailable() -> tuple[type[Exception], ...]:
    import redis

    return (redis.ConnectionError, redis.TimeoutError)


def _call_by(deadline: float | None, fn: Callable[[], T]) -> T:
    """``fn()``, given up at ``deadline`` (``time.monotonic()``; None: never) with ``_NoAnswer``. A Redis that
    stops answering (paused, or unreachable with its TCP connection still up) holds a call for up to its socket
    timeouts and retries; the call goes on in a daemon thread, which the process does not wait for at exit."""
    if deadline is None:
        return fn()
    done = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="batchery-wait-call", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise _NoAnswer("Redis did not answer before the deadline")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
