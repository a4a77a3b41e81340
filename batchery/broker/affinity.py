"""Prefix affinity: the lines of a batch job that share a prompt prefix run on one worker of their queue.

The submitter sorts a job's lines by prefix (``batchery.jobs.submit``), so a document's questions are consecutive
in the queue; but with several workers on one queue kombu's ``BRPOP`` hands consecutive messages to each worker in
turn, and each computes the document. So each line message carries a short hash of its prefix (``PREFIX_HEADER``),
and a group of lines with one hash belongs, for a while, to the worker that started one of them first:

- **Ownership is a lease.** A worker starting a line claims its group (``SET NX`` of ``{queue}.affinity.g.{hash}``
  with a ``LEASE_S`` TTL, refreshed by each line of the group it starts). A worker that finds another worker owning
  the group forwards the message there instead of running it.
- **Each worker has a direct queue** (``{queue}.w.{hostname}``), which it consumes beside the main queue, listed in
  the queue's registry (a Redis set, ``{queue}.affinity.workers``) while it consumes. Forwarding ``LPUSH``es a copy
  of the message (same task id, kwargs and headers, a fresh delivery tag, ``HOPS_HEADER`` one more) onto the
  owner's direct queue, in a script that does so only while the owner is registered and its queue is not longer
  than a bound; the task then returns (its own copy is acknowledged). A copy first, the ack after: at worst a
  duplicate, which the job store records once, never a loss. A message that has hopped ``MAX_HOPS`` times runs
  where it is, and so does every line whose owner is not registered or has a bound's worth waiting; a group whose
  owner's presence has expired is taken over by the worker that claims it next.
- **Nothing is stranded.** A worker retires at its warm shutdown (``retire``: out of the registry and its direct
  queue moved back to the head of the main queue, in one script); every live worker's chore (``Affinity.refresh``,
  from ``batchery.worker.background``) retires the registered workers whose presence (``batchery.broker.presence``)
  has expired, so a killed worker's waiting lines go back to the main queue within about ``ANNOUNCE_TTL_S``. A
  forwarded message's ``delivery_info`` still names the main queue, so kombu's restore of an unacknowledged one
  (a worker died running it) puts it on the main queue too.

Cost: one script call per line started (a ``GET``, and a ``SET``/``HGET`` on the broker's Redis), whatever the
number of workers, and one more per line forwarded. A worker's cached view of who is live would spare the single
worker that call, but a worker that has just joined would go unseen for a refresh interval, and a job submitted as
the workers become ready (``batchery run``, benchmarks, autoscaling) would be split in that time. Every Redis
failure here is logged and the line runs where it is."""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

from batchery.broker import presence
from batchery.broker.queues import queue_key, queue_keys

log = logging.getLogger("batchery.affinity")

PREFIX_HEADER = "batchery_prefix"  # message header: the prefix group (first hex digits of a sha256)
HOPS_HEADER = "batchery_hops"  # message header: how many times the message was forwarded
MAX_HOPS = 1  # a message forwarded this often runs where it lands
PREFIX_HASH_CHARS = 16
LEASE_S = 30.0  # a group stays its owner's this long after the owner last started one of its lines
MOVE_BATCH = 1000  # messages one retire call moves

# KEYS: the group's lease, the presence hash   ARGV: me, ttl ms, the presence field's prefix ("{queue}\n").
# The group's owner after the call: me (a new or refreshed lease, or one taken over from a worker whose presence
# has expired), or another live worker.
_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then
  local seen = redis.call('HGET', KEYS[2], ARGV[3] .. cur)
  local expires = seen and tonumber(string.match(seen, '^(%S+)'))
  local t = redis.call('TIME')
  if expires and expires >= tonumber(t[1]) + tonumber(t[2]) / 1e6 then return cur end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""

# KEYS: the registry, the owner's direct queue list (the message's priority)
# ARGV: owner, max messages waiting, the message. 1 if pushed.
_FORWARD = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[2]) then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[3])
return 1
"""

# KEYS: the registry, kombu's binding set of the direct queue, then pairs (direct list, main list), one per priority
# ARGV: hostname, max messages moved. Unregisters the worker, then moves its waiting messages to the head of the
# main queue (oldest nearest the head, as they would have been taken); returns how many moved, -1 if more wait.
_RETIRE = """
redis.call('SREM', KEYS[1], ARGV[1])
local max = tonumber(ARGV[2])
local moved = 0
for i = 3, #KEYS, 2 do
  while moved < max do
    local m = redis.call('LPOP', KEYS[i])
    if not m then break end
    redis.call('RPUSH', KEYS[i + 1], m)
    moved = moved + 1
  end
end
if moved >= max then return -1 end
redis.call('DEL', KEYS[2])
return moved
"""


def prefix_hash(key: str) -> str:
    """The group of lines whose shared prompt prefix is ``key`` (``batchery.jobs.grouping.prefix_group``): hex digits
    of its sha256."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:PREFIX_HASH_CHARS]


def direct_queue(queue: str, hostname: str) -> str:
    """The queue only ``hostname`` consumes, beside ``queue``."""
    return f"{queue}.w.{hostname}"


