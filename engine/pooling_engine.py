"""The engine of a pooling (embedding) model: ``add_request`` / ``abort`` / ``step()``, as ``LLMEngine``.

A request is one or more inputs (an embeddings body's ``input`` list); each input is prefill-only: run once and
pooled. A step packs waiting inputs, oldest first, into one row under the token budget (``max_num_batched_tokens``)
and ``max_num_seqs``; an input that does not fit the room left waits for the next step while shorter ones behind it
go now, and an input larger than the whole budget runs in a step of its own (it is never split: an encoder's
attention is bidirectional). A request is finished, and comes out of ``step()``, when all its inputs are pooled.
No KV cache, no decode. Single-threaded: one loop drives it (the worker's engine service, or ``LLM.embed``)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from batchery.engine.config import EngineConfig
from batchery.engine.encoder_runner import EncoderRunner, LoadedEncoder, load_encoder
from batchery.engine.pooling import EmbeddingOutput, PoolingParams, PoolingRequestOutput, check_dimensions, cut

log = logging.getLogger("batchery.engine.pooling")


class InputTooLong(ValueError):
    """An input is longer than the model takes, and the request did not ask for truncation."""


@dataclass
class PoolingInput:
    """One input of a request, waiting for (or in) a step (the scheduler's unit)."""

    request_id: str
    index: int  # its place in the request's inputs
    token_ids: list[int]
    isolated: bool = False  # quarantined: runs only in steps with no other request's inputs


@dataclass
class _Request:
    params: PoolingParams
    num_inputs: int
    done: dict[int, EmbeddingOutput] = field(default_factory=dict)


def schedule(waiting: deque[PoolingInput], max_num_seqs: int, max_num_batched_tokens: int) -> list[PoolingInput]:
    """Take the step's inputs out of ``waiting`` (oldest first; see the module docstring). An isolated input
    shares its step only with inputs of its own request. Pure Python."""
    step: list[PoolingInput] = []
    budget = max_num_batched_tokens
    kept: deque[PoolingInput] = deque()
    owner: str | None = None  # set when the step belongs to one isolated request
    while waiting and len(step) < max_num_seqs:
        inp = waiting.popleft()
        n = len(inp.token_ids)
        fits = n <= budget or not step
        if inp.isolated and step and owner != inp.request_id:
            fits = False
        if owner is not None and inp.request_id != owner:
            fits = False
        if fits:
            if inp.isolated and not step:
                owner = inp.request_id
            step.append(inp)
            budget -= n
            if budget <= 0:
                break
        else:
            kept.append(inp)
            if len(kept) >= 4 * max_num_seqs:  # a bounded look-ahead past inputs that do not fit
                break
    kept.extend(waiting)
    waiting.clear()
    waiting.extend(kept)
    return step


class PoolingEngine:
    """Embeds token-id inputs; ``step()`` returns the requests it finished."""

    is_pooling = True
    num_kv_blocks = 0  # no KV cache

    def __init__(self, config: EngineConfig, loaded: LoadedEncoder | None = None) -> None:
        self.config = config
        self.loaded = loaded if loaded is not None else load_encoder(config)
        self.tokenizer = self.loaded.tokenizer
        self.pooler = self.loaded.pooler
        self.max_model_len = self.pooler.max_seq_len
        self.runner = EncoderRunner(self.loaded)
        self.waiting: deque[PoolingInput] = deque()
        self.requests: dict[str, _Request] = {}
        # called with the step's inputs before the forward pass (the engine service counts steps, injects faults)
        self.on_step_start: Callable[[list[PoolingInput]], None] | None = None
        self.num_steps = 0
        self.num_prompt_tokens = 0  # of the pooled inputs
        self.num_inputs = 0  # pooled inputs
        self.last_step_num_seqs = 0
        self.last_step_num_tokens = 0

    # -- tokenization ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """The input's token ids, specials included (``[CLS] ... [SEP]`` for BERT), untruncated."""
        return list(self.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"])

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, in one batch call of the tokenizer (a fast tokenizer encodes a batch in Rust,
        across the cores): for 10,000 inputs of 10-200 words 1.6-1.9 s instead of 3.0-3.3 s one by one on the 2-core
        EPYC, time in which ``LLM.embed`` runs no step. Through the transformers tokenizer, never its backend's
        ``encode_batch`` directly: a sentence-transformers ``tokenizer.json`` can carry padding and truncation (128
        for all-MiniLM-L6-v2), which the backend applies until a transformers call turns them off."""
        if not texts:
            return []
        ids = self.tokenizer(texts, add_special_tokens=True, truncation=False, padding=False, verbose=False)
        return [list(t) for t in ids["input_ids"]]

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        raise ValueError(f"{self.config.model} is an embedding model: it serves /v1/embeddings, not chat")

    # -- requests --------------------------------------------------------------------------
    def check(self, token_ids: list[int], params: PoolingParams, index: int | None = None) -> list[int]:
        """The token ids the engine will run (truncated if asked); raises ValueError on an input the model
        cannot take, naming it by ``index`` where given (an embeddings body's ``input[i]``)."""
        name = "input" if index is None else f"input[{index}]"
        if not token_ids:
            raise ValueError(f"{name} is empty")
        vocab = int(getattr(self.loaded.hf_config, "vocab_size", 0) or 0)
        if vocab and any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"{name} has a token id outside this model's vocabulary (0 to {vocab - 1})")
        limit = self.max_model_len
        truncate = params.truncate_prompt_tokens
        if truncate is not None:
            if truncate == -1:
                truncate = limit
            if truncate < 1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {truncate}")
            limit = min(limit, truncate)
            if len(token_ids) > limit:
                token_ids = self._truncate(token_ids, limit)
        if len(token_ids) > limit:
            raise InputTooLong(
                f"{name} has {len(token_ids)} tokens; this model takes at most {limit} "
                "(truncate_prompt_tokens asks for longer inputs to be cut)"
            )
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

    def add_request(
        self,
        request_id: str,
        token_ids: list[int] | list[list[int]],
        params: Any = None,
        *,
        priority: int = 0,
        isolated: bool = False,
    ) -> None:
        """Queue a request of one input (a token-id list) or several (a list of them). ``params``: its
        ``PoolingParams`` (anything else, such as the engine service's canary ``SamplingParams``, means the
        defaults). Raises ValueError, naming the input, when one cannot be taken; nothing is queued then."""
        pp = params if isinstance(params, PoolingParams) else PoolingParams()
        if request_id in self.requests:
            raise ValueError(f"request {request_id} is already in the engine")
        why = check_dimensions(self.pooler, pp.dimensions)
        if why is not None:
            raise ValueError(why)
        several = bool(token_ids) and isinstance(token_ids[0], list)
        inputs: list[list[int]] = (
            [list(t) for t in cast("list[list[int]]", token_ids)] if several else [list(cast("list[int]", token_ids))]
        )
        checked = [self.check(ids, pp, i if several else None) for i, ids in enumerate(inputs)]
        self.requests[request_id] = _Request(pp, len(checked))
        self.waiting.extend(PoolingInput(request_id, i, ids, isolated) for i, ids in enumerate(checked))

    def abort(self, request_id: str) -> bool:
        if self.requests.pop(request_id, None) is None:
            return False
        kept = [inp for inp in self.waiting if inp.request_id != request_id]
        self.waiting.clear()
        self.waiting.extend(kept)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def num_unfinished(self) -> int:
        return len(self.requests)

    def stats(self) -> dict[str, int | float]:
        """Counters of the engine: ``LLMEngine.stats()``'s keys (the worker's metrics read them), those of the KV
        cache and decoding at zero, and the pooled inputs."""
        zero = [
            *("kv_blocks_total", "kv_blocks_free", "prefix_cache_hit_tokens", "prefix_cache_query_tokens"),
            *("num_preemptions", "num_oom", "cuda_graph_steps", "num_async_steps", "num_async_drains"),
            *("num_forked_choices", "num_prefix_waits", "grammar_compiled", "grammar_cache_hits"),
        ]
        steps = max(self.num_steps, 1)
        return {
            **dict.fromkeys(zero, 0),
            "mean_batch_size": self.num_inputs / steps,
            "mean_batch_tokens": self.num_prompt_tokens / steps,
            "num_prompt_tokens_computed": self.num_prompt_tokens,
            "num_running": 0,
            "num_waiting": len(self.requests),
            "num_waiting_inputs": len(self.waiting),
            "num_steps": self.num_steps,
            "last_step_num_seqs": self.last_step_num_seqs,
            "last_step_num_tokens": self.last_step_num_tokens,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": 0,
            "num_pooled_inputs": self.num_inputs,
        }

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[PoolingRequestOutput]:
        inputs = schedule(self.waiting, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        if not inputs:
            return []
        if self.on_step_start is not None:
            self.on_step_start(inputs)
        pooled = self.runner.execute([inp.token_ids for inp in inputs])  # [num_seqs, hidden]
        self.num_steps += 1
        self.last_step_num_seqs = len(inputs)
        self.last_step_num_tokens = sum(len(inp.token_ids) for inp in inputs)
        self.num_prompt_tokens += self.last_step_num_tokens
        self.num_inputs += len(inputs)
        finished = []
        for inp, vec in zip(inputs, pooled, strict=True):
            req = self.requests.get(inp.request_id)
            if req is None:  # aborted while its step ran
                continue
            v = cut(vec, req.params.dimensions, self.pooler)
            req.done[inp.index] = EmbeddingOutput(inp.request_id, inp.token_ids, v.tolist())
            if len(req.done) == req.num_inputs:
                del self.requests[inp.request_id]
                outs = [req.done[i] for i in range(req.num_inputs)]
                finished.append(PoolingRequestOutput(inp.request_id, outs))
        return finished
