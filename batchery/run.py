"""``batchery run FILE -o OUT.jsonl [--errors ERR.jsonl]``: the main job, in one command.

With no ``BATCHERY_BROKER_URL`` in the environment it brings up the embedded stack
(``batchery.embedded``: a private Redis and a worker), submits the file, shows the progress bar,
writes the results and tears everything down. With a broker URL it submits to that cluster and
waits. Output files appear whole or not at all (a temporary file, fsynced, then renamed), so
Ctrl-C never leaves a half-written one. Paths that name the same file (the output or the errors
being the input, or each other) are refused before anything starts.

An embedded worker that exits after it was serving is restarted, at most ``MAX_WORKER_RESTARTS``
times (each restart said on stderr); its unfinished lines run on the new one. When it gives up,
the command still writes every record that exists, in input order, and says how many lines
completed and how the worker exited.

Exit codes: 0 the job completed (some lines may have failed: see the errors); 1 the job failed or
was cancelled, or the stack broke; 2 bad arguments or input; 3 the embedded worker kept exiting:
the files hold the lines that completed, the rest are missing; 130 interrupted (Ctrl-C, SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

EXIT_OK = 0
EXIT_JOB = 1
EXIT_USAGE = 2
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130
MAX_WORKER_RESTARTS = 3  # an embedded worker that exits after serving is started again this many times


class WorkerGaveUp(RuntimeError):
    """The embedded worker exited once more than it may be restarted; ``exits`` says how, each time."""

    def __init__(self, exits: list[str], last: str) -> None:
        super().__init__(last)
        self.exits = exits


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C."""


