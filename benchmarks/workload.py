"""The reference workload shared by the benchmarks: 64 chat requests, generated deterministically.

Each user message is "Summarize this text: " followed by 20 to 300 random words from a fixed
vocabulary; max_tokens is uniform in [16, 128] and EOS is ignored."""

from __future__ import annotations

import random

VOCAB = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact be have do say get make go know take see come think look "
    "want give use find tell ask seem feel try leave call good new first last long great little own other old "
    "right big high different small large next early young important few public bad same able river mountain "
    "city light dark music book paper stone fire wind rain snow tree flower garden ocean island market school "
    "doctor teacher engine cache memory signal network energy planet history science language village road "
    "bridge window kitchen letter story friend family country season morning evening winter summer journey"
).split()


def reference_requests(n: int = 64, seed: int = 0) -> list[tuple[list[dict], int]]:
    """``n`` (messages, max_tokens) pairs of the reference workload."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = " ".join(rng.choice(VOCAB) for _ in range(rng.randint(20, 300)))
        out.append(([{"role": "user", "content": "Summarize this text: " + words}], rng.randint(16, 128)))
    return out
