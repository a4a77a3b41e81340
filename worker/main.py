"""``batchery worker``: load the model, then consume the model's queue until told to stop.

Exit codes: 0 after a warm shutdown (SIGTERM/SIGINT); 2 for bad configuration; 3 when the model
cannot be loaded or the engine cannot be rebuilt (the orchestrator restarts the worker, and the
unfinished messages have gone back to the queue)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import threading
import time

from batchery.contract.settings import Settings, mask_url
from batchery.worker.logs import configure_logging

log = logging.getLogger("batchery.worker")

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_ENGINE_DEAD = 3


def _exit_during_startup(signum, frame) -> None:
    raise SystemExit(EXIT_OK)


def run_worker(settings: Settings | None = None) -> int:
    """Run a worker in this process (blocking). Returns the process exit code.

    The cyclic garbage collector is paused from here until the model is loaded: the start imports
    torch, transformers and Celery (about 600,000 objects), and each full collection on the way
    rescans all of them (six of them cost 0.5-0.8 s of a 4-5 s start on a 2-core EPYC). What the
    start leaves behind is then frozen (``gc.freeze``, as before) and collection resumes for what the
    worker allocates afterwards. The start's own cyclic garbage (about 11,000 small objects, no
    tensors) is frozen with it; collecting it first would cost another full pass (0.35 s)."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return _run_worker(settings, resume_gc=gc_was_on)
    except RuntimeError as exc:
        # a SIGTERM during start-up raises SystemExit from the signal handler; landing inside a class's
        # __set_name__ (an import under way), Python wraps it in a RuntimeError: exit as the SIGTERM asked
        if isinstance(exc.__cause__, SystemExit):
            raise exc.__cause__ from None
        raise
    finally:
        if gc_was_on:
            gc.enable()


