"""Helpers for the tests of ``batchery serve`` (``batchery.api``): settings pointed at the test
session's broker, the real ASGI app under uvicorn on a real socket in a background thread, and
``batchery serve`` as a subprocess (for the tests that kill and restart the API process).

    from api_util import api_settings, running_api, openai_client

    def test_x(tiny_worker, redis_urls, tmp_path):
        settings = api_settings(redis_urls, tmp_path, queue=tiny_worker.queue, keys="k1,k2")
        with running_api(settings) as base_url:
            client = openai_client(base_url, "k1")
            client.models.list()

Each settings object gets its own ``api.key_prefix`` (so tests never see each other's files or
batches) and a ``storage_dir`` under ``tmp_path``; ``drop_api_keys`` deletes a prefix's keys."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SERVER_START_S = 30.0


def _unique_prefix() -> str:
    return f"batchery:test-api:{uuid.uuid4().hex[:10]}"


def api_settings(
    redis_urls: tuple[str, str],
    tmp_path: Path,
    *,
    queue: str | None = None,
    keys: str | None = None,
    model: str | None = None,
    **api: Any,
):
    """``Settings`` for an API server on the test broker (``redis_urls``: the ``redis_urls`` fixture),
    sending to ``queue`` (the ``tiny_worker``'s, usually), with ``keys`` (comma-separated; None: no
    auth), a unique key prefix and ``storage_dir`` under ``tmp_path``. ``api`` overrides other
    ``BATCHERY_API__*`` fields (``max_body_bytes``, ``request_timeout``, ...)."""
    from batchery.contract.settings import Settings

    broker, backend = redis_urls
    storage = tmp_path / f"files-{uuid.uuid4().hex[:6]}"
    fields: dict[str, Any] = {"key_prefix": _unique_prefix(), "storage_dir": str(storage), **api}
    if keys is not None:
        fields["keys"] = keys
    extra: dict[str, Any] = {"queue": queue} if queue else {}
    if model:
        extra["model"] = model
    return Settings(
        broker_url=broker,
        result_backend=backend,
        result_expires=600,
        max_task_timeout=60,
        task_timeout=60,
        retry_backoff_max=2,
        visibility_timeout=300,
        api=fields,
        **extra,
    )


def drop_api_keys(redis_url: str, prefix: str) -> None:
    """Delete every Redis key under ``prefix`` (one test's files and batches)."""
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


def _wait_healthy(base_url: str, timeout: float, alive: Callable[[], bool], what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise AssertionError(f"the API server exited before it answered /healthz:\n{what()}")
        try:
            with urllib.request.urlopen(base_url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.05)
    raise AssertionError(f"the API server did not answer /healthz within {timeout:g} s ({last}):\n{what()}")


class ThreadServer:
    """``create_app(settings)`` under uvicorn on 127.0.0.1 (a free port, bound before uvicorn starts,
    so no other process can take it in between), in a daemon thread. ``stop()`` sets uvicorn's
    ``should_exit`` and joins the thread (the app's shutdown closes what it built)."""

    def __init__(self, settings, log_level: str = "warning") -> None:
        import uvicorn

        from batchery.api.app import create_app

        self.settings = settings
        self.app = create_app(settings)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"api-server-{self.port}", daemon=True)

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as exc:  # noqa: BLE001 - reported by start()/stop()
            self._error = exc

    def start(self) -> ThreadServer:
        self._thread.start()
        _wait_healthy(
            self.base_url, SERVER_START_S, self._thread.is_alive, lambda: f"uvicorn thread failed: {self._error!r}"
        )
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self._sock.close()
        if self._thread.is_alive():
            raise AssertionError(f"the API server thread on port {self.port} did not stop within 15 s")


def api_server(settings) -> tuple[str, Callable[[], None]]:
    """Start ``create_app(settings)`` on a free port; returns ``(base_url, stop)``. The base URL has
    no ``/v1`` (``openai_client`` adds it)."""
    s = ThreadServer(settings).start()
    return s.base_url, s.stop


@contextmanager
def running_api(settings, *, drop_keys: bool = True) -> Iterator[str]:
    """``api_server`` as a context manager: yields the base URL; stops the server and (``drop_keys``)
    deletes the settings' API keys from Redis afterwards."""
    base_url, stop = api_server(settings)
    try:
        yield base_url
    finally:
        stop()
        if drop_keys:
            drop_api_keys(settings.result_backend, settings.api.key_prefix)


def openai_client(base_url: str, api_key: str | None = "unused", **kwargs: Any):
    """The official SDK pointed at a running server (``base_url`` without ``/v1``); no retries by
    default, so a test sees the first answer."""
    import openai

    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("timeout", 120.0)
    return openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "unused", **kwargs)


