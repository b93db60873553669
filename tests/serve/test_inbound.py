"""The first step of a request (prefix_router/serve/inbound.py): the client's body read, checked
and prepared for every replica, or answered with an OpenAI-style error.

``read_inbound`` runs in a small aiohttp app of the test's that answers what it made of the
request as JSON, so the HTTP side (bodies, headers) is real.
"""

from __future__ import annotations

import base64
import json

import pytest
from aiohttp import web

from prefix_router.config import config_from_dict
from prefix_router.fleet.replicas import apply_health, apply_metrics
from prefix_router.gateway import Gateway
from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.serve.inbound import Inbound, patched, read_inbound

from ..helpers import MODEL

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
ERROR_FIELDS = {"message", "type", "param", "code"}


def described(inbound: Inbound) -> dict:
    return {"payload": base64.b64encode(inbound.payload).decode(), "headers": inbound.headers, "body": inbound.body,
            "prompt": inbound.prompt, "stream": inbound.stream, "client_wants_usage": inbound.client_wants_usage,
            "session": inbound.session, "tenant": inbound.tenant, "session_by_user": inbound.session_by_user}


@pytest.fixture
async def inbound(aiohttp_client):
    """``await inbound(**config)``: a client of an app answering, for a POST to any of the four
    generating paths, what ``read_inbound`` made of it (JSON, ``payload`` in base64) or its error.
    The gateway's replicas are routable unless ``routable=False``."""

    async def start(routable: bool = True, **config):
        gw = Gateway(config_from_dict({"replicas": ["http://127.0.0.1:1"], **config}), ByteTokenizer())
        if routable:
            for replica in gw.replicas.values():
                apply_health(replica, True, gw.config.health)
                apply_metrics(replica, "")

        async def handle(request: web.Request) -> web.Response:
            made = await read_inbound(request, gw, request.path, request.path != COMPLETIONS)
            return made if isinstance(made, web.Response) else web.json_response(described(made))

        app = web.Application(client_max_size=gw.config.limits.max_body_bytes)
        for path in (CHAT, COMPLETIONS, RESPONSES, MESSAGES):
            app.router.add_post(path, handle)
        client = await aiohttp_client(app)
        client.gw = gw
        return client

    return start


async def made_of(client, path: str = CHAT, **kw) -> dict:
    resp = await client.post(path, **kw)
    data = await resp.json()
    assert resp.status == 200, data
    data["payload"] = base64.b64decode(data["payload"])
    return data


async def error_of(client, status: int, path: str = CHAT, **kw) -> dict:
    resp = await client.post(path, **kw)
    data = await resp.json()
    assert resp.status == status, data
    assert set(data["error"]) == ERROR_FIELDS and data["error"]["code"] == status
    return data["error"]


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **extra}


async def test_a_body_without_changes_to_make_is_sent_byte_for_byte(inbound):
    client = await inbound()
    raw = b'{ "model" : "sim", "messages": [{"role": "user", "content": "caf\\u00e9"}], "max_tokens": 1.0 }'
    made = await made_of(client, data=raw, headers={"Content-Type": "application/json"})
    assert made["payload"] == raw and made["prompt"] == made["body"]


