"""The message contract: OpenAI-style request bodies (validated at the boundary) and responses.

Requests accept the OpenAI Chat Completions / Completions fields that apply to a local engine,
plus vLLM's extensions under vLLM's names (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``structured_outputs`` and the older
``guided_*`` fields). Every OpenAI field is one of three kinds, so a real OpenAI batch file either
runs or fails with a reason (the lists are in docs/batch.md, "OpenAI compatibility"):

- supported: it does what OpenAI documents;
- ignored (``IGNORED_FIELDS``, ``CHAT_IGNORED_FIELDS``): accepted, and it cannot change the result
  here (``store``, ``metadata``, ...);
- refused (``CHAT_REFUSED_FIELDS``): it would change the result and Batchery cannot honour it
  (``audio``, ``stream: true``, ...); the error names the field and says why.

A field that is none of these is refused too, so a typo is an error rather than silently ignored.
``null`` means "not set", as in OpenAI: an optional field sent as null takes its default. Sizes are
bounded so one message cannot exhaust a worker."""

from __future__ import annotations

import json
import math
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
MAX_N = 16  # choices per request (the engine's limit; they share the prompt's KV blocks)
OPENAI_MAX_N = 128
MAX_LOGIT_BIAS = 1024  # entries per request
MAX_TOKEN_ID = 2**31 - 1  # a sanity bound; the engine checks the ids against the model's vocabulary
MAX_SCHEMA_CHARS = 65_536  # JSON text of one schema (response format, a tool's parameters), a regex or a grammar
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_CHARS = 262_144  # JSON text of all the tools of a request together
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history
MAX_CHOICES = 256  # entries of a choice constraint (the engine's limit)
MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's pattern for function and response-format names

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
ShortText = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)
]

TEXT_ONLY = "Batchery serves text models"

# Accepted and without effect, on both endpoints: each cannot change what is generated here.
IGNORED_FIELDS: dict[str, str] = {
    "store": "OpenAI's stored completions (distillation, evals); Batchery's results are the job's records",
    "metadata": "tags for OpenAI's dashboard; a batch job has its own metadata",
    "service_tier": "OpenAI's processing tiers; the queue decides how a request is served",
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "a hint for OpenAI's prompt cache; Batchery's prefix cache needs none",
    "prompt_cache_retention": "OpenAI's prompt-cache lifetime",
    "prompt_cache_options": "OpenAI's prompt-cache options",
    "stream_options": "options for streaming, which is refused (stream is false)",
    "guided_decoding_backend": "vLLM's choice of grammar backend; Batchery has one (xgrammar)",
    "guided_whitespace_pattern": "vLLM's whitespace option for JSON; the grammar engine's default applies",
}
CHAT_IGNORED_FIELDS: dict[str, str] = {
    **IGNORED_FIELDS,
    "reasoning_effort": "the effort of OpenAI's reasoning models; Batchery's models have no reasoning budget to set",
    "verbosity": "a length hint for OpenAI's GPT-5 models; not a constraint, and Batchery's models take none",
    "prediction": "Predicted Outputs only make OpenAI faster: the output is the same without them",
    "parallel_tool_calls": "without tools (with tools it is supported)",
    "modalities": 'when it is ["text"] (what Batchery generates anyway)',
}
# Refused with the field named: each would change the result, and Batchery cannot honour it.
CHAT_REFUSED_FIELDS: dict[str, str] = {
    "audio": f"audio output is not supported: {TEXT_ONLY}",
    "functions": "functions is OpenAI's legacy form of tools and is not supported; send tools "
    '([{"type": "function", "function": {...}}])',
    "function_call": "function_call is OpenAI's legacy form of tool_choice and is not supported; send tool_choice",
    "web_search_options": "web search is not supported: Batchery runs no hosted tools",
    "moderation": "moderation is not supported: Batchery runs no moderation model",
}
REFUSED_PART_TYPES = {"image_url": "images", "input_audio": "audio", "file": "files"}  # chat content parts


