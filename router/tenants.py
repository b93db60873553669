"""Tenants: API keys, the cache salt each tenant's requests carry, and who may see admin views.

Prefix caching is a timing side channel: a request whose prefix another tenant computed gets
its first token sooner, which tells the client that someone sent that text. vLLM closes it
with ``cache_salt`` (``vllm/v1/core/kv_cache_utils.py``: the salt seeds the hash of a
request's first block, so blocks of different salts never match). The gateway sets the salt
itself, from the tenant the API key names (``AuthConfig.client_salt`` decides what happens to
a salt the client sent), so tenants never share KV blocks whatever clients send; the salt also
seeds the gateway's block hashes and chat openings, so routing keys differ per tenant too.
Session ids are scoped by tenant, so two tenants' "session 1" are different conversations.

With no tenants and no admin keys configured the gateway is open, as before.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from .config import AuthConfig, TenantConfig

__all__ = ["Tenants", "bearer"]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def bearer(request: web.Request) -> str | None:
    """The key of ``Authorization: Bearer KEY``, else None."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class Tenants:
    """Look up the tenant of a request's API key; constant-time key comparison (keys are
    compared by their SHA-256 with ``hmac.compare_digest``, so timing tells nothing of them)."""

    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._tenants = [(t, [_digest(k) for k in t.keys]) for t in config.tenants]
        self._admins = [_digest(k) for k in config.admin_keys]

    @property
    def enabled(self) -> bool:
        """Whether generation requests need a tenant's key."""
        return bool(self._tenants)

    @property
    def admin_protected(self) -> bool:
        """Whether admin views need an admin key: once any key is configured."""
        return bool(self._tenants or self._admins)

    def tenant_of(self, request: web.Request) -> TenantConfig | None:
        """The tenant whose key the request carries, else None."""
        key = bearer(request)
        if key is None:
            return None
        digest = _digest(key)
        found = None
        for tenant, digests in self._tenants:
            for d in digests:
                if hmac.compare_digest(d, digest):
                    found = tenant  # no early exit: every key is compared
        return found

    def is_admin(self, request: web.Request) -> bool:
        """Whether the request carries an admin key (True when admin views are open)."""
        if not self.admin_protected:
            return True
        key = bearer(request)
        if key is None:
            return False
        digest = _digest(key)
        return any([hmac.compare_digest(d, digest) for d in self._admins])

    def salt(self, tenant: TenantConfig, client_salt: object) -> str:
        """The cache_salt a tenant's request goes upstream with."""
        own = tenant.cache_salt or f"tenant:{tenant.name}"
        if self.config.client_salt == "nest" and isinstance(client_salt, str) and client_salt:
            return f"{own}/{client_salt}"
        return own
