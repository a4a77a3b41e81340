"""The Responses request (``ResponsesRequest``) and its translation to a chat request (``to_chat``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from batchery.contract.responses.items import (
    INPUT_ITEM_TYPES,
    LOGPROBS_INCLUDE,
    MAX_INCLUDE,
    RESPONSES_REFUSED_FIELDS,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesFunctionTool,
    ResponsesNamedChoice,
    TextConfig,
    _parts_text,
)
from batchery.contract.schemas import (
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    Metadata,
    ShortText,
    Text,
    _Strict,
    check_tools_and_choice,
    check_tools_list,
    describe_validation_error,
    refuse_stream,
)


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
