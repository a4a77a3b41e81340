"""Logprob rendering: the engine's per-token entries (token ids and log-probabilities) become the
result's, each token with its text. Token texts are cached: one tokenizer serves the process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from batchery.contract.generation import LogprobEntry

TOKEN_CACHE_MAX = 1 << 18  # token texts kept; a vocabulary is smaller, so in practice all of them


class Decoder(Protocol):
    """What rendering needs of a tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...


class LogprobRenderer:
    """Renders entries; keeps the token-text cache. Loop thread only."""

    def __init__(self) -> None:
        self._text: dict[int, str] = {}

    def token(self, tokenizer: Decoder, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = tokenizer.decode([token_id])
            if len(self._text) < TOKEN_CACHE_MAX:
                self._text[token_id] = s
        return s

    def render(self, tokenizer: Decoder, entries: Sequence[Mapping[str, Any]] | None) -> list[LogprobEntry] | None:
        """``entries`` as the engine gives them: per token ``{"token_id", "logprob", "top": [(id,
        logprob), ...]}``. None stays None (logprobs were not asked for)."""
        if entries is None:
            return None
        out: list[LogprobEntry] = []
        for e in entries:
            tid = int(e["token_id"])
            out.append(
                {
                    "token": self.token(tokenizer, tid),
                    "token_id": tid,
                    "logprob": float(e["logprob"]),
                    "top": [
                        {"token": self.token(tokenizer, int(i)), "token_id": int(i), "logprob": float(lp)}
                        for i, lp in (e.get("top") or [])
                    ],
                }
            )
        return out
