"""Admission, for quarantine: which request goes into the engine when. Requests normally go
straight in. A quarantined request (``solo=True``) goes in as an *isolated* engine request: the
engine runs it only in steps of its own, taking turns with the steps of everyone else, so nobody is
held or waits for a drain, and a failing step holds either the suspect alone or none of it. One
quarantined request is in the engine at a time; the others wait here for their turn, and that wait
does not count against their deadlines (``Pending.held_seconds``; ``EngineService.generate``): it is
quarantine's cost, not theirs."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchery.worker.service.intake import Pending

if TYPE_CHECKING:
    from batchery.engine.llm_engine import LLMEngine


class Lanes:
    """The loop thread's admission state (one per engine loop; loop thread only)."""

    def __init__(self) -> None:
        self.solo: deque[Pending] = deque()  # quarantined requests waiting for their turn
        self.solo_rid: str | None = None  # the quarantined request in the engine now

    def __bool__(self) -> bool:
        return bool(self.solo)

    def place(self, p: Pending) -> bool:
        """Take a request from the inbox. True: it may go into the engine now; False: it waits in
        the solo lane until ``admit`` lets it in."""
        if p.request.solo:
            # a re-run after failing alone goes first: it runs right after the canary proved the
            # engine sound, so a flaky engine would have to fail twice in a row to convict it
            (self.solo.appendleft if p.solo_failures else self.solo.append)(p)
            p.hold()  # its deadline stops while it waits for its turn (EngineService.generate)
            return False
        return True

    def admit(self, engine: LLMEngine, add: Callable[[Pending], bool]) -> list[Pending]:
        """Quarantine's turns: the next quarantined request goes in once the one before it has left
        the engine (finished, failed or aborted). ``add`` puts a request into the engine, isolated
        for a quarantined one (False if it is gone or was refused). Returns the quarantined
        requests whose solo run started."""
        if self.solo_rid is not None:
            if self.solo_rid in engine.requests:
                return []
            self.solo_rid = None  # the solo run is over (finished, or aborted at its deadline)
        started = []
        while self.solo and self.solo_rid is None:
            p = self.solo.popleft()
            p.release()
            if add(p):
                self.solo_rid = p.request_id
                started.append(p)
        return started
