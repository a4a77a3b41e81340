"""Check a Redis URL's credentials once, up front, so a wrong password fails in a second with a
clear message. Without this check, Celery and kombu retry it like a network blip: a worker loads
its model and then retries the connection for minutes, and a client stalls for about 20 s before
it reports "Retry limit exceeded while trying to reconnect to the Celery result store backend".

Only refused credentials and failed TLS verification count as errors. An unreachable Redis is
reported and left to the usual retries, because Redis may simply not be up yet."""

from __future__ import annotations

from urllib.parse import urlsplit

from batchery.broker.connection import is_redis_url, redis_from_url
from batchery.contract.settings import mask_url


class RedisAuthError(ConnectionError):
    """Redis refused the credentials (or the TLS certificate) of a configured URL. The message
    names the setting and the URL with its password masked."""


def check_redis(url: str, setting: str, timeout: float = 5.0) -> str | None:
    """PING ``url`` once. Returns None if Redis answered, or a short reason if it could not be
    reached. Raises ``RedisAuthError`` if Redis refused the URL's password or user, asked for a
    password the URL lacks, or its TLS certificate failed verification. Non-Redis URLs are not
    checked."""
    import redis

    if not is_redis_url(url):
        return None
    shown = mask_url(url)
    client = None
    try:
        client = redis_from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        client.ping()
        return None
    except redis.AuthenticationError as exc:
        if urlsplit(url).password is None:
            raise RedisAuthError(
                f"Redis at {shown} requires a password and {setting} has none; use redis://:PASSWORD@host:port/db"
            ) from None
        raise RedisAuthError(f"Redis at {shown} refused the password in {setting}: {exc}") from None
    except redis.ResponseError as exc:
        if str(exc).startswith(("NOAUTH", "NOPERM", "WRONGPASS")):
            raise RedisAuthError(f"Redis at {shown} refused the credentials in {setting}: {exc}") from None
        return f"{type(exc).__name__}: {exc}"
    except (redis.RedisError, OSError) as exc:
        if "certificate verify failed" in str(exc):
            raise RedisAuthError(
                f"TLS verification failed for Redis at {shown} ({setting}): {exc}; "
                f"pass ssl_ca_certs=/path/to/ca.pem in the URL's query"
            ) from None
        return f"{type(exc).__name__}: {exc}"
    finally:
        if client is not None:
            client.close()
