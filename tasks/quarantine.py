"""Poison-request quarantine, the task side: strikes per task, kept in Redis.

When an engine step fails, the engine service fails only the requests that were in that step,
with an ``EngineFailure`` marked ``struck`` (see ``batchery.worker.service.triage``). Each such failure is
a strike against the task. The task id is stable across Celery retries and redeliveries
(``{job}-{line}`` for a batch line), so the count lives in the result backend's Redis under
``{BATCHERY_QUARANTINE__KEY_PREFIX}:{task_id}`` (``batchery.jobs.strikes``) and survives a retry
that lands on another worker. From ``BATCHERY_QUARANTINE__AFTER`` strikes on, the task asks the
engine to run the request alone (``GenerationRequest.solo``); the engine service then decides
between "innocent" (it completes) and poison (``EngineCrash``).

Strikes are read only on a retry or a redelivery, so a first attempt costs no Redis round trip. A
Redis hiccup never fails a request here: a strike that cannot be read or written is logged and
skipped, and the request retries as usual."""

from __future__ import annotations

import dataclasses
import logging
import threading

from batchery.broker.connection import redis_from_url
from batchery.contract.errors import EngineFailure
from batchery.jobs.strikes import Strikes
from batchery.tasks.stores import app_resource

log = logging.getLogger("batchery.quarantine")


_num_quarantined = 0
_count_lock = threading.Lock()


def num_quarantined() -> int:
    """Requests this process put in quarantine (made to run alone): ``batchery_quarantined_requests_total``."""
    return _num_quarantined


def _count_quarantined() -> None:
    global _num_quarantined
    with _count_lock:
        _num_quarantined += 1


def strikes(app) -> Strikes:
    """The process's strike counters on the result backend's Redis (created on first use)."""

    def build() -> Strikes:
        s = app.batchery_settings
        ttl = max(3600, int(s.visibility_timeout or 0) * 2)
        return Strikes(redis_from_url(s.result_backend), s.quarantine.key_prefix, ttl)

    return app_resource(app, "batchery_strikes", build)


def prepare(task, gen):
    """``gen``, to be run alone if ``task`` has been struck ``BATCHERY_QUARANTINE__AFTER`` times."""
    after = task.app.batchery_settings.quarantine.after
    req = task.request
    if after <= 0 or gen.solo or not (req.retries or (req.delivery_info or {}).get("redelivered")):
        return gen
    try:
        n = strikes(task.app).get(req.id)
    except Exception as exc:  # noqa: BLE001 - a Redis hiccup must not fail the request
        log.warning("quarantine: could not read the strikes of %s (%s); running it as usual", req.id, exc)
        return gen
    if n < after:
        return gen
    log.warning("quarantine: %s was in %d failing engine steps; it runs alone", req.id, n)
    _count_quarantined()
    return dataclasses.replace(gen, solo=True)


def record(task, exc: EngineFailure) -> None:
    """Count a strike if ``exc`` (an ``EngineFailure``) says the request was in the failing step."""
    after = task.app.batchery_settings.quarantine.after
    if after <= 0 or not exc.struck:
        return
    try:
        n = strikes(task.app).add(task.request.id)
    except Exception as err:  # noqa: BLE001
        log.warning("quarantine: could not count a strike against %s (%s)", task.request.id, err)
        return
    log.info("quarantine: strike %d of %d against %s", n, after, task.request.id)
