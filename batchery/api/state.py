"""``ApiState``: what the API's routes share, one per app (``request.app.state.batchery``). It lives in a module
of its own, below ``app`` and the routers, so the routers can name it without importing the module that mounts
them (no import circle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from batchery.api.auth import Keys
from batchery.contract.settings import Settings


@dataclass
class ApiState:
    """What the routes share: settings, keys and the lazily built Redis-backed services."""

    settings: Settings
    keys: Keys
    extras: dict[str, Any] = field(default_factory=dict)  # per-router singletons (file store, job store, ...)


def state(request: Request) -> ApiState:
    """The app's ``ApiState``, from a request."""
    return request.app.state.batchery
