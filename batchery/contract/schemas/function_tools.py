"""Function tools and ``tool_choice``, as Chat Completions requests declare them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from batchery.contract.schemas.common import (
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
    Name,
    ShortText,
    Text,
    _Strict,
    json_chars,
    parse_schema,
)


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
