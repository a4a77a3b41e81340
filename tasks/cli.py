"""``batchery`` command line. Each subcommand is one entry in ``COMMANDS``: a help line, a function
that adds its arguments, and a function that runs it and returns the exit code. Heavy imports
happen inside the run functions, so ``batchery health`` never loads torch."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- worker ---------------------------------------------------------------------------------------
def _worker_args(p: argparse.ArgumentParser) -> None:
    p.description = "Run a worker: load the model, then consume its queue. Configured by BATCHERY_* variables; " \
                    "the flags below override them."
    p.add_argument("--model", help="model name, local HF directory or .gguf file (BATCHERY_MODEL)")
    p.add_argument("--queue", help="queue to consume (BATCHERY_QUEUE; default derived from the model)")
    p.add_argument("--concurrency", type=int, help="task threads (BATCHERY_CONCURRENCY)")
    p.add_argument("--health-port", type=int, help="health endpoint port; 0 disables (BATCHERY_HEALTH_PORT)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ... (BATCHERY_LOG_LEVEL)")


def _worker_run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from worker.main import EXIT_CONFIG, run_worker
    from worker.settings import Settings

    overrides = {k: v for k, v in (("model", args.model), ("queue", args.queue), ("concurrency", args.concurrency),
                                   ("health_port", args.health_port), ("log_level", args.log_level)) if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"batchery worker: invalid configuration:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    return run_worker(settings)


# -- health ---------------------------------------------------------------------------------------
def _health_args(p: argparse.ArgumentParser) -> None:
    p.description = "Check a worker's health endpoints; exit 0 if healthy (and ready), 1 if not."
    p.add_argument("--url", help="base URL (default http://127.0.0.1:$BATCHERY_HEALTH_PORT)")
    p.add_argument("--live", action="store_true", help="check liveness (/healthz) only, not readiness")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing")


def _probe(url: str, timeout: float) -> tuple[int, dict]:
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
        from worker.settings import Settings

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


COMMANDS: dict[str, Command] = {
    "worker": Command("run a worker", _worker_args, _worker_run),
    "health": Command("check a worker's health endpoints (exit code for healthchecks)", _health_args, _health_run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchery", description="Queue-driven batch LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
