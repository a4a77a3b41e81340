"""What the subcommands share: ``Command`` (a help line, the arguments, the run function), and the job options,
``--json`` and the client that the batch commands use."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _metadata(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--metadata takes key=value, got {pair!r}")
        out[key] = value
    return out


def _job_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="each request's deadline in seconds (default: the worker's BATCHERY_TASK_TIMEOUT)",
    )
    p.add_argument(
        "--priority",
        type=int,
        metavar="P",
        choices=range(10),
        help="0 (first, the default) to 9 (last): queue and engine order against other work",
    )
    p.add_argument("--metadata", action="append", metavar="K=V", help="a metadata pair (repeatable, up to 16)")


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (for scripts) instead of text")


def _client(args: argparse.Namespace):
    from batchery.client import Client

    return Client(model=getattr(args, "model", None), queue=getattr(args, "queue", None))


def _ts(t: float | None) -> str:
    import time

    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
