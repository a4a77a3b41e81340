"""The Celery task functions. Thin, like web views: validate, submit, wait, shape.

They are registered by ``batchery.worker.app.make_app`` as ``batchery.chat_completion`` and
``batchery.completion``. At run time they find the process's engine service and settings on the
app (``app.batchery_service``, ``app.batchery_settings``), set by the worker entry point.

Error policy:
- a bad body (or a prompt the engine refuses) -> ``InvalidRequest``, never retried;
- the deadline passes -> the request is aborted in the engine -> ``DeadlineExceeded``, not retried
  (time spent waiting in the quarantine lane for a turn to run alone does not count, up to what the
  visibility timeout allows: ``max_held``);
- ``EngineFailure`` -> retried with exponential backoff and jitter, up to ``max_retries``, on any
  worker of the queue; one that was in the failing step is a strike, and a request with
  ``BATCHERY_QUARANTINE__AFTER`` strikes runs alone (``batchery.tasks.quarantine``);
- ``EngineCrash`` (it failed alone too: poison) -> fails for good, not retried;
- a request whose deliveries died with their worker process ``BATCHERY_MAX_DELIVERIES`` times
  (``batchery.tasks.redelivery``) -> ``EngineCrash`` before it runs, its message dead-lettered;
- this worker cannot serve (``EngineUnavailable``: warm shutdown, or its engine is given up
  on) -> the message goes back to the queue untouched (``Reject(requeue=True)``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from celery.exceptions import Reject
from pydantic import BaseModel, ValidationError

from batchery.contract.errors import (
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
)
from batchery.contract.generation import GenerationRequest, GenerationResult
from batchery.contract.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    Timing,
    TokenLogprob,
    TopLogprob,
    Usage,
    check_timeout,
    describe_validation_error,
)
from batchery.tasks import quarantine, redelivery


def chat_completion(self, body: dict, timeout: float | None = None) -> dict:
    """OpenAI Chat Completions body in, ``ChatCompletion`` (as a dict) out."""
    return run_chat(self, body, timeout)


def completion(self, body: dict, timeout: float | None = None) -> dict:
    """OpenAI Completions body in, ``Completion`` (as a dict) out."""
    return run_completion(self, body, timeout)


def run_chat(
    task, body: dict, timeout: float | None = None, *, priority: int = 0, cancelled: Callable[[], bool] | None = None
) -> dict:
    """Validate, generate and shape one chat completion for ``task`` (a bound Celery task). Shared
    by the chat task and the batch-line task; ``cancelled`` is polled while waiting (batch jobs)."""
    started = time.time()
    req = _validate(ChatCompletionRequest, body)
    gen = GenerationRequest(messages=req.engine_messages(), sampling=req.sampling(), priority=priority)
    result = _generate(task, gen, timeout, cancelled)
    return shape_chat(
        req, result, task.request.id, task.app.batchery_settings.model, started, task.request.retries or 0
    ).model_dump(mode="json")


def run_completion(
    task, body: dict, timeout: float | None = None, *, priority: int = 0, cancelled: Callable[[], bool] | None = None
) -> dict:
    """``run_chat`` for a (legacy) completion."""
    started = time.time()
    req = _validate(CompletionRequest, body)
    if isinstance(req.prompt, str):
        gen = GenerationRequest(prompt=req.prompt, sampling=req.sampling(), priority=priority)
    else:
        gen = GenerationRequest(prompt_token_ids=list(req.prompt), sampling=req.sampling(), priority=priority)
    result = _generate(task, gen, timeout, cancelled)
    return shape_completion(
        req, result, task.request.id, task.app.batchery_settings.model, started, task.request.retries or 0
    ).model_dump(mode="json")


# -- the steps ------------------------------------------------------------------------------------
def _validate(schema: type[BaseModel], body):
    if not isinstance(body, dict):
        raise InvalidRequest(f"invalid request body: expected a JSON object, got {type(body).__name__}")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


def resolve_timeout(timeout, settings) -> float:
    """The attempt's deadline: the request's, checked against the worker's limit, else the default."""
    checked = check_timeout(timeout, settings.max_task_timeout)
    return settings.task_timeout if checked is None else checked


