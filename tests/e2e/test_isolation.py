"""Tenant isolation on every path a request can take, black box: fake replicas record what
reaches them (every path, every header, every byte), the gateway is configured as the README
shows, and tenant bolt tries to reach tenant acme's cache, Responses and keys.

Each vLLM 0.32 POST route, read from the installed vLLM, is walked in
tests/vllm_tier/test_endpoints_vllm.py; here the gateway's own table (``prefix_router.endpoints``) is.
"""

from __future__ import annotations

import itertools
import json

import pytest
from aiohttp import web
from yarl import URL

from prefix_router.app import create_app
from prefix_router.config import ConfigError, config_from_dict
from prefix_router.endpoints import GENERATES, ROUTED, SERVES, UNSALTABLE
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL

KEYS = {"acme": "sk-acme-0001", "bolt": "sk-bolt-0001"}
ADMIN = "sk-admin-0001"
UPSTREAM = "sk-vllm-internal"
FORGED = {"cache_salt": "tenant:acme", "vllm_xargs": {"kv_cache_report_mode": "full", "x": 1}}
_ids = itertools.count(1)


class RecordingReplica:
    """Answers every path as a vLLM would in shape, recording (method, path, headers, body);
    ``POST /v1/responses`` stores a Response that ``GET /v1/responses/{id}`` and ``/cancel`` find."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.stored: set[str] = set()
        self.app = web.Application(client_max_size=1 << 30)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        if path in ("/health", "/metrics"):
            return web.Response(text="")
        if path == "/kv_event_sources":  # the gateway's own probe: no events published
            return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        raw = await request.read()
        self.seen.append((request.method, path, dict(request.headers), raw))
        if len(path) > 1 and path.endswith("/"):  # as Starlette (vLLM's server) answers a trailing slash
            raise web.HTTPTemporaryRedirect(path.rstrip("/"))
        if path == "/v1/responses" and request.method == "POST":
            rid = f"resp_{next(_ids):032x}"
            self.stored.add(rid)
            return web.json_response({"id": rid, "object": "response", "status": "completed", "output": [],
                                      "usage": {"input_tokens": 10, "output_tokens": 1, "total_tokens": 11,
                                                "input_tokens_details": {"cached_tokens": 0}}})
        if path.startswith("/v1/responses/") and path != "/v1/responses/render":
            rid = path.split("/")[3]
            if rid not in self.stored:
                return web.json_response({"error": {"message": f"Response with id '{rid}' not found.", "code": 404}},
                                         status=404)
            return web.json_response({"id": rid, "object": "response", "status": "completed", "output": []})
        return web.json_response({"object": "ok", "choices": [{"index": 0, "text": "ok", "message":
                                  {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                                            "prompt_tokens_details": {"cached_tokens": 0}}})

    def sent_to(self, path: str) -> list[bytes]:
        return [raw for _, p, _, raw in self.seen if p == path]


def _key(tenant: str | None = None, key: str | None = None) -> dict[str, str]:
    key = key or (KEYS[tenant] if tenant else None)
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
async def gateway(aiohttp_server, aiohttp_client):
    async def start(tenants: bool = True, **auth):
        replica = RecordingReplica()
        server = await aiohttp_server(replica.app)
        section = {"admin_keys": [ADMIN], **auth}
        if tenants:
            section["tenants"] = [{"name": n, "keys": [k]} for n, k in KEYS.items()]
        data = {"replicas": [str(server.make_url("")).rstrip("/")], "auth": section,
                "health": {"interval_s": 0.2}, "scrape": {"interval_s": 0.2}}
        client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
        return replica, client

    return start


def _body_for(path: str) -> dict:
    """A body of the shape ``path`` takes in vLLM 0.32, carrying acme's salt and the report mode."""
    if path == "/v1/chat/completions/batch":
        return {"model": MODEL, "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                **FORGED}
    if path in ("/v1/completions", "/inference/v1/generate"):
        return {"model": MODEL, "prompt": "the same words", "max_tokens": 2, **FORGED}
    if path == "/v1/responses":
        return {"model": MODEL, "input": "the same words", **FORGED}
    return {"model": MODEL, "messages": [{"role": "user", "content": "the same words"}], "input": "the same words",
            "max_tokens": 2, **FORGED}


@pytest.mark.parametrize("path", sorted(GENERATES | set(ROUTED)))
async def test_a_tenants_generating_request_reaches_the_replica_with_its_own_salt_only(gateway, path):
    replica, client = await gateway()
    resp = await client.post(path, json=_body_for(path), headers=_key("bolt"))
    assert resp.status == 200, await resp.text()
    (raw,) = replica.sent_to(path)
    sent = json.loads(raw)
    assert sent["cache_salt"] == "tenant:bolt"
    assert b"tenant:acme" not in raw  # acme's salt is gone from the bytes, not only overridden
    assert "kv_cache_report_mode" not in sent.get("vllm_xargs", {}) and sent["vllm_xargs"] == {"x": 1}
    assert all(k.lower() != "authorization" or v == f"Bearer {UPSTREAM}" for k, v in replica.seen[-1][2].items())


async def test_a_salt_sent_as_null_or_twice_is_replaced_in_every_copy(gateway):
    replica, client = await gateway()
    for raw in (b'{"model":"m","cache_salt":null,"input":"x"}',
                b'{"model":"m","cache_salt":"tenant:acme","input":"x","cache_salt":"tenant:acme"}'):
        resp = await client.post("/invocations", data=raw, headers=_key("bolt"))
        assert resp.status == 200
        sent = replica.sent_to("/invocations")[-1]
        assert b"tenant:acme" not in sent and b"null" not in sent and json.loads(sent)["cache_salt"] == "tenant:bolt"


@pytest.mark.parametrize("path", sorted(UNSALTABLE) + ["/v1/a_later_vllms_endpoint", "/reset_prefix_cache"])
async def test_what_cannot_carry_a_tenants_salt_is_refused_to_tenants(gateway, path):
    replica, client = await gateway()
    resp = await client.post(path, json=_body_for(path), headers=_key("bolt"))
    assert resp.status == 403 and (await resp.json())["error"]["type"] == "PermissionDeniedError"
    assert replica.seen == []


async def test_an_operator_can_open_an_unknown_path_to_tenants_with_their_salt(gateway):
    replica, client = await gateway(tenant_paths=["/v1/a_later_vllms_endpoint"])
    resp = await client.post("/v1/a_later_vllms_endpoint", json=_body_for("x"), headers=_key("bolt"))
    assert resp.status == 200
    assert json.loads(replica.sent_to("/v1/a_later_vllms_endpoint")[0])["cache_salt"] == "tenant:bolt"


@pytest.mark.parametrize("path", sorted(SERVES))
async def test_endpoints_that_compute_no_cache_pass_as_they_came_with_a_tenants_key(gateway, path):
    replica, client = await gateway()
    assert (await client.post(path, json={"model": MODEL, "prompt": "x"})).status == 401
    resp = await client.post(path, json={"model": MODEL, "prompt": "x"}, headers=_key("bolt"))
    assert resp.status == 200
    assert json.loads(replica.sent_to(path)[0]) == {"model": MODEL, "prompt": "x"}


async def test_a_generating_body_that_is_not_a_json_object_is_refused_under_tenants(gateway):
    replica, client = await gateway()
    for raw in (b"[1, 2]", b"not json", b'{"model": "m", "temperature": NaN}'):
        resp = await client.post("/invocations", data=raw, headers=_key("bolt"))
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "body"
    assert replica.seen == []


async def test_a_response_created_by_one_tenant_is_not_found_by_another(gateway):
    replica, client = await gateway()
    created = await client.post("/v1/responses", json={"model": MODEL, "input": "secret plans"}, headers=_key("acme"))
    rid = (await created.json())["id"]
    chained = await client.post("/invocations", json={"model": MODEL, "input": "x"}, headers=_key("acme"))
    assert chained.status == 200
    seen = len(replica.seen)
    for method, path, body in (("GET", f"/v1/responses/{rid}", None), ("POST", f"/v1/responses/{rid}/cancel", None),
                               ("POST", "/v1/responses", {"model": MODEL, "input": "go on", "previous_response_id": rid})):
        resp = await client.request(method, path, json=body, headers=_key("bolt"))
        assert resp.status == 404, (method, path)
        assert (await resp.json())["error"]["message"] == f"Response with id '{rid}' not found."
        mine = await client.request(method, path, json=body, headers=_key("acme"))
        assert mine.status == 200, (method, path, await mine.text())
    assert [p for _, p, _, _ in replica.seen[seen:]] == [f"/v1/responses/{rid}", f"/v1/responses/{rid}/cancel",
                                                          "/v1/responses"]  # only acme's reached it
    unknown = await client.get("/v1/responses/resp_never_relayed_here", headers=_key("acme"))
    assert unknown.status == 404


def test_two_tenants_with_one_effective_salt_are_refused_in_one_line():
    tenants = [{"name": "acme", "keys": ["sk-aaaa-key"]}, {"name": "bolt", "keys": ["sk-bbbb-key"], "cache_salt": "tenant:acme"}]
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"auth": {"tenants": tenants}})
    assert "\n" not in str(caught.value) and "'bolt'" in str(caught.value) and "'acme'" in str(caught.value)
    same = [{"name": "a", "keys": ["sk-aaaa-key"], "cache_salt": "shared"},
            {"name": "b", "keys": ["sk-bbbb-key"], "cache_salt": "shared"}]
    with pytest.raises(ConfigError, match="share one KV cache"):
        config_from_dict({"auth": {"tenants": same}})
    for known in ("/v1/audio/transcriptions", "/v1/chat/completions", "/reset_prefix_cache"):
        with pytest.raises(ConfigError, match="tenant_paths.* knows"):  # opening it would do nothing
            config_from_dict({"auth": {"tenant_paths": [known]}})


