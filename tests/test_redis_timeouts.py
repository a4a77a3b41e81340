"""Our own Redis clients never block forever (issue 13, item 6): a Redis that is paused (SIGSTOP:
the TCP connection stays up, nothing answers) makes a command fail within a bounded time, instead
of holding a task thread, a cancel poll or ``batchery batch wait --timeout`` indefinitely. (redis-py 8
has 5 s socket timeouts by default; ``redis>=5`` allows versions without, so ``redis_from_url`` sets
them itself.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
from conftest import free_port, wait_for

from batchery.broker.connection import REDIS_SOCKET_TIMEOUT_S, redis_from_url
from batchery.jobs.store import JobNotFound, JobStore

pytestmark = [
    pytest.mark.integration,  # a private redis-server, paused
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]


@pytest.fixture()
def paused_redis():
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    wait_for(lambda: _answers(url), 15, what="the private redis-server")
    yield proc, url
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return bool(redis_from_url(url).ping())
    except Exception:  # noqa: BLE001
        return False


def test_a_paused_redis_fails_a_job_store_call_in_bounded_time(paused_redis):
    proc, url = paused_redis
    store = JobStore(redis_from_url(url), "batchery:test-timeouts", ttl=60)
    with pytest.raises(JobNotFound):
        store.status("batch_nothing")  # connected and answering
    os.kill(proc.pid, signal.SIGSTOP)
    outcome: list[object] = []

    def call() -> None:
        t0 = time.monotonic()
        try:
            store.status("batch_nothing")
            outcome.append("answered")
        except Exception as exc:  # noqa: BLE001
            outcome.append((type(exc).__name__, time.monotonic() - t0))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    # every try waits at most the socket timeout; the retries add about 3 s of backoff
    bound = 7 * REDIS_SOCKET_TIMEOUT_S + 10
    t.join(bound)
    assert not t.is_alive(), f"a job-store call on a paused Redis still blocks after {bound:g} s"
    assert outcome and outcome[0][0] in ("TimeoutError", "ConnectionError"), outcome
