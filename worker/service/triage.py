"""Triage after an engine failure, as plain functions: who pays (the requests in the failing step),
who is poison (a quarantined request that failed alone ``solo_attempts`` times), who is carried over
to the new engine (everyone else), and the errors they get. Also the watchdog's verdict.

A rebuilt engine first runs a canary; only a failed canary (or a failed build), or a failure that
came outside any step and any request (nobody to blame, so nobody is struck), counts towards
``max_rebuilds``, so a request that crashes every engine it meets cannot make the worker give up.
``POISON_BREAKER`` verdicts in a row with no successful step between them mean the engine, not the
requests, is broken: the service gives up instead."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchery.contract.errors import EngineCrash, EngineFailure
from batchery.worker.service.intake import Pending

POISON_BREAKER = 5  # this many poison verdicts with no successful step between them: the engine is broken


@dataclass
class Triage:
    struck: list[Pending]  # in the failing step: a retryable EngineFailure that counts a strike
    poisoned: list[Pending]  # quarantined and failed alone solo_attempts times: EngineCrash, for good
    carried: list[Pending]  # all others, oldest first: they go to the new engine


def triage(pending: Iterable[Pending], in_step: set[str], solo_attempts: int, busy: str | None = None) -> Triage:
    """Sort the pending requests after a failure. Struck ones were in the failing step, or are the
    request ``busy`` whose own work the loop was doing outside a step when it hung (tokenizing it,
    say). A failure outside any step and any request strikes nobody: all are carried over (the
    supervisor bounds how often that may happen in a row). A quarantined request hit counts a
    failed solo run, and is poisoned at the ``solo_attempts``-th. Carried ones are marked out of
    the engine."""
    t = Triage([], [], [])
    for p in pending:
        hit = (p.in_engine and p.request_id in in_step) or (busy is not None and p.request_id == busy)
        if hit and p.request.solo:
            p.solo_failures += 1
            (t.poisoned if p.solo_failures >= solo_attempts else t.carried).append(p)
        elif hit:
            t.struck.append(p)
        else:
            t.carried.append(p)
    t.carried.sort(key=lambda p: p.submitted_at)
    for p in t.carried:
        p.in_engine = False
    return t


def struck_error(reason: str) -> EngineFailure:
    """For the requests in the failing step: retried, and the task counts a strike towards quarantine."""
    exc = EngineFailure(f"engine failure ({reason}); the request will be retried")
    exc.struck = True  # read by the task (tasks.quarantine.record)
    return exc


def poison_error(p: Pending, what: str) -> EngineCrash:
    """Quarantine's verdict on ``p``; ``what`` names the last exception."""
    return EngineCrash(
        f"the request crashed the engine each of the {p.solo_failures} times it ran "
        f"alone (quarantined after repeated engine failures); last: {what}"[:2000]
    )


def watchdog_reason(quiet_s: float, limit_s: float, num_pending: int, in_canary: bool) -> str | None:
    """The failure reason if the loop has shown no progress for longer than ``limit_s``, else None."""
    if quiet_s <= limit_s:
        return None
    what = "the canary step" if in_canary else f"{num_pending} requests"
    return f"the watchdog fired: {what} pending and no engine step finished for {quiet_s:.1f} s (limit {limit_s:g} s)"
