"""The Celery task functions. Thin, like web views: validate, submit, wait, shape.

They are registered by ``batchery.worker.app.make_app`` as ``batchery.chat_completion``,
``batchery.completion`` and ``batchery.responses``. At run time they find the process's engine
service and settings on the app (``app.batchery_service``, ``app.batchery_settings``), set by the
worker entry point.

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

import hashlib
import os
import random
import socket
import threading
import time
from collections.abc import Callable

from celery.exceptions import Reject
from pydantic import BaseModel, ValidationError

from batchery.contract.errors import (
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
)
from batchery.contract.generation import GenerationChoice, GenerationRequest, GenerationResult, LogprobEntry
from batchery.contract.responses import ResponsesRequest, response_from_chat
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
from batchery.contract.tools import parse_tool_calls, tool_call_constraint
from batchery.tasks import quarantine, redelivery


def chat_completion(self, body: dict, timeout: float | None = None) -> dict:
    """OpenAI Chat Completions body in, ``ChatCompletion`` (as a dict) out."""
    return run_chat(self, body, timeout)


def completion(self, body: dict, timeout: float | None = None) -> dict:
    """OpenAI Completions body in, ``Completion`` (as a dict) out."""
    return run_completion(self, body, timeout)


def responses(self, body: dict, timeout: float | None = None) -> dict:
    """OpenAI Responses body in, ``Response`` (as a dict) out."""
    return run_responses(self, body, timeout)


def run_chat(
    task, body: dict, timeout: float | None = None, *, priority: int = 0, cancelled: Callable[[], bool] | None = None
) -> dict:
    """Validate, generate and shape one chat completion for ``task`` (a bound Celery task). Shared
    by the chat task and the batch-line task; ``cancelled`` is polled while waiting (batch jobs)."""
    started = time.time()
    req = _validate(ChatCompletionRequest, body)
    result = _generate(task, chat_generation(req, priority), timeout, cancelled)
    return shape_chat(
        req, result, task.request.id, task.app.batchery_settings.model, started, task.request.retries or 0
    ).model_dump(mode="json")


def run_responses(
    task, body: dict, timeout: float | None = None, *, priority: int = 0, cancelled: Callable[[], bool] | None = None
) -> dict:
    """``run_chat`` for a Responses API body: it is run as the chat completion it amounts to
    (``ResponsesRequest.to_chat``) and that completion is reshaped as a ``Response``."""
    started = time.time()
    rreq = _validate(ResponsesRequest, body)
    try:
        req = rreq.to_chat()
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None
    except ValueError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from None
    result = _generate(task, chat_generation(req, priority), timeout, cancelled)
    model = task.app.batchery_settings.model
    chat = shape_chat(req, result, task.request.id, model, started, task.request.retries or 0)
    return response_from_chat(chat, response_id=f"resp_{task.request.id}", created_at=started, model=model, req=rreq)


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
def chat_generation(req: ChatCompletionRequest, priority: int = 0) -> GenerationRequest:
    """What the engine service is asked for a chat request: its messages and tools for the chat
    template, and its sampling. With ``tool_choice`` ``"required"`` or a named function, the
    output is constrained to tool calls (``batchery.contract.tools.tool_call_constraint``); that
    constraint wins over a ``response_format`` (or vLLM constraint) of the same request, as the
    answer is then a call, and ``response_format`` shapes only a text answer. A forced call is one
    call unless ``parallel_tool_calls`` is true: given the choice, a small model keeps calling
    until ``max_tokens`` (seen with SmolLM2), so several calls are allowed only when asked for."""
    sampling = req.sampling()
    tools = req.engine_tools()
    try:
        choice = req.engine_tool_choice()
        constraint = tool_call_constraint(tools, choice, parallel=req.parallel_tool_calls is True)
    except ValueError as exc:
        raise InvalidRequest(f"invalid request body: tool_choice: {exc}") from None
    if constraint is not None:
        sampling["structured_outputs"] = {"structural_tag": constraint}
    return GenerationRequest(messages=req.engine_messages(), tools=tools, sampling=sampling, priority=priority)


def _parses_tool_calls(req: ChatCompletionRequest) -> bool:
    """Whether the output is read for tool calls: the request has tools and did not say ``none``."""
    return bool(req.tools) and req.engine_tool_choice() != "none"


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
def _choices(r: GenerationResult) -> list[GenerationChoice]:
    """The result's choices (a result without them is its one choice)."""
    return r.choices or [GenerationChoice(0, r.text, r.token_ids, r.finish_reason, r.logprobs)]


