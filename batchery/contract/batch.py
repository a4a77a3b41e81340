"""Batch lines in the OpenAI Batch format: parsing, validation and the output/error records.

Input line::

    {"custom_id": str, "method": "POST",
     "url": "/v1/chat/completions" | "/v1/completions" | "/v1/responses" | "/v1/embeddings", "body": {...}}

Output line (one per request that ran)::

    {"id", "custom_id", "response": {"status_code": 200, "request_id",
                                     "body": <ChatCompletion|Completion|Response|EmbeddingResponse>},
     "error": null}

Error line (a line refused while submitting, or a request the worker refused or could not finish)::

    {"id", "custom_id" (null if unknown), "response": null or a 4xx/5xx response, "error": {"code", "message", "line"}}

``line`` is the 1-based physical line number in the input file, blank lines included, so an editor
jumps straight to it. Pure and light: no Redis, no Celery, no torch (the client imports it)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, NoReturn

from pydantic import BaseModel, ValidationError

from batchery.contract.responses import ResponsesRequest
from batchery.contract.schemas import ChatCompletionRequest, CompletionRequest, describe_validation_error
from batchery.contract.schemas.embeddings import EmbeddingRequest

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
RESPONSES_URL = "/v1/responses"
EMBEDDINGS_URL = "/v1/embeddings"  # served by workers of an embedding model (a chat model's refuses each line)
ENDPOINTS: dict[str, type[BaseModel]] = {
    CHAT_URL: ChatCompletionRequest,
    COMPLETIONS_URL: CompletionRequest,
    RESPONSES_URL: ResponsesRequest,
    EMBEDDINGS_URL: EmbeddingRequest,
}
# OpenAI Batch endpoints that Batchery does not serve, with the reason the error gives
NOT_SERVED: dict[str, str] = {
    "/v1/moderations": "moderations are not served: Batchery runs no moderation model",
}
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
MAX_CUSTOM_ID_CHARS = 512

# error codes: refused while submitting ...
INVALID_JSON = "invalid_json"  # not JSON (or not UTF-8, or NaN/Infinity, or nested too deep)
INVALID_LINE = "invalid_line"  # JSON, but not an object with exactly the four fields above
MISSING_CUSTOM_ID = "missing_custom_id"  # absent, not a string, empty or too long
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
UNSUPPORTED_METHOD = "unsupported_method"
UNSUPPORTED_URL = "unsupported_url"
INVALID_BODY = "invalid_body"
LINE_TOO_LARGE = "line_too_large"
# ... and recorded by the job store for a line its job's completion window ended before it started (OpenAI's code)
BATCH_EXPIRED = "batch_expired"
# ... and reported by the worker (see batchery.tasks.batch_line)
# Worker-side codes are the error values of batchery.contract.outcomes.Outcome (context_length_exceeded,
# invalid_request, deadline_exceeded, engine_error, engine_crash, internal_error).


@dataclass(frozen=True, slots=True)
class BatchLine:
    """A valid request line."""

    line: int
    custom_id: str
    url: str
    body: dict


@dataclass(frozen=True, slots=True)
class LineError:
    """A line refused while submitting."""

    line: int
    custom_id: str | None
    code: str
    message: str


class _TooLarge:
    """Stands for a physical line longer than the limit (its bytes are skipped, never held)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def loads(raw: bytes | str) -> Any:
    """JSON as batch lines take it: NaN and Infinity are refused (not valid JSON)."""
    return json.loads(raw, parse_constant=_refuse_constant)


