"""``batchery`` command line. Each subcommand is one entry in ``COMMANDS`` (``batch`` has its own
``BATCH_COMMANDS``): a help line, a function that adds its arguments, and a function that runs it
and returns the exit code. The CLI imports only the light layers (contract, Redis plumbing, job
store, client): ``batchery worker`` execs ``python -m batchery.worker``, and ``batchery run`` starts
its embedded worker as a process. Human output by default; ``--json`` for scripts.

In modules by subcommand: ``worker`` (worker, health), ``batch``, ``deadletter``, ``local`` (run, serve), and
``common`` (``Command`` and what the batch commands share); this module gathers them in ``COMMANDS``."""

from __future__ import annotations

import argparse
import sys

from batchery.cli.batch import BATCH_COMMANDS, _batch_args
from batchery.cli.common import Command
from batchery.cli.deadletter import DEADLETTER_COMMANDS, _deadletter_args
from batchery.cli.local import _run_args, _run_run, _serve_args, _serve_run
from batchery.cli.worker import _health_args, _health_run, _worker_arguments, _worker_exec, _worker_run

COMMANDS: dict[str, Command] = {
    "run": Command(
        "run a JSONL batch file end to end (embedded Redis and worker unless a broker is set)", _run_args, _run_run
    ),
    "serve": Command("serve OpenAI's HTTP API (files, batches, chat, models) over the queue", _serve_args, _serve_run),
    "batch": Command("submit, follow, download and cancel batch jobs", _batch_args, lambda args: 2),
    "deadletter": Command(
        "list, inspect and requeue dead letters (messages that failed for good)", _deadletter_args, lambda args: 2
    ),
    "worker": Command("run a worker", _worker_arguments, _worker_run),
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # straight to the worker (see _worker_exec)
        return _worker_exec(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


__all__ = ["BATCH_COMMANDS", "COMMANDS", "DEADLETTER_COMMANDS", "Command", "build_parser", "main"]
