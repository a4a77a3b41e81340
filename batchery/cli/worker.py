"""``batchery worker`` (execs ``python -m batchery.worker``) and ``batchery health`` (a worker's health endpoints)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from batchery.contract.installs import worker_install_hint


# -- worker ---------------------------------------------------------------------------------------
def _worker_arguments(p: argparse.ArgumentParser) -> None:
    from batchery.contract.settings import add_worker_arguments  # pydantic: only when the parser is built

    add_worker_arguments(p)


def _worker_run(args: argparse.Namespace) -> int:
    from batchery.contract.settings import worker_argv, worker_overrides

    return _worker_exec(worker_argv(worker_overrides(args)))


def _worker_exec(flags: list[str]) -> int:
    """Become ``python -m batchery.worker`` with ``flags`` (exec: same process, so signals and the exit
    code are the worker's). The CLI never imports the worker: the light install has none. ``main`` comes
    here for ``batchery worker ...`` before building its parsers: the worker parses and checks the same
    flags (``add_worker_arguments``, under the same ``batchery worker`` name), and whatever this process
    imported would only be imported again after the exec (about 0.2 s of a worker's start)."""
    hint = worker_install_hint("batchery worker")
    if hint is not None:
        print(f"batchery worker: {hint}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "batchery.worker", *flags])
    return 1  # not reached


# -- health ---------------------------------------------------------------------------------------
def _health_args(p: argparse.ArgumentParser) -> None:
    p.description = "Check a worker's health endpoints; exit 0 if healthy (and ready), 1 if not."
    p.add_argument("--url", help="base URL (default http://127.0.0.1:$BATCHERY_HEALTH_PORT)")
    p.add_argument("--live", action="store_true", help="check liveness (/healthz) only, not readiness")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing")


def _probe(url: str, timeout: float) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        return exc.code, body
    except (OSError, ValueError) as exc:
        return 0, {"error": str(exc)}


def _health_run(args: argparse.Namespace) -> int:
    if args.url:
        base = args.url.rstrip("/")
    else:
        from batchery.contract.settings import Settings

        base = f"http://127.0.0.1:{Settings().health_port}"
    paths = ["/healthz"] if args.live else ["/healthz", "/readyz"]
    ok = True
    report = {}
    for path in paths:
        status, body = _probe(base + path, args.timeout)
        report[path] = {"status": status, **body}
        ok = ok and status == 200
    if not args.quiet:
        print(json.dumps({"ok": ok, "url": base, **report}, indent=2))
    return 0 if ok else 1
