"""Redis connections: clients from URLs as Celery and kombu spell them, and riding out outages.

Every Redis client of ours (the job store, strike counters, the queue-depth metric, lost-line
recovery, the credential check) comes from ``redis_from_url``; every loop that waits out a Redis
outage is ``retry_through_outage``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("batchery.redis")

T = TypeVar("T")

REDIS_SCHEMES = ("redis", "rediss", "redis+socket", "socket", "unix")
REDIS_SOCKET_TIMEOUT_S = 5.0  # one command (or connect) waits at most this long: a paused Redis never blocks us


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis server (TCP, TLS or a Unix socket)."""
    return url.split("://", 1)[0] in REDIS_SCHEMES


def _logging_retry(retries: int = 6) -> Any:
    """redis-py's ``Retry`` (exponential backoff, 0.05 s doubling to 1.6 s: about 3 s in all) that
    says in the log when a command meets an outage and when it gets through again."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import AuthenticationError
    from redis.retry import Retry

    class LoggingRetry(Retry):
        def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[no-untyped-def]
            failures = [0]

            def retryable(error: Exception) -> bool:
                # refused credentials are a ConnectionError to redis-py, but no retry can fix them
                if isinstance(error, AuthenticationError):
                    return False
                return is_retryable is None or bool(is_retryable(error))

            def on_fail(error: Exception, count: int) -> Any:
                failures[0] = count
                if count == 1:
                    log.warning(
                        "Redis unavailable (%s); reconnecting with backoff (up to %d tries)", error, self._retries
                    )
                return fail(error, count) if with_failure_count else fail(error)

            result = super().call_with_retry(do, on_fail, retryable, with_failure_count=True)
            if failures[0]:
                log.warning("Redis reconnected after %d retries", failures[0])
            return result

    return LoggingRetry(ExponentialBackoff(cap=1.6, base=0.05), retries)


def redis_from_url(url: str, **kwargs: Any) -> Any:
    """A redis-py client for a Redis URL as Celery and kombu spell it (``redis://``, ``rediss://``,
    ``redis+socket:///path``, ``unix:///path``). Each command rides out a short outage (a restart,
    an AOF still loading) with up to 6 retries and exponential backoff, about 3 s in all, and says
    so in the log. Every socket operation has a timeout (``REDIS_SOCKET_TIMEOUT_S``), so a Redis that
    stops answering with its TCP connection still up (paused, or a network partition) fails a command
    within about 7 timeouts instead of blocking the caller for ever; connections use TCP keepalive.
    Callers may pass their own values. (redis-py's ``health_check_interval`` is not used: with it, a
    URL without the password Redis wants took 37 s to fail instead of under 5.)"""
    import redis

    kwargs.setdefault("retry", _logging_retry())
    kwargs.setdefault("socket_timeout", REDIS_SOCKET_TIMEOUT_S)
    kwargs.setdefault("socket_connect_timeout", REDIS_SOCKET_TIMEOUT_S)
    kwargs.setdefault("socket_keepalive", True)
    parts = urlsplit(url)
    if parts.scheme in ("redis+socket", "socket"):
        q = parse_qs(parts.query)
        return redis.Redis(
            unix_socket_path=parts.path,
            password=parts.password,
            username=parts.username or None,
            db=int(q.get("virtual_host", q.get("db", ["0"]))[0] or 0),
            **kwargs,
        )
    return redis.Redis.from_url(url, **kwargs)


def retry_through_outage(
    fn: Callable[[], T],
    what: str,
    *,
    attempts: int | None = None,
    deadline: float | None = None,
    first_delay: float = 0.5,
    max_delay: float = 10.0,
    logger: logging.Logger = log,
) -> T:
    """``fn()``, called again with exponential backoff while Redis is unreachable, saying so in the log
    (``what`` names the work: "storing line 3 of batch_..."). Gives up, re-raising the error, after
    ``attempts`` calls or at ``deadline`` (``time.monotonic()``); with neither it waits forever. Only
    for idempotent work: a retry after a lost reply runs ``fn`` twice."""
    import redis

    delay, since, tries = first_delay, None, 0
    while True:
        tries += 1
        try:
            result = fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            now = time.monotonic()
            since = since if since is not None else now
            if (attempts is not None and tries >= attempts) or (deadline is not None and now >= deadline):
                raise
            wait = delay if deadline is None else max(0.0, min(delay, deadline - now))
            logger.warning("Redis unavailable while %s (%s); retrying in %.1f s", what, exc, wait)
            time.sleep(wait)
            delay = min(delay * 2, max_delay)
            continue
        if since is not None:
            logger.warning("Redis is back: reconnected after %.1f s (%s)", time.monotonic() - since, what)
        return result