def _run_worker(settings: Settings | None, *, resume_gc: bool) -> int:
    from celery import signals

    from batchery.broker.check import RedisAuthError, check_redis
    from batchery.broker.connection import is_redis_url
    from batchery.engine.config import EngineConfig
    from batchery.worker import kombu_patches
    from batchery.worker.app import make_app
    from batchery.worker.background import EngineSnapshot, start_background
    from batchery.worker.health import HealthServer
    from batchery.worker.metrics import WorkerMetrics
    from batchery.worker.service import EngineService
    from batchery.worker.service.faults import parse_faults

    try:
        settings = settings or Settings()
        faults = parse_faults(settings.faults)
        engine_config = EngineConfig(**settings.engine_kwargs())
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        configure_logging("INFO")
        log.critical("invalid configuration: %s", exc)
        return EXIT_CONFIG
    configure_logging(settings.log_level, settings.log_format)
    if threading.current_thread() is threading.main_thread():
        # Until Celery installs its own handlers, SIGTERM means "never mind": nothing is consumed yet.
        signal.signal(signal.SIGTERM, _exit_during_startup)
    log.info(
        "starting worker: model=%s queue=%s broker=%s backend=%s threads=%d faults=%s",
        settings.model,
        settings.queue,
        mask_url(settings.broker_url),
        mask_url(settings.result_backend),
        settings.num_task_threads,
        settings.faults or "none",
    )
    # Refused credentials are a configuration error: say so now, not after loading the model and
    # retrying the connection for minutes. An unreachable Redis is left to Celery's retries.
    checks = [("BATCHERY_BROKER_URL", settings.broker_url)]
    if settings.result_backend != settings.broker_url:
        checks.append(("BATCHERY_RESULT_BACKEND", settings.result_backend))
    try:
        for setting, url in checks:
            problem = check_redis(url, setting)
            if problem:
                log.warning(
                    "Redis at %s (%s) does not answer yet: %s; the worker keeps trying", mask_url(url), setting, problem
                )
    except RedisAuthError as exc:
        log.critical("%s; not starting", exc)
        return EXIT_CONFIG

    app = make_app(settings)
    kombu_patches.apply()  # a Redis restart must not kill the worker (see the module)
    fatal = threading.Event()

    def on_fatal(reason: str) -> None:
        # Runs on the supervisor thread. It must not exit the process: it asks the main thread for a
        # warm shutdown, which stops consuming and hands unfinished messages back to the queue.
        fatal.set()
        os.kill(os.getpid(), signal.SIGTERM)

    service = EngineService(
        engine_config,
        watchdog_timeout=settings.watchdog_timeout,
        max_rebuilds=settings.max_rebuilds,
        faults=faults,
        on_fatal=on_fatal,
        batch_wait=settings.batch_wait,
        solo_attempts=settings.quarantine.solo_attempts,
    )
    try:
        service.start()  # loads the weights before a single message is taken
    except SystemExit:
        service.stop()
        log.info("stopped during start-up, before consuming")
        return EXIT_OK
    except Exception:  # noqa: BLE001
        log.critical("could not load model %s; not consuming", settings.model, exc_info=True)
        return EXIT_ENGINE_DEAD
    app.batchery_service = service
    metrics = WorkerMetrics(service, settings, task_names=sorted(n for n in app.tasks if n.startswith("batchery.")))
    metrics.connect()
    # Everything loaded so far (torch, transformers, the weights' Python objects) lives as long as
    # the process: keep it out of the cyclic GC, whose full passes over it stall the engine loop.
    gc.freeze()
    if resume_gc:  # paused since run_worker began (see there)
        gc.enable()

    health = None
    if settings.health_port:
        health = HealthServer(service, settings.health_host, settings.health_port)
        health.add_route("/metrics", metrics.route)
        try:
            health.start()
        except OSError as exc:
            log.critical("cannot serve health endpoints on %s:%d: %s", settings.health_host, settings.health_port, exc)
            metrics.disconnect()
            service.stop()
            return EXIT_CONFIG

    chores: list = []  # background threads (presence, lost-line recovery), once the worker consumes
    hostname = settings.hostname or f"batchery-{os.getpid()}@{socket.gethostname()}"
    if is_redis_url(settings.broker_url) and settings.orphan_grace > 0:
        kombu_patches.record_holders(hostname)  # who holds each message, for the others if this worker dies
    queues = [settings.queue]
    affinity = _affinity(app, settings, hostname)
    if affinity is not None:
        app.batchery_affinity = affinity
        queues.append(affinity.direct)

    def on_ready(sender=None, **kwargs) -> None:
        if health is not None:
            health.consuming = True
        chores.extend(start_background(settings, hostname, affinity, app, EngineSnapshot(service)))
        log.info(
            "batchery worker ready: model=%s dtype=%s kv_blocks=%d max_model_len=%d queue=%s threads=%d",
            settings.model,
            service.dtype,
            service.num_kv_blocks,
            service.max_model_len,
            settings.queue,
            settings.num_task_threads,
        )

    def on_shutting_down(sig=None, how=None, exitcode=None, **kwargs) -> None:
        # Called in the main thread's signal handler: flag only, no blocking work.
        if health is not None:
            health.consuming = False
        service.begin_drain(settings.shutdown_grace)
        for chore in chores:
            chore.stop()

    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutting_down, weak=False)
    worker = app.Worker(
        hostname=hostname,
        queues=queues,
        pool="threads",
        concurrency=settings.num_task_threads,
        loglevel=settings.log_level.upper(),
        without_mingle=True,
        without_gossip=True,
        without_heartbeat=not settings.send_events,  # Flower needs heartbeats to show the worker
        quiet=True,
    )
    try:
        worker.start()
        exitcode = worker.exitcode or EXIT_OK
    finally:
        signals.worker_ready.disconnect(on_ready)
        signals.worker_shutting_down.disconnect(on_shutting_down)
        metrics.disconnect()
        service.stop()
        if health is not None:
            health.stop()
        for chore in chores:
            chore.stop()
        until = time.monotonic() + 2.0  # the presence withdrawal, the recovery lock's release: 2 s in all
        for chore in chores:
            chore.join(max(0.0, until - time.monotonic()))
        if affinity is not None:  # the chore retired it; once more for a message that landed since (cheap)
            try:
                affinity.retire()
            except Exception as exc:  # noqa: BLE001 - another worker's chore moves them once this one is gone
                log.warning("could not move this worker's direct queue back to %s: %s", settings.queue, exc)
    if fatal.is_set() or service.fatal:
        log.critical("worker exiting with code %d: %s", EXIT_ENGINE_DEAD, service.fatal_reason)
        return EXIT_ENGINE_DEAD
    log.info("worker stopped (exit %d)", exitcode)
    return int(exitcode)


def _affinity(app, settings: Settings, hostname: str):
    """The worker's ``batchery.broker.affinity.Affinity`` (None: off, or a broker other than Redis)."""
    from batchery.broker.affinity import Affinity
    from batchery.broker.connection import is_redis_url, redis_from_url

    if not settings.prefix_affinity or not is_redis_url(settings.broker_url):
        return None
    # at most a prefetch's worth of forwarded lines waits for the owner; past that a line runs where it lands
    return Affinity(redis_from_url(settings.broker_url), app, str(settings.queue), hostname, settings.num_task_threads)


if __name__ == "__main__":
    sys.exit(run_worker())
