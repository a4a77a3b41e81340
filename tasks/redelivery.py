"""Requests that kill their worker process, the task side: count deliveries, run suspects alone,
dead-letter the poison.

A request that ends its process (a kernel segfault, a lost CUDA context, the OOM killer) leaves no
exception behind for quarantine to count: its message is simply delivered again, to the next worker,
for ever. So every delivery is counted in the result backend's Redis before the engine sees it and
uncounted when it ends (``batchery.jobs.deliveries``); what is left are deliveries that died with their
process. Then:

1. **Suspects run alone.** A request two of whose deliveries died (one, if
   ``BATCHERY_MAX_DELIVERIES`` is 2) runs alone, and exclusively: the engine drains and holds other
   work until it ends (``GenerationRequest.exclusive``; the held requests' deadlines stop meanwhile),
   one at a time in this process, so a death while it runs is its own. One death alone is no sign (a worker
   SIGKILLed with a full batch would otherwise make every request it held run alone). The other
   requests that shared a dying process die too, but not alone, so those deaths never convict them.
2. **Poison is dead-lettered.** At the start of a delivery, a request with ``BATCHERY_MAX_DELIVERIES``
   (K, default 3) deliveries that died, those after the first two (the first one, for K = 2) running
   alone, is not run: it fails for good with ``EngineCrash`` (a batch line's record is
   ``engine_crash``, 500) and its message goes to the dead-letter list (``batchery.jobs.deadletter``)
   for ``batchery deadletter``. K = 1 dead-letters at the first death, blaming every request the
   process held; 0 turns counting off.

A delivery that ends by an engine failure (a retry) or a requeue keeps the deaths counted before it;
any other end (a result, an error of the request's own, a deadline, a cancel) proves the request
harmless and drops its counts. A Redis hiccup never fails a request here: a count that cannot be read
or written is logged and skipped, and the request runs as usual."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator

from batchery.broker.connection import redis_from_url, retry_through_outage
from batchery.contract.errors import EngineCrash, EngineFailure, EngineUnavailable
from batchery.contract.generation import GenerationRequest
from batchery.jobs.deadletter import WORKER_DIED, DeadLetters, make_entry
from batchery.jobs.deliveries import Deliveries
from batchery.tasks.stores import app_resource

log = logging.getLogger("batchery.redelivery")

UNCOUNT_ATTEMPTS = 5  # 0.5 + 1 + 2 + 4 s of backoff, as for a batch line's record
_alone = threading.Lock()  # one run alone at a time in this process: a death then blames only it


def deliveries(app) -> Deliveries:
    """The process's delivery counters on the result backend's Redis (created on first use)."""

    def build() -> Deliveries:
        s = app.batchery_settings
        ttl = max(3600, int(s.visibility_timeout or 0) * 2)
        return Deliveries(redis_from_url(s.result_backend), s.deadletter.deliveries_prefix, ttl)

    return app_resource(app, "batchery_deliveries", build)


def dead_letters(app) -> DeadLetters:
    """The dead-letter list on the result backend's Redis (created on first use)."""

    def build() -> DeadLetters:
        s = app.batchery_settings
        return DeadLetters(redis_from_url(s.result_backend), s.deadletter.key_prefix, s.deadletter.max_entries)

    return app_resource(app, "batchery_dead_letters", build)


def dead_letter(task, reason: str, message: str, **counts) -> bool:
    """Put ``task``'s message on the dead-letter list; False (logged) if Redis would not take it."""
    req = task.request
    info = req.delivery_info or {}
    entry = make_entry(
        task_id=req.id,
        task=task.name,
        args=list(req.args or []),
        kwargs=req.kwargs,
        queue=info.get("routing_key") or task.app.batchery_settings.queue,
        priority=info.get("priority") or 0,
        reason=reason,
        message=message,
        hostname=req.hostname,
        **counts,
    )
    try:
        dead_letters(task.app).add(entry)
    except Exception as exc:  # noqa: BLE001 - the request still fails for good; only the copy is lost
        log.error("dead letters: could not store the message of %s (%s)", entry["id"], exc)
        return False
    return True


