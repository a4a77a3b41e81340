"""``EngineService``: one engine per worker process, behind a thread-safe API. Task threads call
``submit`` / ``abort`` / ``generate`` and wait on futures; the loop thread (``loop``) drives the
engine and the supervisor (``supervisor``) brings it back after a failure.

Quarantine: a request submitted with ``solo=True`` (the task does so once it has been struck
``K`` times) runs alone, in engine steps of its own between the steps of the other work
(``admission``). If it fails alone on ``solo_attempts`` consecutive runs
(each after a canary proved the engine sound), it is poison and its future raises
``EngineCrash``, naming the exception (``triage``)."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from batchery.contract.errors import (
    DeadlineExceeded,
    EngineUnavailable,
    InvalidRequest,
    RequestCancelled,
    WorkerShuttingDown,
)
from batchery.contract.generation import GenerationRequest, GenerationResult
from batchery.worker.service.faults import Fault
from batchery.worker.service.intake import Pending
from batchery.worker.service.shared import SHUTTING_DOWN, AbortOp, AddOp, ServiceOptions, Shared, fail
from batchery.worker.service.state import EngineState
from batchery.worker.service.stats import Health, ServiceStats
from batchery.worker.service.step_stats import StepStats
from batchery.worker.service.supervisor import Supervisor

if TYPE_CHECKING:
    from batchery.engine.config import EngineConfig
    from batchery.engine.loader import LoadedModel

log = logging.getLogger("batchery.worker.engine")

WAIT_POLL_S = 0.25  # how often a waiting task thread looks at cancellation and quarantine time


class EngineService:
    """Owns the process's engine. Thread-safe: ``submit``/``abort``/``generate`` from any thread."""

    def __init__(
        self,
        config: EngineConfig | None,
        *,
        watchdog_timeout: float = 300.0,
        max_rebuilds: int = 3,
        faults: list[Fault] | None = None,
        rebuild_backoff: float = 0.5,
        batch_wait: float = 0.0,
        on_fatal: Callable[[str], None] | None = None,
        solo_attempts: int = 2,
    ) -> None:
        self.config = config
        self.options = ServiceOptions(
            watchdog_timeout=watchdog_timeout,
            max_rebuilds=max_rebuilds,
            faults=tuple(faults or ()),
            rebuild_backoff=rebuild_backoff,
            batch_wait=batch_wait,
            solo_attempts=max(1, int(solo_attempts)),
        )
        self._shared = Shared(config, self.options)
        self._supervisor = Supervisor(self._shared, on_fatal)
        self._ids = itertools.count()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Build the first engine (loads the weights; slow) and start the threads. Raises if the
        first build fails: a worker that cannot load its model must not start consuming."""
        self._supervisor.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the threads. In-flight futures fail with ``WorkerShuttingDown``."""
        s = self._shared
        with s.lock:
            s.stop.set()
            if s.state != EngineState.FAILED:
                s.state = EngineState.STOPPED
            pending = s.take_pending()
            s.abandoned.set()
            s.wake.notify_all()
        fail(pending, WorkerShuttingDown(SHUTTING_DOWN))
        s.failed.set()
        for t in (s.loop_thread, self._supervisor.thread):
            if t is not None and t is not threading.current_thread():
                t.join(timeout)

    def begin_drain(self, grace: float) -> None:
        """Warm shutdown: refuse new work now; after ``grace`` seconds, fail what is still in flight
        with ``WorkerShuttingDown`` (its task requeues the message). Safe from a signal handler."""
        s = self._shared
        with s.lock:
            if s.draining:
                return
            s.draining = True
            if s.state == EngineState.SERVING:
                s.state = EngineState.DRAINING
        log.warning("draining: no new requests; in-flight requests get %.1f s to finish", grace)
        timer = threading.Timer(grace, self._end_drain)
        timer.daemon = True
        timer.start()

    def _end_drain(self) -> None:
        s = self._shared
        with s.lock:
            pending = s.take_pending()
            for p in pending:
                s.inbox.append(AbortOp(p.request_id))
            s.wake.notify_all()
        if pending:
            log.warning("drain grace over: returning %d unfinished requests to the queue", len(pending))
        fail(pending, WorkerShuttingDown(SHUTTING_DOWN))

    # -- the task-thread API -------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> tuple[str, Future[GenerationResult]]:
        """Queue a request for the engine. Returns its engine request id and a future that yields a
        ``GenerationResult`` or raises ``InvalidRequest`` / ``EngineFailure``. An invalid
        structured-outputs constraint raises ``InvalidRequest`` here, before anything is queued."""
        s = self._shared
        self._compile_constraint(request)
        rid = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        p = Pending.new(rid, request)
        with s.lock:
            if s.draining or s.stop.is_set():
                raise WorkerShuttingDown(SHUTTING_DOWN)
            if s.state == EngineState.FAILED:
                raise EngineUnavailable(f"the engine is down and could not be rebuilt: {s.fatal_reason}")
            s.pending[rid] = p
            s.inbox.append(AddOp(p))
            s.stats.num_requests += 1
            s.wake.notify()
        return rid, p.future

    def _compile_constraint(self, request: GenerationRequest) -> None:
        """Compile the request's structured-outputs constraint here, in the caller's (the task's)
        thread, so that the loop thread finds it in the grammar cache: a new schema's compilation
        never holds up an engine step. An invalid constraint raises ``InvalidRequest`` at once (a
        400; no engine step sees it, no strike). Without an engine (being built or rebuilt) the
        loop compiles it when it adds the request, with the same outcome."""
        spec = request.sampling.get("structured_outputs")
        engine = self._shared.engine
        if spec is None or engine is None:
            return
        from batchery.engine.structured import StructuredOutputsParams

        try:
            if isinstance(spec, dict):
                spec = StructuredOutputsParams.from_dict(spec)
            elif not isinstance(spec, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be an object, got {type(spec).__name__}")
            engine.grammars.compile(spec)
        except (ValueError, TypeError) as exc:
            why = str(exc)
            if isinstance(spec, StructuredOutputsParams) and spec.kind == "structural_tag":
                why += (
                    " (with tool_choice required or a named function, it is built from the tools' parameters schemas)"
                )
            raise InvalidRequest(why) from None

    def abort(self, request_id: str) -> bool:
        """Abort a request: its future is dropped and the loop frees its KV blocks. False if it had
        already finished or failed."""
        s = self._shared
        with s.lock:
            p = s.pending.pop(request_id, None)
            if p is None:
                return False
            s.inbox.append(AbortOp(request_id))
            s.stats.num_aborted += 1
            s.wake.notify()
        return True

    def generate(
        self,
        request: GenerationRequest,
        timeout: float,
        *,
        cancelled: Callable[[], bool] | None = None,
        max_held: float = math.inf,
    ) -> GenerationResult:
        """Submit and wait up to ``timeout`` seconds. At the deadline the request is aborted in the
        engine and ``DeadlineExceeded`` is raised. The time a quarantined request waits in the
        quarantine lane for its turn to run alone does not count (up to ``max_held`` seconds more):
        it waits there because of other requests' failures. ``cancelled``, polled every
        ``WAIT_POLL_S``, aborts it with ``RequestCancelled`` once it says so."""
        start = time.monotonic()
        rid, fut = self.submit(request)
        poll = cancelled is not None  # the quarantine time is read again at each expiry: no polling for it
        while True:
            held = min(self.held_seconds(rid), max_held)
            left = start + timeout + held - time.monotonic()
            stop = "deadline" if left <= 0 else "cancel" if cancelled is not None and cancelled() else None
            if stop is None:
                try:
                    return fut.result(timeout=min(WAIT_POLL_S, left) if poll else left)
                except FutureTimeout:
                    continue
            if not self.abort(rid) and fut.done():
                return fut.result()  # finished in the same instant
            if stop == "cancel":
                raise RequestCancelled("the batch job was cancelled; the request was aborted in the engine")
            waited = f" (not counting {held:.1f} s in the quarantine lane)" if held >= 0.05 else ""
            raise DeadlineExceeded(f"deadline of {timeout:g} s exceeded{waited}; the request was aborted in the engine")

    def held_seconds(self, request_id: str) -> float:
        """How long a pending request has waited in the quarantine lane so far (0 once it is done)."""
        p = self._shared.pending.get(request_id)
        return 0.0 if p is None else p.held_seconds()

    # -- status ------------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._shared.state

    @property
    def ready(self) -> bool:
        return self._shared.state == EngineState.SERVING

    @property
    def fatal(self) -> bool:
        return self._shared.state == EngineState.FAILED

    @property
    def fatal_reason(self) -> str | None:
        return self._shared.fatal_reason

    def health(self) -> dict[str, Any]:
        """Liveness: the engine loop thread is alive (or being rebuilt) and the last step's age."""
        s = self._shared
        now = time.monotonic()
        loop = s.loop_thread
        return Health(
            state=s.state,
            loop_alive=loop is not None and loop.is_alive(),
            last_step_age_s=None if s.last_step_at is None else now - s.last_step_at,
            last_loop_beat_age_s=now - s.last_beat,
            num_pending=len(s.pending),
            fatal_reason=s.fatal_reason,
        ).as_dict()

    def stats(self) -> dict[str, Any]:
        """Counters for the worker stats endpoint (``ServiceStats.as_dict``)."""
        return self._shared.stats.as_dict(self._shared.state, len(self._shared.pending), self._shared.step_stats)

    @property
    def counters(self) -> ServiceStats:
        """The typed counters behind ``stats()``."""
        return self._shared.stats

    @property
    def step_stats(self) -> StepStats:
        """Per-step histograms and engine counters, for ``/metrics``."""
        return self._shared.step_stats

    # The counters the entry point, the health endpoints and the tests read as attributes.
    @property
    def model_name(self) -> str:
        return self._shared.stats.model_name

    @property
    def dtype(self) -> str:
        return self._shared.stats.dtype

    @property
    def num_kv_blocks(self) -> int:
        return self._shared.stats.num_kv_blocks

    @property
    def max_model_len(self) -> int:
        return self._shared.stats.max_model_len

    @property
    def engine_stats(self) -> dict[str, Any]:
        return self._shared.stats.engine

    @property
    def num_aborted(self) -> int:
        return self._shared.stats.num_aborted

    @property
    def num_failures(self) -> int:
        return self._shared.stats.num_failures

    @property
    def num_rebuilds(self) -> int:
        return self._shared.stats.num_rebuilds

    @property
    def num_struck(self) -> int:
        return self._shared.stats.num_struck

    @property
    def num_carried_over(self) -> int:
        return self._shared.stats.num_carried_over

    @property
    def num_solo_runs(self) -> int:
        return self._shared.stats.num_solo_runs

    @property
    def num_poisoned(self) -> int:
        return self._shared.stats.num_poisoned

    @property
    def _loaded(self) -> LoadedModel | None:  # the tests check that a rebuild reuses the weights
        return self._shared.loaded

    @property
    def _loop_thread(self) -> threading.Thread | None:  # the tests watch an abandoned loop unwind
        return self._shared.loop_thread