def testclient_openai(settings, api_key: str | None = "unused"):
    """The SDK on the ASGI app in-process (``fastapi.testclient``: no socket), for tests that need no
    server process: ``(client, testclient)``; close the testclient when done."""
    import openai
    from fastapi.testclient import TestClient

    from batchery.api.app import create_app

    tc = TestClient(create_app(settings), base_url="http://testserver")
    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key or "unused", http_client=tc), tc


# -- batchery serve as a process -----------------------------------------------------------------------------
def serve_env(settings, **overrides: str) -> dict[str, str]:
    """The environment of a ``batchery serve`` process with these ``settings``: the BATCHERY_* variables
    of the broker, the queue and the API (keys included), nothing else of this process's BATCHERY_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}
    a = settings.api
    env.update(
        {
            "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
            "BATCHERY_BROKER_URL": settings.broker_url,
            "BATCHERY_RESULT_BACKEND": settings.result_backend,
            "BATCHERY_QUEUE": str(settings.queue),
            "BATCHERY_MODEL": settings.model,
            "BATCHERY_RESULT_EXPIRES": str(settings.result_expires),
            "BATCHERY_MAX_TASK_TIMEOUT": str(settings.max_task_timeout),
            "BATCHERY_TASK_TIMEOUT": str(settings.task_timeout),
            "BATCHERY_RETRY_BACKOFF_MAX": str(settings.retry_backoff_max),
            "BATCHERY_VISIBILITY_TIMEOUT": str(settings.visibility_timeout),
            "BATCHERY_API__KEY_PREFIX": a.key_prefix,
            "BATCHERY_API__STORAGE_DIR": a.storage_dir,
            "BATCHERY_API__REQUEST_TIMEOUT": str(a.request_timeout),
            "BATCHERY_API__MAX_BODY_BYTES": str(a.max_body_bytes),
            "BATCHERY_API__MAX_FILE_BYTES": str(a.max_file_bytes),
        }
    )
    if a.keys is not None:
        env["BATCHERY_API__KEYS"] = a.keys.get_secret_value()
    env.update(overrides)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``python -m batchery serve --host 127.0.0.1 --port P`` with ``env`` (``serve_env``), its
    output in ``log_path``. ``start()`` waits for /healthz; ``kill()`` is SIGKILL (a crash),
    ``terminate()`` SIGTERM (a clean stop); both may be followed by another ``start()`` (a restart,
    on the same port)."""

    def __init__(self, env: dict[str, str], log_path: Path, *, host: str = "127.0.0.1", port: int | None = None):
        self.env = env
        self.log_path = log_path
        self.host = host
        self.port = port or _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "batchery", "serve", "--host", self.host, "--port", str(self.port)]

    def start(self, timeout: float = SERVER_START_S, wait: bool = True) -> ServeProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv(), cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if wait:
            _wait_healthy(self.base_url, timeout, lambda: self.proc.poll() is None, self.log)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_log(self, pattern: str, timeout: float = 30.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.log())
            if m is not None:
                return m
            if self.proc is not None and self.proc.poll() is not None:
                rc = self.proc.returncode
                raise AssertionError(f"batchery serve exited ({rc}) before {pattern!r}:\n{self.log()}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {pattern!r} in the serve log within {timeout:g} s:\n{self.log()}")
            time.sleep(0.05)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"batchery serve did not exit within {timeout:g} s:\n{self.log()}") from None

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
