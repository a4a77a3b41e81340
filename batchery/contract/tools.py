"""Tool calls in the Hermes / Qwen ``<tool_call>`` format: the instructions a model without tool
support in its chat template is given, the constraint that guarantees a call, and the parser.

Pure: no torch, no xgrammar (the constraint is a plain dict in xgrammar's structural-tag format,
compiled by the engine like any other structured-outputs constraint).

The format (the one Hermes-2-Pro, Qwen2/2.5/3 and the SmolLM3 templates teach their models)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Parsed (``parse_tool_calls``): every ``<tool_call> ... </tool_call>`` block whose body is a JSON
object with a string ``"name"`` and an ``"arguments"`` object (``"parameters"`` is accepted for
it, as some Hermes fine-tunes write; a JSON-encoded string of an object too; missing means no
arguments), or a JSON list of such objects. Each becomes an OpenAI ``tool_calls`` item with an id
``call_<24 hex>`` and its arguments re-serialized as JSON text. The text outside the blocks is the
message's ``content`` (None when only whitespace is left). A block that is not such JSON, or one
left unclosed (``max_tokens`` reached inside it), is not a call: it stays in the content as the
model wrote it. Other formats (Llama 3's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``, bare JSON)
are not parsed: their text is the content.

Templates without tool support (SmolLM2's ignores ``tools``): the engine's chat rendering
(``batchery.engine.chat_template.render_chat``) notices that the template renders the same with
and without tools, and then puts ``tools_system_prompt(tools)`` into the system message, writes
earlier assistant calls as ``<tool_call>`` blocks and ``tool`` messages as user turns wrapped in
``<tool_response>``. So every model is taught this one format, and with ``tool_choice``
``"required"`` or a named function the output is constrained to it (``tool_call_constraint``):
the call is then guaranteed well-formed and its arguments match the tool's ``parameters`` schema
(written compactly: at most one whitespace character in a row between JSON tokens), whatever the
model knows of tools. With ``"required"`` and parallel calls allowed, a model may go on calling
until ``max_tokens``: its complete calls are parsed, the choice ends ``"length"``; send
``parallel_tool_calls: false`` for exactly one call. With ``"auto"`` it is only asked for; a small model without
tool training may or may not answer with a call."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
CALL_BEGIN = TOOL_CALL_OPEN + '\n{"name": "'  # + name + ARGUMENTS_BEGIN, then the arguments' JSON
ARGUMENTS_BEGIN = '", "arguments": '
CALL_END = "}\n" + TOOL_CALL_CLOSE
CALL_SEPARATOR = "\n"  # between consecutive calls
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a tool without a parameters schema
# whitespace allowed in a row between the arguments' JSON tokens: one, as models trained on calls write
# them (small models otherwise drift into runs of newlines and indentation, or loop on them)
MAX_ARGUMENTS_WHITESPACE = 1

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The function definition (``name``, ``description``, ``parameters``) of an OpenAI function
    tool: Chat Completions nests it under ``"function"``, the Responses API writes it flat."""
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else tool


def tool_name(tool: dict[str, Any]) -> str:
    return str(function_of(tool).get("name", ""))


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tool instructions for a chat template without tool support, as Qwen2.5's template
    words them: the tools as JSON, one per line, inside ``<tools></tools>``, and the call format."""
    lines = "\n".join(json.dumps({"type": "function", "function": function_of(t)}, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}'
    )


def named_function(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` names (``{"type": "function", "function": {"name": ...}}``,
    or the Responses API's flat ``{"type": "function", "name": ...}``); None for a string choice."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        return str(name) if name is not None else None
    return None


def _call_tag(tool: dict[str, Any]) -> dict[str, Any]:
    fn = function_of(tool)
    params = fn.get("parameters")
    return {
        "type": "tag",
        "begin": CALL_BEGIN + str(fn["name"]) + ARGUMENTS_BEGIN,
        "content": {
            "type": "json_schema",
            "json_schema": params if params else NO_PARAMETERS,
            "max_whitespace_cnt": MAX_ARGUMENTS_WHITESPACE,
        },
        "end": CALL_END,
    }


def tool_call_constraint(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool = True
) -> dict[str, Any] | None:
    """The structured-outputs constraint (an xgrammar structural tag) that makes the output tool
    calls and nothing else: for ``"required"``, one or more ``<tool_call>`` blocks of any of the
    tools (one only when ``parallel`` is False), separated by newlines; for a named function,
    exactly one call of that function. Each call's arguments match its tool's ``parameters``
    schema. None for ``"auto"``, ``"none"`` or no choice (the output is free). ``ValueError``
    for a choice the tools cannot satisfy."""
    name = named_function(tool_choice)
    if name is None and tool_choice != "required":
        return None
    if not tools:
        raise ValueError(f"tool_choice {json.dumps(tool_choice)} needs tools")
    if name is not None:
        match = [t for t in tools if tool_name(t) == name]
        if not match:
            names = ", ".join(tool_name(t) for t in tools)
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools ({names})")
        return {"type": "structural_tag", "format": _call_tag(match[0])}
    return {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": [_call_tag(t) for t in tools],
            "separator": CALL_SEPARATOR,
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _as_call(obj: Any) -> dict[str, Any] | None:
    """An OpenAI ``tool_calls`` item from one parsed call object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _block_calls(body: str) -> list[dict[str, Any]] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(o) for o in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a generated text (see the module docstring for the format).
    Without a well-formed call the text comes back unchanged as the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        found = _block_calls(m.group(1))
        if found is None:
            continue  # malformed: it stays in the content
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.extend(found)
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls
