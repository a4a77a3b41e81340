"""The OpenAI Responses API (``/v1/responses``): the request, its translation to a chat request, and
the Response object built from a chat completion (``response_from_chat``; ``Response`` parses it).

A Responses request is stateless here: Batchery keeps no responses or conversations, so the fields
that point at OpenAI's stored state (``previous_response_id``, ``conversation``, ``prompt``,
``background``) are refused, and ``input`` must carry the whole conversation. What the request asks
for is run as the chat request ``ResponsesRequest.to_chat()`` gives (the same engine path, limits
and checks), and ``response_from_chat`` shapes the chat completion as a Response, which the OpenAI
SDK parses (``Response.model_validate``; ``.output_text`` is the text of the message items).

The field policy is the chat one (``IGNORED_FIELDS``), plus ``RESPONSES_IGNORED_FIELDS`` and
``RESPONSES_REFUSED_FIELDS``; docs/batch.md, "OpenAI compatibility", lists them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from batchery.contract.schemas import (
    IGNORED_FIELDS,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    TEXT_ONLY,
    ChatCompletionRequest,
    Metadata,
    Name,
    ShortText,
    Text,
    _Open,
    _Strict,
    check_tools_and_choice,
    check_tools_list,
    describe_validation_error,
    parse_schema,
    refuse_stream,
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


class ResponsesRequest(_Strict):
    """Body of a ``/v1/responses`` line (OpenAI Responses), run as the chat request ``to_chat()``."""

    model: ShortText | None = None  # informational: the queue decides the model
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    text: TextConfig | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: Annotated[list[ShortText], Field(max_length=MAX_INCLUDE)] | None = None
    # ignored (RESPONSES_IGNORED_FIELDS)
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: ShortText | None = None
    user: ShortText | None = None
    safety_identifier: ShortText | None = None
    prompt_cache_key: ShortText | None = None
    prompt_cache_retention: ShortText | None = None
    prompt_cache_options: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    background_options: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    # refused (RESPONSES_REFUSED_FIELDS): any value but null
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    access_programs: Any = None

    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @field_validator(
        "previous_response_id", "conversation", "prompt", "context_management", "moderation", "access_programs"
    )
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        raise ValueError(RESPONSES_REFUSED_FIELDS[str(info.field_name)])

    @field_validator("stream")
    @classmethod
    def _check_stream(cls, v: bool) -> bool:
        return refuse_stream(v)

    @field_validator("background")
    @classmethod
    def _check_background(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "background is not supported: Batchery keeps no responses to poll; a batch line runs in the "
                "background already"
            )
        return v

    @field_validator("truncation")
    @classmethod
    def _check_truncation(cls, v: str) -> str:
        if v == "auto":
            raise ValueError(
                'truncation "auto" is not supported: Batchery never drops input to fit the context '
                '(an input that does not fit fails its line); omit it or send "disabled"'
            )
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _check_items(cls, v: Any) -> Any:
        if isinstance(v, str) and not v:
            raise ValueError("the input is empty")
        if not isinstance(v, list):
            return v
        if len(v) > MAX_MESSAGES:
            raise ValueError(f"input may have at most {MAX_MESSAGES} items, got {len(v)}")
        items = []
        for i, item in enumerate(v):
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}  # EasyInputMessage: the type is optional
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "item_reference":
                raise ValueError(f"input item {i}: item_reference needs OpenAI's stored items; send the item itself")
            if isinstance(kind, str) and kind not in INPUT_ITEM_TYPES:
                raise ValueError(
                    f"input item {i} has type {kind!r}, which is not supported; Batchery takes "
                    f"{', '.join(INPUT_ITEM_TYPES)} items (it runs no hosted tools)"
                )
            items.append(item)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools(cls, v: Any) -> Any:
        return check_tools_list(v)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(
                f"tool_choice of type {v.get('type')!r} is not supported; "
                'use "none", "auto", "required" or {"type": "function", "name": ...}'
            )
        return v

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        choice = self.tool_choice
        check_tools_and_choice(
            [t.name for t in self.tools or ()], choice.name if isinstance(choice, ResponsesNamedChoice) else choice
        )
        body = self._chat_body()
        if len(body["messages"]) > MAX_MESSAGES:
            raise ValueError(
                f"the input makes {len(body['messages'])} chat messages (instructions included); "
                f"the limit is {MAX_MESSAGES}"
            )
        try:
            self._chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # a limit of the chat request the checks above did not catch
            raise ValueError(describe_validation_error(exc, "request (as a chat request)")) from None
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _parts_text(item.content)})
            elif isinstance(item, FunctionCallItem):
                fn = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": fn}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # a message and its calls are one chat turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _parts_text(item.output)})
            # a ReasoningItem is dropped
        return messages

    def _chat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": self._messages()}
        if self.model is not None:
            body["model"] = self.model
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.wants_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, FormatJsonSchema):
            spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
            if fmt.description is not None:
                spec["description"] = fmt.description
            if fmt.strict is not None:
                spec["strict"] = fmt.strict
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(by_alias=True, exclude_none=True, exclude={"type"})}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, ResponsesNamedChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        return body

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that runs this one: ``instructions`` a leading system message, the items
        messages (function calls an assistant turn's ``tool_calls``, their outputs ``tool`` messages),
        ``text.format`` the ``response_format``, the flat tools chat tools. Valid by construction."""
        assert self._chat is not None  # set by the validator
        return self._chat

    def echo_tools(self) -> list[dict[str, Any]]:
        """The tools as a Response echoes them (Responses' flat shape, every field present)."""
        return [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": t.strict,
            }
            for t in self.tools or ()
        ]

    def echo_tool_choice(self) -> str | dict[str, Any]:
        if isinstance(self.tool_choice, ResponsesNamedChoice):
            return {"type": "function", "name": self.tool_choice.name}
        return self.tool_choice or "auto"

    def echo_text(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            out: dict[str, Any] = {"format": {"type": "text"}}
        else:
            out = {"format": fmt.model_dump(by_alias=True, exclude_none=True)}
        if self.text is not None and self.text.verbosity is not None:
            out["verbosity"] = self.text.verbosity
        return out


# -- the Response object ----------------------------------------------------------------------------
class ResponseUsage(_Open):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, Any] | None = None
    output_tokens_details: dict[str, Any] | None = None


