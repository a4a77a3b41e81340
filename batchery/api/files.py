"""OpenAI's Files API: ``POST /v1/files``, ``GET /v1/files``, ``GET /v1/files/{id}``,
``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``; and ``Files``, the service the batches code uses
for input and output files (``files_of(state)``).

**Uploads stream.** The multipart body is parsed as it arrives (``python_multipart``'s streaming parser over
``request.stream()``, fed in pieces of at most ``READ_CHUNK``), and the file part goes straight into a
storage writer (``batchery.jobs.storage``): never whole in memory, no spooled temporary copy, and the size
limit (``BATCHERY_API__MAX_FILE_BYTES``, 200 MB as at OpenAI) is enforced as the bytes come. For purpose
``batch`` every non-blank line must be a JSON object, checked while streaming: the first line that is not
refuses the upload (400 naming the line). The body of each request line is the batch's to validate (its
error file names the line, as OpenAI's does), and so is a line longer than ``BATCHERY_BATCH__MAX_LINE_BYTES``
(passed unparsed, so a line never costs more memory than that). A refused or interrupted upload leaves
nothing: the storage writer is aborted, and the Redis record is written only after the object is committed.

**Metadata in Redis** (under ``BATCHERY_API__KEY_PREFIX``): hash ``{p}:file:{id}`` (``tenant``, ``bytes``,
``created_at``, ``filename``, ``purpose``, ``status``) and per tenant the sorted sets ``{p}:files:{tenant}``
and ``{p}:files:{tenant}:{purpose}``, every member at score 0 so they sort by id. Ids are
``file-`` + 12 hex digits of the creation time in milliseconds + 16 random hex digits: sorting by id is
sorting by ``created_at``, and an ``after`` cursor keeps its place in the list even once that file is
deleted (``ZRANGE ... BYLEX``). Another tenant's file is a 404 exactly like a missing one."""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from batchery.api.auth import Tenant, tenant
from batchery.api.errors import APIError, invalid, list_page, not_found
from batchery.api.state import ApiState, state
from batchery.broker.connection import redis_from_url
from batchery.contract.batch import json_type, loads
from batchery.jobs.storage import FileStorage, LocalStorage, ObjectTooLarge, ObjectWriter

log = logging.getLogger("batchery.api.files")

router = APIRouter()

UPLOAD_PURPOSES = ("batch",)  # what a client may upload
PURPOSES = ("batch", "batch_output")  # what files can be: output and error files of batches are batch_output
FILE_ID_RE = re.compile(r"file-[0-9a-f]{28}")
READ_CHUNK = 1 << 20  # bytes of the request handed to the parser at once; also the download block
MAX_PARTS = 16  # parts in one multipart body
MAX_FIELD_BYTES = 1024  # a text field (purpose)
MULTIPART_SLACK = 64 << 10  # a body this much over the file limit is refused from its Content-Length alone
DRAIN_BYTES = 16 << 20  # after refusing, read (and drop) up to this much more, so the client sees the answer
LIST_LIMIT = 10_000


def new_file_id(now_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    return f"file-{ms:012x}{secrets.token_hex(8)}"


def created_at_of(file_id: str) -> int:
    return int(file_id[5:17], 16) // 1000


def clean_filename(raw: str | None) -> str:
    """The last path component, printable characters only, at most 255 (browsers and curl may send a path)."""
    name = (raw or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable()).strip()[:255]
    return name or "upload.jsonl"


def file_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The file is larger than the limit of {limit} bytes (BATCHERY_API__MAX_FILE_BYTES).",
        param="file",
        code="file_too_large",
    )


def bad_file(message: str) -> APIError:
    return invalid(message, param="file", code="invalid_file_format")


def check_upload_purpose(purpose: str) -> str:
    if purpose not in UPLOAD_PURPOSES:
        raise invalid(
            f"purpose {purpose[:100]!r} is not supported: Batchery serves the Batch API, upload with purpose 'batch'",
            param="purpose",
        )
    return purpose


