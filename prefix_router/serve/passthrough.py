"""Every endpoint vLLM serves beyond the routed ones: to one replica, or, for an operator's, to all.

vLLM 0.32's OpenAI server registers some seventy routes; ``endpoints.kind_of`` sorts each
request (the lists live there), and ``tenants.Tenants.refusal`` says who may call it. The
gateway routes chat, completions, ``/v1/responses`` and ``/v1/messages`` by prefix
(``proxy.py``); a Responses request continuing a response whose history it does not hold comes
here. The rest:

- **Stored responses** (``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, a
  ``POST /v1/responses`` naming a ``previous_response_id``): to the replica that created that
  response (``response_homes.py``); one this gateway never saw is looked for with ``GET
  /v1/responses/{id}`` on each routable replica in turn. Under tenants, only the tenant that
  created it reaches it (404 to the others).
- **Operator endpoints** (``OPERATOR_POSTS``: ``/reset_prefix_cache``, ``/v1/load_lora_adapter``,
  ``/sleep``, ``/wake_up``, ``/pause``, ``/collective_rpc``, weight updates...): they change a
  replica's state, so they need an admin key once any key is configured, and go to every healthy
  replica. When all answer the same status the client gets that status and the first answer's
  body, as from one vLLM; ``x-prefix-router-replicas`` lists each replica's status. When they
  differ, a 502 whose body lists each replica's status and answer.
- **Generating endpoints** (``GENERATES``: ``/invocations``, ``/v1/chat/completions/batch``,
  ``/v1/embeddings``, ``/v1/score``...): the engine computes KV from the body, so it goes with the
  changes ``Tenants.isolation`` makes (the tenant's ``cache_salt``, ``kv_cache_report_mode``
  dropped), spliced into the client's bytes; under tenants a body that is not a JSON object is
  refused (400), since no salt can be set in it.
- **Unknown POSTs** (an endpoint of a later vLLM, a typo): to one replica, as below, with an
  admin key once any key is configured, since the gateway cannot tell whether it changes the
  replica; tenants only where ``auth.tenant_paths`` lists them (then as a generating endpoint).
- **Everything else** (GETs such as ``/version``, and ``SERVES``: ``/tokenize``, the render
  endpoints...): to one routable replica, the least loaded of those serving the body's ``model``
  (all routable ones when none lists it: vLLM then answers its own 404), with a tenant's key
  when tenants are configured. A connect error or a 5xx is retried on another replica
  (``upstream.max_retries``), each outcome goes to the replica's circuit breaker, and the
  answer, streamed or not, is passed back as it comes (``relay.py``), with
  ``x-prefix-router-replica`` naming the replica.

Bodies are read within ``bodies.py``'s bounds, and only their head (``model``, the salt, a
``previous_response_id``) is parsed; requests are counted in ``prefix_router_requests_total``
with ``route="passthrough"`` or ``route="fanout"``.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web

from prefix_router.serve.bodies import Head, head_of, loads, read_body, shape_refusal
from prefix_router.endpoints import Kind, kind_of, stored_id
from prefix_router.errors import error_body, openai_error, response_not_found
from prefix_router.serve.forward import breaker_record
from prefix_router.gateway import Gateway
from prefix_router.serve.inbound import forward_headers, patched
from prefix_router.serve.relay import CLIENT_GONE, relay
from prefix_router.fleet.replicas import ReplicaState
from prefix_router.fleet.response_homes import response_id_of_stream
from prefix_router.fleet.tenants import IsolationError

__all__ = ["REPLICAS_HEADER", "handle_passthrough", "home_of", "isolated"]

REPLICAS_HEADER = "x-prefix-router-replicas"  # a fan-out's per-replica statuses: "a:8000=200,b:8000=200"


async def handle_passthrough(request: web.Request, gw: Gateway, payload: bytes | None = None,
                             headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Any request without a handler of its own (module docstring). ``payload`` and ``headers``:
    what to send instead of the client's body and headers (a routed request the proxy hands
    over, already isolated: ``inbound.Inbound``)."""
    path, method = request.path, request.method
    kind = kind_of(method, path, gw.config.auth.tenant_paths)
    refused = gw.tenants.refusal(request, kind, method, path)
    if refused is not None:
        return refused
    tenant = gw.tenants.tenant_of(request) if gw.tenants.enabled else None
    raw = await read_body(request, gw.config.limits) if payload is None else payload
    if isinstance(raw, web.Response):
        return raw
    headers = forward_headers(request, gw) if headers is None else headers
    if kind is Kind.OPERATOR:
        return await _fanout(request, gw, raw, headers)
    head = None
    if raw:  # whatever its Content-Type: vLLM reads a body sent without one as JSON
        refused = shape_refusal(raw, gw.config.limits)
        if refused is not None:
            return refused
        head = head_of(raw)
    if kind in (Kind.GENERATES, Kind.ROUTED) and payload is None:  # ROUTED: a path aiohttp matched encoded
        isolated_raw = isolated(gw, tenant, raw, head, path)
        if isinstance(isolated_raw, web.Response):
            return isolated_raw
        if isolated_raw is not raw:
            raw, headers = isolated_raw, {**headers, "Content-Type": "application/json"}
    response_id = stored_id(path) if kind is Kind.STORED else (
        head.get("previous_response_id") if head and path == "/v1/responses" else None)
    owner = tenant.name if tenant is not None else None
    if isinstance(response_id, str) and response_id:
        if owner is not None and not gw.response_homes.owned_by(response_id, owner):
            return response_not_found(response_id)
        home = await home_of(gw, response_id, headers)
        candidates = [home] if home is not None else _candidates(gw, head)  # none: any one answers vLLM's 404
    else:
        candidates = _candidates(gw, head)
    if not candidates:
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")
    return await _forward(request, gw, raw, headers, candidates, learn_id=path == "/v1/responses", owner=owner)