async def test_an_admin_key_on_a_tenants_endpoint_is_told_it_acts_for_no_tenant(gateway):
    replica, client = await gateway()
    for path in ("/v1/chat/completions", "/invocations"):
        resp = await client.post(path, json=_body_for(path), headers=_key(key=ADMIN))
        assert resp.status == 401 and "admin key acts for no tenant" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/some_new_endpoint", json={}, headers=_key("bolt"))
    assert resp.status == 403 and "auth.tenant_paths" in (await resp.json())["error"]["message"]
    assert replica.seen == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations", "/tokenize", "/version"])
async def test_without_tenants_no_client_key_reaches_a_replica_where_the_gateway_has_its_own(gateway, path):
    replica, client = await gateway(tenants=False, upstream_api_key=UPSTREAM)
    method = "GET" if path == "/version" else "POST"
    for key in ("sk-some-client-key", ADMIN):
        resp = await client.request(method, path, json=None if method == "GET" else _body_for(path), headers=_key(key=key))
        assert resp.status == 200, await resp.text()
        assert replica.seen[-1][2].get("Authorization") == f"Bearer {UPSTREAM}"


async def test_an_admin_key_never_leaves_the_gateway(gateway):
    replica, client = await gateway(tenants=False)  # admin keys only, no upstream key
    for method, path in (("POST", "/reset_prefix_cache"), ("GET", "/version"), ("POST", "/tokenize")):
        resp = await client.request(method, path, json={"model": MODEL, "prompt": "x"}, headers=_key(key=ADMIN))
        assert resp.status == 200
        assert "Authorization" not in replica.seen[-1][2], (method, path)
    # an open gateway still passes a client's own key on (vLLM's --api-key behind it)
    await client.post("/tokenize", json={"prompt": "x"}, headers=_key(key="sk-clients-own"))
    assert replica.seen[-1][2]["Authorization"] == "Bearer sk-clients-own"


