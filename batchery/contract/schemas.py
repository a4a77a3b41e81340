"""The message contract: OpenAI-style request bodies (validated at the boundary) and responses.

Requests accept the OpenAI Chat Completions / Completions fields that apply to a local engine,
plus vLLM's sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``). Unknown fields are refused, so a typo is an error rather
than silently ignored. Sizes are bounded so one message cannot exhaust a worker."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batchery.contract.errors import InvalidRequest

MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 1024  # content parts per request, all messages together
MAX_TEXT_CHARS = 1_000_000  # total characters of prompt text per request (a content part counts at least 1)
MAX_PROMPT_TOKEN_IDS = 1 << 17
MAX_TOKENS_LIMIT = 1 << 17
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
MAX_NAME_CHARS = 256
SEED_MAX = 2**63 - 1

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
ShortText = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


def describe_validation_error(exc: ValidationError, what: str = "request body") -> str:
    """One readable line per problem: ``field.path: message``."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(body)"
        msg = err.get("msg", "invalid")
        msg = msg.removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}")
    return f"invalid {what}: " + "; ".join(lines)


def check_timeout(timeout: object, limit: float | None = None) -> float | None:
    """A request's deadline in seconds (None: the worker's default), or ``InvalidRequest`` naming the
    problem: not a positive number, or above ``limit`` (the worker's ``BATCHERY_MAX_TASK_TIMEOUT``)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidRequest(f"timeout must be a positive number of seconds, got {timeout!r}")
    if limit is not None and timeout > limit:
        raise InvalidRequest(f"timeout {timeout:g} s exceeds this worker's limit of {limit:g} s")
    return float(timeout)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_max_length=MAX_TEXT_CHARS)


# -- requests ---------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: ShortText | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, v: Any) -> Any:
        if isinstance(v, list):
            if len(v) > MAX_CONTENT_PARTS:  # refused before a model is built for each part
                raise ValueError(f"a message may have at most {MAX_CONTENT_PARTS} content parts, got {len(v)}")
            for part in v:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported; only text")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    @property
    def num_parts(self) -> int:
        return len(self.content) if isinstance(self.content, list) else 0

    @property
    def num_chars(self) -> int:
        """Characters toward ``MAX_TEXT_CHARS``: an empty part still counts one, so none is free."""
        if isinstance(self.content, list):
            return sum(max(1, len(p.text)) for p in self.content)
        return len(self.text())


class _SamplingFields(_Strict):
    """Fields shared by both request kinds; their names and ranges match ``SamplingParams``."""

    model: ShortText | None = None  # informational: the queue decides the model
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: str | list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = None
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    n: int = 1
    stream: bool = False
    user: ShortText | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v:
                raise ValueError("stop must not be an empty string")
            if len(v) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
            return [v]
        if v is not None and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are supported, got {len(v)}")
        return v

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n must be 1 (one choice per request; send {v} requests instead), got {v}")
        return v

    @field_validator("stream")
    @classmethod
    def _check_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("stream is not supported: results are delivered whole through the result backend")
        return v

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> dict:
        return dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
        )


class ChatCompletionRequest(_SamplingFields):
    """Body of ``batchery.chat_completion`` (OpenAI Chat Completions)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("max_tokens and max_completion_tokens disagree; set one")
        parts = sum(m.num_parts for m in self.messages)
        if parts > MAX_CONTENT_PARTS:
            raise ValueError(f"the messages hold {parts} content parts; the limit is {MAX_CONTENT_PARTS}")
        total = sum(m.num_chars for m in self.messages)
        if total > MAX_TEXT_CHARS:
            raise ValueError(
                f"the messages hold {total} characters (an empty content part counts 1); the limit is {MAX_TEXT_CHARS}"
            )
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_messages(self) -> list[dict]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out

    def sampling(self) -> dict:
        """``SamplingParams`` keyword arguments; ``max_tokens`` None means "fill the context"."""
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(self.effective_max_tokens, lp)


class CompletionRequest(_SamplingFields):
    """Body of ``batchery.completion`` (OpenAI legacy Completions): one prompt, text or token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if len(v) == 1 and isinstance(v[0], (str, list)):
                raise ValueError("send one prompt per request (a list of prompts is not supported)")
            if not v:
                raise ValueError("the prompt is empty")
            if len(v) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} prompt token ids are supported")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v):
                raise ValueError("a token-id prompt must be a list of non-negative integers")
        elif isinstance(v, str):
            if not v:
                raise ValueError("the prompt is empty")
            if len(v) > MAX_TEXT_CHARS:
                raise ValueError(f"the prompt has {len(v)} characters; the limit is {MAX_TEXT_CHARS}")
        return v

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"best_of must be 1, got {v}")
        return v

    def sampling(self) -> dict:
        return self._sampling(self.max_tokens, self.logprobs)


# -- responses --------------------------------------------------------------------------------
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


FinishReason = Literal["stop", "length", "abort", "error"]


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


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Open):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Open):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Open):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Open):
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


# -- batch jobs -------------------------------------------------------------------------------
BatchStatus = Literal["validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled"]
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})


class RequestCounts(_Open):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(_Open):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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
    expires_at: float | None = None
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
