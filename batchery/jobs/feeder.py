"""Feeding big jobs on: the workers' side of a job whose submitter handed it off, or died.

A job with more lines than its window (``batchery.jobs.submit``) has a copy of its input in the store
(``BATCHERY_STORAGE_URL``) and keeps at most a window of lines queued or running. Whoever holds its lease (the
submitter's token, kept alive by heartbeats) feeds it: reads on, validates, records a window of lines, queues them,
waits for room. A submitter that only submits (``batchery batch submit``, ``batchery run``) hands the lease off once
the first window is queued (``JobStore.hand_off``: its heartbeat is zeroed and the job joins the hand-off set), and
returns.

Every worker runs ``Feeders.tick`` every second: for each job of the hand-off set on its queue that is still
``validating`` and whose lease is free (zeroed, or no heartbeat for ``BATCHERY_BATCH__FEEDER_LEASE_S``: its holder
died), it takes the lease (``JobStore.take_over``, atomic: of several workers one wins, and a holder that was only
stalled is fenced off) and feeds the job on from the store in a thread of its own (``Submitter.resume``: the
recorded lines are skipped, lines recorded but never queued are queued again, the rest is fed window by window).
When the job is fed (``in_progress``) or stopped, the input's copy is deleted and the job leaves the set. An input
that is not in this worker's store fails the job with ``input_unreadable`` and a message naming the setting: the
submitter and the workers must share one store."""

from __future__ import annotations

import logging
import threading
import uuid

from batchery.broker import presence
from batchery.jobs.storage import FileStorage, StorageError, open_storage
from batchery.jobs.store import JobNotFound, JobStore
from batchery.jobs.submit import Submitter, window_size

log = logging.getLogger("batchery.feeder")

INPUT_UNREADABLE = "input_unreadable"


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Feeders:
    """One worker's feeders: ``tick`` takes over the jobs that need one; each feeds in a thread of its own."""

    def __init__(self, store: JobStore, broker, app, settings) -> None:
        self.store = store
        self.broker = broker
        self.app = app
        self.settings = settings
        self.queue = str(settings.queue)
        self.stale_s = settings.batch.feeder_lease_s
        self._storage: FileStorage | None = None
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def storage(self) -> FileStorage:
        if self._storage is None:
            self._storage = open_storage(self.settings.storage_url)
        return self._storage

    def feeding(self) -> list[str]:
        """The jobs this worker feeds now."""
        with self._lock:
            return [j for j, t in self._threads.items() if t.is_alive()]

    def tick(self) -> int:
        """Take over every job on this worker's queue that needs a feeder; returns how many were taken."""
        taken = 0
        now = None
        for job in self.store.handed_off():
            with self._lock:
                t = self._threads.get(job)
                if t is not None and t.is_alive():
                    continue
            status, queue, beat, key = self.store.r.hmget(
                self.store.key(job), ["status", "queue", "submit_beat", "input_key"]
            )
            if status is None or _s(status) != "validating" or not key:
                self.store.unhand(job)  # fed, stopped or gone: nothing to take over
                continue
            if _s(queue) != self.queue:
                continue
            now = now if now is not None else self.store.server_time()
            if now - float(_s(beat or b"0") or 0) <= self.stale_s:
                continue  # its holder is alive
            thread = threading.Thread(
                target=self._feed, args=(job, _s(key)), name=f"batchery-feeder-{job[-8:]}", daemon=True
            )
            with self._lock:
                self._threads[job] = thread
            thread.start()
            taken += 1
        return taken

    def _feed(self, job: str, key: str) -> None:
        try:
            try:
                path = self.storage().local_path(key)
                readable = path is not None and path.is_file()
            except StorageError as exc:
                path, readable, why = None, False, str(exc)
            else:
                why = f"not in this worker's store ({self.settings.storage_url})"
            if not readable:
                self._fail_unreadable(job, key, why)
                return
            live = presence.workers(self.broker).get(self.queue)
            submitter = Submitter(
                self.store, self.broker, self.app, self.settings, window=window_size(self.settings, live)
            )
            log.debug("job %s: its feeder lease is free; taking it over", job)
            if submitter.resume(job, path, stale_s=self.stale_s):
                log.info("job %s: this worker fed it on from the store (%d lines)", job, submitter.total)
        except JobNotFound:
            pass
        except Exception:  # noqa: BLE001 - a feeder's failure must not take the worker down; the lease lapses
            log.exception("job %s: feeding failed; another feeder takes over once its lease lapses", job)
        finally:
            self._done(job, key)

    def _done(self, job: str, key: str) -> None:
        """The input's copy goes once the job no longer needs a feeder (fed, stopped or gone)."""
        try:
            status = self.store.get_status(job)
            if status != "validating":
                self.store.unhand(job)
                if self._storage is not None:
                    self._storage.delete(key)
        except Exception as exc:  # noqa: BLE001
            log.warning("job %s: could not tidy its input up (%s)", job, exc)

    def _fail_unreadable(self, job: str, key: str, why: str) -> None:
        token = uuid.uuid4().hex
        if self.store.take_over(job, self.stale_s, token) is None:
            return
        message = (
            f"the job's input ({key}) is {why}: the submitter and the workers must share one store "
            "(BATCHERY_STORAGE_URL: a directory both see, a volume in compose)"
        )
        log.error("job %s: %s", job, message)
        self.store.end_submit(
            job, None, None, [{"code": INPUT_UNREADABLE, "message": message, "line": None}], token=token
        )
