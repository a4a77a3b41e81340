"""Shared fixtures: the tiny local model, Redis URLs for tests, and real worker processes.

Tests use their own Redis databases (broker db 13, results db 14 unless BATCHERY_TEST_BROKER_URL /
BATCHERY_TEST_RESULT_BACKEND say otherwise) and unique queue names, and delete only keys they
created. Worker processes are spawned as ``python -m batchery worker`` with BATCHERY_* variables;
waits are on conditions with timeouts, never blind sleeps."""

from __future__ import annotations

import os

import torch

# Without CUDA, Triton kernels run under the interpreter, which must be chosen before anything
# imports triton (transformers' model modules do), so it is set here, before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
TEST_BROKER_URL = os.environ.get("BATCHERY_TEST_BROKER_URL", "redis://127.0.0.1:6379/13")
TEST_RESULT_BACKEND = os.environ.get("BATCHERY_TEST_RESULT_BACKEND", "redis://127.0.0.1:6379/14")
# The job store's and Lua scripts' tests (no worker): Redis DB 15, under per-test key prefixes.
RELIABILITY_URL = os.environ.get("BATCHERY_TEST_RELIABILITY_URL", "redis://127.0.0.1:6379/15")


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` passes (fails)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_client(url: str):
    import redis

    return redis.Redis.from_url(url)


def drop_queue_keys(r, queue: str) -> None:
    """Delete a test queue's keys: the queue itself and kombu's binding set for it."""
    keys = list(r.scan_iter(match=f"{queue}*")) + list(r.scan_iter(match=f"_kombu.binding*{queue}"))
    if keys:
        r.delete(*keys)


WORKER_FIXTURES = frozenset({"session_workers", "workers", "tiny_worker", "tiny_client"})


def pytest_collection_modifyitems(config, items):
    """A test that uses a real worker process is an integration test (``make test-fast`` skips those),
    whichever module it is in; modules that start other processes mark themselves."""
    for item in items:
        if WORKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama (2 layers, word-level tokenizer, chat template) on disk."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def redis_urls() -> tuple[str, str]:
    for url in (TEST_BROKER_URL, TEST_RESULT_BACKEND):
        try:
            redis_client(url).ping()
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"Redis at {url} does not answer ({exc}); start it with `make redis`")
    return TEST_BROKER_URL, TEST_RESULT_BACKEND


class WorkerProcess:
    """A real ``batchery worker`` subprocess with its log in a file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.queue = env["BATCHERY_QUEUE"]
        self.health_port = int(env["BATCHERY_HEALTH_PORT"])
        self.proc: subprocess.Popen | None = None

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchery", "worker"],
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.log()))

    def wait_for_log(self, pattern: str, timeout: float = 30.0) -> re.Match:
        def found():
            m = re.search(pattern, self.log())
            if m is None and self.proc.poll() is not None:
                raise AssertionError(
                    f"worker exited ({self.proc.returncode}) before logging {pattern!r}:\n" + self.tail()
                )
            return m

        try:
            return wait_for(found, timeout, what=f"log line {pattern!r}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- worker log tail ---\n{self.tail()}") from None

    def wait_ready(self, timeout: float = 90.0) -> WorkerProcess:
        self.wait_for_log(r"batchery worker ready", timeout)
        return self

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def http(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}{path}", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def stats(self) -> dict:
        return self.http("/stats")[1]

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (warm shutdown) and wait for the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {self.pid} did not exit within {timeout:g} s:\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()


class WorkerFactory:
    """Spawns workers on the tiny model with test settings; cleans up processes and queue keys."""

    def __init__(self, model_dir: Path, broker: str, backend: str, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.broker = broker
        self.backend = backend
        self.log_dir = log_dir
        self.workers: list[WorkerProcess] = []
        self.queues: set[str] = set()

    def new_queue(self) -> str:
        q = f"batchery-test-{uuid.uuid4().hex[:10]}"
        self.queues.add(q)
        return q

    def env(self, queue: str, **overrides) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
        env.update(
            {
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "BATCHERY_BROKER_URL": self.broker,
                "BATCHERY_RESULT_BACKEND": self.backend,
                "BATCHERY_MODEL": str(self.model_dir),
                "BATCHERY_DTYPE": "float32",
                "BATCHERY_QUEUE": queue,
                "BATCHERY_HEALTH_HOST": "127.0.0.1",
                "BATCHERY_HEALTH_PORT": str(free_port()),
                "BATCHERY_MAX_NUM_SEQS": "64",
                "BATCHERY_ENGINE__NUM_KV_BLOCKS": "2048",
                "BATCHERY_ENGINE__MAX_MODEL_LEN": "8192",
                "BATCHERY_ENGINE__MAX_NUM_BATCHED_TOKENS": "2048",
                "BATCHERY_TASK_TIMEOUT": "60",
                "BATCHERY_MAX_TASK_TIMEOUT": "60",
                "BATCHERY_RETRY_BACKOFF": "0.2",
                "BATCHERY_RETRY_BACKOFF_MAX": "2",
                "BATCHERY_VISIBILITY_TIMEOUT": "300",
                "BATCHERY_RESULT_EXPIRES": "600",
                "BATCHERY_SHUTDOWN_GRACE": "5",
                "BATCHERY_WATCHDOG_TIMEOUT": "30",
            }
        )
        env.update({k: str(v) for k, v in overrides.items()})
        return env

    def spawn(self, queue: str | None = None, *, ready: bool = True, **overrides) -> WorkerProcess:
        queue = queue or self.new_queue()
        self.queues.add(queue)
        log_path = self.log_dir / f"worker-{len(self.workers)}-{queue}.log"
        w = WorkerProcess(self.env(queue, **overrides), log_path).start()
        self.workers.append(w)
        return w.wait_ready() if ready else w

    def client(self, queue: str):
        from batchery.client import Client
        from batchery.contract.settings import Settings

        return Client(
            settings=Settings(
                broker_url=self.broker,
                result_backend=self.backend,
                queue=queue,
                result_expires=600,
                max_task_timeout=60,
                task_timeout=60,
                retry_backoff_max=2,
                visibility_timeout=300,
            )
        )

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        r = redis_client(self.broker)
        for q in self.queues:
            drop_queue_keys(r, q)


@pytest.fixture()
def r():
    """A Redis client on ``RELIABILITY_URL``; the test is skipped where no Redis answers there."""
    import redis

    client = redis.Redis.from_url(RELIABILITY_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {RELIABILITY_URL}: {exc}")
    yield client
    client.close()


_kernels_checked = False


def build_kernels_once() -> None:
    """Build the CPU kernels here, once, before the first worker starts: on a cold cache the build takes minutes,
    which would otherwise be spent inside a worker's start-up timeout (and a worker killed mid-build used to leave
    a lock that hung every later one)."""
    global _kernels_checked
    if not _kernels_checked:
        _kernels_checked = True
        from batchery.engine import cpu_kernels

        cpu_kernels.load()


@pytest.fixture(scope="session")
def session_workers(tiny_model_dir, redis_urls, tmp_path_factory):
    build_kernels_once()
    f = WorkerFactory(tiny_model_dir, *redis_urls, tmp_path_factory.mktemp("worker-logs"))
    yield f
    f.close()


@pytest.fixture()
def workers(tiny_model_dir, redis_urls, tmp_path):
    """Dedicated workers for one test (fault injection, shutdown); killed afterwards."""
    build_kernels_once()
    f = WorkerFactory(tiny_model_dir, *redis_urls, tmp_path)
    yield f
    f.close()


@pytest.fixture(scope="session")
def tiny_worker(session_workers) -> WorkerProcess:
    """One healthy worker on the tiny model, shared by the tests that do not break it."""
    return session_workers.spawn()


@pytest.fixture(scope="session")
def tiny_client(session_workers, tiny_worker):
    c = session_workers.client(tiny_worker.queue)
    yield c
    c.close()
