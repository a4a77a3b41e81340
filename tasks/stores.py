"""The worker process's Redis-backed stores, created on first use and kept on the Celery app."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from batchery.broker.connection import redis_from_url
from batchery.jobs.store import JobStore
from batchery.jobs.watch import JobWatch

T = TypeVar("T")

_lock = threading.Lock()


def app_resource(app: Any, attr: str, build: Callable[[], T]) -> T:
    """``app.<attr>``, built once by ``build()`` (thread-safe; task threads race for it)."""
    value = getattr(app, attr, None)
    if value is None:
        with _lock:
            value = getattr(app, attr, None)
            if value is None:
                value = build()
                setattr(app, attr, value)
    return value


def job_store(app: Any) -> tuple[JobStore, JobWatch]:
    """The process's job store on the result backend's Redis, and its cancel watch."""

    def build() -> tuple[JobStore, JobWatch]:
        s = app.batchery_settings
        jobs = JobStore(redis_from_url(s.result_backend), s.batch.key_prefix, s.batch.ttl, s.batch.drain_at)
        return jobs, JobWatch(jobs)

    return app_resource(app, "batchery_jobs", build)
