"""The first step of a request (``read_inbound``): read, parse and check the client's body, find
its tenant and session, and build what every replica will be sent.

What it changes on the way (the body is otherwise passed byte for byte):

- a streaming request gets ``stream_options.include_usage``, so the engine reports
  ``cached_tokens`` in its last event (``relay.UsageFilter`` drops that event again when the
  client did not ask for it);
- ``vllm_xargs.kv_cache_report_mode`` is dropped: ``"full"`` makes vLLM publish ``BlockStored``
  again for every block a request reuses, with no ``BlockRemoved`` to match, so the KV events
  every gateway reads would hold those blocks forever;
- under tenants, the tenant's ``cache_salt`` (``tenants.Tenants.salt``) and the tenant's name in
  front of the session key, so tenants' caches and sessions never meet; the client's
  Authorization (a tenant key) is not forwarded.

A Responses or Anthropic Messages request (``dialects.py``) is forwarded as it came (with the
same salt and ``vllm_xargs`` changes); what routing reads is the chat request vLLM renders from
it (``Inbound.prompt``), a Responses request continuing a ``previous_response_id`` rendered from
the history remembered with it (``response_homes.py``).

Bad input gets an OpenAI-style error: 401 (unknown key), 413 (``limits.max_body_bytes``), 400
(unreadable body, bad JSON, a body ``prompts.check_body`` refuses), 503 (no replica routable).
"""

from __future__ import annotations

import dataclasses
import json

import aiohttp
import orjson
from aiohttp import web

from .anthropic import check_messages_body, messages_prompt
from .dialects import MESSAGES, RESPONSES, check_responses_body, responses_prompt
from .errors import openai_error
from .gateway import Gateway
from .prompts import check_body

__all__ = ["Inbound", "forward_headers", "inbound_of", "read_inbound", "loads", "parse", "patched"]

# Not forwarded: hop-by-hop headers, and Content-Encoding, since aiohttp hands the handler the
# decompressed body (a gzip header on a plain body made replicas answer 500)
_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
               "proxy-authorization", "proxy-connection", "te", "trailer", "accept-encoding", "content-encoding"}


@dataclasses.dataclass(frozen=True, slots=True)
class Inbound:
    """A checked request: what routing reads and what is sent to a replica, whichever it is."""

    path: str  # the upstream path: /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages
    chat: bool  # routed as a chat (every path but /v1/completions)
    raw: bytes  # the client's body as it arrived
    body: dict  # parsed, with the gateway's changes applied: what the replica sees
    # what routing hashes: ``body`` itself, or the chat request a Responses or Messages body is
    # rendered as; None for a Responses request continuing a response whose history is unknown
    prompt: dict | None
    payload: bytes  # the bytes sent upstream
    headers: dict[str, str]  # the headers sent upstream
    stream: bool
    client_wants_usage: bool  # the client asked for ``stream_options.include_usage`` itself
    session: str | None  # the session key (header or ``user``), tenant-scoped


