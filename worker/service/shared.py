"""What the task threads, the engine loop thread and the supervisor share: the options, the
requests in flight, the current engine and its state, the loop's vital signs and the counters.
One lock (``Shared.lock``) guards it; the fields only the current loop thread writes (the step
counters, ``last_beat``) are read without it, as plain numbers."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchery.worker.service.faults import Fault
from batchery.worker.service.intake import Pending
from batchery.worker.service.logprobs import LogprobRenderer
from batchery.worker.service.state import EngineState
from batchery.worker.service.stats import ServiceStats
from batchery.worker.service.step_stats import StepStats

if TYPE_CHECKING:
    from batchery.engine.config import EngineConfig
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import LoadedModel


@dataclass(frozen=True)
class ServiceOptions:
    watchdog_timeout: float = 300.0  # work pending and no step finished for this long: the engine hangs
    max_rebuilds: int = 3  # consecutive failed rebuilds (or canaries) before giving up
    faults: tuple[Fault, ...] = ()  # injected into engine steps and rebuilds (rehearsals, tests)
    rebuild_backoff: float = 0.5  # seconds times the attempt number between failed rebuild attempts
    batch_wait: float = 0.0  # an idle engine waits up to this long for a burst to finish arriving
    solo_attempts: int = 2  # failed runs alone that make a quarantined request poison


@dataclass(frozen=True)
class AddOp:
    """Put this request into the engine (through admission)."""

    pending: Pending


@dataclass(frozen=True)
class AbortOp:
    """Drop this request from the engine and free its KV blocks."""

    request_id: str


Op = AddOp | AbortOp


@dataclass(frozen=True)
class Failure:
    """A loop thread's report to the supervisor (or the watchdog's)."""

    gen: int  # the engine generation that failed
    reason: str  # one line, for the log and the requests' errors
    exc: BaseException | None = None  # None for a hang


class EngineAbandoned(Exception):
    """Raised inside an abandoned engine's step so its thread unwinds without touching anything."""


SHUTTING_DOWN = "the worker is shutting down; the request will be requeued"


@dataclass(eq=False)
class Shared:
    """The service's state; one per ``EngineService``."""

    config: EngineConfig | None
    options: ServiceOptions
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Condition = field(init=False)  # wakes the loop thread: new ops or stop
    failed: threading.Event = field(default_factory=threading.Event)  # wakes the supervisor: a failure
    stop: threading.Event = field(default_factory=threading.Event)
    inbox: deque[Op] = field(default_factory=deque)  # what the loop applies between steps
    pending: dict[str, Pending] = field(default_factory=dict)  # submitted, future not yet resolved
    failure: Failure | None = None  # reported by a loop thread, not yet handled

    engine: LLMEngine | None = None  # the current engine; None while rebuilding
    loaded: LoadedModel | None = None  # the weights, reused by a rebuild
    gen: int = 0  # bumped whenever an engine is abandoned; a loop thread serves exactly one gen
    abandoned: threading.Event = field(default_factory=threading.Event)  # the current gen's; set: hands off
    loop_thread: threading.Thread | None = None
    state: EngineState = EngineState.NEW
    draining: bool = False
    fatal_reason: str | None = None

    last_beat: float = field(default_factory=time.monotonic)  # a step ran, a request was taken in, or idle
    last_step_at: float | None = None  # monotonic time the last work step finished
    failed_rebuilds: int = 0  # consecutive; reset by a successful canary or step
    step_rids: tuple[str, ...] = ()  # the requests in the step now running (or the hung one)
    busy_rid: str | None = None  # the request the loop takes in now, outside a step (or the hung one)
    in_canary: bool = False  # the loop runs a rebuilt engine's canary
    verdicts_in_a_row: int = 0  # poison verdicts since the last successful work step
    outside_failures: int = 0  # failures outside any step and request since the last successful work step

    stats: ServiceStats = field(default_factory=ServiceStats)
    step_stats: StepStats = field(default_factory=StepStats)  # per-step histograms for /metrics
    logprobs: LogprobRenderer = field(default_factory=LogprobRenderer)  # its token texts outlive engines

    def __post_init__(self) -> None:
        self.wake = threading.Condition(self.lock)

    def take_pending(self) -> list[Pending]:
        """Empty the pending set and the inbox; returns what was pending. Caller holds the lock."""
        pending = list(self.pending.values())
        self.pending.clear()
        self.inbox.clear()
        return pending

    def requeue(self, carried: list[Pending]) -> None:
        """After a failure: only ``carried`` stays pending, each queued to be added to the next
        engine. Caller holds the lock."""
        self.take_pending()
        for p in carried:
            self.pending[p.request_id] = p
            self.inbox.append(AddOp(p))


def fail(pending: list[Pending], exc: Exception) -> None:
    """Fail these requests' futures (those not resolved yet) with ``exc``."""
    for p in pending:
        if not p.future.done():
            p.future.set_exception(exc)