async def test_a_stream_gets_usage_reported_for_the_gateway_and_keeps_the_clients_other_options(inbound):
    client = await inbound()
    made = await made_of(client, json=chat(stream=True, stream_options={"continuous_usage_stats": False}))
    assert json.loads(made["payload"])["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert made["stream"] and not made["client_wants_usage"]


async def test_a_stream_whose_client_asked_for_usage_is_sent_as_it_came(inbound):
    client = await inbound()
    raw = json.dumps(chat(stream=True, stream_options={"include_usage": True})).encode()
    made = await made_of(client, data=raw)
    assert made["payload"] == raw and made["client_wants_usage"]


@pytest.mark.parametrize("path, raw, param", [
    (CHAT, b'{"model": "sim", "messages": [', "body"),  # not JSON
    (CHAT, b'["a list"]', "body"),  # JSON, not an object
    (CHAT, b'{"model": "sim", "messages": "hello"}', "messages"),  # a shape vLLM refuses
    (CHAT, b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (CHAT, b'{"model": "sim", "messages": [{"role": "user"}], "stream": "yes"}', "stream"),
    (COMPLETIONS, b'{"model": "sim", "prompt": [1, "two"]}', "prompt"),
    (RESPONSES, b'{"model": "sim", "input": 7}', "input"),
])
async def test_a_body_vllm_would_refuse_gets_an_openai_style_400_naming_the_field(inbound, path, raw, param):
    client = await inbound()
    error = await error_of(client, 400, path, data=raw)
    assert error["param"] == param and error["type"] == "BadRequestError"


async def test_a_body_over_the_limit_gets_413(inbound):
    client = await inbound(limits={"max_body_bytes": 1024})
    error = await error_of(client, 413, json=chat(padding="x" * 2048))
    assert "exceeds the limit of 1024" in error["message"]


async def test_with_no_routable_replica_the_request_gets_503(inbound):
    client = await inbound(routable=False)
    error = await error_of(client, 503, json=chat())
    assert error["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize("headers, extra, session, by_user", [
    ({"X-Session-ID": "s" * 300}, {"user": "alice"}, "s" * 256, False),  # the header first, cut to 256
    ({}, {"user": "alice"}, "user:alice", True),
    ({}, {"metadata": {"user_id": "claude-session"}}, "user:claude-session", False),  # Anthropic's: a session
    ({}, {}, None, False),
])
async def test_the_session_key_comes_from_the_header_else_the_user_field(inbound, headers, extra, session, by_user):
    client = await inbound()
    made = await made_of(client, json=chat(**extra), headers=headers)
    assert made["session"] == session and made["session_by_user"] is by_user


async def test_the_user_field_is_no_session_when_configured_off(inbound):
    client = await inbound(routing={"use_user_field": False})
    assert (await made_of(client, json=chat(user="alice")))["session"] is None


async def test_hop_by_hop_headers_stay_behind_and_the_others_go_on(inbound):
    client = await inbound()
    made = await made_of(client, json=chat(), headers={"Authorization": "Bearer client-key", "X-Trace": "t-1",
                                                        "Connection": "keep-alive", "TE": "trailers",
                                                        "Proxy-Authorization": "Basic x"})
    sent = {k.lower(): v for k, v in made["headers"].items()}
    assert sent["authorization"] == "Bearer client-key" and sent["x-trace"] == "t-1"  # an open gateway
    assert not {"connection", "te", "proxy-authorization", "host", "content-length"} & set(sent)
    assert sent["content-type"] == "application/json"


TENANTS = {"auth": {"tenants": [{"name": "acme", "keys": ["acme-key"]}, {"name": "other", "keys": ["other-key"]}]}}


async def test_under_tenants_a_request_gets_its_tenants_salt_and_session_scope_and_loses_the_key(inbound):
    client = await inbound(**TENANTS)
    made = await made_of(client, json=chat(cache_salt="mine", vllm_xargs={"kv_cache_report_mode": "full", "k": 1}),
                         headers={"Authorization": "Bearer acme-key", "X-Session-ID": "s1"})
    sent = json.loads(made["payload"])
    assert sent["cache_salt"] == "tenant:acme" == made["body"]["cache_salt"]  # what routing hashes too
    assert sent["vllm_xargs"] == {"k": 1}  # full reports would make KV events lie
    assert made["session"] == "acme:s1" and made["tenant"] == "acme"
    assert "authorization" not in {k.lower() for k in made["headers"]}


@pytest.mark.parametrize("params", [{"do_remote_decode": True}, {"remote_host": "10.0.0.9", "remote_block_ids": [[1]]},
                                    {}])
async def test_kv_transfer_params_from_a_client_are_refused_open_gateway_or_not(inbound, params):
    """They are the gateway's (``serve/disagg.py``): a client's would make a replica hold blocks
    for nobody, or pull blocks from a host the client names."""
    for config, headers in (({}, {}), (TENANTS, {"Authorization": "Bearer acme-key"})):
        client = await inbound(**config)
        error = await error_of(client, 400, json=chat(kv_transfer_params=params), headers=headers)
        assert error["param"] == "kv_transfer_params"
    acme = {"Authorization": "Bearer acme-key"}
    error = await error_of(client, 400, json=chat(ec_transfer_params=params), headers=acme)
    assert error["param"] == "ec_transfer_params"
    made = await made_of(client, json=chat(kv_transfer_params=None), headers=acme)
    assert made["body"]["messages"]  # a JSON null asks nothing of the engine


async def test_the_engines_own_keys_are_dropped_from_vllm_xargs(inbound):
    """vLLM copies ``vllm_xargs`` into the request's extra args, where its connectors read their
    transfer parameters and its KV events their report mode (``v1/request.py``)."""
    client = await inbound()
    xargs = {"kv_transfer_params": "x", "ec_transfer_params": 1, "kv_cache_report_mode": "full", "mine": [1, 2]}
    made = await made_of(client, json=chat(vllm_xargs=xargs))
    assert json.loads(made["payload"])["vllm_xargs"] == {"mine": [1, 2]} == made["body"]["vllm_xargs"]


async def test_under_tenants_a_request_without_a_tenants_key_gets_401(inbound):
    client = await inbound(**TENANTS)
    error = await error_of(client, 401, json=chat(), headers={"Authorization": "Bearer wrong"})
    assert error["type"] == "AuthenticationError"


async def test_a_response_another_tenant_created_is_not_found(inbound):
    client = await inbound(**TENANTS)
    client.gw.response_homes.remember("resp_1", "127.0.0.1:1", owner="other")
    body = {"model": MODEL, "input": "next", "previous_response_id": "resp_1"}
    error = await error_of(client, 404, RESPONSES, json=body, headers={"Authorization": "Bearer acme-key"})
    assert "resp_1" in error["message"] and error["param"] == "previous_response_id"


async def test_a_responses_request_is_routed_as_the_chat_vllm_renders_and_forwarded_as_it_came(inbound):
    client = await inbound()
    raw = json.dumps({"model": MODEL, "instructions": "be brief", "input": "hello"}).encode()
    made = await made_of(client, RESPONSES, data=raw)
    assert made["payload"] == raw
    assert [m["role"] for m in made["prompt"]["messages"]] == ["system", "user"]


async def test_a_responses_request_continuing_an_unknown_response_has_no_prompt_to_route_by(inbound):
    client = await inbound()
    made = await made_of(client, RESPONSES, json={"model": MODEL, "input": "next", "previous_response_id": "resp_x"})
    assert made["prompt"] is None  # passed through to the replica holding it


async def test_a_continued_responses_request_is_rendered_from_the_remembered_history(inbound):
    client = await inbound()
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    client.gw.response_homes.remember("resp_1", "127.0.0.1:1", history)
    made = await made_of(client, RESPONSES, json={"model": MODEL, "input": "next", "previous_response_id": "resp_1"})
    assert made["prompt"]["messages"] == [*history, {"role": "user", "content": "next"}]


@pytest.mark.parametrize("raw, extra", [
    (b'{"model": "sim"}', {"stream_options": {"include_usage": True}}),
    (b'  {"model": "sim"}', {"cache_salt": "s"}),
    (b"{}", {"cache_salt": "s"}),
    (b'{ }', {"cache_salt": "s"}),
])
def test_patched_splices_new_keys_in_front_of_the_clients_bytes(raw, extra):
    out = patched(raw, json.loads(raw), extra)
    assert json.loads(out) == {**json.loads(raw), **extra}
    if json.loads(raw):  # the client's bytes follow unchanged: no re-encoding of a long prompt
        assert out.endswith(raw.lstrip()[1:])


@pytest.mark.parametrize("raw, kept", [
    (b'{"cache_salt": "client", "prompt": "x"}', b'"prompt":"x"'),  # the key is there already: encoded again
    (b'{"cache_salt": "client", "temperature": NaN}', b"NaN"),  # as vLLM's parser reads it, not null
    (b'{"cache_salt": "client", "seed": 123456789012345678901234567890}',
     b"123456789012345678901234567890"),  # beyond 64 bits, exact, not a float
])
def test_patched_replaces_a_key_the_body_holds_and_keeps_what_orjson_would_change(raw, kept):
    out = patched(raw, json.loads(raw), {"cache_salt": "tenant"})
    assert json.loads(out)["cache_salt"] == "tenant" and out.count(b"cache_salt") == 1
    assert kept in out.replace(b": ", b":")


def test_patched_without_changes_is_the_clients_bytes():
    raw = b'{"model": "sim"}'
    assert patched(raw, {"model": "sim"}, {}) is raw
