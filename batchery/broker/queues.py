"""Queue key names on a Redis broker, as kombu's Redis transport spells them.

kombu keeps one Redis list per priority step for a queue: the queue's own name for step 0 and
``{queue}\\x06\\x16{step}`` for the others. The publisher, the lost-line recovery and the queue-depth
metric all need the same names; they come from here."""

from __future__ import annotations

from bisect import bisect

MIN_PRIORITY, MAX_PRIORITY = 0, 9


def clamp_priority(priority: int) -> int:
    """A Celery priority clamped to 0 (first) .. 9."""
    return max(MIN_PRIORITY, min(MAX_PRIORITY, int(priority)))


def queue_key(queue: str, priority: int) -> str:
    """The Redis list a message of ``priority`` waits in."""
    from kombu.transport.redis import PRIORITY_STEPS, Channel

    step = PRIORITY_STEPS[bisect(PRIORITY_STEPS, clamp_priority(priority)) - 1]
    return f"{queue}{Channel.sep}{step}" if step else queue


def queue_keys(queue: str) -> list[str]:
    """Every Redis list of ``queue``, highest priority first."""
    from kombu.transport.redis import PRIORITY_STEPS, Channel

    return [f"{queue}{Channel.sep}{step}" if step else queue for step in PRIORITY_STEPS]
