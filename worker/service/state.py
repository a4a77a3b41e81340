"""The engine service's state: one value at a time, shown in ``/healthz``, ``/stats`` and the
``batchery_engine_state`` gauge. The values are plain strings there (a ``StrEnum`` serialises and
formats as its value)."""

from __future__ import annotations

from enum import StrEnum


class EngineState(StrEnum):
    NEW = "new"  # constructed; the first engine is not built yet
    SERVING = "serving"  # an engine is installed and takes work
    REBUILDING = "rebuilding"  # the engine failed; the supervisor is building a new one
    DRAINING = "draining"  # warm shutdown: in-flight work finishes, nothing new is taken
    FAILED = "failed"  # the engine could not be brought back; the worker stops consuming
    STOPPED = "stopped"  # stop() was called


LIVE_STATES = (EngineState.SERVING, EngineState.DRAINING)  # a loop thread should be running
