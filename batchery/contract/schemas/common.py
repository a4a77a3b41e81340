"""What every request schema shares: the size limits, the fields ignored or refused, the validation errors'
wording, and ``_Strict`` (unknown fields refused, ``null`` as unset)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
}
CHAT_IGNORED_FIELDS: dict[str, str] = {
    **IGNORED_FIELDS,
    "reasoning_effort": "the effort of OpenAI's reasoning models; Batchery's models have no reasoning budget to set",
    "verbosity": "a length hint for OpenAI's GPT-5 models; not a constraint, and Batchery's models take none",
    "prediction": "Predicted Outputs only make OpenAI faster: the output is the same without them",
    "parallel_tool_calls": "without tools (with tools it is supported)",
    "modalities": 'when it is ["text"] (what Batchery generates anyway)',
}
WHITESPACE_PATTERN_REFUSED = (
    "whitespace patterns are not supported: Batchery lays JSON out in a layout its grammar fixes, not by a regex; "
    "send structured_outputs.json_layout (indent, compact, any or any:N) or disable_any_whitespace: true"
)
# Refused with the field named: each would change the result, and Batchery cannot honour it.
CHAT_REFUSED_FIELDS: dict[str, str] = {
    "guided_whitespace_pattern": WHITESPACE_PATTERN_REFUSED,  # vLLM's; /v1/completions refuses it too
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
