"""The Chat Completions request body (``/v1/chat/completions``)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from batchery.contract.schemas.common import (
    CHAT_REFUSED_FIELDS,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    TEXT_ONLY,
    ShortText,
)
from batchery.contract.schemas.function_tools import (
    FunctionTool,
    NamedToolChoice,
    ToolChoice,
    check_tool_choice,
    check_tools_and_choice,
    check_tools_list,
)
from batchery.contract.schemas.messages import ChatMessage
from batchery.contract.schemas.sampling import _SamplingFields


class ChatCompletionRequest(_SamplingFields):
    """Body of ``batchery.chat_completion`` (OpenAI Chat Completions)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # ignored (CHAT_IGNORED_FIELDS)
    reasoning_effort: ShortText | None = None
    verbosity: ShortText | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # refused (CHAT_REFUSED_FIELDS): any value but null
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    moderation: Any = None

    @field_validator("audio", "functions", "function_call", "web_search_options", "moderation")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        raise ValueError(CHAT_REFUSED_FIELDS[str(info.field_name)])

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str]) -> list[str]:
        if any(m != "text" for m in v):
            raise ValueError(f'only ["text"] is supported: {TEXT_ONLY} (got {json.dumps(v)[:80]})')
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools(cls, v: Any) -> Any:
        return check_tools_list(v)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, v: Any) -> Any:
        return check_tool_choice(v)

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
        choice = self.tool_choice
        check_tools_and_choice(
            [t.function.name for t in self.tools or ()],
            choice.function.name if isinstance(choice, NamedToolChoice) else choice,
        )
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_messages(self) -> list[dict]:
        """The messages as a chat template takes them: content as text, earlier ``tool_calls``
        (arguments an object when they are a JSON object) and ``tool_call_id`` kept."""
        return [m.engine() for m in self.messages]

    def engine_tools(self) -> list[dict] | None:
        """The function tools in OpenAI's shape, for the chat template (None without tools). They are
        rendered with ``tool_choice: "none"`` too, as OpenAI shows them to the model then."""
        if not self.tools:
            return None
        return [{"type": "function", "function": t.function.engine()} for t in self.tools]

    def engine_tool_choice(self) -> str | dict:
        """``"none"`` | ``"auto"`` | ``"required"`` | ``{"type": "function", "function": {"name"}}``,
        with OpenAI's default: ``"auto"`` with tools, ``"none"`` without."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return {"type": "function", "function": {"name": choice.function.name}}
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    @property
    def forces_tool_call(self) -> bool:
        """``tool_choice`` is "required" or names a function: the answer must be a tool call."""
        return bool(self.tools) and self.engine_tool_choice() not in ("none", "auto")

    def sampling(self) -> dict:
        """``SamplingParams`` keyword arguments; ``max_tokens`` None means "fill the context".
        ``structured_outputs`` is the request's own constraint (``response_format``,
        ``structured_outputs`` or ``guided_*``); a tool-call constraint is not added here."""
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(self.effective_max_tokens, lp)
