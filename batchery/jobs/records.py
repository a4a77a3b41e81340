"""A job's records between Redis and the file store: drained in sorted runs while it runs, read back merged in
input order.

A line's record is written once into the job's ``results`` hash in Redis (``JobStore.write``: the line's bit in the
``done`` bitmap is set in the same script, and that bit, not the hash, is what makes a redelivered line find its
record). A job that holds ``BATCHERY_BATCH__DRAIN_AT`` records in Redis joins the drain set; every worker runs
``Drainers.tick`` each second, and one of them at a time per job (a lock with a token, ``{job}:draining``) moves
the records out:

1. it reads up to ``DRAIN_MAX`` records from the hash (records are immutable once written);
2. writes them, sorted by line, as one **run** in the store: ``{job}.records.{seq}.{token}.jsonl``, one
   ``line<TAB>record`` a line, written to a temporary name, fsynced and renamed, so a run is whole or absent;
3. ``drain_commit`` (one script, fenced by the lock's token and the run's sequence number): the run joins the
   job's ``runs`` list and its lines leave the hash. Only while the job has not ended, so once it has, the layout
   of its records (runs plus what is left in Redis: about ``drain_at`` and a second of records) never changes again.

A drainer that dies between 2 and 3 leaves a run no list names (its token is in the name, so another drainer's run
of the same sequence number never overwrites it): readers never open it. Every ``SWEEP_EVERY_S`` each worker's
``sweep`` deletes the runs no job needs any more: those of jobs gone from Redis (expired after their TTL, deleted),
and those no list names of jobs that have ended. A drainer that stalls past its lock's lifetime is refused at 3
and deletes its run.

**Reading** (``iter_records``): one snapshot (``MULTI``) of the runs list and of the hash's line numbers, then a
k-way merge by line number of the runs and the records left in Redis. Runs are sorted and, since a job is fed a
window at a time, nearly disjoint: the merge opens a run only when the lines it yields reach the run's first line
and closes it at its end, so a reader holds a handful of files and one line of each, whatever the job's size.
Records of a job that is still running are a best-effort view (a record drained after the snapshot is skipped);
an ended job's are exact."""

from __future__ import annotations

import heapq
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator

from batchery.jobs.storage import FileStorage, StorageError, open_storage

log = logging.getLogger("batchery.records")

DRAIN_MAX = 16384  # records one run takes at most
SWEEP_EVERY_S = 600.0  # how often a worker looks for runs no job needs any more
DRAIN_LOCK_S = 60.0  # a drainer's lock; a dead one's lapses
HMGET_CHUNK = 1000
ENDED = frozenset({"completed", "failed", "cancelled", "expired"})


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def run_name(job_id: str, seq: int, token: str) -> str:
    return f"{job_id}.records.{seq:06d}.{token[:12]}.jsonl"


def parse_run(entry) -> tuple[str, int, int, int]:
    """A runs-list entry: ``(name, first line, last line, records)``."""
    name, first, last, count = _s(entry).split(" ")
    return name, int(first), int(last), int(count)


def _run_lines(storage: FileStorage, name: str) -> Iterator[tuple[int, bytes]]:
    try:
        f = storage.open(name)
    except FileNotFoundError:
        raise StorageError(
            f"a run of records ({name}) is missing from the store: the job's readers and its workers must share "
            "one store (BATCHERY_STORAGE_URL: a directory all of them see, a volume in compose)"
        ) from None
    with f:
        for raw in f:
            line, _, record = raw.rstrip(b"\n").partition(b"\t")
            yield int(line), record


def merge(sources: list[tuple[int, Callable[[], Iterable[tuple[int, bytes]]]]]) -> Iterator[tuple[int, bytes]]:
    """Merge sorted ``(line, record)`` streams by line; ``sources`` are ``(first line, open)`` pairs. A stream is
    opened only when the merge reaches its first line, so nearly disjoint streams are open a few at a time. A line
    met twice is yielded once."""
    sources = sorted(sources, key=lambda s: s[0])
    heap: list = []
    nxt, last = 0, None

    def push(idx: int, it: Iterator) -> None:
        item = next(it, None)
        if item is not None:
            heapq.heappush(heap, (item[0], idx, item[1], it))

    while True:
        while nxt < len(sources) and (not heap or sources[nxt][0] <= heap[0][0]):
            push(nxt, iter(sources[nxt][1]()))
            nxt += 1
        if not heap:
            return
        line, idx, record, it = heapq.heappop(heap)
        if line != last:
            yield line, record
            last = line
        push(idx, it)


def iter_records(store, job_id: str, storage=None, chunk: int = HMGET_CHUNK) -> Iterator[dict]:
    """The job's records in input order (see the module docstring). ``storage`` (a ``FileStorage``, or a function
    that opens one) is needed only once the job has runs in the store (``StorageError`` without it)."""
    keys = store._k(job_id)
    with store.r.pipeline(transaction=True) as p:
        p.hget(keys[0], "status")
        p.lrange(keys[5], 0, -1)
        p.hkeys(keys[1])
        status, runs, left = p.execute()
    if status is None:
        store._check_exists(job_id)
    runs = [parse_run(e) for e in runs]
    if runs and callable(storage) and not hasattr(storage, "open"):
        storage = storage()  # opened only for a job that has runs
    if runs and storage is None:
        raise StorageError(
            f"{sum(r[3] for r in runs)} records of {job_id} are in the file store, and none is configured here "
            "(BATCHERY_STORAGE_URL)"
        )
    left = sorted(int(_s(n)) for n in left)

    def from_redis() -> Iterator[tuple[int, bytes]]:
        for i in range(0, len(left), chunk):
            lines = left[i : i + chunk]
            for n, raw in zip(lines, store.r.hmget(keys[1], [str(n) for n in lines])):
                if raw is not None:  # drained since the snapshot (a running job): it is in a newer run
                    yield n, raw

    sources: list = [(first, (lambda name=name: _run_lines(storage, name))) for name, first, _, _ in runs]
    if left:
        sources.append((left[0], from_redis))
    for _, record in merge(sources):
        yield json.loads(record)