class Response(_Open):
    """A Response object as ``response_from_chat`` builds it (the client parses results with it).
    The items stay plain dicts, in OpenAI's shape; ``output_text`` is the SDK's convenience: the
    text of every ``output_text`` part of the message items, joined."""

    id: str
    object: Literal["response"] = "response"
    created_at: float
    status: Literal["completed", "incomplete", "failed", "cancelled", "in_progress", "queued"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    @property
    def output_text(self) -> str:
        return "".join(
            part.get("text", "")
            for item in self.output
            if item.get("type") == "message"
            for part in item.get("content") or ()
            if isinstance(part, dict) and part.get("type") == "output_text"
        )


def _suffix(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def _output_logprobs(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        return None
    out = []
    for e in content:
        token = e["token"]
        out.append(
            {
                "token": token,
                "bytes": e.get("bytes") or list(token.encode("utf-8", errors="replace")),
                "logprob": e["logprob"],
                "top_logprobs": [
                    {
                        "token": t["token"],
                        "bytes": t.get("bytes") or list(t["token"].encode("utf-8", errors="replace")),
                        "logprob": t["logprob"],
                    }
                    for t in e.get("top_logprobs") or ()
                ],
            }
        )
    return out


def response_from_chat(
    chat: dict[str, Any] | BaseModel, *, response_id: str, created_at: float, model: str, req: ResponsesRequest
) -> dict[str, Any]:
    """The Response object (OpenAI's shape) for the chat completion ``chat`` (a ``ChatCompletion``
    as a dict) that ran ``req.to_chat()``. Its first choice is the answer: a ``message`` item with
    the text (when there is text, or no call), then one ``function_call`` item per tool call. Status
    ``completed``, or ``incomplete`` with ``incomplete_details.reason "max_output_tokens"`` when the
    token limit cut it short. Item ids derive from ``response_id``, so a retry gives the same ones."""
    if isinstance(chat, BaseModel):
        chat = chat.model_dump(mode="json")
    if not response_id.startswith("resp_"):
        response_id = "resp_" + response_id
    suffix = _suffix(response_id)
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    incomplete = finish == "length"
    item_status = "incomplete" if incomplete else "completed"
    text = message.get("content")
    calls = message.get("tool_calls") or []

    output: list[dict[str, Any]] = []
    if text or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": text or "", "annotations": []}
        logprobs = _output_logprobs(choice) if req.wants_logprobs else None
        if logprobs is not None:
            part["logprobs"] = logprobs
        output.append(
            {"id": f"msg_{suffix}", "type": "message", "role": "assistant", "status": item_status, "content": [part]}
        )
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        args = fn.get("arguments")
        output.append(
            {
                "id": f"fc_{suffix}_{i}",
                "type": "function_call",
                "call_id": call.get("id") or f"call_{suffix}_{i}",
                "name": fn.get("name", ""),
                "arguments": args if isinstance(args, str) else json.dumps(args),
                "status": "completed",
            }
        )

    usage = chat.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    completion_tokens = int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    timing = chat.get("timing")
    out: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "incomplete" if incomplete else "completed",
        "completed_at": timing.get("engine_finished_at") if isinstance(timing, dict) else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": req.echo_text(),
        "tool_choice": req.echo_tool_choice(),
        "tools": req.echo_tools(),
        "truncation": "disabled",
        "metadata": dict(req.metadata or {}),
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if req.top_logprobs is not None:
        out["top_logprobs"] = req.top_logprobs
    if timing is not None:
        out["timing"] = timing  # Batchery's extension, as on chat completions
    return out