def _interrupt(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _atomic_target(path: Path, stack: ExitStack):
    """An open temporary file next to ``path``; renamed onto it by ``commit``, removed otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    f = os.fdopen(fd, "w", encoding="utf-8", newline="\n")

    def discard() -> None:
        if not f.closed:
            f.close()
        if os.path.exists(tmp):
            os.unlink(tmp)

    stack.callback(discard)
    return f, tmp


def clashing_paths(file: str, out: str | None, errors: str | None) -> str | None:
    """A message when two of the paths name one file (through ``./``, ``..``, symlinks or hard
    links): an output would overwrite the input, or the errors would replace the output."""
    roles = [("input", file), ("output (-o)", out), ("errors file (--errors)", errors)]
    named = [(role, p) for role, p in roles if p is not None and str(p) != "-"]
    for i, (role_a, a) in enumerate(named):
        for role_b, b in named[i + 1 :]:
            ra, rb = Path(a).resolve(), Path(b).resolve()
            same = ra == rb
            if not same and ra.exists() and rb.exists():
                same = os.path.samefile(ra, rb)
            if same:
                return (
                    f"the {role_b} {b} and the {role_a} {a} are the same file ({rb}); "
                    f"writing the {role_b.split(' (')[0]} would replace the {role_a.split(' (')[0]}: "
                    "give it another path"
                )
    return None


def write_results(
    records: Iterable[dict], out: str | Path | None, errors: str | Path | None = None, stdout=None
) -> tuple[int, int]:
    """Write records (in the order given) as JSONL: outputs to ``out``, errors to ``errors`` if
    given, else inline. Files are replaced atomically once complete; ``out`` None or ``-`` writes
    to ``stdout``. Returns ``(num_ok, num_errors)``."""
    num_ok = num_err = 0
    with ExitStack() as stack:
        targets = []
        if out is None or str(out) == "-":
            out_f = stdout or sys.stdout
        else:
            out_f, tmp = _atomic_target(Path(out), stack)
            targets.append((out_f, tmp, Path(out)))
        err_f = out_f
        if errors is not None:
            err_f, tmp = _atomic_target(Path(errors), stack)
            targets.append((err_f, tmp, Path(errors)))
        for rec in records:
            failed = rec.get("error") is not None
            (err_f if failed else out_f).write(json.dumps(rec, separators=(",", ":")) + "\n")
            if failed:
                num_err += 1
            else:
                num_ok += 1
        for f, _tmp, _final in targets:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for _f, tmp, final in targets:
            os.replace(tmp, final)
    return num_ok, num_err


def cached_tokens(usage) -> int:
    """Of a job's prompt tokens, those served from the prefix cache (``usage.prompt_tokens_details``)."""
    details = getattr(usage, "prompt_tokens_details", None)
    if isinstance(details, dict):
        return int(details.get("cached_tokens") or 0)
    return int(getattr(details, "cached_tokens", 0) or 0)


def summary(job, wall: float, num_ok: int, num_err: int) -> dict:
    end = job.completed_at or job.cancelled_at or job.failed_at or time.time()
    job_s = max(end - job.created_at, 1e-9)
    # generation time: from the first line a worker started (after the model loaded) to the end
    running_s = max(end - (job.started_at or job.created_at), 1e-9)
    return {
        "job": job.id,
        "status": job.status,
        "lines_ok": num_ok,
        "lines_failed": num_err,
        "request_counts": job.request_counts.model_dump(),
        "prompt_tokens": job.usage.prompt_tokens,
        "cached_tokens": cached_tokens(job.usage),
        "completion_tokens": job.usage.completion_tokens,
        "wall_s": round(wall, 3),
        "job_s": round(job_s, 3),
        "running_s": round(running_s, 3),
        "completion_tokens_per_s": round(job.usage.completion_tokens / running_s, 2),
        "errors": [e.model_dump() for e in job.errors],
    }


def print_summary(s: dict, out_path, err_path, stream) -> None:
    where = f"{out_path}" + (f", errors in {err_path}" if err_path else "")
    print(
        f"batchery run: {s['status']} {s['job']}: {s['lines_ok']} lines ok, {s['lines_failed']} failed -> {where}",
        file=stream,
    )
    print(
        f"  tokens: {s['prompt_tokens']} prompt ({s['cached_tokens']} from the prefix cache) + "
        f"{s['completion_tokens']} completion; wall {s['wall_s']:.1f} s, "
        f"generating {s['running_s']:.1f} s: {s['completion_tokens_per_s']:.1f} completion tokens/s",
        file=stream,
    )
    for e in s["errors"]:
        print(f"  job error: {e['code']}: {e['message']}", file=stream)


def watch_stack(stack, exits: list[str]):
    """``wait_batch``'s ``on_update`` for the embedded stack: a dead Redis ends the run
    (``StackError``); a worker that exited after it was serving is started again, at most
    ``MAX_WORKER_RESTARTS`` times, then ``WorkerGaveUp``. ``exits`` collects how each one exited."""
    from batchery.embedded import WorkerExited, describe_exit, exited, tail

    def check(st) -> None:
        try:
            stack.check()
        except WorkerExited as exc:
            if st.is_terminal:
                return  # every line has its record: the exit costs nothing
            if not exc.was_ready and not exits:
                raise  # the first worker never served: this model or configuration cannot run here
            exits.append(describe_exit(exc.returncode))
            if not exc.was_ready or len(exits) > MAX_WORKER_RESTARTS:
                raise WorkerGaveUp(exits, str(exc)) from None
            log_tail = "\n".join("  | " + x for x in tail(stack.worker_log, 3).splitlines())
            restored = stack.restart_worker()
            print(
                f"{chr(10) if sys.stderr.isatty() else ''}batchery run: the worker {exited(exc.returncode)}; "
                f"restarting it (restart {len(exits)} of {MAX_WORKER_RESTARTS}); {restored} unfinished lines "
                f"back on the queue\n{log_tail}",
                file=sys.stderr,
            )

    return check


def run_job(
    file: str,
    out: str,
    errors: str | None = None,
    *,
    timeout: float | None = None,
    priority: int | None = None,
    metadata: dict | None = None,
    model: str | None = None,
    as_json: bool = False,
    progress: bool = True,
) -> int:
    """The ``batchery run`` command. Returns the exit code."""
    from pydantic import ValidationError
    from redis.exceptions import RedisError

    from batchery.client import Client
    from batchery.contract.errors import InvalidRequest
    from batchery.contract.installs import worker_install_hint
    from batchery.contract.settings import Settings, mask_url
    from batchery.embedded import EmbeddedStack, StackError
    from batchery.jobs.storage import StorageError
    from batchery.jobs.store import JobNotFound

    t0 = time.monotonic()
    if not Path(file).is_file():
        print(f"batchery run: no such file: {file}", file=sys.stderr)
        return EXIT_USAGE
    clash = clashing_paths(file, out, errors)
    if clash is not None:
        print(f"batchery run: {clash}", file=sys.stderr)
        return EXIT_USAGE
    embedded = not os.environ.get("BATCHERY_BROKER_URL")
    hint = worker_install_hint("batchery run without BATCHERY_BROKER_URL (an embedded worker)") if embedded else None
    if hint is not None:
        print(
            f"batchery run: {hint} Or set BATCHERY_BROKER_URL to run the file on a cluster's workers.", file=sys.stderr
        )
        return EXIT_USAGE
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    stack = client = job_id = settings = None
    workdir = None
    worker_exits: list[str] = []
    keep_workdir = False
    try:
        try:
            overrides = {"model": model} if model else {}
            if embedded:
                workdir = tempfile.mkdtemp(prefix="batchery-run-")
                stack = EmbeddedStack(Path(workdir), model=model)
                url = stack.start()
                settings = Settings(broker_url=url, result_backend=url, queue=None, **overrides)
                print(
                    f"batchery run: embedded Redis and a worker for {settings.model} (worker log {stack.worker_log})",
                    file=sys.stderr,
                )
            else:
                settings = Settings(**overrides)
            client = Client(settings=settings)
            job_id = client.submit_batch(file, timeout=timeout, priority=priority, metadata=metadata)
            print(f"batchery run: submitted {file} as {job_id} on queue {settings.queue}", file=sys.stderr)
            check = watch_stack(stack, worker_exits) if stack is not None else None
            job = client.wait_batch(job_id, progress=progress, on_update=check)
            num_ok, num_err = write_results(client.batch_results(job_id), out, errors)
        except (InvalidRequest, StorageError, ValidationError) as exc:
            print(f"batchery run: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except WorkerGaveUp as exc:
            keep_workdir = True
            job = client.batch_status(job_id)
            num_ok, num_err = write_results(client.batch_results(job_id), out, errors)
            print(f"batchery run: {exc}\n(logs kept in {workdir})", file=sys.stderr)
            where = f"{out}" + (f", errors in {errors}" if errors else "")
            print(
                f"batchery run: {num_ok + num_err} of {job.request_counts.total} lines completed; the worker exited "
                f"{len(exc.exits)} times: {', '.join(exc.exits)}; gave up after {len(exc.exits) - 1} restarts. "
                f"Wrote the records that exist ({num_ok} ok, {num_err} failed) -> {where}",
                file=sys.stderr,
            )
            if as_json:
                print(json.dumps({**summary(job, time.monotonic() - t0, num_ok, num_err), "worker_exits": exc.exits}))
            return EXIT_PARTIAL
        except StackError as exc:
            keep_workdir = True
            print(f"batchery run: {exc}\n(logs kept in {workdir})", file=sys.stderr)
            return EXIT_JOB
        except (JobNotFound, RedisError) as exc:
            # A Redis that is unreachable or refuses us, or a job that vanished with it (flushed, replaced):
            # one clear line, never a traceback. Nothing is written: there are no records to trust.
            where = mask_url(settings.broker_url) if settings is not None else "Redis"
            what = str(exc) if isinstance(exc, JobNotFound) else f"{type(exc).__name__}: {exc}"
            print(
                f"batchery run: {'the job is gone: ' if isinstance(exc, JobNotFound) else ''}{what} "
                f"({where}{f'; job {job_id}' if job_id else ''}); no output written",
                file=sys.stderr,
            )
            if workdir is not None:
                keep_workdir = True
                print(f"batchery run: logs kept in {workdir}", file=sys.stderr)
            return EXIT_JOB
        except KeyboardInterrupt as exc:
            why = f"{exc}" if isinstance(exc, Interrupted) else "Ctrl-C"
            print(f"\nbatchery run: interrupted ({why}); no output written", file=sys.stderr)
            if client is not None and job_id is not None and not embedded:
                try:
                    client.cancel_batch(job_id)
                    print(f"batchery run: cancelled {job_id}", file=sys.stderr)
                except Exception as cancel_exc:  # noqa: BLE001
                    print(f"batchery run: could not cancel {job_id}: {cancel_exc}", file=sys.stderr)
            return EXIT_INTERRUPTED
        s = summary(job, time.monotonic() - t0, num_ok, num_err)
        if as_json:
            print(json.dumps(s))
        print_summary(s, out, errors, sys.stderr)
        return EXIT_OK if job.status == "completed" else EXIT_JOB
    finally:
        # Teardown must finish: a second Ctrl-C now would orphan the children.
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if client is not None:
                client.close()
            if stack is not None:
                stack.stop()
            if workdir is not None and not keep_workdir:
                import shutil

                shutil.rmtree(workdir, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous_int)
            for s, h in old.items():
                signal.signal(s, h)
