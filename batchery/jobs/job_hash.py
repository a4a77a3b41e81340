"""A job's Redis hash read into a ``BatchJob`` (the counts, usage, timestamps and metadata the scripts write)."""

from __future__ import annotations

import json

from batchery.contract.schemas import BatchJob

_FLOAT_FIELDS = (
    "created_at",
    "started_at",
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "cancelling_at",
    "cancelled_at",
    "expired_at",
    "expires_at",
    "window_s",
    "window_ends_at",
)


def as_text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_job_or_none(raw: dict) -> BatchJob | None:
    """The job the hash holds, or None for a hash that is no job (no id or status, a field that does not parse)."""
    try:
        return parse_job(raw)
    except (KeyError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def parse_job(raw: dict) -> BatchJob:
    d = {as_text(k): as_text(v) for k, v in raw.items()}
    num = lambda f: int(d.get(f) or 0)  # noqa: E731
    out = {
        "id": d["id"],
        "status": d["status"],
        "queue": d.get("queue", ""),
        "model": d.get("model") or None,
        "input_file": d.get("input_file") or None,
        "request_counts": {"total": num("total"), "completed": num("completed"), "failed": num("failed")},
        "usage": {
            "prompt_tokens": num("prompt_tokens"),
            "completion_tokens": num("completion_tokens"),
            "total_tokens": num("prompt_tokens") + num("completion_tokens"),
            # of the prompt tokens, those the engines' prefix caches served (the records' cached_tokens, summed)
            "prompt_tokens_details": {"cached_tokens": num("cached_tokens")},
        },
        "metadata": json.loads(d.get("metadata") or "{}"),
        "errors": json.loads(d.get("errors") or "[]"),
        "timeout": float(d["timeout"]) if d.get("timeout") else None,
        "priority": num("priority"),
        "expired_lines": num("expired_lines"),
    }
    for f in _FLOAT_FIELDS:
        if d.get(f):
            out[f] = float(d[f])
    return BatchJob.model_validate(out)
