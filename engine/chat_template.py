"""Chat messages (and tools) to prompt token ids through the model's own chat template.

A template with tool support (it renders ``tools``: Qwen2.5, Hermes, Llama 3.1, SmolLM3, ...)
gets the OpenAI tools and the history as they are: assistant ``tool_calls`` (arguments as
objects) and ``tool`` messages. A template without it (SmolLM2's) would drop them silently, so
then the tools are written into the system message as ``batchery.contract.tools``'
``tools_system_prompt``, earlier assistant calls become ``<tool_call>`` text, and ``tool``
messages become user turns wrapped in ``<tool_response>`` (consecutive ones in one turn), the
Hermes / Qwen convention. Which kind a template is, is found once per tokenizer by rendering a
probe conversation with and without a probe tool: identical output means no tool support."""

from __future__ import annotations

import json
from typing import Any

from batchery.contract.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    function_of,
    tools_system_prompt,
)

_SUPPORT_ATTR = "_batchery_template_tools"  # the probe's answer, kept on the tokenizer
_PROBE_MESSAGES = [{"role": "user", "content": "probe"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "batchery_probe_tool",
            "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` as the model's chat template renders them, with the assistant's
    turn opened. ``tools`` are OpenAI function tools (``{"type": "function", "function": {...}}``)."""
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
    if tools or _has_tool_turns(messages):
        if template_supports_tools(tokenizer):
            if tools:
                kwargs["tools"] = tools
        else:
            messages = messages_without_tool_support(messages, tools)
    out = tokenizer.apply_chat_template(messages, **kwargs)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (asked once per tokenizer). A
    template that raises when given tools has no (usable) support either."""
    known = getattr(tokenizer, _SUPPORT_ATTR, None)
    if known is not None:
        return bool(known)
    plain = tokenizer.apply_chat_template(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    try:
        with_tools = tokenizer.apply_chat_template(
            _PROBE_MESSAGES, tools=_PROBE_TOOLS, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - a template that cannot take tools: the fallback renders them
        with_tools = plain
    supported = with_tools != plain
    try:
        setattr(tokenizer, _SUPPORT_ATTR, supported)
    except (AttributeError, TypeError):
        pass  # not cached: probed again next time, same answer
    return supported


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def call_text(call: dict[str, Any]) -> str:
    """An OpenAI ``tool_calls`` item as the ``<tool_call>`` block a model would have written."""
    fn = function_of(call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # kept as the text it is
    body = json.dumps({"name": fn.get("name"), "arguments": args if args is not None else {}}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def messages_without_tool_support(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation rewritten for a template that knows only roles and text (see the module
    docstring). The caller's messages are not changed."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{m.get('content') or ''}\n{TOOL_RESPONSE_CLOSE}"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
            continue
        d = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        calls = m.get("tool_calls") or []
        if calls:
            text = d.get("content") or ""
            d["content"] = "\n".join(([text] if text else []) + [call_text(c) for c in calls])
        elif d.get("content") is None:
            d["content"] = ""
        out.append(d)
    for d in out:
        d.pop("_tool_responses", None)
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0].get("role") in ("system", "developer"):
            head = out[0].get("content") or ""
            out[0] = {**out[0], "role": "system", "content": f"{head}\n\n{prompt}" if head else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
