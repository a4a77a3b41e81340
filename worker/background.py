"""The worker's background chores, each a daemon thread started once the worker consumes and stopped when it
stops: its presence announcement (``batchery.broker.presence``), lost-line recovery
(``batchery.jobs.recover.recover_queue``), the sweep for dead workers' messages (``batchery.broker.orphans``), big
jobs' feeders (``batchery.jobs.feeder``) and prefix affinity's registry and clean-up (``batchery.broker.affinity``).
None ever stops the worker: a failure is logged once when it starts and once when it ends (a Redis outage is quiet
beyond that), and the chore goes on."""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from batchery.broker import presence
from batchery.broker.connection import is_redis_url, redis_from_url
from batchery.contract.settings import Settings

log = logging.getLogger("batchery.worker.background")

FEEDERS_EVERY_S = 1.0  # how often a worker looks for big jobs that need a feeder


class Periodic:
    """``tick()`` every ``interval`` seconds (times ``jitter``) on a daemon thread; ``last()`` once on stop."""

    def __init__(
        self,
        name: str,
        interval: float,
        tick: Callable[[], object],
        last: Callable[[], object] | None = None,
        jitter: float = 0.0,
    ) -> None:
        self.name = name
        self.interval = interval
        self.jitter = jitter
        self._tick = tick
        self._last = last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"batchery-{name}", daemon=True)
        self._failing = False

    def start(self) -> Periodic:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to stop (never blocks: safe in a signal handler)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        delay = 0.0  # the first tick at once
        while not self._stop.wait(delay):
            self._guarded(self._tick)
            delay = self.interval * random.uniform(1 - self.jitter, 1 + self.jitter)
        if self._last is not None:
            self._guarded(self._last)

    def _guarded(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a chore must never take the worker down
            if not self._failing:
                name, why = self.name, f"{type(exc).__name__}: {exc}"
                log.warning("%s failed (%s); trying again every %.0f s", name, why, self.interval)
                self._failing = True
            return
        if self._failing:
            log.warning("%s works again", self.name)
            self._failing = False


class EngineSnapshot:
    """What a worker's announcement says of its engine, taken at each announcement (the web console's workers page
    shows it): the engine's state, its batch size and steps/s since the previous announcement, KV blocks in use,
    restarts and the last failure. ``service``: the worker's ``EngineService`` (anything with ``stats()``,
    ``health()`` and ``counters``)."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self._last: tuple[float, int, int] | None = None  # (monotonic time, num_steps, num_step_seqs)

    def __call__(self) -> dict[str, Any]:
        st = self.service.stats()
        engine = st.get("engine") or {}
        now, steps, seqs = time.monotonic(), int(st["num_steps"]), int(st["num_step_seqs"])
        prev, self._last = self._last, (now, steps, seqs)
        dt = now - prev[0] if prev else 0.0
        d_steps = steps - prev[1] if prev else 0
        total, free = int(engine.get("kv_blocks_total") or 0), int(engine.get("kv_blocks_free") or 0)
        return {
            "state": st["state"],
            "num_pending": st["num_pending"],
            "num_running": int(engine.get("num_running") or 0),
            "batch_size": (seqs - prev[2]) / d_steps if prev and d_steps > 0 else 0.0,
            "steps_per_s": d_steps / dt if dt > 0 else 0.0,
            "kv_blocks_total": total,
            "kv_blocks_used": max(total - free, 0),
            "num_rebuilds": st["num_rebuilds"],
            "num_failures": st["num_failures"],
            "last_error": self.service.health().get("fatal_reason") or self.service.counters.last_failure or None,
            "announced_at": time.time(),
        }


def presence_beacon(
    settings: Settings,
    hostname: str,
    direct_queue: str | None = None,
    live: Callable[[], dict[str, Any]] | None = None,
) -> Periodic:
    """Announce ``hostname`` on the worker's queue every few seconds, with ``live()``'s fields of the moment
    (``EngineSnapshot``); withdraw it on stop."""
    r = redis_from_url(settings.broker_url)
    queue = str(settings.queue)  # derived by Settings
    info = {
        "model": settings.model,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": time.time(),
        "concurrency": settings.num_task_threads,  # what big jobs' windows are sized from
    }
    if direct_queue:
        info["direct_queue"] = direct_queue

    def tick() -> None:
        try:
            now = live() if live is not None else {}
        except Exception:  # noqa: BLE001 - the announcement matters more than its engine figures
            log.debug("the engine snapshot failed", exc_info=True)
            now = {}
        presence.announce(r, queue, hostname, {**info, **now})

    return Periodic(
        "presence",
        presence.ANNOUNCE_EVERY_S,
        tick,
        lambda: presence.withdraw(r, queue, hostname),
    )


def lost_line_recovery(settings: Settings) -> Periodic:
    """Every ``BATCHERY_RECOVERY_INTERVAL`` seconds, if this worker holds its queue's recovery lock, queue again the
    lost lines of the queue's jobs quiet for that long. The lock is held while the holder goes on (it outlives a
    few intervals) and released on stop, so another worker takes over at once."""
    from batchery.jobs.recover import RecoveryLock, recover_queue
    from batchery.jobs.store import JobStore

    interval = settings.recovery_interval
    queue = str(settings.queue)  # derived by Settings, as the result backend is
    broker = redis_from_url(settings.broker_url)
    store = JobStore(
        redis_from_url(str(settings.result_backend)),
        settings.batch.key_prefix,
        settings.batch.ttl,
        settings.batch.drain_at,
    )
    lock = RecoveryLock(broker, queue, ttl_s=max(3 * interval, 30.0))
    return Periodic(
        "lost-line recovery",
        interval,
        lambda: recover_queue(store, broker, queue, lock, quiet_s=interval),
        lock.release,
        jitter=0.2,
    )


def orphan_sweeper(settings: Settings, hostname: str) -> Periodic:
    """Every few seconds: give the messages of the worker's queue held by workers gone from presence back to the
    queue, once delivered ``BATCHERY_ORPHAN_GRACE`` seconds ago (``batchery.broker.orphans``)."""
    from batchery.broker import orphans

    grace = settings.orphan_grace
    sweeper = orphans.Orphans(
        redis_from_url(settings.broker_url),
        str(settings.queue),
        hostname,
        confirm_s=min(orphans.CONFIRM_S, grace / 2),
        grace_s=grace,
    )
    return Periodic("orphan sweeper", min(orphans.SWEEP_EVERY_S, grace / 4), sweeper.sweep, jitter=0.2)


def big_job_feeders(settings: Settings, app) -> Periodic:
    """Every second: feed on the big jobs of the worker's queue whose submitter handed them off or died
    (``batchery.jobs.feeder``)."""
    from batchery.jobs.feeder import Feeders
    from batchery.jobs.store import JobStore

    broker = redis_from_url(settings.broker_url)
    store = JobStore(
        redis_from_url(str(settings.result_backend)),
        settings.batch.key_prefix,
        settings.batch.ttl,
        settings.batch.drain_at,
    )
    feeders = Feeders(store, broker, app, settings)
    return Periodic("big-job feeders", FEEDERS_EVERY_S, feeders.tick, jitter=0.2)


def record_drainers(settings: Settings) -> Periodic:
    """Every second: move the records of the running jobs of the worker's queue that hold
    ``BATCHERY_BATCH__DRAIN_AT`` records in Redis to the file store (``batchery.jobs.records``)."""
    from batchery.jobs.records import Drainers
    from batchery.jobs.store import JobStore

    b = settings.batch
    store = JobStore(redis_from_url(str(settings.result_backend)), b.key_prefix, b.ttl, b.drain_at)
    drainers = Drainers(store, settings)
    return Periodic("record drainers", FEEDERS_EVERY_S, drainers.tick, jitter=0.2)


def prefix_affinity(affinity) -> Periodic:
    """Every few seconds: register the worker's direct queue, see who is live on the queue, and move the direct
    queues of workers gone back to the main queue (``batchery.broker.affinity``); on stop, this worker's own."""
    return Periodic("prefix affinity", presence.ANNOUNCE_EVERY_S, affinity.refresh, affinity.retire, jitter=0.2)