async def test_a_routed_path_written_with_an_encoded_slash_is_still_salted(gateway):
    """aiohttp matches routes on the path as sent (``%2F`` kept), vLLM's server on the decoded
    one: ``/v1/chat%2Fcompletions`` reaches the passthrough, and vLLM runs it as a chat."""
    replica, client = await gateway()
    for path in ("/v1/chat%2Fcompletions", "/v1%2Fcompletions", "/v1%2Fresponses"):
        resp = await client.post(path, json=_body_for(path.replace("%2F", "/")), headers=_key("bolt"))
        assert resp.status == 200, (path, await resp.text())
        sent = json.loads(replica.seen[-1][3])
        assert sent["cache_salt"] == "tenant:bolt" and "kv_cache_report_mode" not in sent["vllm_xargs"], path
    refused = await client.post("/v1%2Fresponses", data=b'{"model":"m","input":"x","previous_response_id":"r","x":NaN}',
                                headers=_key("bolt"))
    assert refused.status == 400  # vLLM would read NaN; the gateway cannot read the id to check its owner


async def test_a_trailing_slash_or_a_redirect_reaches_no_other_tenants_response(gateway):
    replica, client = await gateway()
    created = await client.post("/v1/responses", json={"model": MODEL, "input": "secret"}, headers=_key("acme"))
    rid = (await created.json())["id"]
    seen = len(replica.seen)
    resp = await client.get(f"/v1/responses/{rid}/", headers=_key("bolt"))
    assert resp.status == 404 and len(replica.seen) == seen
    # a replica's redirect goes back to the client, which asks the gateway again: never followed here
    resp = await client.get("/version/", headers=_key("bolt"), allow_redirects=False)
    assert resp.status == 307 and resp.headers["Location"] == "/version"
    assert [p for _, p, _, _ in replica.seen[seen:]] == ["/version/"]


async def test_a_tenant_cannot_name_the_stored_id_of_its_response(gateway):
    """vLLM stores a Response under the body's ``request_id``: one naming another tenant's id
    would overwrite that Response."""
    replica, client = await gateway()
    for path in ("/v1/responses", "/v1%2Fresponses"):
        resp = await client.post(path, json={"model": MODEL, "input": "x", "request_id": "resp_of_acme"},
                                 headers=_key("bolt"))
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "request_id", path
    assert replica.sent_to("/v1/responses") == []


