"""Prefix grouping of batch lines: the text a line's prompt starts with (lines are sorted by it before they are
queued, so lines that share a prefix run side by side and the engine's prefix cache serves them) and its prefix
group (``batchery.broker.affinity`` sends a group's lines to one worker)."""

from __future__ import annotations

import json

from batchery.broker.affinity import prefix_hash
from batchery.contract.batch import CHAT_URL, COMPLETIONS_URL, RESPONSES_URL

PREFIX_KEY_CHARS = 1 << 16  # lines whose prompts agree this far sort as equal (bounds the sort's compares)
GROUP_MIN_CHARS = 512  # a prompt less its last turn this long is a prefix group of its own (prefix_group)
GROUP_PREFIX_CHARS = 1024  # else the prompt's first characters are


def _text(v) -> str:
    """The text of a prompt part as a chat template renders it, near enough to compare prompts by."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "\x01".join(_text(x) for x in v)
    if isinstance(v, dict):
        if isinstance(v.get("text"), str):
            return v["text"]
        if "content" in v:
            return f"{v.get('role', '')}\x02{_text(v['content'])}"
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def prefix_key(url: str, body: dict) -> str:
    """The start of the prompt a line becomes, as text to sort by: lines that share a prefix sort next to each
    other. Model and endpoint first, then tools (chat templates render them before the messages), then the
    messages' roles and contents in order (chat), the prompt (completions) or the instructions and input
    (responses). Cut at ``PREFIX_KEY_CHARS``."""
    parts = [str(body.get("model") or ""), url]
    tools = body.get("tools")
    parts.append(_text(tools) if tools else "")
    if url == CHAT_URL:
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}\x02{_text(m.get('content'))}")
            else:
                parts.append(_text(m))
    elif url == COMPLETIONS_URL:
        parts.append(_text(body.get("prompt")))
    elif url == RESPONSES_URL:
        parts.append(_text(body.get("instructions")))
        parts.append(_text(body.get("input")))
    return "\x00".join(parts)[:PREFIX_KEY_CHARS]


def prefix_group(url: str, body: dict) -> str:
    """The line's prefix group (``batchery.broker.affinity``): a hash of its prompt without the last turn (a chat's
    last message, a Response's last input item), so a document's questions share one; when that part is short (a
    one-line system prompt, a single message, a completion's prompt) the first ``GROUP_PREFIX_CHARS`` of the whole
    prompt instead, so unrelated lines are not all one group."""
    head = ""
    if url == CHAT_URL and isinstance(body.get("messages"), list) and len(body["messages"]) > 1:
        head = prefix_key(url, {**body, "messages": body["messages"][:-1]})
    elif url == RESPONSES_URL and isinstance(body.get("input"), list) and len(body["input"]) > 1:
        head = prefix_key(url, {**body, "input": body["input"][:-1]})
    if len(head) < GROUP_MIN_CHARS:
        head = prefix_key(url, body)[:GROUP_PREFIX_CHARS]
    return prefix_hash(head)
