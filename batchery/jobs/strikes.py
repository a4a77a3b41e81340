"""Strike counters in Redis: how many failing engine steps a task was in (quarantine, the store side).

The task id is stable across Celery retries and redeliveries (``{job}-{line}`` for a batch line), so
a count under ``{prefix}:{task_id}`` survives a retry that lands on another worker. The policy that
reads them is ``batchery.tasks.quarantine``."""

from __future__ import annotations

from typing import Any


class Strikes:
    """Strike counters on one Redis. Thread-safe (redis-py clients are)."""

    def __init__(self, redis_client: Any, prefix: str = "batchery:strikes", ttl: int = 86400) -> None:
        self.r = redis_client
        self.prefix = prefix
        self.ttl = int(ttl)

    def key(self, task_id: str) -> str:
        return f"{self.prefix}:{task_id}"

    def get(self, task_id: str) -> int:
        return int(self.r.get(self.key(task_id)) or 0)

    def add(self, task_id: str) -> int:
        """Count one more strike; returns the new count. The key expires ``ttl`` seconds after the
        last strike."""
        with self.r.pipeline(transaction=True) as p:
            p.incr(self.key(task_id))
            p.expire(self.key(task_id), self.ttl)
            n, _ = p.execute()
        return int(n)

    def clear(self, task_id: str) -> None:
        self.r.delete(self.key(task_id))