_TYPE_ERRORS = frozenset(
    {
        "string_type",
        "list_type",
        "dict_type",
        "model_type",
        "model_attributes_type",
        "literal_error",
        "int_type",
        "float_type",
        "bool_type",
        "none_required",
        "is_instance_of",
    }
)
_UNKNOWN_FIELD = 'unknown field (a typo? see "OpenAI compatibility" in docs/batch.md for the fields Batchery takes)'


def _field_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic error location as the body's path: without the names pydantic gives union branches
    (``constrained-str``, ``list[...]``, ``NamedToolChoice``) and with a discriminated union's tag not
    repeating the field it sits under (``response_format.json_schema``, not ``...json_schema.json_schema``)."""
    out: list[Any] = []
    for part in loc:
        if isinstance(part, str) and (
            "[" in part or "-" in part or part[:1].isupper() or part in ("str", "int", "float", "bool", "dict", "list")
        ):
            continue
        if out and out[-1] == part:
            continue
        out.append(part)
    return tuple(out)


def describe_validation_error(exc: ValidationError, what: str = "request body") -> str:
    """One readable line per problem: ``field.path: message`` (a problem of the whole body is named
    by its own message). Where one branch of a union failed deeper inside the value, the other
    branches' "should be a valid ..." are left out: the deeper problem is the one to fix."""
    errors = [(_field_path(tuple(e.get("loc", ()))), e) for e in exc.errors(include_url=False)]
    paths = [p for p, _ in errors]
    lines = []
    for path, err in errors:
        if err.get("type") in _TYPE_ERRORS and any(len(q) > len(path) and q[: len(path)] == path for q in paths):
            continue
        loc = ".".join(str(p) for p in path)
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = _UNKNOWN_FIELD
        line = f"{loc}: {msg}" if loc else msg
        if line not in lines:
            lines.append(line)
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


def json_chars(value: Any) -> int:
    """Characters of ``value`` as compact JSON text: how schema sizes are bounded."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def parse_schema(value: Any, what: str, *, object_type: bool = False) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both) -> the object, bounded
    by ``MAX_SCHEMA_CHARS``. With ``object_type`` a ``type`` it declares must be ``"object"`` (a
    function's parameters, as OpenAI requires)."""
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:
            raise ValueError(f"{what} has {len(value)} characters; the limit is {MAX_SCHEMA_CHARS}")
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON schema object")
    size = json_chars(value)
    if size > MAX_SCHEMA_CHARS:
        raise ValueError(f"{what} has {size} characters of JSON; the limit is {MAX_SCHEMA_CHARS}")
    if object_type and value.get("type", "object") != "object":
        raise ValueError(f'{what} must be a JSON schema of type "object", got type {value.get("type")!r}')
    return value


def refuse_stream(stream: bool) -> bool:
    """``stream`` as every request body takes it: false, or refused (results travel whole)."""
    if stream:
        raise ValueError("stream is not supported: results are delivered whole through the result backend")
    return stream


def _bounded_text(value: str, what: str) -> str:
    if not value:
        raise ValueError(f"{what} must not be empty")
    if len(value) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{what} has {len(value)} characters; the limit is {MAX_SCHEMA_CHARS}")
    return value


class _Strict(BaseModel):
    """Unknown fields refused; ``null`` for a field that is not required means "not set" (OpenAI's
    meaning), so it takes the default, and an unknown field sent as null asks for nothing."""

    model_config = ConfigDict(extra="forbid", str_max_length=MAX_TEXT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None for v in data.values()):
            fields = cls.model_fields
            keep = {name for name, f in fields.items() if f.is_required()}
            keep |= {f.alias for name, f in fields.items() if f.is_required() and f.alias}
            data = {k: v for k, v in data.items() if v is not None or k in keep}
        return data


