"""One engine per worker process: a loop thread drives it, task threads wait on futures.

The engine is single-threaded, so task threads never touch it: ``submit`` and ``abort`` only
queue an operation and wake the loop thread, which applies it (tokenize, ``add_request``,
``abort``) between steps. Each request's ``concurrent.futures.Future`` is resolved by the loop
thread when the request finishes.

A supervisor thread watches over the loop. When ``step()`` raises, or the watchdog sees work
pending and no progress for ``watchdog_timeout`` seconds, it logs one ERROR with the traceback,
fails every in-flight future at once with a retryable ``EngineFailure``, abandons the old engine
and its loop thread (a late result from an abandoned step is ignored), and builds a new engine on
the same loaded weights. After ``max_rebuilds`` consecutive failed rebuilds it gives up: the
service turns unhealthy and calls ``on_fatal`` so the entry point can stop consuming and exit
non-zero. Nothing here ever exits the process.

Who pays for a failure: only the requests in the failing step (for a hang, the hung step) get the
``EngineFailure``, marked ``struck``; the task records the strike and retries. Every other pending
request (waiting in the engine, or not yet in it) is carried over to the new engine in-process. A
rebuilt engine first runs a two-token canary; only a failed canary (or a failed build) counts
towards ``max_rebuilds``, so a request that crashes every engine it meets cannot make the worker
give up.

Quarantine: a request submitted with ``solo=True`` (the task does so once it has been struck
``K`` times) runs alone: new work is held while the engine drains, the request runs by itself,
then held work goes in before the next quarantined request. If it fails alone on
``solo_attempts`` consecutive runs (each after a canary proved the engine sound), it is poison and
its future raises ``EngineCrash``, naming the exception. ``POISON_BREAKER`` verdicts in a row with
no successful step between them mean the engine fails real work: the service gives up instead."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from batchery.contract.errors import (
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineCrash,
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
    WorkerShuttingDown,
)
from batchery.worker.faults import Fault, StepContext
from batchery.worker.metrics import StepStats

log = logging.getLogger("batchery.worker.engine")

IDLE_WAIT_S = 1.0  # the idle loop wakes this often just to show it is alive
BATCH_QUIET_S = 0.01  # gathering a burst ends once no request has arrived for this long
SUPERVISOR_TICK_S = 0.1
CANARY_ID = "batchery-canary"
POISON_BREAKER = 5  # this many poison verdicts with no successful step between them: the engine is broken


@dataclass
class GenerationRequest:
    """What a task asks for. Exactly one of ``messages``, ``prompt``, ``prompt_token_ids``."""

    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict = field(default_factory=dict)  # SamplingParams kwargs; max_tokens None -> fill the context
    priority: int = 0
    solo: bool = False  # quarantined: run alone, with no other request in the engine


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    # per token: {"token", "token_id", "logprob", "top": [{"token", "token_id", "logprob"}, ...]}
    logprobs: list[dict] | None
    submitted_at: float  # wall-clock times (time.time()), for latency accounting
    added_at: float
    finished_at: float


@dataclass
class _Pending:
    request_id: str
    request: GenerationRequest
    future: Future
    submitted_at: float
    added_at: float = 0.0
    in_engine: bool = False  # added to the current engine (False again once carried over to a new one)
    solo_failures: int = 0  # failed runs alone (quarantine)
    text: str | None = None  # the prompt as sent, for poison faults (built on first use)


class _Lanes:
    """The loop thread's admission state, for quarantine. Requests normally go straight into the
    engine; while a quarantined request waits or runs, new ones are held."""

    def __init__(self) -> None:
        self.held: deque[_Pending] = deque()  # normal requests waiting for a solo run to end
        self.solo: deque[_Pending] = deque()  # quarantined requests waiting for their turn
        self.solo_rid: str | None = None  # the quarantined request running now
        self.release_held = False  # a solo run just ended: held work goes in before the next one

    def __bool__(self) -> bool:
        return bool(self.held or self.solo)


class EngineAbandoned(Exception):
    """Raised inside an abandoned engine's step so its thread unwinds without touching anything."""


