"""The canary: a rebuilt engine proves itself sound before it takes work, with one short prompt
and two tokens (a prefill and a decode step). If it raises (or hangs), the failure is the
engine's, not a request's, and counts as a failed rebuild."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchery.engine.llm_engine import LLMEngine

CANARY_ID = "batchery-canary"
CANARY_PROMPT = "Hello"


def run_canary(engine: LLMEngine, abandoned: threading.Event) -> None:
    """Run the canary request to its end on ``engine`` (or until ``abandoned`` is set). Raises
    whatever the engine raises."""
    from batchery.engine.sampling import SamplingParams

    ids = (engine.encode(CANARY_PROMPT) or [0])[:8]
    engine.add_request(CANARY_ID, ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished() and not abandoned.is_set():
        engine.step()
