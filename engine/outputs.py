"""What the model runner hands back after a step (vLLM's ``ModelRunnerOutput``), for the
scheduler's ``update_from_output``.

Pure Python: plain ints and lists, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchery.engine.sequence import Sequence, TokenLogprobs


@dataclass
class ModelRunnerOutput:
    """The tokens sampled in one step, row by row (the i-th token belongs to the i-th sequence)."""

    sampled_seqs: list[Sequence] = field(default_factory=list)  # sequences fully computed this step
    token_ids: list[int] = field(default_factory=list)  # the token each one sampled
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per token; None where not asked for