def alone_from(limit: int) -> int:
    """After how many deaths a request runs alone: 2 (one death, such as a worker SIGKILLed with a full
    batch, must not make every request it held run alone, one at a time), but 1 where the limit leaves
    no room (``BATCHERY_MAX_DELIVERIES`` 2; with 1 the first death dead-letters, alone or not)."""
    return max(1, min(2, limit - 1))


@contextlib.contextmanager
def attempt(task, gen: GenerationRequest, timeout: float) -> Iterator[tuple[GenerationRequest, float]]:
    """Count this delivery around the engine call: yields the request to submit (alone if a delivery
    of it died before) and the deadline left. Raises ``EngineCrash`` (and dead-letters the message)
    for a request whose deliveries killed ``BATCHERY_MAX_DELIVERIES`` processes."""
    limit = task.app.batchery_settings.max_deliveries
    task_id = task.request.id
    if limit <= 0 or not task_id:
        yield gen, timeout
        return
    counters = deliveries(task.app)
    try:
        seen = counters.begin(task_id)
    except Exception as exc:  # noqa: BLE001 - a Redis hiccup must not fail the request
        log.warning("deliveries: could not count the delivery of %s (%s); running it as usual", task_id, exc)
        yield gen, timeout
        return
    alone_after = alone_from(limit)
    if seen.died >= limit and seen.died_alone >= limit - alone_after:
        message = (
            f"delivered {seen.died} times and the worker process died each time"
            + (f" ({seen.died_alone} of them running alone)" if seen.died_alone else "")
            + f"; BATCHERY_MAX_DELIVERIES is {limit}, so it is not run again"
        )
        stored = dead_letter(
            task, WORKER_DIED, message, deliveries=seen.died, deliveries_alone=seen.died_alone,
            first_delivery_at=seen.first_at,
        )  # fmt: skip
        log.error("deliveries: %s was %s; failing it for good", task_id, message)
        raise EngineCrash(
            message + ("; its message is on the dead-letter list (batchery deadletter)" if stored else "")
        )
    suspect = seen.died >= alone_after
    if suspect:
        log.warning(
            "deliveries: %s was in flight in %d worker process(es) that died; it runs alone", task_id, seen.died
        )
        gen = dataclasses.replace(gen, solo=True, exclusive=True)
    keep, alone = True, False
    try:
        # Only a death suspect takes this process's turn to run alone: a death while it holds the turn is
        # counted against it. A request quarantined for strikes (engine failures) waits for its turn in the
        # engine service's quarantine lane instead, where the wait does not count against its deadline.
        if suspect:
            with _alone_turn(task_id, timeout) as left:
                alone = _count_alone(counters, task_id)
                yield gen, left
        else:
            yield gen, timeout
        keep = False
    except EngineFailure:  # a retry or a requeue: the request has not shown what it does
        raise
    except BaseException:  # its own error, a deadline, a cancel: it ran and the process lived
        keep = False
        raise
    finally:
        # Retried through a short outage (a Redis restart, a Sentinel failover): an uncount that is lost
        # leaves a delivery that did not die counted as a death. Safe to repeat: dropping the counts is
        # idempotent, and a repeated keep-uncount only ever under-counts deaths.
        try:
            retry_through_outage(
                lambda: counters.end(task_id, alone=alone, keep=keep),
                f"uncounting the delivery of {task_id}",
                attempts=UNCOUNT_ATTEMPTS,
                logger=log,
            )
        except Exception as exc:  # noqa: BLE001
            log.warning("deliveries: could not uncount the delivery of %s (%s)", task_id, exc)


@contextlib.contextmanager
def _alone_turn(task_id: str, timeout: float) -> Iterator[float]:
    """Wait (within the deadline) for this process's turn to run a request alone; yields the deadline
    left. No turn in time: ``EngineUnavailable``, so the message goes back to the queue untouched."""
    started = time.monotonic()
    if not _alone.acquire(timeout=max(0.0, timeout)):
        raise EngineUnavailable(f"no turn to run {task_id} alone within its deadline of {timeout:g} s; requeued")
    try:
        yield max(0.001, timeout - (time.monotonic() - started))
    finally:
        _alone.release()


def _count_alone(counters: Deliveries, task_id: str) -> bool:
    try:
        counters.alone(task_id)
    except Exception as exc:  # noqa: BLE001
        log.warning("deliveries: could not count the run alone of %s (%s)", task_id, exc)
        return False
    return True