# -- output constraints -----------------------------------------------------------------------
class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``. ``strict`` is accepted either way: the schema is always
    enforced by the grammar engine."""

    name: Name
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    @field_validator("schema_", mode="before")
    @classmethod
    def _check_schema(cls, v: Any) -> Any:
        return parse_schema(v, "the schema")


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]

CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # the engine's names


def _check_choice(v: Any, what: str) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise ValueError(f"{what} must be a non-empty list of non-empty strings")
    if len(v) > MAX_CHOICES:
        raise ValueError(f"{what} has {len(v)} entries; the limit is {MAX_CHOICES}")
    if json_chars(v) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{what} is over {MAX_SCHEMA_CHARS} characters of JSON")
    return v


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (vLLM >= 0.11): exactly one constraint. vLLM's tuning options
    (``disable_fallback``, ``disable_any_whitespace``, ``disable_additional_properties``,
    ``whitespace_pattern``) are accepted and ignored: the output still matches the constraint."""

    json_: dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: ShortText | None = None

    @field_validator("json_", mode="before")
    @classmethod
    def _check_json(cls, v: Any) -> Any:
        return parse_schema(v, "structured_outputs.json")

    @field_validator("regex", "grammar")
    @classmethod
    def _check_text(cls, v: str, info: ValidationInfo) -> str:
        return _bounded_text(v, f"structured_outputs.{info.field_name}")

    @field_validator("choice", mode="before")
    @classmethod
    def _check_choice(cls, v: Any) -> Any:
        return _check_choice(v, "structured_outputs.choice")

    @field_validator("structural_tag")
    @classmethod
    def _check_tag(cls, v: Any) -> Any:
        if (len(v) if isinstance(v, str) else json_chars(v)) > MAX_SCHEMA_CHARS:
            raise ValueError(f"structured_outputs.structural_tag is over {MAX_SCHEMA_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        set_ = [k for k, v in self._values().items() if v not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(CONSTRAINT_KEYS)}, "
                f"got {', '.join(set_) or 'none'}"
            )
        return self

    def _values(self) -> dict[str, Any]:
        return {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
            "structural_tag": self.structural_tag,
        }

    def engine(self) -> dict[str, Any]:
        """The engine's ``structured_outputs`` dict: exactly one key."""
        return {k: v for k, v in self._values().items() if v not in (None, False)}


