"""Request intake: the service's record of a request in flight (``Pending``), and turning a request
(``GenerationRequest``, defined with ``GenerationResult`` in ``batchery.contract.generation``) into
engine input (token ids and ``SamplingParams``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchery.contract.errors import ContextLengthExceeded, EngineFailure, InvalidRequest
from batchery.contract.generation import GenerationChoice, GenerationRequest, GenerationResult, LogprobEntry

if TYPE_CHECKING:
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.pooling import PoolingParams
    from batchery.engine.sampling import SamplingParams
    from batchery.engine.sequence import RequestOutput

# renders one choice's engine logprob entries (None stays None): the loop's LogprobRenderer, bound to the tokenizer
LogprobRender = Callable[[Sequence[Mapping[str, Any]] | None], list[LogprobEntry] | None]


@dataclass
class Pending:
    """A submitted request whose future is not resolved yet."""

    request_id: str
    request: GenerationRequest
    future: Future[GenerationResult]
    submitted_at: float  # time.time()
    added_at: float = 0.0  # time.time() when it went into the engine (the last time, after a carry-over)
    in_engine: bool = False  # added to the current engine (False again once carried over to a new one)
    solo_failures: int = 0  # failed runs alone (quarantine)
    held_s: float = 0.0  # seconds spent waiting in the quarantine lane for a turn to run alone, so far
    held_since: float | None = None  # time.monotonic() when it began waiting there now; None: not waiting
    text: str | None = None  # the prompt as sent, for poison faults (built on first use)

    @classmethod
    def new(cls, request_id: str, request: GenerationRequest) -> Pending:
        return cls(request_id, request, Future(), time.time())

    def hold(self) -> None:
        """It begins (or goes on) waiting in the quarantine lane."""
        if self.held_since is None:
            self.held_since = time.monotonic()

    def release(self) -> None:
        """Its wait in the quarantine lane is over: the time is added to ``held_s``."""
        if self.held_since is not None:
            self.held_s += time.monotonic() - self.held_since
            self.held_since = None

    def held_seconds(self) -> float:
        """All its time in the quarantine lane so far, the wait under way included."""
        since = self.held_since
        return self.held_s + (time.monotonic() - since if since is not None else 0.0)

    def prompt_text(self) -> str | None:
        """The prompt as the client sent it: the messages' contents joined, or the prompt; None
        for token ids."""
        if self.text is None:
            req = self.request
            if req.messages is not None:
                self.text = "\n".join(str(m.get("content") or "") for m in req.messages)
            elif req.prompt is not None:
                self.text = req.prompt
            elif req.inputs is not None and all(isinstance(t, str) for t in req.inputs):
                self.text = "\n".join(str(t) for t in req.inputs)  # an embeddings request's texts
            else:
                return None
        return self.text

    def result(self, out: RequestOutput, render: LogprobRender, finished_at: float) -> GenerationResult:
        """The result of this request from the engine's output for it: a pooling engine's vectors
        (``PoolingRequestOutput``), or its ``n`` choices
        (``out.outputs``; an engine output without them is its one choice), each choice's logprobs
        rendered by ``render``. The result's own fields are choice 0's."""
        outputs: Sequence[Any] = getattr(out, "outputs", None) or [out]  # by index
        if self.request.inputs is not None:  # a pooling engine's output: one vector per input
            return GenerationResult(
                request_id=out.request_id,
                text="",
                token_ids=[],
                finish_reason="stop",
                num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
                num_cached_tokens=0,
                logprobs=None,
                submitted_at=self.submitted_at,
                added_at=self.added_at,
                finished_at=finished_at,
                embeddings=[list(o.embedding) for o in outputs],
            )
        choices = [
            GenerationChoice(
                index=int(getattr(c, "index", i)),
                text=c.text,
                token_ids=list(c.token_ids),
                finish_reason=c.finish_reason or "stop",
                logprobs=render(c.logprobs),
            )
            for i, c in enumerate(outputs)
        ]
        first = choices[0]
        return GenerationResult(
            request_id=out.request_id,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            logprobs=first.logprobs,
            submitted_at=self.submitted_at,
            added_at=self.added_at,
            finished_at=finished_at,
            choices=choices,
        )


@dataclass(frozen=True)
class EngineInput:
    """A request as the engine takes it."""

    prompt_token_ids: list[int] | list[list[int]]  # a list of token-id lists: an embeddings request's inputs
    params: SamplingParams | PoolingParams


def engine_input(engine: LLMEngine, req: GenerationRequest) -> EngineInput | InvalidRequest:
    """Tokenize the request and build its ``SamplingParams`` (``max_tokens`` None fills the
    context), or, for an embeddings request, its inputs and ``PoolingParams``. A request the template,
    the tokenizer or ``SamplingParams`` refuses gets its error back, returned rather than raised: it goes
    onto the request's future as it is; so does a request of the other kind than the model's (a chat
    request sent to an embedding model's worker, or an embeddings request to a chat model's)."""
    from batchery.engine.sampling import SamplingParams

    pooling = bool(getattr(engine, "is_pooling", False))
    if pooling != (req.inputs is not None):
        return InvalidRequest(kind_mismatch(str(engine.config.model), pooling))
    if req.inputs is not None:
        return _pooling_input(engine, req.inputs, req.pooling)
    try:
        if req.messages is not None:
            ids = engine.encode_chat(req.messages, req.tools)
        elif req.prompt is not None:
            ids = engine.encode(req.prompt)
        else:
            ids = list(req.prompt_token_ids or [])
    except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the request's fault
        return InvalidRequest(f"could not tokenize the request: {exc}")
    kwargs = dict(req.sampling)
    if kwargs.get("max_tokens") is None:
        room = engine.max_model_len - len(ids)
        kwargs["max_tokens"] = max(room, 1)
    try:
        return EngineInput(ids, SamplingParams(**kwargs))
    except (ValueError, TypeError) as exc:
        return request_error(exc)


def kind_mismatch(model: str, pooling: bool) -> str:
    """Why a request of the other kind than the worker's model is refused (a 400 naming the model's kind)."""
    if pooling:
        return (
            f"this worker serves {model}, an embedding model: it takes /v1/embeddings requests only "
            "(chat, completions and responses need a worker of a generative model)"
        )
    return (
        f"this worker serves {model}, a generative model: /v1/embeddings needs a worker of an embedding model "
        "(e.g. BATCHERY_MODEL=all-minilm-l6-v2)"
    )


def _pooling_input(
    engine: LLMEngine, inputs: list[str] | list[list[int]], pooling: dict
) -> EngineInput | InvalidRequest:
    from batchery.engine.pooling import PoolingParams

    try:
        ids = [engine.encode(t) if isinstance(t, str) else list(t) for t in inputs]
    except Exception as exc:  # noqa: BLE001 - a tokenizer error is the request's fault
        return InvalidRequest(f"could not tokenize the request: {exc}")
    try:
        return EngineInput(ids, PoolingParams(**pooling))
    except (ValueError, TypeError) as exc:
        return request_error(exc)


def request_error(exc: ValueError | TypeError) -> InvalidRequest:
    """What the task gets for a request the engine (or ``SamplingParams``) refused."""
    from batchery.engine.llm_engine import PromptTooLong
    from batchery.engine.pooling_engine import InputTooLong

    kind = ContextLengthExceeded if isinstance(exc, (PromptTooLong, InputTooLong)) else InvalidRequest
    return kind(str(exc))


def internal_error(what: str, exc: BaseException) -> EngineFailure:
    """For a request whose own work outside a step (adding it to the engine, building its result)
    raised: it fails alone, with a retryable ``EngineFailure`` that is no strike (no step failed)."""
    message = f"the engine service failed this request while {what} ({type(exc).__name__}: {exc})"
    return EngineFailure(f"{message[:2000]}; the request will be retried")
