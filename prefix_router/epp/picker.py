"""The gateway as an Endpoint Picker: Envoy's external processor, choosing the replica of each
request by the same analysis, policy and accounting as ``serve`` (``prefix-router epp``).
``Exchange`` is one HTTP request's exchange; ``epp/server.py`` serves it over gRPC.

The Gateway API Inference Extension's Endpoint Picker protocol
(kubernetes-sigs/gateway-api-inference-extension, ``docs/proposals/004-endpoint-picker-protocol``):
an Envoy-based gateway calls ``envoy.service.ext_proc.v3.ExternalProcessor/Process``, one
bidirectional gRPC stream per HTTP request (the messages: prefix_router/epp/extproc.py). Either body mode
the filter is configured with works, as its first message says (``protocol_config``):
``BUFFERED`` request and ``STREAMED`` response bodies (plain Envoy, ``launch.ENVOY_CONFIG``),
where each message gets one answer, or ``FULL_DUPLEX_STREAMED`` both ways (Istio and other
Gateway API gateways), where the picker holds the request's headers and body until it has
chosen, then answers the headers and streams the body back, and streams every answer chunk back.

- request headers: first the keys the path needs (``Tenants.refusal``: a 401 or 403 before any
  body is read) and the body's declared length (413 past ``limits.max_body_bytes``); for a
  routed path (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
  ``/v1/messages``) or a generating one (``endpoints.GENERATES``: ``/invocations``...) with a
  body, wait for the body, buffered up to ``max_body_bytes`` (413 past it, nothing more kept);
  a stored Response goes to its home, 404 to a tenant that did not create it; for any other
  request, the least loaded routable replica at once, the bodies passed on untouched (not sent
  to the picker at all where the mode allows: ``mode_override``); a subset hint (filter
  metadata ``envoy.lb.subset_hint``) limits the choice to its endpoints, 503 when it leaves none;
- the request body: ``inbound.inbound_of`` (checks, tenant, salt, ``include_usage``) and
  ``proxy.route`` (analysis, admission, the policy); a generating body gets the changes
  ``passthrough.isolated`` makes (the tenant's salt) and the least loaded replica; then the chosen endpoint as the header
  ``x-gateway-destination-endpoint: ip:port`` and in dynamic metadata
  ``envoy.lb/x-gateway-destination-endpoint``, with the route cache cleared and the body
  replaced when the gateway changed it (``--fallbacks N``: N more endpoints after it,
  ``ip:port,ip:port``, for gateways that try them in order); an error (400, 404, 429, 503) is
  Envoy's immediate response, with the OpenAI-style body ``serve`` gives;
- the response headers: the endpoint that served the request where the gateway reports it
  (``envoy.lb/x-gateway-destination-endpoint-served``); a fallback's answer counts on the
  fallback, as a retry, and the chosen replica's breaker hears of its failure;
- the response body: passed on through ``relay.UsageFilter`` (or ``responses.Events``), so the
  client sees what ``serve`` would send, and read for the engine's usage; at its end,
  ``learning.learn`` as for ``serve``.

While a request is between its choice and its answer's end it counts on its replica as in
``serve`` (``forward.InFlight``); a stream Envoy ends early (the client left) releases it. Retries
are the gateway's and do not ask the picker again: they go down the endpoint list
(``--fallbacks``), then to the gateway's own fallback choice (Istio: round robin). The replicas
are the configured ones, or the InferencePool's endpoints through DNS discovery (a headless
Service), named by ``ip:port``: what Envoy's original-destination cluster connects to and what
Istio's override-host policy looks up among the pool's endpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from multidict import CIMultiDict

from prefix_router.serve.bodies import head_of, loads, shape_refusal
from prefix_router.constants import REPLICA_HEADER
from prefix_router.prompts.responses import MESSAGES, RESPONSES, Events
from prefix_router.endpoints import ROUTED, Kind, kind_of, stored_id
from prefix_router.errors import openai_error, response_not_found
from prefix_router.epp.extproc import (DESTINATION_HEADER, SKIP_BODIES, duplex_modes, header_list, immediate, metadata, served_of,
                      set_header, streamed, subset_of)
from prefix_router.serve.forward import InFlight, Outcome, answered
from prefix_router.gateway import Gateway
from prefix_router.serve.inbound import forward_headers, inbound_of
from prefix_router.serve.learning import learn
from prefix_router.serve.passthrough import home_of, isolated
from prefix_router.routing.decision import Decision, Route
from prefix_router.serve.proxy import route
from prefix_router.serve.relay import UsageFilter
from prefix_router.fleet.tenants import KEY_HEADERS

__all__ = ["DESTINATION_HEADER", "Exchange", "subset_of"]


Answers = list[pb.ProcessingResponse]


class _Client:
    """What ``inbound_of`` reads of a request: its headers (Envoy's, pseudo-headers left out)."""

    __slots__ = ("headers",)

    def __init__(self, headers: CIMultiDict) -> None:
        self.headers = headers


def _pick(gw: Gateway, client: _Client, endpoint: str, body: bytes | None = None,
          duplex: bool = False) -> pb.CommonResponse:
    """The request's mutation: its endpoint; as ``serve`` forwards it
    (``Tenants.upstream_headers``), ``auth.upstream_api_key`` replaces the client's
    Authorization, which reaches the replica only from an open gateway and never when it is a
    tenant's or an admin's key; ``body`` replacing the client's (in duplex mode the body is
    streamed back instead, and Envoy drops the content length)."""
    headers = [set_header(DESTINATION_HEADER, endpoint)]
    common = pb.CommonResponse(clear_route_cache=True)
    if gw.config.auth.upstream_api_key:
        headers.append(set_header("authorization", f"Bearer {gw.config.auth.upstream_api_key}"))
        common.header_mutation.remove_headers.append("x-api-key")
    elif not gw.tenants.forwards_client_key(client):
        common.header_mutation.remove_headers.extend(KEY_HEADERS)
    if body is not None and not duplex:
        common.body_mutation.body = body
        headers.append(set_header("content-length", str(len(body))))
    common.header_mutation.set_headers.extend(headers)
    return common


class Exchange:
    """One HTTP request through Envoy: its choice, its slot on the replica, its answer read.
    ``fallbacks``: how many endpoints to name after the chosen one. Each ``on_*`` method takes
    one of Envoy's messages and returns the answers to send, in order (none while it waits)."""

    def __init__(self, gw: Gateway, fallbacks: int = 0) -> None:
        self.gw, self.fallbacks = gw, fallbacks
        self.duplex = self.duplex_answer = False  # FULL_DUPLEX_STREAMED request / response bodies
        self.passing = False  # duplex: a body not routed by prefix, streamed back as it comes
        self.route: Route | None = None  # retry, once the gateway reports a fallback served it
        self.headers: CIMultiDict = CIMultiDict()
        self.client = _Client(CIMultiDict())  # the headers as inbound_of and the key checks read them
        self.path = ""
        self.kind = Kind.UNKNOWN
        self.body = bytearray()
        self.inbound = self.info = None
        self.decision: Decision | None = None
        self.slot: InFlight | None = None
        self.status = 0
        self.events = None
        self.answer = bytearray()
        self.sent_at = 0.0
        self.ttft: float | None = None
        self.subset: frozenset[str] | None = None

    async def on_request_headers(self, request: pb.ProcessingRequest) -> Answers:
        if request.HasField("protocol_config"):
            self.duplex, self.duplex_answer = duplex_modes(request)
        self.subset = subset_of(request)
        message = request.request_headers
        self.headers = header_list(message)
        self.client = _Client(CIMultiDict((k, v) for k, v in self.headers.items() if not k.startswith(":")))
        self.path = self.headers.get(":path", "").split("?", 1)[0]
        method = self.headers.get(":method", "")
        self.kind = kind_of(method, self.path, self.gw.config.auth.tenant_paths)
        # the keys first: no body is read for a request that has not the key it needs (an
        # operator's POST goes to one replica here, not to all: send those to serve)
        refused = self.gw.tenants.refusal(self.client, self.kind, method, self.path)
        if refused is None:
            refused = self._too_large(self.headers.get("content-length", ""))
        if refused is not None:
            return [immediate(refused)]
        if self.kind in (Kind.ROUTED, Kind.GENERATES) and not message.end_of_stream:
            return [] if self.duplex else [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        response_id = stored_id(self.path) if self.kind is Kind.STORED else None
        if response_id is not None:
            return await self._to_home(response_id, message.end_of_stream)
        routable = self._routable()
        if not routable:
            where = "" if self.subset is None else " in the endpoint subset"
            return [immediate(openai_error(503, "no healthy replica" + where, type_="ServiceUnavailableError"))]
        self.passing = self.duplex and not message.end_of_stream
        return [self._to(routable[0].name, headers=True)]

    def _routable(self) -> list:
        """Routable replicas in the subset, least loaded first."""
        return sorted((r for r in self.gw.replicas.values()
                       if r.routable and (self.subset is None or r.name in self.subset)),
                      key=lambda r: (r.routing_load, r.name))

    def _too_large(self, declared: str | int) -> web.Response | None:
        """The 413 for a body of ``declared`` bytes past ``limits.max_body_bytes``, else None."""
        limit = self.gw.config.limits.max_body_bytes
        if isinstance(declared, str):
            declared = int(declared) if declared.isascii() and declared.isdigit() else 0
        if declared > limit:
            return openai_error(413, f"request body of {declared} bytes exceeds the limit of {limit}")
        return None

    async def _to_home(self, response_id: str, end: bool) -> Answers:
        """A stored Response's request: to the replica holding it; 404 to a tenant that did not
        create it (``response_homes.py``), or when no routable replica holds it."""
        tenant = self.gw.tenants.tenant_of(self.client) if self.gw.tenants.enabled else None
        if tenant is not None and not self.gw.response_homes.owned_by(response_id, tenant.name):
            return [immediate(response_not_found(response_id))]
        home = await home_of(self.gw, response_id, forward_headers(self.client, self.gw))
        if home is None:
            return [immediate(response_not_found(response_id))]
        self.passing = self.duplex and not end
        return [self._to(home.name, headers=True)]

    def _to(self, endpoint: str, headers: bool = False, body: bytes | None = None,
            skip_bodies: bool = True) -> pb.ProcessingResponse:
        """The answer that sends the request to ``endpoint``: as the headers' answer or the
        buffered body's; ``skip_bodies``: no more is said of it (the answer is not read)."""
        common = _pick(self.gw, self.client, endpoint, body, self.duplex)
        mode = SKIP_BODIES if skip_bodies and not self.duplex else None  # duplex: Istio allows no mode override
        if headers or self.duplex:
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                         dynamic_metadata=metadata(endpoint), mode_override=mode)
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                     dynamic_metadata=metadata(endpoint), mode_override=mode)

    async def on_request_body(self, request: pb.ProcessingRequest) -> Answers:
        message = request.request_body
        if self.passing:
            return streamed(message.body, message.end_of_stream)
        refused = self._too_large(len(self.body) + len(message.body))
        if refused is not None:
            self.body = bytearray()  # nothing more is kept
            return [immediate(refused)]
        self.body += message.body
        if not message.end_of_stream:
            return [] if self.duplex else [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        return await self.choose(end=True)

    async def on_request_trailers(self) -> Answers:
        """Trailers end a duplex request's body (none come in buffered mode's configuration)."""
        done = [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if self.duplex and not self.passing and self.slot is None and self.decision is None:
            return [*await self.choose(end=False), *done]
        return done

    async def choose(self, end: bool) -> Answers:
        """The whole request body is here: check it, route it, send it on (``end``: no trailers follow)."""
        raw = bytes(self.body)
        if self.kind is Kind.GENERATES:
            return self._generating(raw, end)
        inbound = inbound_of(self.client, self.gw, self.path, ROUTED[self.path], raw)
        if isinstance(inbound, web.Response):
            return [immediate(inbound)]
        if self.subset == frozenset():
            return [immediate(openai_error(503, "the endpoint subset is empty", type_="ServiceUnavailableError"))]
        routed = await route(self.gw, inbound, self.subset) if inbound.prompt is not None else None
        body = inbound.payload if inbound.payload != raw else None
        if routed is None:  # a Responses chain this picker holds no history for: to its home
            home = await home_of(self.gw, str(inbound.body["previous_response_id"]), inbound.headers)
            candidates = [home] if home is not None else [r for r in self.gw.replicas.values() if r.routable]
            if not candidates:
                return [immediate(openai_error(503, "no healthy replica", type_="ServiceUnavailableError"))]
            # none holds it: any one answers vLLM's own 404
            return [self._to(candidates[0].name, body=body), *self._body_back(body or raw, end)]
        if isinstance(routed, web.Response):
            return [immediate(routed)]
        self.inbound, (self.info, self.decision, _) = inbound, routed
        replica = self.gw.replicas[self.decision.replica]
        self.slot = InFlight(self.gw, replica, self.info, self.decision).acquire()
        self.sent_at = time.perf_counter()
        dialect = inbound.path in (RESPONSES, MESSAGES)
        self.events = Events(inbound.path) if dialect and inbound.stream else (
            UsageFilter(keep_usage=inbound.client_wants_usage) if inbound.stream else None)
        endpoint = ",".join([replica.name, *self.fallbacks_of(self.decision)])
        return [self._to(endpoint, body=body, skip_bodies=False), *self._body_back(body or raw, end)]

    def _generating(self, raw: bytes, end: bool) -> Answers:
        """A generating body (``endpoints.GENERATES``): isolated as ``serve`` sends it, to the
        least loaded replica."""
        refused = shape_refusal(raw, self.gw.config.limits)
        tenant = self.gw.tenants.tenant_of(self.client) if self.gw.tenants.enabled else None
        body = refused or isolated(self.gw, tenant, raw, head_of(raw), self.path)
        if isinstance(body, web.Response):
            return [immediate(body)]
        routable = self._routable()
        if not routable:
            return [immediate(openai_error(503, "no healthy replica", type_="ServiceUnavailableError"))]
        changed = body if body is not raw else None
        return [self._to(routable[0].name, body=changed), *self._body_back(body, end)]

    def _body_back(self, body: bytes, end: bool) -> Answers:
        """Duplex mode: the request body Envoy is waiting for, streamed back."""
        return streamed(body, end) if self.duplex else []

    def fallbacks_of(self, decision: Decision) -> list[str]:
        """Up to ``fallbacks`` other routable endpoints the request may go to, in the subset:
        those believed to hold most of the prompt first, then the least loaded."""
        if self.fallbacks <= 0:
            return []
        others = [r for r in self.gw.replicas.values() if r.routable and r.name != decision.replica
                  and (self.subset is None or r.name in self.subset)]
        others.sort(key=lambda r: (-decision.matches.get(r.name, 0), r.routing_load, r.name))
        return [r.name for r in others[:self.fallbacks]]

    def on_served(self, served: str | None) -> None:
        """The gateway reports a fallback served the request: the chosen replica failed it (its
        breaker hears so) and the request counts on the one that served it, as a retry."""
        if self.slot is None or served is None or served == self.slot.replica.name or served not in self.gw.replicas:
            return
        failed, self.slot = self.slot, None
        failed.ok, failed.failed = False, True
        failed.release()
        held = self.decision.matches.get(served, 0)  # what the fallback holds, not the chosen one
        self.slot = InFlight(self.gw, self.gw.replicas[served], self.info,
                             dataclasses.replace(self.decision, replica=served, predicted_blocks=held)).acquire()
        self.route = Route.RETRY

    def on_response_headers(self, request: pb.ProcessingRequest) -> Answers:
        """The replica's status; the answer is named by ``x-prefix-router-replica``, as in ``serve``."""
        message = request.response_headers
        self.on_served(served_of(request))
        status = header_list(message).get(":status", "0")
        self.status = int(status) if status.isascii() and status.isdigit() else 0
        response = pb.HeadersResponse()
        if self.slot is not None:
            response.response.header_mutation.set_headers.append(set_header(REPLICA_HEADER, self.slot.replica.name))
        if message.end_of_stream:  # an answer without a body: no body message will come
            self.finish()
        return [pb.ProcessingResponse(response_headers=response)]

    def on_response_body(self, request: pb.ProcessingRequest) -> Answers:
        chunk, end = request.response_body.body, request.response_body.end_of_stream
        out = None
        if self.slot is None:
            pass  # not one this picker counts: passed on as it is
        elif self.events is None or self.status != 200:
            self.answer += chunk
        else:
            out = self.events.feed(chunk) + (self.events.flush() if end else b"")
            if self.ttft is None and self.events.saw_data:
                self.ttft = time.perf_counter() - self.sent_at
                self.slot.prefilled()
        if end:
            self.finish()
        if self.duplex_answer:
            return streamed(chunk if out is None else out, end, response=True)
        response = pb.BodyResponse()
        if out is not None and out != chunk:
            response.response.body_mutation.body = out
        return [pb.ProcessingResponse(response_body=response)]

    def on_response_trailers(self) -> Answers:
        """Trailers end a duplex answer's body: what the usage filter still holds goes first."""
        out: Answers = []
        if self.duplex_answer and self.slot is not None and self.events is not None and self.status == 200:
            out = streamed(self.events.flush(), False, response=True)
        self.finish()
        return [*out, pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]

    def finish(self) -> None:
        """The answer ended: release the replica, learn from the usage."""
        if self.slot is None:
            return
        slot, self.slot = self.slot, None
        elapsed = time.perf_counter() - self.sent_at
        usage = answer = None
        if self.events is not None:
            usage = self.events.usage
        elif self.status == 200:
            with contextlib.suppress(ValueError, RecursionError):
                parsed = loads(bytes(self.answer))
                if isinstance(parsed, dict):
                    answer, usage = parsed, parsed.get("usage")
            self.ttft = elapsed
        slot.relayed(self.status if self.status < 500 else 502)
        slot.failed = self.status >= 500
        slot.release()
        if self.status >= 500:
            return
        usage, answer, response_id = answered(self.inbound.path, self.events, answer, usage)
        outcome = Outcome(None, self.status, slot.replica, self.decision, self.route or self.decision.route, usage,
                          self.ttft, elapsed, slot.held_blocks, slot.view, slot.removals, answer, response_id)
        learn(self.gw, self.inbound, self.info, outcome)

    def abandon(self) -> None:
        """Envoy ended the stream before the answer did (the client left, a timeout)."""
        if self.slot is not None:
            slot, self.slot = self.slot, None
            slot.release()
