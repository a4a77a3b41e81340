"""The engine: ``add_request`` / ``abort`` / ``step()``. Single-threaded: one loop drives it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from itertools import repeat
from typing import Any

import torch

from batchery.engine.block_manager import BlockManager
from batchery.engine.chat_template import render_chat
from batchery.engine.config import EngineConfig
from batchery.engine.detokenizer import final_text
from batchery.engine.loader import LoadedModel, load_model
from batchery.engine.model_runner import LaunchedStep, ModelRunner
from batchery.engine.sampling import SamplingParams
from batchery.engine.scheduler import Scheduler, SchedulerOutput
from batchery.engine.sequence import CompletionOutput, RequestOutput, Sequence
from batchery.engine.stop_checker import STOP_TOKEN, StopChecker
from batchery.engine.structured import GrammarCache, grammar_cache

log = logging.getLogger("batchery.engine")

OOM_RESTORE_STEPS = 64  # steps without an out-of-memory error before a shrunk step limit doubles back
OOM_MIN_TOKENS = 16  # the token budget never shrinks below this (or the scheduled step, if smaller)
CHOICE_SEED_STEP = 0x9E3779B97F4A7C15  # the golden-ratio increment: seeds of a request's choices far apart


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``: choice 0 keeps ``seed`` (so it
    samples exactly as the request would with ``n=1``), the others get seeds of their own."""
    return seed if index == 0 else (seed + index * CHOICE_SEED_STEP) % 2**63