# -- tools --------------------------------------------------------------------------------------
class FunctionDefinition(_Strict):
    name: Name
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # omitted: a function without parameters, as in OpenAI
    strict: bool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _check_parameters(cls, v: Any) -> Any:
        return parse_schema(v, "parameters", object_type=True)

    def engine(self) -> dict[str, Any]:
        """The OpenAI function object a chat template renders (``parameters`` always present)."""
        d: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            d["description"] = self.description
        d["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return d


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: ShortText


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools_list(v: Any, what: str = "tools") -> Any:
    """Refuse what is not a function tool, by its type, before a model is built for each tool."""
    if v is None:
        return v
    if not isinstance(v, list):
        raise ValueError(f"{what} must be a list of tools")
    if len(v) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are supported (as in OpenAI), got {len(v)}")
    for i, tool in enumerate(v):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is not None and kind != "function":
            raise ValueError(
                f"tool {i} has type {kind!r}; only function tools are supported "
                "(Batchery runs no hosted or custom tools)"
            )
    if json_chars(v) > MAX_TOOLS_CHARS:
        raise ValueError(f"the tools are over {MAX_TOOLS_CHARS} characters of JSON together")
    return v


def check_tool_choice(v: Any) -> Any:
    if isinstance(v, dict) and v.get("type") not in (None, "function"):
        raise ValueError(
            f"tool_choice of type {v.get('type')!r} is not supported; "
            'use "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    return v


def check_tools_and_choice(names: list[str], choice: str | None) -> None:
    """OpenAI's rules: unique names, a tool_choice only with tools, a named choice naming a tool.
    ``choice`` is "none" | "auto" | "required" | the named function, or None (not set)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"tools: function names must be unique; {name!r} appears more than once")
        seen.add(name)
    if choice is None or choice == "none":
        return
    if not names:
        raise ValueError('tool_choice is only allowed when tools are specified (or set it to "none")')
    if choice not in ("auto", "required") and choice not in seen:
        raise ValueError(f"tool_choice names function {choice!r}, which is not in tools ({', '.join(names)})")


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


def _logit_bias(v: Any) -> dict[int, float]:
    """``{"<token id>": bias}`` (string keys, as JSON has them; ints from Python) -> int keys."""
    if not isinstance(v, dict):
        raise ValueError("logit_bias must be an object of token ids to biases")
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if isinstance(key, bool):
            token = -1
        elif isinstance(key, int):
            token = key
        elif isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        else:
            token = -1
        if not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, (int, float))
            or not math.isfinite(bias)
            or not -100 <= bias <= 100
        ):
            raise ValueError(f"logit_bias[{key!r}] must be a number from -100 to 100, got {bias!r}")
        out[token] = float(bias)
    return out


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
    logit_bias: dict[int, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # ignored (IGNORED_FIELDS)
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: ShortText | None = None
    user: ShortText | None = None
    safety_identifier: ShortText | None = None
    prompt_cache_key: ShortText | None = None
    prompt_cache_retention: ShortText | None = None
    prompt_cache_options: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    guided_decoding_backend: ShortText | None = None
    guided_whitespace_pattern: ShortText | None = None

    _constraint: dict[str, Any] | None = PrivateAttr(default=None)

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
        if not 1 <= v <= MAX_N:
            raise ValueError(
                f"n must be from 1 to {MAX_N}, got {v} (Batchery's limit: the choices share one request's "
                f"KV blocks; OpenAI allows up to {OPENAI_MAX_N}, so send a larger n as several requests)"
            )
        return v

    @field_validator("stream")
    @classmethod
    def _check_stream(cls, v: bool) -> bool:
        return refuse_stream(v)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, v: Any) -> Any:
        return _logit_bias(v)

    @field_validator("guided_json", mode="before")
    @classmethod
    def _check_guided_json(cls, v: Any) -> Any:
        return parse_schema(v, "guided_json")

    @field_validator("guided_regex", "guided_grammar")
    @classmethod
    def _check_guided_text(cls, v: str, info: ValidationInfo) -> str:
        return _bounded_text(v, str(info.field_name))

    @field_validator("guided_choice", mode="before")
    @classmethod
    def _check_guided_choice(cls, v: Any) -> Any:
        return _check_choice(v, "guided_choice")

    @model_validator(mode="after")
    def _one_constraint(self) -> _SamplingFields:
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if isinstance(rf, ResponseFormatJsonObject):
            found.append(("response_format (json_object)", {"json_object": True}))
        elif isinstance(rf, ResponseFormatJsonSchema):
            found.append(("response_format (json_schema)", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.engine()))
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {key: value}))
        if len(found) > 1:
            raise ValueError(
                f"one output constraint per request, got {' and '.join(n for n, _ in found)}: set only one"
            )
        self._constraint = found[0][1] if found else None
        return self

    @property
    def constraint(self) -> dict[str, Any] | None:
        """The output constraint in the engine's terms (one key of ``CONSTRAINT_KEYS``), or None."""
        return self._constraint

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
            n=self.n,
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
            structured_outputs=dict(self._constraint) if self._constraint is not None else None,
        )


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


# -- batch jobs -------------------------------------------------------------------------------
BatchStatus = Literal[
    "validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"
]
# ``expired``: the job's completion window ended before every line had started; the lines that had not are
# error records (``batch_expired``), the ones that had finished and kept their results (OpenAI's Batch API).
TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})


class RequestCounts(_Open):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(_Open):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # of the prompt tokens, those from the prefix cache


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
    expired_at: float | None = None  # when it ended ``expired``
    expires_at: float | None = None  # when its keys expire (the TTL, counted from its end)
    window_s: float | None = None  # its completion window, seconds (None: no window, it never expires)
    window_ends_at: float | None = None  # created_at + window_s: lines not started by then are not run
    expired_lines: int = 0  # lines recorded ``batch_expired`` (counted in request_counts.failed too)
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
