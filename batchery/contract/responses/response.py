"""The Response object: ``response_from_chat`` shapes a chat completion as one, ``Response`` parses it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel

from batchery.contract.responses.request import ResponsesRequest
from batchery.contract.schemas import _Open


# -- the Response object ----------------------------------------------------------------------------
class ResponseUsage(_Open):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, Any] | None = None
    output_tokens_details: dict[str, Any] | None = None


class Response(_Open):
    """A Response object as ``response_from_chat`` builds it (the client parses results with it).
    The items stay plain dicts, in OpenAI's shape; ``output_text`` is the SDK's convenience: the
    text of every ``output_text`` part of the message items, joined."""

    id: str
    object: Literal["response"] = "response"
    created_at: float
    status: Literal["completed", "incomplete", "failed", "cancelled", "in_progress", "queued"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    @property
    def output_text(self) -> str:
        return "".join(
            part.get("text", "")
            for item in self.output
            if item.get("type") == "message"
            for part in item.get("content") or ()
            if isinstance(part, dict) and part.get("type") == "output_text"
        )


def _suffix(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def _output_logprobs(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        return None
    out = []
    for e in content:
        token = e["token"]
        out.append(
            {
                "token": token,
                "bytes": e.get("bytes") or list(token.encode("utf-8", errors="replace")),
                "logprob": e["logprob"],
                "top_logprobs": [
                    {
                        "token": t["token"],
                        "bytes": t.get("bytes") or list(t["token"].encode("utf-8", errors="replace")),
                        "logprob": t["logprob"],
                    }
                    for t in e.get("top_logprobs") or ()
                ],
            }
        )
    return out


def response_from_chat(
    chat: dict[str, Any] | BaseModel, *, response_id: str, created_at: float, model: str, req: ResponsesRequest
) -> dict[str, Any]:
    """The Response object (OpenAI's shape) for the chat completion ``chat`` (a ``ChatCompletion``
    as a dict) that ran ``req.to_chat()``. Its first choice is the answer: a ``message`` item with
    the text (when there is text, or no call), then one ``function_call`` item per tool call. Status
    ``completed``, or ``incomplete`` with ``incomplete_details.reason "max_output_tokens"`` when the
    token limit cut it short. Item ids derive from ``response_id``, so a retry gives the same ones."""
    if isinstance(chat, BaseModel):
        chat = chat.model_dump(mode="json")
    if not response_id.startswith("resp_"):
        response_id = "resp_" + response_id
    suffix = _suffix(response_id)
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    incomplete = finish == "length"
    item_status = "incomplete" if incomplete else "completed"
    text = message.get("content")
    calls = message.get("tool_calls") or []

    output: list[dict[str, Any]] = []
    if text or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": text or "", "annotations": []}
        logprobs = _output_logprobs(choice) if req.wants_logprobs else None
        if logprobs is not None:
            part["logprobs"] = logprobs
        output.append(
            {"id": f"msg_{suffix}", "type": "message", "role": "assistant", "status": item_status, "content": [part]}
        )
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        args = fn.get("arguments")
        output.append(
            {
                "id": f"fc_{suffix}_{i}",
                "type": "function_call",
                "call_id": call.get("id") or f"call_{suffix}_{i}",
                "name": fn.get("name", ""),
                "arguments": args if isinstance(args, str) else json.dumps(args),
                "status": "completed",
            }
        )

    usage = chat.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    completion_tokens = int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    timing = chat.get("timing")
    out: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "incomplete" if incomplete else "completed",
        "completed_at": timing.get("engine_finished_at") if isinstance(timing, dict) else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": req.echo_text(),
        "tool_choice": req.echo_tool_choice(),
        "tools": req.echo_tools(),
        "truncation": "disabled",
        "metadata": dict(req.metadata or {}),
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if req.top_logprobs is not None:
        out["top_logprobs"] = req.top_logprobs
    if timing is not None:
        out["timing"] = timing  # Batchery's extension, as on chat completions
    return out
