"""Streaming submission of a batch job: read, validate, enqueue, chunk by chunk.

The input is never held whole: lines are read one at a time (an oversized line in bounded pieces),
parsed and validated (``batchery.contract.batch``) into a grouping window. A window's valid lines are put in
order of their prompt's start (``prefix_key``: model, endpoint, tools, then the messages, prompt or instructions
and input), a stable sort, so that lines sharing a long prefix (a document, a few-shot instruction) spread
through the file reach the workers together and the engine computes that prefix once (its prefix cache need
hold one document at a time, not all of them). Then one pipeline records the window's error lines, its task
messages in the ledger and its counts in the job, and ``LPUSH``es put the messages on the queue
(``batchery.broker.publish``), ``chunk_size`` at a time, each with its prefix group (``prefix_group``) in a header,
so that several workers on the queue run a group's lines on one of them (``batchery.broker.affinity``). Outputs
keep their input line number and custom_id, so nothing about the results' order changes. A window is
``chunk_size`` lines at first and then as many as were read before it (the first lines reach the workers at once),
at most ``GROUP_LINES`` lines and ``GROUP_BYTES`` bytes of messages (memory stays bounded). Workers start on the
first window while the rest is still being read; the job is ``validating`` until the last window, then
``in_progress``. A window is recorded as one chunk (every line up to its last is then recorded), so a take-over
(``resume``) skips exactly the recorded lines.

The job fails as a whole (status ``failed``, a job-level error; lines already queued are skipped
and running ones aborted) only when it cannot be a job: no request lines (``empty_file``), more
lines than ``BATCHERY_BATCH__MAX_LINES`` (``too_many_lines``), or the submission itself broke off
(``submission_interrupted``: Ctrl-C, an unreadable file). With ``require_valid`` (the HTTP API, as OpenAI's
Batch API validates a file before it runs it) a file none of whose lines is valid fails too (``no_valid_lines``,
with the first line errors).

A job may have a completion window (``completion_window``, seconds from its creation): lines not started when it
ends are recorded ``batch_expired`` instead of running (``batchery.jobs.store``). With ``endpoint`` (the batch's
endpoint, as in OpenAI's API) a line whose ``url`` is another one is an error line (``unsupported_url``).

``run`` is ``create`` (validate the options, create the ``validating`` job) and then ``submit`` (stream the
input); the HTTP API calls the two apart, so that its create call returns while the file is still being read.
``resume`` goes on with the submission of a job whose submitter died mid-file (an API replica restarted): it takes
the job over (the submitter's token fences the old one off), reads the file again from the start, skips the lines
already recorded (``max_line``) and submits the rest.

A job that vanishes from Redis during the submission (deleted, or Redis flushed or replaced) raises
``JobNotFound``: nothing is written to it any more, so no malformed job is left behind."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from batchery.broker.affinity import PREFIX_HEADER
from batchery.broker.connection import is_redis_url, redis_from_url
from batchery.broker.publish import MessageBuilder
from batchery.contract.batch import (
    UNSUPPORTED_URL,
    BatchLine,
    LineError,
    SeenIds,
    line_error_record,
    parse_line,
    parse_object,
    parse_stream,
)
from batchery.contract.errors import InvalidRequest
from batchery.contract.names import (
    BATCH_LINE_TASK,
    BATCH_LINES_TASK,
    CHUNK_JOB_HEADER,
    CHUNK_LINES_HEADER,
    ENQUEUED_AT_HEADER,
)
from batchery.contract.schemas import check_timeout
from batchery.jobs.grouping import prefix_group, prefix_key
from batchery.jobs.storage import FileStorage, StorageError, open_storage
from batchery.jobs.store import STOPPED_STATUSES, JobNotFound, JobStore, check_window, new_job_id

log = logging.getLogger("batchery.submit")

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
DEFAULT_CHUNK = 1000
GROUP_LINES = 20_000  # the most lines in one grouping window (lines sorted by prefix before they are enqueued)
GROUP_BYTES = 64 << 20  # ... and the most bytes of task messages (and their prefix keys) it holds
FIRST_ERRORS = 10  # line errors a job that fails with no_valid_lines reports
RESUME_AFTER_S = 30.0  # a validating job whose submitter has not beaten for this long may be taken over
ROOM_POLL_S = 0.1  # how often a submitter whose window is full looks at the job's counts
BEAT_S = 5.0  # how often a waiting submitter beats (well inside RESUME_AFTER_S)
COPY_PIECE = 1 << 20  # bytes a copy of the input into the store reads at a time


def window_size(settings, workers: list[dict] | None) -> int:
    """Lines of a job queued or running at once: twice what the live workers on its queue hold in flight (their
    task threads, as each announces), within ``BATCHERY_BATCH__WINDOW_MIN`` and ``__WINDOW_MAX``. No worker seen
    yet: the floor."""
    limits = settings.batch
    in_flight = sum(int(w.get("concurrency") or 0) for w in workers or ())
    return max(limits.window_min, min(limits.window_max, 2 * in_flight))


def input_key(job_id: str) -> str:
    """The store key of a job's input copy."""
    return f"{job_id}.input.jsonl"