def isolated(gw: Gateway, tenant, raw: bytes, head: Head | None, path: str) -> bytes | web.Response:
    """A generating request's body to ``path`` with ``Tenants.isolation``'s changes (``raw``
    itself when there are none), or the 400 to answer: under tenants a body that is not a JSON
    object msgspec reads (no salt can be set in it: vLLM would read NaN, say, and generate),
    or one ``isolation`` refuses. An open gateway passes such a body on as it came (the replica
    answers a broken one itself) unless Python's JSON, as vLLM reads it, finds in it what
    ``isolation`` refuses or drops."""
    if head is None:
        if tenant is not None:
            return openai_error(400, "request body must be a JSON object", "body")
        if _asks_the_engine(raw, gw, path):
            return openai_error(400, "request body sets what only the gateway may (a connector's transfer parameters, "
                                "or the engine's own keys in vllm_xargs or sampling_params.extra_args)", "body")
        return raw
    try:
        extra = gw.tenants.isolation(tenant, head, path)
    except IsolationError as exc:
        return openai_error(400, str(exc), exc.param)
    return patched(raw, None, extra, keys=head.sent()) if extra else raw


def _asks_the_engine(raw: bytes, gw: Gateway, path: str) -> bool:
    """Whether a body msgspec could not read is one ``Tenants.isolation`` would refuse or change
    (a connector's transfer parameters, an engine key in ``vllm_xargs``), read as vLLM reads it
    (Python's JSON takes NaN and lone surrogates)."""
    try:
        body = loads(raw)
    except (ValueError, RecursionError):
        return False
    if not isinstance(body, dict):
        return False
    try:
        return bool(gw.tenants.isolation(None, body, path))
    except IsolationError:
        return True


def _candidates(gw: Gateway, head: Head | None) -> list[ReplicaState]:
    """Routable replicas serving the body's model (all routable ones when none lists it), least loaded first."""
    routable = [r for r in gw.replicas.values() if r.routable]
    model = head.get("model") if head is not None else None
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
            async with gw.http.get(url, headers=get_headers, allow_redirects=False) as resp:
                if resp.status == 200:
                    gw.response_homes.remember(response_id, replica.name)
                    return replica
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
    return None


async def _forward(request: web.Request, gw: Gateway, raw: bytes, headers: dict[str, str],
                   candidates: list[ReplicaState], learn_id: bool, owner: str | None = None) -> web.StreamResponse:
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
                                       headers=headers, allow_redirects=False) as upstream:
                if upstream.status >= 500 and n + 1 < len(attempts):
                    ok = None
                    answered_5xx.append(replica)
                    gw.metrics.requests.labels(replica.name, "passthrough", str(upstream.status)).inc()
                    last_error = f"replica {replica.name} answered {upstream.status}"
                    continue
                watch = _IdWatch(gw, replica.name, owner) if learn_id and upstream.status == 200 else None
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

    __slots__ = ("gw", "replica", "owner", "found")

    def __init__(self, gw: Gateway, replica: str, owner: str | None = None) -> None:
        self.gw, self.replica, self.owner, self.found = gw, replica, owner, False

    def __call__(self, chunk: bytes) -> None:
        """A stream's chunk: its ``response.created`` event names the id."""
        if not self.found and (response_id := response_id_of_stream(chunk)) is not None:
            self.gw.response_homes.remember(response_id, self.replica, owner=self.owner)
            self.found = True

    def body(self, data: bytes | None) -> None:
        """A whole JSON answer: the Response object, ``id`` at its top."""
        try:
            response_id = orjson.loads(data or b"").get("id")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(response_id, str) and response_id:
            self.gw.response_homes.remember(response_id, self.replica, owner=self.owner)


async def _fanout(request: web.Request, gw: Gateway, raw: bytes, headers: dict[str, str]) -> web.Response:
    """An operator's request to every healthy replica; one answer as from one vLLM when all agree."""
    replicas = [r for r in gw.replicas.values() if r.healthy]
    if not replicas:
        return openai_error(503, "no healthy replica", type_="ServiceUnavailableError")

    async def one(replica: ReplicaState) -> tuple[int, bytes, str]:
        try:
            async with gw.http.request(request.method, replica.url + request.path_qs, data=raw or None,
                                       headers=headers, allow_redirects=False) as resp:
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