def _eos_ids(loaded: LoadedModel) -> list[int]:
    ids: set[int] = set()
    gen = getattr(loaded.model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(loaded.tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return sorted(ids)


def resolve_async_scheduling(setting: bool | str, device: torch.device) -> bool:
    """``EngineConfig.async_scheduling``: "auto" is on where the device runs a step while the host
    prepares the next (CUDA); on the CPU the host is the device, so nothing would overlap."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


@dataclasses.dataclass
class _Pending:
    """A step launched under async scheduling whose tokens the host has not committed yet."""

    sched: SchedulerOutput
    launched: LaunchedStep


class PromptTooLong(ValueError):
    """The prompt leaves no room to generate within ``max_model_len``."""


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded if loaded is not None else load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(config, self.loaded)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.stop_checker = StopChecker(self.tokenizer, _eos_ids(self.loaded), self.max_model_len)
        self.requests: dict[str, Sequence] = {}  # request id -> its choice 0 (until every choice has finished)
        self.choices: dict[str, list[Sequence]] = {}  # request id -> all its choices, by index
        self.on_step_start: Callable[[list[Sequence]], None] | None = None
        self.num_steps = 0
        self._sum_batch_seqs = 0
        self._sum_batch_tokens = 0
        self.last_step_num_seqs = 0
        self.last_step_num_tokens = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0  # of the finished requests, each prompt once
        self.num_oom = 0  # steps that ran out of memory and were shrunk
        self._oom_ok_steps = 0  # steps since the last OOM (or the last restore)
        self.async_scheduling = resolve_async_scheduling(config.async_scheduling, self.runner.device)
        self._pending: _Pending | None = None  # async scheduling: the step on the device, not yet committed
        self.num_async_steps = 0  # steps launched while the one before was still on the device
        self.num_async_drains = 0  # times the pipeline was drained for a step that needs the tokens first

    @property
    def eos_ids(self) -> list[int]:
        """The model's end-of-sequence token ids, held by the stop check (the sampler's
        ``min_tokens`` ban reads the same list)."""
        return self.stop_checker.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: list[int]) -> None:
        self.stop_checker.eos_ids = ids

    @property
    def grammars(self) -> GrammarCache:
        """Compiled structured-output grammars, kept on the loaded model (a rebuilt engine keeps
        them). Thread-safe: the engine service compiles in its callers' threads, off the loop."""
        return grammar_cache(
            self.loaded, self.tokenizer, self.runner.vocab_size, self.eos_ids, json_layout=self.config.json_layout
        )

    # -- tokenization ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return render_chat(self.tokenizer, messages, tools)

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        isolated: bool = False,
    ) -> None:
        """Queue a request. Raises ``ValueError`` naming the problem; the engine is unaffected.
        An ``isolated`` request runs only in steps of its own, taking turns with the steps of the
        others (quarantine: if such a step fails, the request was the only one in it).

        ``params.n`` choices run: choice 0 computes the prompt and the others fork its prompt blocks
        once it has (``Scheduler.add_fork``), each with its own random stream (``choice_seed``) and
        its own grammar state; one ``RequestOutput`` comes back when all of them have finished."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if not all(map(isinstance, prompt_token_ids, repeat(int))) or not (
            0 <= min(prompt_token_ids) and max(prompt_token_ids) < self.runner.vocab_size
        ):
            raise ValueError(f"prompt token ids must be integers in [0, {self.runner.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong(
                f"the prompt has {len(prompt_token_ids)} tokens but the model's context (max_model_len) is "
                f"{self.max_model_len}, leaving no room to generate"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        params = self._fit_to_model(params)
        spec = params.structured
        seqs: list[Sequence] = []
        for i in range(params.n):  # all built before any is queued: an invalid constraint queues nothing
            p = params
            if i and params.seed is not None:
                p = dataclasses.replace(params, seed=choice_seed(params.seed, i))
            seqs.append(
                Sequence(
                    request_id,
                    prompt_token_ids,
                    p,
                    priority=priority,
                    arrival_time=seqs[0].arrival_time if seqs else None,
                    isolated=bool(isolated),
                    grammar=self.grammars.matcher(spec) if spec is not None else None,
                    index=i,
                )
            )
        parent = seqs[0]
        self.requests[request_id] = parent
        self.choices[request_id] = seqs
        self.scheduler.add(parent)
        for child in seqs[1:]:
            self.scheduler.add_fork(child, parent)

    def _fit_to_model(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against the loaded model, so that nothing a step indexes can be out of
        range: stop token ids must be in the vocabulary (``ValueError`` otherwise), and a ``top_k`` at
        or above it keeps every token, so it is off. The caller's object is never changed."""
        vocab = self.runner.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            shown = ", ".join(map(str, outside[:5])) + (", ..." if len(outside) > 5 else "")
            raise ValueError(
                f"stop_token_ids {shown} are outside this model's vocabulary of {vocab} tokens (ids 0 to {vocab - 1})"
            )
        outside = sorted(t for t in params.logit_bias or {} if t >= vocab)
        if outside:
            shown = ", ".join(map(str, outside[:5])) + (", ..." if len(outside) > 5 else "")
            raise ValueError(
                f"logit_bias token ids {shown} are outside this model's vocabulary of {vocab} tokens "
                f"(ids 0 to {vocab - 1})"
            )
        if params.top_k >= vocab:
            params = dataclasses.replace(params, top_k=0)
        return params

    def abort(self, request_id: str) -> bool:
        """Drop a request now, all its choices, and free their KV blocks. False if it is unknown
        or already finished."""
        if self.requests.pop(request_id, None) is None:
            return False
        for seq in reversed(self.choices.pop(request_id)):  # the forks first, then the parent
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        if self._pending is not None and not self.requests:
            self._drain()  # nothing left to run: the step on the device gives its blocks back now
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns the requests that finished in it (under async scheduling,
        those that the step before it finished: its tokens are read one step late)."""
        if self.async_scheduling:
            return self._step_async()
        sched = self.scheduler.schedule()
        if not sched:
            return []
        try:
            if self.on_step_start is not None:
                self.on_step_start(sched.seqs)
            runner_out = self.runner.run(sched.seqs, sched.num_new_tokens, self.eos_ids)
        except torch.OutOfMemoryError as exc:
            self._shrink_after_oom(sched, exc)
            return []
        self._count_step(sched)
        finished = self.scheduler.update_from_output(sched, runner_out, self.stop_checker.check)
        return self._outputs(finished)

    def _count_step(self, sched: SchedulerOutput) -> None:
        if (
            self.scheduler.max_num_seqs < self.config.max_num_seqs
            or self.scheduler.max_num_batched_tokens < self.config.max_num_batched_tokens
        ):
            self._maybe_restore_step_limits()
        self.num_steps += 1
        self.last_step_num_seqs = len(sched.seqs)
        self.last_step_num_tokens = sched.num_batched_tokens
        self._sum_batch_seqs += len(sched.seqs)
        self._sum_batch_tokens += sched.num_batched_tokens

    # -- async scheduling --------------------------------------------------------------------
    def _step_async(self) -> list[RequestOutput]:
        """vLLM v1's async scheduling: step k+1 is scheduled and packed while step k runs on the
        device, then launched, and only then are k's tokens read and committed (stop checks,
        finishes, frees), while k+1 runs. Every sequence that samples in k has a placeholder token
        meanwhile (``Scheduler.advance``), so k+1 gives it its next position; its input id is taken
        on the device from k's sampled ids. A sequence that k finishes has one row of k+1 computed
        for nothing: that token is dropped, and its blocks are freed once k+1 is committed.

        A step whose rows need the previous token on the host before they can be built falls back:
        the pipeline is drained (k committed) first. That is a step after one that sampled for a
        grammar-constrained row (its mask follows the token) or a penalised one (penalties read the
        output so far), and every step while isolated (quarantined) sequences are in the engine.
        Everything else pipelines: decodes, new prefills and chunks, preemption, n > 1 forks,
        seeds, logprobs, min_tokens, stop strings and tokens."""
        outputs: list[RequestOutput] = []
        prev = self._pending
        if prev is not None and (prev.launched.needs_host or self.scheduler.isolated):
            self.num_async_drains += 1
            outputs += self._drain()
            prev = None
        sched = self.scheduler.schedule()
        if not sched:
            return outputs + self._drain() if prev is not None else outputs
        prev_tokens = prev.launched.tokens if prev is not None else None
        try:
            if self.on_step_start is not None:
                self.on_step_start(sched.seqs)
            launched = self.runner.launch(sched.seqs, sched.num_new_tokens, self.eos_ids, prev_tokens)
        except torch.OutOfMemoryError as exc:
            outputs += self._drain()  # nothing of this step was committed; the one before it is, first
            self._shrink_after_oom(sched, exc)
            return outputs
        self._count_step(sched)
        self.scheduler.held = set(sched.seqs)
        self._pending = _Pending(sched, launched)
        if prev is not None:
            self.num_async_steps += 1
            outputs += self._outputs(self.scheduler.commit(prev.launched.get(), self.stop_checker.check))
        sch = self.scheduler
        sch.advance(sched, launched.sample_seqs, self.max_model_len)
        if not self.requests or (
            sch.finishing
            and len(sch.finishing) >= len(sch.running)
            and not sch.num_waiting
            and all(s in sch.finishing for s in sch.running)
        ):
            # the last request finished, or every one left takes its last token in this step: commit it
            # now rather than leave it for a step that launches nothing (no step left on the device)
            outputs += self._drain()
        return outputs

    def _drain(self) -> list[RequestOutput]:
        """Commit the step on the device, if any; nothing is on the device afterwards."""
        prev = self._pending
        if prev is None:
            return []
        self._pending = None
        runner_out = prev.launched.get()
        self.scheduler.held = set()
        return self._outputs(self.scheduler.commit(runner_out, self.stop_checker.check))

    def _outputs(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests whose last choice is among ``finished``."""
        outputs = []
        for seq in finished:
            self.num_generated_tokens += seq.num_output_tokens
        for seq in finished:
            choices = self.choices.get(seq.request_id)
            if choices is None or not all(s.is_finished for s in choices):
                continue  # its other choices go on (or it was output already, with a choice that finished beside it)
            del self.choices[seq.request_id]
            self.requests.pop(seq.request_id, None)
            self.num_prompt_tokens += seq.num_prompt_tokens
            outputs.append(self._output(choices))
        return outputs

    # -- out of memory ---------------------------------------------------------------------
    def _shrink_after_oom(self, sched: SchedulerOutput, exc: BaseException) -> None:
        """A step ran out of accelerator memory. Nothing of it was committed (no token counted as
        computed, none sampled), so it can simply be scheduled again, smaller: halve the token
        budget and the number of sequences per step, and preempt the newest running sequences
        beyond that (their blocks go back to the pool; they are recomputed later). Limits double
        back after ``OOM_RESTORE_STEPS`` clean steps. Re-raises when the step cannot get smaller."""
        sch = self.scheduler
        num_seqs, num_tokens = len(sched.seqs), sched.num_batched_tokens
        if num_seqs <= 1 and num_tokens <= OOM_MIN_TOKENS:
            raise exc  # one sequence, a handful of tokens: nothing left to shrink; a real failure
        self.num_oom += 1
        self._oom_ok_steps = 0
        self.last_step_num_seqs = self.last_step_num_tokens = 0
        # an isolated sequence's own step is one sequence: only its token budget can be the cause
        max_seqs = sch.max_num_seqs if sched.isolated else max(1, min(sch.max_num_seqs, num_seqs // 2 or 1))
        max_tokens = max(min(OOM_MIN_TOKENS, num_tokens), num_tokens // 2)
        num_preempted = sch.set_step_limits(max_seqs, max_tokens)
        del exc  # its traceback holds the step's activations
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        log.warning(
            "out of memory in a step of %d sequences and %d tokens: shrinking steps to at most %d sequences "
            "and %d tokens, %d sequences preempted (OOM #%d)",
            num_seqs,
            num_tokens,
            sch.max_num_seqs,
            sch.max_num_batched_tokens,
            num_preempted,
            self.num_oom,
        )

    def _maybe_restore_step_limits(self) -> None:
        self._oom_ok_steps += 1
        if self._oom_ok_steps < OOM_RESTORE_STEPS:
            return
        self._oom_ok_steps = 0
        sch, cfg = self.scheduler, self.config
        sch.set_step_limits(
            max_num_seqs=min(cfg.max_num_seqs, sch.max_num_seqs * 2),
            max_num_batched_tokens=min(cfg.max_num_batched_tokens, sch.max_num_batched_tokens * 2),
        )
        log.info(
            "no out-of-memory error for %d steps: step limits back up to %d sequences and %d tokens",
            OOM_RESTORE_STEPS,
            sch.max_num_seqs,
            sch.max_num_batched_tokens,
        )

    def _output(self, choices: list[Sequence]) -> RequestOutput:
        """The request's output once all its ``choices`` (index order) have finished."""
        outs = []
        for seq in choices:
            stop_token = seq.finish_reason == STOP_TOKEN
            if stop_token:
                seq.finish_reason = "stop"
            text = final_text(self.tokenizer, seq, strip_last=stop_token)
            outs.append(CompletionOutput(seq.index, seq.output_token_ids, text, seq.finish_reason, seq.logprobs))
        first, out0 = choices[0], outs[0]
        return RequestOutput(
            request_id=first.request_id,
            prompt_token_ids=first.prompt_token_ids,
            token_ids=out0.token_ids,
            text=out0.text,
            finish_reason=out0.finish_reason,
            logprobs=out0.logprobs,
            num_cached_tokens=first.num_cached_tokens,
            outputs=outs,
        )

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """Counters and gauges of the engine (the worker's metrics read these keys)."""
        bm = self.block_manager
        steps = max(self.num_steps, 1)
        grammars = getattr(self.loaded, "_batchery_grammars", None)  # only once a constraint was compiled
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "num_steps": self.num_steps,
            "last_step_num_seqs": self.last_step_num_seqs,
            "last_step_num_tokens": self.last_step_num_tokens,
            "mean_batch_size": self._sum_batch_seqs / steps,
            "mean_batch_tokens": self._sum_batch_tokens / steps,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "prefix_cache_hit_tokens": bm.num_hit_tokens,
            "prefix_cache_query_tokens": bm.num_query_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_oom": self.num_oom,
            "cuda_graph_steps": self.runner.graphs.num_runs if self.runner.graphs is not None else 0,
            "num_async_steps": self.num_async_steps,
            "num_async_drains": self.num_async_drains,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_prompt_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            "num_forked_choices": self.scheduler.num_forks,
            "num_prefix_waits": self.scheduler.num_prefix_waits,
            "grammar_compiled": int(getattr(grammars, "num_compiled", 0)),
            "grammar_cache_hits": int(getattr(grammars, "num_hits", 0)),
            "time": time.time(),
        }
