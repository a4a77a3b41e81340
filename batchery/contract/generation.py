"""What a Celery task asks of the engine service, and what it gets back.

The boundary between the task functions (``batchery.tasks``) and the engine service
(``batchery.worker.service``): both import these types from here, so neither imports the other; the
worker's entry point hands the tasks their service (``app.batchery_service``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict


class TopLogprob(TypedDict):
    token: str
    token_id: int
    logprob: float


class LogprobEntry(TypedDict):
    """One generated token: its text, id and logprob, and the top alternatives at that position."""

    token: str
    token_id: int
    logprob: float
    top: list[TopLogprob]


@dataclass
class GenerationRequest:
    """What a task asks for. Exactly one of ``messages``, ``prompt``, ``prompt_token_ids``, ``inputs``."""

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, rendered with the messages by the chat template
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs; max_tokens None -> fill the context
    # an embeddings request's inputs (texts, or token-id lists), for a worker of a pooling model
    inputs: list[str] | list[list[int]] | None = None
    pooling: dict[str, Any] = field(default_factory=dict)  # PoolingParams kwargs (dimensions, truncate_prompt_tokens)
    priority: int = 0
    solo: bool = False  # quarantined: run alone, in engine steps of its own (one such request at a time)
    exclusive: bool = False  # with solo: nothing else in the engine while it runs (suspected of killing its process)


@dataclass
class GenerationChoice:
    """One of a request's ``n`` choices (``SamplingParams.n``), all from the same prompt."""

    index: int  # 0..n-1
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[LogprobEntry] | None  # per token; None unless asked for


@dataclass
class GenerationResult:
    """A finished request. ``text``, ``token_ids``, ``finish_reason`` and ``logprobs`` are choice
    0's (so a caller of one choice reads them as before); ``choices`` holds all ``n``."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[LogprobEntry] | None  # per token, with its top alternatives; None unless asked for
    submitted_at: float  # wall-clock times (time.time()), for latency accounting
    added_at: float
    finished_at: float
    choices: list[GenerationChoice] = field(default_factory=list)  # all n choices, by index (choice 0 first)
    embeddings: list[list[float]] | None = None  # an embeddings request's vectors, one per input, in input order