class EngineService:
    """Owns the process's engine. Thread-safe: ``submit``/``abort``/``generate`` from any thread."""

    def __init__(
        self,
        config,
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
        self.watchdog_timeout = watchdog_timeout
        self.max_rebuilds = max_rebuilds
        self.faults = list(faults or [])
        self.rebuild_backoff = rebuild_backoff
        self.batch_wait = batch_wait
        self.on_fatal = on_fatal
        self.solo_attempts = max(1, int(solo_attempts))

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # wakes the loop thread: new ops or stop
        self._failed = threading.Event()  # wakes the supervisor: a loop thread reported a failure
        self._stop = threading.Event()
        self._inbox: deque = deque()  # ("add", _Pending) | ("abort", request_id)
        self._pending: dict[str, _Pending] = {}  # submitted, future not yet resolved
        self._failure: tuple[int, str, BaseException | None] | None = None

        self._engine = None
        self._loaded = None
        self._gen = 0  # bumped whenever an engine is abandoned; a loop thread serves exactly one gen
        self._abandoned: threading.Event = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self._supervisor: threading.Thread | None = None
        self._state = "new"  # new | serving | rebuilding | draining | failed | stopped
        self._draining = False
        self._fatal_reason: str | None = None

        self._last_beat = time.monotonic()  # loop progress: a step ran, or the loop idled with no work
        self._last_step_at: float | None = None
        self._engine_steps = 0
        self._failed_rebuilds = 0  # consecutive; reset by a successful canary or step
        self._token_text: dict[int, str] = {}
        self._step_rids: tuple[str, ...] = ()  # the requests in the step now running (or the hung one)
        self._in_canary = False
        self._verdicts_in_a_row = 0  # poison verdicts since the last successful work step

        # counters for /stats (process lifetime, across rebuilds)
        self.num_steps = 0
        self.num_step_seqs = 0
        self.num_step_tokens = 0
        self.step_seconds = 0.0  # wall time inside engine.step()
        self.step_stats = StepStats()  # per-step histograms and engine counters for /metrics
        self.num_failures = 0
        self.num_rebuilds = 0
        self.num_struck = 0  # requests failed for being in a failing step
        self.num_carried_over = 0  # requests moved to a rebuilt engine without failing
        self.num_solo_runs = 0  # quarantined runs started
        self.num_poisoned = 0  # requests failed for good with EngineCrash
        self.num_requests = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.engine_stats: dict = {}
        self.model_name = ""
        self.dtype = ""
        self.num_kv_blocks = 0
        self.max_model_len = 0
        self._ids = itertools.count()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Build the first engine (loads the weights; slow) and start the threads. Raises if the
        first build fails: a worker that cannot load its model must not start consuming."""
        engine = self._build(None)
        self._loaded = engine.loaded
        self.model_name = str(engine.loaded.name)
        self.dtype = str(engine.loaded.dtype).removeprefix("torch.")
        with self._lock:
            self._install(engine, is_rebuild=False)
        self._supervisor = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
        self._supervisor.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the threads. In-flight futures fail with ``WorkerShuttingDown``."""
        with self._lock:
            self._stop.set()
            if self._state != "failed":
                self._state = "stopped"
            pending = self._take_pending()
            self._abandoned.set()
            self._wake.notify_all()
        self._fail(pending, WorkerShuttingDown("the worker is shutting down; the request will be requeued"))
        self._failed.set()
        for t in (self._loop_thread, self._supervisor):
            if t is not None and t is not threading.current_thread():
                t.join(timeout)

    def begin_drain(self, grace: float) -> None:
        """Warm shutdown: refuse new work now; after ``grace`` seconds, fail what is still in flight
        with ``WorkerShuttingDown`` (its task requeues the message). Safe from a signal handler."""
        with self._lock:
            if self._draining:
                return
            self._draining = True
            if self._state == "serving":
                self._state = "draining"
        log.warning("draining: no new requests; in-flight requests get %.1f s to finish", grace)
        timer = threading.Timer(grace, self._end_drain)
        timer.daemon = True
        timer.start()

    def _end_drain(self) -> None:
        with self._lock:
            pending = self._take_pending()
            for p in pending:
                self._inbox.append(("abort", p.request_id))
            self._wake.notify_all()
        if pending:
            log.warning("drain grace over: returning %d unfinished requests to the queue", len(pending))
        self._fail(pending, WorkerShuttingDown("the worker is shutting down; the request will be requeued"))

    # -- the task-thread API -------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> tuple[str, Future]:
        """Queue a request for the engine. Returns its engine request id and a future that yields a
        ``GenerationResult`` or raises ``InvalidRequest`` / ``EngineFailure``."""
        rid = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        p = _Pending(rid, request, Future(), time.time())
        with self._lock:
            if self._draining or self._stop.is_set():
                raise WorkerShuttingDown("the worker is shutting down; the request will be requeued")
            if self._state == "failed":
                raise EngineUnavailable(f"the engine is down and could not be rebuilt: {self._fatal_reason}")
            self._pending[rid] = p
            self._inbox.append(("add", p))
            self.num_requests += 1
            self._wake.notify()
        return rid, p.future

    def abort(self, request_id: str) -> bool:
        """Abort a request: its future is dropped and the loop frees its KV blocks. False if it had
        already finished or failed."""
        with self._lock:
            p = self._pending.pop(request_id, None)
            if p is None:
                return False
            self._inbox.append(("abort", request_id))
            self.num_aborted += 1
            self._wake.notify()
        return True

    def generate(self, request: GenerationRequest, timeout: float) -> GenerationResult:
        """Submit and wait up to ``timeout`` seconds. At the deadline the request is aborted in the
        engine and ``DeadlineExceeded`` is raised."""
        deadline = time.monotonic() + timeout
        rid, fut = self.submit(request)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            if not self.abort(rid) and fut.done():
                return fut.result()  # finished in the same instant
            raise DeadlineExceeded(
                f"deadline of {timeout:g} s exceeded; the request was aborted in the engine"
            ) from None

    # -- status ------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def ready(self) -> bool:
        return self._state == "serving"

    @property
    def fatal(self) -> bool:
        return self._state == "failed"

    @property
    def fatal_reason(self) -> str | None:
        return self._fatal_reason

    def health(self) -> dict:
        """Liveness: the engine loop thread is alive (or being rebuilt) and the last step's age."""
        now = time.monotonic()
        loop = self._loop_thread
        loop_alive = loop is not None and loop.is_alive()
        state = self._state
        healthy = state in ("serving", "draining") and loop_alive or state == "rebuilding"
        return {
            "healthy": bool(healthy),
            "state": state,
            "loop_alive": loop_alive,
            "last_step_age_s": None if self._last_step_at is None else round(now - self._last_step_at, 3),
            "last_loop_beat_age_s": round(now - self._last_beat, 3),
            "num_pending": len(self._pending),
            "fatal_reason": self._fatal_reason,
        }

    def stats(self) -> dict:
        """Counters for the worker stats endpoint. ``mean_batch_size`` is over this process's
        lifetime; diff ``num_steps`` / ``num_step_seqs`` for a window."""
        steps = max(self.num_steps, 1)
        return {
            "model": self.model_name,
            "dtype": self.dtype,
            "num_kv_blocks": self.num_kv_blocks,
            "max_model_len": self.max_model_len,
            "state": self._state,
            "num_pending": len(self._pending),
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_steps": self.num_steps,
            "num_step_seqs": self.num_step_seqs,
            "num_step_tokens": self.num_step_tokens,
            "step_seconds": round(self.step_seconds, 6),
            "mean_batch_size": self.num_step_seqs / steps,
            "num_failures": self.num_failures,
            "num_rebuilds": self.num_rebuilds,
            "num_struck": self.num_struck,
            "num_carried_over": self.num_carried_over,
            "num_solo_runs": self.num_solo_runs,
            "num_poisoned": self.num_poisoned,
            "engine": dict(self.engine_stats),
        }

    # -- engine construction -----------------------------------------------------------------
    def _build(self, loaded):
        from batchery.engine.llm_engine import LLMEngine  # heavy; only the worker process pays for it

        config = self.config
        if self.num_kv_blocks and config.num_kv_blocks is None:
            # a rebuild gets the pool size the first engine had, rather than one re-derived from
            # whatever memory is free at that moment: same capacity, or a clear failure
            config = dataclasses.replace(config, num_kv_blocks=self.num_kv_blocks)
        return LLMEngine(config, loaded=loaded)

    def _install(self, engine, is_rebuild: bool) -> None:
        """Make ``engine`` current and start its loop thread. Caller holds the lock."""
        gen = self._gen
        abandoned = threading.Event()
        engine.on_step_start = self._make_step_hook(gen, engine, abandoned)
        self._engine = engine
        self._abandoned = abandoned
        self._engine_steps = 0
        self.num_kv_blocks = engine.num_kv_blocks
        self.max_model_len = engine.max_model_len
        self.engine_stats = engine.stats()
        self._last_beat = time.monotonic()
        if not self._draining:
            self._state = "serving"
        else:
            self._state = "draining"
        t = threading.Thread(target=self._loop, args=(gen, engine, abandoned, is_rebuild),
                             name=f"engine-loop-{gen}", daemon=True)
        self._loop_thread = t
        t.start()

    def _make_step_hook(self, gen: int, engine, abandoned: threading.Event):
        def on_step_start(seqs) -> None:
            if abandoned.is_set():
                raise EngineAbandoned()
            if self._in_canary:
                return  # not a work step: not counted, and no fault applies
            self._step_rids = tuple(s.request_id for s in seqs)
            self.num_steps += 1
            self.num_step_seqs += len(seqs)
            if self.faults:
                ctx = StepContext(step=self.num_steps, seqs=seqs, engine=engine, abandoned=abandoned,
                                  prompt_text=self._prompt_text)
                for f in self.faults:
                    f.before_step(ctx)
            if abandoned.is_set():  # a hang outlived the watchdog: do not run the forward pass
                raise EngineAbandoned()

        return on_step_start

    def _prompt_text(self, seq) -> str | None:
        """The prompt of an engine sequence as the client sent it (for poison faults)."""
        p = self._pending.get(seq.request_id)
        if p is None:
            return None
        if p.text is None:
            req = p.request
            if req.messages is not None:
                p.text = "\n".join(str(m.get("content") or "") for m in req.messages)
            elif req.prompt is not None:
                p.text = req.prompt
            else:
                return None
        return p.text

    # -- the loop thread -----------------------------------------------------------------------
    def _loop(self, gen: int, engine, abandoned: threading.Event, canary: bool = False) -> None:
        lanes = _Lanes()
        try:
            if canary:
                self._run_canary(engine, abandoned)
            while True:
                with self._lock:
                    if abandoned.is_set() or self._stop.is_set():
                        return
                    idle = not engine.has_unfinished()
                    if idle and not self._inbox and not lanes:
                        self._last_beat = time.monotonic()
                        self._wake.wait(IDLE_WAIT_S)
                        continue
                    if idle and self.batch_wait > 0 and self._inbox:
                        self._gather()
                    ops = list(self._inbox)
                    self._inbox.clear()
                self._apply(engine, ops, lanes)
                if not engine.has_unfinished():
                    self.engine_stats = engine.stats()
                    continue
                steps_before = self.num_steps
                t_step = time.perf_counter()
                outputs = engine.step()
                self._step_rids = ()
                step_s = time.perf_counter() - t_step
                self.step_seconds += step_s
                if abandoned.is_set():
                    return  # the supervisor gave up on this engine; its results are void
                if self.num_steps == steps_before:
                    continue  # nothing was scheduled: not progress, so the watchdog keeps counting
                self._last_beat = self._last_step_at = time.monotonic()
                self._engine_steps += 1
                self._failed_rebuilds = self._verdicts_in_a_row = 0
                self.num_step_tokens += engine.last_step_num_tokens
                self.engine_stats = engine.stats()
                self.step_stats.observe(gen, step_s, self.engine_stats)
                if outputs:
                    self._resolve(engine, outputs)
        except EngineAbandoned:
            log.info("abandoned engine loop %d exited", gen)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the supervisor
            if abandoned.is_set():
                log.info("abandoned engine loop %d exited with %r", gen, exc)
                return
            with self._lock:
                if self._failure is None:
                    self._failure = (gen, f"the engine loop raised {type(exc).__name__}", exc)
            self._failed.set()

    def _gather(self) -> None:
        """The engine is idle and work has arrived: let a burst finish arriving before the first
        step, so the step batches it (and small early steps do not compete with the arriving
        tasks for the CPU). Waits while new requests keep coming, at most ``batch_wait`` seconds;
        a lone request waits one quiet period. Caller holds the lock."""
        deadline = time.monotonic() + self.batch_wait
        quiet = min(BATCH_QUIET_S, self.batch_wait)
        while len(self._inbox) < self.config.max_num_seqs:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            n = len(self._inbox)
            self._wake.wait(min(quiet, left))
            if len(self._inbox) == n or self._stop.is_set():
                return

    def _run_canary(self, engine, abandoned: threading.Event) -> None:
        """Prove a rebuilt engine sound before it takes work: one short prompt, two tokens (a
        prefill and a decode step). If it raises (or hangs), the failure is the engine's, not a
        request's, and counts as a failed rebuild."""
        from batchery.engine.sampling import SamplingParams

        with self._lock:
            self._in_canary = True
        t0 = time.perf_counter()
        ids = (engine.encode("Hello") or [0])[:8]
        engine.add_request(CANARY_ID, ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished() and not abandoned.is_set():
            engine.step()
        with self._lock:
            self._in_canary = False
            if abandoned.is_set():
                raise EngineAbandoned()
            self._failed_rebuilds = 0
            self._last_beat = time.monotonic()
        log.info("rebuilt engine passed its canary step (%.3f s)", time.perf_counter() - t0)

    def _apply(self, engine, ops: list, lanes: _Lanes) -> None:
        """Apply queued aborts and adds, then admit what quarantine allows. Loop thread only."""
        for op, arg in ops:
            if op == "abort":
                engine.abort(arg)
                continue
            p: _Pending = arg
            if p.request_id not in self._pending:  # aborted or failed before it reached the engine
                continue
            if p.request.solo:
                # a re-run after failing alone goes first: it runs right after the canary proved the
                # engine sound, so a flaky engine would have to fail twice in a row to convict it
                (lanes.solo.appendleft if p.solo_failures else lanes.solo.append)(p)
            elif lanes.solo or lanes.solo_rid is not None:
                lanes.held.append(p)
            else:
                self._add(engine, p)
        self._admit(engine, lanes)

    def _admit(self, engine, lanes: _Lanes) -> None:
        """Quarantine's turns: held work goes in when no solo run waits (or one just ended); a
        quarantined request starts once the engine is empty, and then runs alone."""
        if lanes.solo_rid is not None:
            if lanes.solo_rid in engine.requests:
                return
            lanes.solo_rid = None  # the solo run is over (finished, or aborted at its deadline)
            lanes.release_held = True
        if lanes.held and (lanes.release_held or not lanes.solo):
            while lanes.held:
                self._add(engine, lanes.held.popleft())
        lanes.release_held = False
        while lanes.solo and not engine.has_unfinished():
            p = lanes.solo.popleft()
            if self._add(engine, p):
                lanes.solo_rid = p.request_id
                self.num_solo_runs += 1
                log.warning("quarantine: running request %s alone (solo run %d of at most %d)", p.request_id,
                            p.solo_failures + 1, self.solo_attempts)

    def _add(self, engine, p: _Pending) -> bool:
        """Tokenize and add one request to the engine; False if it is gone or was refused."""
        from batchery.engine.llm_engine import PromptTooLong
        from batchery.engine.sampling import SamplingParams

        if p.request_id not in self._pending:  # aborted or failed before it reached the engine
            return False
        req = p.request
        try:
            if req.messages is not None:
                ids = engine.encode_chat(req.messages)
            elif req.prompt is not None:
                ids = engine.encode(req.prompt)
            else:
                ids = list(req.prompt_token_ids or [])
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the request's fault
            self._reject(p, InvalidRequest(f"could not tokenize the request: {exc}"))
            return False
        kwargs = dict(req.sampling)
        if kwargs.get("max_tokens") is None:
            room = engine.max_model_len - len(ids)
            kwargs["max_tokens"] = max(room, 1)
        try:
            params = SamplingParams(**kwargs)
            p.added_at = time.time()
            engine.add_request(p.request_id, ids, params, priority=req.priority)
        except (ValueError, TypeError) as exc:
            kind = ContextLengthExceeded if isinstance(exc, PromptTooLong) else InvalidRequest
            self._reject(p, kind(str(exc)))
            return False
        with self._lock:
            if p.request_id not in self._pending:  # aborted while we tokenized
                engine.abort(p.request_id)
                return False
            p.in_engine = True
        return True

    def _reject(self, p: _Pending, exc: Exception) -> None:
        with self._lock:
            if self._pending.pop(p.request_id, None) is None:
                return
        p.future.set_exception(exc)

    def _resolve(self, engine, outputs) -> None:
        now = time.time()
        for out in outputs:
            with self._lock:
                p = self._pending.pop(out.request_id, None)
            if p is None:
                continue  # aborted at its deadline
            if out.finish_reason == "error":
                p.future.set_exception(EngineFailure(f"the engine failed this request: {out.error}"))
                continue
            self.num_finished += 1
            p.future.set_result(GenerationResult(
                request_id=out.request_id,
                text=out.text,
                token_ids=list(out.token_ids),
                finish_reason=out.finish_reason or "stop",
                num_prompt_tokens=len(out.prompt_token_ids),
                num_cached_tokens=out.num_cached_tokens,
                logprobs=self._render_logprobs(engine, out.logprobs),
                submitted_at=p.submitted_at,
                added_at=p.added_at,
                finished_at=now,
            ))

    def _token(self, engine, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = engine.tokenizer.decode([token_id])
            if len(self._token_text) < 1 << 18:
                self._token_text[token_id] = s
        return s

    def _render_logprobs(self, engine, entries) -> list[dict] | None:
        if entries is None:
            return None
        out = []
        for e in entries:
            tid = int(e["token_id"])
            out.append({
                "token": self._token(engine, tid),
                "token_id": tid,
                "logprob": float(e["logprob"]),
                "top": [{"token": self._token(engine, int(i)), "token_id": int(i), "logprob": float(lp)}
                        for i, lp in (e.get("top") or [])],
            })
        return out

    # -- the supervisor ------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.is_set():
            self._failed.wait(SUPERVISOR_TICK_S)
            if self._stop.is_set():
                return
            with self._lock:
                self._failed.clear()
                failure, self._failure = self._failure, None
                if failure is None and self._state in ("serving", "draining") and (self._pending or self._in_canary):
                    quiet = time.monotonic() - self._last_beat
                    if quiet > self.watchdog_timeout:
                        what = "the canary step" if self._in_canary else f"{len(self._pending)} requests"
                        failure = (self._gen, f"the watchdog fired: {what} pending and "
                                              f"no engine step finished for {quiet:.1f} s "
                                              f"(limit {self.watchdog_timeout:g} s)", None)
            if failure is not None:
                try:
                    self._handle_failure(*failure)
                except Exception:  # noqa: BLE001 - the supervisor must survive its own bugs
                    log.exception("engine supervisor error")

    def _take_pending(self) -> list[_Pending]:
        """Empty the pending set and the inbox. Caller holds the lock."""
        pending = list(self._pending.values())
        self._pending.clear()
        self._inbox.clear()
        return pending

    @staticmethod
    def _fail(pending: list[_Pending], exc: Exception) -> None:
        for p in pending:
            if not p.future.done():
                p.future.set_exception(exc)

    def _handle_failure(self, gen: int, reason: str, exc: BaseException | None) -> None:
        with self._lock:
            if gen != self._gen or self._state in ("failed", "stopped"):
                return  # already handled
            self._gen += 1
            self._abandoned.set()  # the old loop thread, if it ever returns, touches nothing
            canary_failed = self._in_canary
            self._in_canary = False
            old_thread = self._loop_thread
            self._engine = None
            self._state = "rebuilding"
            struck, poisoned, carried = self._triage(set(self._step_rids))
            self._step_rids = ()
            self.num_failures += 1
            self.num_struck += len(struck)
            self.num_poisoned += len(poisoned)
            self.num_carried_over += len(carried)
        what = f"{type(exc).__name__}: {exc}" if exc is not None else reason
        tb = "".join(traceback.format_exception(exc)) if exc is not None else "(no exception: the step hung)"
        carry = f", carrying {len(carried)} others over to the new engine" if carried else ""
        canary = " (the rebuilt engine's canary step)" if canary_failed else ""
        log.error("engine failure%s: %s; failing %d in-flight requests with a retryable EngineFailure%s%s and "
                  "rebuilding the engine\n%s", canary, reason, len(struck), carry,
                  f", {len(poisoned)} for good as poison" if poisoned else "", tb.rstrip())
        retry = EngineFailure(f"engine failure ({reason}); the request will be retried")
        retry.struck = True  # it was in the failing step: the task counts a strike towards quarantine
        self._fail(struck, retry)
        for p in poisoned:
            log.error("quarantine: request %s failed alone %d times; failing it for good", p.request_id,
                      p.solo_failures)
            self._fail([p], EngineCrash(f"the request crashed the engine each of the {p.solo_failures} times it ran "
                                        f"alone (quarantined after repeated engine failures); last: {what}"[:2000]))
        self._release(old_thread, exc)
        del exc
        if canary_failed:
            self._failed_rebuilds += 1  # rebuilt, but the engine failed its canary step
        self._verdicts_in_a_row += len(poisoned)
        if self._verdicts_in_a_row >= POISON_BREAKER:
            # Poison is rare; request after request failing alone, with nothing succeeding in
            # between, means this engine fails real work (its canary is too small to show it).
            self._give_up(f"{self._verdicts_in_a_row} requests in a row failed alone with no successful engine step "
                          f"in between: the engine, not the requests, looks broken (last failure: {reason})")
            return
        self._rebuild(reason)

    def _triage(self, in_step: set[str]) -> tuple[list[_Pending], list[_Pending], list[_Pending]]:
        """Sort the pending requests after a failure: (struck, poisoned, carried over). Struck ones
        were in the failing step (or, if the failure came outside a step, in the engine); a
        quarantined request struck alone for the ``solo_attempts``-th time is poisoned; all others
        go to the new engine. Empties the pending set and the inbox of all but the carried ones.
        Caller holds the lock."""
        struck, poisoned, carried = [], [], []
        for p in self._pending.values():
            hit = p.in_engine and (p.request_id in in_step if in_step else True)
            if hit and p.request.solo:
                p.solo_failures += 1
                (poisoned if p.solo_failures >= self.solo_attempts else carried).append(p)
            elif hit:
                struck.append(p)
            else:
                carried.append(p)
        self._pending.clear()
        self._inbox.clear()
        carried.sort(key=lambda p: p.submitted_at)
        for p in carried:
            p.in_engine = False
            self._pending[p.request_id] = p
            self._inbox.append(("add", p))
        return struck, poisoned, carried

    @staticmethod
    def _release(old_thread: threading.Thread | None, exc: BaseException | None) -> None:
        """Let the old engine's memory go before a new KV pool is allocated. A thread that raised
        exits at once; a hung one cannot be waited for, and keeps its engine until it returns."""
        if old_thread is not None and old_thread is not threading.current_thread():
            old_thread.join(timeout=2.0)
        if exc is not None:
            traceback.clear_frames(exc.__traceback__)  # the frames hold the old engine and its KV pool
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _rebuild(self, reason: str) -> None:
        attempt = 0
        while not self._stop.is_set():
            if self._failed_rebuilds >= self.max_rebuilds:
                self._give_up(f"{self._failed_rebuilds} consecutive engine rebuilds failed (last failure: {reason})")
                return
            attempt += 1
            # reuse the weights first; if that does not hold, drop them and reload from disk
            loaded = self._loaded if attempt == 1 else None
            if loaded is None:
                self._loaded = None
                gc.collect()
            t0 = time.monotonic()
            try:
                for f in self.faults:
                    f.before_rebuild(attempt)
                engine = self._build(loaded)
            except Exception as exc:  # noqa: BLE001
                self._failed_rebuilds += 1
                reason = f"rebuild attempt {attempt} raised {exc!r}"
                log.error("engine rebuild attempt %d failed (%d/%d consecutive)", attempt,
                          self._failed_rebuilds, self.max_rebuilds, exc_info=True)
                self._stop.wait(self.rebuild_backoff * attempt)
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self._loaded = engine.loaded
                self.num_rebuilds += 1
                self._install(engine, is_rebuild=True)
            log.warning("engine restarted: rebuild %d (attempt %d, %s weights) took %.2f s; serving again",
                        self.num_rebuilds, attempt, "reused" if loaded is not None else "reloaded",
                        time.monotonic() - t0)
            return

    def _give_up(self, reason: str) -> None:
        with self._lock:
            self._state = "failed"
            self._fatal_reason = reason
            pending = self._take_pending()
        log.critical("engine cannot be rebuilt: %s; the worker stops consuming and exits non-zero", reason)
        self._fail(pending, EngineUnavailable(f"the engine is down: {reason}"))
        if self.on_fatal is not None:
            try:
                self.on_fatal(reason)
            except Exception:  # noqa: BLE001
                log.exception("on_fatal callback failed")
