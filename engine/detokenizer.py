"""Incremental detokenization and stop-string checks on the text.

Text is decoded incrementally only for requests with stop strings (the check needs it); every
other request is decoded once, when it finishes, keeping detokenization off the hot path."""

from __future__ import annotations

from typing import Protocol

from batchery.engine.sequence import Sequence


class Tokenizer(Protocol):
    """What detokenization needs of a transformers tokenizer."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


def _decode(tokenizer: Tokenizer | None, ids: list[int]) -> str:
    if tokenizer is None:  # token-ids-only engines (benchmarks on random-weight models)
        return ""
    return tokenizer.decode(ids, skip_special_tokens=True)


def append_text(tokenizer: Tokenizer | None, seq: Sequence) -> None:
    """Extend ``seq.text`` with the text of newly generated tokens (prefix/read offsets, so a
    multi-byte character split across tokens is emitted only once it is complete)."""
    if seq.read_offset == 0:
        seq.prefix_offset = seq.read_offset = seq.num_prompt_tokens
    ids = seq.token_ids
    prefix_text = _decode(tokenizer, ids[seq.prefix_offset : seq.read_offset])
    new_text = _decode(tokenizer, ids[seq.prefix_offset :])
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        seq.text += new_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)


def find_stop(seq: Sequence) -> int:
    """Index in ``seq.text`` where the earliest stop string starts, or -1. Only the text added since
    the last check (plus an overlap for a stop string straddling the boundary) is searched."""
    stops = seq.params.stop_strings
    longest = max(len(s) for s in stops)
    start = max(0, seq.stop_checked_len - longest + 1)
    seq.stop_checked_len = len(seq.text)
    hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def final_text(tokenizer: Tokenizer | None, seq: Sequence, strip_last: bool) -> str:
    """The request's output text; a matched stop string and everything after it is trimmed."""
    ids = seq.output_token_ids
    if strip_last:
        ids = ids[:-1]
    text = _decode(tokenizer, ids)
    if seq.params.stop:
        hits = [i for i in (text.find(s) for s in seq.params.stop_strings) if i >= 0]
        if hits:
            text = text[: min(hits)]
    return text
