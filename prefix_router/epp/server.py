"""The Endpoint Picker's gRPC server: Envoy's ``ExternalProcessor/Process`` (one ``picker.Exchange``
a stream) and the standard gRPC health service, for an aiohttp application's lifetime.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prefix_router.epp.picker import Exchange
from prefix_router.gateway import Gateway

__all__ = ["LIVENESS", "Picker", "READINESS", "add_picker"]

log = logging.getLogger(__name__)

# gRPC health services (the protocol's "Health Checking"; inference-extension: the name the
# reference picker's probes ask for, so manifests written for it work unchanged)
LIVENESS = "liveness"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READINESS = ("readiness", "", pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name, "inference-extension")

class Picker(pb_grpc.ExternalProcessorServicer):
    """``ExternalProcessor/Process`` for one gateway (``epp/picker.py``'s docstring)."""

    def __init__(self, gw: Gateway, fallbacks: int = 0) -> None:
        self.gw, self.fallbacks = gw, fallbacks
        self.active = 0  # exchanges (HTTP requests through the gateway) in progress

    async def Process(self, request_iterator, context):  # noqa: N802 (the gRPC method's name)
        exchange = Exchange(self.gw, self.fallbacks)
        self.active += 1
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    answers = await exchange.on_request_headers(message)
                elif kind == "request_body":
                    answers = await exchange.on_request_body(message)
                elif kind == "request_trailers":
                    answers = await exchange.on_request_trailers()
                elif kind == "response_headers":
                    answers = exchange.on_response_headers(message)
                elif kind == "response_body":
                    answers = exchange.on_response_body(message)
                elif kind == "response_trailers":
                    answers = exchange.on_response_trailers()
                else:
                    continue
                for answer in answers:
                    yield answer
        finally:
            self.active -= 1
            exchange.abandon()


def add_picker(app: web.Application, port: int, host: str = "0.0.0.0", fallbacks: int = 0) -> None:
    """Run the picker's gRPC server on ``host:port`` for ``app``'s lifetime (``fallbacks``:
    endpoints named after each chosen one), with the standard gRPC health service as the
    protocol names it: ``liveness`` SERVING while the process answers; ``readiness``, the
    ExternalProcessor service, the server as a whole (``""``) and ``inference-extension``
    SERVING from the start (the first discovery, health check and scrape are done by then)
    until shutdown. With no routable replica the picker stays ready and answers 503 itself, as
    the protocol asks; a NOT_SERVING picker would leave the gateway nothing to ask.

    On shutdown (SIGTERM) readiness turns NOT_SERVING and the exchanges in flight (streams
    being answered) get up to ``drain_s`` to end before the server stops. Raises ``OSError``
    at start when the port cannot be bound."""
    from prefix_router.app import GATEWAY

    state: dict = {}

    async def run(app: web.Application):
        server = grpc.aio.server()
        picker = Picker(app[GATEWAY], fallbacks)
        pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
        checker = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        try:  # grpcio raises where older releases returned 0
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} for gRPC: the port is taken, or the address is not this machine's")
        for service in (LIVENESS, *READINESS):
            await checker.set(service, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        log.info("endpoint picker (Envoy ext_proc) on %s:%d", host, port)
        state.update(picker=picker, checker=checker)
        yield
        await server.stop(grace=1.0)

    async def drain(app: web.Application) -> None:
        if "picker" not in state:
            return
        picker, checker = state["picker"], state["checker"]
        for service in READINESS:
            await checker.set(service, NOT_SERVING)
        drain_s = app[GATEWAY].config.drain_s
        log.info("endpoint picker: not ready; %d exchanges in flight get up to %g s to finish", picker.active, drain_s)
        deadline = time.monotonic() + drain_s
        while picker.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    app.cleanup_ctx.append(run)
    app.on_shutdown.append(drain)
