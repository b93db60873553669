"""Tenants: API keys, the cache salt the gateway sets for each tenant, and admin views.

The same isolation on the real vLLM engine: tests/vllm_tier/test_gateway_vllm.py.
"""

from __future__ import annotations

import json

import pytest

from prefix_router.app import create_app
from prefix_router.config import ConfigError, config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.fleet.tenants import MAX_SALT_CHARS, SALT_JOIN
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, text
from ..e2e.test_gateway_http import EchoReplica

KEYS = {"acme": "sk-acme-0001", "bolt": "sk-bolt-0001"}
ADMIN = "sk-admin-0001"
DOCUMENT = " ".join(f"clause {i} of a contract long enough to fill many blocks." for i in range(40))


def _auth(tenant: str | None = None, key: str | None = None) -> dict[str, str]:
    key = key or (KEYS[tenant] if tenant else None)
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
async def tenant_gateway(aiohttp_client):
    async def start(servers, **auth):
        data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers],
                "auth": {"tenants": [{"name": n, "keys": [k]} for n, k in KEYS.items()], "admin_keys": [ADMIN], **auth},
                "health": {"interval_s": 0.2}, "scrape": {"interval_s": 0.2}}
        return await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))

    return start


async def _ask(client, tenant: str | None, body: dict, key: str | None = None) -> tuple[int, dict, str | None]:
    resp = await client.post("/v1/chat/completions", json=body, headers=_auth(tenant, key))
    return resp.status, await resp.json(), resp.headers.get(REPLICA_HEADER)


def _body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 2, **extra,
            "messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "summarise"}]}


async def test_requests_without_a_tenants_key_get_401_and_reach_no_replica(aiohttp_server, tenant_gateway):
    echo = EchoReplica()
    client = await tenant_gateway([await aiohttp_server(echo.app)])
    for key in (None, "sk-unknown-01", ADMIN):
        status, body, _ = await _ask(client, None, _body(), key=key)
        assert status == 401 and body["error"]["type"] == "AuthenticationError", (key, body)
    resp = await client.post("/v1/chat/completions", data=b"x", headers={"Authorization": "Basic c2stYWNtZQ=="})
    assert resp.status == 401
    assert echo.requests == []
    assert (await client.get("/v1/models")).status == 401
    assert (await client.get("/v1/models", headers=_auth("acme"))).status == 200


async def test_the_replica_sees_the_tenants_salt_never_the_tenants_key(aiohttp_server, tenant_gateway):
    echo = EchoReplica()
    client = await tenant_gateway([await aiohttp_server(echo.app)], upstream_api_key="sk-vllm-internal")
    for tenant, extra in (("acme", {}), ("bolt", {"cache_salt": "tenant:acme"}), ("bolt", {"stream": True})):
        resp = await client.post("/v1/chat/completions", json=_body(**extra), headers=_auth(tenant))
        assert resp.status == 200
        await resp.read()
    salts = [json.loads(raw)["cache_salt"] for _, _, raw in echo.requests]
    assert salts == ["tenant:acme", "tenant:bolt", "tenant:bolt"]  # a forged salt is overridden
    for _, headers, raw in echo.requests:
        assert headers["Authorization"] == "Bearer sk-vllm-internal"
        assert not any(key.encode() in raw for key in KEYS.values())
    assert json.loads(echo.requests[2][2])["stream_options"] == {"include_usage": True}  # both edits applied


async def test_nested_salts_keep_a_clients_own_partition_inside_its_tenant(aiohttp_server, tenant_gateway):
    echo = EchoReplica()
    client = await tenant_gateway([await aiohttp_server(echo.app)], client_salt="nest")
    for tenant, extra in (("acme", {"cache_salt": "team-1"}), ("bolt", {"cache_salt": "tenant:acme"}), ("bolt", {})):
        assert (await _ask(client, tenant, _body(**extra)))[0] == 200
    assert [json.loads(raw)["cache_salt"] for _, _, raw in echo.requests] == \
        [f"tenant:acme{SALT_JOIN}team-1", f"tenant:bolt{SALT_JOIN}tenant:acme", "tenant:bolt"]
    # every salt sent is one vLLM 0.32 takes (validate_cache_salt: at most 128 characters, no
    # '@', '/', '\\' or NUL); a client salt that would break that rule is the gateway's 400
    for _, _, raw in echo.requests:
        salt = json.loads(raw)["cache_salt"]
        assert len(salt) <= MAX_SALT_CHARS and not set(salt) & set("@/\\\x00")
    sent = len(echo.requests)
    for bad in ("team/1", "x" * 200, "", 7):
        status, body, _ = await _ask(client, "acme", _body(cache_salt=bad))
        assert status == 400 and body["error"]["param"] == "cache_salt", (bad, body)
    assert len(echo.requests) == sent


