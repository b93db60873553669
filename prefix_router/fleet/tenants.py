"""Tenants: API keys, the cache salt each tenant's requests carry, and who may see admin views.

Prefix caching is a timing side channel: a request whose prefix another tenant computed gets
its first token sooner, which tells the client that someone sent that text. vLLM closes it
with ``cache_salt`` (``vllm/v1/core/kv_cache_utils.py``: the salt seeds the hash of a
request's first block, so blocks of different salts never match). The gateway sets the salt
itself, from the tenant the API key names (``AuthConfig.client_salt`` decides what happens to
a salt the client sent), so tenants never share KV blocks whatever clients send; the salt also
seeds the gateway's block hashes and chat openings, so routing keys differ per tenant too.
Session ids are scoped by tenant, so two tenants' "session 1" are different conversations.

Every path that reaches a replica asks this module (``endpoints.kind_of`` sorts the paths):
``Tenants.isolation`` gives the body changes of a generating request (the salt, and
``vllm_xargs.kv_cache_report_mode`` dropped), ``Tenants.upstream_headers`` the headers a replica
may see, ``Tenants.session`` the session scope, ``Tenants.refusal`` who may call what.

With no tenants and no admin keys configured the gateway is open, as before.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from prefix_router.config import AuthConfig, TenantConfig
from prefix_router.endpoints import Kind
from prefix_router.errors import openai_error

__all__ = ["IsolationError", "KEY_HEADERS", "MAX_SALT_CHARS", "SALT_JOIN", "Tenants", "bearer"]

# the headers a client's key travels in: OpenAI's, and Anthropic's (its SDKs send x-api-key)
KEY_HEADERS = ("authorization", "x-api-key")

SALT_JOIN = "|"  # between a tenant's salt and a client's nested one: no configured salt holds it
# vLLM 0.32's rule for cache_salt (``validate_cache_salt``, vllm/entrypoints/generate/base/protocol.py)
MAX_SALT_CHARS = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def bearer(request: web.Request) -> str | None:
    """The key of ``Authorization: Bearer KEY``, else None."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


# request keys vLLM's KV and encoder-cache connectors act on (vLLM 0.32, ``v1/request.py``)
_TRANSFER_KEYS = ("kv_transfer_params", "ec_transfer_params")
# ``vllm_xargs`` keys the engine reads as its own: dropped from every request (``Tenants.isolation``)
_ENGINE_XARGS = frozenset({"kv_cache_report_mode", *_TRANSFER_KEYS})


