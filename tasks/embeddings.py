"""``batchery.embeddings``: an OpenAI Embeddings body in, an ``EmbeddingResponse`` (as a dict) out.

Thin, like the chat tasks (``batchery.tasks.chat``), and sharing their error policy (retries, deadlines,
quarantine, requeue): the whole body is one engine request whose inputs the pooling engine packs with the
other requests' into its steps. Shared by the task and the batch-line task (``url: /v1/embeddings``). A worker
of a generative model refuses it with a 400 naming its model's kind (the engine service's ``engine_input``)."""

from __future__ import annotations

from collections.abc import Callable

from batchery.contract.errors import InvalidRequest
from batchery.contract.generation import GenerationRequest, GenerationResult
from batchery.contract.schemas.embeddings import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    encode_vector,
)
from batchery.tasks.chat import _generate, _validate


def embeddings(self, body: dict, timeout: float | None = None) -> dict:
    """OpenAI Embeddings body in, ``EmbeddingResponse`` (as a dict) out."""
    return run_embeddings(self, body, timeout)


def embedding_generation(req: EmbeddingRequest, priority: int = 0) -> GenerationRequest:
    pooling: dict = {}
    if req.dimensions is not None:
        pooling["dimensions"] = req.dimensions
    if req.truncate_prompt_tokens is not None:
        pooling["truncate_prompt_tokens"] = req.truncate_prompt_tokens
    return GenerationRequest(inputs=req.input, pooling=pooling, priority=priority)


def run_embeddings(
    task, body: dict, timeout: float | None = None, *, priority: int = 0, cancelled: Callable[[], bool] | None = None
) -> dict:
    """Validate, embed and shape one embeddings body for ``task`` (a bound Celery task)."""
    req = _validate(EmbeddingRequest, body)
    result = _generate(task, embedding_generation(req, priority), timeout, cancelled)
    return shape_embeddings(req, result, task.app.batchery_settings.model)


def shape_embeddings(req: EmbeddingRequest, result: GenerationResult, model: str) -> dict:
    """The ``EmbeddingResponse`` (as a dict) of a finished embeddings request."""
    if result.embeddings is None or len(result.embeddings) != len(req.input):
        # a worker of a generative model that predates embeddings would answer with text: never pass that on
        raise InvalidRequest("this worker's model is not an embedding model: /v1/embeddings needs one")
    data = [
        Embedding(index=i, embedding=encode_vector(v, req.encoding_format)) for i, v in enumerate(result.embeddings)
    ]
    usage = EmbeddingUsage(prompt_tokens=result.num_prompt_tokens, total_tokens=result.num_prompt_tokens)
    return EmbeddingResponse(data=data, model=model, usage=usage).model_dump(mode="json")
