"""Per-request state. One object flows between scheduler, block manager and runner.

Pure Python: plain ints and lists, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from batchery.engine.sampling import SamplingParams

if TYPE_CHECKING:  # annotations only: this module stays free of torch at run time
    import torch

    from batchery.engine.structured import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprobs(TypedDict):
    """The logprobs of one sampled token (a plain dict at run time)."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability under the model's distribution (before penalties and temperature)
    top: list[tuple[int, float]]  # the top-N (token id, logprob) pairs, most likely first; [] when N is 0


@dataclass
class CompletionOutput:
    """One choice of a request (vLLM's ``CompletionOutput``): ``SamplingParams.n`` of them per request."""

    index: int  # the choice's index, 0 to n - 1
    token_ids: list[int]  # the generated tokens (a stop token included; it is left out of ``text``)
    text: str  # the generated text, a matched stop string and what follows it cut off
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None  # one per generated token; None unless the request asked


@dataclass
class RequestOutput:
    """What ``LLMEngine.step()`` and ``LLM.generate()`` hand back for one finished request: all of
    its choices in ``outputs`` (ordered by index). The flat fields are choice 0's, so callers that
    ask for one choice need not look at ``outputs``; left empty, ``outputs`` is filled from them."""

    request_id: str
    prompt_token_ids: list[int]  # the prompt as the engine ran it
    token_ids: list[int]  # choice 0's generated tokens (a stop token included; it is left out of ``text``)
    text: str  # choice 0's text, a matched stop string and what follows it cut off
    finish_reason: str | None  # choice 0's: "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None  # choice 0's, one per generated token; None unless asked
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (the prompt's, once)
    error: str | None = None  # why the request failed, with finish_reason "error" (for every choice)
    outputs: list[CompletionOutput] = field(default_factory=list)  # every choice, ordered by index

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.token_ids, self.text, self.finish_reason, self.logprobs)]


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        isolated: bool = False,
        grammar: GrammarState | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id  # shared by all choices of a request
        self.index = index  # which choice of its request (``SamplingParams.n``); 0 is the one that computes the prompt
        self.params = params
        self.priority = priority
        # runs only in steps of its own (quarantine: a suspect request, so that a failing step names it)
        self.isolated = isolated
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache (first schedule)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the leading full, computed blocks
        # chained hashes of the prompt's full blocks, computed once on demand (``BlockManager.prompt_hashes``)
        self.prompt_hashes: list[int] | None = None
        self.num_prefix_waits = 0  # steps it was held back for a prefix another sequence was computing
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # incremental detokenization state (used only when stop strings are set)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_checked_len = 0
        # runtime extras owned by the runner (per-request torch.Generator); never read by the scheduler
        self.generator: torch.Generator | None = None
        # structured outputs: where the output stands in its grammar (advanced with every token appended)
        self.grammar = grammar

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_hashed_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def sort_key(self) -> tuple[int, float, int]:
        """FCFS within priority; lower priority value runs first. The choices of one request share
        its priority and arrival, so they queue together, in index order (and the newest choice
        is the first to be preempted among them)."""
        return (self.priority, self.arrival_time, self.index)
