"""``python -m batchery.worker`` (also ``batchery worker``): parse the flags, then run a worker."""

from __future__ import annotations

import argparse
import sys

from batchery.contract.installs import worker_install_hint
from batchery.contract.settings import add_worker_arguments, worker_overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchery worker")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    hint = worker_install_hint("batchery worker")
    if hint is not None:
        print(f"batchery worker: {hint}", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    from batchery.contract.settings import Settings
    from batchery.worker.main import EXIT_CONFIG, run_worker

    try:
        settings = Settings(**worker_overrides(args))
    except ValidationError as exc:
        print(f"batchery worker: invalid configuration:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    return run_worker(settings)


if __name__ == "__main__":
    sys.exit(main())