async def test_tenants_reuse_their_own_prefixes_and_never_each_others(fleet, tenant_gateway):
    (sim,) = await fleet(1)  # one replica: any sharing would show
    client = await tenant_gateway([sim])
    cached = {}
    for turn, tenant in enumerate(("acme", "acme", "bolt", "bolt")):
        status, body, _ = await _ask(client, tenant, _body())
        assert status == 200
        cached[(tenant, turn)] = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached[("acme", 0)] == 0 and cached[("acme", 1)] > 0
    assert cached[("bolt", 2)] == 0, "tenant bolt hit tenant acme's blocks"
    assert cached[("bolt", 3)] == cached[("acme", 1)]
    # a client of bolt naming acme's salt still gets nothing of acme's
    status, body, _ = await _ask(client, "bolt", {**_body(), "cache_salt": "tenant:acme",
                                                 "messages": _body()["messages"][:1] + [{"role": "user", "content": "again"}]})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] <= cached[("bolt", 3)]


async def test_routing_keys_differ_per_tenant(fleet, tenant_gateway):
    client = await tenant_gateway(await fleet(4))
    import random

    rng = random.Random(2)
    pairs = []
    for _ in range(12):
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text(rng, 30)}]}
        pairs.append(((await _ask(client, "acme", body))[2], (await _ask(client, "bolt", body))[2]))
    # the same prompt from two tenants is keyed apart (equal for all 12 by chance: 4^-12)
    assert any(a != b for a, b in pairs)


async def test_admin_views_need_an_admin_key_once_keys_are_configured(fleet, tenant_gateway, aiohttp_client):
    client = await tenant_gateway(await fleet(1))
    for view in ("/replicas", "/debug/changes"):
        assert (await client.get(view)).status == 401
        resp = await client.get(view, headers=_auth("acme"))
        assert resp.status == 403 and (await resp.json())["error"]["type"] == "PermissionDeniedError"
        assert (await client.get(view, headers=_auth(key=ADMIN))).status == 200
    assert (await client.get("/health")).status == 200 and (await client.get("/ready")).status == 200
    # admin keys alone (no tenants) protect the views and leave generation open
    sims = await fleet(1)
    config = config_from_dict({"replicas": [str(sims[0].make_url("")).rstrip("/")], "auth": {"admin_keys": [ADMIN]}})
    open_client = await aiohttp_client(create_app(config, ByteTokenizer()))
    assert (await open_client.get("/replicas")).status == 401
    assert (await open_client.get("/debug/changes")).status == 401
    assert (await _ask(open_client, None, _body()))[0] == 200


def test_keys_can_come_from_the_environment_and_bad_key_sets_are_refused(monkeypatch):
    monkeypatch.setenv("ACME_KEY", "sk-from-the-env")
    config = config_from_dict({"auth": {"tenants": [{"name": "acme", "keys": ["env:ACME_KEY"]}]}})
    assert config.auth.tenants[0].keys == ("sk-from-the-env",)
    bad = [
        ({"tenants": [{"name": "a", "keys": ["env:NOT_SET_ANYWHERE"]}]}, "NOT_SET_ANYWHERE"),
        ({"tenants": [{"name": "a", "keys": ["short"]}]}, "at least 8"),
        ({"tenants": [{"name": "a", "keys": []}]}, "at least one key"),
        ({"tenants": [{"name": "a", "keys": ["sk-same-key"]}, {"name": "b", "keys": ["sk-same-key"]}]}, "also one of"),
        ({"tenants": [{"name": "a", "keys": ["sk-aaaa-key"]}, {"name": "a", "keys": ["sk-bbbb-key"]}]}, "twice"),
        ({"tenants": [{"name": "a", "keys": ["sk-aaaa-key"]}], "admin_keys": ["sk-aaaa-key"]}, "admin"),
        ({"client_salt": "merge"}, "client_salt"),
        ({"tenants": [{"name": "a/b", "keys": ["sk-aaaa-key"]}]}, "name"),  # would collide with a nested salt
        ({"tenants": [{"name": "a:b", "keys": ["sk-aaaa-key"]}]}, "name"),  # would collide with a session scope
        ({"tenants": [{"name": "a", "keys": ["sk-aaaa-key"], "cache_salt": "x/y"}]}, "cache_salt"),
    ]
    for auth, message in bad:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"auth": auth})


def test_a_refused_key_is_not_echoed_in_the_error(monkeypatch):
    monkeypatch.setenv("SHORT_KEY", "sk-7chr")
    for key in ("sk-7chr", "env:SHORT_KEY", " sk-spaced-key "):
        with pytest.raises(ConfigError, match="at least 8") as caught:
            config_from_dict({"auth": {"tenants": [{"name": "a", "keys": [key]}]}})
        assert "sk-" not in str(caught.value)
