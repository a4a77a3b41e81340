"""Batch-job state in Redis (the result backend's Redis): one hash per job, one hash of line records,
one hash of running leases, and an index of jobs.

Keys (``prefix`` is ``BATCHERY_BATCH__KEY_PREFIX``, default ``batchery:batch``)::

    {prefix}:{job}          hash  status, counts, usage, timestamps, metadata, limits
    {prefix}:{job}:results  hash  line number -> output or error record (JSON)
    {prefix}:{job}:running  hash  line number -> lease deadline (server time), for cancellation
    {prefix}:{job}:pending  hash  line number -> its queued task message, until the line has a record
    {prefix}:index          zset  job id, scored by creation time

**TTL.** A job's keys never expire while it runs, however long that takes. When it ends (``completed``,
``failed``, ``expired`` or ``cancelled``: the ``finish`` of ``lua/prelude.lua``) the job hash and its records get
the TTL (``BATCHERY_BATCH__TTL``), ``expires_at`` says when, and the leases and the ledger are deleted; a record
written after the end (a line that finished just too late) inherits the job's TTL. ``create`` drops from the
index the jobs older than the TTL whose keys have expired, and repairs (``status``) those that never ended, so
a job whose submitter died is failed and then expires like any other.

**Clocks.** Every timestamp is the Redis server's (``TIME`` inside the scripts): heartbeats and lease
deadlines are written by one machine and compared by another, whose clocks may disagree by minutes.

**A job that is gone** (deleted, or a Redis flushed or replaced) is never written to: every script checks
the job's status first and refuses (``"gone"``, or a nil reply), so no write recreates a hash without id,
status or TTL. A hash that is no job (left by older code) raises ``JobMalformed`` and is given the TTL.

Every transition is one Lua script, so it is atomic against every other writer (one ``.lua`` file each in
``batchery/jobs/lua/``, which opens with its KEYS, ARGV, reply and promises):

- ``claim``: a worker may run a line only while the job is ``validating`` or ``in_progress``, the
  line has no record yet and the job's completion window (if any) has not ended; it takes a lease on the line.
  After the window's end the claim writes the line's ``batch_expired`` record itself (counted as failed, once,
  like any record) and answers ``expired``, so the task skips it.
- ``write``: ``HSETNX`` of the record and, only if it was new, the counter increments and ``progress_at``
  (server time; lost-line recovery looks at jobs quiet for a while), all in one script (and the line leaves the
  ``pending`` ledger). A redelivered or retried request can never
  duplicate a line or a count. The last record of an ``in_progress`` job moves it to
  ``finalizing``; ``finalize`` then makes it ``completed`` (and applies the job's TTL to all its keys).
- ``chunk``/``ledger``: a submitted chunk's count, heartbeat and task-message copies.
- ``end_submit``: the submitter's last word: the final total; ``validating`` -> ``in_progress``
  (or ``failed``, with a job-level error).
- ``cancel``: -> ``cancelling``; ``cancelled`` once no line holds a lease (the last running line
  releases it, or the lease outlived its deadline because its worker died).
- ``expire`` (the completion window, OpenAI's ``completion_window``): once the window has ended (``window_ends_at``,
  server time, ``created_at`` + ``window_s``), every line in the ``pending`` ledger without a record and without a
  live lease is recorded ``batch_expired``, a piece at a time, under a per-job lock (``{job}:expiring``, with a
  TTL) so that API replicas polling the same job do not all scan it. Lines running when the window ended finish
  and keep their results. ``finalize`` makes a job with any ``batch_expired`` line ``expired``, not ``completed``.
- ``take_over``: a ``validating`` job whose submitter stopped beating gets a new submitter token; the old one's
  ``chunk`` and ``end_submit`` are refused (``superseded``) from then on, so two submitters never both count a
  chunk (``batchery.jobs.submit``'s ``Submitter.resume``).

``status`` also repairs what a dead process left behind: a job stuck in ``finalizing`` (its
finalizer died) is finalized, a ``cancelling`` one re-checks its leases, and a ``validating`` one
whose submitter stopped beating fails with ``submission_interrupted``.

The ``pending`` ledger keeps a copy of each line's task message until the line is recorded, so a
message the broker lost (kombu's Redis transport pops a message with BRPOP before it records it as
unacknowledged: a Redis restart or a worker death in between loses it) can be found and queued
again (``batchery.jobs.recover``). It costs about as much Redis memory as the queue itself while lines wait."""

