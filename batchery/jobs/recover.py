"""Find and re-queue batch lines whose task message the broker lost.

kombu's Redis transport takes a message off the queue with ``BRPOP`` and only then records it in
its ``unacked`` hash (which is what brings it back after a worker dies). If Redis restarts, or the
worker dies, between the two, the message is gone: persistence cannot help, the pop itself was
persisted. A batch job would then wait forever for that line.

The submitter keeps a copy of every line's message in the job's ``pending`` ledger until the line is
recorded (``batchery.jobs.store``). A line is lost when the job is ``in_progress`` and the line is still
pending, but no copy of its message waits in the queue, no worker holds it unacknowledged, and no worker has
a live lease on it. Each line is looked up in the queue itself (``queued_lines``: a script,
``lua/recovery_queued.lua``, reads the queue's lists a bounded piece at a time and picks out the task ids of
the jobs asked about), so other messages on the queue, of other jobs or of the same one, hide nothing. A
look reads the queue, then ``unacked``, then the leases, then the ledger: the order a message moves in, so
one moving on during the look is still seen in a later place. The look runs twice, a moment apart, so a
message caught between ``BRPOP`` and its ``unacked`` record is not taken for lost. A lost line's message
goes back to the head of its queue with a fresh delivery tag; should the original turn up after all, the
line is claimed and recorded once (``JobStore.claim``/``write``), so a false alarm costs a duplicate run,
never a duplicate record.

Who looks: every worker, one at a time (``RecoveryLock``), every ``BATCHERY_RECOVERY_INTERVAL`` seconds,
at the in-progress jobs of its queue that have recorded no line for that long (``recover_queue``, from
``batchery.worker.background``). A job nobody watches completes. ``Client.wait_batch`` (and so ``batchery batch
wait`` and ``batchery run``) also calls ``requeue_lost`` when a job has made no progress for a while, for
workers that do not recover (the interval set to 0, or older versions). Needs a Redis broker (the ledger holds
raw kombu messages)."""

from __future__ import annotations

import json
import logging
import time
import uuid

from batchery.broker import affinity
from batchery.broker.queues import queue_key, queue_keys
from batchery.contract.names import CHUNK_JOB_HEADER, CHUNK_LINES_HEADER
from batchery.jobs import lua

log = logging.getLogger("batchery.recover")

CONFIRM_S = 1.0  # the second look, to let a message in flight between BRPOP and unacked land
SCAN_MAX_MESSAGES = 1000  # messages one script call reads
SCAN_MAX_BYTES = 8 << 20  # and bytes: each call holds Redis for a few milliseconds, whatever the queue
SCAN_MAX_CALLS = 10_000  # calls per list and look: a list growing faster than it is read is left for later
MAX_JOBS_PER_ROUND = 50  # quiet jobs a recovery round looks at
LOCK_PREFIX = "batchery:recovery"


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RecoveryLock:
    """The right to recover ``queue``'s jobs, for one worker at a time: a Redis key holding a token, taken with
    ``SET NX PX`` and kept by its holder while it goes on (``acquire`` again, ``extend``); released only by its
    holder (compare-and-delete), or it expires ``ttl_s`` after the holder was last heard of."""

    def __init__(self, broker, queue: str, ttl_s: float) -> None:
        self.r = broker
        self.key = f"{LOCK_PREFIX}:{queue}"
        self.token = uuid.uuid4().hex
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._acquire = broker.register_script(lua.load("recovery_lock_acquire"))
        self._extend = broker.register_script(lua.load("recovery_lock_extend"))
        self._release = broker.register_script(lua.load("recovery_lock_release"))

    def acquire(self) -> bool:
        return bool(self._acquire(keys=[self.key], args=[self.token, self.ttl_ms]))

    def extend(self) -> bool:
        """Whether this holder still has the lock (now for another ``ttl_s``)."""
        return bool(self._extend(keys=[self.key], args=[self.token, self.ttl_ms]))

    def release(self) -> None:
        self._release(keys=[self.key], args=[self.token])


def queued_lines(broker, queue: str, jobs: list[str]) -> dict[str, set[int]] | None:
    """The lines of each of ``jobs`` whose messages wait in ``queue`` (any priority) or in the direct queue of one
    of its workers (prefix affinity forwards a line there: ``batchery.broker.affinity``); None if a list could not
    be read to its end (it grew faster than it was read)."""
    found: dict[str, set[int]] = {j: set() for j in jobs}
    if not jobs:
        return found
    script = broker.register_script(lua.load("recovery_queued"))
    keys = list(queue_keys(queue))
    for host in sorted(broker.smembers(affinity.registry_key(queue))):
        keys += queue_keys(affinity.direct_queue(queue, _s(host)))
    for key in keys:
        start = 0
        for _ in range(SCAN_MAX_CALLS):
            nxt, length, pairs = script(keys=[key], args=[start, SCAN_MAX_MESSAGES, SCAN_MAX_BYTES, *jobs])
            for i in range(0, len(pairs), 2):
                found[_s(pairs[i])].add(int(pairs[i + 1]))
            if int(nxt) >= int(length):
                break
            start = int(nxt)
        else:
            return None
    return found


