"""Admission, for quarantine: which request goes into the engine when. Requests normally go
straight in. A quarantined request (``solo=True``) goes in as an *isolated* engine request: the
engine runs it only in steps of its own, taking turns with the steps of everyone else, so nobody is
held or waits for a drain, and a failing step holds either the suspect alone or none of it. One
quarantined request is in the engine at a time; the others wait here for their turn, and that wait
does not count against their deadlines (``Pending.held_seconds``; ``EngineService.generate``): it is
quarantine's cost, not theirs. A request suspected of killing its worker process (``exclusive``) runs
with nothing else in the engine: it starts once the engine has drained, and new normal requests are held
(their deadlines stopped too) until it ends, so a process death during its run is its own."""

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
        self.solo_exclusive = False  # ... and it runs with nothing else in the engine
        self.held: deque[Pending] = deque()  # normal requests waiting for an exclusive run to end

    def __bool__(self) -> bool:
        return bool(self.solo or self.held)

    def _exclusive_ahead(self) -> bool:
        """An exclusive run is under way, or is the next to start (the engine drains for it)."""
        return (self.solo_rid is not None and self.solo_exclusive) or (
            self.solo_rid is None and bool(self.solo) and self.solo[0].request.exclusive
        )

    def place(self, p: Pending) -> bool:
        """Take a request from the inbox. True: it may go into the engine now; False: it waits in
        the solo lane until ``admit`` lets it in."""
        if p.request.solo:
            # a re-run after failing alone goes first: it runs right after the canary proved the
            # engine sound, so a flaky engine would have to fail twice in a row to convict it
            (self.solo.appendleft if p.solo_failures else self.solo.append)(p)
            p.hold()  # its deadline stops while it waits for its turn (EngineService.generate)
            return False
        if self._exclusive_ahead():
            self.held.append(p)
            p.hold()  # held for another request's exclusive run: not its own time either
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
            self.solo_exclusive = False
        if self.held and not self._exclusive_ahead():
            while self.held:
                p = self.held.popleft()
                p.release()
                add(p)
        started = []
        while self.solo and self.solo_rid is None:
            if self.solo[0].request.exclusive and engine.has_unfinished():
                break  # an exclusive run starts once the engine has drained
            p = self.solo.popleft()
            p.release()
            if add(p):
                self.solo_rid = p.request_id
                self.solo_exclusive = p.request.exclusive
                started.append(p)
        return started
