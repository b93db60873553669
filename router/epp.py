"""The gateway as an Endpoint Picker: Envoy's external processor, choosing the replica of each
request by the same analysis, policy and accounting as ``serve`` (``prefix-router epp``).

The Gateway API Inference Extension's Endpoint Picker protocol
(kubernetes-sigs/gateway-api-inference-extension, ``docs/proposals/004-endpoint-picker-protocol``):
an Envoy-based gateway calls ``envoy.service.ext_proc.v3.ExternalProcessor/Process``, one
bidirectional gRPC stream per HTTP request (Envoy's protos from PyPI ``xds-protos``). Per
message Envoy sends, the picker answers one:

- request headers: for a routed path (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/responses``, ``/v1/messages``) with a body, continue (Envoy buffers the body:
  ``request_body_mode: BUFFERED``); for any other request, the least loaded routable replica at
  once, and no body or answer is sent to the picker (``mode_override``); a subset hint (filter
  metadata ``envoy.lb.subset_hint``) limits the choice to its endpoints, 503 when it leaves none;
- the request body: ``inbound.inbound_of`` (checks, tenant, salt, ``include_usage``) and
  ``proxy.route`` (analysis, admission, the policy), then the chosen endpoint as the header
  ``x-gateway-destination-endpoint: ip:port`` and in dynamic metadata
  ``envoy.lb/x-gateway-destination-endpoint``, with the route cache cleared and the body
  replaced when the gateway changed it; an error (400, 404, 429, 503) is Envoy's immediate
  response, with the OpenAI-style body ``serve`` gives;
- the response headers and body (``response_body_mode: STREAMED``): passed on through
  ``relay.UsageFilter`` (or ``dialects.Events``), so the client sees what ``serve`` would send,
  and read for the engine's usage; at the end of the body, ``learning.learn`` as for ``serve``.

While a request is between its choice and its answer's end it counts on its replica as in
``serve`` (``forward.InFlight``); a stream Envoy ends early (the client left) releases it. Retries
are Envoy's (its retry policy; the picker is asked again). The replicas are the configured
ones, or the InferencePool's endpoints through DNS discovery (a headless Service), named by
``ip:port``, which Envoy's original-destination cluster connects to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from multidict import CIMultiDict

from .constants import REPLICA_HEADER
from .dialects import MESSAGES, RESPONSES, Events
from .errors import openai_error
from .forward import InFlight, Outcome, answered
from .gateway import Gateway
from .inbound import inbound_of, loads
from .learning import learn
from .passthrough import home_of, refusal
from .policy import Decision
from .proxy import route
from .relay import UsageFilter

__all__ = ["DESTINATION_HEADER", "Picker", "serve_grpc", "subset_of"]

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the protocol's header and metadata key
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE, SUBSET_KEY = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
ROUTED = {"/v1/chat/completions": True, "/v1/completions": False, RESPONSES: True, MESSAGES: True}  # path: chat
_SKIP_BODIES = processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
                                                  response_header_mode=processing_mode_pb2.ProcessingMode.SKIP,
                                                  response_body_mode=processing_mode_pb2.ProcessingMode.NONE)


class _Client:
    """What ``inbound_of`` reads of a request: its headers (Envoy's, pseudo-headers left out)."""

    __slots__ = ("headers",)

    def __init__(self, headers: CIMultiDict) -> None:
        self.headers = headers


def _headers(message) -> CIMultiDict:
    out: CIMultiDict = CIMultiDict()
    for h in message.headers.headers:
        out.add(h.key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
    return out


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _pick(gw: Gateway, endpoint: str, body: bytes | None = None) -> pb.CommonResponse:
    """The request's mutation: its endpoint; as ``serve`` forwards it, a tenant's key never
    reaches the replica and ``auth.upstream_api_key`` does; ``body`` replacing the client's."""
    headers = [_set(DESTINATION_HEADER, endpoint)]
    common = pb.CommonResponse(clear_route_cache=True)
    if gw.config.auth.upstream_api_key:
        headers.append(_set("authorization", f"Bearer {gw.config.auth.upstream_api_key}"))
    elif gw.tenants.enabled:
        common.header_mutation.remove_headers.append("authorization")
    if body is not None:
        common.body_mutation.body = body
        headers.append(_set("content-length", str(len(body))))
    common.header_mutation.set_headers.extend(headers)
    return common


def subset_of(message: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the proxy lets this request go to (the protocol's subset hint: filter
    metadata ``envoy.lb.subset_hint``, key ``x-gateway-destination-endpoint-subset``, a list of
    ``ip:port``), or None when it names none."""
    hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    if value.WhichOneof("kind") != "list_value":
        return frozenset()
    return frozenset(v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value")


def _metadata(endpoint: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return metadata


def _immediate(response: web.Response) -> pb.ProcessingResponse:
    """An error ``serve`` would answer, as Envoy's immediate response."""
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
               for k, v in response.headers.items() if k.lower() in ("content-type", "retry-after")]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=response.status), body=response.body or b"",
        headers=pb.HeaderMutation(set_headers=headers)))


