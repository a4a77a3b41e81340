"""Check a Redis URL's credentials once, up front, so a wrong password fails in a second with a
clear message. Without this check, Celery and kombu retry it like a network blip: a worker loads
its model and then retries the connection for minutes, and a client stalls for about 20 s before
it reports "Retry limit exceeded while trying to reconnect to the Celery result store backend".

Only refused credentials, failed TLS verification and a ``sentinel://`` URL that cannot work (it does
not parse, or no sentinel monitors its ``master_name``) count as errors. An unreachable Redis, or a
Sentinel with no master right now (a failover under way), is reported and left to the usual retries,
because Redis may simply not be up yet."""

from __future__ import annotations

from urllib.parse import urlsplit

from batchery.broker.connection import (
    is_redis_url,
    is_sentinel_url,
    parse_sentinel_url,
    redis_from_url,
    sentinel_node_kwargs,
)
from batchery.contract.settings import mask_url


class RedisAuthError(ConnectionError):
    """Redis refused the credentials (or the TLS certificate) of a configured URL. The message
    names the setting and the URL with its password masked."""


class SentinelConfigError(RedisAuthError):
    """A ``sentinel://`` URL that no retry can make work: it does not parse, or the sentinels that
    answer monitor no master of its ``master_name``."""


def _unknown_master(url: str) -> str | None:
    """For a sentinel URL whose master was not found: the names the sentinels do monitor, if some
    sentinel answered and none knows ``master_name`` (else None: a failover may be under way)."""
    import redis

    s = parse_sentinel_url(url)
    known: set[str] = set()
    answered = False
    for host, port in s.sentinels:
        node = redis.Redis(host, port, **sentinel_node_kwargs())
        try:
            known.update(node.sentinel_masters())
            answered = True
        except redis.RedisError:
            continue
        finally:
            node.close()
    if answered and s.master_name not in known:
        return ", ".join(sorted(known)) or "none"
    return None


def check_redis(url: str, setting: str, timeout: float = 5.0) -> str | None:
    """PING ``url`` once. Returns None if Redis answered, or a short reason if it could not be
    reached. Raises ``RedisAuthError`` if Redis refused the URL's password or user, asked for a
    password the URL lacks, or its TLS certificate failed verification; ``SentinelConfigError`` (a
    ``RedisAuthError``) for a ``sentinel://`` URL that does not parse or whose ``master_name`` no
    answering sentinel monitors. Non-Redis URLs are not checked."""
    import redis
    import redis.sentinel

    if not is_redis_url(url):
        return None
    shown = mask_url(url)
    sentinel = is_sentinel_url(url)
    if sentinel:
        try:
            password = parse_sentinel_url(url).password
        except ValueError as exc:
            raise SentinelConfigError(f"{setting}: {exc}") from None
    else:
        password = urlsplit(url).password
    client = None
    try:
        client = redis_from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        client.ping()
        return None
    except redis.AuthenticationError as exc:
        if password is None:
            form = (
                "sentinel://:PASSWORD@host:26379/db;sentinel://host2:26379?master_name=NAME"
                if sentinel
                else "redis://:PASSWORD@host:port/db"
            )
            raise RedisAuthError(f"Redis at {shown} requires a password and {setting} has none; use {form}") from None
        raise RedisAuthError(f"Redis at {shown} refused the password in {setting}: {exc}") from None
    except redis.ResponseError as exc:
        if str(exc).startswith(("NOAUTH", "NOPERM", "WRONGPASS")):
            raise RedisAuthError(f"Redis at {shown} refused the credentials in {setting}: {exc}") from None
        return f"{type(exc).__name__}: {exc}"
    except (redis.RedisError, OSError) as exc:
        if sentinel and isinstance(exc, redis.sentinel.MasterNotFoundError):
            known = _unknown_master(url)
            if known is not None:
                raise SentinelConfigError(
                    f"no sentinel of {shown} ({setting}) monitors a master named "
                    f"{parse_sentinel_url(url).master_name!r}; they monitor: {known}"
                ) from None
        if "certificate verify failed" in str(exc):
            raise RedisAuthError(
                f"TLS verification failed for Redis at {shown} ({setting}): {exc}; "
                f"pass ssl_ca_certs=/path/to/ca.pem in the URL's query"
            ) from None
        return f"{type(exc).__name__}: {exc}"
    finally:
        if client is not None:
            client.close()