def held_lines(broker, jobs: list[str]) -> dict[str, set[int]]:
    """The lines of each of ``jobs`` whose messages some worker holds unacknowledged (kombu's ``unacked``)."""
    found: dict[str, set[int]] = {j: set() for j in jobs}
    needles = [j.encode() for j in jobs]
    for _tag, raw in broker.hscan_iter("unacked", count=1000):
        if not any(n in raw for n in needles):
            continue
        try:
            headers = json.loads(raw)[0].get("headers") or {}
            task_id = str(headers.get("id") or "")
            chunk_job = str(headers.get(CHUNK_JOB_HEADER) or "")
            chunk_lines = str(headers.get(CHUNK_LINES_HEADER) or "")
        except (ValueError, TypeError, AttributeError, IndexError, KeyError):
            continue
        if chunk_job in found:  # a chunk (batchery.batch_lines): its lines are in a header
            found[chunk_job].update(int(n) for n in chunk_lines.split(",") if n.isdigit())
            continue
        job, _, line = task_id.rpartition("-")
        if job in found and line.isdigit():
            found[job].add(int(line))
    return found


def _look(store, broker, queue: str, jobs: list[str]) -> dict[str, set[int]]:
    """Lines of ``jobs`` that look lost now: pending, and neither queued, held nor leased."""
    queued = queued_lines(broker, queue, jobs)
    if queued is None:
        return {}
    held = held_lines(broker, jobs)
    out = {}
    for job in jobs:
        if store.get_status(job) != "in_progress":
            continue
        leased = store.leased_lines(job)
        lost = store.pending_lines(job) - queued[job] - held[job] - leased  # the ledger last: see the docstring
        if lost:
            out[job] = lost
    return out


def find_lost_many(store, broker, queue: str, jobs: list[str], confirm_s: float = CONFIRM_S) -> dict[str, set[int]]:
    """The lost lines of each of ``jobs`` (all on ``queue``): those that looked lost twice, ``confirm_s`` apart."""
    first = _look(store, broker, queue, jobs)
    if not first:
        return {}
    time.sleep(confirm_s)
    second = _look(store, broker, queue, list(first))
    return {job: lines & second[job] for job, lines in first.items() if lines & second.get(job, set())}


def find_lost(store, broker, job_id: str, queue: str, confirm_s: float = CONFIRM_S) -> set[int]:
    """Lines of the job that nothing will ever run (see the module docstring)."""
    return find_lost_many(store, broker, queue, [job_id], confirm_s).get(job_id, set())


def push_copies(broker, queue: str, copies: dict, redelivered: bool = False, priority: int = 0) -> int:
    """Push the ledger's copies of lines (raw messages, by line) back at the head of the queue, each with a fresh
    delivery tag, in one round trip; ``redelivered`` flags them delivered before (quarantine then reads their
    strikes). ``priority``: for a copy that names none. Returns how many."""
    out = []
    for raw in copies.values():
        msg = json.loads(raw)
        props = msg.setdefault("properties", {})
        props["delivery_tag"] = str(uuid.uuid4())
        if redelivered:
            msg.setdefault("headers", {})["redelivered"] = True
            props.setdefault("delivery_info", {})["redelivered"] = True
        out.append((queue_key(queue, props.get("priority") or priority), json.dumps(msg)))
    with broker.pipeline(transaction=False) as p:
        for key, msg in out:
            p.rpush(key, msg)  # RPUSH: the end BRPOP takes from (the head); the line has waited long enough
        p.execute()
    return len(out)


def requeue(store, broker, job_id: str, queue: str, lines: list[int]) -> int:
    """Put the ledger's copies of ``lines`` (those still pending) back at the head of the queue, each with a fresh
    delivery tag; returns how many."""
    messages = store.pending_messages(job_id, sorted(lines))
    if not messages:
        return 0
    push_copies(broker, queue, messages)
    log.warning(
        "batch job %s: the messages of %d lines were lost by the broker (a Redis restart or a worker "
        "death between taking a message and recording it); queued them again: lines %s",
        job_id,
        len(messages),
        ", ".join(map(str, list(messages)[:20])) + (" ..." if len(messages) > 20 else ""),
    )
    return len(messages)


def requeue_lost(store, broker, job_id: str, queue: str, confirm_s: float = CONFIRM_S) -> int:
    """Queue again the messages of the job's lost lines; returns how many."""
    lost = find_lost(store, broker, job_id, queue, confirm_s)
    return requeue(store, broker, job_id, queue, sorted(lost)) if lost else 0


def recover_queue(
    store,
    broker,
    queue: str,
    lock: RecoveryLock,
    quiet_s: float,
    max_jobs: int = MAX_JOBS_PER_ROUND,
    confirm_s: float = CONFIRM_S,
) -> int:
    """One recovery round for ``queue``, if this caller holds (or takes) ``lock``: the lost lines of the
    in-progress jobs on the queue that have recorded no line for ``quiet_s`` seconds, queued again. Returns how
    many lines; 0 without the lock."""
    if not lock.acquire():
        return 0
    jobs = store.quiet_jobs(queue, quiet_s, max_jobs)
    if not jobs:
        return 0
    lost = find_lost_many(store, broker, queue, jobs, confirm_s)
    n = 0
    for job, lines in lost.items():
        if not lock.extend():  # the round outlived the lock and another worker took over: it decides now
            break
        n += requeue(store, broker, job, queue, sorted(lines))
    return n
