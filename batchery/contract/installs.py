"""What each install provides: ``pip install batchery`` (client, CLI, job store) and
``pip install 'batchery[worker]'`` (adds the worker and the offline engine)."""

from __future__ import annotations

import importlib.util

WORKER_INSTALL = "pip install 'batchery[worker]'"
WORKER_PACKAGES = ("torch", "transformers", "gguf", "accelerate", "prometheus_client")


def missing_worker_packages() -> list[str]:
    """The worker install's packages that this environment lacks (empty: a worker can run here)."""
    return [name for name in WORKER_PACKAGES if importlib.util.find_spec(name) is None]


def worker_install_hint(what: str) -> str | None:
    """None if a worker can run here, else a message saying that ``what`` needs the worker install."""
    missing = missing_worker_packages()
    if not missing:
        return None
    return (
        f"{what} needs the worker install ({', '.join(missing)} missing here): {WORKER_INSTALL}. "
        "The light install (pip install batchery) has the client and the batch CLI."
    )
