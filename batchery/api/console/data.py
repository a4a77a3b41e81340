"""What the web console shows, read from the job store, the API's batches and the workers' presence: job rows,
a job's detail (its failures and its counts over time), the workers and their queues.

**Counts over time.** The job store keeps a job's counts, not their history, so the console samples them: a Redis
list per job, ``{p}:console:series:{job id}``, of ``[t, completed, failed, completion tokens]`` points on the Redis
server's clock. A point is added when the console reads the job and by a sampler thread (every ``SAMPLE_EVERY_S``,
the active jobs among the newest ``SAMPLE_SCAN``), at most one per ``min_gap`` (1 s, growing with the job's age so
a long job keeps about ``MAX_POINTS`` points), checked in one Lua script so API replicas never add two. An ended
job gets one last point and no more. The list expires with the job (``BATCHERY_BATCH__TTL``)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from batchery.api.auth import Tenant
from batchery.api.batches import Batches, batches_of
from batchery.api.console.session import Viewer
from batchery.api.errors import APIError
from batchery.api.state import ApiState
from batchery.broker import presence
from batchery.broker.queues import queue_keys
from batchery.contract.schemas import BatchJob
from batchery.jobs.store import JobNotFound

log = logging.getLogger("batchery.api.console")

MAX_JOBS = 5000  # jobs a viewer's list (and a status filter) looks through, newest first
PAGE_SIZE = 25
SAMPLE_EVERY_S = 2.0
SAMPLE_SCAN = 200  # the sampler looks at the newest jobs only
MAX_POINTS = 500
MAX_FAILURE_SCAN = 50_000  # records a job page reads for its failure codes
EXAMPLES_PER_CODE = 3
FAILURES_CACHE_S = 5.0  # a running job's failure summary is read again at most this often
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
BAD_ENGINE_STATES = ("failed", "rebuilding")
ENDS = ("completed_at", "failed_at", "cancelled_at", "expired_at")
TRANSITIONS = (
    "created_at",
    "in_progress_at",
    "started_at",
    "finalizing_at",
    "cancelling_at",
    "completed_at",
    "failed_at",
    "cancelled_at",
    "expired_at",
)

# KEYS: the job's series   ARGV: t, min gap (s), point JSON, max points, ttl, ended ('1'/'0')
# Appends the point unless the last one is younger than the gap (or, for an ended job, holds the same counts).
_SAMPLE = """
local last = redis.call('LINDEX', KEYS[1], -1)
if last then
  local lt = tonumber(string.match(last, '^%[([^,]+),'))
  if ARGV[6] == '1' and string.match(last, ',(.*)$') == string.match(ARGV[3], ',(.*)$') then return 0 end
  if ARGV[6] ~= '1' and lt and tonumber(ARGV[1]) - lt < tonumber(ARGV[2]) then return 0 end
end
redis.call('RPUSH', KEYS[1], ARGV[3])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[4]), -1)
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


@dataclass
class JobRow:
    """One job as the console shows it."""

    id: str
    status: str  # the API's view of it for an API batch (finalizing until its files are written)
    endpoint: str | None
    model: str | None
    queue: str
    total: int
    completed: int
    failed: int
    tokens_per_s: float | None  # completion tokens per second since its first line started
    eta_s: float | None  # at the rate so far; None when it is not running
    age_s: float
    metadata: dict[str, Any]
    job: BatchJob
    output_file_id: str | None = None
    error_file_id: str | None = None
    tenant: str | None = None  # an API batch's owner

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def pct_completed(self) -> float:
        return 100.0 * self.completed / self.total if self.total else 0.0

    @property
    def pct_failed(self) -> float:
        return 100.0 * self.failed / self.total if self.total else 0.0

    @property
    def active(self) -> bool:
        return self.status in ACTIVE


@dataclass
class Failures:
    """A job's line failures: counts by code and a few examples of each."""

    counts: list[tuple[str, int]]  # most frequent first
    examples: dict[str, list[dict[str, Any]]]  # code -> [{line, custom_id, message}]
    scanned: int
    truncated: bool  # more records than MAX_FAILURE_SCAN


@dataclass
class WorkerRow:
    hostname: str
    host: str
    pid: Any
    model: str
    state: str
    batch_size: float | None
    kv_used_pct: float | None
    steps_per_s: float | None
    restarts: int | None
    heartbeat_age_s: float | None
    last_error: str | None

    @property
    def bad(self) -> bool:
        return self.state in BAD_ENGINE_STATES


@dataclass
class QueueRow:
    name: str
    depth: int | None  # messages waiting (every priority); None when the broker is not Redis
    workers: list[WorkerRow] = field(default_factory=list)


