"""Offline API, vLLM-style::

from batchery.engine.llm import LLM
from batchery.engine.sampling import SamplingParams
llm = LLM(model="smollm2-135m-instruct", dtype="float32")
outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
outs = llm.chat([[{"role": "user", "content": "Hi"}]], [SamplingParams(temperature=0, max_tokens=32)])
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any, cast

from batchery.engine.config import DEFAULT_MODEL, EngineConfig
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.sampling import SamplingParams
from batchery.engine.sequence import CompletionOutput, RequestOutput


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", **engine_kwargs: Any) -> None:
        """``engine_kwargs``: any other ``EngineConfig`` field (``max_num_seqs``, ``device``, ...)."""
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

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
        token_ids = [self.engine.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(token_ids, params)

    def chat(
        self,
        conversations: list[list[dict[str, Any]]] | list[dict[str, Any]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply for each conversation (a list of ``{"role", "content"}`` messages)."""
        single = bool(conversations) and isinstance(conversations[0], dict)
        batch = cast("list[list[dict[str, Any]]]", [conversations] if single else conversations)
        return self._run([self.engine.encode_chat(c) for c in batch], params)

    def _run(
        self, token_ids: list[list[int]], params: SamplingParams | Seq[SamplingParams] | None
    ) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(token_ids)
        if len(params) != len(token_ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(token_ids)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        for ids, p in zip(token_ids, params, strict=True):
            rid = f"llm-{next(self._ids)}"
            order.append(rid)
            try:
                self.engine.add_request(rid, ids, p)
            except ValueError as e:
                n = p.n if isinstance(p, SamplingParams) else 1
                choices = [CompletionOutput(i, [], "", "error") for i in range(n)]
                results[rid] = RequestOutput(rid, ids, [], "", "error", error=str(e), outputs=choices)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                results[out.request_id] = out
        return [results[rid] for rid in order]