def loads(data: bytes):
    """JSON from bytes: orjson, or Python's json for what orjson refuses and it takes (lone
    surrogates, NaN and Infinity, as vLLM writes a -inf logprob). Raises ValueError or
    RecursionError for what neither takes, with the standard parser's message."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


async def read_inbound(request: web.Request, gw: Gateway, path: str, chat: bool) -> Inbound | web.Response:
    """The request checked and prepared for forwarding, or the error response to answer."""
    if gw.tenants.enabled and gw.tenants.tenant_of(request) is None:
        return openai_error(401, "missing or unknown API key (Authorization: Bearer KEY)", type_="AuthenticationError")
    raw = await _read_raw(request, gw.config.limits.max_body_bytes)
    if isinstance(raw, web.Response):
        return raw
    return inbound_of(request, gw, path, chat, raw)


def inbound_of(request, gw: Gateway, path: str, chat: bool, raw: bytes) -> Inbound | web.Response:
    """``read_inbound`` once the body is read: ``request`` is anything with the client's
    ``headers`` (an aiohttp request, or the Endpoint Picker's view of Envoy's, ``epp.py``)."""
    tenant = gw.tenants.tenant_of(request) if gw.tenants.enabled else None
    if gw.tenants.enabled and tenant is None:
        return openai_error(401, "missing or unknown API key (Authorization: Bearer KEY)", type_="AuthenticationError")
    body = parse(raw)
    if isinstance(body, web.Response):
        return body
    problem = _CHECKS[path](body) if path in _CHECKS else check_body(body, chat)
    if problem is not None:
        return openai_error(400, *problem)
    if not any(r.routable for r in gw.replicas.values()):
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    extra = _changes(body, stream and path not in _CHECKS, wants_usage)
    session = _session_key(request, body, gw)
    if tenant is not None:
        salt = gw.tenants.salt(tenant, body.get("cache_salt"))
        if body.get("cache_salt") != salt:
            extra["cache_salt"] = salt
        if session is not None:
            session = f"{tenant.name}:{session}"  # tenants' session ids never meet
    try:
        payload = patched(raw, body, extra)
        body.update(extra)  # what the replica sees is what routing hashes (the salt seeds the blocks)
        prompt = _prompt(gw, path, body, raw)
    except RecursionError:  # orjson reads 1,024 levels; Python's own JSON and repr fewer
        return openai_error(400, "request body is nested too deeply", "body")
    headers = {**forward_headers(request, gw), "Content-Type": "application/json"}
    return Inbound(path, chat, raw, body, prompt, payload, headers, stream, wants_usage, session)


_CHECKS = {RESPONSES: check_responses_body, MESSAGES: check_messages_body}


def _prompt(gw: Gateway, path: str, body: dict, raw: bytes) -> dict | None:
    """What routing reads of ``body`` (``Inbound.prompt``). A Responses or Messages body whose
    shape the mapping cannot follow (vLLM will refuse it) is routed by its characters."""
    if path not in (MESSAGES, RESPONSES):
        return body
    try:
        if path == MESSAGES:
            return messages_prompt(body, gw.merge_inline_system)
        previous = body.get("previous_response_id")
        if not previous:
            return responses_prompt(body)
        history = gw.response_homes.history(previous)
        return None if history is None else responses_prompt(body, history)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError):
        salt = body.get("cache_salt")
        return {"model": body.get("model"), "cache_salt": salt if isinstance(salt, str) else None,
                "messages": [{"role": "user", "content": raw.decode("utf-8", "replace")}]}


def _changes(body: dict, stream: bool, client_wants_usage: bool) -> dict:
    """The top-level keys the gateway sets before forwarding (see the module's docstring)."""
    extra: dict = {}
    if stream and not client_wants_usage:
        options = body.get("stream_options")
        extra["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
        extra["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
    return extra


async def _read_raw(request: web.Request, limit: int) -> bytes | web.Response:
    if request.content_length is not None and request.content_length > limit:
        return openai_error(413, f"request body of {request.content_length} bytes exceeds the limit of {limit}")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return openai_error(413, f"request body exceeds the limit of {limit} bytes")
    except (web.RequestPayloadError, aiohttp.http_exceptions.HttpProcessingError) as exc:
        # e.g. Content-Encoding: gzip on a body that is not gzip
        return openai_error(400, f"request body could not be read ({type(exc).__name__})", "body")


def parse(raw: bytes) -> dict | web.Response:
    """The body as a JSON object, or the 400 to answer."""
    try:
        body = loads(raw)
    except (ValueError, RecursionError) as exc:
        return openai_error(400, f"JSON decode error: {str(exc)[:200]}", "body")
    if not isinstance(body, dict):
        return openai_error(400, "request body must be a JSON object", "body")
    return body



def patched(raw: bytes, body: dict, extra: dict) -> bytes:
    """The client's body with the ``extra`` top-level keys set (usage reporting, a tenant's salt).

    When none of them is in the body, they are spliced in front of the client's bytes (no
    re-serialisation of a prompt that may be megabytes); otherwise the body is re-encoded from
    the client's bytes read by Python's own parser, which keeps integers beyond 64 bits exact
    (orjson reads them as floats).
    """
    if not extra:
        return raw
    stripped = raw.lstrip()
    if body and stripped.startswith(b"{") and not any(k in body for k in extra):
        return b"{" + json.dumps(extra, separators=(",", ":"))[1:-1].encode() + b"," + stripped[1:]
    return json.dumps({**json.loads(raw), **extra}).encode()


def _session_key(request: web.Request, body: dict, gw: Gateway) -> str | None:
    key = request.headers.get(gw.config.routing.session_header)
    if key:
        return key[:256]
    user = body.get("user")
    metadata = body.get("metadata")
    if user is None and isinstance(metadata, dict):  # Anthropic's: Claude Code sends its session here
        user = metadata.get("user_id")
    if gw.config.routing.use_user_field and isinstance(user, str) and user:
        return "user:" + user[:256]
    return None


def forward_headers(request: web.Request, gw: Gateway) -> dict[str, str]:
    """The client's headers, less hop-by-hop ones. Under tenants the client's Authorization (a
    tenant key) is dropped, so replicas never see it; the HTTP session then sends
    ``auth.upstream_api_key`` when one is configured (``app.create_app``)."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    if gw.tenants.enabled:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    return headers