class JsonlCheck:
    """Checks, as the bytes stream by, that every non-blank line is a JSON object (UTF-8, no NaN or
    Infinity, a byte-order mark allowed on line 1, as ``batchery.contract.batch`` reads lines). Raises the
    400 at the first line that is not. Holds at most one line of ``max_line_bytes``; a longer line is
    counted but not parsed (the batch reports it)."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self.line = 0  # physical lines seen, blank ones included
        self.requests = 0  # non-blank lines
        self._buf = bytearray()
        self._skipping = False  # inside a line longer than max_line_bytes

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                self._partial(data, start)
                return
            if self._skipping:
                self._skipping = False
                self.line += 1
                self.requests += 1
            elif self._buf:
                self._buf += data[start : nl + 1]
                raw = bytes(self._buf)
                self._buf.clear()
                self._check(raw)
            else:
                self._check(data[start : nl + 1])
            start = nl + 1

    def _partial(self, data: bytes, start: int) -> None:
        if self._skipping or start >= len(data):
            return
        self._buf += data[start:]
        if len(self._buf) > self.max_line_bytes + 2:  # room for "\r\n"
            self._buf.clear()
            self._skipping = True

    def finish(self) -> None:
        """The end of the file: its last line may have no newline."""
        if self._skipping:
            self._skipping = False
            self.line += 1
            self.requests += 1
        elif self._buf:
            raw = bytes(self._buf)
            self._buf.clear()
            self._check(raw)

    def _check(self, raw: bytes) -> None:
        self.line += 1
        if len(raw.rstrip(b"\r\n")) > self.max_line_bytes:
            self.requests += 1
            return
        if not raw.strip():
            return
        self.requests += 1
        why = self._why_not_object(raw)
        if why is not None:
            raise bad_file(f"line {self.line} is not a JSON object: {why}")

    def _why_not_object(self, raw: bytes) -> str | None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
        if self.line == 1 and text.startswith("\ufeff"):
            text = text[1:]
        try:
            obj = loads(text)
        except RecursionError:
            return "invalid JSON: nested too deeply"
        except ValueError as exc:
            return f"invalid JSON: {str(exc)[:200]}"
        if not isinstance(obj, dict):
            return f"got {json_type(obj)}"
        return None


class Files:
    """Files of every tenant: metadata in Redis (a client with ``decode_responses=True``), bytes in a
    ``FileStorage``. Every method that takes a tenant answers 404 (``APIError``) for a file that does not
    exist or is another tenant's. Blocking calls: from async code run them in a thread."""

    def __init__(
        self, redis: Any, prefix: str, storage: FileStorage, *, max_file_bytes: int, max_line_bytes: int
    ) -> None:
        self.r = redis
        self.prefix = prefix
        self.storage = storage
        self.max_file_bytes = max_file_bytes
        self.max_line_bytes = max_line_bytes

    def close(self) -> None:
        """Close the Redis connections (the app's shutdown calls it)."""
        self.r.close()

    def _key(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def _index(self, tenant: str, purpose: str | None = None) -> str:
        return f"{self.prefix}:files:{tenant}" + (f":{purpose}" if purpose else "")

    # -- writing --------------------------------------------------------------------------------------
    def record(self, tenant: str, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        """Publish a committed object as a file of ``tenant`` (the hash and both listings at once)."""
        meta = {
            "tenant": tenant,
            "bytes": str(size),
            "created_at": str(created_at_of(file_id)),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self._key(file_id), mapping=meta)
        pipe.zadd(self._index(tenant), {file_id: 0})
        pipe.zadd(self._index(tenant, purpose), {file_id: 0})
        pipe.execute()
        log.info("file %s created: %d bytes, purpose %s, tenant %s", file_id, size, purpose, tenant)
        return self._public(file_id, meta)

    def create_from_chunks(self, tenant: str, filename: str, purpose: str, chunks: Iterable[bytes]) -> dict[str, Any]:
        """A new file from ``chunks`` (no size limit: batch output and error files); the File object.
        ``ValueError`` for a purpose files cannot have."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}")
        file_id = new_file_id()
        size = self.storage.write_stream(file_id, chunks)
        try:
            return self.record(tenant, file_id, clean_filename(filename), purpose, size)
        except BaseException:
            self.storage.delete(file_id)
            raise

    # -- reading --------------------------------------------------------------------------------------
    def _meta(self, tenant: str, file_id: str) -> dict[str, str]:
        if not isinstance(file_id, str) or not FILE_ID_RE.fullmatch(file_id):
            raise not_found("file", str(file_id))
        meta = self.r.hgetall(self._key(file_id))
        if not meta or meta.get("tenant") != tenant:
            raise not_found("file", file_id)
        return meta

    @staticmethod
    def _public(file_id: str, meta: dict[str, str]) -> dict[str, Any]:
        return {
            "id": file_id,
            "object": "file",
            "bytes": int(meta["bytes"]),
            "created_at": int(meta["created_at"]),
            "filename": meta["filename"],
            "purpose": meta["purpose"],
            "status": meta.get("status", "processed"),
            "expires_at": None,
            "status_details": None,
        }

    def get(self, tenant: str, file_id: str) -> dict[str, Any]:
        """The File object."""
        return self._public(file_id, self._meta(tenant, file_id))

    def open(self, tenant: str, file_id: str) -> BinaryIO:
        """A binary reader of the file's content (close it)."""
        return self.content(tenant, file_id)[1]

    def content(self, tenant: str, file_id: str) -> tuple[dict[str, Any], BinaryIO]:
        """The File object and a binary reader of its content."""
        obj = self.get(tenant, file_id)
        try:
            return obj, self.storage.open(file_id)
        except FileNotFoundError:
            log.warning("file %s has a record but no object in the storage", file_id)
            raise not_found("file", file_id) from None

    def local_path(self, tenant: str, file_id: str) -> Path | None:
        """The content's path on this machine (LocalStorage), or None where the storage is remote."""
        self._meta(tenant, file_id)
        return self.storage.local_path(file_id)

    def list(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        limit: int = LIST_LIMIT,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        """OpenAI's list shape, newest first by default; ``after`` is the last id of the previous page."""
        if after is not None and not FILE_ID_RE.fullmatch(after):
            raise invalid(f"after must be a file id (file-...), got {after[:100]!r}", param="after")
        if purpose is not None and purpose not in PURPOSES:
            ids: list[str] = []
        else:
            edge = "-" if order == "asc" else "+"
            start = f"({after}" if after else edge
            end = "+" if order == "asc" else "-"
            ids = self.r.zrange(
                self._index(tenant, purpose), start, end, desc=order == "desc", bylex=True, offset=0, num=limit + 1
            )
        has_more = len(ids) > limit
        ids = ids[:limit]
        pipe = self.r.pipeline(transaction=False)
        for file_id in ids:
            pipe.hgetall(self._key(file_id))
        data = [
            self._public(file_id, meta)
            for file_id, meta in zip(ids, pipe.execute() if ids else [], strict=True)
            if meta and meta.get("tenant") == tenant
        ]
        return list_page(data, has_more)

    # -- deleting -------------------------------------------------------------------------------------
    def delete(self, tenant: str, file_id: str) -> dict[str, Any]:
        """Remove the record (the file is gone for every reader at once), then the object."""
        meta = self._meta(tenant, file_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self._key(file_id))
        pipe.zrem(self._index(tenant), file_id)
        pipe.zrem(self._index(tenant, meta["purpose"]), file_id)
        removed = pipe.execute()[0]
        if not removed:  # a concurrent delete won
            raise not_found("file", file_id)
        self.storage.delete(file_id)
        log.info("file %s deleted, tenant %s", file_id, tenant)
        return {"id": file_id, "object": "file", "deleted": True}


_BUILD_LOCK = threading.Lock()


def files_of(st: ApiState) -> Files:
    """The process's ``Files`` (built on first use, kept in ``state.extras["files"]``): metadata on the
    result backend's Redis (where the job store lives), objects in ``LocalStorage(storage_dir)``."""
    files = st.extras.get("files")
    if files is None:
        with _BUILD_LOCK:
            files = st.extras.get("files")
            if files is None:
                s = st.settings
                files = Files(
                    redis_from_url(str(s.result_backend or s.broker_url), decode_responses=True),
                    s.api.key_prefix,
                    LocalStorage(s.api.storage_dir),
                    max_file_bytes=s.api.max_file_bytes,
                    max_line_bytes=s.batch.max_line_bytes,
                )
                st.extras["files"] = files
    return files


# -- the upload ---------------------------------------------------------------------------------------
class Upload:
    """One ``POST /v1/files`` body, parsed as it streams. Blocking (the storage writes): the route feeds it
    from a thread. A part named ``file`` is the file, ``purpose`` the purpose; anything else is refused."""

    def __init__(self, files: Files, tenant: str, boundary: bytes) -> None:
        self.files = files
        self.tenant = tenant
        self.parser = MultipartParser(
            boundary,
            callbacks={
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_end": self._end,
            },
        )
        self.fields: dict[str, str] = {}
        self.file_id: str | None = None
        self.filename = ""
        self.writer: ObjectWriter | None = None
        self.check = JsonlCheck(files.max_line_bytes)
        self._parts = 0
        self._name: str | None = None  # the current part's field name
        self._hname = bytearray()
        self._hvalue = bytearray()
        self._headers: dict[str, str] = {}
        self._text = bytearray()
        self._ended = False
        self.received = 0  # bytes of the body fed so far

    # -- parser callbacks -------------------------------------------------------------------------------
    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise invalid(f"too many parts in the multipart body (at most {MAX_PARTS}): send a file and a purpose")
        self._headers = {}
        self._name = None
        self._text.clear()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._hname.decode("latin-1").strip().lower()] = self._hvalue.decode("latin-1")
        self._hname.clear()
        self._hvalue.clear()

    def _headers_finished(self) -> None:
        kind, opts = parse_options_header(self._headers.get("content-disposition"))
        name = opts.get(b"name", b"").decode("utf-8", "replace")
        if kind != b"form-data" or not name:
            raise invalid("every part of the multipart body needs Content-Disposition: form-data; name=...")
        self._name = name
        if name == "file":
            if self.file_id is not None:
                raise invalid("send one file per upload", param="file")
            filename = opts.get(b"filename")
            self.filename = clean_filename(filename.decode("utf-8", "replace") if filename else None)
            self.file_id = new_file_id()
            self.writer = self.files.storage.writer(self.file_id, self.files.max_file_bytes)
        elif name.startswith("expires_after"):
            raise invalid(
                "expires_after is not supported: Batchery keeps files until they are deleted", param="expires_after"
            )
        elif name != "purpose":
            raise invalid(f"unknown field {name[:100]!r}: an upload has a file and a purpose", param=name[:100])

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "file":
            assert self.writer is not None
            piece = data[start:end]
            self.check.feed(piece)
            try:
                self.writer.write(piece)
            except ObjectTooLarge:
                raise file_too_large(self.files.max_file_bytes) from None
        else:
            self._text += data[start:end]
            if len(self._text) > MAX_FIELD_BYTES:
                raise invalid(f"{self._name} is longer than {MAX_FIELD_BYTES} bytes", param=self._name)

    def _part_end(self) -> None:
        if self._name == "file":
            self.check.finish()
            return
        try:
            value = self._text.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise invalid(f"{self._name} is not valid UTF-8", param=self._name) from None
        assert self._name is not None
        self.fields[self._name] = value
        if self._name == "purpose":
            check_upload_purpose(value)

    def _end(self) -> None:
        self._ended = True

    # -- driving ------------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        self.received += len(data)
        try:
            self.parser.write(data)
        except MultipartParseError as exc:
            raise invalid(f"malformed multipart body: {exc}") from None

    def finish(self) -> dict[str, Any]:
        """The body has ended: check it is whole, commit the object, then publish the record."""
        try:
            self.parser.finalize()
        except MultipartParseError as exc:
            raise invalid(f"malformed multipart body: {exc}") from None
        if not self._ended:
            raise invalid("the multipart body ended before its closing boundary")
        purpose = self.fields.get("purpose")
        if purpose is None:
            raise invalid("purpose is required: upload with purpose 'batch'", param="purpose")
        if self.writer is None or self.file_id is None:
            raise invalid("file is required: a multipart part named 'file'", param="file")
        if self.writer.written == 0:
            raise bad_file("the file is empty")
        if self.check.requests == 0:
            raise bad_file("the file has no request lines (every line is blank)")
        size = self.writer.commit()
        try:
            return self.files.record(self.tenant, self.file_id, self.filename, purpose, size)
        except BaseException:
            self.files.storage.delete(self.file_id)
            raise

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


def multipart_boundary(content_type: str | None) -> bytes:
    kind, opts = parse_options_header(content_type)
    boundary = opts.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise invalid("POST /v1/files takes multipart/form-data: a part 'file' and a part 'purpose'")
    return boundary


async def _feed_body(chunks: AsyncIterator[bytes], upload: Upload) -> APIError | None:
    """Feed the body to ``upload`` in pieces of up to ``READ_CHUNK``. After a refusal, read on (dropping the
    bytes, up to ``DRAIN_BYTES``) so the client, still sending, reads the answer instead of a reset."""
    pending = bytearray()
    drained = 0
    async for chunk in chunks:
        pending += chunk
        if len(pending) < READ_CHUNK:
            continue
        data = bytes(pending)
        pending.clear()
        try:
            await run_in_threadpool(upload.feed, data)
        except APIError as exc:
            upload.abort()
            async for rest in chunks:
                drained += len(rest)
                if drained > DRAIN_BYTES:
                    break
            return exc
    if pending:
        try:
            await run_in_threadpool(upload.feed, bytes(pending))
        except APIError as exc:
            return exc
    return None


# -- routes -------------------------------------------------------------------------------------------
@router.post("/files")
async def create_file(request: Request, who: Tenant = Depends(tenant)) -> dict[str, Any]:
    files = files_of(state(request))
    upload = Upload(files, who.id, multipart_boundary(request.headers.get("content-type")))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > files.max_file_bytes + MULTIPART_SLACK:
        raise file_too_large(files.max_file_bytes)
    try:
        error = await _feed_body(request.stream(), upload)
        if error is None:
            return await run_in_threadpool(upload.finish)
    except ClientDisconnect:  # nobody reads an answer now; not a bug worth a traceback
        upload.abort()
        log.info("an upload (tenant %s) was cut off by the client after %d bytes", who.id, upload.received)
        raise APIError(400, "the client disconnected during the upload") from None
    except BaseException:
        upload.abort()
        raise
    upload.abort()
    raise error


@router.get("/files")
def list_files(
    request: Request,
    who: Tenant = Depends(tenant),
    purpose: str | None = None,
    limit: int = Query(default=LIST_LIMIT, ge=1, le=LIST_LIMIT),
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    return files_of(state(request)).list(who.id, purpose=purpose, limit=limit, after=after, order=order)


@router.get("/files/{file_id}")
def retrieve_file(file_id: str, request: Request, who: Tenant = Depends(tenant)) -> dict[str, Any]:
    return files_of(state(request)).get(who.id, file_id)


@router.get("/files/{file_id}/content")
def file_content(file_id: str, request: Request, who: Tenant = Depends(tenant)) -> StreamingResponse:
    obj, f = files_of(state(request)).content(who.id, file_id)

    def blocks() -> Iterator[bytes]:
        with f:
            while block := f.read(READ_CHUNK):
                yield block

    media = "application/jsonl" if obj["filename"].endswith(".jsonl") else "application/octet-stream"
    headers = {
        "Content-Length": str(obj["bytes"]),
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(obj['filename'])}",
    }
    return StreamingResponse(blocks(), media_type=media, headers=headers)


@router.delete("/files/{file_id}")
def delete_file(file_id: str, request: Request, who: Tenant = Depends(tenant)) -> dict[str, Any]:
    return files_of(state(request)).delete(who.id, file_id)
