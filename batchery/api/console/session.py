"""Who is looking at the web console, from its cookie; the login, the CSRF token and the checks every request passes.

- **The key** is posted once to ``/login`` (a form body, never a URL) and kept in the ``batchery_console`` cookie:
  ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page sends it), ``Path=/``, ``Secure`` when
  the request came over https. Every request checks it again against the configured keys, so a key taken out of
  ``BATCHERY_API__KEYS`` stops working at once. Neither the key nor its tenant is ever logged.
- **Tenancy** is the API's (``batchery.api.auth``): an API key's viewer is that key's tenant and sees only the jobs
  its batches made; an operator key (``BATCHERY_API__OPERATOR_KEYS``, apart from the API keys) sees every job and the
  workers page. With no key configured at all there is one local viewer, an operator, and ``batchery serve`` listens
  on loopback only; the console then answers only requests whose ``Host`` is a loopback name, so a page of another
  site cannot reach it by pointing its own name at 127.0.0.1 (DNS rebinding).
- **CSRF**: a form that changes something (cancel, logout) carries a token derived from the cookie's key (HMAC), and
  a POST whose ``Origin`` is another site's is refused whatever it carries."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

from batchery.api.auth import LOCAL, tenant_id
from batchery.contract.settings import Settings

COOKIE = "batchery_console"
COOKIE_MAX_AGE_S = 12 * 3600
_LOCAL_SECRET = secrets.token_bytes(32)  # the no-key console's CSRF secret: one process serves it (loopback only)


@dataclass(frozen=True)
class Viewer:
    """The person behind a console request."""

    tenant: str  # the API tenant whose jobs it sees ("local" with no keys); "" for an operator key
    operator: bool  # sees every job and the workers page
    csrf: str  # the token its forms carry

    @property
    def label(self) -> str:
        if self.tenant == LOCAL:
            return "local (no keys configured)"
        return "operator" if self.operator else f"tenant {self.tenant}"


class ConsoleKeys:
    """The API keys and the operator keys, compared in constant time."""

    def __init__(self, settings: Settings) -> None:
        self._api = [k.encode() for k in settings.api.key_list()]
        self._operators = [k.encode() for k in settings.api.operator_key_list()]

    @property
    def enabled(self) -> bool:
        """Whether a key is needed (else: the local operator, loopback only)."""
        return bool(self._api or self._operators)

    def viewer(self, key: str | None) -> Viewer | None:
        """The viewer a key is; None for a missing or unknown key. With no key configured, the local operator."""
        if not self.enabled:
            return Viewer(LOCAL, True, _csrf(_LOCAL_SECRET))
        if not key:
            return None
        given = key.encode("utf-8", "replace")
        is_operator = _member(given, self._operators)
        is_api = _member(given, self._api)
        if is_operator:
            return Viewer("", True, _csrf(given))
        if is_api:
            return Viewer(tenant_id(key), False, _csrf(given))
        return None


def _member(given: bytes, keys: list[bytes]) -> bool:
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(given, k)
    return ok


def _csrf(secret: bytes) -> str:
    return hmac.new(secret, b"batchery-console-csrf", hashlib.sha256).hexdigest()[:32]


def viewer_of(request: Request, keys: ConsoleKeys) -> Viewer | None:
    """The request's viewer from its cookie (None: it must log in)."""
    return keys.viewer(request.cookies.get(COOKIE))


def host_allowed(request: Request, keys: ConsoleKeys) -> bool:
    """With no key configured, only a loopback ``Host`` (see the module docstring); with keys, any."""
    if keys.enabled:
        return True
    host = request.headers.get("host") or ""
    if host.startswith("["):  # [::1]:8000
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:  # 127.0.0.1:8000
        host = host.split(":", 1)[0]
    return bool(host) and _is_loopback(host)


def _is_loopback(host: str) -> bool:
    """As ``batchery.api.serve.is_loopback`` (which imports the app, so is not imported here)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_origin(request: Request) -> bool:
    """A POST's ``Origin`` (or, without one, its ``Referer``) names this server, or it names nothing."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if not origin or origin == "null":
        return origin != "null"
    return urlsplit(origin).netloc == request.headers.get("host", "")


def csrf_ok(viewer: Viewer, token: str | None) -> bool:
    return bool(token) and hmac.compare_digest(viewer.csrf.encode(), str(token).encode())


def set_cookie(response, request: Request, key: str) -> None:
    response.set_cookie(
        COOKIE,
        key,
        max_age=COOKIE_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_cookie(response) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
