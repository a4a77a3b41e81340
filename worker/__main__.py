"""``python -m batchery.worker`` (also ``batchery worker``): parse the flags, then run a worker."""

from __future__ import annotations

import argparse
import sys

from batchery.contract.installs import worker_install_hint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batchery worker",
        description="Run a worker: load the model, then consume its queue. Configured by BATCHERY_* variables; "
                    "the flags below override them.")
    p.add_argument("--model", help="model name, local HF directory or .gguf file (BATCHERY_MODEL)")
    p.add_argument("--queue", help="queue to consume (BATCHERY_QUEUE; default derived from the model)")
    p.add_argument("--concurrency", type=int, help="task threads (BATCHERY_CONCURRENCY)")
    p.add_argument("--health-port", type=int, help="health endpoint port; 0 disables (BATCHERY_HEALTH_PORT)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ... (BATCHERY_LOG_LEVEL)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hint = worker_install_hint("batchery worker")
    if hint is not None:
        print(f"batchery worker: {hint}", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    from batchery.contract.settings import Settings
    from batchery.worker.main import EXIT_CONFIG, run_worker

    overrides = {k: v for k, v in (("model", args.model), ("queue", args.queue), ("concurrency", args.concurrency),
                                   ("health_port", args.health_port), ("log_level", args.log_level)) if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"batchery worker: invalid configuration:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    return run_worker(settings)


if __name__ == "__main__":
    sys.exit(main())
