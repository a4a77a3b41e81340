"""The Completions request body (``/v1/completions``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from batchery.contract.schemas.common import MAX_PROMPT_TOKEN_IDS, MAX_TEXT_CHARS, MAX_TOKENS_LIMIT, MAX_TOP_LOGPROBS
from batchery.contract.schemas.sampling import _SamplingFields


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

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of must equal n ({self.n}) when set, got {self.best_of}: choosing the best of several "
                "completions server-side is not supported"
            )
        return self

    def sampling(self) -> dict:
        return self._sampling(self.max_tokens, self.logprobs)
