"""``batchery serve [--host H] [--port P]``: OpenAI's HTTP API (``create_app``) under uvicorn.

- Where: ``--host``/``--port``, else ``BATCHERY_API__HOST`` (127.0.0.1) and ``BATCHERY_API__PORT`` (8000).
- Keys: with ``BATCHERY_API__KEYS`` set every request needs one of them (Bearer) and the start-up line
  says how many there are (never what they are). With none, there is no authentication, so the server
  refuses any address but a loopback one, and says at start-up that it is unauthenticated and local.
- The broker: as ``batchery run`` decides it. With ``BATCHERY_BROKER_URL`` in the environment the server
  is one more client of that cluster (as many replicas as wanted: they share nothing but Redis and the
  file storage). Without it, it starts the embedded stack (``batchery.embedded``: a private Redis and
  one worker for ``BATCHERY_MODEL``) and tears it down on exit; files then live under the stack's
  directory too (unless ``BATCHERY_API__STORAGE_DIR`` is set), as nothing outlives that Redis. An embedded
  worker that exits after it was serving is started again (at most ``MAX_WORKER_RESTARTS`` an hour);
  one that never became ready, or a Redis that died, stops the server with the log's tail.
- Stopping: SIGINT or SIGTERM (or SIGHUP): uvicorn stops taking connections and gives the open ones
  ``GRACEFUL_SHUTDOWN_S``; then the embedded stack, if any, stops (worker, then Redis). Exit 0. A
  second Ctrl-C during the teardown is ignored, so no child is orphaned.

Exit codes: 0 stopped by a signal; 1 the server or the embedded stack failed; 2 bad settings, a host that
needs keys, or a missing install (``pip install 'batchery[serve]'``; an embedded worker also needs
``pip install 'batchery[worker]'``)."""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

SERVE_INSTALL = "pip install 'batchery[serve]'"
SERVE_PACKAGES = ("fastapi", "uvicorn", "python_multipart", "jinja2")
MAX_WORKER_RESTARTS = 3  # embedded worker restarts allowed within RESTART_WINDOW_S
RESTART_WINDOW_S = 3600.0
GRACEFUL_SHUTDOWN_S = 10.0  # open connections get this long after SIGTERM (a sync request may be waiting)
WATCH_INTERVAL_S = 1.0

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

log = logging.getLogger("batchery.api.serve")


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def missing_serve_packages() -> list[str]:
    """The serve install's packages this environment lacks (empty: ``batchery serve`` can run)."""
    missing = []
    for name in SERVE_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append("python-multipart" if name == "python_multipart" else name)
    return missing


