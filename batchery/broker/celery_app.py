"""The Celery app configuration that clients and workers share, built from ``Settings``.

Delivery is at-least-once: late acks, reject on worker loss, a Redis visibility timeout longer
than the longest deadline, bounded prefetch, and JSON only (pickle is refused both for task
messages and for results). A client sends with this app as it is; the worker
(``batchery.worker.app.make_app``) registers its task functions on it. No import-time side
effects: call ``make_celery``.

A ``sentinel://...?master_name=NAME`` broker or result backend (``batchery.broker.connection``) goes
to Celery without its query, with ``master_name`` as a transport option: kombu's Sentinel transport
and Celery's ``SentinelBackend`` then follow the master through a failover."""

from __future__ import annotations

from celery import Celery

from batchery.broker.connection import celery_sentinel
from batchery.contract.names import TASK_NAMES
from batchery.contract.settings import Settings


def make_celery(settings: Settings | None = None) -> Celery:
    """A Celery app for ``settings`` (default: from the environment), with no tasks registered."""
    settings = settings or Settings()
    broker_url, broker_sentinel = celery_sentinel(settings.broker_url)
    backend_url, backend_sentinel = celery_sentinel(settings.result_backend)
    app = Celery("batchery", broker=broker_url, backend=backend_url, set_as_current=False)
    app.conf.update(
        # JSON only, everywhere
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        # at-least-once delivery
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,  # a task that failed for good is not redelivered
        worker_prefetch_multiplier=1,  # prefetch = concurrency: bounded
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout,
            # kombu sweeps for messages whose worker died every interval x throttle seconds (by
            # default 10 x 10): make it one sweep per interval, a tenth of the visibility timeout
            "unacked_restore_interval": max(1.0, min(10.0, settings.visibility_timeout / 10)),
            "unacked_restore_throttle": 1,
            # the sweep holds a Redis lock shared by every worker on the broker; a worker killed
            # while holding it would stop all sweeps for the lock's expiry (kombu: 300 s). Each
            # restore is its own WATCH transaction, so a short expiry cannot restore twice.
            "unacked_mutex_expire": int(max(5.0, min(300.0, settings.visibility_timeout / 4))),
            **broker_sentinel,  # master_name, for a sentinel:// broker
        },
        result_backend_transport_options=backend_sentinel,
        # the result backend rides out a Redis restart (clients polling results, workers storing them)
        result_backend_always_retry=True,
        result_backend_max_retries=10,
        result_expires=settings.result_expires,
        # one queue per model
        task_default_queue=settings.queue,
        task_routes={name: {"queue": settings.queue} for name in TASK_NAMES},
        # many tasks per process, all feeding one engine
        worker_pool="threads",
        worker_concurrency=settings.num_task_threads,
        # the entry point owns logging and stdout
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        broker_connection_retry_on_startup=True,
        # a lost broker connection must not cancel generations; their messages stay unacked
        worker_cancel_long_running_tasks_on_connection_loss=False,
        enable_utc=True,
        # task events for monitoring (Flower); off by default, they cost a Redis publish per state change
        worker_send_task_events=settings.send_events,
        task_send_sent_event=settings.send_events,
    )
    app.batchery_settings = settings  # type: ignore[attr-defined]
    return app
