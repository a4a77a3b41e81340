"""A paused Redis (SIGSTOP: the TCP connection stays up, nothing answers) blocks no waiter beyond its own
time (issue 13, item 6): ``batchery batch wait --timeout 5`` returns in about 5 s with a clear message and exit
124, and a batch line's cancel poll (``JobWatch.stopped``) answers at once from its cache, so a request's
deadline is enforced on time."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, free_port, wait_for

from batchery.broker.connection import redis_from_url
from batchery.jobs.store import JobStore
from batchery.jobs.watch import JobWatch

pytestmark = [
    pytest.mark.integration,  # a private redis-server, paused
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]

PREFIX = "batchery:test-pause"


@pytest.fixture()
def private_redis():
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
        return bool(redis_from_url(url, retry=None).ping())
    except Exception:  # noqa: BLE001
        return False


def running_job(store: JobStore) -> str:
    job = "batch_pause_" + os.urandom(4).hex()
    store.create(job, queue="batchery.pause-test", model=None)
    assert store.end_submit(job, total=3, max_line=3) == "in_progress"
    return job


def test_batch_wait_timeout_returns_on_time_while_redis_is_paused(private_redis):
    proc, url = private_redis
    r = redis_from_url(url)
    job = running_job(JobStore(r, PREFIX, ttl=600))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
    env.update(BATCHERY_BROKER_URL=url, BATCHERY_BATCH__KEY_PREFIX=PREFIX, PYTHONPATH=str(REPO))
    t_start = time.monotonic()
    cli = subprocess.Popen(
        [sys.executable, "-m", "batchery", "batch", "wait", job, "--timeout", "5", "--no-progress"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the command is polling the job (its connection shows) before Redis stops answering
        wait_for(lambda: int(r.info("clients")["connected_clients"]) >= 2, 30, what="batch wait to connect")
        t_pause = time.monotonic()
        os.kill(proc.pid, signal.SIGSTOP)
        out, err = cli.communicate(timeout=90)
        t_end = time.monotonic()
    finally:
        if cli.poll() is None:
            cli.kill()
    print(f"\n[{t_end - t_pause:.1f} s after the pause, {t_end - t_start:.1f} s in all] {err}")
    assert cli.returncode == 124, (cli.returncode, out, err)
    # --timeout 5 counts from the command's start; the pause began after its first poll
    assert t_end - t_pause < 5 + 2.5, f"batch wait --timeout 5 took {t_end - t_pause:.1f} s after the pause: {err}"
    assert t_end - t_start < 5 + 10, f"batch wait --timeout 5 took {t_end - t_start:.1f} s in all: {err}"
    assert "Redis" in err and "did not answer" in err and job in err, err
    assert "Traceback" not in err, err


def test_the_cancel_poll_never_blocks_on_a_paused_redis(private_redis):
    proc, url = private_redis
    store = JobStore(redis_from_url(url), PREFIX, ttl=600)
    job = running_job(store)
    watch = JobWatch(store, interval=0.1)
    try:
        assert wait_for(lambda: watch.stopped(job) is False and watch.known(job), 10, what="a first answer")
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.3)  # the cache is stale now: a refresh is due (and blocks, on its own thread)
        slowest = 0.0
        for _ in range(20):  # 2 s of 0.1 s polls, as a batch line's task thread makes them
            t0 = time.monotonic()
            assert watch.stopped(job) is False  # the last known answer: running
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.1)
        assert slowest < 0.05, f"JobWatch.stopped blocked {slowest:.2f} s on a paused Redis"
        os.kill(proc.pid, signal.SIGCONT)
        # once Redis answers again, a cancel is seen
        assert store.cancel(job) == "cancelled"
        wait_for(lambda: watch.stopped(job), 60, what="the cancel to be seen after the pause")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        watch.close()


def test_a_gone_job_stops_its_lines_and_an_unknown_one_does_not(private_redis):
    _proc, url = private_redis
    store = JobStore(redis_from_url(url), PREFIX, ttl=600)
    job = running_job(store)
    watch = JobWatch(store, interval=0.05)
    try:
        wait_for(lambda: watch.stopped(job) is False and watch.known(job), 10, what="a first answer")
        store.delete(job)
        wait_for(lambda: watch.stopped(job), 10, what="a deleted job to stop its lines")
        # many threads asking at once cost one refresh per interval, not one read each
        threads = [threading.Thread(target=watch.stopped, args=(job,)) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads)
    finally:
        watch.close()


def test_a_wait_that_runs_out_on_a_healthy_redis_says_the_job_is_still_running():
    """The wait's own deadline, with Redis answering all along, is "still in_progress after 1 s", never "Redis did
    not answer" (the status call made right at the deadline used to get no time, and was blamed on Redis)."""
    import uuid

    from conftest import TEST_BROKER_URL

    from batchery.client import Client
    from batchery.contract.errors import ResultTimeout
    from batchery.contract.settings import Settings

    prefix = f"batchery-test-wait-{uuid.uuid4().hex[:8]}"
    c = Client(
        settings=Settings(
            broker_url=TEST_BROKER_URL, result_backend=TEST_BROKER_URL, queue=prefix, batch={"key_prefix": prefix}
        )
    )
    job = f"batch_{uuid.uuid4().hex}"
    try:
        c.jobs.create(job, queue=prefix, model=None)
        c.jobs.r.hset(c.jobs.key(job), "total", 1)
        c.jobs.end_submit(job, 1, 1)
        for _ in range(3):
            with pytest.raises(ResultTimeout) as err:
                c.wait_batch(job, timeout=1.0, poll_interval=0.5, recover_after=None)
            assert f"batch job {job} is still in_progress after 1 s (0/1 done)" in str(err.value), str(err.value)
    finally:
        c.jobs.delete(job)
        c.close()
