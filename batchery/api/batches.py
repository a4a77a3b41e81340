"""OpenAI's Batches API: ``POST /v1/batches``, ``GET /v1/batches``, ``GET /v1/batches/{id}``,
``POST /v1/batches/{id}/cancel``, on the job store (``batchery.jobs.store``) and the streaming submitter
(``batchery.jobs.submit``). The batch id is the job id (``batch_<hex>``); workers run its lines as they run any
batch job's.

**Create.** Everything is checked before anything is written: the ``endpoint`` (one of
``batchery.contract.batch.ENDPOINTS``), the ``completion_window``, the ``metadata`` (OpenAI's limits: 16 pairs,
keys of 64 characters, values of 512), and the input file (the caller's own, not deleted, purpose ``batch``). Then
the job is created (``validating``) and the call returns; a background thread streams the stored file through the
submitter. A line whose ``url`` is not the batch's endpoint is an error line, as at OpenAI. A file that cannot be a
batch as a whole (no request line, none valid, more than ``BATCHERY_BATCH__MAX_LINES``) ends ``failed`` with
``errors`` (``{"object": "list", "data": [{"code", "message", "line", "param"}]}``). If the API process dies
while it reads the file, the job store fails the job (``submission_interrupted``) once the submitter's heartbeat
is two minutes old.

**completion_window.** OpenAI accepts only ``"24h"``; Batchery accepts ``<n>s``, ``<n>m`` or ``<n>h`` from 1 s to
7 days (``"24h"`` is the SDK's value; a short one is for tests and for jobs that are worthless late). It is
enforced on the Redis server's clock from the batch's ``created_at``: a line not started when it ends is not run
but recorded ``batch_expired`` (by the worker's claim, or by ``JobStore.expire``, which ``retrieve`` and ``list``
call once the window has passed); lines already running finish and keep their results; the batch ends
``expired`` with its partial output. ``output_expires_after`` is accepted and checked, but not enforced: the
output files stay until deleted.

**Output and error files.** When the job ends (``completed``, ``expired`` or ``cancelled``), its records are
written once, in input order, as two files of purpose ``batch_output`` (the 200 lines, then the error lines;
none when it would be empty), by the first ``retrieve``/``list`` that sees the end, in a background thread, under
a Redis lock (``SET NX`` with a TTL the writer refreshes), so two API replicas never write two, and a replica that
died writing leaves the lock to lapse and the next one to write them. Until the ids are set the batch shows
``finalizing`` (``cancelling`` for a cancelled one), as at OpenAI. A failed batch has no files (its ``errors``
say why).

**Redis.** Under ``BATCHERY_API__KEY_PREFIX`` (``{p}``): hash ``{p}:batch:{id}`` (the owner tenant,
``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``, the file ids once written) and zset
``{p}:batches:{tenant}`` (ids by ``created_at``), for the tenant's newest-first listing. The hash gets the job's
TTL (``BATCHERY_BATCH__TTL``) when its files are written, so it goes with the job. Another tenant's batch is a 404,
as one that does not exist."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from batchery.api.auth import Tenant, tenant
from batchery.api.errors import APIError, invalid, list_page, not_found
from batchery.api.files import files_of
from batchery.api.state import ApiState
from batchery.broker.connection import is_redis_url, redis_from_url
from batchery.client import Client
from batchery.contract.batch import ENDPOINTS, NOT_SERVED
from batchery.contract.errors import InvalidRequest
from batchery.contract.schemas import BatchJob
from batchery.jobs.store import JobNotFound, JobStore, new_job_id
from batchery.jobs.submit import DEFAULT_CHUNK, RESUME_AFTER_S, Submitter, check_options

log = logging.getLogger("batchery.api.batches")

router = APIRouter()

WINDOW_RE = re.compile(r"([1-9][0-9]{0,6})([smh])")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 7 * 86400
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
FILES_LOCK_S = 30.0  # the output writer's lock; refreshed while it writes, so only a dead writer's lapses
CHUNK_BYTES = 1 << 20  # bytes of output lines handed to the file store at a time
OUTPUT_PURPOSE = "batch_output"
INPUT_PURPOSE = "batch"
# what a job whose files are not written yet shows (OpenAI writes them while finalizing or cancelling)
UNTIL_FILES = {"completed": "finalizing", "expired": "finalizing", "cancelled": "cancelling"}
ENDED_AT = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}

# KEYS: batch hash   ARGV: output file id, error file id ('' for none), ttl
# Sets the file ids once (1), or not when another writer already did (0).
_FILES_DONE = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'files_done') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'output_file_id', ARGV[1], 'error_file_id', ARGV[2], 'files_done', '1')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class CreateBatch(BaseModel):
    """The body of ``POST /v1/batches`` (OpenAI's ``BatchCreateParams``); unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: str = Field(max_length=200)
    completion_window: str = Field(max_length=20)
    metadata: dict[str, Any] | None = None
    output_expires_after: OutputExpiresAfter | None = None


def parse_window(text: str) -> float:
    """``"24h"`` -> 86400.0; ``<n>s|m|h`` from 1 s to 7 days. Raises ``APIError`` 400 naming the field."""
    m = WINDOW_RE.fullmatch(text.strip())
    seconds = int(m.group(1)) * WINDOW_UNITS[m.group(2)] if m else 0
    if not m or seconds > MAX_WINDOW_S:
        raise invalid(
            f"completion_window must be a duration like '24h' (OpenAI's only value), '90m' or '30s', from 1 s "
            f"to {MAX_WINDOW_S // 86400} days; got {text[:40]!r}",
            param="completion_window",
        )
    return float(seconds)


class Batches:
    """The API's batch service, one per app (``state.extras["batches"]``): the job store and a client on the
    result backend's Redis (the API's own keys live there too), the broker's Redis for the submitter, and the
    background threads that read input files and write output files."""

    def __init__(self, st: ApiState) -> None:
        self.state = st
        self.settings = st.settings
        self.prefix = st.settings.api.key_prefix
        self.client = Client(settings=st.settings)
        self.store: JobStore = self.client.jobs
        self.r = self.store.r
        self.broker = redis_from_url(st.settings.broker_url) if is_redis_url(st.settings.broker_url) else None
        self._files_done = self.r.register_script(_FILES_DONE)
        self._unlock = self.r.register_script(_UNLOCK)
        self._refresh = self.r.register_script(_REFRESH)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._resuming: set[str] = set()
        self.chunk_size = DEFAULT_CHUNK
        self.resume_after_s = RESUME_AFTER_S

    def close(self) -> None:
        if self.broker is not None:
            self.broker.close()
        self.client.close()

    # -- keys -------------------------------------------------------------------------------------
    def meta_key(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def index_key(self, tenant_id: str) -> str:
        return f"{self.prefix}:batches:{tenant_id}"

    def files_lock_key(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:files"

    # -- create -----------------------------------------------------------------------------------
    def create(self, who: Tenant, body: CreateBatch) -> dict:
        endpoint = body.endpoint
        if endpoint not in ENDPOINTS:
            why = NOT_SERVED.get(endpoint, f"unsupported endpoint {endpoint[:100]!r}")
            raise invalid(f"{why}; supported: {', '.join(ENDPOINTS)}", param="endpoint", code="invalid_endpoint")
        window = parse_window(body.completion_window)
        try:
            _, _, metadata = check_options(None, None, body.metadata)
        except InvalidRequest as exc:
            raise invalid(str(exc), param="metadata") from None
        files = _files(self.state)
        try:
            meta = files.get(who.id, body.input_file_id)
        except APIError as exc:
            exc.param = "input_file_id"
            raise
        if meta.get("purpose") != INPUT_PURPOSE:
            raise invalid(
                f"file {body.input_file_id!r} has purpose {meta.get('purpose')!r}; a batch's input file is "
                f"uploaded with purpose {INPUT_PURPOSE!r}",
                param="input_file_id",
            )
        source = self._open_source(who.id, body.input_file_id)
        batch_id = new_job_id()
        submitter = self._submitter()
        try:
            submitter.create(
                job_id=batch_id,
                metadata=metadata,
                completion_window=window,
                endpoint=endpoint,
                require_valid=True,
                input_file=body.input_file_id,
            )
            job = self.store.status(batch_id, repair=False)
            fields = {
                "id": batch_id,
                "tenant": who.id,
                "input_file_id": body.input_file_id,
                "endpoint": endpoint,
                "completion_window": body.completion_window.strip(),
                "metadata": "" if body.metadata is None else json.dumps(metadata),
                "output_expires_after": ""
                if body.output_expires_after is None
                else body.output_expires_after.model_dump_json(),
                "created_at": repr(job.created_at),
            }
            with self.r.pipeline(transaction=True) as p:
                p.hset(self.meta_key(batch_id), mapping=fields)
                p.zadd(self.index_key(who.id), {batch_id: job.created_at})
                p.execute()
        except BaseException:
            if hasattr(source, "close"):
                source.close()
            try:  # nothing half-created: no job without its batch
                self.store.delete(batch_id)
            except Exception:  # noqa: BLE001 - the job store repairs an orphan (submission_interrupted)
                log.exception("could not remove job %s after a failed create", batch_id)
            raise
        self._background(f"batchery-submit-{batch_id[-8:]}", self._submit, submitter, source)
        return self.view(batch_id, fields, job)

    def _submitter(self) -> Submitter:
        return Submitter(self.store, self.broker, self.client.app, self.settings, chunk_size=self.chunk_size)

    def _open_source(self, tenant_id: str, file_id: str) -> Any:
        """The stored input file for the submitter: its local path, or a binary reader (close it)."""
        files = _files(self.state)
        path = files.local_path(tenant_id, file_id)
        return path if path is not None else files.open(tenant_id, file_id)

    def _submit(self, submitter: Submitter, source: Any) -> None:
        try:
            submitter.submit(source)
        except Exception:  # noqa: BLE001 - the submitter has failed the job (submission_interrupted)
            log.exception("batch %s: reading its input file failed", submitter.job_id)
        finally:
            if hasattr(source, "close"):
                source.close()

    def _background(self, name: str, target, *args) -> None:
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the background threads (tests)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                threads = list(self._threads)
            if not threads or time.monotonic() >= deadline:
                return
            threads[0].join(max(0.0, deadline - time.monotonic()))

    # -- read -------------------------------------------------------------------------------------
    def meta(self, who: Tenant, batch_id: str) -> dict[str, str]:
        """The batch's hash, if it is the caller's (else a 404, the same as for one that does not exist)."""
        raw = self.r.hgetall(self.meta_key(batch_id)) if batch_id.startswith("batch_") else {}
        meta = {_s(k): _s(v) for k, v in raw.items()}
        if not meta or meta.get("tenant") != who.id:
            raise not_found("batch", batch_id)
        return meta

    def retrieve(self, who: Tenant, batch_id: str) -> dict:
        meta = self.meta(who, batch_id)
        job = self._job(batch_id, meta)
        if job is None:
            raise not_found("batch", batch_id)
        return self.view(batch_id, meta, job)

    def _job(self, batch_id: str, meta: dict[str, str]) -> BatchJob | None:
        """The job's state, the window enforced (``expire`` once it has passed) and the output files started
        when it has ended. None: the job is gone (its TTL ran out)."""
        try:
            job = self.store.status(batch_id, repair=False)
            if job.status == "validating":
                self._resume_if_dead(batch_id, meta)
            elif job.status in ("finalizing", "cancelling"):  # what a dead finalizer or canceller left
                job = self.store.status(batch_id)
            ends = job.window_ends_at
            if not job.is_terminal and ends is not None and self.store.server_time() >= ends:
                self.store.expire(batch_id)  # records the lines not started (their counts change, if not the status)
                job = self.store.status(batch_id, repair=False)
        except JobNotFound:
            return None
        if job.is_terminal and not meta.get("files_done"):
            self._start_files(batch_id, meta, job)
        return job

    def _resume_if_dead(self, batch_id: str, meta: dict[str, str]) -> None:
        """A ``validating`` batch whose submitter stopped beating (the API replica reading its file died): this
        replica takes the submission over, in a background thread, and goes on from the last chunk recorded
        (``Submitter.resume``; of several replicas, one wins the take-over)."""
        beat = self.r.hget(self.store.key(batch_id), "submit_beat")
        if beat is None or self.store.server_time() - float(_s(beat)) <= self.resume_after_s:
            return
        with self._lock:
            if batch_id in self._resuming:
                return
            self._resuming.add(batch_id)
        self._background(f"batchery-resume-{batch_id[-8:]}", self._resume, batch_id, meta)

    def _resume(self, batch_id: str, meta: dict[str, str]) -> None:
        try:
            try:
                source = self._open_source(meta["tenant"], meta["input_file_id"])
            except APIError:  # the input file was deleted meanwhile: the batch cannot go on
                self.store.end_submit(
                    batch_id,
                    None,
                    None,
                    [
                        {
                            "code": "submission_interrupted",
                            "message": "the API stopped reading the input file, which was deleted before the "
                            "submission could go on",
                            "line": None,
                        }
                    ],
                    stale_s=self.resume_after_s,
                )
                return
            submitter = self._submitter()
            try:
                if submitter.resume(
                    batch_id, source, endpoint=meta["endpoint"], require_valid=True, stale_s=self.resume_after_s
                ):
                    log.warning("batch %s: its submitter had stopped; this API process went on with it", batch_id)
            except Exception:  # noqa: BLE001 - the submitter has failed the job (submission_interrupted)
                log.exception("batch %s: resuming its submission failed", batch_id)
            finally:
                if hasattr(source, "close"):
                    source.close()
        finally:
            with self._lock:
                self._resuming.discard(batch_id)

    def cancel(self, who: Tenant, batch_id: str) -> dict:
        self.meta(who, batch_id)  # the caller's, or a 404
        try:
            self.store.cancel(batch_id)
        except JobNotFound:
            raise not_found("batch", batch_id) from None
        return self.retrieve(who, batch_id)

    def list(self, who: Tenant, after: str | None, limit: int) -> dict:
        index = self.index_key(who.id)
        start = 0
        if after:
            rank = self.r.zrevrank(index, after)
            if rank is None:
                raise not_found("batch", after, param="after")
            start = rank + 1
        data: list[dict] = []
        gone: list[str] = []
        while len(data) <= limit:
            ids = [_s(i) for i in self.r.zrevrange(index, start, start + limit - len(data))]
            if not ids:
                break
            start += len(ids)
            with self.r.pipeline(transaction=False) as p:
                for i in ids:
                    p.hgetall(self.meta_key(i))
                raws = p.execute()
            for i, raw in zip(ids, raws):
                meta = {_s(k): _s(v) for k, v in raw.items()}
                job = self._job(i, meta) if meta else None
                if job is None:
                    gone.append(i)
                    continue
                data.append(self.view(i, meta, job))
        if gone:
            self.r.zrem(index, *gone)
        return list_page(data[:limit], len(data) > limit)

    # -- the Batch object -------------------------------------------------------------------------
    def view(self, batch_id: str, meta: dict[str, str], job: BatchJob) -> dict:
        """OpenAI's Batch object for the job (Unix-second timestamps)."""
        status: str = job.status
        files_pending = job.is_terminal and status != "failed" and not meta.get("files_done")
        ended_at = {k: getattr(job, k) for k in ("completed_at", "expired_at", "cancelled_at", "failed_at")}
        if files_pending:
            ended_at[ENDED_AT[status]] = None
            status = UNTIL_FILES[status]
        finalizing_at = job.finalizing_at
        if files_pending and status == "finalizing" and finalizing_at is None:
            finalizing_at = job.expired_at  # an expired job goes straight to its end: finalizing from then
        errors = None
        if job.errors:
            errors = {
                "object": "list",
                "data": [{"code": e.code, "message": e.message, "line": e.line, "param": None} for e in job.errors],
            }
        u = job.usage
        return {
            "id": batch_id,
            "object": "batch",
            "endpoint": meta.get("endpoint"),
            "model": job.model or self.settings.model,
            "errors": errors,
            "input_file_id": meta.get("input_file_id"),
            "completion_window": meta.get("completion_window"),
            "status": status,
            "output_file_id": meta.get("output_file_id") or None,
            "error_file_id": meta.get("error_file_id") or None,
            "created_at": _ts(job.created_at),
            "in_progress_at": _ts(job.in_progress_at),
            "expires_at": None if job.window_s is None else int(job.created_at) + int(job.window_s),
            "finalizing_at": _ts(finalizing_at),
            "completed_at": _ts(ended_at["completed_at"]),
            "failed_at": _ts(ended_at["failed_at"]),
            "expired_at": _ts(ended_at["expired_at"]),
            "cancelling_at": _ts(job.cancelling_at),
            "cancelled_at": _ts(ended_at["cancelled_at"]),
            "request_counts": job.request_counts.model_dump(),
            "usage": {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
                },
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens,
            },
            "metadata": json.loads(meta["metadata"]) if meta.get("metadata") else None,
        }

    # -- output files -----------------------------------------------------------------------------
    def _start_files(self, batch_id: str, meta: dict[str, str], job: BatchJob) -> None:
        """Write the ended job's output and error files, once across every replica: the caller that takes the
        lock writes them in a background thread; everyone else (and this caller) shows the batch finalizing."""
        if job.status == "failed":  # no files; the batch's errors say why
            self._files_done(keys=[self.meta_key(batch_id)], args=["", "", self._ttl(batch_id)])
            meta["files_done"] = "1"
            return
        token = uuid.uuid4().hex
        if not self.r.set(self.files_lock_key(batch_id), token, nx=True, px=int(FILES_LOCK_S * 1000)):
            return
        self._background(f"batchery-output-{batch_id[-8:]}", self._write_files, batch_id, meta["tenant"], token)

    def _write_files(self, batch_id: str, tenant_id: str, token: str) -> None:
        lock = self.files_lock_key(batch_id)
        files = _files(self.state)
        made: list[str] = []
        try:
            job = self.store.status(batch_id, repair=False)
            ids = []
            for errors, name, count in (
                (False, "output", job.request_counts.completed),
                (True, "error", job.request_counts.failed),
            ):
                if count == 0:
                    ids.append("")
                    continue
                obj = files.create_from_chunks(
                    tenant_id,
                    f"{batch_id}_{name}.jsonl",
                    OUTPUT_PURPOSE,
                    self._chunks(batch_id, errors, lock, token),
                )
                made.append(obj["id"])
                ids.append(obj["id"])
            if not self._files_done(keys=[self.meta_key(batch_id)], args=[*ids, self._ttl(batch_id)]):
                for file_id in made:  # another writer got there first (this one's lock had lapsed)
                    files.delete(tenant_id, file_id)
        except Exception:  # noqa: BLE001 - the next retrieve tries again
            log.exception("batch %s: writing its output files failed; the next retrieve tries again", batch_id)
            for file_id in made:
                try:
                    files.delete(tenant_id, file_id)
                except Exception:  # noqa: BLE001
                    pass
        finally:
            self._unlock(keys=[lock], args=[token])

    def _chunks(self, batch_id: str, errors: bool, lock: str, token: str) -> Iterator[bytes]:
        """The job's records of one kind, in input order, as JSONL in pieces of about ``CHUNK_BYTES``; the
        lock is refreshed with each piece."""
        buf: list[bytes] = []
        size = 0
        for rec in self.client.batch_results(batch_id):  # merged with the records the workers moved to the store
            if (rec.get("error") is not None) != errors:
                continue
            line = json.dumps(rec, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"
            buf.append(line)
            size += len(line)
            if size >= CHUNK_BYTES:
                self._refresh(keys=[lock], args=[token, int(FILES_LOCK_S * 1000)])
                yield b"".join(buf)
                buf, size = [], 0
        if buf:
            yield b"".join(buf)

    def _ttl(self, batch_id: str) -> int:
        """The job's remaining TTL (its batch hash goes with it)."""
        ttl = int(self.r.ttl(self.store.key(batch_id)))
        return ttl if ttl > 0 else self.store.ttl


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _ts(t: float | None) -> int | None:
    return None if t is None else int(t)


def _files(st: ApiState):
    return files_of(st)


def batches_of(st: ApiState) -> Batches:
    """The app's ``Batches``, built on first use."""
    b = st.extras.get("batches")
    if b is None:
        with _build_lock:
            b = st.extras.get("batches")
            if b is None:
                b = st.extras["batches"] = Batches(st)
    return b


_build_lock = threading.Lock()


def _state(request: Request) -> ApiState:
    return request.app.state.batchery


def _service(request: Request) -> Batches:
    return batches_of(_state(request))


@router.post("/batches")
def create_batch(body: CreateBatch, who: Tenant = Depends(tenant), svc: Batches = Depends(_service)) -> dict:
    return svc.create(who, body)


@router.get("/batches")
def list_batches(
    after: str | None = Query(default=None, max_length=200),
    limit: int = Query(default=DEFAULT_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
    who: Tenant = Depends(tenant),
    svc: Batches = Depends(_service),
) -> dict:
    return svc.list(who, after, limit)


@router.get("/batches/{batch_id}")
def retrieve_batch(batch_id: str, who: Tenant = Depends(tenant), svc: Batches = Depends(_service)) -> dict:
    return svc.retrieve(who, batch_id)


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, who: Tenant = Depends(tenant), svc: Batches = Depends(_service)) -> dict:
    return svc.cancel(who, batch_id)