from __future__ import annotations

import base64
import json
import logging
import math
import random
import uuid
from collections.abc import Iterator

from batchery.contract.batch import BATCH_EXPIRED, error_record
from batchery.contract.errors import InvalidRequest
from batchery.contract.schemas import TERMINAL_STATUSES, BatchJob
from batchery.jobs import lua
from batchery.jobs.job_hash import as_text as _s
from batchery.jobs.job_hash import parse_job_or_none

log = logging.getLogger("batchery.jobs")

ACTIVE_STATUSES = frozenset({"validating", "in_progress"})  # lines may still start
STOPPED_STATUSES = frozenset({"cancelling", "cancelled", "failed", "expired"})  # lines must not run
FINALIZE_STALE_S = 10.0  # a job finalizing for this long lost its finalizer
SUBMIT_STALE_S = 120.0  # a validating job whose submitter has not beaten for this long is dead
LEASE_GRACE_S = 30.0  # a running lease outlives its request's deadline by this much
MAX_REPAIRS_PER_CREATE = 20  # old jobs that never ended, looked at (and repaired) by each create
MAX_INDEX_SCAN = 50_000  # newest jobs of the index that lost-line recovery looks through, per round
EXPIRE_PIECE = 500  # pending lines recorded batch_expired per script call (each call is short: Redis stays responsive)
EXPIRE_LOCK_S = 60.0  # one expire() at a time per job (API replicas polling the same job); a dead holder's lapses
MAX_WINDOW_S = 30 * 86400.0  # the longest completion window a job may have
DRAIN_AT = 4096  # records a running job keeps in Redis before the drainers move them to the file store
EXPIRED_MESSAGE = "the batch's completion window ended before this line started"