class Console:
    """The console's reads and its sampler, one per app (``console_of``)."""

    def __init__(self, st: ApiState) -> None:
        self.state = st
        self.batches: Batches = batches_of(st)
        self.store = self.batches.store
        self.r = self.store.r
        self.broker = self.batches.broker
        self.prefix = st.settings.api.key_prefix
        self._sample = self.r.register_script(_SAMPLE)
        self._failures: dict[str, tuple[float, tuple[int, int], Failures]] = {}
        self._lock = threading.Lock()
        self.active_queues: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sampler, name="batchery-console-sampler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # -- jobs -----------------------------------------------------------------------------------------------
    def job_ids(self, viewer: Viewer) -> list[str]:
        """The ids of the jobs ``viewer`` may see, newest first (at most ``MAX_JOBS``)."""
        index = self.store.index_key if viewer.operator else self.batches.index_key(viewer.tenant)
        return [_s(i) for i in self.r.zrevrange(index, 0, MAX_JOBS - 1)]

    def page(self, viewer: Viewer, status: str | None, page: int) -> tuple[list[JobRow], int]:
        """One page of the viewer's jobs (with ``status`` only, if given) and the number of pages."""
        ids = self.job_ids(viewer)
        if status:
            ids = [i for i, s in zip(ids, self.store.get_statuses(ids)) if s == status]
        pages = max(1, -(-len(ids) // PAGE_SIZE))
        page = min(max(page, 1), pages)
        rows = [row for i in ids[(page - 1) * PAGE_SIZE : page * PAGE_SIZE] if (row := self.row(viewer, i))]
        return rows, pages

    def row(self, viewer: Viewer, job_id: str) -> JobRow | None:
        """The job as ``viewer`` may see it; None when it may not (or it is gone): to the viewer, the same."""
        meta = self._meta(job_id)
        if not viewer.operator and (meta is None or meta.get("tenant") != viewer.tenant):
            return None
        view: dict[str, Any] = {}
        if meta is not None:
            try:  # the API's own read: it enforces the window and writes an ended batch's files
                view = self.batches.retrieve(Tenant(meta["tenant"]), job_id)
            except APIError:
                return None
        try:
            job = self.store.status(job_id, repair=False)
        except JobNotFound:
            return None
        now = self.store.server_time()
        self.sample(job, now)
        return _row(job, meta, view, now)

    def _meta(self, job_id: str) -> dict[str, str] | None:
        raw = self.r.hgetall(self.batches.meta_key(job_id)) if job_id.startswith("batch_") else {}
        return {_s(k): _s(v) for k, v in raw.items()} or None

    def cancel(self, viewer: Viewer, job_id: str) -> bool:
        """Cancel as ``POST /v1/batches/{id}/cancel`` does; False when the viewer may not see the job."""
        row = self.row(viewer, job_id)
        if row is None:
            return False
        if row.tenant is not None:
            self.batches.cancel(Tenant(row.tenant), job_id)
        else:
            self.store.cancel(job_id)
        return True

    # -- a job's detail -------------------------------------------------------------------------------------
    def failures(self, job: BatchJob) -> Failures:
        counts = (job.request_counts.completed, job.request_counts.failed)
        with self._lock:
            hit = self._failures.get(job.id)
        if hit is not None and hit[1] == counts and (job.is_terminal or time.monotonic() - hit[0] < FAILURES_CACHE_S):
            return hit[2]
        found: Counter[str] = Counter()
        examples: dict[str, list[dict[str, Any]]] = {}
        scanned = 0
        truncated = False
        if job.request_counts.failed:
            for rec in self.records(job.id):
                scanned += 1
                if scanned > MAX_FAILURE_SCAN:
                    truncated = True
                    break
                err = rec.get("error")
                if not isinstance(err, dict):
                    continue
                code = str(err.get("code") or "error")
                found[code] += 1
                ex = examples.setdefault(code, [])
                if len(ex) < EXAMPLES_PER_CODE:
                    ex.append(
                        {"line": err.get("line"), "custom_id": rec.get("custom_id"), "message": err.get("message")}
                    )
        result = Failures(found.most_common(), examples, min(scanned, MAX_FAILURE_SCAN), truncated)
        with self._lock:
            self._failures[job.id] = (time.monotonic(), counts, result)
            if len(self._failures) > 256:
                self._failures.pop(next(iter(self._failures)))
        return result

    def records(self, job_id: str) -> Iterator[dict[str, Any]]:
        """The job's records in input order, those the workers moved to the file store included (the client's)."""
        return self.batches.client.batch_results(job_id)

    def series(self, job_id: str) -> dict[str, list[float]]:
        """The job's sampled points as columns: time, completed, failed, tokens/s (between points)."""
        t: list[float] = []
        completed: list[float] = []
        failed: list[float] = []
        tps: list[float] = []
        prev = None
        for raw in self.r.lrange(self._series_key(job_id), 0, -1):
            try:
                p = [float(x) for x in json.loads(raw)]
            except (ValueError, TypeError):
                continue
            t.append(p[0])
            completed.append(p[1])
            failed.append(p[2])
            tps.append(0.0 if prev is None or p[0] <= prev[0] else max(p[3] - prev[3], 0.0) / (p[0] - prev[0]))
            prev = p
        return {"t": t, "completed": completed, "failed": failed, "tokens_per_s": tps}

    def _series_key(self, job_id: str) -> str:
        return f"{self.prefix}:console:series:{job_id}"

    def sample(self, job: BatchJob, now: float) -> None:
        """Add a point to the job's series (see the module docstring)."""
        rc = job.request_counts
        point = json.dumps([round(now, 3), rc.completed, rc.failed, job.usage.completion_tokens])
        gap = max(1.0, (now - job.created_at) / MAX_POINTS)
        ttl = max(int(self.store.ttl), 60)
        try:
            self._sample(
                keys=[self._series_key(job.id)],
                args=[repr(now), repr(gap), point, MAX_POINTS, ttl, "1" if job.is_terminal else "0"],
            )
        except Exception:  # noqa: BLE001 - a missed point is no reason to fail a page
            log.debug("sampling job %s failed", job.id, exc_info=True)

    def _sampler(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            try:
                ids = [_s(i) for i in self.r.zrevrange(self.store.index_key, 0, SAMPLE_SCAN - 1)]
                statuses = self.store.get_statuses(ids)
                now = self.store.server_time()
                queues = set()
                for i, s in zip(ids, statuses):
                    if s in ACTIVE:
                        try:
                            job = self.store.status(i, repair=False)
                        except JobNotFound:
                            continue
                        queues.add(job.queue)
                        self.sample(job, now)
                self.active_queues = queues
            except Exception:  # noqa: BLE001 - the sampler goes on; Redis may be back next time
                log.debug("the console's sampler failed", exc_info=True)

    # -- workers --------------------------------------------------------------------------------------------
    def workers(self) -> list[QueueRow] | None:
        """Every queue with a live worker or an active job, with its depth and its workers; None when the
        broker is not Redis or does not answer."""
        if self.broker is None:
            return None
        try:
            live = presence.workers(self.broker)
            names = sorted(set(live) | self.active_queues)
            with self.broker.pipeline(transaction=False) as p:
                for q in names:
                    for k in queue_keys(q):
                        p.llen(k)
                lens = p.execute()
        except Exception:  # noqa: BLE001 - shown as "the broker does not answer"
            log.warning("the console could not read the workers from the broker", exc_info=True)
            return None
        per = len(queue_keys("q"))
        now = time.time()
        out = []
        for n, q in enumerate(names):
            rows = [_worker_row(w, now) for w in sorted(live.get(q, []), key=lambda w: str(w.get("hostname")))]
            out.append(QueueRow(q, int(sum(lens[n * per : (n + 1) * per])), rows))
        return out


def _worker_row(w: dict[str, Any], now: float) -> WorkerRow:
    total, used = w.get("kv_blocks_total"), w.get("kv_blocks_used")
    announced = w.get("announced_at")
    return WorkerRow(
        hostname=str(w.get("hostname") or "?"),
        host=str(w.get("host") or "?"),
        pid=w.get("pid"),
        model=str(w.get("model") or "?"),
        state=str(w.get("state") or "unknown"),
        batch_size=_num(w.get("batch_size")),
        kv_used_pct=100.0 * used / total if isinstance(total, int) and isinstance(used, int) and total else None,
        steps_per_s=_num(w.get("steps_per_s")),
        restarts=w.get("num_rebuilds") if isinstance(w.get("num_rebuilds"), int) else None,
        heartbeat_age_s=max(0.0, now - announced) if isinstance(announced, (int, float)) else None,
        last_error=str(w["last_error"]) if w.get("last_error") else None,
    )


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _row(job: BatchJob, meta: dict[str, str] | None, view: dict[str, Any], now: float) -> JobRow:
    rc = job.request_counts
    start = job.started_at or job.in_progress_at
    end = next(
        (getattr(job, f) for f in ("completed_at", "failed_at", "cancelled_at", "expired_at") if getattr(job, f)), None
    )
    elapsed = ((end or now) - start) if start else 0.0
    tps = job.usage.completion_tokens / elapsed if elapsed > 0 else None
    done = rc.completed + rc.failed
    eta = None
    if not job.is_terminal and start and done and rc.total > done and elapsed > 0:
        eta = (rc.total - done) / (done / elapsed)
    return JobRow(
        id=job.id,
        status=str(view.get("status") or job.status),
        endpoint=(meta or {}).get("endpoint") or None,
        model=job.model,
        queue=job.queue,
        total=rc.total,
        completed=rc.completed,
        failed=rc.failed,
        tokens_per_s=tps,
        eta_s=eta,
        age_s=max(0.0, now - job.created_at),
        metadata=view.get("metadata") or dict(job.metadata),
        job=job,
        output_file_id=view.get("output_file_id"),
        error_file_id=view.get("error_file_id"),
        tenant=(meta or {}).get("tenant"),
    )


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


_build_lock = threading.Lock()


def console_of(st: ApiState) -> Console:
    """The app's ``Console``, built on first use (its ``close`` stops the sampler at shutdown)."""
    c = st.extras.get("console")
    if c is None:
        with _build_lock:
            c = st.extras.get("console")
            if c is None:
                c = st.extras["console"] = Console(st)
    return c
