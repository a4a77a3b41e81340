"""When a request is done: a stop token, a stop string in its text, or its length limit.

Called by the scheduler's ``update_from_output`` once per sampled token, right after the token is
appended. Stop strings need the text, so only requests that set them are detokenized here
(incrementally); every other request is decoded once, when it finishes."""

from __future__ import annotations

from collections.abc import Callable

from batchery.engine.detokenizer import Tokenizer, append_text, find_stop
from batchery.engine.sequence import Sequence

# (sequence, the token just appended to it) -> its finish reason, or None while it goes on
StopCheck = Callable[[Sequence, int], str | None]

STOP_TOKEN = "stop_token"  # internal reason: the output ends in a stop token, left out of the text ("stop" outside)


class StopChecker:
    """Stop tokens (the request's and, unless ``ignore_eos``, the model's EOS ids), stop strings
    and the length limits; ``check`` is a ``StopCheck``."""

    def __init__(self, tokenizer: Tokenizer | None, eos_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.is_terminated():
            return STOP_TOKEN  # the grammar accepted its stop token: the output is complete (even with ignore_eos)
        # the sampler bans stop tokens until min_tokens, so any stop token here ends the request
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return STOP_TOKEN
        if p.stop:
            append_text(self.tokenizer, seq)
            if find_stop(seq) >= 0:
                return "stop"
        # num_output_tokens and num_tokens without their properties: this runs for every sequence every step
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= p.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None
