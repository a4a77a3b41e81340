"""The response bodies: chat completions and completions, their choices, logprobs, usage and timing."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


# -- responses --------------------------------------------------------------------------------
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class PromptTokensDetails(_Open):
    cached_tokens: int = 0


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Timing(_Open):
    """Batchery extension: wall-clock timestamps (``time.time()``) of one request on the worker."""

    task_started_at: float
    engine_added_at: float
    engine_finished_at: float
    attempt: int = 0  # 0 = first attempt; n = n-th retry
    # an opaque id of the worker process that ran it (a hash, never its host name): which lines shared a worker
    worker: str | None = None


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Open):
    content: list[TokenLogprob] | None = None


class ToolCallFunctionOut(_Open):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(_Open):
    """A call the model made (``message.tool_calls[i]``); ids are ``call_<hex>``."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunctionOut


class AssistantMessage(_Open):
    """``content`` is None when the answer is only tool calls, as in OpenAI."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Open):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Open):
    """``choices`` holds ``n`` choices, ``choices[i].index == i``; ``usage`` counts the prompt once."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timing: Timing | None = None


class CompletionLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(_Open):
    index: int = 0
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None


class Completion(_Open):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timing: Timing | None = None
