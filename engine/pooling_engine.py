"""The engine of a pooling (embedding) model: ``add_request`` / ``abort`` / ``step()``, as ``LLMEngine``.

Requests are prefill-only: each is one whole input, run once and pooled. A step packs waiting inputs, oldest
first, into one row under the token budget (``max_num_batched_tokens``) and ``max_num_seqs``; an input that does
not fit the room left waits for the next step while shorter ones behind it go now, and an input larger than the
whole budget runs in a step of its own (it is never split: an encoder's attention is bidirectional). No KV cache,
no decode. Single-threaded: one loop drives it."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from batchery.engine.config import EngineConfig
from batchery.engine.encoder_runner import EncoderRunner, LoadedEncoder, load_encoder
from batchery.engine.pooling import EmbeddingOutput, PoolingParams, check_dimensions, cut

log = logging.getLogger("batchery.engine.pooling")


class InputTooLong(ValueError):
    """An input is longer than the model takes, and the request did not ask for truncation."""


@dataclass
class PoolingRequest:
    """One input waiting for (or in) a step."""

    request_id: str
    token_ids: list[int]
    params: PoolingParams


def schedule(waiting: deque[PoolingRequest], max_num_seqs: int, max_num_batched_tokens: int) -> list[PoolingRequest]:
    """Take the step's requests out of ``waiting`` (oldest first; see the module docstring). Pure Python."""
    step: list[PoolingRequest] = []
    budget = max_num_batched_tokens
    kept: deque[PoolingRequest] = deque()
    while waiting and len(step) < max_num_seqs:
        req = waiting.popleft()
        n = len(req.token_ids)
        if n <= budget or not step:
            step.append(req)
            budget -= n
            if budget <= 0:
                break
        else:
            kept.append(req)
            if len(kept) >= 4 * max_num_seqs:  # a bounded look-ahead past inputs that do not fit
                break
    kept.extend(waiting)
    waiting.clear()
    waiting.extend(kept)
    return step


class PoolingEngine:
    """Embeds token-id inputs; ``step()`` returns the requests it finished."""

    is_pooling = True

    def __init__(self, config: EngineConfig, loaded: LoadedEncoder | None = None) -> None:
        self.config = config
        self.loaded = loaded if loaded is not None else load_encoder(config)
        self.tokenizer = self.loaded.tokenizer
        self.pooler = self.loaded.pooler
        self.max_model_len = self.pooler.max_seq_len
        self.runner = EncoderRunner(self.loaded)
        self.waiting: deque[PoolingRequest] = deque()
        self.num_steps = 0
        self.num_prompt_tokens = 0  # of the finished requests
        self.last_step_num_seqs = 0
        self.last_step_num_tokens = 0

    # -- tokenization ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """The input's token ids, specials included (``[CLS] ... [SEP]`` for BERT), untruncated."""
        return list(self.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"])

    # -- requests --------------------------------------------------------------------------
    def check(self, token_ids: list[int], params: PoolingParams) -> list[int]:
        """The token ids the engine will run (truncated if asked); raises ValueError on an input the
        model cannot take. Called by ``add_request``, and by callers that validate before submitting."""
        if not token_ids:
            raise ValueError("input is empty")
        why = check_dimensions(self.pooler, params.dimensions)
        if why is not None:
            raise ValueError(why)
        limit = self.max_model_len
        if params.truncate_prompt_tokens is not None:
            if params.truncate_prompt_tokens < 1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1, got {params.truncate_prompt_tokens}")
            limit = min(limit, params.truncate_prompt_tokens)
            if len(token_ids) > limit:
                token_ids = self._truncate(token_ids, limit)
        if len(token_ids) > limit:
            raise InputTooLong(f"input has {len(token_ids)} tokens; this model takes at most {limit}")
        return token_ids

    def _truncate(self, token_ids: list[int], limit: int) -> list[int]:
        """The input cut to ``limit`` tokens, keeping its first tokens and its closing special (``[SEP]``),
        as sentence-transformers truncates; for decoders, the last ``limit`` tokens (vLLM's choice)."""
        if self.loaded.is_causal:
            return token_ids[-limit:]
        sep = getattr(self.tokenizer, "sep_token_id", None)
        if sep is not None and token_ids[-1] == sep and limit >= 2:
            return token_ids[: limit - 1] + [sep]
        return token_ids[:limit]

    def add_request(self, request_id: str, token_ids: list[int], params: PoolingParams | None = None) -> None:
        params = params if params is not None else PoolingParams()
        ids = self.check(list(token_ids), params)
        self.waiting.append(PoolingRequest(request_id, ids, params))

    def abort(self, request_id: str) -> bool:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def num_unfinished(self) -> int:
        return len(self.waiting)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[EmbeddingOutput]:
        reqs = schedule(self.waiting, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        if not reqs:
            return []
        pooled = self.runner.execute([r.token_ids for r in reqs])  # [num_seqs, hidden]
        self.num_steps += 1
        self.last_step_num_seqs = len(reqs)
        self.last_step_num_tokens = sum(len(r.token_ids) for r in reqs)
        self.num_prompt_tokens += self.last_step_num_tokens
        outs = []
        for req, vec in zip(reqs, pooled, strict=True):
            v = cut(vec, req.params.dimensions, self.pooler)
            outs.append(EmbeddingOutput(req.request_id, req.token_ids, v.tolist()))
        return outs
