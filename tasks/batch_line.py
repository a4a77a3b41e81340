"""``batchery.batch_line``: run one line of a batch job and store its record, exactly once.

Thin, like the chat tasks it reuses (``batchery.tasks.chat.run_chat`` / ``run_completion``):

1. claim the line (``JobStore.claim``): skip it if the job is cancelling, cancelled, failed or gone,
   or if the line already has a record (a redelivered message);
2. run it, polling the job while waiting, so a cancel aborts it in the engine;
3. store its record (``JobStore.write``: ``HSETNX`` + counters in one script, so a duplicate
   delivery never counts twice).

Every outcome of a started line becomes a record, so no line is lost: the response (200), or an
error record with a 400 (invalid, ``context_length_exceeded``), 504 (deadline) or 500 (engine
failure once retries are spent, ``engine_crash`` for a poison request, or a bug). Only a retry
(engine failure), a requeue (this worker cannot serve) or a cancel leaves without a record, and
each releases the line's lease.

The task's Celery result is ignored: the record in the job is the result."""

from __future__ import annotations

import logging
import threading
import time

from celery.exceptions import Reject, Retry

from batchery.contract.batch import (
    CHAT_URL,
    COMPLETIONS_URL,
    CONTEXT_LENGTH_EXCEEDED,
    DEADLINE_EXCEEDED,
    ENGINE_CRASH,
    ENGINE_ERROR,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    error_record,
    output_record,
)
from batchery.tasks.chat import resolve_timeout, run_chat, run_completion
from batchery.jobs.store import LEASE_GRACE_S, JobStore, JobWatch, redis_from_url
from batchery.contract.errors import (
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineCrash,
    EngineFailure,
    InvalidRequest,
    RequestCancelled,
)
from batchery.worker.metrics import note_outcome

log = logging.getLogger("batchery.batch")

BATCH_LINE_TASK = "batchery.batch_line"
RUNNERS = {CHAT_URL: run_chat, COMPLETIONS_URL: run_completion}
REDIS_ATTEMPTS = 5  # 0.5 + 1 + 2 + 4 s of backoff before a Redis outage fails the task

_lock = threading.Lock()


def job_store(app) -> tuple[JobStore, JobWatch]:
    """The process's job store on the result backend's Redis (created on first use)."""
    store = getattr(app, "batchery_jobs", None)
    if store is None:
        with _lock:
            store = getattr(app, "batchery_jobs", None)
            if store is None:
                s = app.batchery_settings
                jobs = JobStore(redis_from_url(s.result_backend), s.batch.key_prefix, s.batch.ttl)
                store = app.batchery_jobs = (jobs, JobWatch(jobs))
    return store


def batch_line(self, job: str, line: int, custom_id: str, url: str, body: dict, timeout: float | None = None,
               priority: int = 0) -> str:
    """Run line ``line`` of batch job ``job``; returns what happened (for the worker log)."""
    store, watch = job_store(self.app)
    settings = self.app.batchery_settings
    try:
        lease = resolve_timeout(timeout, settings) + settings.retry_backoff_max + LEASE_GRACE_S
    except InvalidRequest:
        lease = settings.max_task_timeout + LEASE_GRACE_S
    claim = _retrying(f"claiming line {line} of {job}", store.claim, job, line, lease)
    if claim != "run":
        return f"skipped ({claim})"
    run = RUNNERS.get(url)
    try:
        if run is None:
            raise InvalidRequest(f"unsupported url {url!r}")
        response = run(self, body, timeout, priority=priority, cancelled=lambda: watch.stopped(job))
    except RequestCancelled:
        _retrying(f"releasing line {line} of {job}", store.release, job, line)
        return "cancelled"
    except (Retry, Reject):
        _retrying(f"releasing line {line} of {job}", store.release, job, line)
        raise
    except ContextLengthExceeded as exc:
        record = _error(self, job, line, custom_id, CONTEXT_LENGTH_EXCEEDED, exc, 400)
    except InvalidRequest as exc:
        record = _error(self, job, line, custom_id, INVALID_REQUEST, exc, 400)
    except DeadlineExceeded as exc:
        record = _error(self, job, line, custom_id, DEADLINE_EXCEEDED, exc, 504)
    except EngineFailure as exc:
        record = _error(self, job, line, custom_id, ENGINE_ERROR, exc, 500)
    except EngineCrash as exc:
        record = _error(self, job, line, custom_id, ENGINE_CRASH, exc, 500)
    except Exception as exc:  # noqa: BLE001 - a bug must still leave a record, never lose the line
        log.exception("batch %s line %d: unexpected error", job, line)
        record = _error(self, job, line, custom_id, INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", 500)
    else:
        usage = response.get("usage") or {}
        return _store(store, job, line, output_record(job, line, custom_id, self.request.id, response), False,
                      usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
    return _store(store, job, line, record, True)


def _error(task, job: str, line: int, custom_id: str, code: str, exc, status_code: int) -> dict:
    note_outcome(code)  # the metrics' outcome label: the task itself returns normally
    return error_record(job, line, custom_id, code, str(exc), status_code=status_code, request_id=task.request.id)


def _store(store: JobStore, job: str, line: int, record: dict, failed: bool, prompt_tokens: int = 0,
           completion_tokens: int = 0) -> str:
    new, status = _retrying(f"storing line {line} of {job}", store.write, job, line, record, failed, prompt_tokens,
                            completion_tokens)
    outcome = "failed" if failed else "ok"
    if status == "gone":
        return f"{outcome}, not recorded: job {job} no longer exists"
    return f"{outcome} (job {status})" if new else f"{outcome}, already recorded (duplicate delivery)"


def _retrying(what: str, fn, *args):
    """``fn(*args)``, retried with backoff while Redis is unreachable (a finished line's record is
    worth a few seconds; the scripts are idempotent, so a retry after a lost reply is safe)."""
    import redis

    for attempt in range(REDIS_ATTEMPTS):
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError):
            if attempt == REDIS_ATTEMPTS - 1:
                raise
            log.warning("batch: Redis unavailable while %s; retrying", what)
            time.sleep(0.5 * 2 ** attempt)
