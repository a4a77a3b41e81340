"""The worker's Celery app: the shared configuration (``batchery.broker.celery_app``) with the task
functions of ``batchery.tasks`` registered on it. No import-time side effects: call ``make_app``."""

from __future__ import annotations

from celery import Celery

from batchery.broker.celery_app import make_celery
from batchery.contract.errors import DeadlineExceeded, EngineCrash, InvalidRequest
from batchery.contract.names import (
    BATCH_LINE_TASK,
    BATCH_LINES_TASK,
    CHAT_TASK,
    COMPLETION_TASK,
    EMBEDDINGS_TASK,
    RESPONSES_TASK,
)
from batchery.contract.settings import Settings
from batchery.tasks import batch_line, batch_lines, chat, embeddings


def make_app(settings: Settings | None = None) -> Celery:
    """A Celery app for ``settings`` (default: from the environment) with its tasks registered."""
    settings = settings or Settings()
    app = make_celery(settings)
    expected = (InvalidRequest, DeadlineExceeded, EngineCrash)  # logged without a traceback
    common = dict(
        bind=True,
        acks_late=True,
        reject_on_worker_lost=True,
        max_retries=settings.max_retries,
        throws=expected,
        resultrepr_maxsize=160,
    )
    app.task(name=CHAT_TASK, **common)(chat.chat_completion)
    app.task(name=COMPLETION_TASK, **common)(chat.completion)
    app.task(name=RESPONSES_TASK, **common)(chat.responses)
    app.task(name=EMBEDDINGS_TASK, **common)(embeddings.embeddings)
    # a batch line's outcome is its record in the job (batchery.jobs.store), not a Celery result
    app.task(name=BATCH_LINE_TASK, **{**common, "throws": ()}, ignore_result=True)(batch_line.batch_line)
    app.task(name=BATCH_LINES_TASK, **{**common, "throws": ()}, ignore_result=True)(batch_lines.batch_lines)
    app.batchery_service = None
    app.batchery_jobs = None  # batchery.tasks.batch_line.job_store, on first use
    return app
