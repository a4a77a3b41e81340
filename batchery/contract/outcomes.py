"""How a task attempt ended: one enum, shared by the batch-line records, the worker log and the metrics.

The worker-side batch error codes (``context_length_exceeded``, ``deadline_exceeded``, ...) are these
values, and each error type of ``batchery.contract.errors`` names its outcome, so nobody parses
strings back."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    """The ``outcome`` label of ``batchery_requests_total``; the error ones are also batch error codes."""

    SUCCESS = "success"
    INVALID_REQUEST = "invalid_request"  # 400: the worker refused it
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # 400: only the worker has the tokenizer
    DEADLINE_EXCEEDED = "deadline_exceeded"  # 504
    ENGINE_ERROR = "engine_error"  # 500: the engine failed it and retries are spent
    ENGINE_CRASH = "engine_crash"  # 500: quarantine found it poison: it made the engine fail even alone
    INTERNAL_ERROR = "internal_error"  # 500: a bug; a batch line is still accounted for
    CANCELLED = "cancelled"  # its batch job was cancelled
    SKIPPED = "skipped"  # a batch line not run: already recorded, or its job stopped or gone
    RETRY = "retry"  # retried after an engine failure
    REQUEUED = "requeued"  # handed back to the queue: this worker could not serve


@dataclass(frozen=True)
class LineOutcome:
    """What a batch-line task did: its return value, read by the worker log and the metrics."""

    outcome: Outcome  # how the attempt ended
    detail: str = ""  # for the log: the job's status after the write, why it was skipped, ...
    prompt_tokens: int = 0  # of a line that generated (counted once its record is stored)
    completion_tokens: int = 0

    def __str__(self) -> str:
        return f"{self.outcome.value} ({self.detail})" if self.detail else self.outcome.value

    __repr__ = __str__  # the worker log prints the return value


@dataclass(frozen=True)
class ChunkOutcome:
    """What a chunk task (``batchery.batch_lines``) did: how many of its lines ended each way. The metrics count
    each line as a ``batchery.batch_line`` request, as if it had travelled alone."""

    outcomes: dict[Outcome, int]
    detail: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __str__(self) -> str:
        if len(self.outcomes) == 1 and self.detail:
            return f"{next(iter(self.outcomes)).value} ({self.detail})"
        return self.detail or ", ".join(f"{n} {o.value}" for o, n in self.outcomes.items())

    __repr__ = __str__  # the worker log prints the return value
