"""Worker logging: one line per record on stderr, as text or JSON (``BATCHERY_LOG_FORMAT``).

Every record logged while a task runs carries that task's context. This covers Celery's own
lines about the task, such as ``succeeded`` and ``retry``. The context is ``task_id`` and
``task_name``; a batch line adds ``job_id``, ``line`` and ``custom_id``. It is taken from
Celery's current task, which is thread-local, so it works under the threads pool without any
call in the task code. Code outside a task can add fields with ``log_context(...)``. A record
about several requests at once, such as an engine failure, carries none.

- text: ``2025-01-01 12:00:00,123 INFO [thread] logger: message | task_id=... job_id=...``
  (the prefix is what it always was, so existing log parsers keep working);
- json: ``{"ts": "2025-01-01T12:00:00.123+00:00", "level": "INFO", "logger": ..., "thread": ...,
  "message": ..., "task_id": ..., ...}``, plus ``"exc_info"`` with the traceback. Progress bars are
  turned off. Celery still prints one plain line on stdout at shutdown (``worker: Warm shutdown``).

Passwords are masked in every line: ``scheme://user:password@`` becomes ``scheme://user:***@``,
and ``password=...`` becomes ``password=***``, whatever logged them. This is a safety net; the
worker already masks the URLs it logs itself (``batchery.contract.settings.mask_url``)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import sys
from datetime import UTC, datetime

from batchery.contract.batch import MAX_CUSTOM_ID_CHARS

TEXT_FORMAT = "%(asctime)s %(levelname)s [%(threadName)s] %(name)s: %(message)s"
CONTEXT_FIELDS = ("task_id", "task_name", "job_id", "line", "custom_id")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")

_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<pw>[^/\s]+)@")
_PARAM_PASSWORD = re.compile(
    r"(?i)\b(?P<key>password|passwd|pwd)(?P<sep>=)(?P<pw>[^&\s\"',]+)"
    r"|\b(?P<key2>requirepass)(?P<sep2>\s+)(?P<pw2>\S+)"
)

_bound: contextvars.ContextVar[dict | None] = contextvars.ContextVar("batchery_log_context", default=None)


def mask_secrets(text: str) -> str:
    """``text`` with URL passwords and ``password=...`` values replaced by ``***``."""
    if "@" in text:
        text = _URL_PASSWORD.sub(r"\g<head>:***@", text)
    low = text.lower()
    if "pass" in low or "pwd" in low:
        text = _PARAM_PASSWORD.sub(_mask_param, text)
    return text


def _mask_param(m: re.Match) -> str:
    if m.group("key") is not None:
        return f"{m.group('key')}{m.group('sep')}***"
    return f"{m.group('key2')}{m.group('sep2')}***"


@contextlib.contextmanager
def log_context(**fields):
    """Add ``fields`` to every record logged in this context (this thread, or this asyncio task)."""
    token = _bound.set({**(_bound.get() or {}), **fields})
    try:
        yield
    finally:
        _bound.reset(token)


def request_context() -> dict:
    """The context of the request being handled in this thread: the bound fields, then the
    current Celery task's id and name and, for a batch line, its job, line and custom_id."""
    fields = dict(_bound.get() or {})
    state = sys.modules.get("celery._state")  # never import celery just to log
    task = state.get_current_task() if state is not None else None
    if task is not None:
        req = task.request
        if req.id:
            fields.setdefault("task_id", req.id)
            fields.setdefault("task_name", task.name)
            kwargs = req.kwargs
            if isinstance(kwargs, dict) and "job" in kwargs:  # from the message: cut to size, never trusted
                fields.setdefault("job_id", _bounded(kwargs.get("job")))
                fields.setdefault("line", _bounded(kwargs.get("line")))
                fields.setdefault("custom_id", _bounded(kwargs.get("custom_id")))
    return fields


def _bounded(value, limit: int = MAX_CUSTOM_ID_CHARS):
    """A context value from a task message as it can go in every log line: short (``limit``: a custom_id
    as the submitter bounds it)."""
    if value is None or isinstance(value, (bool, int, float)) and len(repr(value)) <= 40:
        return value
    text = value if isinstance(value, str) else repr(value)[: limit + 1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ContextFilter(logging.Filter):
    """Puts the request context on each record (``record.batchery_context``); never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "batchery_context"):
            try:
                ctx = request_context()
                data = record.__dict__.get("data")
                if "task_id" not in ctx and isinstance(data, dict) and data.get("id") and data.get("name"):
                    # Celery's own lines outside the task's thread ("Task ...[id] received") carry it here
                    ctx.update(task_id=data["id"], task_name=data["name"])
                record.batchery_context = ctx
            except Exception:  # noqa: BLE001 - logging must never fail over its context
                record.batchery_context = {}
        return True


def _context_of(record: logging.LogRecord) -> dict:
    ctx = getattr(record, "batchery_context", None)
    if ctx is None:
        ctx = request_context()
    for name in CONTEXT_FIELDS:  # extra={"task_id": ...} given to one call wins
        value = record.__dict__.get(name)
        if value is not None:
            ctx = {**ctx, name: value}
    return {k: v for k, v in ctx.items() if v is not None}


def _kv(value) -> str:
    s = str(value)
    return s if s and not re.search(r"[\s\"'=|]", s) else json.dumps(s, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` plus `` | key=value ...`` for the request context; secrets masked."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging API
        s = super().formatMessage(record)
        ctx = _context_of(record)
        if ctx:
            s += " | " + " ".join(f"{k}={_kv(v)}" for k, v in ctx.items())
        return s

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; secrets masked in the message and the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "thread": record.threadName,
            "message": mask_secrets(record.getMessage()),
        }
        out.update(_context_of(record))
        if record.exc_info:
            out["exc_info"] = mask_secrets(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc_info"] = mask_secrets(record.exc_text)
        if record.stack_info:
            out["stack_info"] = mask_secrets(self.formatStack(record.stack_info))
        return json.dumps(out, ensure_ascii=False, default=str)


def make_handler(fmt: str = "text", stream=None) -> logging.Handler:
    """A stream handler (stderr by default) with the context filter and the ``fmt`` formatter."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    handler.batchery_handler = True
    return handler


def configure_logging(level: str = "INFO", fmt: str | None = None) -> None:
    """Log ``level`` and above from every logger to stderr in ``fmt`` (``text`` or ``json``; None:
    ``BATCHERY_LOG_FORMAT`` if valid, else text, for the lines before the settings are validated).
    Idempotent: a second call replaces the handler it installed, and leaves other handlers alone."""
    if fmt is None:
        fmt = os.environ.get("BATCHERY_LOG_FORMAT", "text").strip().lower()
        fmt = fmt if fmt in FORMATS else "text"
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "batchery_handler", False)]:
        root.removeHandler(h)
    root.addHandler(make_handler(fmt))
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings.warn(...) as log records, so JSON output stays JSON
    if fmt == "json":  # no progress bars between the JSON lines (model downloads and loading)
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