def _usage(r: GenerationResult) -> Usage:
    """The prompt counts once, however many choices share it; completion tokens are summed over them."""
    completion = sum(len(c.token_ids) for c in _choices(r))
    return Usage(
        prompt_tokens=r.num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=r.num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=r.num_cached_tokens),
    )


_worker_id: tuple[int, str] | None = None  # (pid, id): a forked child makes its own
_worker_id_lock = threading.Lock()


def worker_id() -> str:
    """This worker process's id in results: opaque (a hash of host, pid and start), so that outputs tell which lines
    ran on one worker (and shared its prefix cache) without naming the machine to the tenant. Made once per process,
    under a lock: task threads ask for it at the same moment (``functools.cache`` would let two of them each make
    and return their own)."""
    global _worker_id
    pid = os.getpid()
    with _worker_id_lock:
        if _worker_id is None or _worker_id[0] != pid:
            seed = f"{socket.gethostname()}:{pid}:{time.time_ns()}"
            _worker_id = (pid, hashlib.sha256(seed.encode()).hexdigest()[:12])
        return _worker_id[1]


def _timing(r: GenerationResult, started: float, attempt: int) -> Timing:
    return Timing(
        task_started_at=started,
        engine_added_at=r.added_at,
        engine_finished_at=r.finished_at,
        attempt=attempt,
        worker=worker_id(),
    )


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def _chat_logprobs(req: ChatCompletionRequest, entries: list[LogprobEntry] | None) -> ChoiceLogprobs | None:
    if entries is None:
        return None
    return ChoiceLogprobs(
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
            for e in entries
        ]
    )


def _chat_choice(req: ChatCompletionRequest, c: GenerationChoice, tools: bool) -> ChatChoice:
    """One choice; with ``tools``, its ``<tool_call>`` blocks become ``message.tool_calls`` and a
    choice that stopped after calling has ``finish_reason`` ``"tool_calls"`` (one cut off by
    ``max_tokens`` keeps ``"length"``, its complete calls parsed)."""
    content: str | None = c.text
    finish = c.finish_reason
    message = AssistantMessage(content=content)
    if tools:
        content, calls = parse_tool_calls(c.text)
        if calls:
            message = AssistantMessage(content=content, tool_calls=calls)
            if finish == "stop":
                finish = "tool_calls"
    return ChatChoice(index=c.index, message=message, finish_reason=finish, logprobs=_chat_logprobs(req, c.logprobs))


def shape_chat(
    req: ChatCompletionRequest, r: GenerationResult, task_id: str, model: str, started: float, attempt: int = 0
) -> ChatCompletion:
    tools = _parses_tool_calls(req)
    return ChatCompletion(
        id=f"chatcmpl-{task_id}",
        created=int(started),
        model=model,
        choices=[_chat_choice(req, c, tools) for c in _choices(r)],
        usage=_usage(r),
        timing=_timing(r, started, attempt),
    )


def _completion_logprobs(req: CompletionRequest, entries: list[LogprobEntry] | None) -> CompletionLogprobs | None:
    if entries is None:
        return None
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return CompletionLogprobs(
        tokens=[e["token"] for e in entries],
        token_logprobs=[e["logprob"] for e in entries],
        top_logprobs=[{t["token"]: t["logprob"] for t in e["top"][: req.logprobs or 0]} for e in entries],
        text_offset=offsets,
    )


def shape_completion(
    req: CompletionRequest, r: GenerationResult, task_id: str, model: str, started: float, attempt: int = 0
) -> Completion:
    return Completion(
        id=f"cmpl-{task_id}",
        created=int(started),
        model=model,
        choices=[
            CompletionChoice(
                index=c.index,
                text=c.text,
                finish_reason=c.finish_reason,
                logprobs=_completion_logprobs(req, c.logprobs),
            )
            for c in _choices(r)
        ],
        usage=_usage(r),
        timing=_timing(r, started, attempt),
    )
