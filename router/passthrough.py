"""Every endpoint vLLM serves beyond the routed ones: to one replica, or, for an operator's, to all.

vLLM 0.32's OpenAI server registers some sixty routes (``vllm/entrypoints/openai/api_server.py``
and the routers it includes under ``vllm/entrypoints/``). The gateway routes chat and completions
by prefix (``proxy.py``) and sorts every other request in three:

The gateway routes ``/v1/responses`` and ``/v1/messages`` by prefix too (``dialects.py``); a
Responses request continuing a response whose history it does not hold comes here.

- **Stored responses** (``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, a
  ``POST /v1/responses`` naming a ``previous_response_id``): to the replica that created that
  response (``response_homes.py``); one this gateway never saw is looked for with ``GET
  /v1/responses/{id}`` on each routable replica in turn.
- **Operator endpoints** (``OPERATOR_POSTS``: ``/reset_prefix_cache``, ``/v1/load_lora_adapter``,
  ``/sleep``, ``/wake_up``, ``/pause``, ``/collective_rpc``, weight updates...): they change a
  replica's state, so they need an admin key once any key is configured, and go to every healthy
  replica. When all answer the same status the client gets that status and the first answer's
  body, as from one vLLM; ``x-prefix-router-replicas`` lists each replica's status. When they
  differ, a 502 whose body lists each replica's status and answer.
- **Unknown POSTs** (neither list: an endpoint of a later vLLM, a typo): to one replica, as
  below, but with an admin key once any key is configured, since the gateway cannot tell
  whether it changes the replica.
- **Everything else** (GETs such as ``/version`` and ``/v1/responses``' reads, and the
  ``INFERENCE_POSTS``: ``/tokenize``, ``/v1/embeddings``, ``/v1/score``, ``/v1/messages``...):
  to one routable replica, the least loaded of those serving the body's ``model`` (all routable
  ones when none lists it: vLLM then answers its own 404), with a tenant's key when tenants are
  configured. A connect error or a 5xx is retried on another replica (``upstream.max_retries``),
  each outcome goes to the replica's circuit breaker, and the answer, streamed or not, is passed
  back as it comes (``relay.py``), with ``x-prefix-router-replica`` naming the replica.

Body limits are the gateway's (``limits.max_body_bytes``); requests are counted in
``prefix_router_requests_total`` with ``route="passthrough"`` or ``route="fanout"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web

from .errors import error_body, openai_error
from .forward import breaker_record
from .gateway import Gateway
from .inbound import forward_headers, loads
from .relay import CLIENT_GONE, relay
from .replicas import ReplicaState
from .response_homes import response_id_of_stream
from .tenants import bearer

__all__ = ["INFERENCE_POSTS", "OPERATOR_POSTS", "REPLICAS_HEADER", "handle_passthrough", "home_of", "refusal"]

REPLICAS_HEADER = "x-prefix-router-replicas"  # a fan-out's per-replica statuses: "a:8000=200,b:8000=200"
# POSTs that serve a client, not change a replica (vLLM 0.32's routers; /ping is a health check)
INFERENCE_POSTS = frozenset({
    "/v1/chat/completions/render", "/v1/chat/completions/derender", "/v1/chat/completions/batch",
    "/v1/completions/render", "/v1/completions/derender", "/v1/responses", "/v1/responses/render",
    "/v1/messages", "/v1/messages/count_tokens", "/v1/messages/render", "/v1/embeddings", "/v1/score", "/score",
    "/v1/rerank", "/rerank", "/v2/rerank", "/classify", "/pooling", "/tokenize", "/detokenize",
    "/v1/audio/transcriptions", "/v1/audio/translations", "/invocations", "/ping", "/v1/systemone",
})
# POSTs that change a replica's state (vLLM 0.32's routers under vllm/entrypoints/serve/ and the
# dev-mode ones of api_server.py): every replica gets them
OPERATOR_POSTS = frozenset({
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/release_kv_cache_memory", "/sleep",
    "/wake_up", "/pause", "/resume", "/abort_requests", "/inference/v1/abort_requests", "/collective_rpc",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile", "/stop_profile", "/update_weights",
    "/update_weight_version", "/start_weight_update", "/start_draft_weight_update", "/finish_weight_update",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/weight_checker",
    "/scale_elastic_ep", "/is_scaling_elastic_ep",
})
_STORED = re.compile(r"^/v1/responses/([^/]{1,200})(/cancel)?$")
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


async def handle_passthrough(request: web.Request, gw: Gateway, payload: bytes | None = None,
                             headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Any request without a handler of its own (module docstring). ``payload`` and ``headers``:
    what to send instead of the client's body and headers (a routed request the proxy hands
    over, with its tenant's salt set: ``inbound.Inbound``)."""
    path, method = request.path, request.method
    operator = method not in _READS and path in OPERATOR_POSTS
    refused = refusal(request, gw, method, path)
    if refused is not None:
        return refused
    raw = await request.read() if payload is None else payload
    headers = forward_headers(request, gw) if headers is None else headers
    if operator:
        return await _fanout(request, gw, raw, headers)
    body = None
    if raw:  # whatever its Content-Type: vLLM reads a body sent without one as JSON
        with contextlib.suppress(ValueError, RecursionError):  # the replica answers a broken body itself
            body = loads(raw)
    stored = _STORED.match(path)
    response_id = stored.group(1) if stored else (
        body.get("previous_response_id") if isinstance(body, dict) and path == "/v1/responses" else None)
    if isinstance(response_id, str) and response_id:
        home = await home_of(gw, response_id, headers)
        if home is None:  # no replica holds it: any one answers vLLM's own 404
            candidates = _candidates(gw, body)
        else:
            candidates = [home]
    else:
        candidates = _candidates(gw, body)
    if not candidates:
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")
    return await _forward(request, gw, raw, headers, candidates, learn_id=path == "/v1/responses")