def count_newlines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(COPY_PIECE), b""))


def copy_to_storage(storage: FileStorage, key: str, path: Path) -> None:
    """Copy ``path`` into the store under ``key`` (streamed; whole or not at all). ``StorageError`` names the
    problem."""
    try:
        with open(path, "rb") as f:
            storage.write_stream(key, iter(lambda: f.read(COPY_PIECE), b""))
    except OSError as exc:
        raise StorageError(f"cannot copy {path} into the store ({type(exc).__name__}: {exc})") from exc


def check_options(timeout, priority, metadata) -> tuple[float | None, int, dict[str, str]]:
    """Validate the job-level options; raises ``InvalidRequest``."""
    timeout = check_timeout(timeout)
    if priority is None:
        priority = 0
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
        raise InvalidRequest(f"priority must be an integer from 0 (first) to 9 (last), got {priority!r}")
    metadata = dict(metadata or {})
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"at most {MAX_METADATA_PAIRS} metadata pairs, got {len(metadata)}")
    for k, v in metadata.items():
        if (
            not isinstance(k, str)
            or not isinstance(v, str)
            or not k
            or len(k) > MAX_METADATA_KEY
            or len(v) > MAX_METADATA_VALUE
        ):
            raise InvalidRequest(
                f"metadata keys must be strings of 1-{MAX_METADATA_KEY} characters and values "
                f"strings of at most {MAX_METADATA_VALUE}; got {k!r}: {v!r}"[:300]
            )
    return (None if timeout is None else float(timeout)), priority, metadata


def exceeds_max_lines(path: Path, max_lines: int) -> bool:
    """Whether ``path`` has more than ``max_lines`` non-blank lines. A newline count settles the
    common case; otherwise the non-blank lines are counted, reading in bounded pieces."""
    with open(path, "rb") as f:
        newlines = sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
    if newlines + 1 <= max_lines:
        return False
    n, blank = 0, True
    with open(path, "rb") as f:
        for piece in iter(lambda: f.readline(1 << 16), b""):
            blank = blank and not piece.strip()
            if piece.endswith(b"\n"):
                n += not blank
                blank = True
                if n > max_lines:
                    return True
    return n + (not blank) > max_lines


def _message_size(message) -> int:
    return len(message) if isinstance(message, str) else 256  # (task id, kwargs) for a non-Redis broker: its key counts


