"""The OpenAI Responses API (``/v1/responses``): the request, its translation to a chat request, and
the Response object built from a chat completion (``response_from_chat``; ``Response`` parses it).

A Responses request is stateless here: Batchery keeps no responses or conversations, so the fields
that point at OpenAI's stored state (``previous_response_id``, ``conversation``, ``prompt``,
``background``) are refused, and ``input`` must carry the whole conversation. What the request asks
for is run as the chat request ``ResponsesRequest.to_chat()`` gives (the same engine path, limits
and checks), and ``response_from_chat`` shapes the chat completion as a Response, which the OpenAI
SDK parses (``Response.model_validate``; ``.output_text`` is the text of the message items).

The field policy is the chat one (``IGNORED_FIELDS``), plus ``RESPONSES_IGNORED_FIELDS`` and
``RESPONSES_REFUSED_FIELDS``; docs/batch.md, "OpenAI compatibility", lists them.

In modules: ``items`` (the field policy and what ``input``, ``text`` and ``tools`` hold), ``request`` and
``response``. Every name is importable from here, as before."""

from __future__ import annotations

from batchery.contract.responses.items import (
    INPUT_ITEM_TYPES,
    LOGPROBS_INCLUDE,
    MAX_INCLUDE,
    REFUSED_INPUT_PARTS,
    RESPONSES_IGNORED_FIELDS,
    RESPONSES_REFUSED_FIELDS,
    FormatJsonObject,
    FormatJsonSchema,
    FormatText,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputText,
    MessageItem,
    OutputText,
    Part,
    ReasoningItem,
    Refusal,
    ResponsesFunctionTool,
    ResponsesNamedChoice,
    TextConfig,
    TextFormat,
    _check_parts,
    _parts_text,
)
from batchery.contract.responses.request import (
    ResponsesRequest,
)
from batchery.contract.responses.response import (
    Response,
    ResponseUsage,
    _output_logprobs,
    _suffix,
    response_from_chat,
)

__all__ = [
    "FormatJsonObject",
    "FormatJsonSchema",
    "FormatText",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "INPUT_ITEM_TYPES",
    "InputItem",
    "InputText",
    "LOGPROBS_INCLUDE",
    "MAX_INCLUDE",
    "MessageItem",
    "OutputText",
    "Part",
    "REFUSED_INPUT_PARTS",
    "RESPONSES_IGNORED_FIELDS",
    "RESPONSES_REFUSED_FIELDS",
    "ReasoningItem",
    "Refusal",
    "Response",
    "ResponseUsage",
    "ResponsesFunctionTool",
    "ResponsesNamedChoice",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
    "_check_parts",
    "_output_logprobs",
    "_parts_text",
    "_suffix",
    "response_from_chat",
]
