"""``batchery batch``: submit, follow, download, cancel and list batch jobs."""

from __future__ import annotations

import argparse
import json
import sys

from batchery.cli.common import Command, _client, _job_options, _json_flag, _metadata, _ts


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
