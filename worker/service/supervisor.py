"""The supervisor: builds engines, watches the loop, and after a failure triages and rebuilds.

When ``step()`` raises, or the watchdog sees work pending and no progress for
``watchdog_timeout`` seconds, it logs one ERROR with the traceback, fails the requests in the
failing step with a retryable ``EngineFailure`` (marked ``struck``), carries every other pending
request over (all of them, for a failure outside any step), abandons the old engine and its loop
thread (a late result from an abandoned step is ignored), and builds a new engine on the same
loaded weights (then, if that fails, on weights reloaded from disk). After ``max_rebuilds``
consecutive failed rebuilds, or as many failures outside any step in a row, or ``POISON_BREAKER``
poison verdicts in a row, it gives up: the service turns unhealthy and calls ``on_fatal`` so the
entry point can stop consuming and exit non-zero. Nothing here ever exits the process.

A step that hung on CUDA is the exception to rebuilding (``after_hang``): the hung thread keeps
its engine, KV pool included, and a rebuild would ask for the same pool again beside it. Unless
the device shows that much memory free, the supervisor gives up at once, so the worker hands its
messages back to the queue and exits for its orchestrator to restart it with the memory free."""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, cast

from batchery.contract.errors import EngineUnavailable
from batchery.worker.service.loop import EngineLoop
from batchery.worker.service.shared import Failure, Shared, fail
from batchery.worker.service.state import LIVE_STATES, EngineState
from batchery.worker.service.triage import POISON_BREAKER, poison_error, struck_error, triage, watchdog_reason

if TYPE_CHECKING:
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import LoadedModel

log = logging.getLogger("batchery.worker.engine")

SUPERVISOR_TICK_S = 0.1

HangAction = Literal["rebuild", "exit"]


def after_hang(device_kind: str, free_bytes: int | None, needed_bytes: int) -> HangAction:
    """What to do once a step hung and its thread is still running: ``rebuild`` beside it, or
    ``exit`` so that a restarted process gets the memory back. On the CPU the old engine's memory
    is host memory, which the rebuild has always shared with it: rebuild, as before. On CUDA the
    hung thread holds its KV pool (up to 85% of the device), so a new pool of the same size fits
    only if ``free_bytes`` (``torch.cuda.mem_get_info``, after a GC pass and ``empty_cache``)
    shows it; unknown free memory counts as not enough."""
    if device_kind != "cuda":
        return "rebuild"
    if free_bytes is not None and free_bytes >= needed_bytes:
        return "rebuild"
    return "exit"


def _engine_memory(engine: LLMEngine | None) -> tuple[str, int] | None:
    """The engine's device kind and KV-pool bytes (what its replacement needs), or None when the
    engine does not say (then the rebuild goes ahead, as it always has)."""
    try:
        runner = engine.runner  # type: ignore[union-attr]
        return str(runner.device.type), int(runner.kv_cache_bytes())
    except Exception:  # noqa: BLE001 - a guess about memory must never stop the recovery
        return None


def _cuda_free_bytes(engine_device: str) -> int | None:
    """Free device memory as the driver sees it; None where it cannot be read."""
    torch = sys.modules.get("torch")
    if torch is None or engine_device != "cuda" or not torch.cuda.is_available():
        return None
    try:
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    except Exception:  # noqa: BLE001
        return None


