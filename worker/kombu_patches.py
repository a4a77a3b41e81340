"""A work-around for a kombu/Celery bug that kills a worker when its Redis restarts. Applied by the
worker entry point (``apply()``), never at import.

Celery 5.7's consumer, on losing the broker connection, first ``collect()``s the connection
(which detaches the transport: ``transport.client = None``) and then ``close()``s it. With Redis
down, the first close of the channel breaks off while it reads its last BRPOP reply, before the
channel is marked closed. The second close then restores the unacknowledged messages through the
detached transport, and kombu's Redis channel fails with ``AttributeError: 'NoneType' object has
no attribute 'hostname'`` (``Channel._connparams``). Celery does not count that as a connection
error: "Unrecoverable error", and the worker exits with every in-flight request aborted.

The patch makes ``_connparams`` raise ``redis.ConnectionError`` on a detached channel instead.
Celery ignores connection errors while it closes a lost connection, so the worker reconnects as
it should. The messages the close could not restore stay unacknowledged in Redis; the requests
running still finish and store their results, and anything left comes back after the visibility
timeout, like after any worker loss (batch writes are idempotent)."""

from __future__ import annotations

import logging

log = logging.getLogger("batchery.worker")


def apply() -> None:
    import redis
    from kombu.transport import redis as kombu_redis

    original = kombu_redis.Channel._connparams
    if getattr(original, "batchery_patched", False):
        return

    def _connparams(self, asynchronous=False):
        if getattr(self.connection, "client", None) is None:
            raise redis.ConnectionError("the broker connection was closed (its channel is detached)")
        return original(self, asynchronous=asynchronous)

    _connparams.batchery_patched = True
    kombu_redis.Channel._connparams = _connparams
