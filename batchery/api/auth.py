"""API keys (``BATCHERY_API__KEYS``, comma-separated, sent as ``Authorization: Bearer <key>``) and the
tenant each one is. A key's tenant is a hash of the key, so keys never reach Redis, files or logs;
every file and batch records its tenant, and another tenant's gets a 404. With no key configured
there is one tenant, ``local``, and ``batchery serve`` listens on localhost only."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.requests import Request

from batchery.api.errors import unauthorized

LOCAL = "local"


@dataclass(frozen=True)
class Tenant:
    id: str  # "local", or "key_" + the first 16 hex digits of the key's sha256


def tenant_id(key: str) -> str:
    return "key_" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


class Keys:
    """The configured keys, compared in constant time."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode("utf-8") for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header; ``APIError`` 401 when keys are on and it is
        missing or wrong."""
        if not self._keys:
            return Tenant(LOCAL)
        if not authorization or not authorization.lower().startswith("bearer "):
            raise unauthorized("You didn't provide an API key: send 'Authorization: Bearer <key>'.")
        given = authorization[7:].strip().encode("utf-8")
        ok = False
        for k in self._keys:
            ok |= hmac.compare_digest(given, k)
        if not ok:
            raise unauthorized()
        return Tenant(tenant_id(given.decode("utf-8")))


def tenant(request: Request) -> Tenant:
    """Dependency: the caller's tenant (401 in OpenAI's shape for a missing or wrong key). It lives here, not in
    ``app``, so the routers that use it need not import the module that mounts them."""
    return request.app.state.batchery.keys.tenant(request.headers.get("authorization"))
