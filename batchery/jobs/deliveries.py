"""Delivery counters in Redis: how many deliveries of a task began and never finished (the store side).

A worker process that dies in the middle of a request (a segfault in a kernel, a lost CUDA context, the
OOM killer) acknowledges nothing, so the broker hands its messages to the next worker; nothing in the
process survives to count that. So every delivery is counted here, in the result backend's Redis, before
the engine sees the request, and uncounted when it ends. What is left over are the deliveries that died
with their process. The task id is stable across Celery retries and redeliveries (``{job}-{line}`` for a
batch line), so the count survives the death of any worker.

One hash per task, ``{prefix}:{task_id}``, expiring ``ttl`` seconds after its last change::

    open      deliveries begun and not ended (the one that begins now included)
    alone     runs alone (quarantine's solo runs) begun and not ended
    first_at  when the first counted delivery began (server time)

The policy that reads them is ``batchery.tasks.redelivery``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchery.jobs import lua


@dataclass(frozen=True)
class Seen:
    """What the counters say as a delivery begins."""

    died: int  # earlier deliveries that began and never ended: they died with their worker process
    died_alone: int  # of those, the ones that were running alone
    first_at: float  # when the first of them began (Redis server time)


class Deliveries:
    """Delivery counters on one Redis. Thread-safe (redis-py clients are)."""

    def __init__(self, redis_client: Any, prefix: str = "batchery:deliveries", ttl: int = 86400) -> None:
        self.r = redis_client
        self.prefix = prefix
        self.ttl = int(ttl)
        self._begin = self.r.register_script(lua.load("deliveries_begin"))
        self._keep = self.r.register_script(lua.load("deliveries_keep"))

    def key(self, task_id: str) -> str:
        return f"{self.prefix}:{task_id}"

    def begin(self, task_id: str) -> Seen:
        """Count a delivery that begins now; returns what the earlier ones left behind."""
        died, alone, first_at = self._begin(keys=[self.key(task_id)], args=[self.ttl])
        return Seen(int(died), int(alone), float(first_at))

    def begin_in(self, pipe, task_id: str) -> None:
        """``begin`` inside a pipeline (a chunk's lines); its reply is ``[died, alone, first_at]``."""
        self._begin(keys=[self.key(task_id)], args=[self.ttl], client=pipe)

    def end_in(self, pipe, task_id: str, *, keep: bool = False) -> None:
        """``end`` inside a pipeline (a delivery that did not run alone)."""
        if keep:
            self._keep(keys=[self.key(task_id)], args=[self.ttl, "0"], client=pipe)
        else:
            pipe.delete(self.key(task_id))

    def alone(self, task_id: str) -> None:
        """The delivery that began last now runs alone (nothing else in its engine)."""
        with self.r.pipeline(transaction=True) as p:
            p.hincrby(self.key(task_id), "alone", 1)
            p.expire(self.key(task_id), self.ttl)
            p.execute()

    def end(self, task_id: str, *, alone: bool = False, keep: bool = False) -> None:
        """A delivery ended. By default the request showed what it does (it finished, or failed for a
        reason of its own) and its counts are dropped; with ``keep`` (an engine failure, a requeue) only
        this delivery is uncounted."""
        if keep:
            self._keep(keys=[self.key(task_id)], args=[self.ttl, "1" if alone else "0"])
        else:
            self.r.delete(self.key(task_id))

    def get(self, task_id: str) -> dict[str, float]:
        raw = self.r.hgetall(self.key(task_id))
        return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}

    def clear(self, task_id: str) -> None:
        self.r.delete(self.key(task_id))
