"""Checks on a ``batchery.batch_line`` message before it may touch its job.

Anyone with access to the broker can publish a ``batchery.batch_line`` message by hand. The job store
counts every new record, so a forged line (0, negative, above the job's last line, or a line that was
never queued, such as a blank line of the input) would count and could finalize the job early, and an
unbounded ``custom_id`` would be copied into every log line of its task. So a message must look like
one our submitter wrote (``batchery.jobs.submit``):

- kwargs of the right types: ``job`` and ``custom_id`` non-empty strings within bounds (a custom_id as
  ``batchery.contract.batch`` bounds it), ``line`` an integer from 1, ``url`` a supported endpoint,
  ``body`` an object, ``timeout`` a positive number or null, ``priority`` 0..9;
- its task id is ``{job}-{line}``;
- in the job: ``line`` is at most the job's ``max_line`` (the submitter records a chunk's last line
  before it publishes the chunk), and, on a Redis broker, the line's message was queued (the job's
  ``pending`` ledger holds it until the line is recorded) or the line already has its record (a
  redelivery, skipped as usual).

A message that fails is logged (its values cut short) and dead-lettered, and writes nothing to the job."""

from __future__ import annotations

from batchery.contract.batch import ENDPOINTS, MAX_CUSTOM_ID_CHARS
from batchery.jobs.deadletter import short
from batchery.jobs.store import ACTIVE_STATUSES

MAX_LINE = 10_000_000  # the most lines a job may have (BATCHERY_BATCH__MAX_LINES is at most this)

MAX_JOB_ID_CHARS = 128


def check_kwargs(task_id, job, line, custom_id, url, body, timeout, priority) -> str | None:
    """What is wrong with a batch-line message on its own (None: nothing)."""
    if not isinstance(job, str) or not 0 < len(job) <= MAX_JOB_ID_CHARS:
        return f"job must be a string of 1-{MAX_JOB_ID_CHARS} characters, got {short(job, 80)}"
    if isinstance(line, bool) or not isinstance(line, int) or not 1 <= line <= MAX_LINE:
        return f"line must be an integer from 1 to {MAX_LINE}, got {short(line, 40)}"
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        size = f"{len(custom_id)} characters" if isinstance(custom_id, str) else type(custom_id).__name__
        return f"custom_id must be a string of 1-{MAX_CUSTOM_ID_CHARS} characters, got {size}"
    if not isinstance(url, str) or url not in ENDPOINTS:
        return f"url must be one of {', '.join(ENDPOINTS)}, got {short(url, 80)}"
    if not isinstance(body, dict):
        return f"body must be an object, got {type(body).__name__}"
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        return f"timeout must be a positive number or null, got {short(timeout, 40)}"
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
        return f"priority must be an integer from 0 to 9, got {short(priority, 40)}"
    if task_id != f"{job}-{line}":
        return f"the task id of line {line} of {job} must be {job}-{line}, got {short(task_id, 80)}"
    return None


def check_in_job(store, job: str, line: int, ledger: bool) -> str | None:
    """What is wrong with line ``line`` of ``job`` while the job runs (None: nothing; or the job is gone
    or stopped, which the claim then reports). ``ledger``: the submitter keeps a pending ledger (a Redis
    broker)."""
    return check_chunk_in_job(store, job, [line], ledger)


MAX_CHUNK_LINES = 256  # the most lines a chunk message may carry (BATCHERY_BATCH__CHUNK_LINES is at most this)


def check_chunk(task_id, job, lines, timeout, priority) -> str | None:
    """What is wrong with a chunk message (``batchery.batch_lines``) on its own (None: nothing): each of its lines
    as ``check_kwargs`` checks a line's message, no line twice, and its task id ``{job}-c{first line}``."""
    if not isinstance(lines, list) or not 1 <= len(lines) <= MAX_CHUNK_LINES:
        size = f"{len(lines)} lines" if isinstance(lines, list) else type(lines).__name__
        return f"lines must be a list of 1-{MAX_CHUNK_LINES} lines, got {size}"
    seen: set[int] = set()
    for entry in lines:
        if not isinstance(entry, dict) or set(entry) != {"line", "custom_id", "url", "body"}:
            return "each of lines must be an object with line, custom_id, url and body"
        line = entry["line"]
        problem = check_kwargs(
            f"{job}-{line}", job, line, entry["custom_id"], entry["url"], entry["body"], timeout, priority
        )
        if problem is not None:
            return problem
        if line in seen:
            return f"line {line} is twice in the chunk"
        seen.add(line)
    first = lines[0]["line"]
    if task_id != f"{job}-c{first}":
        return f"the task id of a chunk of {job} from line {first} must be {job}-c{first}, got {short(task_id, 80)}"
    return None


def check_chunk_in_job(store, job: str, lines: list[int], ledger: bool) -> str | None:
    """``check_in_job`` for every line of a chunk, in one round trip: the first problem, or None. A record drained
    to the file store keeps its bit in the done bitmap."""
    job_key, results, _running, pending, done, _runs = store._k(job)
    with store.r.pipeline(transaction=True) as p:
        p.hmget(job_key, ["status", "max_line"])
        for line in lines:
            p.hexists(results, str(line))
            p.getbit(done, int(line))
            p.hexists(pending, str(line))
        answers = p.execute()
    status, max_line = answers[0]
    if isinstance(status, bytes):
        status = status.decode()
    if status not in ACTIVE_STATUSES:
        return None  # gone, or stopped or ended: the claims skip the lines, nothing is written
    max_line = int(max_line or 0)
    for i, line in enumerate(lines):
        in_redis, bit, queued = answers[1 + 3 * i : 4 + 3 * i]
        if line > max_line:
            return f"line {line} is beyond the last line of {job} ({max_line})"
        if ledger and not (in_redis or bit) and not queued:
            return f"line {line} of {job} was never queued (it is not in the job's pending ledger)"
    return None