def refusal(request, gw: Gateway, method: str, path: str) -> web.Response | None:
    """The 401 or 403 for a request to ``method path`` without the key it needs (an admin's for
    what may change a replica, a tenant's for the rest once tenants exist), else None.
    ``request``: anything with the client's ``headers``."""
    admin = method not in _READS and (path in OPERATOR_POSTS or path not in INFERENCE_POSTS and not _STORED.match(path))
    if admin and not gw.tenants.is_admin(request):
        message = f"{method} {path[:200]} may change the replicas' state and needs an admin key"
        if bearer(request) is None:
            return openai_error(401, message + " (Authorization: Bearer KEY)", type_="AuthenticationError")
        return openai_error(403, message + "; the key given is not one", type_="PermissionDeniedError")
    if not admin and gw.tenants.enabled and gw.tenants.tenant_of(request) is None \
            and not gw.tenants.is_admin(request):
        return openai_error(401, "missing or unknown API key (Authorization: Bearer KEY)", type_="AuthenticationError")
    return None


def _candidates(gw: Gateway, body) -> list[ReplicaState]:
    """Routable replicas serving the body's model (all routable ones when none lists it), least loaded first."""
    routable = [r for r in gw.replicas.values() if r.routable]
    model = body.get("model") if isinstance(body, dict) else None
    serving = [r for r in routable if model in r.models] if isinstance(model, str) else []
    return sorted(serving or routable, key=lambda r: (r.routing_load, r.name))


async def home_of(gw: Gateway, response_id: str, headers: dict[str, str]) -> ReplicaState | None:
    """The routable replica holding ``response_id``: remembered, else found by asking each."""
    name = gw.response_homes.home(response_id)
    replica = gw.replicas.get(name) if name is not None else None
    if replica is not None and replica.routable:
        return replica
    if len(response_id) > 200:  # no id vLLM makes (resp_ and 16 to 32 hex digits): not worth a probe
        return None
    get_headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
    for replica in [r for r in gw.replicas.values() if r.routable]:
        try:
            quoted = quote(response_id.encode("utf-8", "surrogatepass"), safe="")  # JSON allows lone surrogates
            url = f"{replica.url}/v1/responses/{quoted}"  # the path's id, decoded
            async with gw.http.get(url, headers=get_headers) as resp:
                if resp.status == 200:
                    gw.response_homes.remember(response_id, replica.name)
                    return replica
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
    return None


