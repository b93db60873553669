"""The Endpoint Picker protocol's messages (``prefix_router/epp/extproc.py``), built and read
without Envoy: the body modes a stream asks for, headers, the subset hint and the served
endpoint read from metadata, the destination written as header and metadata, immediate answers
and streamed bodies. The exchange that uses them: ``test_picker.py``; a real Envoy:
``tests/e2e/test_epp.py``."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from prefix_router.epp.extproc import (CHUNK_BYTES, DESTINATION_HEADER, METADATA_NAMESPACE, SERVED_KEY, duplex_modes,
                                       header_list, immediate, metadata, served_of, set_header, streamed, subset_of)
from prefix_router.errors import openai_error

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def test_the_duplex_modes_are_read_from_the_first_messages_protocol_config():
    assert duplex_modes(pb.ProcessingRequest()) == (False, False)
    first = pb.ProcessingRequest()
    first.protocol_config.request_body_mode = DUPLEX
    assert duplex_modes(first) == (True, False)
    first.protocol_config.response_body_mode = DUPLEX
    assert duplex_modes(first) == (True, True)


def test_headers_are_a_case_insensitive_multidict_of_raw_values_or_values():
    message = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key="X-Tag", raw_value=b"a"), base_pb2.HeaderValue(key="x-tag", raw_value=b"b"),
        base_pb2.HeaderValue(key="old-style", value="v"), base_pb2.HeaderValue(key="bad", raw_value=b"\xff")]))
    headers = header_list(message)
    assert headers[":path"] == "/v1/completions" and headers.getall("x-tag") == ["a", "b"]
    assert headers["Old-Style"] == "v" and headers["bad"] == "\ufffd"


def test_the_destination_is_set_as_a_header_replacing_any_and_as_load_balancing_metadata():
    option = set_header(DESTINATION_HEADER, "10.0.0.1:8000,10.0.0.2:8000")
    assert option.header.raw_value == b"10.0.0.1:8000,10.0.0.2:8000"
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    fields = metadata("10.0.0.1:8000").fields[METADATA_NAMESPACE].struct_value.fields
    assert fields[DESTINATION_HEADER].string_value == "10.0.0.1:8000"


def _with_metadata(namespace: str, values: dict) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    message.metadata_context.filter_metadata[namespace].update(values)
    return message


def test_the_subset_hint_is_the_string_endpoints_of_its_list_or_none_when_absent():
    assert subset_of(pb.ProcessingRequest()) is None
    assert subset_of(_with_metadata("envoy.lb.subset_hint", {"other": 1})) is None
    key = "x-gateway-destination-endpoint-subset"
    assert subset_of(_with_metadata("envoy.lb.subset_hint", {key: ["10.0.0.1:8000", 7, "10.0.0.2:8000"]})) == {
        "10.0.0.1:8000", "10.0.0.2:8000"}
    assert subset_of(_with_metadata("envoy.lb.subset_hint", {key: "10.0.0.1:8000"})) == frozenset()  # not a list


def test_the_served_endpoint_is_read_where_the_gateway_reports_it():
    assert served_of(pb.ProcessingRequest()) is None
    assert served_of(_with_metadata(METADATA_NAMESPACE, {SERVED_KEY: ""})) is None
    assert served_of(_with_metadata(METADATA_NAMESPACE, {SERVED_KEY: "10.0.0.2:8000"})) == "10.0.0.2:8000"


def test_an_answer_of_the_gateways_own_becomes_an_immediate_response_with_its_type_and_retry_after():
    answer = immediate(openai_error(429, "busy", headers={"Retry-After": "2", "X-Other": "no"}))
    sent = answer.immediate_response
    assert sent.status.code == 429 and b'"busy"' in sent.body
    assert {h.header.key.lower(): h.header.raw_value for h in sent.headers.set_headers} == {
        "content-type": b"application/json; charset=utf-8", "retry-after": b"2"}


def test_a_streamed_body_goes_back_in_chunks_the_last_one_ending_the_stream():
    body = b"x" * (2 * CHUNK_BYTES + 1)
    chunks = [c.request_body.response.body_mutation.streamed_response for c in streamed(body, end=True)]
    assert [len(c.body) for c in chunks] == [CHUNK_BYTES, CHUNK_BYTES, 1]
    assert [c.end_of_stream for c in chunks] == [False, False, True]
    assert not streamed(body, end=False)[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    (empty,) = streamed(b"", end=True, response=True)
    assert empty.HasField("response_body") and empty.response_body.response.body_mutation.streamed_response.end_of_stream
