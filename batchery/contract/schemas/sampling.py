"""The sampling fields both request kinds share (``SamplingParams``' names and ranges), ``logit_bias`` included."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from batchery.contract.schemas.common import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    OPENAI_MAX_N,
    SEED_MAX,
    WHITESPACE_PATTERN_REFUSED,
    Metadata,
    ShortText,
    _bounded_text,
    _Strict,
    parse_schema,
    refuse_stream,
)
from batchery.contract.schemas.constraints import (
    ResponseFormat,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    StructuredOutputs,
    _check_choice,
)


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
    # refused (CHAT_REFUSED_FIELDS)
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

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _refuse_whitespace_pattern(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError(WHITESPACE_PATTERN_REFUSED)
        return v

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