class _Exchange:
    """One HTTP request through Envoy: its choice, its slot on the replica, its answer read."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.headers: CIMultiDict = CIMultiDict()
        self.path = ""
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

    async def on_request_headers(self, message) -> pb.ProcessingResponse:
        self.headers = _headers(message)
        self.path = self.headers.get(":path", "").split("?", 1)[0]
        method = self.headers.get(":method", "")
        if method == "POST" and self.path in ROUTED and not message.end_of_stream:
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        # to one replica, as serve's passthrough sends it, with the keys it asks for (an
        # operator's POST goes to one replica here, not to all: send those to serve)
        refused = refusal(_Client(self.headers), self.gw, method, self.path)
        if refused is not None:
            return _immediate(refused)
        routable = sorted((r for r in self.gw.replicas.values()
                           if r.routable and (self.subset is None or r.name in self.subset)),
                          key=lambda r: (r.routing_load, r.name))
        if not routable:
            where = "" if self.subset is None else " in the endpoint subset"
            return _immediate(openai_error(503, "no healthy replica" + where, type_="ServiceUnavailableError"))
        endpoint = routable[0].name
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=_pick(self.gw, endpoint)),
                                     dynamic_metadata=_metadata(endpoint), mode_override=_SKIP_BODIES)

    async def on_request_body(self, message) -> pb.ProcessingResponse:
        self.body += message.request_body.body
        if not message.request_body.end_of_stream:
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        raw = bytes(self.body)
        client = _Client(CIMultiDict((k, v) for k, v in self.headers.items() if not k.startswith(":")))
        inbound = inbound_of(client, self.gw, self.path, ROUTED[self.path], raw)
        if isinstance(inbound, web.Response):
            return _immediate(inbound)
        if self.subset == frozenset():
            return _immediate(openai_error(503, "the endpoint subset is empty", type_="ServiceUnavailableError"))
        routed = await route(self.gw, inbound, self.subset) if inbound.prompt is not None else None
        body = inbound.payload if inbound.payload != raw else None
        if routed is None:  # a Responses chain this picker holds no history for: to its home
            home = await home_of(self.gw, str(inbound.body["previous_response_id"]), inbound.headers)
            candidates = [home] if home is not None else [r for r in self.gw.replicas.values() if r.routable]
            if not candidates:
                return _immediate(openai_error(503, "no healthy replica", type_="ServiceUnavailableError"))
            endpoint = candidates[0].name  # none holds it: any one answers vLLM's own 404
            return pb.ProcessingResponse(request_body=pb.BodyResponse(response=_pick(self.gw, endpoint, body)),
                                         dynamic_metadata=_metadata(endpoint), mode_override=_SKIP_BODIES)
        if isinstance(routed, web.Response):
            return _immediate(routed)
        self.inbound, (self.info, self.decision, _) = inbound, routed
        replica = self.gw.replicas[self.decision.replica]
        self.slot = InFlight(self.gw, replica, self.info, self.decision).__enter__()
        self.sent_at = time.perf_counter()
        dialect = inbound.path in (RESPONSES, MESSAGES)
        self.events = Events(inbound.path) if dialect and inbound.stream else (
            UsageFilter(keep_usage=inbound.client_wants_usage) if inbound.stream else None)
        endpoint = replica.name
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=_pick(self.gw, endpoint, body)),
                                     dynamic_metadata=_metadata(endpoint))

    def on_response_headers(self, message) -> pb.ProcessingResponse:
        """The replica's status; the answer is named by ``x-prefix-router-replica``, as in ``serve``."""
        status = _headers(message).get(":status", "0")
        self.status = int(status) if status.isdigit() else 0
        response = pb.HeadersResponse()
        if self.decision is not None:
            response.response.header_mutation.set_headers.append(_set(REPLICA_HEADER, self.decision.replica))
        if message.end_of_stream:  # an answer without a body: no body message will come
            self.finish()
        return pb.ProcessingResponse(response_headers=response)

    def on_response_body(self, message) -> pb.ProcessingResponse:
        chunk, end = message.response_body.body, message.response_body.end_of_stream
        if self.events is None or self.status != 200:
            self.answer += chunk
            out = None
        else:
            out = self.events.feed(chunk) + (self.events.flush() if end else b"")
            if self.ttft is None and self.events.saw_data:
                self.ttft = time.perf_counter() - self.sent_at
        if end:
            self.finish()
        response = pb.BodyResponse()
        if out is not None and out != chunk:
            response.response.body_mutation.body = out
        return pb.ProcessingResponse(response_body=response)

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
        slot.__exit__(None, None, None)
        if self.status >= 500:
            return
        usage, answer, response_id = answered(self.inbound.path, self.events, answer, usage)
        outcome = Outcome(None, self.status, slot.replica, self.decision, self.decision.route, usage, self.ttft,
                          elapsed, slot.held_blocks, slot.evicted_block, answer, response_id)
        learn(self.gw, self.inbound, self.info, outcome)

    def abandon(self) -> None:
        """Envoy ended the stream before the answer did (the client left, a timeout)."""
        if self.slot is not None:
            slot, self.slot = self.slot, None
            slot.__exit__(None, None, None)


