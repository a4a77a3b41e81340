"""Per-request sampling parameters (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

from batchery.engine.structured import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per request
MAX_LOGIT_BIAS = 1024  # entries of logit_bias per request


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ``ValueError`` naming the field."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per sampled token (0 = only the sampled one)
    n: int = 1  # choices: they share the prompt's KV blocks; choice i samples from a stream derived from seed
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | dict | None = None  # a constraint on the output (a grammar)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._check()
        self.temperature = float(self.temperature)
        # the sampler's view of logit_bias, built once: token ids ascending and their biases
        items = sorted(self.logit_bias.items()) if self.logit_bias else []
        self._logit_bias_items: tuple[list[int], list[float]] = (
            [t for t, _ in items],
            [float(b) for _, b in items],
        )

    def _check(self) -> None:
        def bad(name: str, why: str) -> NoReturn:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                bad(name, "must be a number")
        for name in ("max_tokens", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                bad(name, "must be an integer")
        if not isinstance(self.stop, list):
            bad("stop", "must be a string or a list of strings")
        if not isinstance(self.stop_token_ids, list):
            bad("stop_token_ids", "must be a list of integers")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (or -1 to disable)")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer or None")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"must be up to {MAX_STOP_STRINGS} non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.logit_bias is not None:
            lb = self.logit_bias
            if not isinstance(lb, dict):
                bad("logit_bias", "must be a dict of token ids to biases")
            if len(lb) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"SamplingParams.logit_bias has {len(lb)} entries, more than the {MAX_LOGIT_BIAS} allowed"
                )
            for k, v in lb.items():
                if not is_int(k) or k < 0:
                    raise ValueError(
                        f"SamplingParams.logit_bias keys must be non-negative integer token ids, got {k!r:.40}"
                    )
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100.0 <= v <= 100.0:
                    raise ValueError(f"SamplingParams.logit_bias[{k}] must be a number in [-100, 100], got {v!r:.40}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams, a dict or None")

    @property
    def structured(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` as ``__post_init__`` left it."""
        return cast("StructuredOutputsParams | None", self.structured_outputs)

    @property
    def logit_bias_items(self) -> tuple[list[int], list[float]]:
        """``logit_bias`` as two lists, token ids ascending and their biases (computed once, in
        ``__post_init__``: change ``logit_bias`` afterwards through ``dataclasses.replace``)."""
        return self._logit_bias_items

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as ``__post_init__`` left it: always a list."""
        return cast(list[str], self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
