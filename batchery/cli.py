"""``batchery`` command line. Each subcommand is one entry in ``COMMANDS`` (``batch`` has its own
``BATCH_COMMANDS``): a help line, a function that adds its arguments, and a function that runs it
and returns the exit code. The CLI imports only the light layers (contract, Redis plumbing, job
store, client): ``batchery worker`` execs ``python -m batchery.worker``, and ``batchery run`` starts
its embedded worker as a process. Human output by default; ``--json`` for scripts."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from batchery.contract.installs import worker_install_hint


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


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


# -- batch ----------------------------------------------------------------------------------------
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


def _print_job(job) -> None:
    rc, u = job.request_counts, job.usage
    print(f"id:        {job.id}")
    print(f"status:    {job.status}")
    print(f"requests:  {rc.total} total, {rc.completed} completed, {rc.failed} failed")
    print(f"tokens:    {u.prompt_tokens} prompt, {u.completion_tokens} completion")
    print(f"queue:     {job.queue}  (model {job.model or '-'})")
    print(f"input:     {job.input_file or '(iterable)'}")
    ends = [
        (name, getattr(job, f"{name}_at"))
        for name in (
            "started",
            "in_progress",
            "finalizing",
            "completed",
            "failed",
            "expired",
            "cancelling",
            "cancelled",
        )
    ]
    print(f"created:   {_ts(job.created_at)}" + "".join(f"; {n} {_ts(t)}" for n, t in ends if t is not None))
    if job.expires_at is not None:
        print(f"expires:   {_ts(job.expires_at)}")
    else:
        print("expires:   BATCHERY_BATCH__TTL after it ends")
    if job.metadata:
        print("metadata:  " + ", ".join(f"{k}={v}" for k, v in job.metadata.items()))
    for e in job.errors:
        print(f"error:     {e.code}: {e.message}")


def _emit(args: argparse.Namespace, job) -> None:
    if args.json:
        print(job.model_dump_json())
    else:
        _print_job(job)


def _batch_submit_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Submit a JSONL file of OpenAI Batch request lines; prints the job id. Bad lines become "
        "error records with their line numbers; the rest of the job goes on."
    )
    p.add_argument("file", help="input .jsonl (custom_id, method, url, body per line)")
    _job_options(p)
    p.add_argument("--model", help="the model whose queue takes the job (BATCHERY_MODEL)")
    p.add_argument("--queue", help="the queue (BATCHERY_QUEUE; default derived from the model)")
    p.add_argument("--wait", action="store_true", help="then wait for it, as `batchery batch wait` does")
    _json_flag(p)


def _batch_submit_run(args: argparse.Namespace) -> int:
    from batchery.contract.errors import InvalidRequest
    from batchery.jobs.storage import StorageError

    try:
        metadata = _metadata(args.metadata)
        with _client(args) as c:
            job_id = c.submit_batch(args.file, timeout=args.timeout, priority=args.priority, metadata=metadata)
            job = c.batch_status(job_id)
            if args.wait:
                job = c.wait_batch(job_id, progress=not args.json)
    except (InvalidRequest, StorageError, argparse.ArgumentTypeError) as exc:
        print(f"batchery batch submit: {exc}", file=sys.stderr)
        return 2
    except _job_errors() as exc:
        print(f"batchery batch submit: {_job_error(exc)}", file=sys.stderr)
        return 1
    if args.json:
        print(job.model_dump_json())
    else:
        print(job.id)
        if job.status == "failed" or args.wait:
            print(
                f"{job.status}: {job.request_counts.completed} completed, {job.request_counts.failed} failed"
                + "".join(f"; {e.code}: {e.message}" for e in job.errors),
                file=sys.stderr,
            )
    return 1 if job.status in ("failed", "expired", "cancelled") else 0


def _batch_id_args(description: str):
    def add(p: argparse.ArgumentParser) -> None:
        p.description = description
        p.add_argument("job", help="the job id (batch_...)")
        _json_flag(p)

    return add


def _job_errors() -> tuple[type[Exception], ...]:
    """What a batch command reports as one line and exit code 1: a job that is gone or malformed
    (``JobNotFound``, ``JobMalformed``), or a Redis that fails (unreachable, refusing, out of memory)."""
    import redis

    from batchery.jobs.store import JobNotFound

    return (JobNotFound, redis.RedisError)


def _job_error(exc: Exception) -> str:
    from batchery.jobs.store import JobNotFound

    return str(exc) if isinstance(exc, JobNotFound) else f"Redis error: {type(exc).__name__}: {exc}"


def _with_job(fn):
    """Run ``fn(client, args)``; a missing or malformed job, or a failing Redis, is a clear message and
    exit code 1 (never a traceback)."""

    def run(args: argparse.Namespace) -> int:
        try:
            with _client(args) as c:
                return fn(c, args)
        except _job_errors() as exc:
            print(f"batchery batch {args.batch_command}: {_job_error(exc)}", file=sys.stderr)
            return 1

    return run


def _batch_status_run(c, args) -> int:
    from batchery.broker import presence

    job = c.batch_status(args.job)
    live = c.live_workers()  # None: cannot be told (not a Redis broker, or it does not answer at once)
    if args.json:
        doc = json.loads(job.model_dump_json())
        if live is not None:
            doc["workers"] = presence.summary(live, job.queue)
        print(json.dumps(doc))
        return 0
    _print_job(job)
    if live is not None and not job.is_terminal:
        note = presence.absence_note(live, job.queue)
        print(f"workers:   {note}" if note else f"workers:   {len(live[job.queue])} consuming queue '{job.queue}'")
    return 0


def _batch_wait_args(p: argparse.ArgumentParser) -> None:
    _batch_id_args(
        "Wait for a job to end, with a live progress bar (done/total, failed, tokens/s, ETA) on a "
        "terminal. Exit 0 when it completed, 1 if it failed or was cancelled, 124 on --timeout (also when Redis "
        "stops answering: the wait never outlasts --timeout by more than a moment)."
    )(p)
    p.add_argument("--timeout", type=float, metavar="S", help="give up waiting after S seconds (exit 124)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _batch_wait_run(c, args) -> int:
    from batchery.contract.errors import ResultTimeout

    try:
        job = c.wait_batch(args.job, timeout=args.timeout, progress=not (args.no_progress or args.json))
    except ResultTimeout as exc:
        print(f"batchery batch wait: {exc}", file=sys.stderr)
        return 124
    _emit(args, job)
    return 0 if job.status == "completed" else 1


def _batch_results_args(p: argparse.ArgumentParser) -> None:
    _batch_id_args(
        "Download a job's records in input order: output lines, and error lines (inline unless "
        "--errors is given). Files are written whole or not at all. A running or cancelled job "
        "gives the records so far."
    )(p)
    p.add_argument("-o", "--output", default="-", metavar="OUT.jsonl", help="output file (default: stdout)")
    p.add_argument("--errors", metavar="ERR.jsonl", help="write error lines here instead of inline")


def _batch_results_run(c, args) -> int:
    from batchery.run import write_results

    job = c.batch_status(args.job)
    num_ok, num_err = write_results(c.batch_results(job.id), args.output, args.errors)
    report = {
        "job": job.id,
        "status": job.status,
        "lines_ok": num_ok,
        "lines_failed": num_err,
        "output": args.output,
        "errors": args.errors,
    }
    if args.json:
        print(json.dumps(report), file=sys.stderr if args.output == "-" else sys.stdout)
    elif args.output != "-":
        print(
            f"{num_ok} output lines -> {args.output}; {num_err} error lines -> {args.errors or args.output} "
            f"(job {job.status})"
        )
    return 0


def _batch_cancel_run(c, args) -> int:
    _emit(args, c.cancel_batch(args.job))
    return 0


def _batch_list_args(p: argparse.ArgumentParser) -> None:
    p.description = "List the newest batch jobs."
    p.add_argument("--limit", type=int, default=20, help="how many (default 20)")
    _json_flag(p)


def _batch_list_run(args: argparse.Namespace) -> int:
    try:
        with _client(args) as c:
            jobs = c.list_batches(args.limit)
    except _job_errors() as exc:
        print(f"batchery batch list: {_job_error(exc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([j.model_dump(mode="json") for j in jobs]))
        return 0
    print(f"{'id':<38} {'status':<12} {'done':>15} {'failed':>7}  created")
    for j in jobs:
        done = f"{j.num_done}/{j.request_counts.total}"
        print(f"{j.id:<38} {j.status:<12} {done:>15} {j.request_counts.failed:>7}  {_ts(j.created_at)}")
    return 0


BATCH_COMMANDS: dict[str, Command] = {
    "submit": Command("submit a JSONL batch file; prints the job id", _batch_submit_args, _batch_submit_run),
    "status": Command(
        "show a job's state and counts",
        _batch_id_args(
            "Show a batch job's state, request counts, token usage and timestamps, and whether any worker has been "
            "seen on its queue (the JSON form adds a 'workers' object: queue, seen, workers, other_queues)."
        ),
        _with_job(_batch_status_run),
    ),
    "wait": Command("wait for a job, with a progress bar", _batch_wait_args, _with_job(_batch_wait_run)),
    "results": Command("download a job's output and error lines", _batch_results_args, _with_job(_batch_results_run)),
    "cancel": Command(
        "cancel a job (partial results stay downloadable)",
        _batch_id_args(
            "Cancel a job: requests not started are skipped, running ones aborted in the engine. The status is "
            "cancelling until they have stopped, then cancelled."
        ),
        _with_job(_batch_cancel_run),
    ),
    "list": Command("list recent jobs", _batch_list_args, _batch_list_run),
}


def _batch_args(p: argparse.ArgumentParser) -> None:
    p.description = "Batch jobs in the OpenAI Batch format, on the configured Redis (BATCHERY_* variables)."
    sub = p.add_subparsers(dest="batch_command", required=True, metavar="SUBCOMMAND")
    for name, cmd in BATCH_COMMANDS.items():
        sp = sub.add_parser(name, help=cmd.help)
        cmd.add_arguments(sp)
        sp.set_defaults(_run=cmd.run)


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
    if c.jobs.r.hexists(c.jobs.keys(job)[1], str(line)):
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


# -- run ------------------------------------------------------------------------------------------
def _run_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run a JSONL batch file end to end and write the results. Without BATCHERY_BROKER_URL it "
        "starts a private Redis and a worker (BATCHERY_MODEL, default smollm2-135m-instruct), and "
        "stops them afterwards (an embedded worker that exits is restarted up to 3 times); with it, it "
        "submits to that cluster and waits. Exit 0 when the job completed (failed lines go to the errors), "
        "1 if it did not, 2 for bad arguments (an output path that is the input or the other output), "
        "3 when the embedded worker kept exiting (the files then hold the lines that completed), 130 on Ctrl-C."
    )
    p.add_argument("file", help="input .jsonl")
    p.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="output file (written atomically)")
    p.add_argument("--errors", metavar="ERR.jsonl", help="error lines go here (default: inline in the output)")
    _job_options(p)
    p.add_argument("--model", help="model for the embedded worker and the queue (BATCHERY_MODEL)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _json_flag(p)


def _run_run(args: argparse.Namespace) -> int:
    from batchery.run import run_job

    try:
        metadata = _metadata(args.metadata)
    except argparse.ArgumentTypeError as exc:
        print(f"batchery run: {exc}", file=sys.stderr)
        return 2
    return run_job(
        args.file,
        args.output,
        args.errors,
        timeout=args.timeout,
        priority=args.priority,
        metadata=metadata,
        model=args.model,
        as_json=args.json,
        progress=not args.no_progress,
    )


# -- serve ----------------------------------------------------------------------------------------
def _serve_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Serve OpenAI's HTTP API (Files, Batches, Chat Completions, Completions, Responses, Models) in front "
        "of the queue: point an OpenAI SDK's base_url at http://HOST:PORT/v1. With BATCHERY_API__KEYS "
        "(comma-separated) every request needs one of them as a Bearer token; without, it is unauthenticated "
        "and listens on localhost only. Without BATCHERY_BROKER_URL it starts a private Redis and a worker "
        "(BATCHERY_MODEL) and stops them on exit. Needs pip install 'batchery[serve]'. Exit 0 when stopped "
        "(Ctrl-C, SIGTERM), 1 if the server or the embedded stack failed, 2 for bad settings."
    )
    p.add_argument("--host", help="address to listen on (BATCHERY_API__HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (BATCHERY_API__PORT, default 8000)")


def _serve_run(args: argparse.Namespace) -> int:
    from batchery.api.serve import serve

    return serve(host=args.host, port=args.port)


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


if __name__ == "__main__":
    sys.exit(main())
