"""The dead-letter list: task messages that failed for good without running (the store side).

A message lands here when a worker refuses to run it (``batchery.tasks.redelivery``,
``batchery.tasks.messages``):

- ``worker_died``: ``BATCHERY_MAX_DELIVERIES`` deliveries of it died with their worker process (the
  anchor is SQS's redrive policy: ``maxReceiveCount`` and a dead-letter queue);
- ``invalid_message``: a batch-line message that fails its checks (no such line in the job, a custom_id
  or job id out of bounds, a body that is no object ...): a hand-written message, never one of ours.

Each entry is one JSON object (never pickle), by task id, in the result backend's Redis::

    {prefix}:entries  hash  task id -> entry (JSON)
    {prefix}:index    zset  task id, scored by when it was dead-lettered (server time)

An entry holds what it takes to publish the message again (task name, id, args, kwargs, queue,
priority), why it is here (``reason``, ``message``), the deliveries counted and when the first of them
began, and ``dead_lettered_at``. Sizes are bounded: a payload over ``MAX_PAYLOAD_BYTES`` is kept as a
preview (``truncated``; it cannot be requeued), and the list keeps the newest ``max_entries``.

Operators list, inspect and requeue them with ``batchery deadletter`` (``batchery.cli``). ``requeue``
here publishes an entry again, with its own task id, after resetting its delivery and strike counters."""

from __future__ import annotations

import json
import time
from typing import Any

from batchery.contract.names import BATCH_LINE_TASK, ENQUEUED_AT_HEADER
from batchery.jobs import lua

MAX_PAYLOAD_BYTES = 1 << 20  # args + kwargs as JSON; a batch line of BATCHERY_BATCH__MAX_LINE_BYTES (1 MiB) fits
PREVIEW_CHARS = 2048  # of a payload too large to keep
MAX_ID_CHARS = 512
MAX_TEXT_CHARS = 1000  # task name, queue, message, hostname

WORKER_DIED = "worker_died"
INVALID_MESSAGE = "invalid_message"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def short(text: Any, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` as a string of at most ``limit`` characters (for entries and log lines)."""
    s = text if isinstance(text, str) else repr(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def make_entry(
    *,
    task_id: Any,
    task: Any,
    args: Any,
    kwargs: Any,
    queue: Any,
    priority: Any,
    reason: str,
    message: str,
    deliveries: int = 0,
    deliveries_alone: int = 0,
    first_delivery_at: float | None = None,
    hostname: Any = None,
) -> dict:
    """A bounded, JSON-ready entry. Whatever came in a message is cut to size here, never trusted."""
    entry: dict[str, Any] = {
        "id": short(task_id, MAX_ID_CHARS),
        "task": short(task),
        "queue": short(queue) if queue else None,
        "priority": priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
        "reason": reason,
        "message": short(message),
        "deliveries": int(deliveries),
        "deliveries_alone": int(deliveries_alone),
        "first_delivery_at": first_delivery_at,
        "hostname": short(hostname) if hostname else None,
        "truncated": False,
    }
    try:
        payload = json.dumps({"args": args, "kwargs": kwargs}, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        payload = short(repr((args, kwargs)), PREVIEW_CHARS + 1)
        entry["truncated"] = True
    if not entry["truncated"] and len(payload.encode("utf-8", "surrogatepass")) <= MAX_PAYLOAD_BYTES:
        entry["args"], entry["kwargs"] = args, kwargs
    else:
        entry["truncated"] = True
        entry["payload_preview"] = short(payload, PREVIEW_CHARS)
    if entry["id"] != task_id or entry["task"] != task:
        entry["truncated"] = True  # an id or a task name cut short cannot be published again
    return entry


class DeadLetters:
    """The dead-letter list on one Redis. Thread-safe (redis-py clients are)."""

    def __init__(self, redis_client: Any, prefix: str = "batchery:deadletter", max_entries: int = 1000) -> None:
        self.r = redis_client
        self.prefix = prefix
        self.max_entries = int(max_entries)
        self._add = self.r.register_script(lua.load("deadletter_add"))

    @property
    def entries_key(self) -> str:
        return f"{self.prefix}:entries"

    @property
    def index_key(self) -> str:
        return f"{self.prefix}:index"

    def add(self, entry: dict) -> None:
        """Store ``entry`` (from ``make_entry``) under its id, replacing an older one; the oldest entries
        beyond ``max_entries`` are dropped."""
        text = json.dumps({k: v for k, v in entry.items() if k != "dead_lettered_at"}, separators=(",", ":"))
        self._add(keys=[self.entries_key, self.index_key], args=[entry["id"], text[:-1], self.max_entries])

    def get(self, task_id: str) -> dict | None:
        raw = self.r.hget(self.entries_key, task_id)
        return None if raw is None else json.loads(raw)

    def ids(self, limit: int | None = None) -> list[str]:
        """Entry ids, newest first."""
        end = -1 if limit is None else max(1, limit) - 1
        return [_s(i) for i in self.r.zrevrange(self.index_key, 0, end)]

    def list(self, limit: int = 100) -> list[dict]:
        """The newest ``limit`` entries, newest first."""
        ids = self.ids(limit)
        raws = self.r.hmget(self.entries_key, ids) if ids else []
        return [json.loads(raw) for raw in raws if raw is not None]

    def count(self) -> int:
        return int(self.r.zcard(self.index_key))

    def remove(self, task_id: str) -> bool:
        with self.r.pipeline(transaction=True) as p:
            p.hdel(self.entries_key, task_id)
            p.zrem(self.index_key, task_id)
            removed, _ = p.execute()
        return bool(removed)


def requeue_refusal(entry: dict) -> str | None:
    """Why ``entry`` cannot be published again as it stands (None: it can)."""
    if entry.get("truncated"):
        return "its message was too large (or its id or task name too long) to be kept whole"
    if entry.get("reason") == INVALID_MESSAGE:
        return "its message failed the worker's checks and would fail them again"
    if not entry.get("queue"):
        return "its queue is unknown"
    return None


def requeue(app: Any, entry: dict, *counters: Any) -> None:
    """Publish ``entry``'s message again on its queue, with its own task id, after clearing its
    ``counters`` (``Deliveries``, ``Strikes``: anything with ``clear(task_id)``), so it starts afresh.
    Check ``requeue_refusal`` first; the caller removes the entry once this returns."""
    for c in counters:
        c.clear(entry["id"])
    app.send_task(
        entry["task"],
        args=entry.get("args") or [],
        kwargs=entry.get("kwargs") or {},
        task_id=entry["id"],
        queue=entry["queue"],
        priority=entry.get("priority") or 0,
        ignore_result=entry["task"] == BATCH_LINE_TASK,
        headers={ENQUEUED_AT_HEADER: time.time()},
    )
