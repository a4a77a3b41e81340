"""Admission, for quarantine: which request goes into the engine when. Requests normally go
straight in. A quarantined request (``solo=True``) runs alone: while one waits or runs, new work is
held; it starts once the engine is empty; when its run ends, the held work goes in before the next
quarantined request starts."""

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
        self.held: deque[Pending] = deque()  # normal requests waiting for a solo run to end
        self.solo: deque[Pending] = deque()  # quarantined requests waiting for their turn
        self.solo_rid: str | None = None  # the quarantined request running now
        self.release_held = False  # a solo run just ended: held work goes in before the next one

    def __bool__(self) -> bool:
        return bool(self.held or self.solo)

    def place(self, p: Pending) -> bool:
        """Take a request from the inbox. True: it may go into the engine now; False: it waits in
        a lane until ``admit`` lets it in."""
        if p.request.solo:
            # a re-run after failing alone goes first: it runs right after the canary proved the
            # engine sound, so a flaky engine would have to fail twice in a row to convict it
            (self.solo.appendleft if p.solo_failures else self.solo.append)(p)
            return False
        if self.solo or self.solo_rid is not None:
            self.held.append(p)
            return False
        return True

    def admit(self, engine: LLMEngine, add: Callable[[Pending], bool]) -> list[Pending]:
        """Quarantine's turns: held work goes in when no solo run waits (or one just ended); a
        quarantined request starts once the engine is empty, and then runs alone. ``add`` puts a
        request into the engine (False if it is gone or was refused). Returns the quarantined
        requests whose solo run started."""
        if self.solo_rid is not None:
            if self.solo_rid in engine.requests:
                return []
            self.solo_rid = None  # the solo run is over (finished, or aborted at its deadline)
            self.release_held = True
        if self.held and (self.release_held or not self.solo):
            while self.held:
                add(self.held.popleft())
        self.release_held = False
        started = []
        while self.solo and not engine.has_unfinished():
            p = self.solo.popleft()
            if add(p):
                self.solo_rid = p.request_id
                started.append(p)
        return started
