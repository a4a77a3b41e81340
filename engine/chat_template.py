"""Chat messages (and tools) to prompt token ids through the model's own chat template."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` as the model's chat template renders them, with the assistant's
    turn opened. ``tools`` (OpenAI function tools) go to the template's ``tools`` argument."""
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
    if tools:
        kwargs["tools"] = tools
    out = tokenizer.apply_chat_template(messages, **kwargs)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
