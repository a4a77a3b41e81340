"""The engine loop: one thread per engine generation calls ``step()`` while there is work.

The engine is single-threaded, so task threads never touch it: they queue operations in the inbox
and wake this thread, which applies them between steps (tokenize, admission, ``add_request``,
``abort``) and resolves each request's future when it finishes. Each request it takes in is
progress for the watchdog, and a request whose own work here raises fails alone. Before a rebuilt engine takes
work the loop runs its canary. Any exception ends the loop and is reported to the supervisor; a
loop whose engine was abandoned (``abandoned`` set) touches nothing on its way out."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from batchery.contract.errors import EngineFailure, InvalidRequest
from batchery.worker.service.admission import Lanes
from batchery.worker.service.canary import run_canary
from batchery.worker.service.faults import StepContext
from batchery.worker.service.intake import Pending, engine_input, internal_error, request_error
from batchery.worker.service.logprobs import Decoder
from batchery.worker.service.shared import AbortOp, EngineAbandoned, Failure, Op, Shared

if TYPE_CHECKING:
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.sequence import RequestOutput, Sequence

log = logging.getLogger("batchery.worker.engine")

IDLE_WAIT_S = 1.0  # the idle loop wakes this often just to show it is alive
BATCH_QUIET_S = 0.01  # gathering a burst ends once no request has arrived for this long


class EngineLoop:
    """Drives one engine (generation ``gen``) until it is abandoned, the service stops, or a step
    raises. ``run`` is the thread body; the other methods run on that thread."""

    def __init__(
        self, shared: Shared, gen: int, engine: LLMEngine, abandoned: threading.Event, canary: bool = False
    ) -> None:
        self.shared = shared
        self.gen = gen
        self.engine = engine
        self.abandoned = abandoned
        self.canary = canary

    def run(self) -> None:
        s, engine, abandoned = self.shared, self.engine, self.abandoned
        lanes = Lanes()
        try:
            if self.canary:
                self._run_canary()
            while True:
                with s.lock:
                    if abandoned.is_set() or s.stop.is_set():
                        return
                    idle = not engine.has_unfinished()
                    if idle and not s.inbox and not lanes:
                        s.last_beat = time.monotonic()
                        s.wake.wait(IDLE_WAIT_S)
                        continue
                    if idle and s.options.batch_wait > 0 and s.inbox:
                        self.gather()
                    ops = list(s.inbox)
                    s.inbox.clear()
                self.apply(ops, lanes)
                if not engine.has_unfinished():
                    s.stats.engine = engine.stats()
                    continue
                steps_before = s.step_stats.num_started
                t_step = time.perf_counter()
                outputs = engine.step()
                s.step_rids = ()
                step_s = time.perf_counter() - t_step
                s.stats.step_seconds += step_s
                if abandoned.is_set():
                    return  # the supervisor gave up on this engine; its results are void
                if s.step_stats.num_started == steps_before:
                    if outputs:  # async scheduling: a drain commits the last step's tokens and launches nothing
                        s.stats.engine = engine.stats()
                        self.resolve(outputs)
                    continue  # nothing was scheduled: not progress, so the watchdog keeps counting
                s.last_beat = s.last_step_at = time.monotonic()
                s.failed_rebuilds = s.verdicts_in_a_row = s.outside_failures = 0
                s.stats.engine = engine.stats()
                s.step_stats.observe(self.gen, step_s, s.stats.engine)
                if outputs:
                    self.resolve(outputs)
        except EngineAbandoned:
            log.info("abandoned engine loop %d exited", self.gen)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the supervisor
            if abandoned.is_set():
                log.info("abandoned engine loop %d exited with %r", self.gen, exc)
                return
            with s.lock:
                if s.failure is None:
                    s.failure = Failure(self.gen, f"the engine loop raised {type(exc).__name__}", exc)
            s.failed.set()

    def gather(self) -> None:
        """The engine is idle and work has arrived: let a burst finish arriving before the first
        step, so the step batches it (and small early steps do not compete with the arriving
        tasks for the CPU). Waits while new requests keep coming, at most ``batch_wait`` seconds;
        a lone request waits one quiet period. Caller holds the lock."""
        s = self.shared
        batch_wait = s.options.batch_wait
        deadline = time.monotonic() + batch_wait
        quiet = min(BATCH_QUIET_S, batch_wait)
        while len(s.inbox) < self.engine.config.max_num_seqs:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            n = len(s.inbox)
            s.wake.wait(min(quiet, left))
            if len(s.inbox) == n or s.stop.is_set():
                return

    def _run_canary(self) -> None:
        s = self.shared
        with s.lock:
            s.in_canary = True
        t0 = time.perf_counter()
        run_canary(self.engine, self.abandoned)
        with s.lock:
            s.in_canary = False
            if self.abandoned.is_set():
                raise EngineAbandoned()
            s.failed_rebuilds = 0
            s.last_beat = time.monotonic()
        log.info("rebuilt engine passed its canary step (%.3f s)", time.perf_counter() - t0)

    def apply(self, ops: list[Op], lanes: Lanes) -> None:
        """Apply queued aborts and adds, then admit what quarantine allows."""
        if ops:
            for f in self.shared.options.faults:
                f.before_apply()
        for op in ops:
            if isinstance(op, AbortOp):
                self.engine.abort(op.request_id)
                continue
            p = op.pending
            if p.request_id not in self.shared.pending:  # aborted or failed before it reached the engine
                continue
            if lanes.place(p):
                self.add(p)
        for p in lanes.admit(self.engine, self.add):
            self.shared.stats.num_solo_runs += 1
            log.warning(
                "quarantine: running request %s alone (solo run %d of at most %d)",
                p.request_id,
                p.solo_failures + 1,
                self.shared.options.solo_attempts,
            )

    def add(self, p: Pending) -> bool:
        """Tokenize one request and add it to the engine (isolated, in steps of its own, if it is
        quarantined); False if it is gone, was refused or failed. Each request taken in is progress
        for the watchdog (a big inbox may take long to tokenize); while the loop works on it,
        ``busy_rid`` names it (should that work hang). If its own work raises, it fails alone, at
        once; the loop goes on."""
        s = self.shared
        with s.lock:
            if self.abandoned.is_set():
                raise EngineAbandoned()
            if p.request_id not in s.pending:  # aborted or failed before it reached the engine
                return False
            s.busy_rid = p.request_id
        try:
            return self._add(p)
        except EngineAbandoned:
            raise
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the loop
            log.error("adding request %s to the engine failed; failing it alone", p.request_id, exc_info=True)
            with contextlib.suppress(Exception):
                self.engine.abort(p.request_id)
            self.reject(p, internal_error("adding it to the engine", exc))
            return False
        finally:
            self.beat()

    def _add(self, p: Pending) -> bool:
        s, engine = self.shared, self.engine
        for f in s.options.faults:
            f.before_tokenize(p.prompt_text())
        inp = engine_input(engine, p.request)
        if isinstance(inp, InvalidRequest):
            self.reject(p, inp)
            return False
        p.added_at = time.time()
        try:
            # an embeddings request's token-id lists and PoolingParams reach a PoolingEngine (engine_input matched them)
            ids: Any = inp.prompt_token_ids
            params: Any = inp.params
            engine.add_request(p.request_id, ids, params, priority=p.request.priority, isolated=p.request.solo)
        except (ValueError, TypeError) as exc:
            self.reject(p, request_error(exc))
            return False
        with s.lock:
            if self.abandoned.is_set() or p.request_id not in s.pending:  # abandoned, or aborted while we tokenized
                engine.abort(p.request_id)
                if self.abandoned.is_set():
                    raise EngineAbandoned()
                return False
            p.in_engine = True
        return True

    def beat(self) -> None:
        """The loop made progress outside a step (a request taken in): tell the watchdog."""
        s = self.shared
        with s.lock:
            if not self.abandoned.is_set():  # an abandoned loop's beat would hide the new one's hang
                s.busy_rid = None
                s.last_beat = time.monotonic()

    def reject(self, p: Pending, exc: Exception) -> None:
        with self.shared.lock:
            if self.abandoned.is_set():
                raise EngineAbandoned()  # p was carried over to the next engine; it decides
            if self.shared.pending.pop(p.request_id, None) is None:
                return
        p.future.set_exception(exc)

    def resolve(self, outputs: list[RequestOutput]) -> None:
        """Resolve the futures of the requests that finished. Each request leaves the pending set
        only here, and its future is resolved whatever happens: if building its result raises, it
        fails alone with a retryable error (not a strike)."""
        s = self.shared
        now = time.time()
        tokenizer = cast(Decoder, self.engine.tokenizer)
        for out in outputs:
            with s.lock:
                p = s.pending.pop(out.request_id, None)
            if p is None:
                continue  # aborted at its deadline
            if out.finish_reason == "error":
                p.future.set_exception(EngineFailure(f"the engine failed this request: {out.error}"))
                continue
            try:
                for f in s.options.faults:
                    f.before_result(p.prompt_text())
                result = p.result(out, lambda entries: s.logprobs.render(tokenizer, entries), now)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the loop
                log.error("building the result of request %s failed; failing it alone", p.request_id, exc_info=True)
                p.future.set_exception(internal_error("building its result", exc))
                continue
            s.stats.num_finished += 1
            p.future.set_result(result)

    # -- the engine's step hook --------------------------------------------------------------------
    def on_step_start(self, seqs: list[Sequence]) -> None:
        """Installed as the engine's ``on_step_start``: counts the step, runs the faults, and
        unwinds an abandoned engine before it computes anything."""
        s, abandoned = self.shared, self.abandoned
        if abandoned.is_set():
            raise EngineAbandoned()
        if s.in_canary:
            return  # not a work step: not counted, and no fault applies
        s.step_rids = tuple(seq.request_id for seq in seqs)
        step = s.step_stats.start(len(seqs))
        if s.options.faults:
            ctx = StepContext(
                step=step, seqs=seqs, engine=self.engine, abandoned=abandoned, prompt_text=self.prompt_text
            )
            for f in s.options.faults:
                f.before_step(ctx)
        if abandoned.is_set():  # a hang outlived the watchdog: do not run the forward pass
            raise EngineAbandoned()

    def prompt_text(self, seq: Sequence) -> str | None:
        """The prompt of an engine sequence as the client sent it (for poison faults)."""
        p = self.shared.pending.get(seq.request_id)
        return None if p is None else p.prompt_text()