def start_background(settings: Settings, hostname: str, affinity=None, app=None, live=None) -> list[Periodic]:
    """The chores of a worker that now consumes (none on a broker other than Redis); ``affinity``: its
    ``batchery.broker.affinity.Affinity``, if it has one; ``app``: its Celery app (big jobs' feeders build messages
    with it); ``live``: what its announcements add of the engine (``EngineSnapshot``)."""
    if not is_redis_url(settings.broker_url):
        return []
    direct = affinity.direct if affinity is not None else None
    makers: list[Callable[[], Periodic]] = [lambda: presence_beacon(settings, hostname, direct, live)]
    if app is not None:
        makers.append(lambda: big_job_feeders(settings, app))
    if settings.batch.drain_at > 0:
        makers.append(lambda: record_drainers(settings))
    if affinity is not None:
        makers.append(lambda: prefix_affinity(affinity))
    if settings.recovery_interval > 0:
        makers.append(lambda: lost_line_recovery(settings))
    if settings.orphan_grace > 0:
        makers.append(lambda: orphan_sweeper(settings, hostname))
    chores = []
    for make in makers:
        try:
            chores.append(make().start())
        except Exception:  # noqa: BLE001 - a chore that cannot start must not stop the worker
            log.exception("a background chore could not start")
    return chores
