"""What a Responses request is made of: its field policy, the ``input`` items, the text formats and the function
tools."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from batchery.contract.schemas import (
    IGNORED_FIELDS,
    MAX_CONTENT_PARTS,
    TEXT_ONLY,
    Name,
    ShortText,
    Text,
    _Strict,
    parse_schema,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one ``include`` value that changes the output here
MAX_INCLUDE = 32

RESPONSES_IGNORED_FIELDS: dict[str, str] = {
    **IGNORED_FIELDS,
    "reasoning": "the options of OpenAI's reasoning models; Batchery's models have no reasoning budget to set",
    "include": f"except {LOGPROBS_INCLUDE!r}: the other values ask for data of items Batchery never produces "
    "(hosted tools, images, encrypted reasoning)",
    "max_tool_calls": "a limit on OpenAI's built-in tools, which Batchery does not run",
    "parallel_tool_calls": "without tools (with tools it is supported)",
    "truncation": 'when it is "disabled" (OpenAI\'s default, and what Batchery does)',
    "background": "when it is false",
    "background_options": "options of background mode, which is refused",
    "image": "request-level image options; Batchery takes no images",
    "text.verbosity": "a length hint for OpenAI's GPT-5 models; not a constraint, and Batchery's models take none",
}
RESPONSES_REFUSED_FIELDS: dict[str, str] = {
    "previous_response_id": "previous_response_id needs OpenAI's stored responses: Batchery keeps no state "
    "between requests; send the whole conversation in input",
    "conversation": "conversation needs OpenAI's stored conversations: Batchery keeps no state between requests; "
    "send the whole conversation in input",
    "prompt": "prompt templates are stored at OpenAI and not supported; send the text in instructions and input",
    "context_management": "server-side context compaction is not supported",
    "moderation": "moderation is not supported: Batchery runs no moderation model",
    "access_programs": "OpenAI's access programs are not supported: they select capabilities of OpenAI's models",
}
REFUSED_INPUT_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


# -- the request ------------------------------------------------------------------------------------
class InputText(_Strict):
    type: Literal["input_text"]
    text: Text
    prompt_cache_breakpoint: dict[str, Any] | None = None  # an OpenAI prompt-cache hint: ignored


class OutputText(_Strict):
    """Text the assistant gave earlier (an output item sent back as input)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: Text


Part = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def _check_parts(v: Any) -> Any:
    if isinstance(v, list):
        if len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"a message may have at most {MAX_CONTENT_PARTS} content parts, got {len(v)}")
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in REFUSED_INPUT_PARTS:
                raise ValueError(f"content parts of type {kind!r} are not supported: {TEXT_ONLY}")
    return v


def _parts_text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


class MessageItem(_Strict):
    """``{"role", "content"}`` (``type: "message"`` optional), an output message item included."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS)]
    id: ShortText | None = None  # of an output item sent back: ignored
    status: ShortText | None = None
    phase: ShortText | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any) -> Any:
        return _check_parts(v)

    @model_validator(mode="after")
    def _refusal_from_assistant(self) -> MessageItem:
        if self.role != "assistant" and isinstance(self.content, list):
            if any(isinstance(p, Refusal) for p in self.content):
                raise ValueError(f"refusal parts are only allowed in assistant messages, not in a {self.role} message")
        return self


class FunctionCallItem(_Strict):
    """A call the model made earlier (a ``function_call`` output item sent back)."""

    type: Literal["function_call"]
    call_id: ShortText
    name: ShortText
    arguments: Text
    id: ShortText | None = None
    status: ShortText | None = None


class FunctionCallOutputItem(_Strict):
    """The result of a call: becomes a ``tool`` message answering ``call_id``."""

    type: Literal["function_call_output"]
    call_id: ShortText
    output: Text | Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS)]
    id: ShortText | None = None
    status: ShortText | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _check_output(cls, v: Any) -> Any:
        return _check_parts(v)


class ReasoningItem(_Strict):
    """An earlier reasoning item (OpenAI's encrypted state): accepted and dropped, no model here reads it."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    """``text.format`` for a schema: flat, as the Responses API has it."""

    type: Literal["json_schema"]
    name: Name
    schema_: dict[str, Any] = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None

    @field_validator("schema_", mode="before")
    @classmethod
    def _check_schema(cls, v: Any) -> Any:
        return parse_schema(v, "the schema")


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: ShortText | None = None  # ignored


class ResponsesFunctionTool(_Strict):
    """Responses' flat function tool: ``{"type": "function", "name", "description", "parameters", "strict"}``."""

    type: Literal["function"]
    name: Name
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _check_parameters(cls, v: Any) -> Any:
        return parse_schema(v, "parameters", object_type=True)


class ResponsesNamedChoice(_Strict):
    type: Literal["function"]
    name: ShortText