def retry_delay(retries: int, settings) -> float:
    """Exponential backoff with jitter: base * 2**retries, capped, then scaled by U(0.5, 1)."""
    delay = min(settings.retry_backoff_max, settings.retry_backoff * (2**retries))
    return delay * random.uniform(0.5, 1.0)


def _generate(task, gen: GenerationRequest, timeout, cancelled: Callable[[], bool] | None = None) -> GenerationResult:
    settings = task.app.batchery_settings
    deadline = resolve_timeout(timeout, settings)
    service = getattr(task.app, "batchery_service", None)
    try:
        if service is None:
            raise EngineUnavailable("this process has no engine service (not a batchery worker)")
        gen = quarantine.prepare(task, gen)
        with redelivery.attempt(task, gen, deadline) as (gen, left):  # counted before the engine sees it
            return service.generate(gen, left, cancelled=cancelled, max_held=max_held(left, settings))
    except EngineUnavailable as exc:
        # This worker cannot serve (shutting down, or its engine is gone for good): hand the
        # message back untouched for another worker, without spending a retry.
        raise Reject(str(exc), requeue=True) from None
    except EngineFailure as exc:
        quarantine.record(task, exc)
        retries = task.request.retries or 0
        if retries >= settings.max_retries:
            raise EngineFailure(f"{exc} -- gave up after {retries} retries") from None
        raise task.retry(exc=exc, countdown=retry_delay(retries, settings), max_retries=settings.max_retries) from exc


def max_held(deadline: float, settings) -> float:
    """How much longer than its deadline a request may take for the time it waits in the quarantine lane:
    until just before the broker would deliver its message again (``BATCHERY_VISIBILITY_TIMEOUT``)."""
    vt = settings.visibility_timeout or 0.0
    return max(0.0, vt - deadline - settings.retry_backoff_max - 1.0)


# -- shaping ------------------------------------------------------------------------------------
def _usage(r: GenerationResult) -> Usage:
    return Usage(
        prompt_tokens=r.num_prompt_tokens,
        completion_tokens=len(r.token_ids),
        total_tokens=r.num_prompt_tokens + len(r.token_ids),
        prompt_tokens_details=PromptTokensDetails(cached_tokens=r.num_cached_tokens),
    )


def _timing(r: GenerationResult, started: float, attempt: int) -> Timing:
    return Timing(
        task_started_at=started, engine_added_at=r.added_at, engine_finished_at=r.finished_at, attempt=attempt
    )


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def shape_chat(
    req: ChatCompletionRequest, r: GenerationResult, task_id: str, model: str, started: float, attempt: int = 0
) -> ChatCompletion:
    logprobs = None
    if r.logprobs is not None:
        logprobs = ChoiceLogprobs(
            content=[
                TokenLogprob(
                    token=e["token"],
                    logprob=e["logprob"],
                    bytes=_bytes(e["token"]),
                    top_logprobs=[
                        TopLogprob(token=t["token"], logprob=t["logprob"], bytes=_bytes(t["token"]))
                        for t in e["top"][: req.top_logprobs or 0]
                    ],
                )
                for e in r.logprobs
            ]
        )
    return ChatCompletion(
        id=f"chatcmpl-{task_id}",
        created=int(started),
        model=model,
        choices=[
            ChatChoice(
                index=0, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason, logprobs=logprobs
            )
        ],
        usage=_usage(r),
        timing=_timing(r, started, attempt),
    )


def shape_completion(
    req: CompletionRequest, r: GenerationResult, task_id: str, model: str, started: float, attempt: int = 0
) -> Completion:
    logprobs = None
    if r.logprobs is not None:
        offsets, pos = [], 0
        for e in r.logprobs:
            offsets.append(pos)
            pos += len(e["token"])
        logprobs = CompletionLogprobs(
            tokens=[e["token"] for e in r.logprobs],
            token_logprobs=[e["logprob"] for e in r.logprobs],
            top_logprobs=[{t["token"]: t["logprob"] for t in e["top"][: req.logprobs or 0]} for e in r.logprobs],
            text_offset=offsets,
        )
    return Completion(
        id=f"cmpl-{task_id}",
        created=int(started),
        model=model,
        choices=[CompletionChoice(index=0, text=r.text, finish_reason=r.finish_reason, logprobs=logprobs)],
        usage=_usage(r),
        timing=_timing(r, started, attempt),
    )
