"""The service's counters, typed: what ``EngineService.stats()`` and ``health()`` return, built
from one dataclass instead of a dict assembled ad hoc. Counters cover the process lifetime,
across engine rebuilds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchery.worker.service.state import LIVE_STATES, EngineState
from batchery.worker.service.step_stats import StepStats


@dataclass
class ServiceStats:
    """Written under the service lock or by the one loop thread that serves the current engine."""

    model_name: str = ""  # the loaded model, as the loader names it
    dtype: str = ""  # its dtype without the "torch." prefix
    num_kv_blocks: int = 0  # KV pool size of the current engine (a rebuild keeps the first one's)
    max_model_len: int = 0  # context length of the current engine
    num_requests: int = 0  # submitted
    num_finished: int = 0  # resolved with a result
    num_aborted: int = 0  # aborted by their task (deadline, cancellation)
    step_seconds: float = 0.0  # wall time inside engine.step()
    num_failures: int = 0  # engine failures: a step raised or the watchdog fired
    num_rebuilds: int = 0  # successful rebuilds
    num_struck: int = 0  # requests failed for being in a failing step
    num_carried_over: int = 0  # requests moved to a rebuilt engine without failing
    num_solo_runs: int = 0  # quarantined runs started
    num_poisoned: int = 0  # requests failed for good with EngineCrash
    last_failure: str = ""  # the last engine failure's reason ("" before any); presence shows it, /stats does not
    engine: dict[str, Any] = field(default_factory=dict)  # the current engine's own stats()

    def as_dict(self, state: EngineState, num_pending: int, steps: StepStats) -> dict[str, Any]:
        """The ``/stats`` body, with the step counters of ``steps``. ``mean_batch_size`` is over the
        process lifetime; diff ``num_steps`` / ``num_step_seqs`` for a window."""
        return {
            "model": self.model_name,
            "dtype": self.dtype,
            "num_kv_blocks": self.num_kv_blocks,
            "max_model_len": self.max_model_len,
            "state": state.value,
            "num_pending": num_pending,
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_steps": steps.num_started,
            "num_step_seqs": steps.num_started_seqs,
            "num_step_tokens": steps.num_step_tokens,
            "step_seconds": round(self.step_seconds, 6),
            "mean_batch_size": steps.num_started_seqs / max(steps.num_started, 1),
            "num_failures": self.num_failures,
            "num_rebuilds": self.num_rebuilds,
            "num_struck": self.num_struck,
            "num_carried_over": self.num_carried_over,
            "num_solo_runs": self.num_solo_runs,
            "num_poisoned": self.num_poisoned,
            "engine": dict(self.engine),
        }


@dataclass(frozen=True)
class Health:
    """Liveness, as ``/healthz`` shows it."""

    state: EngineState
    loop_alive: bool  # the current engine's loop thread runs
    last_step_age_s: float | None  # since the last work step finished; None before the first
    last_loop_beat_age_s: float  # since the loop last showed progress (a step, or idling with no work)
    num_pending: int
    fatal_reason: str | None

    @property
    def healthy(self) -> bool:
        """Serving (or draining) with a live loop, or being rebuilt."""
        return self.state in LIVE_STATES and self.loop_alive or self.state == EngineState.REBUILDING

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": bool(self.healthy),
            "state": self.state.value,
            "loop_alive": self.loop_alive,
            "last_step_age_s": None if self.last_step_age_s is None else round(self.last_step_age_s, 3),
            "last_loop_beat_age_s": round(self.last_loop_beat_age_s, 3),
            "num_pending": self.num_pending,
            "fatal_reason": self.fatal_reason,
        }
