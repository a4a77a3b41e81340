"""Output constraints: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` (and the older ``guided_*``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from batchery.contract.schemas.common import (
    MAX_CHOICES,
    MAX_SCHEMA_CHARS,
    WHITESPACE_PATTERN_REFUSED,
    Name,
    ShortText,
    Text,
    _bounded_text,
    _Strict,
    json_chars,
    parse_schema,
)


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


JSON_LAYOUT_NAMES = ("indent", "compact", "any")  # and "any:N"; the engine's JSON_LAYOUTS (kept in step by a test)
MAX_JSON_WHITESPACE = 64


def check_json_layout(v: Any, what: str) -> Any:
    """A JSON layout's name (the engine's ``check_json_layout``, repeated here: the contract imports no engine)."""
    if v is None or v in JSON_LAYOUT_NAMES:
        return v
    if isinstance(v, str) and v.startswith("any:"):
        n = v[4:]
        if n.isdigit() and n == str(int(n)) and 1 <= int(n) <= MAX_JSON_WHITESPACE:
            return v
    raise ValueError(
        f"{what} must be indent, compact, any or any:N with N from 1 to {MAX_JSON_WHITESPACE}, got {v!r:.80}"
    )


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (vLLM >= 0.11): exactly one constraint. Of vLLM's tuning options,
    ``disable_fallback`` and ``disable_additional_properties`` are accepted and ignored (there is one
    backend, and schemas are always strict); ``disable_any_whitespace: true`` lays JSON out on one line
    (``json_layout`` compact: what vLLM's flag gives); ``whitespace_pattern`` is refused. ``json_layout``
    (Batchery's) names a JSON constraint's layout; unset, the worker's ``BATCHERY_ENGINE__JSON_LAYOUT``."""

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
    json_layout: ShortText | None = None

    @field_validator("json_layout")
    @classmethod
    def _check_layout(cls, v: Any) -> Any:
        return check_json_layout(v, "structured_outputs.json_layout")

    @field_validator("whitespace_pattern")
    @classmethod
    def _refuse_pattern(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError(WHITESPACE_PATTERN_REFUSED)
        return v

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
        if self.disable_any_whitespace and self.json_layout not in (None, "compact"):
            raise ValueError(
                f"structured_outputs: disable_any_whitespace: true asks for the compact layout, "
                f"and json_layout is {self.json_layout!r}: set only one"
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
        """The engine's ``structured_outputs`` dict: exactly one constraint key, and ``json_layout``
        when one is asked for (of a JSON constraint; the others have no layout)."""
        out = {k: v for k, v in self._values().items() if v not in (None, False)}
        layout = "compact" if self.disable_any_whitespace else self.json_layout
        if layout is not None and ("json" in out or "json_object" in out):
            out["json_layout"] = layout
        return out
