"""Health endpoints on ``BATCHERY_HEALTH_PORT``: a small stdlib HTTP server in a daemon thread.

- ``/healthz`` (liveness): the process answers, the engine loop is alive (or being rebuilt);
  includes the age of the last engine step. 503 once the engine is given up on.
- ``/readyz`` (readiness): the model is loaded and the worker is consuming its queue.
- ``/stats``: the engine service's counters (mean batch size, KV blocks, failures, ...).

More routes plug in with ``add_route``; the worker adds ``/metrics`` (``batchery.worker.metrics``)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("batchery.worker.health")

# a route returns (status, body, content type); a dict body is sent as JSON
Route = Callable[[], tuple[int, object, str]]


class HealthServer:
    def __init__(self, service, host: str = "0.0.0.0", port: int = 8080) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.consuming = False  # set by the entry point once the Celery consumer runs
        self.routes: dict[str, Route] = {"/healthz": self._healthz, "/readyz": self._readyz, "/stats": self._stats}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add_route(self, path: str, route: Route) -> None:
        self.routes[path] = route

    def _healthz(self):
        h = self.service.health()
        return (200 if h["healthy"] else 503), h, "application/json"

    def _readyz(self):
        ready = bool(self.service.ready and self.consuming)
        body = {
            "ready": ready,
            "model_loaded": bool(self.service.num_kv_blocks),
            "consuming": self.consuming,
            "state": self.service.state,
        }
        return (200 if ready else 503), body, "application/json"

    def _stats(self):
        return 200, self.service.stats(), "application/json"

    def start(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                route = server.routes.get(self.path.split("?", 1)[0])
                if route is None:
                    status, body, ctype = 404, {"error": f"no route {self.path}"}, "application/json"
                else:
                    try:
                        status, body, ctype = route()
                    except Exception as exc:  # noqa: BLE001 - a broken probe must answer, not hang
                        log.exception("health route %s failed", self.path)
                        status, body, ctype = 500, {"error": repr(exc)}, "application/json"
                data = (json.dumps(body) if isinstance(body, dict) else str(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt, *args) -> None:  # probes every few seconds: keep them out of the log
                log.debug("%s " + fmt, self.address_string(), *args)

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="health-http", daemon=True)
        self._thread.start()
        log.info("health endpoints on http://%s:%d (%s)", self.host, self.port, ", ".join(self.routes))

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