def write_run(storage: FileStorage, name: str, items: list[tuple[int, bytes]]) -> None:
    """One run, whole or not at all (``items`` sorted by line)."""

    def chunks() -> Iterator[bytes]:
        buf: list[bytes] = []
        size = 0
        for line, record in items:
            piece = b"%d\t%s\n" % (line, record)
            buf.append(piece)
            size += len(piece)
            if size >= 1 << 20:
                yield b"".join(buf)
                buf, size = [], 0
        if buf:
            yield b"".join(buf)

    storage.write_stream(name, chunks())


class Drainers:
    """One worker's drainers: ``tick`` moves the records of the jobs of its queue that hold ``drain_at`` records in
    Redis to the file store (see the module docstring)."""

    def __init__(self, store, settings, storage: FileStorage | None = None, limit: int = DRAIN_MAX) -> None:
        self.store = store
        self.queue = str(settings.queue)
        self.storage_url = settings.storage_url
        self._storage = storage
        self.limit = int(limit)
        self._unlock = store._unlock
        self._warned = False
        self._lock = threading.Lock()
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S * random.uniform(0.1, 1.0)

    def storage(self) -> FileStorage:
        if self._storage is None:
            self._storage = open_storage(self.storage_url)
        return self._storage

    def tick(self) -> int:
        """Drain each due job of this worker's queue once (and now and then sweep); returns the records moved."""
        moved = 0
        with self._lock:  # one tick at a time in this process
            now = time.monotonic()
            if now >= self._next_sweep:
                self._next_sweep = now + SWEEP_EVERY_S * random.uniform(0.8, 1.2)
                try:
                    self.sweep()
                except Exception as exc:  # noqa: BLE001 - a sweep that fails is tried again later
                    log.warning("could not sweep the store's record runs (%s)", exc)
            for job in sorted(_s(j) for j in self.store.r.smembers(self.store.drain_set_key)):
                status, queue = self.store.r.hmget(self.store.key(job), ["status", "queue"])
                if status is None or _s(status) in ENDED:
                    self.store.r.srem(self.store.drain_set_key, job)
                    continue
                if _s(queue) != self.queue:
                    continue
                try:
                    storage = self.storage()
                except StorageError as exc:
                    if not self._warned:
                        log.error("records cannot go to the store, they stay in Redis: %s", exc)
                        self._warned = True
                    return moved
                moved += self.drain(job, storage)
        return moved

    def sweep(self) -> int:
        """Delete the runs in the store that no job needs: a job gone from Redis needs none, an ended job only those
        its list names (a running job's unlisted run may be a drainer's about to commit: it stays). Returns how many
        were deleted."""
        storage = self.storage()
        lister = getattr(storage, "list_keys", None)
        if lister is None:  # a store that cannot list (an object store's lifecycle rules do this there)
            return 0
        by_job: dict[str, list[str]] = {}
        for name in lister("batch_*.records.*.jsonl"):
            by_job.setdefault(name.split(".records.", 1)[0], []).append(name)
        deleted = 0
        for job, names in by_job.items():
            keys = self.store._k(job)
            with self.store.r.pipeline(transaction=True) as p:
                p.hget(keys[0], "status")
                p.lrange(keys[5], 0, -1)
                status, listed = p.execute()
            if status is not None and _s(status) not in ENDED:
                continue
            keep = {parse_run(e)[0] for e in listed} if status is not None else set()
            for name in names:
                if name not in keep and storage.delete(name):
                    deleted += 1
        if deleted:
            log.info("deleted %d runs of records no job needs any more", deleted)
        return deleted

    def drain(self, job: str, storage: FileStorage) -> int:
        """Move up to ``limit`` of ``job``'s records to one run in the store, if no other drainer is at it."""
        lock, token = f"{self.store.key(job)}:draining", uuid.uuid4().hex
        if not self.store.r.set(lock, token, nx=True, px=int(DRAIN_LOCK_S * 1000)):
            return 0
        keys = self.store._k(job)
        name = None
        try:
            seq = int(self.store.r.hget(keys[0], "runs_seq") or 0)
            items: list[tuple[int, bytes]] = []
            cursor = 0
            while len(items) < self.limit:
                cursor, entries = self.store.r.hscan(keys[1], cursor, count=1000)
                items += [(int(_s(k)), v) for k, v in entries.items()]
                if int(cursor) == 0:
                    break
            items = sorted(dict(items).items())[: self.limit]
            if not items:
                return 0
            name = run_name(job, seq, token)
            write_run(storage, name, items)
            entry = f"{name} {items[0][0]} {items[-1][0]} {len(items)}"
            answer = _s(
                self.store._drain_commit(
                    keys=keys + [lock, self.store.drain_set_key],
                    args=[token, seq, entry, self.store.drain_at, job] + [str(n) for n, _ in items],
                )
            )
            if answer != "committed":
                log.info("job %s: run %d of its records not committed (%s)", job, seq, answer)
                storage.delete(name)
                return 0
            log.debug("job %s: %d records moved to the store (%s)", job, len(items), name)
            return len(items)
        finally:  # a run whose commit's outcome is unknown stays (it may be listed); sweep() removes orphans
            self._unlock(keys=[lock], args=[token])