async def test_a_second_authorization_header_or_an_anthropic_key_header_never_carries_a_key_out(gateway):
    replica, client = await gateway(tenants=False)  # an open gateway with admin keys
    from multidict import CIMultiDict

    two = CIMultiDict([("Authorization", "Bearer sk-client-own"), ("Authorization", f"Bearer {ADMIN}")])
    await client.post("/tokenize", json={"prompt": "x"}, headers=two)
    assert "Authorization" not in replica.seen[-1][2]
    await client.post("/tokenize", json={"prompt": "x"}, headers={"x-api-key": ADMIN})
    assert "X-Api-Key" not in replica.seen[-1][2] and "x-api-key" not in replica.seen[-1][2]
    replica, client = await gateway()
    await client.post("/tokenize", json={"prompt": "x"}, headers={**_key("bolt"), "x-api-key": KEYS["bolt"]})
    assert not {"authorization", "x-api-key"} & {k.lower() for k in replica.seen[-1][2]}


async def test_the_pickers_search_for_a_responses_home_carries_no_client_key(aiohttp_server, aiohttp_client):
    from prefix_router.app import GATEWAY
    from prefix_router.epp.picker import Exchange

    from ..epp.test_picker import _request_headers

    replica = RecordingReplica()
    server = await aiohttp_server(replica.app)
    data = {"replicas": [str(server.make_url("")).rstrip("/")], "auth": {"upstream_api_key": UPSTREAM,
                                                                          "admin_keys": [ADMIN]}}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    for key in ("sk-client-own", ADMIN):
        exchange = Exchange(client.server.app[GATEWAY])
        await exchange.on_request_headers(_request_headers(
            {":method": "GET", ":path": "/v1/responses/resp_unknown", "authorization": f"Bearer {key}"}, True))
        probe = replica.seen[-1]
        assert probe[1] == "/v1/responses/resp_unknown" and probe[2].get("Authorization") == f"Bearer {UPSTREAM}"


async def test_kv_transfer_params_from_a_client_never_reach_a_replica(gateway):
    """On every path that generates, routed or passed through, with tenants or without: they are
    the gateway's to set (``serve/disagg.py``)."""
    for tenants in (True, False):
        replica, client = await gateway(tenants=tenants)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate",
                     "/v1/chat%2Fcompletions"):
            before = len(replica.seen)
            body = {**_body_for(path.replace("%2F", "/")), "kv_transfer_params": {"remote_host": "10.0.0.9"}}
            resp = await client.post(path, json=body, headers=_key("acme" if tenants else None))
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["param"] == "kv_transfer_params", (tenants, path)
            assert len(replica.seen) == before, (tenants, path)


@pytest.mark.parametrize("path", ["/v1/./completions", "/v1/x/../completions", "/v1/%2E/completions",
                                  "/./v1/chat/completions", "/v1/responses/%2e%2e/responses"])
async def test_a_path_with_dot_segments_reaches_no_replica(gateway, path):
    """The client library forwarding a request resolves . and .. (RFC 3986): such a path would reach
    a routed endpoint past its checks (found by an attack on an open gateway)."""
    replica, client = await gateway(tenants=False)
    body = {**_body_for("/v1/completions"), "kv_transfer_params": {"do_remote_decode": True}}
    raw = URL(str(client.make_url("")).rstrip("/") + path, encoded=True)  # sent as written, not resolved
    resp = await client.session.post(raw, json=body)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "path"
    assert not replica.seen


async def test_the_engines_own_keys_do_not_ride_in_by_a_body_msgspec_cannot_read_or_in_extra_args(gateway):
    """An open gateway passes a body msgspec cannot read (NaN, a lone surrogate) on as it came,
    but not one that carries what isolation refuses; ``/inference/v1/generate`` hands
    ``sampling_params.extra_args`` to the engine as it came, so the engine's keys leave it."""
    replica, client = await gateway(tenants=False)
    before = len(replica.seen)
    for raw in (b'{"model":"m","prompt":"x","temperature":NaN,"kv_transfer_params":{"remote_host":"h"}}',
                b'{"model":"m","prompt":"\\ud800","vllm_xargs":{"kv_transfer_params":"x"}}'):
        resp = await client.post("/inference/v1/generate", data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400, raw
    assert len(replica.seen) == before
    resp = await client.post("/inference/v1/generate", data=b'{"model":"m","prompt":"x","temperature":NaN}',
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200 and replica.seen[-1][3] == b'{"model":"m","prompt":"x","temperature":NaN}'
    body = {"model": MODEL, "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 2, "extra_args": {"kv_transfer_params": {"remote_host": "h"},
                                                                "kv_cache_report_mode": "full", "mine": 1}}}
    resp = await client.post("/inference/v1/generate", json=body)
    assert resp.status == 200
    sent = json.loads(replica.seen[-1][3])
    assert sent["sampling_params"] == {"max_tokens": 2, "extra_args": {"mine": 1}}
