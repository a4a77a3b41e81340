"""Per-request state. One object flows between scheduler, block manager and runner.

Pure Python: plain ints and lists, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from batchery.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What ``LLMEngine.step()`` and ``LLM.generate()`` hand back for one finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top": [(id, logprob), ...]}
    num_cached_tokens: int = 0
    error: str | None = None


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache (first schedule)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the leading full, computed blocks
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # incremental detokenization state (used only when stop strings are set)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_checked_len = 0
        # runtime extras owned by the runner (per-request generator); never read by the scheduler
        self.generator = None

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

    def sort_key(self) -> tuple[int, float]:
        """FCFS within priority; lower priority value runs first."""
        return (self.priority, self.arrival_time)
