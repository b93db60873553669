"""The Endpoint Picker's exchange (``prefix_router/epp/picker.py``), message by message, without
Envoy: ext_proc requests built here, a gateway in the test's event loop in front of simulated
replicas. The picker behind a real Envoy: ``tests/e2e/test_epp.py``."""

from __future__ import annotations

import json

from prefix_router.metrics import sample_sum


def _headers(pairs: dict[str, str], end_of_stream: bool = False):
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]), end_of_stream=end_of_stream)


def _request_headers(pairs: dict[str, str], end_of_stream: bool = False):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return pb.ProcessingRequest(request_headers=_headers(pairs, end_of_stream))


def _body(payload: dict):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(payload).encode(), end_of_stream=True))


async def _picker_exchange(fleet, aiohttp_client, fallbacks: int = 0, **sections):
    from prefix_router.app import GATEWAY, create_app
    from prefix_router.config import config_from_dict
    from prefix_router.epp.picker import Exchange
    from prefix_router.prompts.tokenizer import ByteTokenizer

    servers = await fleet(3)
    data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers], **sections}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    return Exchange(client.server.app[GATEWAY], fallbacks)


async def test_the_picker_asks_the_keys_serve_asks_and_keeps_a_tenants_key_from_the_replica(fleet, aiohttp_client):
    auth = {"auth": {"tenants": [{"name": "acme", "keys": ["key-of-acme"]}], "admin_keys": ["key-of-admin"]}}
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    (refused,) = await exchange.on_request_headers(_request_headers(
        {":method": "POST", ":path": "/reset_prefix_cache", "authorization": "Bearer key-of-acme"}, True))
    assert refused.immediate_response.status.code == 403  # an operator's endpoint: an admin's key
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    assert (await exchange.on_request_headers(_request_headers({":method": "GET", ":path": "/version"}, True))
            )[0].immediate_response.status.code == 401
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    headers = {":method": "POST", ":path": "/v1/chat/completions", "authorization": "Bearer key-of-acme",
               "content-type": "application/json"}
    await exchange.on_request_headers(_request_headers(headers))
    (picked,) = await exchange.on_request_body(_body({"model": "sim", "messages": [{"role": "user", "content": "hi"}]}))
    common = picked.request_body.response
    assert "authorization" in common.header_mutation.remove_headers  # the tenant's key stays here
    sent = json.loads(common.body_mutation.body)
    assert sent["cache_salt"] == "tenant:acme"  # the tenant's salt, set by the picker as serve sets it
    endpoint = next(h.header.raw_value.decode() for h in common.header_mutation.set_headers
                    if h.header.key == "x-gateway-destination-endpoint")
    assert endpoint in exchange.gw.replicas
    assert picked.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == endpoint
    exchange.abandon()
    assert all(r.inflight == 0 for r in exchange.gw.replicas.values())


def _destination(common) -> str:
    return next(h.header.raw_value.decode() for h in common.header_mutation.set_headers
                if h.header.key == "x-gateway-destination-endpoint")


async def test_fallbacks_follow_the_choice_and_a_fallback_that_served_takes_the_request(fleet, aiohttp_client):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from google.protobuf import struct_pb2

    exchange = await _picker_exchange(fleet, aiohttp_client, fallbacks=2)
    gw = exchange.gw
    await exchange.on_request_headers(_request_headers({":method": "POST", ":path": "/v1/chat/completions"}))
    (picked,) = await exchange.on_request_body(_body({"model": "sim", "messages": [{"role": "user", "content": "hello " * 40}]}))
    endpoints = _destination(picked.request_body.response).split(",")
    assert endpoints[0] == exchange.decision.replica and len(endpoints) == 3 == len(set(endpoints))
    assert set(endpoints) == set(gw.replicas)
    assert picked.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == ",".join(endpoints)  # the same value in both
    chosen, fallback = endpoints[0], endpoints[1]
    assert gw.replicas[chosen].inflight == 1
    queued = gw.replicas[chosen].prefill_blocks  # the prompt, queued for prefill there (new work)
    assert queued > 0
    # the gateway reports that the first fallback served it: the request counts there, as a retry
    served = struct_pb2.Struct()
    served.update({"envoy.lb": {"x-gateway-destination-endpoint-served": fallback}})
    request = pb.ProcessingRequest(response_headers=_headers({":status": "200"}))
    request.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served.fields["envoy.lb"].struct_value)
    (headers,) = exchange.on_response_headers(request)
    assert (gw.replicas[chosen].inflight, gw.replicas[fallback].inflight) == (0, 1)
    # neither held any of it: the same prompt now queues on the fallback alone
    assert (gw.replicas[chosen].prefill_blocks, gw.replicas[fallback].prefill_blocks) == (0, queued)
    assert gw.replicas[chosen].breaker.failures == 1
    named = {h.header.key: h.header.raw_value.decode() for h in headers.response_headers.response.header_mutation.set_headers}
    assert named["x-prefix-router-replica"] == fallback
    answer = {"id": "x", "object": "chat.completion", "choices": [],
              "usage": {"prompt_tokens": 250, "completion_tokens": 1, "total_tokens": 251,
                        "prompt_tokens_details": {"cached_tokens": 0}}}
    exchange.on_response_body(pb.ProcessingRequest(response_body=pb.HttpBody(body=json.dumps(answer).encode(),
                                                                              end_of_stream=True)))
    assert (gw.replicas[fallback].inflight, gw.replicas[fallback].prefill_blocks) == (0, 0)
    from prometheus_client import generate_latest

    page = generate_latest(gw.metrics.registry).decode()
    assert sample_sum(page, "prefix_router_requests_total", route="retry", replica=fallback) == 1