class Submitter:
    """Submits one job. ``run`` returns the job id; the job's status tells how it went."""

    def __init__(
        self,
        store: JobStore,
        broker,
        app,
        settings,
        *,
        chunk_size: int = DEFAULT_CHUNK,
        group_lines: int = GROUP_LINES,
        group_bytes: int = GROUP_BYTES,
        storage: FileStorage | None = None,
        storage_url: str | None = None,
        window: int | None = None,
    ) -> None:
        self.store = store
        self.broker = broker  # a redis-py client on the broker's Redis, or None for a non-Redis broker
        self.app = app
        self.settings = settings
        self.chunk_size = chunk_size  # lines per LPUSH, and the first grouping window
        self.group_lines = group_lines
        self.group_bytes = group_bytes
        # where a job that outgrows its window is copied, so that a worker feeds it on (None: this one feeds it all)
        self.storage = storage
        self.storage_url = storage_url  # opened when a job first needs it (a small job never touches the store)
        self.window = window or settings.batch.window_min  # lines of the job queued or running at once
        self.hand_off = False  # set by run() once the input is in the store

    def run(
        self,
        source,
        *,
        timeout=None,
        priority=None,
        metadata=None,
        job_id: str | None = None,
        completion_window: float | None = None,
        endpoint: str | None = None,
        require_valid: bool = False,
    ) -> str:
        """Create the job and submit ``source`` (a JSONL path, a binary file object, or an iterable of line
        dicts or strings); returns the job id once every line is enqueued."""
        path = Path(source) if isinstance(source, (str, os.PathLike)) else None
        if path is not None and not path.is_file():
            raise InvalidRequest(f"no such file: {path}")
        job_id = job_id or new_job_id()
        key = None
        if path is not None and (self.storage or self.storage_url) and count_newlines(path) >= self.window:
            # more lines than the window holds: the rest is fed from the store, by whoever holds the job's lease
            # (this submitter hands it off once the window is full; a worker takes it over). Copied before the job
            # exists, so a store that fails leaves nothing half-created.
            if self.storage is None:
                self.storage = open_storage(str(self.storage_url))
            key = input_key(job_id)
            copy_to_storage(self.storage, key, path)
        try:
            self.create(
                timeout=timeout,
                priority=priority,
                metadata=metadata,
                job_id=job_id,
                completion_window=completion_window,
                endpoint=endpoint,
                require_valid=require_valid,
                input_file=str(path) if path else None,
                input_key=key,
            )
        except BaseException:
            if key is not None and self.storage is not None:
                self.storage.delete(key)
            raise
        self.hand_off = key is not None
        return self.submit(source)

    def create(
        self,
        *,
        timeout=None,
        priority=None,
        metadata=None,
        job_id: str | None = None,
        completion_window: float | None = None,
        endpoint: str | None = None,
        require_valid: bool = False,
        input_file: str | None = None,
        input_key: str | None = None,
    ) -> str:
        """Validate the job's options (``InvalidRequest`` naming the field, before anything is written) and
        create it, ``validating``; ``submit`` then streams its input. Returns the job id. ``input_key``: the
        input's copy in the store, from which a worker may take the feeding over."""
        timeout, priority, metadata = check_options(timeout, priority, metadata)
        window = check_window(completion_window)
        job_id = job_id or new_job_id()
        token = uuid.uuid4().hex
        self.store.create(
            job_id,
            queue=self.settings.queue,
            model=self.settings.model,
            input_file=input_file,
            metadata=metadata,
            timeout=timeout,
            priority=priority,
            window_s=window,
            submitter=token,
            input_key=input_key,
        )
        self._setup(job_id, token, timeout, priority, endpoint, require_valid)
        return job_id

    def resume(
        self, job_id: str, source, *, endpoint: str | None = None, require_valid: bool = False, stale_s=RESUME_AFTER_S
    ) -> bool:
        """Go on with the submission of a ``validating`` job whose submitter died (no heartbeat for ``stale_s``
        seconds, server time; an API replica restarted mid-file): take it over (``JobStore.take_over``: the old
        submitter, if it was only stalled, is refused from then on), read ``source`` (the same file: a path or a
        binary file object) again, skip the lines the old one recorded (they still count toward duplicates and
        validity) and submit the rest. Lines of a chunk it recorded but did not enqueue are in the pending
        ledger, where lost-line recovery finds them. ``endpoint`` and ``require_valid`` must be the original's.
        False: the job needed no new submitter (not validating, or its submitter is alive)."""
        token = uuid.uuid4().hex
        done = self.store.take_over(job_id, stale_s, token)
        if done is None:
            return False
        log.info("job %s: took over its submission (%d lines submitted before)", job_id, done[0])
        job = self.store.status(job_id, repair=False)
        self._setup(job_id, token, job.timeout, job.priority, endpoint, require_valid)
        self.total, self.max_line = done
        self.skip_through = self.flushed_max_line = self.max_line
        if self.broker is not None:
            # lines the old submitter recorded but did not push: queued again now, or they would hold the window
            from batchery.jobs.recover import requeue_lost

            n = requeue_lost(self.store, self.broker, job_id, job.queue)
            if n:
                log.warning("job %s: %d lines its old submitter recorded but never queued are queued now", job_id, n)
        self.submit(source)
        return True

    def _setup(self, job_id: str, token: str, timeout, priority: int, endpoint, require_valid: bool) -> None:
        self.job_id = job_id
        self.token = token
        self.endpoint = endpoint
        self.require_valid = require_valid
        self.builder = (
            MessageBuilder(self.app, BATCH_LINE_TASK, self.settings.queue, priority)
            if self.broker is not None
            else None
        )
        # lines of one prefix group travel together, up to chunk_lines a message (a Redis broker only)
        self.chunk_lines = self.settings.batch.chunk_lines if self.builder is not None else 1
        self.chunk_builder = (
            MessageBuilder(self.app, BATCH_LINES_TASK, self.settings.queue, priority) if self.chunk_lines > 1 else None
        )
        self.kwargs = {"timeout": timeout, "priority": priority}
        self.total = self.max_line = self.valid = self.skip_through = 0
        self.flushed_max_line = 0  # the last line of the last window recorded in the job
        self.beat_at = time.monotonic()
        self.handed_off = False
        self.first_errors: list[LineError] = []
        self.superseded = False

    def submit(self, source) -> str:
        """Stream ``source`` into the job made by ``create``; returns the job id (its status tells how it went).
        Any exception fails the job (``submission_interrupted``) and is raised again."""
        limits = self.settings.batch
        job_id = self.job_id
        path = Path(source) if isinstance(source, (str, os.PathLike)) else None
        try:
            if path is not None and exceeds_max_lines(path, limits.max_lines):
                return self._fail(
                    "too_many_lines",
                    f"{path} has more than {limits.max_lines} request lines (BATCHERY_BATCH__MAX_LINES)",
                )
            if path is not None:
                with open(path, "rb") as f:
                    stopped = self._submit(parse_stream(f, limits.max_line_bytes), limits.max_lines)
            elif hasattr(source, "read"):  # a binary file object (the HTTP API's stored file)
                stopped = self._submit(parse_stream(source, limits.max_line_bytes), limits.max_lines)
            else:
                stopped = self._submit(self._parse_items(source, limits.max_line_bytes), limits.max_lines)
        except BaseException as exc:
            self._fail(
                "submission_interrupted",
                f"the submission stopped after {self.total} request lines: {type(exc).__name__}: {exc}"[:500],
            )
            raise
        if stopped:
            return job_id
        if self.total == 0:
            return self._fail("empty_file", "the input has no request lines")
        if self.require_valid and self.valid == 0:
            return self._fail(
                "no_valid_lines",
                f"none of the {self.total} request lines is valid"
                + (f"; the first {len(self.first_errors)} errors follow" if self.first_errors else ""),
                self.first_errors,
            )
        if self.store.end_submit(job_id, self.total, self.max_line, token=self.token) == "gone":
            raise self._vanished()
        return job_id

    # -- internals --------------------------------------------------------------------------------
    @staticmethod
    def _parse_items(items: Iterable, max_line_bytes: int):
        seen = SeenIds()  # every custom_id of the job, compactly (a million lines: ~20 MB)
        for n, item in enumerate(items, 1):
            if isinstance(item, (str, bytes, bytearray)):
                parsed = parse_line(
                    bytes(item) if isinstance(item, bytearray) else item, n, seen, max_line_bytes=max_line_bytes
                )
                if parsed is None:
                    continue
            else:
                parsed = parse_object(item, n, seen)
            yield parsed

    def _submit(self, items, max_lines: int) -> bool:
        """Enqueue everything, a grouping window at a time; True if the job was stopped (cancelled or failed)
        on the way."""
        window: list[tuple[str, int, object]] = []  # (prefix key, line, task message) of its valid lines
        errors: list[LineError] = []
        size = 0  # bytes of the window's messages and keys
        read = 0  # lines read before this window (this submitter's), which its size may double
        for item in items:
            if item.line <= self.skip_through:  # recorded by the submitter this one took over from
                self._classify(item)
                if item.line % 1000 == 0 and self._beat_due() and self._beat() == "superseded":
                    return True
                continue
            if self.total + len(window) + len(errors) >= max_lines:
                if self._flush(window, errors):
                    return True
                self._fail(
                    "too_many_lines", f"the input has more than {max_lines} request lines (BATCHERY_BATCH__MAX_LINES)"
                )
                return True
            item = self._classify(item)
            if isinstance(item, BatchLine):
                key = prefix_key(item.url, item.body)
                group = prefix_group(item.url, item.body)
                message = self._message(item, group)
                window.append((key, item.line, message, (item, group)))
                size += len(key) + _message_size(message)
            else:
                errors.append(item)
            self.max_line = item.line
            n = len(window) + len(errors)
            # a quarter of the window at most: lines a dead worker still holds (until the visibility timeout) leave
            # room for the next group
            group = min(self.group_lines, max(1, self.window // 4), max(self.chunk_size, read))
            if n >= group or size >= self.group_bytes:
                if self._flush(window, errors):
                    return True
                window, errors, size, read = [], [], 0, read + n
        return self._flush(window, errors)

    def _classify(self, item: BatchLine | LineError) -> BatchLine | LineError:
        """The line as this job takes it (another url than the batch's endpoint is an error line), counted
        toward ``valid`` and the first errors."""
        if isinstance(item, BatchLine) and self.endpoint is not None and item.url != self.endpoint:
            item = LineError(
                item.line,
                item.custom_id,
                UNSUPPORTED_URL,
                f"url {item.url!r} is not the batch's endpoint {self.endpoint!r}: every line of a batch "
                "goes to its endpoint",
            )
        if isinstance(item, BatchLine):
            self.valid += 1
        elif len(self.first_errors) < FIRST_ERRORS:
            self.first_errors.append(item)
        return item

    def _message(self, item: BatchLine, group: str):
        kwargs = {
            "job": self.job_id,
            "line": item.line,
            "custom_id": item.custom_id,
            "url": item.url,
            "body": item.body,
            **self.kwargs,
        }
        task_id = f"{self.job_id}-{item.line}"
        if self.builder is None:
            return task_id, kwargs
        return self.builder.build(
            task_id,
            kwargs,
            f"{{'job': '{self.job_id}', 'line': {item.line}}}",
            headers={PREFIX_HEADER: group},
        )

    def _flush(self, window: list, errors: list[LineError]) -> bool:
        """Record the window in the job as one chunk (counts first, so progress never shows more done than
        total), then enqueue its messages in prefix order. True if the job has been stopped meanwhile."""
        n = len(window) + len(errors)
        if window:
            room = self._room(len(window))
            if room == "stopped":
                self.store.end_submit(self.job_id, self.total, self.flushed_max_line, token=self.token)
            if room is not None:
                return True
        window.sort(key=lambda entry: entry[0])  # stable: lines with the same prefix stay in input order
        messages = [(line, message) for _, line, message, _ in window]
        queued = self._chunks(window)  # what goes on the queue: chunks of a group's lines, or the lines' own
        window.clear()  # the keys go now; the messages are held until they are queued
        with self.store.r.pipeline(transaction=False) as p:
            for e in errors:
                self.store.write_in(p, self.job_id, e.line, line_error_record(self.job_id, e), failed=True)
            if self.builder is not None:  # the ledger, before the messages: see batchery.jobs.recover
                for i in range(0, len(messages), self.chunk_size):
                    self.store.ledger_in(p, self.job_id, messages[i : i + self.chunk_size])
            self.store.queue_chunk(p, self.job_id, n, self.max_line, self.token)
            status = p.execute()[-1]
        self.total += n
        self.flushed_max_line = self.max_line
        self.beat_at = time.monotonic()  # the chunk beat too
        status = status.decode() if isinstance(status, bytes) else status
        if status is None:  # nothing of the chunk was written: the job is gone, so is the submission
            raise self._vanished()
        if status == "superseded":  # another submitter took the job over (this one had stalled): it goes on
            self.total -= n
            self.superseded = True
            return True
        if status in STOPPED_STATUSES:
            self.store.end_submit(self.job_id, self.total, self.max_line, token=self.token)
            return True
        for i in range(0, len(queued), self.chunk_size):
            piece = queued[i : i + self.chunk_size]
            if self.builder is not None:
                with self.broker.pipeline(transaction=False) as p:
                    self.builder.push(p, piece)  # every message of a job goes to the same list (its priority's)
                    p.execute()
            else:
                self._send_tasks(piece)
        return False

    def _chunks(self, window: list) -> list:
        """The messages that carry ``window``'s lines (sorted by prefix): up to ``chunk_lines`` lines of one prefix
        group in one ``batchery.batch_lines`` message (prefix affinity sends it to the group's worker), and the lines
        whose group has no other line in the window together, with no group; a line left alone keeps its own message
        (the one the ledger holds). The ledger keeps every line's own message: a chunk that cannot run as one
        (delivered again after its worker died, an engine failure) goes back to the queue as its lines' own
        messages."""
        if self.chunk_builder is None:
            return [message for _, _, message, _ in window]
        sizes: dict[str, int] = {}
        for *_, (_, group) in window:
            sizes[group] = sizes.get(group, 0) + 1
        out: list = []
        loose: list = []  # lines alone in their group: they share nothing, so any chunk does

        def emit(entries: list, group: str | None) -> None:
            if len(entries) == 1:
                out.append(entries[0][2])
            else:
                out.append(self._chunk_message([item for *_, (item, _) in entries], group))

        i = 0
        while i < len(window):
            group = window[i][3][1]
            if sizes[group] == 1:
                loose.append(window[i])
                if len(loose) == self.chunk_lines:
                    emit(loose, None)
                    loose = []
                i += 1
                continue
            j = i + 1
            while j < len(window) and j - i < self.chunk_lines and window[j][3][1] == group:
                j += 1
            emit(window[i:j], group)
            i = j
        if loose:
            emit(loose, None)
        return out

    def _chunk_message(self, items: list[BatchLine], group: str | None) -> str:
        lines = [{"line": it.line, "custom_id": it.custom_id, "url": it.url, "body": it.body} for it in items]
        headers = {CHUNK_JOB_HEADER: self.job_id, CHUNK_LINES_HEADER: ",".join(str(it.line) for it in items)}
        if group is not None:
            headers[PREFIX_HEADER] = group
        return self.chunk_builder.build(
            f"{self.job_id}-c{items[0].line}",
            {"job": self.job_id, "lines": lines, **self.kwargs},
            f"{{'job': '{self.job_id}', 'lines': {len(items)}}}",
            headers=headers,
        )

    def _room(self, n: int) -> str | None:
        """Wait until the job's window has room for ``n`` more lines: fewer than ``window`` lines queued or running
        (counted but not recorded), or none at all. Beats meanwhile, so the lease holds. None: room; else why this
        submitter stops feeding: ``"handed off"`` (the input is in the store: the lease is released for a worker to
        take over), ``"stopped"`` (cancelled or failed) or ``"superseded"`` (another submitter took over)."""
        key = self.store.key(self.job_id)
        while True:
            total, done, failed, status = self.store.r.hmget(key, ["total", "completed", "failed", "status"])
            if status is None:
                raise self._vanished()
            outstanding = int(total or 0) - int(done or 0) - int(failed or 0)
            if outstanding <= 0 or outstanding + n <= self.window:
                return None
            if status.decode() in STOPPED_STATUSES:
                return "stopped"
            if self.hand_off:
                answer = self.store.hand_off(self.job_id, self.token)
                if answer == "gone":
                    raise self._vanished()
                self.handed_off = answer == "handed off"
                self.superseded = answer == "superseded"
                log.info(
                    "job %s: %s after %d lines (its window of %d is full)", self.job_id, answer, self.total, self.window
                )
                return answer
            if self._beat_due() and self._beat() == "superseded":
                return "superseded"
            time.sleep(ROOM_POLL_S)

    def _beat_due(self) -> bool:
        return time.monotonic() - self.beat_at >= min(BEAT_S, self.settings.batch.feeder_lease_s / 3)

    def _beat(self) -> str:
        """A heartbeat that keeps this submitter's lease (no new lines); returns the job's status or
        ``"superseded"``."""
        self.beat_at = time.monotonic()
        with self.store.r.pipeline(transaction=False) as p:
            self.store.queue_chunk(p, self.job_id, 0, self.flushed_max_line, self.token)
            answer = p.execute()[-1]
        answer = answer.decode() if isinstance(answer, bytes) else answer
        if answer is None:
            raise self._vanished()
        if answer == "superseded":
            self.superseded = True
        return answer

    def _send_tasks(self, messages: list) -> None:
        with self.app.producer_or_acquire() as producer, producer.batch(self.chunk_size):
            for task_id, kwargs in messages:
                self.app.send_task(
                    BATCH_LINE_TASK,
                    kwargs=kwargs,
                    task_id=task_id,
                    queue=self.settings.queue,
                    priority=self.kwargs["priority"],
                    ignore_result=True,
                    producer=producer,
                    headers={ENQUEUED_AT_HEADER: time.time()},
                )

    def _vanished(self) -> JobNotFound:
        return JobNotFound(
            f"batch job {self.job_id!r} vanished from Redis after {self.total} request lines (deleted, or Redis "
            "flushed or replaced during the submission); lines already queued are skipped; submit again"
        )

    def _fail(self, code: str, message: str, lines: list[LineError] | None = None) -> str:
        errors: list[dict] = [{"code": code, "message": message, "line": None}]
        errors += [{"code": e.code, "message": e.message, "line": e.line} for e in lines or ()]
        try:
            self.store.end_submit(self.job_id, self.total, self.max_line, errors, token=self.token)
        except Exception:  # noqa: BLE001 - reporting the failure must not hide the original error
            pass
        return self.job_id


def make_submitter(client) -> Submitter:
    """The client's submitter: its window sized from the live workers, the configured store to hand big jobs off
    through (``StorageError`` when it cannot be used, before anything is written)."""
    settings = client.settings
    broker = redis_from_url(settings.broker_url) if is_redis_url(settings.broker_url) else None
    live = client.live_workers()
    window = window_size(settings, (live or {}).get(str(client.queue)))
    return Submitter(client.jobs, broker, client.app, settings, storage_url=settings.storage_url, window=window)
