"""The worker's side of a job's status: "should this job's lines stop?", answered from a cache that one
background thread refreshes for every job asked about, so a task thread never waits on Redis."""

from __future__ import annotations

import logging
import threading
import time

from batchery.jobs.store import STOPPED_STATUSES, JobStore

log = logging.getLogger("batchery.jobs")


class JobWatch:
    """Worker side: "should this job's lines stop?" (cancelled, failed or gone), answered at once from a per-job
    cache. A background thread refreshes the cache every ``interval`` seconds with one pipelined read for every
    job asked about in the last ``forget_s``, so hundreds of waiting task threads cost one round trip per
    interval, and a paused or unreachable Redis never blocks a task thread: the last known answer holds
    (a job not known yet counts as running), and the request's own deadline still fires on time."""

    def __init__(self, store: JobStore, interval: float = 0.5, forget_s: float = 60.0) -> None:
        self.store = store
        self.interval = interval
        self.forget_s = forget_s
        self._lock = threading.Lock()
        self._status: dict[str, str | None] = {}  # job -> last status read (None: no such job)
        self._asked: dict[str, float] = {}  # job -> when it was last asked about (monotonic)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def stopped(self, job_id: str) -> bool:
        """Whether the job's lines must stop, as last read (never waits on Redis)."""
        with self._lock:
            self._asked[job_id] = time.monotonic()
            known = job_id in self._status
            status = self._status.get(job_id)
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="batchery-job-watch", daemon=True)
                self._thread.start()
        if not known:
            self._wake.set()  # a job seen for the first time: read it now, not at the next tick
            return False
        return status is None or status in STOPPED_STATUSES

    def known(self, job_id: str) -> bool:
        """Whether the job's status has been read at least once."""
        with self._lock:
            return job_id in self._status

    def close(self) -> None:
        """Stop the refresh thread (tests; a worker's watch lives as long as the process)."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._closed.is_set():
                return
            now = time.monotonic()
            with self._lock:
                for job, asked in list(self._asked.items()):
                    if now - asked > self.forget_s:
                        del self._asked[job]
                        self._status.pop(job, None)
                jobs = list(self._asked)
            if not jobs:
                continue
            try:
                statuses = self.store.get_statuses(jobs)
            except Exception as exc:  # noqa: BLE001 - Redis hiccup: the last answers hold; the deadlines still do
                if not self._failing:
                    log.warning("cannot read batch job statuses (%s); cancel checks use the last known state", exc)
                    self._failing = True
                continue
            if self._failing:
                log.warning("batch job statuses readable again")
                self._failing = False
            with self._lock:
                for job, status in zip(jobs, statuses):
                    if job in self._asked:
                        self._status[job] = status
