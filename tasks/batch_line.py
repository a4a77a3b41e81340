"""``batchery.batch_line``: run one line of a batch job and store its record, exactly once.

Thin, like the chat tasks it reuses (``batchery.tasks.chat.run_chat`` / ``run_completion`` /
``run_responses``):

0. check the message (``batchery.tasks.messages``): one that is none of ours (a line the job never
   queued, a custom_id out of bounds, ...) is logged and dead-lettered and never touches the job;
0b. forward it, when several workers serve the queue and another one runs the lines of its prompt prefix
   (``batchery.broker.affinity``): a copy goes to that worker's own queue, then this one is acknowledged;
1. claim the line (``JobStore.claim``): skip it if the job is cancelling, cancelled, failed or gone,
   or if the line already has a record (a redelivered message), or if the job's completion window has ended
   (the claim then records the line ``batch_expired`` itself);
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

from celery.exceptions import Reject, Retry

from batchery.broker.connection import is_redis_url, retry_through_outage
from batchery.contract.batch import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    RESPONSES_URL,
    error_record,
    output_record,
)
from batchery.contract.errors import BatcheryError, InvalidRequest, RequestCancelled
from batchery.contract.outcomes import LineOutcome, Outcome
from batchery.jobs.deadletter import INVALID_MESSAGE, short
from batchery.jobs.store import LEASE_GRACE_S, JobStore
from batchery.tasks import inflight, messages, redelivery
from batchery.tasks.chat import resolve_timeout, run_chat, run_completion, run_responses
from batchery.tasks.embeddings import run_embeddings
from batchery.tasks.stores import job_store

log = logging.getLogger("batchery.batch")

RUNNERS = {
    CHAT_URL: run_chat,
    COMPLETIONS_URL: run_completion,
    RESPONSES_URL: run_responses,
    EMBEDDINGS_URL: run_embeddings,
}
REDIS_ATTEMPTS = 5  # 0.5 + 1 + 2 + 4 s of backoff before a Redis outage fails the task


def batch_line(
    self, job: str, line: int, custom_id: str, url: str, body: dict, timeout: float | None = None, priority: int = 0
) -> LineOutcome:
    """Run line ``line`` of batch job ``job``; returns what happened (for the worker log and metrics)."""
    store, watch = job_store(self.app)
    settings = self.app.batchery_settings
    problem = messages.check_kwargs(self.request.id, job, line, custom_id, url, body, timeout, priority)
    if problem is None:
        problem = _retrying(
            f"checking line {line} of {job}", messages.check_in_job, store, job, line, is_redis_url(settings.broker_url)
        )
    if problem is not None:
        return _refuse(self, problem)
    affinity = getattr(self.app, "batchery_affinity", None)  # several workers on the queue: run with the group
    if affinity is not None:
        kwargs = dict(job=job, line=line, custom_id=custom_id, url=url, body=body, timeout=timeout, priority=priority)
        owner = affinity.route(self.request, self.name, kwargs, priority)  # a copy of the message, if it went
        if owner is not None:
            return LineOutcome(Outcome.SKIPPED, f"forwarded to {owner}, the worker of its prefix group")
    if not inflight.take(job, [line]):  # a duplicate message: the copy that runs records or requeues the line
        return LineOutcome(Outcome.SKIPPED, "another copy of the line runs in this worker process")
    try:
        return _claim_and_run(self, store, watch, job, line, custom_id, url, body, timeout, priority)
    finally:
        inflight.release(job, [line])


def _claim_and_run(self, store, watch, job, line, custom_id, url, body, timeout, priority) -> LineOutcome:
    settings = self.app.batchery_settings
    try:
        lease = resolve_timeout(timeout, settings) + settings.retry_backoff_max + LEASE_GRACE_S
    except InvalidRequest:
        lease = settings.max_task_timeout + LEASE_GRACE_S
    # "expired": the job's completion window ended before the line started; the claim recorded it batch_expired
    claim = _retrying(f"claiming line {line} of {job}", store.claim, job, line, lease, custom_id)
    if claim != "run":
        return LineOutcome(Outcome.SKIPPED, claim)
    run = RUNNERS.get(url)
    try:
        if run is None:
            raise InvalidRequest(f"unsupported url {url!r}")
        response = run(self, body, timeout, priority=priority, cancelled=lambda: watch.stopped(job))
    except RequestCancelled:
        _retrying(f"releasing line {line} of {job}", store.release, job, line)
        return LineOutcome(Outcome.CANCELLED)
    except (Retry, Reject):
        _retrying(f"releasing line {line} of {job}", store.release, job, line)
        raise
    except BatcheryError as exc:  # invalid, context length, deadline, engine error or crash: its own code
        record = error_record(
            job, line, custom_id, exc.outcome.value, str(exc), status_code=exc.status_code, request_id=self.request.id
        )
        return _store(store, job, line, record, exc.outcome)
    except Exception as exc:  # noqa: BLE001 - a bug must still leave a record, never lose the line
        log.exception("batch %s line %d: unexpected error", job, line)
        record = error_record(
            job,
            line,
            custom_id,
            Outcome.INTERNAL_ERROR.value,
            f"{type(exc).__name__}: {exc}",
            status_code=500,
            request_id=self.request.id,
        )
        return _store(store, job, line, record, Outcome.INTERNAL_ERROR)
    usage = response.get("usage") or {}  # a Response counts input and output tokens
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details")) or {}
    return _store(
        store,
        job,
        line,
        output_record(job, line, custom_id, self.request.id, response),
        Outcome.SUCCESS,
        usage.get("prompt_tokens", usage.get("input_tokens", 0)),
        usage.get("completion_tokens", usage.get("output_tokens", 0)),
        details.get("cached_tokens") or 0,
    )


def _refuse(task, problem: str) -> LineOutcome:
    """A message that is none of ours: logged and dead-lettered; the job is not touched."""
    stored = redelivery.dead_letter(task, INVALID_MESSAGE, problem)
    log.error(
        "batch line message %s refused, %s: %s",
        short(task.request.id, 120),
        "dead-lettered" if stored else "dropped (the dead-letter list is unreachable)",
        problem,
    )
    return LineOutcome(Outcome.SKIPPED, "invalid message, dead-lettered" if stored else "invalid message")


def _store(
    store: JobStore,
    job: str,
    line: int,
    record: dict,
    outcome: Outcome,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
) -> LineOutcome:
    failed = outcome is not Outcome.SUCCESS
    new, status = _retrying(
        f"storing line {line} of {job}",
        store.write,
        job,
        line,
        record,
        failed,
        prompt_tokens,
        completion_tokens,
        cached_tokens,
    )
    if status == "gone":
        detail = f"not recorded: job {job} no longer exists"
    else:
        detail = f"job {status}" if new else "already recorded (duplicate delivery)"
    return LineOutcome(outcome, detail, prompt_tokens, completion_tokens)


def _retrying(what: str, fn, *args):
    """``fn(*args)``, retried with backoff while Redis is unreachable (a finished line's record is
    worth a few seconds; the scripts are idempotent, so a retry after a lost reply is safe)."""
    return retry_through_outage(lambda: fn(*args), what, attempts=REDIS_ATTEMPTS, logger=log)
