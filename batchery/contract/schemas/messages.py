"""Chat messages: content parts, the assistant's tool calls, and what the engine's chat template receives."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from batchery.contract.schemas.common import (
    MAX_CONTENT_PARTS,
    MAX_TOOL_CALLS,
    REFUSED_PART_TYPES,
    TEXT_ONLY,
    ShortText,
    Text,
    _Strict,
    json_chars,
)


# -- requests ---------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: Text
    prompt_cache_breakpoint: dict[str, Any] | None = None  # an OpenAI prompt-cache hint: ignored


class RefusalPart(_Strict):
    """A refusal the assistant gave earlier (assistant messages of the history only)."""

    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class ToolCallFunction(_Strict):
    name: ShortText
    arguments: Text | dict[str, Any]  # JSON text, as OpenAI sends it (an object is taken too)


class MessageToolCall(_Strict):
    """A call the assistant made earlier: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``."""

    id: ShortText
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def engine(self) -> dict[str, Any]:
        """The call as a chat template takes it: ``arguments`` an object when the text is a JSON object."""
        args: Any = self.function.arguments
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}

    @property
    def num_chars(self) -> int:
        args = self.function.arguments
        return len(self.function.name) + (len(args) if isinstance(args, str) else json_chars(args))


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: ShortText | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None  # assistant
    tool_call_id: ShortText | None = None  # tool messages: the call they answer
    refusal: Text | None = None  # assistant: a refusal it gave earlier
    audio: Any = None  # refused: an earlier audio answer
    function_call: Any = None  # refused: legacy

    @field_validator("role", mode="before")
    @classmethod
    def _no_function_role(cls, v: Any) -> Any:
        if v == "function":
            raise ValueError(
                "role 'function' is OpenAI's legacy form and is not supported; "
                "send the result as a 'tool' message with tool_call_id"
            )
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, list):
            if len(v) > MAX_CONTENT_PARTS:  # refused before a model is built for each part
                raise ValueError(f"a message may have at most {MAX_CONTENT_PARTS} content parts, got {len(v)}")
            allowed = ("text", "refusal") if info.data.get("role") == "assistant" else ("text",)
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in REFUSED_PART_TYPES:
                    raise ValueError(f"content parts of type {kind!r} are not supported: {TEXT_ONLY}")
                if kind is not None and kind not in allowed:
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported here; "
                        f"this message takes {' and '.join(repr(a) for a in allowed)} parts"
                    )
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: Any) -> Any:
        raise ValueError(f"audio is not supported: {TEXT_ONLY}")

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v: Any) -> Any:
        raise ValueError("function_call is OpenAI's legacy form and is not supported; send tool_calls")

    @model_validator(mode="after")
    def _check_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed on assistant messages, not on a {self.role} message")
        if self.refusal is not None and self.role != "assistant":
            raise ValueError(f"refusal is only allowed on assistant messages, not on a {self.role} message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is only allowed on tool messages, not on a {self.role} message")
        return self

    def text(self) -> str:
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)
        if not text and self.refusal:
            return self.refusal
        return text

    @property
    def num_parts(self) -> int:
        return len(self.content) if isinstance(self.content, list) else 0

    @property
    def num_chars(self) -> int:
        """Characters toward ``MAX_TEXT_CHARS``: an empty part still counts one, so none is free;
        earlier tool calls count their names and arguments."""
        calls = sum(c.num_chars for c in self.tool_calls or ())
        if isinstance(self.content, list):
            parts = sum(max(1, len(p.text if isinstance(p, TextPart) else p.refusal)) for p in self.content)
            return parts + calls + len(self.refusal or "")
        return len(self.text()) + calls

    def engine(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.engine() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d
