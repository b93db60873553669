"""The Endpoint Picker protocol's messages, as Envoy's ext_proc filter reads and writes them
(prefix_router/epp/picker.py holds the exchange itself).

Sources: the Gateway API Inference Extension's ``docs/proposals/004-endpoint-picker-protocol``
(the header and metadata keys, the subset hint, the served endpoint) and Envoy's
``envoy/service/ext_proc/v3/external_processor.proto`` and
``envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto`` (data-plane-api; PyPI
``xds-protos``) for the body modes: ``BUFFERED`` / ``STREAMED``, one answer per message, a body
replaced by ``body_mutation.body``; ``FULL_DUPLEX_STREAMED`` (how Istio and other Gateway API
gateways configure the filter), where the picker answers when it is ready, the headers' answer
first, and every body comes back as ``streamed_response`` chunks of at most ``CHUNK_BYTES``.
"""

from __future__ import annotations

from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

__all__ = ["CHUNK_BYTES", "DESTINATION_HEADER", "METADATA_NAMESPACE", "SERVED_KEY", "SKIP_BODIES", "duplex_modes",
           "header_list", "immediate", "metadata", "served_of", "set_header", "streamed", "subset_of"]

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the protocol's header and metadata key
METADATA_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"  # in METADATA_NAMESPACE, from the gateway
SUBSET_NAMESPACE, SUBSET_KEY = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
# A streamed body chunk's most bytes: processing_mode.proto recommends at most 64 KiB; the
# reference picker sends 62,000 (pkg/common/envoy/chunking.go), under some gateways' 64 KiB cap
CHUNK_BYTES = 62_000
_MODE = processing_mode_pb2.ProcessingMode
SKIP_BODIES = _MODE(request_body_mode=_MODE.NONE, response_header_mode=_MODE.SKIP, response_body_mode=_MODE.NONE)


def duplex_modes(message: pb.ProcessingRequest) -> tuple[bool, bool]:
    """(request body, response body) in ``FULL_DUPLEX_STREAMED`` mode, from the
    ``protocol_config`` Envoy puts in a stream's first message (both False without one)."""
    config = message.protocol_config
    return (config.request_body_mode == _MODE.FULL_DUPLEX_STREAMED,
            config.response_body_mode == _MODE.FULL_DUPLEX_STREAMED)


def header_list(message: pb.HttpHeaders) -> CIMultiDict:
    """A headers message as a multidict (pseudo-headers included; ``raw_value`` as UTF-8)."""
    out: CIMultiDict = CIMultiDict()
    for h in message.headers.headers:
        out.add(h.key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
    return out


def set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    """A header set, replacing any the request has."""
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def metadata(endpoint: str) -> struct_pb2.Struct:
    """The dynamic metadata naming the chosen endpoints (``envoy.lb``), as the header does."""
    out = struct_pb2.Struct()
    out.update({METADATA_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return out


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


def served_of(message: pb.ProcessingRequest) -> str | None:
    """The endpoint that served the request, where the gateway reports it (the protocol's
    "Destination Endpoint Served": filter metadata ``envoy.lb``,
    ``x-gateway-destination-endpoint-served``), else None."""
    lb = message.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    if lb is None or SERVED_KEY not in lb.fields:
        return None
    return lb.fields[SERVED_KEY].string_value or None


def immediate(response: web.Response) -> pb.ProcessingResponse:
    """An answer the gateway gives itself (an error ``serve`` would answer) as Envoy's immediate
    response: status, body, content type and ``Retry-After``."""
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
               for k, v in response.headers.items() if k.lower() in ("content-type", "retry-after")]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=response.status), body=response.body or b"",
        headers=pb.HeaderMutation(set_headers=headers)))


def streamed(body: bytes, end: bool, response: bool = False) -> list[pb.ProcessingResponse]:
    """``body`` back to Envoy in ``FULL_DUPLEX_STREAMED`` mode: chunks of at most
    ``CHUNK_BYTES``, the last with ``end_of_stream`` = ``end``; one empty chunk for an empty
    body. ``response``: the answer's body, else the request's."""
    pieces = [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=piece, end_of_stream=end and i == len(pieces) - 1)))
        out.append(pb.ProcessingResponse(response_body=pb.BodyResponse(response=common)) if response
                   else pb.ProcessingResponse(request_body=pb.BodyResponse(response=common)))
    return out
