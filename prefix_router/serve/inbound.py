"""The first step of a request (``read_inbound``): read, parse and check the client's body, find
its tenant and session, and build what every replica will be sent.

What it changes on the way (the body is otherwise passed byte for byte):

- a streaming request gets ``stream_options.include_usage``, so the engine reports
  ``cached_tokens`` in its last event (``relay.UsageFilter`` drops that event again when the
  client did not ask for it);
- what ``tenants.Tenants.isolation`` asks of every generating request:
  ``vllm_xargs.kv_cache_report_mode`` and the connectors' transfer parameters dropped (always); under tenants the tenant's
  ``cache_salt``, and the
  tenant's name in front of the session key, so tenants' caches and sessions never meet; the
  client's Authorization only where ``Tenants.upstream_headers`` allows it.

A Responses or Anthropic Messages request (``prompts/responses.py``) is forwarded as it came (with the
same salt and ``vllm_xargs`` changes); what routing reads is the chat request vLLM renders from
it (``Inbound.prompt``), a Responses request continuing a ``previous_response_id`` rendered from
the history remembered with it (``response_homes.py``).

Bad input gets an OpenAI-style error: 401 (unknown key), 408 and 413 (``bodies.py``: a body too
slow, too large or of too many values), 400 (unreadable body, bad JSON, a body
``analysis.check_body`` refuses, a nested salt vLLM would refuse), 503 (no replica routable).
"""

from __future__ import annotations

import dataclasses
import json
import re

import orjson
from aiohttp import web

from prefix_router.constants import DP_RANK_HEADER
from prefix_router.prompts.anthropic import check_messages_body, messages_prompt
from prefix_router.serve.bodies import loads, parse, read_body
from prefix_router.prompts.responses import MESSAGES, RESPONSES, check_responses_body, responses_prompt
from prefix_router.endpoints import Kind
from prefix_router.errors import openai_error, response_not_found
from prefix_router.gateway import Gateway
from prefix_router.prompts.analysis import check_body
from prefix_router.fleet.tenants import IsolationError

__all__ = ["Inbound", "forward_headers", "inbound_of", "read_inbound", "loads", "patched"]

# Not forwarded: hop-by-hop headers, Content-Encoding, since the body goes on inflated
# (bodies.read_body; a gzip header on a plain body made replicas answer 500), and a client's
# data-parallel rank: the engine is the routing's choice (forward.headers_for sets it for a rank)
_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
               "proxy-authorization", "proxy-connection", "te", "trailer", "accept-encoding", "content-encoding",
               DP_RANK_HEADER.lower()}


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
    tenant: str | None = None  # the tenant's name under tenants: a Response it creates is its own
    session_by_user: bool = False  # the session key is the body's ``user``: one per end user, not per chat


async def read_inbound(request: web.Request, gw: Gateway, path: str, chat: bool) -> Inbound | web.Response:
    """The request checked and prepared for forwarding, or the error response to answer."""
    refused = gw.tenants.refusal(request, Kind.ROUTED, "POST", path)  # before the body is read
    if refused is not None:
        return refused
    raw = await read_body(request, gw.config.limits)
    if isinstance(raw, web.Response):
        return raw
    return inbound_of(request, gw, path, chat, raw)


