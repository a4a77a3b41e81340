"""Find and re-queue batch lines whose task message the broker lost.

kombu's Redis transport takes a message off the queue with ``BRPOP`` and only then records it in
its ``unacked`` hash (which is what brings it back after a worker dies). If Redis restarts, or the
worker dies, between the two, the message is gone: persistence cannot help, the pop itself was
persisted. A batch job would then wait forever for that line.

The submitter keeps a copy of every line's message in the job's ``pending`` ledger until the line
is recorded (``batchery.jobs.store``). A line is lost when the job is ``in_progress`` and the line is still
pending, but its queue is empty (no copy waits there), no worker holds its message unacknowledged,
and no worker has a live lease on it. The check runs twice, a moment apart, so a message caught
between ``BRPOP`` and its ``unacked`` record is not taken for lost. A lost line's message is queued
again with a fresh delivery tag; should the original turn up after all, the line is claimed and
recorded once (``JobStore.claim``/``write``), so a false alarm costs a duplicate run, never a
duplicate record.

``Client.wait_batch`` (and so ``batchery batch wait`` and ``batchery run``) calls ``requeue_lost``
when a job has made no progress for a while. Needs a Redis broker (the ledger holds raw kombu
messages)."""

from __future__ import annotations

import json
import logging
import time
import uuid

from batchery.broker.queues import queue_key, queue_keys

log = logging.getLogger("batchery.recover")

CONFIRM_S = 1.0  # the second look, to let a message in flight between BRPOP and unacked land


def held_lines(broker, queue: str, job_id: str) -> set[int]:
    """Lines of ``job_id`` whose messages some worker holds unacknowledged (kombu's ``unacked``)."""
    prefix = f"{job_id}-"
    lines = set()
    for _tag, raw in broker.hscan_iter("unacked", count=1000):
        try:
            message, _exchange, routing_key = json.loads(raw)
            task_id = (message.get("headers") or {}).get("id") or ""
        except (ValueError, TypeError, AttributeError):
            continue
        if routing_key == queue and task_id.startswith(prefix):
            try:
                lines.add(int(task_id[len(prefix) :]))
            except ValueError:
                pass
    return lines


def _candidates(store, broker, job_id: str, queue: str) -> set[int]:
    if store.get_status(job_id) != "in_progress":
        return set()
    if any(broker.llen(k) for k in queue_keys(queue)):
        return set()  # messages still wait in the queue: nothing can be called lost yet
    pending = store.pending_lines(job_id)
    if not pending:
        return set()
    return pending - store.leased_lines(job_id) - held_lines(broker, queue, job_id)


def find_lost(store, broker, job_id: str, queue: str, confirm_s: float = CONFIRM_S) -> set[int]:
    """Lines of the job that nothing will ever run (see the module docstring)."""
    first = _candidates(store, broker, job_id, queue)
    if not first:
        return set()
    time.sleep(confirm_s)
    return first & _candidates(store, broker, job_id, queue)


def requeue_lost(store, broker, job_id: str, queue: str, confirm_s: float = CONFIRM_S) -> int:
    """Queue again the messages of the job's lost lines; returns how many."""
    lost = sorted(find_lost(store, broker, job_id, queue, confirm_s))
    if not lost:
        return 0
    messages = store.pending_messages(job_id, lost)
    with broker.pipeline(transaction=False) as p:
        for raw in messages.values():
            msg = json.loads(raw)
            msg["properties"]["delivery_tag"] = str(uuid.uuid4())
            p.lpush(queue_key(queue, msg["properties"].get("priority") or 0), json.dumps(msg))
        p.execute()
    log.warning(
        "batch job %s: the messages of %d lines were lost by the broker (a Redis restart or a worker "
        "death between taking a message and recording it); queued them again: lines %s",
        job_id,
        len(messages),
        ", ".join(map(str, list(messages)[:20])) + (" ..." if len(messages) > 20 else ""),
    )
    return len(messages)