class JobNotFound(KeyError):
    """No such batch job (never created, or expired)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no such batch job"


class JobMalformed(JobNotFound):
    """A job hash that is no job: no id or status (a write landed on a Redis that had lost the job). Its keys
    are given the TTL, so it does not stay in Redis for good."""


def new_job_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def _line_key(line: int) -> str:
    return str(int(line))


def _gone(job_id: str) -> JobNotFound:
    return JobNotFound(f"no batch job {job_id!r} (never created, or expired)")


def check_window(window_s) -> float | None:
    """A completion window in seconds (None: none); raises ``InvalidRequest`` naming the field."""
    if window_s is None:
        return None
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not math.isfinite(window_s):
        raise InvalidRequest(f"completion_window must be a number of seconds, got {window_s!r}"[:200])
    if not 0 < window_s <= MAX_WINDOW_S:
        raise InvalidRequest(f"completion_window must be more than 0 and at most {MAX_WINDOW_S:g} s, got {window_s!r}")
    return float(window_s)


def expired_record(job_id: str, line: int, custom_id: str | None) -> str:
    """The JSON record of a line its job's completion window ended before it started (OpenAI's ``batch_expired``
    error line: no response)."""
    rec = error_record(job_id, int(line), custom_id, BATCH_EXPIRED, EXPIRED_MESSAGE)
    return json.dumps(rec, separators=(",", ":"))


def _custom_id_of(message) -> str | None:
    """The ``custom_id`` in a queued task message (a ledger entry), or None if it cannot be read."""
    try:
        body = json.loads(base64.b64decode(json.loads(message)["body"]))
        cid = body[1]["custom_id"]
        return cid if isinstance(cid, str) else None
    except Exception:  # noqa: BLE001 - the record is still written, without its custom_id
        return None


class JobStore:
    """Batch-job bookkeeping on one Redis. Thread-safe (redis-py clients are).

    Every timestamp is the Redis server's clock (``TIME``), never the caller's: heartbeats, lease deadlines and
    the repairs' "how long ago" are compared across machines, whose clocks may disagree by minutes."""

    def __init__(
        self, redis_client, prefix: str = "batchery:batch", ttl: int = 7 * 86400, drain_at: int = DRAIN_AT
    ) -> None:
        self.r = redis_client
        self.prefix = prefix
        self.ttl = int(ttl)
        self.drain_at = int(drain_at)  # records a running job keeps in Redis before drainers move them to the store
        self._create = self.r.register_script(lua.load("create", prelude=True))
        self._chunk = self.r.register_script(lua.load("chunk", prelude=True))
        self._ledger = self.r.register_script(lua.load("ledger", prelude=True))
        self._claim = self.r.register_script(lua.load("claim", prelude=True))
        self._write = self.r.register_script(lua.load("write", prelude=True))
        self._release = self.r.register_script(lua.load("release", prelude=True))
        self._cancel = self.r.register_script(lua.load("cancel", prelude=True))
        self._end_submit = self.r.register_script(lua.load("end_submit", prelude=True))
        self._finalize = self.r.register_script(lua.load("finalize", prelude=True))
        self._expire = self.r.register_script(lua.load("expire", prelude=True))
        self._unlock = self.r.register_script(lua.load("unlock"))
        self._take_over = self.r.register_script(lua.load("take_over", prelude=True))
        self._hand_off = self.r.register_script(lua.load("hand_off"))
        self._expire_malformed = self.r.register_script(lua.load("expire_malformed"))
        self._drain_commit = self.r.register_script(lua.load("drain_commit", prelude=True))

    # -- keys -------------------------------------------------------------------------------------
    def key(self, job_id: str) -> str:
        return f"{self.prefix}:{job_id}"

    def keys(self, job_id: str) -> list[str]:
        k = self.key(job_id)
        return [k, f"{k}:results", f"{k}:running", f"{k}:pending"]

    def _k(self, job_id: str) -> list[str]:
        """The six keys every script of the prelude is given: ``keys`` and the done bitmap and the runs list."""
        k = self.key(job_id)
        return [k, f"{k}:results", f"{k}:running", f"{k}:pending", f"{k}:done", f"{k}:runs"]

    @property
    def drain_set_key(self) -> str:
        """The jobs that hold at least ``drain_at`` records in Redis (``batchery.jobs.drain``)."""
        return f"{self.prefix}:drain"

    @property
    def index_key(self) -> str:
        return f"{self.prefix}:index"

    def server_time(self) -> float:
        """The Redis server's clock, in seconds since the epoch."""
        sec, usec = self.r.time()
        return sec + usec / 1e6

    # -- the submitter's side ----------------------------------------------------------------------
    def create(
        self,
        job_id: str,
        *,
        queue: str,
        model: str | None,
        input_file: str | None = None,
        metadata: dict[str, str] | None = None,
        timeout: float | None = None,
        priority: int = 0,
        window_s: float | None = None,
        submitter: str | None = None,
        input_key: str | None = None,
    ) -> None:
        """A new ``validating`` job. Its keys do not expire until it ends; ``created_at`` is server time.
        ``window_s``: its completion window, from ``created_at`` (server time): lines not started by then are
        recorded ``batch_expired`` instead of running (``claim``, ``expire``). Prunes the index of jobs that have
        expired, and repairs old ones that never ended (a dead submitter). ``submitter``: a token the submitter
        passes with each chunk and its end, so that one ``take_over`` replaced is refused."""
        window_s = check_window(window_s)
        fields = {
            "id": job_id,
            "status": "validating",
            "queue": queue,
            "model": model or "",
            "total": 0,
            "completed": 0,
            "failed": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "max_line": 0,
            "metadata": json.dumps(metadata or {}),
            "input_file": input_file or "",
            "timeout": "" if timeout is None else repr(float(timeout)),
            "priority": int(priority),
            "window_s": "" if window_s is None else repr(window_s),
            "submitter": submitter or "",
            "input_key": input_key or "",  # the input's copy in the file store, for a feeder to take over from
        }
        args: list = [job_id, self.ttl, self.prefix]
        for k, v in fields.items():
            args += [k, v]
        unended = self._create(keys=[self.key(job_id), self.index_key], args=args)
        for old in unended[:MAX_REPAIRS_PER_CREATE]:
            try:
                self.status(_s(old))  # a validating job whose submitter died fails, and gets its TTL
            except JobNotFound:
                pass

    def queue_chunk(self, pipe, job_id: str, num_requests: int, max_line: int, token: str | None = None) -> None:
        """Add to ``pipe`` the bookkeeping of one submitted chunk: the running total, the last line
        seen, a heartbeat (server time); its reply is the status (None: the job is gone, and nothing was
        written; ``"superseded"``: ``token`` is no longer the job's submitter), so the submitter notices a cancel,
        a lost job or a take-over."""
        self._chunk(keys=self._k(job_id), args=[int(num_requests), int(max_line), token or ""], client=pipe)

    def take_over(self, job_id: str, stale_s: float, token: str) -> tuple[int, int] | None:
        """Become the submitter of a ``validating`` job whose submitter has not beaten for ``stale_s`` seconds
        (server time): ``(total, max_line)`` so far, from which the new one goes on (the old one's next chunk
        or end is refused); None when the job is not validating or its submitter is alive."""
        answer = self._take_over(keys=self._k(job_id), args=[repr(float(stale_s)), token])
        if int(answer[0]) != 1:
            return None
        return int(answer[1]), int(answer[2])

    @property
    def handoff_key(self) -> str:
        return f"{self.prefix}:handoff"

    def hand_off(self, job_id: str, token: str) -> str:
        """Free the lease of a ``validating`` job whose input is in the store, for a worker to feed it on
        (``batchery.jobs.feeder``): ``"handed off"``, ``"superseded"`` (``token`` no longer holds it), ``"gone"``
        or the status."""
        return _s(self._hand_off(keys=[self.key(job_id), self.handoff_key], args=[token, job_id]))

    def handed_off(self) -> list[str]:
        """The jobs handed off (or being fed on by a worker) that have not been fed to the end yet."""
        return sorted(_s(j) for j in self.r.smembers(self.handoff_key))

    def unhand(self, job_id: str) -> None:
        """Drop a job from the hand-off set (it was fed to the end, stopped or is gone)."""
        self.r.srem(self.handoff_key, job_id)

    def ledger_in(self, pipe, job_id: str, messages: list[tuple[int, str]]) -> None:
        """Add to ``pipe`` the copies of a chunk's task messages, by line, for ``batchery.jobs.recover``
        (only while the job is ``validating``: never on a job that is gone or stopped)."""
        if messages:
            args: list = []
            for line, msg in messages:
                args += [_line_key(line), msg]
            self._ledger(keys=self._k(job_id), args=args, client=pipe)

    def pending_lines(self, job_id: str) -> set[int]:
        """Lines whose task message was queued and that have no record yet."""
        return {int(x) for x in self.r.hkeys(self.keys(job_id)[3])}

    def pending_messages(self, job_id: str, lines: list[int]) -> dict[int, str]:
        raw = self.r.hmget(self.keys(job_id)[3], [_line_key(n) for n in lines]) if lines else []
        return {n: _s(m) for n, m in zip(lines, raw) if m is not None}

    def leased_lines(self, job_id: str) -> set[int]:
        """Lines some worker is running now (a lease whose deadline, server time, has not passed)."""
        with self.r.pipeline(transaction=False) as p:
            p.time()
            p.hgetall(self.keys(job_id)[2])
            (sec, usec), leases = p.execute()
        now = sec + usec / 1e6
        return {int(_s(k)) for k, v in leases.items() if float(v) >= now}

    def write_in(
        self,
        pipe,
        job_id: str,
        line: int,
        record: dict,
        failed: bool,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        """``write`` inside a pipeline (the submitter's error records)."""
        self._write(
            keys=self._k(job_id) + [self.drain_set_key],
            args=self._write_args(job_id, line, record, failed, prompt_tokens, completion_tokens, cached_tokens),
            client=pipe,
        )

    def end_submit(
        self,
        job_id: str,
        total: int | None,
        max_line: int | None,
        errors: list[dict] | None = None,
        *,
        stale_s: float | None = None,
        token: str | None = None,
    ) -> str:
        """Close the submission: the final total, then ``in_progress`` (or ``failed`` with
        ``errors``). Returns the new status (``"gone"``: no such job); finalizes at once if every line is
        already done. With ``stale_s``, only if the submitter has not beaten for that long (server time). With
        ``token``, only if it is still the job's submitter (else ``"superseded"``)."""
        status = _s(
            self._end_submit(
                keys=self._k(job_id),
                args=[
                    "" if total is None else int(total),
                    "" if max_line is None else int(max_line),
                    self.ttl,
                    json.dumps(errors) if errors else "",
                    "" if stale_s is None else repr(float(stale_s)),
                    token or "",
                ],
            )
        )
        if status == "finalizing":
            status = self.finalize(job_id)
        return status

    # -- the worker's side ------------------------------------------------------------------------
    def claim(self, job_id: str, line: int, lease_s: float, custom_id: str | None = None) -> str:
        """``"run"`` (the caller holds the line's lease, for ``lease_s`` seconds of server time), ``"done"``
        (it has a record), ``"gone"`` (no such job), ``"expired"`` (the job's completion window has ended: the
        line is not run, and this call recorded it ``batch_expired``, with ``custom_id``) or the job's status
        when lines must not run."""
        return self.claims_answered(job_id, [self._claim(**self._claim_args(job_id, line, lease_s, custom_id))])[0]

    def claim_in(self, pipe, job_id: str, line: int, lease_s: float, custom_id: str | None = None) -> None:
        """``claim`` inside a pipeline (a chunk's lines); read the replies with ``claims_answered``."""
        self._claim(**self._claim_args(job_id, line, lease_s, custom_id), client=pipe)

    def _claim_args(self, job_id: str, line: int, lease_s: float, custom_id: str | None) -> dict:
        args = [_line_key(line), repr(float(lease_s)), expired_record(job_id, line, custom_id), self.ttl]
        return {"keys": self._k(job_id), "args": args}

    def claims_answered(self, job_id: str, answers: list) -> list[str]:
        """The pipelined claims' answers, as ``claim`` gives them (finalizes the job if an expired line was its
        last)."""
        out, finalize = [], False
        for answer in answers:
            if isinstance(answer, list):
                finalize = finalize or _s(answer[1]) == "finalizing"
                answer = answer[0]
            out.append(_s(answer))
        if finalize:
            self.finalize(job_id)
        return out

    def write(
        self,
        job_id: str,
        line: int,
        record: dict,
        failed: bool,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> tuple[bool, str]:
        """Store a line's record once: ``(is_new, status)``. Counters move only when it is new, in
        the same script (``cached_tokens``: of its prompt tokens, those the prefix cache served). Finalizes the
        job when this was its last line."""
        new, status = self._write(
            keys=self._k(job_id) + [self.drain_set_key],
            args=self._write_args(job_id, line, record, failed, prompt_tokens, completion_tokens, cached_tokens),
        )
        status = _s(status)
        if status == "finalizing":  # this was the last line (or a retry of it whose reply was lost)
            status = self.finalize(job_id)
        return bool(new), status

    def release(self, job_id: str, line: int) -> str:
        """Give up a line's lease without a record (cancelled, retried, requeued)."""
        return _s(self._release(keys=self._k(job_id), args=[_line_key(line), self.ttl]))

    def _write_args(self, job_id, line, record, failed, prompt_tokens, completion_tokens, cached_tokens=0) -> list:
        return [
            _line_key(line),
            json.dumps(record, separators=(",", ":")),
            "failed" if failed else "completed",
            int(prompt_tokens),
            int(completion_tokens),
            self.ttl,
            int(cached_tokens),
            int(self.drain_at),
            job_id,
        ]

    # -- anyone -----------------------------------------------------------------------------------
    def finalize(self, job_id: str) -> str:
        return _s(self._finalize(keys=self._k(job_id), args=[self.ttl]))

    def expire(self, job_id: str, piece: int = EXPIRE_PIECE) -> str:
        """Enforce the job's completion window once it has ended (server time): every pending line that is not
        running is recorded ``batch_expired`` (counted as failed, once), ``piece`` lines per script, so Redis
        stays responsive on a large job. Lines running now finish and keep their results; the job ends
        ``expired`` when the last of them is recorded (at once if none runs). Returns the status (``"gone"``
        never: raises ``JobNotFound``). Harmless to call any number of times, from any number of processes
        (one at a time per job does the work; the others return the status). Before the window ends, or for a
        job without one, it changes nothing.

        The pending lines are the submitter's ledger (a Redis broker); without one, lines expire only as
        workers claim them."""
        status, ends = self.r.hmget(self.key(job_id), ["status", "window_ends_at"])
        if status is None:
            self._check_exists(job_id)
        st = _s(status)
        if st not in ACTIVE_STATUSES or not ends or self.server_time() < float(_s(ends)):
            return st
        lock, token = f"{self.key(job_id)}:expiring", uuid.uuid4().hex
        if not self.r.set(lock, token, nx=True, px=int(EXPIRE_LOCK_S * 1000)):
            return st  # another process is at it
        try:
            keys = self._k(job_id)
            cursor = 0
            while True:
                cursor, entries = self.r.hscan(keys[3], cursor, count=max(1, int(piece)))
                items = list(entries.items())
                for i in range(0, len(items), max(1, int(piece))):
                    args: list = [self.ttl]
                    for line, message in items[i : i + max(1, int(piece))]:
                        args += [_s(line), expired_record(job_id, int(_s(line)), _custom_id_of(message))]
                    _, status = self._expire(keys=keys, args=args)
                    st = _s(status)
                    if st not in ACTIVE_STATUSES:
                        break
                if st not in ACTIVE_STATUSES or int(cursor) == 0:
                    break
                self.r.pexpire(lock, int(EXPIRE_LOCK_S * 1000))
            if st in ACTIVE_STATUSES:  # no pending line left to record: may the job end now?
                st = _s(self._expire(keys=keys, args=[self.ttl])[1])
            if st == "finalizing":
                st = self.finalize(job_id)
        finally:
            self._unlock(keys=[lock], args=[token])
        if st == "gone":
            self._check_exists(job_id)
        return st

    def cancel(self, job_id: str) -> str:
        """Ask a job to stop: ``cancelling``, then ``cancelled`` once no line is running. A job that
        already ended keeps its status. Raises ``JobNotFound`` (``JobMalformed``)."""
        status = _s(self._cancel(keys=self._k(job_id), args=[self.ttl]))
        if status == "gone":
            self._check_exists(job_id)
        return status

    def get_status(self, job_id: str) -> str | None:
        v = self.r.hget(self.key(job_id), "status")
        return None if v is None else _s(v)

    def get_statuses(self, job_ids: list[str]) -> list[str | None]:
        """``get_status`` of each job, in one round trip."""
        with self.r.pipeline(transaction=False) as p:
            for j in job_ids:
                p.hget(self.key(j), "status")
            return [None if v is None else _s(v) for v in p.execute()]

    def quiet_jobs(self, queue: str, quiet_s: float, limit: int, scan: int = MAX_INDEX_SCAN) -> list[str]:
        """Up to ``limit`` ``in_progress`` jobs on ``queue`` (among the ``scan`` newest of the index) that have
        recorded no line for ``quiet_s`` seconds of server time (or, without any record, since they went
        ``in_progress``): where lost-line recovery looks. A random pick when there are more, so none is left out
        for good."""
        now = self.server_time()
        quiet: list[str] = []
        for start in range(0, scan, 1000):
            ids = [_s(j) for j in self.r.zrevrange(self.index_key, start, min(start + 1000, scan) - 1)]
            if not ids:
                break
            with self.r.pipeline(transaction=False) as p:
                for j in ids:
                    p.hmget(self.key(j), ["status", "queue", "progress_at", "in_progress_at"])
                rows = p.execute()
            for j, (status, q, progress_at, in_progress_at) in zip(ids, rows):
                if status is None or _s(status) != "in_progress" or q is None or _s(q) != queue:
                    continue
                since = max(float(_s(progress_at or b"0") or 0), float(_s(in_progress_at or b"0") or 0))
                if now - since >= quiet_s:
                    quiet.append(j)
        return quiet if len(quiet) <= limit else random.sample(quiet, limit)

    def status(self, job_id: str, repair: bool = True) -> BatchJob:
        """The job's state. Raises ``JobNotFound`` (``JobMalformed`` for a hash that is no job). With
        ``repair``, finishes what a dead finalizer, canceller or submitter left half done (see the module
        docstring)."""
        raw = self.r.hgetall(self.key(job_id))
        if not raw:
            raise _gone(job_id)
        job = parse_job_or_none(raw)
        if job is None:
            raise self._malformed(job_id)
        if repair and not job.is_terminal and self._repair(job_id, job, raw):
            return self.status(job_id, repair=False)
        return job

    def _repair(self, job_id: str, job: BatchJob, raw: dict) -> bool:
        now = self.server_time()
        if job.status == "finalizing" and now - (job.finalizing_at or now) > FINALIZE_STALE_S:
            self.finalize(job_id)
            return True
        if job.status == "cancelling":
            return self.cancel(job_id) != "cancelling"
        beat = float(_s(raw.get(b"submit_beat", b"0")) or 0)
        # a job whose input is in the store is never failed for its submitter: a worker feeds it on
        if job.status == "validating" and now - beat > SUBMIT_STALE_S and not raw.get(b"input_key"):
            status = self.end_submit(
                job_id,
                None,
                None,
                [
                    {
                        "code": "submission_interrupted",
                        "message": f"the submitter stopped after {job.request_counts.total} requests "
                        f"(no sign of it for {now - beat:.0f} s)",
                        "line": None,
                    }
                ],
                stale_s=SUBMIT_STALE_S,  # decided again in the script, on the server's clock
            )
            return status != "validating"
        return False

    def _check_exists(self, job_id: str) -> None:
        """Raise ``JobMalformed`` if the job's hash exists without a status, else ``JobNotFound``."""
        if self.r.exists(self.key(job_id)):
            raise self._malformed(job_id)
        raise _gone(job_id)

    def _malformed(self, job_id: str) -> JobMalformed:
        self._expire_malformed(keys=self._k(job_id), args=[self.ttl])
        return JobMalformed(
            f"batch job {job_id!r} is malformed in Redis (no id or status: was Redis flushed or replaced while it "
            f"ran?); it is not a job any more, and its keys expire within {self.ttl} s"
        )

    def max_line(self, job_id: str) -> int:
        status, v = self.r.hmget(self.key(job_id), ["status", "max_line"])
        if status is None:
            self._check_exists(job_id)
        return int(v or 0)

    def iter_results(self, job_id: str, chunk: int = 1000, storage=None) -> Iterator[dict]:
        """The job's records (outputs and errors), in input order, streamed: those still in Redis ``chunk`` lines at
        a time, merged with the runs drained to the file store (``storage``: a ``FileStorage`` or a function that
        opens one, needed only once the job has runs; ``batchery.jobs.records``)."""
        from batchery.jobs.records import iter_records

        return iter_records(self, job_id, storage, chunk)

    def recorded(self, job_id: str, line: int) -> bool:
        """Whether the line has its record (in Redis or drained to the store)."""
        k = self._k(job_id)
        with self.r.pipeline(transaction=False) as p:
            p.getbit(k[4], int(line))
            p.hexists(k[1], _line_key(line))
            bit, there = p.execute()
        return bool(bit) or bool(there)

    def list(self, limit: int = 20) -> list[BatchJob]:
        """The newest ``limit`` jobs (expired and malformed ones are dropped from the index as they are met)."""
        ids = [_s(j) for j in self.r.zrevrange(self.index_key, 0, max(limit, 1) - 1)]
        with self.r.pipeline(transaction=False) as p:
            for j in ids:
                p.hgetall(self.key(j))
            raws = p.execute()
        jobs, gone = [], []
        for j, raw in zip(ids, raws):
            job = parse_job_or_none(raw) if raw else None
            if job is not None:
                jobs.append(job)
                continue
            gone.append(j)
            if raw:
                self._expire_malformed(keys=self._k(j), args=[self.ttl])
        if gone:
            self.r.zrem(self.index_key, *gone)
        return jobs

    def delete(self, job_id: str) -> None:
        """Remove a job and its records now (tests, operators)."""
        with self.r.pipeline(transaction=True) as p:
            p.delete(*self._k(job_id), f"{self.key(job_id)}:draining")
            p.zrem(self.index_key, job_id)
            p.srem(self.drain_set_key, job_id)
            p.execute()


__all__ = [
    "JobStore",
    "JobNotFound",
    "JobMalformed",
    "new_job_id",
    "ACTIVE_STATUSES",
    "STOPPED_STATUSES",
    "TERMINAL_STATUSES",
]