def is_loopback(host: str) -> bool:
    """Whether ``host`` is only reachable from this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _say(message: str) -> None:
    print(f"batchery serve: {message}", file=sys.stderr, flush=True)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class StackWatch(threading.Thread):
    """Watches the embedded stack while the server runs: says when the worker is ready, restarts a
    worker that exited after it was ready, and stops the server (``error`` set) when the stack cannot
    go on."""

    def __init__(self, stack: Any, server: Any, model: str) -> None:
        super().__init__(name="embedded-stack-watch", daemon=True)
        self.stack = stack
        self.server = server
        self.model = model
        self.error: str | None = None
        self.stopping = threading.Event()
        self._restarts: deque[float] = deque()

    def run(self) -> None:
        from batchery.embedded import StackError, WorkerExited, exited, tail

        ready = False
        while not self.stopping.wait(WATCH_INTERVAL_S):
            if not ready and self.stack.worker_was_ready():
                ready = True
                log.info("the embedded worker is ready: serving %s", self.model)
            try:
                self.stack.check()
            except WorkerExited as exc:
                if self.stopping.is_set():
                    return
                if not exc.was_ready:
                    why = f"the embedded worker {exited(exc.returncode)} before it was ready"
                    self.error = f"{why}:\n{tail(self.stack.worker_log)}"
                    break
                now = time.monotonic()
                while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
                    self._restarts.popleft()
                if len(self._restarts) >= MAX_WORKER_RESTARTS:
                    self.error = (
                        f"the embedded worker {exited(exc.returncode)}, the {MAX_WORKER_RESTARTS + 1}th time within "
                        f"{RESTART_WINDOW_S / 60:.0f} minutes; giving up:\n{tail(self.stack.worker_log)}"
                    )
                    break
                self._restarts.append(now)
                restored = self.stack.restart_worker()
                ready = False
                log.warning(
                    "the embedded worker %s; restarted it (%d unfinished messages back on the queue)",
                    exited(exc.returncode),
                    restored,
                )
            except StackError as exc:
                if self.stopping.is_set():
                    return
                self.error = str(exc)
                break
        if self.error is not None:
            log.error("%s", self.error)
            self.server.should_exit = True


def serve(host: str | None = None, port: int | None = None) -> int:
    """The ``batchery serve`` command. Returns the exit code."""
    missing = missing_serve_packages()
    if missing:
        _say(
            f"needs the serve install ({', '.join(missing)} missing here): {SERVE_INSTALL}. "
            "The light install (pip install batchery) has the client and the batch CLI."
        )
        return EXIT_USAGE
    from pydantic import ValidationError

    from batchery.contract.installs import worker_install_hint
    from batchery.contract.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        _say(f"bad settings: {exc}")
        return EXIT_USAGE
    host = host if host is not None else settings.api.host
    port = port if port is not None else settings.api.port
    if not 0 <= port <= 65535:
        _say(f"--port must be 0 to 65535, got {port}")
        return EXIT_USAGE
    num_keys = len(settings.api.key_list())
    if num_keys == 0 and not is_loopback(host):
        _say(
            f"no API key is configured, so it listens on localhost only: set BATCHERY_API__KEYS to listen on {host} "
            "(comma-separated keys; clients send one as 'Authorization: Bearer <key>'), or use --host 127.0.0.1"
        )
        return EXIT_USAGE
    embedded = not os.environ.get("BATCHERY_BROKER_URL")
    if embedded:
        hint = worker_install_hint("batchery serve without BATCHERY_BROKER_URL (an embedded worker)")
        if hint is not None:
            _say(f"{hint} Or set BATCHERY_BROKER_URL to serve a cluster's workers.")
            return EXIT_USAGE
    _configure_logging(settings.log_level)

    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    stack = None
    workdir: str | None = None
    keep_workdir = False
    try:
        if embedded:
            from batchery.embedded import EmbeddedStack

            workdir = tempfile.mkdtemp(prefix="batchery-serve-")
            # the worker needs no API key: keep them out of its environment (and so of its logs)
            env = {
                k: v for k, v in os.environ.items() if k not in ("BATCHERY_API__KEYS", "BATCHERY_API__OPERATOR_KEYS")
            }
            stack = EmbeddedStack(Path(workdir), env=env)
            _say(f"no BATCHERY_BROKER_URL: starting an embedded Redis and a worker for {settings.model}")
            url = stack.start()
            settings = Settings(broker_url=url, result_backend=url, queue=None)
            if not os.environ.get("BATCHERY_API__STORAGE_DIR"):
                files = str(Path(workdir) / "files")
                settings = settings.model_copy(update={"api": settings.api.model_copy(update={"storage_dir": files})})
            _say(
                f"embedded Redis and a worker for {settings.model} (worker log {stack.worker_log}); the worker "
                "loads the model now, and files and batches last as long as this process"
            )
        code = _run_server(settings, host, port, num_keys, stack)
        if code != EXIT_OK and workdir is not None:
            keep_workdir = True
            _say(f"logs kept in {workdir}")
        return code
    except KeyboardInterrupt:
        return EXIT_OK
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind
        keep_workdir = True
        return exc.code if isinstance(exc.code, int) else EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - one clear line; the stack's logs stay for a look
        from batchery.embedded import StackError

        keep_workdir = True
        if not isinstance(exc, StackError):
            log.exception("batchery serve failed")
        _say(f"{exc}" + (f"\n(logs kept in {workdir})" if workdir else ""))
        return EXIT_FAILED
    finally:
        # Teardown must finish: a second Ctrl-C now would orphan the children.
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if stack is not None:
                stack.stop()
                _say("stopped the embedded worker and Redis")
            if workdir is not None and not keep_workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous_int)
            for s, h in old.items():
                signal.signal(s, h)


def _run_server(settings: Any, host: str, port: int, num_keys: int, stack: Any) -> int:
    import uvicorn

    from batchery.api.app import create_app

    app = create_app(settings)
    level = settings.log_level.lower()  # never "trace": uvicorn's trace level logs request headers (keys)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=level,
        lifespan="on",
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
        server_header=False,
    )
    server = uvicorn.Server(config)
    shown = f"[{host}]" if ":" in host else host
    if num_keys:
        auth = f"{num_keys} API key{'s' if num_keys != 1 else ''} configured (BATCHERY_API__KEYS)"
    else:
        auth = (
            f"no API key configured: unauthenticated, and local only (listening on {host}); "
            "set BATCHERY_API__KEYS to require keys and listen on other addresses"
        )
    _say(f"OpenAI-compatible API at http://{shown}:{port}/v1 on queue {settings.queue}; {auth}")
    _say(f"web console at http://{shown}:{port}/ (docs/console.md)")
    watch = None
    if stack is not None:
        watch = StackWatch(stack, server, settings.model)
        watch.start()
    try:
        server.run()
    finally:
        if watch is not None:
            watch.stopping.set()
    if watch is not None and watch.error is not None:
        return EXIT_FAILED
    return EXIT_OK