def parse_line(
    raw: bytes | str, line: int, seen: set[str] | SeenIds | None = None, *, max_line_bytes: int | None = None
) -> BatchLine | LineError | None:
    """One physical line (with or without its newline) -> a request, an error record, or None for
    a blank line. Never raises. ``seen`` collects the custom_ids so far, for duplicate detection."""
    if max_line_bytes is not None:
        content = raw.rstrip("\r\n") if isinstance(raw, str) else raw.rstrip(b"\r\n")
        size = len(content.encode("utf-8", "surrogatepass")) if isinstance(content, str) else len(content)
        if size > max_line_bytes:
            return too_large(line, size, max_line_bytes)
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw  # UTF-8 only, as OpenAI
        if line == 1 and text.startswith("\ufeff"):  # a byte-order mark some editors write
            text = text[1:]
        obj = loads(text)
    except RecursionError:
        return LineError(line, None, INVALID_JSON, "invalid JSON: nested too deeply")
    except UnicodeDecodeError as exc:
        return LineError(line, None, INVALID_JSON, f"the line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        return LineError(line, None, INVALID_JSON, f"invalid JSON: {exc}")
    return parse_object(obj, line, seen)


def too_large(line: int, size: int, max_line_bytes: int) -> LineError:
    return LineError(
        line,
        None,
        LINE_TOO_LARGE,
        f"the line has {size} bytes; the limit is {max_line_bytes} (BATCHERY_BATCH__MAX_LINE_BYTES)",
    )


class SeenIds:
    """The custom_ids of a job so far, for duplicate detection over millions of lines: each id is kept as a 96-bit
    digest (BLAKE2b) in one open-addressing table (linear probing, at most three quarters full), 16-24 bytes an id
    where a ``set`` of the strings takes about 90. Two different ids share a digest with a probability below 1e-15
    in a 10,000,000-line job. ``in`` and ``add``, as a set."""

    _W = 12  # bytes a digest
    _EMPTY = bytes(_W)

    def __init__(self) -> None:
        self._table = bytearray(self._W * 1024)
        self._mask = 1023
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _digest(self, custom_id: str) -> bytes:
        d = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=self._W).digest()
        return d if d != self._EMPTY else b"\x01" * self._W  # the empty slot's bytes stand for no id

    def _find(self, table: bytearray, mask: int, d: bytes) -> tuple[int, bool]:
        """(slot, found): where ``d`` is, or the free slot it would take."""
        w = self._W
        i = int.from_bytes(d[:8], "little") & mask
        while True:
            cur = table[i * w : i * w + w]
            if cur == d:
                return i, True
            if cur == self._EMPTY:
                return i, False
            i = (i + 1) & mask

    def __contains__(self, custom_id: object) -> bool:
        return isinstance(custom_id, str) and self._find(self._table, self._mask, self._digest(custom_id))[1]

    def add(self, custom_id: str) -> None:
        self.add_new(custom_id)

    def add_new(self, custom_id: str) -> bool:
        """Add ``custom_id``; False if it was here already (one lookup where ``in`` then ``add`` take two)."""
        d = self._digest(custom_id)
        i, found = self._find(self._table, self._mask, d)
        if found:
            return False
        self._table[i * self._W : (i + 1) * self._W] = d
        self._n += 1
        if 4 * self._n > 3 * (self._mask + 1):
            self._grow()
        return True

    def _grow(self) -> None:
        w, old = self._W, self._table
        mask = 2 * (self._mask + 1) - 1
        table = bytearray(w * (mask + 1))
        for o in range(0, len(old), w):
            d = bytes(old[o : o + w])
            if d != self._EMPTY:
                i, _ = self._find(table, mask, d)
                table[i * w : (i + 1) * w] = d
        self._table, self._mask = table, mask


def _first_time(seen: set[str] | SeenIds, custom_id: str) -> bool:
    if isinstance(seen, SeenIds):
        return seen.add_new(custom_id)
    if custom_id in seen:
        return False
    seen.add(custom_id)
    return True


