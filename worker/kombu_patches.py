"""Two changes to kombu's Redis transport, applied by the worker entry point (``apply()``), never at import: a
work-around for a kombu/Celery bug that kills a worker when its Redis restarts, and a record of which worker holds
each unacknowledged message (``record_holders``).

**Holders.** Next to its ``unacked`` record of a message, the worker's channel records the worker's hostname
(``batchery.broker.orphans.OWNERS_KEY``), and drops it in the same pipeline that drops kombu's record
(acknowledgement, rejection, restore). A worker that dies leaves the record behind, and the other workers give its
messages back once it has left the workers' presence, instead of after the visibility timeout (see
``batchery.broker.orphans``). The record comes right after kombu's (a second round trip a message: a chunk of
lines on big jobs), so a worker that dies between the two leaves a message only the visibility timeout restores, as
before.

**Redis restarts.**

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


def record_holders(hostname: str) -> None:
    """Record ``hostname`` as the holder of every message this process's Redis channels take (see the module)."""
    from kombu.transport import redis as kombu_redis

    from batchery.broker import orphans

    qos = kombu_redis.QoS
    if getattr(qos.append, "batchery_patched", False):
        qos.batchery_hostname = hostname
        return
    append, remove = qos.append, qos._remove_from_indices

    def append_held(self, message, delivery_tag):
        append(self, message, delivery_tag)
        with self.channel.conn_or_acquire() as client:
            orphans.record_owner(client, delivery_tag, self.batchery_hostname)

    def remove_held(self, delivery_tag, pipe=None):
        return orphans.drop_owner(remove(self, delivery_tag, pipe), delivery_tag)

    append_held.batchery_patched = True
    qos.batchery_hostname = hostname
    qos.append = append_held
    qos._remove_from_indices = remove_held