async def _forward(request: web.Request, gw: Gateway, raw: bytes, headers: dict[str, str],
                   candidates: list[ReplicaState], learn_id: bool) -> web.StreamResponse:
    """To the first candidate that answers below 500, the next ones on a failure (module docstring).

    As for generation (``forward.py``), a replica that answered 5xx is blamed in its breaker only
    once another one served the request; the last candidate's 5xx goes to the client as it is.
    """
    attempts = [r for r in candidates if r.breaker.allows(time.monotonic())][: gw.config.upstream.max_retries + 1]
    answered_5xx: list[ReplicaState] = []
    last_error = "no replica answered" if candidates else "no healthy replica"
    for n, replica in enumerate(attempts):
        replica.breaker.on_send(time.monotonic())
        replica.inflight += 1  # the load bound of chat and completions counts it too
        gw.metrics.inflight.labels(replica.name).set(replica.inflight)
        ok: bool | None = False
        try:
            async with gw.http.request(request.method, replica.url + request.path_qs, data=raw or None,
                                       headers=headers) as upstream:
                if upstream.status >= 500 and n + 1 < len(attempts):
                    ok = None
                    answered_5xx.append(replica)
                    gw.metrics.requests.labels(replica.name, "passthrough", str(upstream.status)).inc()
                    last_error = f"replica {replica.name} answered {upstream.status}"
                    continue
                watch = _IdWatch(gw, replica.name) if learn_id and upstream.status == 200 else None
                relayed = await relay(request, upstream, replica.name,
                                      stream=upstream.content_type == "text/event-stream", client_wants_usage=True,
                                      write_timeout_s=gw.config.limits.client_write_timeout_s,
                                      sent_at=time.perf_counter(), watch=watch)
                if watch is not None and isinstance(relayed.response, web.Response):
                    watch.body(relayed.response.body)
                ok = None if relayed.status == CLIENT_GONE or relayed.status >= 500 else relayed.status != 502
                gw.metrics.requests.labels(replica.name, "passthrough", str(relayed.status)).inc()
                if ok:
                    for earlier in answered_5xx:
                        breaker_record(gw, earlier, False)
                return relayed.response
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            gw.metrics.requests.labels(replica.name, "passthrough", "0").inc()
            last_error = f"replica {replica.name}: {type(exc).__name__}"
        finally:
            replica.inflight -= 1
            gw.metrics.inflight.labels(replica.name).set(replica.inflight)
            gw.admission.notify()
            if ok is None:
                replica.breaker.release_trial()
            else:
                breaker_record(gw, replica, ok)
    return openai_error(502, last_error, type_="BadGatewayError")


class _IdWatch:
    """Remembers the replica of the response id a ``POST /v1/responses`` answer carries."""

    __slots__ = ("gw", "replica", "found")

    def __init__(self, gw: Gateway, replica: str) -> None:
        self.gw, self.replica, self.found = gw, replica, False

    def __call__(self, chunk: bytes) -> None:
        """A stream's chunk: its ``response.created`` event names the id."""
        if not self.found and (response_id := response_id_of_stream(chunk)) is not None:
            self.gw.response_homes.remember(response_id, self.replica)
            self.found = True

    def body(self, data: bytes | None) -> None:
        """A whole JSON answer: the Response object, ``id`` at its top."""
        try:
            response_id = orjson.loads(data or b"").get("id")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(response_id, str) and response_id:
            self.gw.response_homes.remember(response_id, self.replica)


async def _fanout(request: web.Request, gw: Gateway, raw: bytes, headers: dict[str, str]) -> web.Response:
    """An operator's request to every healthy replica; one answer as from one vLLM when all agree."""
    replicas = [r for r in gw.replicas.values() if r.healthy]
    if not replicas:
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")

    async def one(replica: ReplicaState) -> tuple[int, bytes, str]:
        try:
            async with gw.http.request(request.method, replica.url + request.path_qs, data=raw or None,
                                       headers=headers) as resp:
                return resp.status, await resp.read(), resp.headers.get("Content-Type", "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return 0, type(exc).__name__.encode(), "text/plain"

    answers = await asyncio.gather(*(one(r) for r in replicas))
    for replica, (status, _, _) in zip(replicas, answers):
        gw.metrics.requests.labels(replica.name, "fanout", str(status)).inc()
    statuses = ",".join(f"{r.name}={status}" for r, (status, _, _) in zip(replicas, answers))
    if len({status for status, _, _ in answers}) == 1 and answers[0][0]:
        status, data, content_type = answers[0]
        return web.Response(body=data, status=status, headers={"Content-Type": content_type, REPLICAS_HEADER: statuses})
    results = [{"replica": r.name, "status": status, "body": data.decode("utf-8", "replace")[:2000]}
               for r, (status, data, _) in zip(replicas, answers)]
    body = error_body(502, f"the replicas answered {request.method} {request.path[:200]} differently: {statuses}",
                      type_="BadGatewayError")
    return web.json_response({**body, "replicas": results}, status=502, headers={REPLICAS_HEADER: statuses})
