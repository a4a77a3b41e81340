"""Offline API, vLLM-style::

from batchery.engine.llm import LLM
from batchery.engine.sampling import SamplingParams
llm = LLM(model="smollm2-135m-instruct", dtype="float32")
outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
outs = llm.chat([[{"role": "user", "content": "Hi"}]], [SamplingParams(temperature=0, max_tokens=32)])

emb = LLM(model="all-minilm-l6-v2", dtype="float32")  # a pooling model: a sentence-transformers directory
vecs = emb.embed(["a sentence", "another"])  # EmbeddingOutput: .embedding, .prompt_token_ids, .error
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any, cast

from batchery.engine.config import DEFAULT_MODEL, EngineConfig
from batchery.engine.encoder_runner import is_pooling_model
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.pooling import EmbeddingOutput, PoolingParams
from batchery.engine.pooling_engine import PoolingEngine
from batchery.engine.sampling import SamplingParams
from batchery.engine.sequence import CompletionOutput, RequestOutput

RUNNERS = ("auto", "generate", "pooling")


class LLM:
    def __init__(
        self, model: str = DEFAULT_MODEL, dtype: str = "auto", runner: str = "auto", **engine_kwargs: Any
    ) -> None:
        """``runner``: "generate" (a causal LM: ``generate``, ``chat``), "pooling" (an embedding model, or a decoder
        used as one: ``embed``), "auto" (pooling for sentence-transformers directories and models without an LM head).
        ``engine_kwargs``: any other ``EngineConfig`` field (``max_num_seqs``, ``device``, ...)."""
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
        config = EngineConfig(model=model, dtype=dtype, **engine_kwargs)
        if runner == "auto":
            runner = "pooling" if is_pooling_model(model) else "generate"
        self.engine: LLMEngine | PoolingEngine = PoolingEngine(config) if runner == "pooling" else LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _generator(self) -> LLMEngine:
        if isinstance(self.engine, PoolingEngine):
            raise ValueError(f"{self.engine.config.model} is run as an embedding model: use LLM.embed()")
        return self.engine

    def embed(
        self,
        inputs: str | list[int] | list[str] | list[list[int]],
        params: PoolingParams | None = None,
    ) -> list[EmbeddingOutput]:
        """Embed each input (text or token ids; text gets the model's special tokens). Outputs come back in
        input order; an input the engine rejects (empty, too long without ``truncate_prompt_tokens``, a
        ``dimensions`` the model does not allow) fails alone, with ``error`` set and no embedding."""
        engine = self.engine
        if not isinstance(engine, PoolingEngine):
            raise ValueError(f"{engine.config.model} is run as a generative model: use LLM(..., runner='pooling')")
        single = isinstance(inputs, str) or (bool(inputs) and isinstance(inputs[0], int))
        batch = cast("list[str | list[int]]", [inputs] if single else inputs)
        params = params if params is not None else PoolingParams()
        results: dict[str, EmbeddingOutput] = {}
        order = []
        texts = [item for item in batch if isinstance(item, str) and item]
        encoded = iter(engine.encode_many(texts))  # the texts' ids, in order, in one batch call
        for item in batch:
            rid = f"embed-{next(self._ids)}"
            order.append(rid)
            if isinstance(item, str):
                ids = next(encoded) if item else []  # an empty string fails in add_request, as at the API
            else:
                ids = list(item)
            try:
                engine.add_request(rid, ids, params)
            except ValueError as e:
                results[rid] = EmbeddingOutput(rid, ids, [], error=str(e))
        while engine.has_unfinished():
            for out in engine.step():
                results[out.request_id] = out.outputs[0]
        return [results[rid] for rid in order]

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids). Outputs come back in prompt order, one per
        prompt, with ``SamplingParams.n`` choices in ``outputs``; a prompt the engine rejects (e.g.
        longer than the context) fails alone with ``finish_reason == "error"`` (every choice's) and
        ``error`` set."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = cast("list[str | list[int]]", [prompts] if single else prompts)
        engine = self._generator()
        token_ids = [engine.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(token_ids, params)

    def chat(
        self,
        conversations: list[list[dict[str, Any]]] | list[dict[str, Any]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply for each conversation (a list of ``{"role", "content"}`` messages)."""
        single = bool(conversations) and isinstance(conversations[0], dict)
        batch = cast("list[list[dict[str, Any]]]", [conversations] if single else conversations)
        engine = self._generator()
        return self._run([engine.encode_chat(c) for c in batch], params)

    def _run(
        self, token_ids: list[list[int]], params: SamplingParams | Seq[SamplingParams] | None
    ) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(token_ids)
        if len(params) != len(token_ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(token_ids)} prompts")
        engine = self._generator()
        results: dict[str, RequestOutput] = {}
        order = []
        for ids, p in zip(token_ids, params, strict=True):
            rid = f"llm-{next(self._ids)}"
            order.append(rid)
            try:
                engine.add_request(rid, ids, p)
            except ValueError as e:
                n = p.n if isinstance(p, SamplingParams) else 1
                choices = [CompletionOutput(i, [], "", "error") for i in range(n)]
                results[rid] = RequestOutput(rid, ids, [], "", "error", error=str(e), outputs=choices)
        while engine.has_unfinished():
            for out in engine.step():
                results[out.request_id] = out
        return [results[rid] for rid in order]