class IsolationError(ValueError):
    """A body the gateway cannot send upstream under the tenant's isolation; ``param``: the
    body's key at fault (the 400's ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
        return key is not None and self._is_admin_key(key)

    def salt(self, tenant: TenantConfig, client_salt: object) -> str:
        """The cache_salt a tenant's request goes upstream with: the tenant's, or under
        ``client_salt: nest`` the tenant's and the client's joined by ``SALT_JOIN``. Raises
        ``IsolationError`` for a nested salt vLLM would refuse."""
        own = tenant.salt
        if self.config.client_salt != "nest" or client_salt is None:
            return own
        if not isinstance(client_salt, str) or not client_salt:
            raise IsolationError("'cache_salt' must be a non-empty string", "cache_salt")
        nested = f"{own}{SALT_JOIN}{client_salt}"
        if len(nested) > MAX_SALT_CHARS or any(c in _SALT_FORBIDDEN for c in client_salt):
            raise IsolationError(f"'cache_salt' must be at most {MAX_SALT_CHARS - len(own) - 1} characters under "
                                 f"this tenant and must not contain '@', '/', '\\' or NUL", "cache_salt")
        return nested

    def isolation(self, tenant: TenantConfig | None, body, path: str = "") -> dict:
        """The top-level keys a generating request's body gets before it goes upstream (an
        empty dict: none). ``body``: the parsed body, or its ``bodies.Head`` (anything with
        ``get``). The tenant's salt (``salt``), and ``vllm_xargs`` without the keys the engine
        reads as its own (``_ENGINE_XARGS``): ``kv_cache_report_mode`` ``"full"`` makes vLLM
        publish ``BlockStored`` again for every block a request reuses, with no ``BlockRemoved``
        to match, so the KV events every gateway reads would hold those blocks for ever; vLLM
        copies ``kv_transfer_params`` and ``ec_transfer_params`` from ``vllm_xargs`` into the
        request's transfer parameters as it does the top-level keys (``to_sampling_params``,
        ``v1/request.py``), there a string or number a connector would read as a dict; the same
        keys leave ``sampling_params.extra_args`` (``/inference/v1/generate`` passes it to the
        engine as it came).

        Raises ``IsolationError`` as ``salt``; always for a top-level ``kv_transfer_params`` or
        ``ec_transfer_params``, the gateway's to set (``serve/disagg.py``): from a client they
        would make a prefill replica hold blocks for a decode that never comes, or a decode
        replica pull blocks from a host the client names (another tenant's prompt, or no vLLM);
        and under tenants for a ``request_id`` on ``/v1/responses`` (``path``): vLLM stores the
        Response under that id (``ResponsesResponse.from_request``), so a tenant naming another's
        id would overwrite that Response."""
        get = body.get
        for key in _TRANSFER_KEYS:
            if get(key) is not None:
                raise IsolationError(f"'{key}' is set by the gateway, not by a client", key)
        if tenant is not None and path == "/v1/responses" and get("request_id") is not None:
            raise IsolationError("'request_id' names the stored Response; under tenants the engine chooses it",
                                 "request_id")
        extra: dict = {}
        xargs = get("vllm_xargs")
        if isinstance(xargs, dict) and not _ENGINE_XARGS.isdisjoint(xargs):
            extra["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in _ENGINE_XARGS}
        sampling = get("sampling_params")  # /inference/v1/generate takes the engine's extra args as they are
        own = sampling.get("extra_args") if isinstance(sampling, dict) else None
        if isinstance(own, dict) and not _ENGINE_XARGS.isdisjoint(own):
            kept = {k: v for k, v in own.items() if k not in _ENGINE_XARGS}
            extra["sampling_params"] = {**sampling, "extra_args": kept}
        if tenant is not None:
            salt = self.salt(tenant, get("cache_salt"))
            if get("cache_salt") != salt:
                extra["cache_salt"] = salt
        return extra

    @staticmethod
    def session(tenant: TenantConfig | None, key: str | None) -> str | None:
        """A session key scoped by tenant, so two tenants' "session 1" never meet."""
        return key if tenant is None or key is None else f"{tenant.name}:{key}"

    def upstream_headers(self, request: web.Request, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` (the client's, less hop-by-hop ones) without the client's Authorization
        wherever it is not the replica's business: under tenants (a tenant key), where
        ``auth.upstream_api_key`` is set (the gateway's key goes instead), and when it is an
        admin key (in ``Authorization`` or Anthropic's ``x-api-key``). Only an open gateway passes a
        client's own key on (vLLM's ``--api-key``)."""
        if self.forwards_client_key(request):
            return headers
        return {k: v for k, v in headers.items() if k.lower() not in KEY_HEADERS}

    def forwards_client_key(self, request: web.Request) -> bool:
        """Whether a client's own key may reach a replica (``upstream_headers``): only from an open
        gateway, one Authorization header at most, and no admin key in either key header."""
        if self.enabled or self.config.upstream_api_key or len(request.headers.getall("Authorization", [])) > 1:
            return False
        if not self._admins:
            return True
        keys = [bearer(request), *request.headers.getall("x-api-key", [])]
        return not any(key and self._is_admin_key(key) for key in keys)

    def _is_admin_key(self, key: str) -> bool:
        digest = _digest(key)
        return any([hmac.compare_digest(d, digest) for d in self._admins])

    def refusal(self, request: web.Request, kind: Kind, method: str, path: str) -> web.Response | None:
        """The 401 or 403 for a request of ``kind`` without the key it needs, else None.
        ``request``: anything with the client's ``headers``.

        - ``OPERATOR`` and ``UNKNOWN`` (may change a replica): an admin key once any key is set;
        - under tenants, ``ROUTED``, ``GENERATES`` and ``STORED``: a tenant's key (the salt and
          the Response's owner come from it); ``UNSALTABLE``: refused (403), the engine would
          compute a cache any tenant could probe; ``SERVES``: a tenant's key or an admin's.
        """
        what = f"{method} {path[:200]}"
        if kind in (Kind.OPERATOR, Kind.UNKNOWN):
            if self.is_admin(request):
                return None
            if kind is Kind.UNKNOWN and self.enabled and self.tenant_of(request) is not None:
                return openai_error(403, f"{what} is not an endpoint the gateway knows, so it is closed to tenants; "
                                         "an operator may open it (auth.tenant_paths)", type_="PermissionDeniedError")
            return self._denied(request, f"{what} may change the replicas' state and needs an admin key")
        if not self.enabled:
            return None
        if kind is Kind.UNSALTABLE:
            return openai_error(403, f"{what} computes a prefix cache it cannot separate per tenant (its requests "
                                     "carry no cache_salt), so it is closed to tenants", type_="PermissionDeniedError")
        tenant = self.tenant_of(request)
        if tenant is not None or (kind is Kind.SERVES and self.is_admin(request)):
            return None
        if self.is_admin(request):
            return openai_error(401, f"{what} needs a tenant's key: an admin key acts for no tenant (its requests "
                                     "would have no cache salt)", type_="AuthenticationError")
        return openai_error(401, "missing or unknown API key (Authorization: Bearer KEY)", type_="AuthenticationError")

    @staticmethod
    def _denied(request: web.Request, message: str) -> web.Response:
        if bearer(request) is None:
            return openai_error(401, message + " (Authorization: Bearer KEY)", type_="AuthenticationError")
        return openai_error(403, message + "; the key given is not one", type_="PermissionDeniedError")
