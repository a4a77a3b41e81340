"""Batch lines in flight in this worker process: two copies of one line never run side by side here.

A line's message can be delivered twice (a chunk redelivered after a worker died and split into its lines while
another copy of one of them came back from the broker, a requeue racing a restore). Both copies would claim the
line (a claim renews the lease) and run it, and both would count a delivery (``batchery.tasks.redelivery``): one
death of the process then counted twice against the line, and two copies of a line that kills its worker were
dead-lettered twice, the entry naming one count and the line's ``engine_crash`` record (the first one written)
another.

So a copy that finds its line in flight here is acknowledged and skipped. Nothing is lost: the copy that runs ends
with the line's record, or queues its own message again (a retry, a requeue, a chunk's lines sent back one by
one), or dies with the process, and then its unacknowledged message comes back."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_held: set[tuple[str, int]] = set()


def take(job: str, lines: list[int]) -> list[int]:
    """Hold those of ``lines`` that no other copy holds in this process; returns them (in order)."""
    with _lock:
        mine = [n for n in lines if (job, n) not in _held]
        _held.update((job, n) for n in mine)
    return mine


def release(job: str, lines: list[int]) -> None:
    with _lock:
        _held.difference_update((job, n) for n in lines)