class Supervisor:
    """Owns the engine's lifecycle for one ``EngineService``; ``run`` is its thread's body."""

    def __init__(self, shared: Shared, on_fatal: Callable[[str], None] | None = None) -> None:
        self.shared = shared
        self.on_fatal = on_fatal
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Build the first engine (loads the weights; slow), install it and start watching.
        Raises if the build fails."""
        s = self.shared
        engine = self.build(None)
        s.loaded = engine.loaded
        s.stats.model_name = str(engine.loaded.name)
        s.stats.dtype = str(engine.loaded.dtype).removeprefix("torch.")
        with s.lock:
            self.install(engine, is_rebuild=False)
        self.thread = threading.Thread(target=self.run, name="engine-supervisor", daemon=True)
        self.thread.start()

    # -- engine construction -----------------------------------------------------------------------
    def build(self, loaded: LoadedModel | None) -> LLMEngine:
        from batchery.engine.encoder_runner import is_pooling_model
        from batchery.engine.llm_engine import LLMEngine  # heavy; only the worker process pays for it
        from batchery.engine.pooling_engine import PoolingEngine

        config = self.shared.config
        if config is None:
            raise ValueError("the engine service has no engine config to build an engine from")
        if is_pooling_model(config.model):
            # an embedding model: a PoolingEngine offers the part of LLMEngine's surface the service uses
            # (add_request, abort, step, has_unfinished, stats, requests, on_step_start, loaded, encode)
            return cast("LLMEngine", PoolingEngine(config, loaded=cast("Any", loaded)))
        num_kv_blocks = self.shared.stats.num_kv_blocks
        if num_kv_blocks and config.num_kv_blocks is None:
            # a rebuild gets the pool size the first engine had, rather than one re-derived from
            # whatever memory is free at that moment: same capacity, or a clear failure
            config = dataclasses.replace(config, num_kv_blocks=num_kv_blocks)
        return LLMEngine(config, loaded=loaded)

    def install(self, engine: LLMEngine, is_rebuild: bool) -> None:
        """Make ``engine`` current and start its loop thread. Caller holds the lock."""
        s = self.shared
        gen = s.gen
        abandoned = threading.Event()
        loop = EngineLoop(s, gen, engine, abandoned, canary=is_rebuild)
        engine.on_step_start = loop.on_step_start
        s.engine = engine
        s.abandoned = abandoned
        s.stats.num_kv_blocks = engine.num_kv_blocks
        s.stats.max_model_len = engine.max_model_len
        s.stats.engine = engine.stats()
        s.last_beat = time.monotonic()
        s.state = EngineState.DRAINING if s.draining else EngineState.SERVING
        t = threading.Thread(target=loop.run, name=f"engine-loop-{gen}", daemon=True)
        s.loop_thread = t
        t.start()

    # -- watching --------------------------------------------------------------------------------
    def run(self) -> None:
        s = self.shared
        while not s.stop.is_set():
            s.failed.wait(SUPERVISOR_TICK_S)
            if s.stop.is_set():
                return
            with s.lock:
                s.failed.clear()
                failure, s.failure = s.failure, None
                if failure is None and s.state in LIVE_STATES and (s.pending or s.in_canary):
                    reason = watchdog_reason(
                        time.monotonic() - s.last_beat, s.options.watchdog_timeout, len(s.pending), s.in_canary
                    )
                    if reason is not None:
                        failure = Failure(s.gen, reason)
            if failure is not None:
                try:
                    self.handle_failure(failure.gen, failure.reason, failure.exc)
                except Exception:  # noqa: BLE001 - the supervisor must survive its own bugs
                    log.exception("engine supervisor error")

    # -- after a failure ----------------------------------------------------------------------------
    def handle_failure(self, gen: int, reason: str, exc: BaseException | None) -> None:
        s = self.shared
        with s.lock:
            if gen != s.gen or s.state in (EngineState.FAILED, EngineState.STOPPED):
                return  # already handled
            s.gen += 1
            s.abandoned.set()  # the old loop thread, if it ever returns, touches nothing
            canary_failed = s.in_canary
            s.in_canary = False
            old_thread = s.loop_thread
            old_engine, s.engine = s.engine, None
            s.state = EngineState.REBUILDING
            t = triage(s.pending.values(), set(s.step_rids), s.options.solo_attempts, busy=s.busy_rid)
            # outside any step and any request's own work: nobody to blame, so nobody is struck;
            # counted, so that an engine failing that way over and over is given up on
            outside = not s.step_rids and s.busy_rid is None and not canary_failed
            if outside:
                s.outside_failures += 1
            s.requeue(t.carried)
            s.step_rids = ()
            s.busy_rid = None
            s.stats.num_failures += 1
            s.stats.last_failure = reason[:500]
            s.stats.num_struck += len(t.struck)
            s.stats.num_poisoned += len(t.poisoned)
            s.stats.num_carried_over += len(t.carried)
        what = f"{type(exc).__name__}: {exc}" if exc is not None else reason
        try:
            tb = "".join(traceback.format_exception(exc)) if exc is not None else "(no exception: the step hung)"
            carry = f", carrying {len(t.carried)} others over to the new engine" if t.carried else ""
            canary = " (the rebuilt engine's canary step)" if canary_failed else ""
            log.error(
                "engine failure%s: %s; failing %d in-flight requests with a retryable EngineFailure%s%s%s and "
                "rebuilding the engine\n%s",
                canary,
                reason,
                len(t.struck),
                " (outside any engine step: nobody is struck)" if outside else "",
                carry,
                f", {len(t.poisoned)} for good as poison" if t.poisoned else "",
                tb.rstrip(),
            )
            for p in t.poisoned:
                log.error(
                    "quarantine: request %s failed alone %d times; failing it for good", p.request_id, p.solo_failures
                )
        finally:
            # these requests have left the pending set: their futures are resolved whatever happened above
            fail(t.struck, struck_error(reason))
            for p in t.poisoned:
                fail([p], poison_error(p, what))
        memory = _engine_memory(old_engine) if exc is None else None
        if old_engine is not None:
            # The engine holds its loop through this hook and the loop holds the engine: a cycle,
            # which only a full GC pass would free, and never once gc.freeze() has frozen it (the
            # worker freezes its first engine). Broken here, the engine goes with its last reference.
            old_engine.on_step_start = None
        del old_engine
        self.release(old_thread, exc)
        del exc
        if memory is not None and old_thread is not None and old_thread.is_alive():
            kind, needed = memory
            free = _cuda_free_bytes(kind)
            if after_hang(kind, free, needed) == "exit":
                self.give_up(
                    f"the engine step hung on {kind} and its thread still holds the old engine's memory "
                    f"({free if free is not None else 'unknown'} bytes free, {needed} needed for a new KV pool): "
                    f"exiting so that a restarted worker gets the memory back (last failure: {reason})"
                )
                return
        if canary_failed:
            s.failed_rebuilds += 1  # rebuilt, but the engine failed its canary step
        if s.outside_failures >= s.options.max_rebuilds:
            self.give_up(
                f"{s.outside_failures} engine failures in a row outside any engine step, with no successful "
                f"step in between (last failure: {reason})"
            )
            return
        s.verdicts_in_a_row += len(t.poisoned)
        if s.verdicts_in_a_row >= POISON_BREAKER:
            # Poison is rare; request after request failing alone, with nothing succeeding in
            # between, means this engine fails real work (its canary is too small to show it).
            self.give_up(
                f"{s.verdicts_in_a_row} requests in a row failed alone with no successful engine step "
                f"in between: the engine, not the requests, looks broken (last failure: {reason})"
            )
            return
        self.rebuild(reason)

    @staticmethod
    def release(old_thread: threading.Thread | None, exc: BaseException | None) -> None:
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

    def rebuild(self, reason: str) -> None:
        s = self.shared
        attempt = 0
        while not s.stop.is_set():
            if s.failed_rebuilds >= s.options.max_rebuilds:
                self.give_up(f"{s.failed_rebuilds} consecutive engine rebuilds failed (last failure: {reason})")
                return
            attempt += 1
            # reuse the weights first; if that does not hold, drop them and reload from disk
            loaded = s.loaded if attempt == 1 else None
            if loaded is None:
                s.loaded = None
                gc.collect()
            t0 = time.monotonic()
            try:
                for f in s.options.faults:
                    f.before_rebuild(attempt)
                engine = self.build(loaded)
            except Exception as exc:  # noqa: BLE001
                s.failed_rebuilds += 1
                reason = f"rebuild attempt {attempt} raised {exc!r}"
                log.error(
                    "engine rebuild attempt %d failed (%d/%d consecutive)",
                    attempt,
                    s.failed_rebuilds,
                    s.options.max_rebuilds,
                    exc_info=True,
                )
                s.stop.wait(s.options.rebuild_backoff * attempt)
                continue
            with s.lock:
                if s.stop.is_set():
                    return
                s.loaded = engine.loaded
                s.stats.num_rebuilds += 1
                self.install(engine, is_rebuild=True)
            log.warning(
                "engine restarted: rebuild %d (attempt %d, %s weights) took %.2f s; serving again",
                s.stats.num_rebuilds,
                attempt,
                "reused" if loaded is not None else "reloaded",
                time.monotonic() - t0,
            )
            return

    def give_up(self, reason: str) -> None:
        s = self.shared
        with s.lock:
            s.state = EngineState.FAILED
            s.fatal_reason = reason
            pending = s.take_pending()
        log.critical("engine cannot be rebuilt: %s; the worker stops consuming and exits non-zero", reason)
        fail(pending, EngineUnavailable(f"the engine is down: {reason}"))
        if self.on_fatal is not None:
            try:
                self.on_fatal(reason)
            except Exception:  # noqa: BLE001
                log.exception("on_fatal callback failed")