async def test_without_fallbacks_the_header_names_one_endpoint_and_an_unknown_served_changes_nothing(
        fleet, aiohttp_client):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    exchange = await _picker_exchange(fleet, aiohttp_client)
    assert len(await exchange.on_request_headers(_request_headers({":method": "POST", ":path": "/v1/completions"}))) == 1
    (picked,) = await exchange.on_request_body(_body({"model": "sim", "prompt": "hello " * 40}))
    assert _destination(picked.request_body.response) == exchange.decision.replica
    request = pb.ProcessingRequest(response_headers=_headers({":status": "200"}))
    request.metadata_context.filter_metadata["envoy.lb"].fields[
        "x-gateway-destination-endpoint-served"].string_value = "10.9.9.9:1"
    exchange.on_response_headers(request)
    assert exchange.gw.replicas[exchange.decision.replica].inflight == 1 and exchange.route is None
    exchange.abandon()


async def test_the_picker_asks_for_the_key_before_any_body_and_bounds_what_it_buffers(fleet, aiohttp_client):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    auth = {"auth": {"tenants": [{"name": "acme", "keys": ["key-of-acme"]}]}, "limits": {"max_body_bytes": 4096}}
    routed = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    (refused,) = await exchange.on_request_headers(_request_headers(routed))  # a body is to follow
    assert refused.immediate_response.status.code == 401 and exchange.body == bytearray()
    keyed = {**routed, "authorization": "Bearer key-of-acme"}
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    (refused,) = await exchange.on_request_headers(_request_headers({**keyed, "content-length": "900000000"}))
    assert refused.immediate_response.status.code == 413
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    await exchange.on_request_headers(_request_headers(keyed))  # no declared length: counted as it comes
    chunk = pb.ProcessingRequest(request_body=pb.HttpBody(body=b" " * 3000, end_of_stream=False))
    assert (await exchange.on_request_body(chunk))[0].HasField("request_body")
    (refused,) = await exchange.on_request_body(chunk)
    assert refused.immediate_response.status.code == 413
    assert json.loads(refused.immediate_response.body)["error"]["code"] == 413
    assert len(exchange.body) <= 4096  # nothing past the limit was kept


async def test_the_picker_salts_generating_endpoints_and_keeps_stored_responses_to_their_tenant(fleet, aiohttp_client):
    auth = {"auth": {"tenants": [{"name": "acme", "keys": ["key-of-acme"]}, {"name": "bolt", "keys": ["key-of-bolt"]}]}}
    exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
    headers = {":method": "POST", ":path": "/invocations", "authorization": "Bearer key-of-bolt",
               "content-type": "application/json"}
    assert await exchange.on_request_headers(_request_headers(headers)) != []  # waits for the body
    (picked,) = await exchange.on_request_body(_body({"model": "sim", "prompt": "x", "cache_salt": "tenant:acme",
                                                      "vllm_xargs": {"kv_cache_report_mode": "full"}}))
    common = picked.request_body.response
    sent = json.loads(common.body_mutation.body)
    assert sent["cache_salt"] == "tenant:bolt" and sent["vllm_xargs"] == {}
    assert "authorization" in common.header_mutation.remove_headers
    assert _destination(common) in exchange.gw.replicas
    exchange.gw.response_homes.remember("resp_of_acme", _destination(common), owner="acme")
    for key, status in (("key-of-bolt", 404), ("key-of-acme", None)):
        exchange = await _picker_exchange(fleet, aiohttp_client, **auth)
        exchange.gw.response_homes.remember("resp_of_acme", next(iter(exchange.gw.replicas)), owner="acme")
        (answer,) = await exchange.on_request_headers(_request_headers(
            {":method": "GET", ":path": "/v1/responses/resp_of_acme", "authorization": f"Bearer {key}"}, True))
        if status is None:
            assert _destination(answer.request_headers.response) == next(iter(exchange.gw.replicas))
        else:
            assert answer.immediate_response.status.code == status


async def test_in_duplex_mode_the_picker_answers_once_it_has_chosen(fleet, aiohttp_client):
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    exchange = await _picker_exchange(fleet, aiohttp_client)
    first = _request_headers({":method": "POST", ":path": "/v1/chat/completions"})
    first.protocol_config.request_body_mode = first.protocol_config.response_body_mode = duplex
    assert await exchange.on_request_headers(first) == []  # the headers wait for the body
    raw = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "x" * 70_000}]}).encode()
    half = len(raw) // 2
    assert await exchange.on_request_body(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[:half]))) == []
    answers = await exchange.on_request_body(pb.ProcessingRequest(
        request_body=pb.HttpBody(body=raw[half:], end_of_stream=True)))
    headers, *chunks = answers
    assert _destination(headers.request_headers.response) == exchange.decision.replica
    assert headers.request_headers.response.clear_route_cache
    assert not headers.HasField("mode_override")
    sent = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert len(sent) == 2 and [c.end_of_stream for c in sent] == [False, True]
    assert json.loads(b"".join(c.body for c in sent))["messages"] == json.loads(raw)["messages"]
    (back,) = exchange.on_response_body(pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"partial": ')))
    assert back.response_body.response.body_mutation.streamed_response.body == b'{"partial": '
    exchange.abandon()
