"""Redis connections: clients from URLs as Celery and kombu spell them, and riding out outages.

Every Redis client of ours (the job store, strike counters, the queue-depth metric, lost-line
recovery, the credential check) comes from ``redis_from_url``; every loop that waits out a Redis
outage is ``retry_through_outage``.

**Redis Sentinel.** A ``sentinel://`` URL names the sentinels and the master they watch::

    sentinel://[[USER]:PASSWORD@]HOST[:PORT][/DB][;sentinel://HOST2[:PORT]...]?master_name=NAME

``;`` separates the sentinels (port 26379 by default); ``master_name`` (required) is the name in the
sentinels' ``sentinel monitor`` line. The password, user and database are the Redis master's (not the
sentinels'): give them on the first sentinel (or on each, alike). ``redis_from_url`` returns a client of
the current master that follows a failover (``parse_sentinel_url``); ``make_celery`` hands Celery the
same URL without its query, and ``master_name`` as a transport option (``celery_sentinel``)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

log = logging.getLogger("batchery.redis")

T = TypeVar("T")

REDIS_SCHEMES = ("redis", "rediss", "redis+socket", "socket", "unix", "sentinel")
REDIS_SOCKET_TIMEOUT_S = 5.0  # one command (or connect) waits at most this long: a paused Redis never blocks us
SENTINEL_DEFAULT_PORT = 26379


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis server (TCP, TLS, a Unix socket, or the master of a Sentinel)."""
    return url.split("://", 1)[0] in REDIS_SCHEMES


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Redis master through its sentinels (``sentinel://``)."""
    return url.split("://", 1)[0] == "sentinel"


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``sentinel://`` URL (see the module docstring)."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int
    username: str | None
    password: str | None
    celery_url: str  # as kombu and Celery take it: each sentinel with the credentials and db, no query


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``sentinel://...;sentinel://...?master_name=NAME``. Raises ``ValueError`` naming the
    problem (never showing a password) for a URL without ``master_name``, with another query
    parameter, or whose sentinels disagree on the credentials or the database."""
    from batchery.contract.settings import mask_url

    sentinels: list[tuple[str, int]] = []
    master_names: set[str] = set()
    userinfos: set[str] = set()
    dbs: set[str] = set()
    for part in url.split(";"):
        part = part.strip()
        if not part:
            continue
        try:
            p = urlsplit(part)
            port = p.port or SENTINEL_DEFAULT_PORT
        except ValueError as exc:
            raise ValueError(f"bad sentinel address {mask_url(part)!r}: {exc}") from None
        if p.scheme != "sentinel" or not p.hostname:
            raise ValueError(f"{mask_url(part)!r} is no sentinel address; expected sentinel://[:PASSWORD@]HOST[:PORT]")
        for key, values in parse_qs(p.query, keep_blank_values=True).items():
            if key != "master_name":
                raise ValueError(f"sentinel URL: unknown query parameter {key!r} (only master_name is understood)")
            master_names.update(v for v in values if v)
        sentinels.append((p.hostname, port))
        userinfo = p.netloc.rpartition("@")[0] if "@" in p.netloc else ""
        if userinfo:
            userinfos.add(userinfo)
        db = p.path.strip("/")
        if db:
            dbs.add(db)
    if not sentinels:
        raise ValueError("sentinel URL names no sentinel")
    if len(master_names) != 1:
        raise ValueError(
            f"sentinel URL {mask_url(url)!r} needs exactly one ?master_name=NAME (the name in the sentinels' "
            f"'sentinel monitor' line), got {len(master_names)}"
        )
    if len(userinfos) > 1:
        raise ValueError("the sentinel addresses of one URL carry different credentials; give them once, on the first")
    if len(dbs) > 1:
        raise ValueError(f"the sentinel addresses of one URL name different databases ({', '.join(sorted(dbs))})")
    db_text = dbs.pop() if dbs else "0"
    if not db_text.isdigit():
        raise ValueError(f"sentinel URL: the database must be a number, got {db_text!r}")
    userinfo = userinfos.pop() if userinfos else ""
    user, _, password = userinfo.partition(":")
    prefix = f"{userinfo}@" if userinfo else ""
    celery_url = ";".join(
        f"sentinel://{prefix}{f'[{h}]' if ':' in h else h}:{port}/{int(db_text)}" for h, port in sentinels
    )
    return SentinelURL(
        sentinels=tuple(sentinels),
        master_name=master_names.pop(),
        db=int(db_text),
        username=unquote(user) or None,
        password=unquote(password) if userinfo and ":" in userinfo else None,
        celery_url=celery_url,
    )


def sentinel_node_kwargs() -> dict[str, Any]:
    """Connection options for the sentinels themselves (not the master): the same timeouts as every
    client of ours, so a sentinel that stops answering cannot block a failover's discovery."""
    return {
        "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": REDIS_SOCKET_TIMEOUT_S,
        "socket_keepalive": True,
    }


def celery_sentinel(url: str | None) -> tuple[str | None, dict[str, Any]]:
    """``(url, transport options)`` for Celery: a ``sentinel://`` URL without our query, and its
    ``master_name`` (with the sentinels' timeouts); any other URL as it is, with no options."""
    if not url or not is_sentinel_url(url):
        return url, {}
    s = parse_sentinel_url(url)
    return s.celery_url, {"master_name": s.master_name, "sentinel_kwargs": sentinel_node_kwargs()}


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
    URL without the password Redis wants took 37 s to fail instead of under 5.)

    A ``sentinel://`` URL (module docstring) gives a client of the master its sentinels name now: each
    new connection asks them, and a connection to a master that was demoted (``READONLY``) or that died
    fails as a ``ConnectionError``, so the retries above (and ``retry_through_outage``) land on the
    promoted replica once the sentinels have failed over. Closing the client closes its connections
    to the sentinels too."""
    import redis

    kwargs.setdefault("retry", _logging_retry())
    kwargs.setdefault("socket_timeout", REDIS_SOCKET_TIMEOUT_S)
    kwargs.setdefault("socket_connect_timeout", REDIS_SOCKET_TIMEOUT_S)
    kwargs.setdefault("socket_keepalive", True)
    if is_sentinel_url(url):
        return _sentinel_master(parse_sentinel_url(url), kwargs)
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


@functools.cache
def _sentinel_master_class() -> type:
    import redis

    class SentinelMaster(redis.Redis):
        """A client of the master a Sentinel names; ``close`` also closes the sentinel connections."""

        sentinel: Any = None

        def close(self) -> None:
            try:
                super().close()
            finally:
                if self.sentinel is not None:
                    self.sentinel.close()

    return SentinelMaster


@functools.cache
def _sentinel_connection_class() -> type:
    from redis.sentinel import SentinelManagedConnection

    class FollowingConnection(SentinelManagedConnection):
        """A master connection that asks the sentinels where the master is whenever it reconnects.
        redis-py's retry of a failed command reconnects through ``send_packed_command``, which goes
        to the address the connection had (the dead master) and not through ``connect``, which asks
        the sentinels: a command cut off by a failover failed after all its retries."""

        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if not self._sock:
                self.connect()
            super().send_packed_command(command, check_health)

    return FollowingConnection


def _sentinel_master(s: SentinelURL, kwargs: dict[str, Any]) -> Any:
    from redis.sentinel import Sentinel

    kwargs.setdefault("connection_class", _sentinel_connection_class())
    node_kwargs = {k: v for k, v in kwargs.items() if k.startswith("socket_")} or sentinel_node_kwargs()
    sentinel = Sentinel(list(s.sentinels), sentinel_kwargs=node_kwargs)
    client = sentinel.master_for(
        s.master_name, redis_class=_sentinel_master_class(), db=s.db, username=s.username, password=s.password, **kwargs
    )
    client.sentinel = sentinel
    return client


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
