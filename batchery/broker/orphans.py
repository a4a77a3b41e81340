"""A dead worker's messages back on their queue within a minute, not after the visibility timeout.

kombu's Redis transport keeps every message a worker has taken and not yet acknowledged in its ``unacked`` hash
(delivery tag -> ``[message, exchange, routing key]``, the delivery time in ``unacked_index``), and gives it back
only when it has been held longer than the visibility timeout. That timeout must outlast the longest task
(Batchery's default is two hours), so a worker killed by the OOM killer or a SIGKILL left its messages, prefetched
or running, waiting two hours. For a big job that is the whole job: its window (``batchery.jobs.submit``) is made of
those lines, and nothing more is fed until they are recorded.

Who holds what: each worker's kombu channel records, next to ``unacked``, the worker holding each message
(``OWNERS_KEY``: delivery tag -> hostname; set right after kombu's own record, dropped in the same pipeline as
kombu drops its own: acknowledgement, rejection, restore), see ``batchery.worker.kombu_patches``.

Who restores: every worker, every ``SWEEP_EVERY_S`` (``Orphans.sweep``, a background chore). A message is given
back when its holder has been missing from the workers' presence (``batchery.broker.presence``: a live worker
announces itself every 5 s, for 20 s) at two sweeps at least ``CONFIRM_S`` apart, and it was delivered at least
``GRACE_S`` ago (a worker that has just started may not have announced itself yet). The move is one script per
message, which checks that the message and its holder are still what the sweep read: of two workers sweeping at
once, or a sweep and kombu's own restore, one moves it and the others do nothing. It goes to the head of its queue
(the list a consumer pops next, at its priority), flagged ``redelivered`` as kombu flags its restores; a message of
a dead worker's direct queue (prefix affinity) goes to the main queue. A worker sweeps only the messages of its own
queue: other queues have workers of their own.

Exactly once does not depend on this: a line's record is written once whoever runs it (``batchery.jobs.store``), so
a message given back while its holder was in fact alive costs a second run, never a second record. Messages without
a holder record (a worker of an older version, or one that died between kombu's record and its own) still come back
after the visibility timeout."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from batchery.broker import presence
from batchery.broker.affinity import direct_queue
from batchery.broker.queues import queue_key

log = logging.getLogger("batchery.orphans")

OWNERS_KEY = "batchery:unacked:owners"  # hash: delivery tag -> hostname of the worker holding the message
UNACKED_KEY, UNACKED_INDEX_KEY = "unacked", "unacked_index"  # kombu's (Channel.unacked_key, unacked_index_key)
SWEEP_EVERY_S = 10.0  # how often each worker looks
CONFIRM_S = 15.0  # a holder missing at two sweeps this far apart is gone (presence lets 20 s pass already)
GRACE_S = 60.0  # a message delivered more recently stays, whoever holds it
SCAN_COUNT = 1000  # owner entries a round trip reads

# KEYS: unacked, unacked_index, owners, the list to push to
# ARGV: delivery tag, the holder the sweep read, the message as the sweep read it, the message to push
# Returns 1 if the message moved, 0 if it was no longer held as read (acknowledged, restored or taken again).
# Promises: atomic; moves a message only while both its unacked entry and its holder are what the sweep read, and
#   then drops all three records of it (unacked, its index, its holder) with the push.
_RESTORE = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] or redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[3] then
  return 0
end
redis.call('RPUSH', KEYS[4], ARGV[4])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""

# KEYS: unacked, owners   ARGV: delivery tag, the holder the sweep read
# Returns 1 if the holder record was dropped: it named a message no longer held (acknowledged or restored).
_FORGET = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def record_owner(client, delivery_tag: str, hostname: str) -> None:
    """Say that ``hostname`` holds the message ``delivery_tag`` (kombu has just recorded it as unacked)."""
    client.hset(OWNERS_KEY, delivery_tag, hostname)


def drop_owner(pipe, delivery_tag: str):
    """Queue the holder record's removal on ``pipe`` (kombu's own removal pipeline); returns the pipe."""
    return pipe.hdel(OWNERS_KEY, delivery_tag)


def live_hostnames(r) -> set[str]:
    """Every worker live on any queue, by presence."""
    return {str(w.get("hostname")) for ws in presence.workers(r).values() for w in ws}


class Orphans:
    """One worker's sweeps of ``queue``'s messages held by workers that are gone."""

    def __init__(self, r, queue: str, hostname: str, *, confirm_s: float = CONFIRM_S, grace_s: float = GRACE_S):
        self.r, self.queue, self.hostname = r, queue, hostname
        self.confirm_s, self.grace_s = confirm_s, grace_s
        self.direct_prefix = direct_queue(queue, "")
        self.missing: dict[str, float] = {}  # holder -> when a sweep first found it missing (monotonic)
        self._restore = r.register_script(_RESTORE)
        self._forget = r.register_script(_FORGET)

    def sweep(self) -> int:
        """Give back the messages of this queue held by workers gone; returns how many moved."""
        live = live_hostnames(self.r) | {self.hostname}
        held: dict[str, list[str]] = {}  # holder missing from presence -> the tags it holds
        for tag, host in self.r.hscan_iter(OWNERS_KEY, count=SCAN_COUNT):
            host = _s(host)
            if host not in live:
                held.setdefault(host, []).append(_s(tag))
        now = time.monotonic()
        self.missing = {h: self.missing.get(h, now) for h in held}
        moved = 0
        for host, tags in held.items():
            if now - self.missing[host] >= self.confirm_s:
                moved += self._give_back(host, tags)
        return moved

    def _give_back(self, host: str, tags: list[str]) -> int:
        moved = 0
        for start in range(0, len(tags), SCAN_COUNT):
            piece = tags[start : start + SCAN_COUNT]
            with self.r.pipeline(transaction=False) as p:
                for tag in piece:
                    p.hget(UNACKED_KEY, tag)
                    p.zscore(UNACKED_INDEX_KEY, tag)
                replies = p.execute()
            wall = time.time()  # kombu scores deliveries with its clients' clocks
            for i, tag in enumerate(piece):
                raw, delivered = replies[2 * i], replies[2 * i + 1]
                if raw is None:
                    self._forget(keys=[UNACKED_KEY, OWNERS_KEY], args=[tag, host])
                elif delivered is None or wall - float(delivered) >= self.grace_s:  # no index entry: kombu never would
                    moved += self._move(host, tag, raw)
        if moved:
            log.warning(
                "worker %s is gone: %d messages it held (unacknowledged) are back on queue %s", host, moved, self.queue
            )
        return moved

    def _move(self, host: str, tag: str, raw: bytes | str) -> int:
        try:
            message, _exchange, routing_key = json.loads(raw)
            props = message.setdefault("properties", {})
        except (TypeError, ValueError, AttributeError):
            return 0  # not kombu's: left to the visibility timeout
        routing_key = str(routing_key)
        if routing_key.startswith(self.direct_prefix):
            target = self.queue  # a dead worker's direct queue has no consumer: the main queue
        elif routing_key == self.queue:
            target = routing_key
        else:
            return 0  # another queue's: its own workers sweep it
        message.setdefault("headers", {})["redelivered"] = True
        props.setdefault("delivery_info", {})["redelivered"] = True
        key = queue_key(target, props.get("priority") or 0)
        keys = [UNACKED_KEY, UNACKED_INDEX_KEY, OWNERS_KEY, key]
        return int(self._restore(keys=keys, args=[tag, host, raw, json.dumps(message)]))