def inbound_of(request, gw: Gateway, path: str, chat: bool, raw: bytes) -> Inbound | web.Response:
    """``read_inbound`` once the body is read: ``request`` is anything with the client's
    ``headers`` (an aiohttp request, or the Endpoint Picker's view of Envoy's, ``epp/picker.py``)."""
    refused = gw.tenants.refusal(request, Kind.ROUTED, "POST", path)
    if refused is not None:
        return refused
    tenant = gw.tenants.tenant_of(request) if gw.tenants.enabled else None
    body = parse(raw, gw.config.limits)
    if isinstance(body, web.Response):
        return body
    problem = _CHECKS[path](body) if path in _CHECKS else check_body(body, chat)
    if problem is not None:
        return openai_error(400, *problem)
    previous = body.get("previous_response_id") if path == RESPONSES else None
    if tenant is not None and previous and not gw.response_homes.owned_by(str(previous), tenant.name):
        return response_not_found(str(previous), "previous_response_id")
    if not any(r.routable for r in gw.replicas.values()):
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    try:
        extra = {**_usage_options(body, stream and path not in _CHECKS, wants_usage),
                 **gw.tenants.isolation(tenant, body, path)}
    except IsolationError as exc:  # a nested cache_salt vLLM would refuse, a Responses request_id
        return openai_error(400, str(exc), exc.param)
    key, by_user = _session_key(request, body, gw)
    session = gw.tenants.session(tenant, key)
    try:
        payload = patched(raw, body, extra)
        body.update(extra)  # what the replica sees is what routing hashes (the salt seeds the blocks)
        prompt = _prompt(gw, path, body, raw)
    except RecursionError:  # orjson reads 1,024 levels; Python's own JSON and repr fewer
        return openai_error(400, "request body is nested too deeply", "body")
    headers = {**forward_headers(request, gw), "Content-Type": "application/json"}
    return Inbound(path, chat, raw, body, prompt, payload, headers, stream, wants_usage, session,
                   tenant.name if tenant is not None else None, by_user)


_LONG_NUMBER = re.compile(rb"\d{20}")  # 20 digits: more than a 64-bit integer holds (or a string's)
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


def _usage_options(body: dict, stream: bool, client_wants_usage: bool) -> dict:
    """``stream_options`` with ``include_usage`` for a stream whose client did not ask for it."""
    if not stream or client_wants_usage:
        return {}
    options = body.get("stream_options")
    return {"stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}


def patched(raw: bytes, body: dict | None, extra: dict, keys: frozenset[str] | set[str] | None = None) -> bytes:
    """The client's body with the ``extra`` top-level keys set (usage reporting, a tenant's salt).

    When none of them is in the body (``keys``: the body's top-level keys, when ``body`` is
    not at hand), they are spliced in front of the client's bytes: no re-serialisation of a
    prompt that may be megabytes. Otherwise ``body`` (parsed once, by ``bodies.loads``; parsed
    here when None) is encoded again with them: orjson, or Python's json for what orjson does
    not keep (NaN, lone surrogates, integers beyond 64 bits).
    """
    if not extra:
        return raw
    present = set(body) if keys is None and body is not None else keys or set()
    stripped = raw.lstrip()
    if stripped.startswith(b"{") and stripped[1:].lstrip()[:1] != b"}" and not any(k in present for k in extra):
        return b"{" + orjson.dumps(extra)[1:-1] + b"," + stripped[1:]
    if b"NaN" in raw or b"Infinity" in raw or _LONG_NUMBER.search(raw):
        # orjson would write NaN as null and read integers beyond 64 bits as floats: Python's
        # parser keeps them exact (a second parse, for these rare bodies only)
        return json.dumps({**json.loads(raw), **extra}).encode()
    whole = {**(loads(raw) if body is None else body), **extra}
    try:
        return orjson.dumps(whole)
    except TypeError:  # lone surrogates
        return json.dumps(whole).encode()


def _session_key(request: web.Request, body: dict, gw: Gateway) -> tuple[str | None, bool]:
    """(the session key: the session header's, else the body's ``user``; whether it is OpenAI's
    ``user``, an end user's, not a conversation's, unlike a header or Anthropic's ``metadata.user_id``,
    where Claude Code sends its session)."""
    key = request.headers.get(gw.config.routing.session_header)
    if key:
        return key[:256], False
    user, end_user = body.get("user"), True
    metadata = body.get("metadata")
    if user is None and isinstance(metadata, dict):
        user, end_user = metadata.get("user_id"), False
    if gw.config.routing.use_user_field and isinstance(user, str) and user:
        return "user:" + user[:256], end_user
    return None, False


def forward_headers(request: web.Request, gw: Gateway) -> dict[str, str]:
    """The client's headers, less hop-by-hop ones and less the client's Authorization wherever
    ``Tenants.upstream_headers`` says so; the HTTP session then sends ``auth.upstream_api_key``
    when one is configured (``app.create_app``)."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    return gw.tenants.upstream_headers(request, headers)
