"""Errors that cross the queue. They travel through the JSON result backend as
``(module, type, args)`` and are rebuilt on the client, so each takes exactly one message string.

Light on purpose: the client imports this module. Each type names the ``Outcome`` it stands for
and the HTTP status of its batch error record."""

from __future__ import annotations

from batchery.contract.outcomes import Outcome


class BatcheryError(Exception):
    """Base for every error a Batchery task reports."""

    retryable = False
    outcome = Outcome.INTERNAL_ERROR  # the batch error code and metrics label of this error
    status_code = 500  # of its batch error record

    def __init__(self, message: str = "") -> None:
        super().__init__(message)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return self.message


class InvalidRequest(BatcheryError):
    """The request body (or the prompt it yields) is invalid. Never retried."""

    outcome = Outcome.INVALID_REQUEST
    status_code = 400


class ContextLengthExceeded(InvalidRequest):
    """The prompt does not fit the model's context (``max_model_len``), with room to generate."""

    outcome = Outcome.CONTEXT_LENGTH_EXCEEDED
    status_code = 400


class DeadlineExceeded(BatcheryError):
    """The task's deadline passed; the request was aborted in the engine. Not retried."""

    outcome = Outcome.DEADLINE_EXCEEDED
    status_code = 504


class EngineFailure(BatcheryError):
    """The engine failed (step raised, watchdog fired, or it is being rebuilt). Retryable; once the
    retries are spent, this is what the client sees."""

    outcome = Outcome.ENGINE_ERROR
    status_code = 500
    retryable = True
    struck = False  # set on the failures of the requests that were in the failing step (quarantine)


class EngineCrash(BatcheryError):
    """Quarantine's verdict: the request made the engine fail every time it was in a step, in the
    end also when it ran alone, so it is poison for this engine. Names the exception. Never
    retried (batch code ``engine_crash``)."""

    outcome = Outcome.ENGINE_CRASH
    status_code = 500


class EngineUnavailable(EngineFailure):
    """The worker's engine is not serving (rebuilding, given up, or shutting down)."""


class WorkerShuttingDown(EngineUnavailable):
    """The worker is in warm shutdown; the task puts its message back on the queue."""


class RequestCancelled(BatcheryError):
    """The batch job the request belongs to was cancelled (or failed); the request was aborted in
    the engine. Worker-internal: it never reaches a client."""

    outcome = Outcome.CANCELLED
    status_code = 500


class TaskExpired(BatcheryError):
    """The task's ``expires`` passed before a worker started it (client side)."""


class ResultTimeout(BatcheryError, TimeoutError):
    """The client gave up waiting for the result (``get(timeout=...)``); the task may still run."""