def registry_key(queue: str) -> str:
    return f"{queue}.affinity.workers"


def lease_key(queue: str, group: str) -> str:
    return f"{queue}.affinity.g.{group}"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def retire(broker, queue: str, hostname: str) -> int:
    """Take ``hostname`` out of ``queue``'s registry and move its direct queue's messages back to the head of the
    main queue; returns how many moved."""
    direct = direct_queue(queue, hostname)
    keys = [registry_key(queue), f"_kombu.binding.{direct}"]
    for src, dst in zip(queue_keys(direct), queue_keys(queue), strict=True):
        keys += [src, dst]
    script = broker.register_script(_RETIRE)
    total = 0
    while True:
        n = int(script(keys=keys, args=[hostname, MOVE_BATCH]))
        if n >= 0:
            return total + n
        total += MOVE_BATCH


class Affinity:
    """One worker's side of prefix affinity on ``queue`` (see the module docstring). Thread-safe: task threads call
    ``route``, the worker's chore ``refresh``."""

    def __init__(self, broker, app, queue: str, hostname: str, max_waiting: int, lease_s: float = LEASE_S) -> None:
        self.r = broker
        self.app = app
        self.queue = queue
        self.hostname = hostname
        self.direct = direct_queue(queue, hostname)
        self.max_waiting = max(1, int(max_waiting))
        self.lease_ms = max(1, int(lease_s * 1000))
        self._claim = broker.register_script(_CLAIM)
        self._forward = broker.register_script(_FORWARD)
        self._builders: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self.live: frozenset[str] = frozenset()  # hostnames live on the queue, as the last refresh saw them
        self._failing = False

    # -- the chore -----------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Register this worker, read who is live on the queue, retire the registered workers that are not."""
        self.r.sadd(registry_key(self.queue), self.hostname)
        live = {str(w.get("hostname")) for w in presence.workers(self.r).get(self.queue, [])}
        live.add(self.hostname)
        if frozenset(live) != self.live:
            log.info("prefix affinity: %d workers live on queue %s", len(live), self.queue)
        self.live = frozenset(live)
        for member in self.r.smembers(registry_key(self.queue)):
            name = _s(member)
            if name not in live:
                moved = retire(self.r, self.queue, name)
                log.warning(
                    "prefix affinity: worker %s is gone; %d messages of its direct queue are back on %s",
                    name,
                    moved,
                    self.queue,
                )

    def retire(self) -> int:
        """This worker stops consuming: unregister it, its waiting messages back to the main queue."""
        moved = retire(self.r, self.queue, self.hostname)
        if moved:
            log.info("prefix affinity: %d messages of this worker's direct queue are back on %s", moved, self.queue)
        return moved

    # -- the task's side -----------------------------------------------------------------------------
    def route(self, request, task_name: str, kwargs: dict, priority: int, headers: dict | None = None) -> str | None:
        """Where the line of ``request`` runs: None here (its group is this worker's, or its owner is gone, does
        not take forwarded lines or has enough waiting, or the line hopped enough), else the hostname of the owner
        it was forwarded to. Never raises."""
        group = getattr(request, PREFIX_HEADER, None)
        if not group:
            return None
        try:
            return self._route(request, task_name, kwargs, priority, str(group), headers)
        except Exception as exc:  # noqa: BLE001 - affinity is an optimisation: the line runs here
            if not self._failing:
                log.warning("prefix affinity failed (%s: %s); lines run where they land", type(exc).__name__, exc)
                self._failing = True
            return None

    def _route(
        self, request, task_name: str, kwargs: dict, priority: int, group: str, headers: dict | None = None
    ) -> str | None:
        key = lease_key(self.queue, group)
        owner = _s(self._claim(keys=[key, presence.KEY], args=[self.hostname, self.lease_ms, f"{self.queue}\n"]))
        self._failing = False
        if owner == self.hostname:
            return None
        hops = _hops(request)
        if hops >= MAX_HOPS:
            return None
        message = self._builder(task_name, priority).build(
            request.id,
            kwargs,
            f"{{'job': '{kwargs.get('job')}', 'line': {kwargs.get('line')}}}",
            headers={**(headers or {}), PREFIX_HEADER: group, HOPS_HEADER: hops + 1},
            enqueued_at=_float(getattr(request, "batchery_enqueued_at", None)),
        )
        target = queue_key(direct_queue(self.queue, owner), priority)
        pushed = self._forward(keys=[registry_key(self.queue), target], args=[owner, self.max_waiting, message])
        return owner if int(pushed) else None

    def _builder(self, task_name: str, priority: int):
        from batchery.broker.publish import MessageBuilder

        with self._lock:
            b = self._builders.get((task_name, priority))
            if b is None:
                b = self._builders[(task_name, priority)] = MessageBuilder(self.app, task_name, self.queue, priority)
            return b


def _hops(request) -> int:
    try:
        return max(0, int(getattr(request, HOPS_HEADER, 0) or 0))
    except (TypeError, ValueError):
        return MAX_HOPS  # a header we cannot read: do not forward


def _float(v) -> float | None:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None