def parse_object(obj: Any, line: int, seen: set[str] | SeenIds | None = None) -> BatchLine | LineError:
    """A decoded line (or an item of an iterable submission) -> a request or an error record."""
    if not isinstance(obj, dict):
        return LineError(line, None, INVALID_LINE, f"expected a JSON object, got {json_type(obj)}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        what = "missing" if custom_id is None else f"must be a non-empty string, got {json_type(custom_id)}"
        if custom_id == "":
            what = "must not be empty"
        return LineError(line, None, MISSING_CUSTOM_ID, f"custom_id {what}")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(
            line,
            None,
            MISSING_CUSTOM_ID,
            f"custom_id has {len(custom_id)} characters; the limit is {MAX_CUSTOM_ID_CHARS}",
        )
    if seen is not None and not _first_time(seen, custom_id):
        return LineError(
            line, custom_id, DUPLICATE_CUSTOM_ID, f"custom_id {custom_id!r} already appeared earlier in this job"
        )
    extra = sorted(str(k) for k in obj.keys() - LINE_KEYS)
    if extra:
        return LineError(
            line,
            custom_id,
            INVALID_LINE,
            f"unknown field(s) {', '.join(map(repr, extra[:5]))}; a line has custom_id, method, url and body",
        )
    method = obj.get("method")
    if method != "POST":
        return LineError(line, custom_id, UNSUPPORTED_METHOD, f'method must be "POST", got {_short(method)}')
    url = obj.get("url")
    schema = ENDPOINTS.get(url) if isinstance(url, str) else None
    if schema is None or not isinstance(url, str):
        supported = ", ".join(ENDPOINTS)
        if isinstance(url, str) and url in NOT_SERVED:
            return LineError(line, custom_id, UNSUPPORTED_URL, f"{NOT_SERVED[url]}; supported: {supported}")
        return LineError(line, custom_id, UNSUPPORTED_URL, f"url must be one of {supported}, got {_short(url)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(line, custom_id, INVALID_BODY, f"body must be a JSON object, got {json_type(body)}")
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        return LineError(line, custom_id, INVALID_BODY, describe_validation_error(exc))
    except RecursionError:
        return LineError(line, custom_id, INVALID_BODY, "invalid request body: nested too deeply")
    return BatchLine(line, custom_id, url, body)


def iter_physical_lines(f: IO[bytes], max_line_bytes: int) -> Iterator[tuple[int, bytes | _TooLarge]]:
    """Stream ``(line_number, bytes)`` from a binary file. A line over ``max_line_bytes`` (newline
    not counted) comes as a ``_TooLarge`` marker; its bytes are read in bounded pieces and dropped,
    never held whole."""
    line = 0
    limit = max_line_bytes + 2  # room for "\r\n"
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        line += 1
        if len(raw) > limit and not raw.endswith(b"\n"):  # cut short: the line goes on
            size = len(raw)
            while not raw.endswith(b"\n"):
                raw = f.readline(1 << 16)
                if not raw:
                    break
                size += len(raw)
            yield line, _TooLarge(size - (len(raw) - len(raw.rstrip(b"\r\n"))))
            continue
        size = len(raw.rstrip(b"\r\n"))
        yield line, (_TooLarge(size) if size > max_line_bytes else raw)


def parse_stream(
    f: IO[bytes], max_line_bytes: int, seen: set[str] | SeenIds | None = None
) -> Iterator[BatchLine | LineError]:
    """Every non-blank line of a binary file, as a request or an error record, in order."""
    seen = SeenIds() if seen is None else seen
    for line, raw in iter_physical_lines(f, max_line_bytes):
        if isinstance(raw, _TooLarge):
            yield too_large(line, raw.size, max_line_bytes)
            continue
        item = parse_line(raw, line, seen)
        if item is not None:
            yield item


# -- records --------------------------------------------------------------------------------------
def record_id(job_id: str, line: int) -> str:
    """The deterministic id of a job's line record (the same on every retry or redelivery)."""
    return f"batch_req_{job_id.removeprefix('batch_')}_{line}"


def output_record(job_id: str, line: int, custom_id: str, request_id: str, body: dict) -> dict:
    return {
        "id": record_id(job_id, line),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(
    job_id: str,
    line: int,
    custom_id: str | None,
    code: str,
    message: str,
    *,
    status_code: int | None = None,
    request_id: str | None = None,
) -> dict:
    """An error line. With ``status_code`` it carries an OpenAI-style error response too."""
    response = None
    if status_code is not None:
        kind = "invalid_request_error" if 400 <= status_code < 500 else "server_error"
        response = {
            "status_code": status_code,
            "request_id": request_id,
            "body": {"error": {"message": message, "type": kind, "param": None, "code": code}},
        }
    return {
        "id": record_id(job_id, line),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message, "line": line},
    }


def line_error_record(job_id: str, err: LineError) -> dict:
    return error_record(job_id, err.line, err.custom_id, err.code, err.message)


def json_type(v: Any) -> str:
    """How an error message names a JSON value's type."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _short(v: Any, limit: int = 80) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        s = json_type(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."
