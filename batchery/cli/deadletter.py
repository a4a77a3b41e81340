"""``batchery deadletter``: list, inspect and requeue dead letters (messages that failed for good)."""

from __future__ import annotations

import argparse
import json
import sys

from batchery.cli.common import Command, _client, _json_flag, _ts


# -- deadletter -----------------------------------------------------------------------------------
def _dl_store(c):
    """The dead-letter list (and the counters a requeue resets) on ``c``'s result backend."""
    from batchery.jobs.deadletter import DeadLetters
    from batchery.jobs.deliveries import Deliveries
    from batchery.jobs.strikes import Strikes

    s = c.settings
    r = c.jobs.r  # the result backend's Redis
    return (
        DeadLetters(r, s.deadletter.key_prefix, s.deadletter.max_entries),
        Deliveries(r, s.deadletter.deliveries_prefix),
        Strikes(r, s.quarantine.key_prefix),
    )


def _dl_with(fn):
    """Run ``fn(client, dead_letters, args)``; a failing Redis is one line and exit code 1."""

    def run(args: argparse.Namespace) -> int:
        import redis

        try:
            with _client(args) as c:
                return fn(c, _dl_store(c), args)
        except redis.RedisError as exc:
            print(f"batchery deadletter {args.dl_command}: Redis error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1

    return run


def _dl_list_args(p: argparse.ArgumentParser) -> None:
    p.description = "List the dead letters, newest first: messages that failed for good without running."
    p.add_argument("--limit", type=int, default=50, help="how many (default 50)")
    _json_flag(p)


def _dl_list_run(c, store, args) -> int:
    dl = store[0]
    entries = dl.list(args.limit)
    if args.json:
        print(json.dumps(entries))
        return 0
    print(f"{dl.count()} dead letters")
    if entries:
        print(f"{'id':<44} {'task':<26} {'reason':<16} {'deliv':>5}  dead-lettered")
    for e in entries:
        print(
            f"{e['id'][:44]:<44} {e['task'][:26]:<26} {e['reason']:<16} {e.get('deliveries', 0):>5}  "
            f"{_ts(e.get('dead_lettered_at'))}"
        )
    return 0


def _dl_inspect_args(p: argparse.ArgumentParser) -> None:
    p.description = "Show one dead letter whole (JSON): its message, why it is here, its deliveries and times."
    p.add_argument("id", help="the task id (a batch line's is JOB-LINE)")


def _dl_inspect_run(c, store, args) -> int:
    entry = store[0].get(args.id)
    if entry is None:
        print(f"batchery deadletter inspect: no dead letter {args.id!r}", file=sys.stderr)
        return 1
    print(json.dumps(entry, indent=2))
    return 0


def _dl_requeue_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Publish dead letters again, each with its own task id on its own queue, with its delivery and strike "
        "counts reset, and take them off the list. Refused (and kept) when that cannot help: a message that "
        "failed its checks or was kept truncated, or a batch line whose job has its record already or has ended "
        "(a line runs once: submit it again in a new job). Exit 0 if every one asked for was requeued, else 1."
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?", help="the task id (a batch line's is JOB-LINE)")
    which.add_argument("--all", action="store_true", help="every dead letter on the list")
    _json_flag(p)


def _dl_batch_line_refusal(c, entry: dict) -> str | None:
    from batchery.jobs.store import ACTIVE_STATUSES

    kwargs = entry.get("kwargs") or {}
    job, line = kwargs.get("job"), kwargs.get("line")
    status = c.jobs.get_status(job)
    if status is None:
        return f"its job {job} no longer exists"
    if isinstance(line, int) and 0 < line < 2**32 and c.jobs.recorded(job, line):  # in Redis or in the store
        return f"line {line} of {job} already has its record (a line runs once; submit it again in a new job)"
    if status not in ACTIVE_STATUSES:
        return f"its job {job} is {status}"
    return None


def _dl_requeue_run(c, store, args) -> int:
    from batchery.contract.names import BATCH_LINE_TASK
    from batchery.jobs.deadletter import requeue, requeue_refusal

    dl, deliveries, strikes = store
    ids = dl.ids() if args.all else [args.id]
    report = []
    for task_id in ids:
        entry = dl.get(task_id)
        if entry is None:
            report.append({"id": task_id, "requeued": False, "why": "no such dead letter"})
            continue
        why = requeue_refusal(entry)
        if why is None and entry["task"] == BATCH_LINE_TASK:
            why = _dl_batch_line_refusal(c, entry)
        if why is None:
            requeue(c.app, entry, deliveries, strikes)
            dl.remove(task_id)
        report.append({"id": task_id, "requeued": why is None, "why": why, "queue": entry.get("queue")})
    if args.json:
        print(json.dumps(report))
    else:
        for r in report:
            if r["requeued"]:
                print(f"requeued {r['id']} on {r['queue']}")
            else:
                print(f"not requeued {r['id']}: {r['why']}", file=sys.stderr)
        if args.all:
            print(f"{sum(r['requeued'] for r in report)} of {len(report)} dead letters requeued")
    return 0 if all(r["requeued"] for r in report) else 1


DEADLETTER_COMMANDS: dict[str, Command] = {
    "list": Command("list the dead letters, newest first", _dl_list_args, _dl_with(_dl_list_run)),
    "inspect": Command("show one dead letter whole (JSON)", _dl_inspect_args, _dl_with(_dl_inspect_run)),
    "requeue": Command("publish dead letters again (ID, or --all)", _dl_requeue_args, _dl_with(_dl_requeue_run)),
}


def _deadletter_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Dead letters: messages that failed for good without running (BATCHERY_MAX_DELIVERIES deliveries died "
        "with their worker process, or a batch-line message failed its checks), kept on the configured result "
        "backend (BATCHERY_* variables)."
    )
    sub = p.add_subparsers(dest="dl_command", required=True, metavar="SUBCOMMAND")
    for name, cmd in DEADLETTER_COMMANDS.items():
        sp = sub.add_parser(name, help=cmd.help)
        cmd.add_arguments(sp)
        sp.set_defaults(_run=cmd.run)
