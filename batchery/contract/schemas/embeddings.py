"""The Embeddings request and response bodies (``/v1/embeddings``), as OpenAI defines them.

``input`` is a string, a list of strings, a list of token ids or a list of such lists: up to 2,048 inputs
(OpenAI's limit), none empty. ``encoding_format`` is ``float`` (a list of numbers) or ``base64`` (the vector's
little-endian float32 bytes, base64-encoded, which the openai SDK decodes). ``dimensions`` asks for a shorter
vector: the worker refuses it for a model not trained to be cut (Matryoshka). ``user`` is accepted and has no
effect. vLLM's ``truncate_prompt_tokens`` keeps the first N tokens of an input that is longer (-1: the model's
limit) where the default is a 400 naming the input and its length. Which model's limit, and so which input is too
long, only the worker knows: those checks are there."""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from batchery.contract.schemas.common import MAX_PROMPT_TOKEN_IDS, MAX_TEXT_CHARS, MAX_TOKEN_ID, ShortText, _Strict

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request
MAX_EMBEDDING_DIMENSIONS = 1 << 16


def _check_inputs(v: Any) -> Any:
    """The request's inputs as a list (a single string or token-id list becomes a list of one)."""
    if isinstance(v, str):
        v = [v]
    elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        v = [v]
    if not isinstance(v, list):
        raise ValueError("input must be a string, a list of strings, a list of token ids or a list of such lists")
    if not v:
        raise ValueError("input must not be an empty list")
    if len(v) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"input has {len(v)} items; at most {MAX_EMBEDDING_INPUTS} inputs are allowed per request")
    chars = 0
    for i, item in enumerate(v):
        if isinstance(item, str):
            if not item:
                raise ValueError(f"input[{i}] is an empty string")
            chars += len(item)
        elif isinstance(item, list):
            if not item:
                raise ValueError(f"input[{i}] is an empty list of token ids")
            if len(item) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"input[{i}] has {len(item)} token ids; the limit is {MAX_PROMPT_TOKEN_IDS}")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID for t in item):
                raise ValueError(f"input[{i}] must be a list of non-negative integer token ids")
            chars += len(item)
        else:
            raise ValueError(f"input[{i}] must be a string or a list of token ids, and all items of one kind")
    if len({isinstance(item, str) for item in v}) > 1:
        raise ValueError("input mixes strings and token-id lists; send one kind per request")
    if chars > MAX_TEXT_CHARS:
        raise ValueError(f"input has {chars} characters and token ids in all; the limit is {MAX_TEXT_CHARS}")
    return v


class EmbeddingRequest(_Strict):
    """Body of ``/v1/embeddings`` (and of batch lines with that url)."""

    input: list[str] | list[list[int]]
    model: ShortText | None = None  # informational: the queue decides the model
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=MAX_EMBEDDING_DIMENSIONS)
    user: ShortText | None = None  # accepted, without effect (OpenAI's abuse monitoring)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_PROMPT_TOKEN_IDS)  # vLLM's extension
    timeout: float | None = None  # Batchery's per-request deadline, as on the other endpoints

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        return _check_inputs(v)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for the model's limit")
        return v


# -- responses --------------------------------------------------------------------------------
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class EmbeddingUsage(_Open):
    prompt_tokens: int
    total_tokens: int


class Embedding(_Open):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a str with encoding_format "base64"


class EmbeddingResponse(_Open):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: the list itself, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def decode_vector(value: list[float] | str) -> list[float]:
    """The inverse of ``encode_vector`` (base64 comes back as float32 values)."""
    if isinstance(value, str):
        raw = base64.b64decode(value)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return value
