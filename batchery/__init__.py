"""Batchery: queue-driven LLM batch inference.

The short public names, as vLLM and Celery users expect::

    from batchery import LLM, SamplingParams, Client

``Client`` comes with the light install (``pip install batchery``); ``LLM`` and ``SamplingParams`` are
the offline engine and need the worker install (``pip install 'batchery[worker]'``). Nothing is
imported until a name is used, so ``import batchery`` costs nothing and never loads torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Client", "__version__"]

# public name -> (module, attribute, whether it needs the worker install)
_PUBLIC = {
    "LLM": ("batchery.engine.llm", "LLM", True),
    "SamplingParams": ("batchery.engine.sampling", "SamplingParams", True),
    "Client": ("batchery.client", "Client", False),
}


if TYPE_CHECKING:
    from batchery.client import Client
    from batchery.engine.llm import LLM
    from batchery.engine.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    try:
        module, attr, heavy = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'batchery' has no attribute {name!r}") from None
    try:
        value = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        if heavy and exc.name and exc.name.split(".")[0] in ("torch", "transformers", "triton", "gguf"):
            from batchery.contract.installs import WORKER_INSTALL

            raise ModuleNotFoundError(
                f"batchery.{name} is the offline engine and needs {exc.name}, which this install lacks: "
                f"{WORKER_INSTALL}",
                name=exc.name,
            ) from exc
        raise
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