class Picker(pb_grpc.ExternalProcessorServicer):
    """``ExternalProcessor/Process`` for one gateway (module docstring)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def Process(self, request_iterator, context):  # noqa: N802 (the gRPC method's name)
        exchange = _Exchange(self.gw)
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    exchange.subset = subset_of(message)
                    yield await exchange.on_request_headers(message.request_headers)
                elif kind == "request_body":
                    yield await exchange.on_request_body(message)
                elif kind == "response_headers":
                    yield exchange.on_response_headers(message.response_headers)
                elif kind == "response_body":
                    yield exchange.on_response_body(message)
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        finally:
            exchange.abandon()


def serve_grpc(port: int, host: str = "0.0.0.0"):
    """An aiohttp ``cleanup_ctx`` entry: the picker's gRPC server on ``host:port`` (with the
    standard gRPC health service: SERVING while a replica is routable) for the app's lifetime."""
    from .app import GATEWAY

    async def run(app: web.Application):
        gw = app[GATEWAY]
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(Picker(gw), server)
        checker = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        if server.add_insecure_port(f"{host}:{port}") == 0:
            raise OSError(f"cannot listen on {host}:{port} for gRPC")
        await server.start()
        log.info("endpoint picker (Envoy ext_proc) on %s:%d", host, port)

        async def ready() -> None:
            while True:
                serving = any(r.routable for r in gw.replicas.values())
                status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
                await checker.set("", status)
                await checker.set(pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name, status)
                await asyncio.sleep(1.0)

        task = asyncio.create_task(ready())
        yield
        task.cancel()
        await server.stop(grace=1.0)

    return run
