"""Fault injection for tests and for operators rehearsing failure. Off by default.

``BATCHERY_FAULTS`` is a comma list of ``kind:arg[:arg...]``:

- ``step_raise:N``     the Nth engine step of the process raises ``RuntimeError``, once;
- ``step_hang:N:S``    the Nth engine step sleeps S seconds (the watchdog should fire);
- ``rebuild_raise:N``  the next N engine rebuilds raise ``RuntimeError`` (to rehearse giving up).

Steps are counted per process, across engine rebuilds, starting at 1. A new kind is one parser
function in ``PARSERS`` returning a ``Fault``; it sees each step's scheduled sequences through
``StepContext`` (e.g. a future ``poison:TEXT`` decodes ``ctx.seqs`` and raises on a match)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


log = logging.getLogger("batchery.worker.faults")


class InjectedFault(RuntimeError):
    """Raised by an injected fault, so logs say plainly that the failure was rehearsed."""


@dataclass
class StepContext:
    """What a fault sees at the start of a step (called in the engine loop thread)."""

    step: int  # 1-based, per process
    seqs: list  # the scheduled engine Sequence objects (.request_id, .token_ids, .num_prompt_tokens)
    engine: object  # the LLMEngine (for .tokenizer, e.g. to decode seqs)
    abandoned: threading.Event  # set once the supervisor has given up on this step's engine


class Fault:
    """One injected fault. Hooks default to doing nothing."""

    spec: str = ""

    def before_step(self, ctx: StepContext) -> None:
        pass

    def before_rebuild(self, attempt: int) -> None:
        pass


@dataclass
class StepRaise(Fault):
    at_step: int
    spec: str = ""
    fired: bool = False

    def before_step(self, ctx: StepContext) -> None:
        if not self.fired and ctx.step == self.at_step:
            self.fired = True
            raise InjectedFault(f"injected fault {self.spec!r}: engine step {ctx.step} raises")


@dataclass
class StepHang(Fault):
    at_step: int
    seconds: float
    spec: str = ""

    def before_step(self, ctx: StepContext) -> None:
        if ctx.step == self.at_step:
            log.warning("injected fault %r: engine step %d hangs for %g s", self.spec, ctx.step, self.seconds)
            # wake early if the supervisor abandons this engine, so the thread ends promptly
            ctx.abandoned.wait(self.seconds)


@dataclass
class RebuildRaise(Fault):
    count: int
    spec: str = ""
    num_raised: int = field(default=0)

    def before_rebuild(self, attempt: int) -> None:
        if self.num_raised < self.count:
            self.num_raised += 1
            raise InjectedFault(f"injected fault {self.spec!r}: engine rebuild {self.num_raised} raises")


def _int(spec: str, value: str, what: str, minimum: int = 1) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"fault {spec!r}: {what} must be an integer, got {value!r}") from None
    if n < minimum:
        raise ValueError(f"fault {spec!r}: {what} must be >= {minimum}, got {n}")
    return n


def _float(spec: str, value: str, what: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"fault {spec!r}: {what} must be a number, got {value!r}") from None
    if not x >= 0:
        raise ValueError(f"fault {spec!r}: {what} must be >= 0, got {x}")
    return x


def _nargs(spec: str, args: list[str], n: int, usage: str) -> None:
    if len(args) != n:
        raise ValueError(f"fault {spec!r}: expected {usage}")


def _step_raise(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 1, "step_raise:N")
    return StepRaise(_int(spec, args[0], "N"), spec=spec)


def _step_hang(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 2, "step_hang:N:SECONDS")
    return StepHang(_int(spec, args[0], "N"), _float(spec, args[1], "SECONDS"), spec=spec)


def _rebuild_raise(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 1, "rebuild_raise:N")
    return RebuildRaise(_int(spec, args[0], "N"), spec=spec)


# kind -> parser(spec, args). Arguments are the ':'-separated fields after the kind; a kind that
# takes free text (e.g. poison:TEXT) can re-join them with ':'.
PARSERS: dict[str, Callable[[str, list[str]], Fault]] = {
    "step_raise": _step_raise,
    "step_hang": _step_hang,
    "rebuild_raise": _rebuild_raise,
}


def parse_faults(text: str | None) -> list[Fault]:
    """Parse ``BATCHERY_FAULTS``. Raises ``ValueError`` naming the bad entry."""
    faults: list[Fault] = []
    for raw in (text or "").split(","):
        spec = raw.strip()
        if not spec:
            continue
        kind, *args = spec.split(":")
        parser = PARSERS.get(kind.strip())
        if parser is None:
            raise ValueError(f"unknown fault {kind!r} in {spec!r}; known: {', '.join(sorted(PARSERS))}")
        faults.append(parser(spec, [a.strip() for a in args]))
    return faults
