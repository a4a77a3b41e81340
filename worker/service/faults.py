"""Fault injection for tests and for operators rehearsing failure. Off by default.

``BATCHERY_FAULTS`` is a comma list of ``kind:arg[:arg...]``:

- ``step_raise:N``        the Nth engine step of the process raises ``RuntimeError``, once;
- ``step_raise_every:N``  every Nth engine step raises (steps N, 2N, 3N, ...): a flaky engine;
- ``step_hang:N:S``       the Nth engine step sleeps S seconds (the watchdog should fire);
- ``rebuild_raise:N``     the next N engine rebuilds raise ``RuntimeError`` (to rehearse giving up);
- ``poison:TEXT``         any step whose batch holds a request whose prompt contains TEXT raises
                          (TEXT is taken as written and may hold ``:``, but not ``,``);
- ``oom:N``               the Nth engine step raises the accelerator's out-of-memory error
                          (``torch.OutOfMemoryError``), once: the engine shrinks its steps and goes on;
- ``exit_on:TEXT``        any step whose batch holds a request whose prompt contains TEXT ends the
                          process at once with ``os._exit(70)`` (no cleanup, no acks: like a segfault
                          or the OOM killer); TEXT as for ``poison``;
- ``tokenize_delay:S``    the engine loop sleeps S seconds before it tokenizes each request (a slow
                          tokenizer or chat template, or a huge prompt: work outside any step);
- ``result_raise:TEXT``   building the result of a finished request whose prompt contains TEXT raises
                          (a failure after its last step, outside any step); TEXT as for ``poison``;
- ``loop_raise:N[:C]``    the Nth time the engine loop takes new work from its inbox (and the C-1 times
                          after it; C is 1 by default), it raises before it applies any of it: a failure
                          outside any step and any request's own work (counted per process).

Steps are counted per process, across engine rebuilds, starting at 1. The engine service's
two-token canary after a rebuild is not a counted step and meets no fault. A new kind is one
parser function in ``PARSERS`` returning a ``Fault``; it sees each step's scheduled sequences
through ``StepContext``."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from batchery.worker.service.logprobs import Decoder

if TYPE_CHECKING:
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.sequence import Sequence

log = logging.getLogger("batchery.worker.faults")


class InjectedFault(RuntimeError):
    """Raised by an injected fault, so logs say plainly that the failure was rehearsed."""


@dataclass
class StepContext:
    """What a fault sees at the start of a step (called in the engine loop thread)."""

    step: int  # 1-based, per process
    seqs: list[Sequence]  # the scheduled engine sequences (.request_id, .token_ids, .num_prompt_tokens)
    engine: LLMEngine  # the engine (for .tokenizer, e.g. to decode seqs)
    abandoned: threading.Event  # set once the supervisor has given up on this step's engine
    prompt_text: Callable[[Sequence], str | None] | None = None  # a seq's prompt as the client sent it

    def text_of(self, seq: Sequence) -> str:
        """The prompt of ``seq`` as sent (the messages' contents, or the prompt), else decoded."""
        text = self.prompt_text(seq) if self.prompt_text is not None else None
        return text if text is not None else cast(Decoder, self.engine.tokenizer).decode(seq.prompt_token_ids)

    def holds(self, text: str) -> bool:
        """Whether a request of this step has ``text`` in its prompt."""
        return any(text in self.text_of(seq) for seq in self.seqs)


class Fault:
    """One injected fault. Hooks default to doing nothing. ``before_step`` runs at the start of
    each counted step; the others run on the engine loop thread outside any step: ``before_apply``
    when the loop takes new work from its inbox, ``before_tokenize`` and ``before_result`` with the
    prompt of the request (as sent; None for token ids) it tokenizes or whose result it builds."""

    spec: str = ""

    def before_step(self, ctx: StepContext) -> None:
        pass

    def before_rebuild(self, attempt: int) -> None:
        pass

    def before_apply(self) -> None:
        pass

    def before_tokenize(self, prompt_text: str | None) -> None:
        pass

    def before_result(self, prompt_text: str | None) -> None:
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
class StepRaiseEvery(Fault):
    every: int
    spec: str = ""

    def before_step(self, ctx: StepContext) -> None:
        if ctx.step % self.every == 0:
            raise InjectedFault(f"injected fault {self.spec!r}: engine step {ctx.step} raises")


@dataclass
class Poison(Fault):
    text: str
    spec: str = ""

    def before_step(self, ctx: StepContext) -> None:
        if ctx.holds(self.text):
            raise InjectedFault(
                f"injected fault {self.spec!r}: engine step {ctx.step} holds a poisoned "
                f"request ({len(ctx.seqs)} in the batch)"
            )


EXIT_ON_CODE = 70  # the exit status of a process ended by ``exit_on`` (EX_SOFTWARE)


@dataclass
class ExitOn(Fault):
    text: str
    spec: str = ""

    def before_step(self, ctx: StepContext) -> None:
        if ctx.holds(self.text):
            log.critical(
                "injected fault %r: engine step %d holds a request that ends the process (exit %d)",
                self.spec,
                ctx.step,
                EXIT_ON_CODE,
            )
            os._exit(EXIT_ON_CODE)


@dataclass
class OutOfMemory(Fault):
    at_step: int
    spec: str = ""
    fired: bool = False

    def before_step(self, ctx: StepContext) -> None:
        if not self.fired and ctx.step == self.at_step:
            self.fired = True
            import torch  # only a worker process (which has the engine loaded) gets here

            raise torch.OutOfMemoryError(
                f"injected fault {self.spec!r}: engine step {ctx.step} ran out of memory ({len(ctx.seqs)} sequences)"
            )


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
class TokenizeDelay(Fault):
    seconds: float
    spec: str = ""

    def before_tokenize(self, prompt_text: str | None) -> None:
        time.sleep(self.seconds)


@dataclass
class ResultRaise(Fault):
    text: str
    spec: str = ""

    def before_result(self, prompt_text: str | None) -> None:
        if prompt_text is not None and self.text in prompt_text:
            raise InjectedFault(f"injected fault {self.spec!r}: building the result of a poisoned request raises")


@dataclass
class LoopRaise(Fault):
    at: int
    count: int = 1
    spec: str = ""
    num_applies: int = field(default=0)

    def before_apply(self) -> None:
        self.num_applies += 1
        if self.at <= self.num_applies < self.at + self.count:
            raise InjectedFault(
                f"injected fault {self.spec!r}: the engine loop raises outside a step (taking new work, "
                f"time {self.num_applies})"
            )


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


def _text(spec: str, args: list[str], kind: str) -> str:
    """The TEXT of ``kind:TEXT`` (it may hold ``:``), refused when empty."""
    text = ":".join(args)
    if not text.strip():
        raise ValueError(f"fault {spec!r}: expected {kind}:TEXT with a non-empty TEXT")
    return text


def _step_raise(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 1, "step_raise:N")
    return StepRaise(_int(spec, args[0], "N"), spec=spec)


def _step_raise_every(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 1, "step_raise_every:N")
    return StepRaiseEvery(_int(spec, args[0], "N"), spec=spec)


def _poison(spec: str, args: list[str]) -> Fault:
    return Poison(_text(spec, args, "poison"), spec=spec)


def _exit_on(spec: str, args: list[str]) -> Fault:
    return ExitOn(_text(spec, args, "exit_on"), spec=spec)


def _oom(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 1, "oom:N")
    return OutOfMemory(_int(spec, args[0], "N"), spec=spec)


def _step_hang(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 2, "step_hang:N:SECONDS")
    return StepHang(_int(spec, args[0], "N"), _float(spec, args[1], "SECONDS"), spec=spec)


def _tokenize_delay(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 1, "tokenize_delay:SECONDS")
    return TokenizeDelay(_float(spec, args[0], "SECONDS"), spec=spec)


def _result_raise(spec: str, args: list[str]) -> Fault:
    return ResultRaise(_text(spec, args, "result_raise"), spec=spec)


def _loop_raise(spec: str, args: list[str]) -> Fault:
    if len(args) not in (1, 2):
        raise ValueError(f"fault {spec!r}: expected loop_raise:N or loop_raise:N:COUNT")
    count = _int(spec, args[1], "COUNT") if len(args) == 2 else 1
    return LoopRaise(_int(spec, args[0], "N"), count, spec=spec)


def _rebuild_raise(spec: str, args: list[str]) -> Fault:
    _nargs(spec, args, 1, "rebuild_raise:N")
    return RebuildRaise(_int(spec, args[0], "N"), spec=spec)


# kind -> parser(spec, args). Arguments are the ':'-separated fields after the kind; a kind that
# takes free text (e.g. poison:TEXT) can re-join them with ':'.
PARSERS: dict[str, Callable[[str, list[str]], Fault]] = {
    "step_raise": _step_raise,
    "step_raise_every": _step_raise_every,
    "step_hang": _step_hang,
    "rebuild_raise": _rebuild_raise,
    "poison": _poison,
    "oom": _oom,
    "exit_on": _exit_on,
    "tokenize_delay": _tokenize_delay,
    "result_raise": _result_raise,
    "loop_raise": _loop_raise,
}
FREE_TEXT_KINDS = ("poison", "exit_on", "result_raise")  # their TEXT is taken as written


def parse_faults(text: str | None) -> list[Fault]:
    """Parse ``BATCHERY_FAULTS``. Raises ``ValueError`` naming the bad entry."""
    faults: list[Fault] = []
    for raw in (text or "").split(","):
        spec = raw.strip()
        if not spec:
            continue
        kind, *args = spec.split(":")
        kind = kind.strip()
        parser = PARSERS.get(kind)
        if parser is None:
            raise ValueError(f"unknown fault {kind!r} in {spec!r}; known: {', '.join(sorted(PARSERS))}")
        # a TEXT is free text, taken as written; numeric arguments may carry spaces
        faults.append(parser(spec, args if kind in FREE_TEXT_KINDS else [a.strip() for a in args]))
    return faults
