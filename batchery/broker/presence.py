"""Worker presence: which queues a live worker consumes, and with what model.

Each worker announces itself every few seconds in the broker's Redis, in one hash (``KEY``): field
``{queue}\\n{hostname}``, value ``{expires_at} {json}``, where ``expires_at`` is the Redis server's clock plus
the announcement's TTL and the JSON holds the worker's model, host and pid. A worker that stops withdraws its
field; one that dies is forgotten once its announcement expires (readers prune expired fields). One small hash
rather than a key per worker: a reader needs every queue's workers, and a ``SCAN`` for keys would walk a broker
Redis that may also hold millions of results.

A client waiting in vain (``ResultTimeout``) and ``batchery batch status`` use it to say when no worker has been
seen on a queue, and which queues do have workers (``absence_note``)."""

from __future__ import annotations

import json
from typing import Any

KEY = "batchery:workers"
ANNOUNCE_EVERY_S = 5.0  # a worker refreshes its announcement this often
ANNOUNCE_TTL_S = 20.0  # and it holds this long: a dead worker is forgotten within about 20 s
MAX_QUEUES_NAMED = 8  # queues named in a note

# KEYS: the hash   ARGV: field, ttl seconds, info JSON
_ANNOUNCE = """
local t = redis.call('TIME')
local expires = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.3f', expires) .. ' ' .. ARGV[3])
return 1
"""

# KEYS: the hash. Returns the live fields and values (flat), after deleting the expired ones.
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local all = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #all, 2 do
  local expires = tonumber(string.match(all[i + 1], '^(%S+)'))
  if expires and expires >= now then
    live[#live + 1] = all[i]
    live[#live + 1] = all[i + 1]
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return live
"""


def _field(queue: str, hostname: str) -> str:
    return f"{queue}\n{hostname}"


def announce(r, queue: str, hostname: str, info: dict[str, Any], ttl_s: float = ANNOUNCE_TTL_S) -> None:
    """Say that ``hostname`` consumes ``queue``, for ``ttl_s`` seconds (server time). ``info``: JSON-able."""
    body = json.dumps({**info, "queue": queue, "hostname": hostname}, separators=(",", ":"))
    r.register_script(_ANNOUNCE)(keys=[KEY], args=[_field(queue, hostname), repr(float(ttl_s)), body])


def withdraw(r, queue: str, hostname: str) -> None:
    """Forget ``hostname``'s announcement for ``queue`` (the worker stopped consuming)."""
    r.hdel(KEY, _field(queue, hostname))


def workers(r) -> dict[str, list[dict[str, Any]]]:
    """The live workers by queue: ``{queue: [{"hostname", "model", "host", "pid", ...}, ...]}``."""
    flat = r.register_script(_LIVE)(keys=[KEY])
    out: dict[str, list[dict[str, Any]]] = {}
    for i in range(0, len(flat), 2):
        raw = flat[i + 1].decode() if isinstance(flat[i + 1], bytes) else str(flat[i + 1])
        try:
            info = json.loads(raw.split(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if isinstance(info, dict) and isinstance(info.get("queue"), str):
            out.setdefault(info["queue"], []).append(info)
    return out


def absence_note(live: dict[str, list[dict[str, Any]]], queue: str) -> str | None:
    """None when a worker has been seen on ``queue``; else a sentence naming the queue and the queues that do
    have workers, with their models, e.g. ``no worker has been seen on queue 'batchery.a' (workers are consuming:
    'batchery.b' (model /models/b)); check BATCHERY_MODEL / BATCHERY_QUEUE``."""
    if live.get(queue):
        return None
    others = sorted(q for q in live if q != queue)
    if others:
        named = []
        for q in others[:MAX_QUEUES_NAMED]:
            models = sorted({str(w.get("model") or "?") for w in live[q]})
            named.append(f"'{q}' (model {', '.join(models)})")
        more = f" and {len(others) - MAX_QUEUES_NAMED} more" if len(others) > MAX_QUEUES_NAMED else ""
        where = f"workers are consuming: {', '.join(named)}{more}"
    else:
        where = "no worker has been seen on any queue"
    return f"no worker has been seen on queue '{queue}' ({where}); check BATCHERY_MODEL / BATCHERY_QUEUE"


def summary(live: dict[str, list[dict[str, Any]]], queue: str) -> dict[str, Any]:
    """``{"queue", "seen", "workers", "other_queues": {queue: [models]}}`` for ``batchery batch status --json``."""
    return {
        "queue": queue,
        "seen": len(live.get(queue, [])),
        "workers": live.get(queue, []),
        "other_queues": {
            q: sorted({str(w.get("model") or "?") for w in ws}) for q, ws in sorted(live.items()) if q != queue
        },
    }
