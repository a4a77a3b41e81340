"""Batch jobs as OpenAI's Batch API shows them: status, request counts, usage and errors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from batchery.contract.schemas.results import PromptTokensDetails, _Open

# -- batch jobs -------------------------------------------------------------------------------
BatchStatus = Literal[
    "validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"
]
# ``expired``: the job's completion window ended before every line had started; the lines that had not are
# error records (``batch_expired``), the ones that had finished and kept their results (OpenAI's Batch API).
TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})


class RequestCounts(_Open):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(_Open):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # of the prompt tokens, those from the prefix cache


class BatchError(_Open):
    code: str
    message: str
    line: int | None = None


class BatchJob(_Open):
    """A batch job's state (OpenAI's Batch object, plus Batchery's queue, model and usage).

    ``request_counts.total`` grows while the job is ``validating`` (the file is still being read and
    enqueued) and is final from ``in_progress`` on. Timestamps are Unix-time floats from the Redis server's clock."""

    id: str
    object: Literal["batch"] = "batch"
    status: BatchStatus
    input_file: str | None = None
    queue: str
    model: str | None = None
    created_at: float
    started_at: float | None = None  # Batchery: when a worker started the first line
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    expired_at: float | None = None  # when it ended ``expired``
    expires_at: float | None = None  # when its keys expire (the TTL, counted from its end)
    window_s: float | None = None  # its completion window, seconds (None: no window, it never expires)
    window_ends_at: float | None = None  # created_at + window_s: lines not started by then are not run
    expired_lines: int = 0  # lines recorded ``batch_expired`` (counted in request_counts.failed too)
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: BatchUsage = Field(default_factory=BatchUsage)
    errors: list[BatchError] = Field(default_factory=list)  # job-level (the job failed); line errors are records
    metadata: dict[str, str] = Field(default_factory=dict)
    timeout: float | None = None  # per-request deadline, seconds (None: the worker's default)
    priority: int = 0

    @property
    def num_done(self) -> int:
        return self.request_counts.completed + self.request_counts.failed

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES
