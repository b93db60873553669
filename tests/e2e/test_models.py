"""Several models and LoRA adapters behind one gateway: each request goes only to replicas whose
``/v1/models`` lists its model, ``/v1/models`` is the union, and a model none serves gets the
gateway's own 404 (prefix_router/gateway.py: ``serving``, ``refresh_models``; prefix_router/serve/proxy.py).

Two simulated replicas serve a model each; adapters loaded at run time are a small aiohttp
replica whose model list changes. The real engine with a real adapter:
tests/vllm_tier/test_apis_and_adapters_vllm.py.
"""

from __future__ import annotations

import random

from aiohttp import web

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.serve.passthrough import REPLICAS_HEADER
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import metric, text


async def _gateway(aiohttp_client, servers, **sections):
    data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers], "health": {"interval_s": 0.2},
            "scrape": {"interval_s": 0.2}, **sections}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    return client, client.server.app[GATEWAY]


def _chat(model: str, rng: random.Random) -> dict:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": text(rng, 200)}]}


async def test_two_models_each_go_only_to_their_replicas(fleet, aiohttp_client):
    servers = [*await fleet(1, model="model-a"), *await fleet(1, model="model-b")]
    client, gw = await _gateway(aiohttp_client, servers)
    name_a, name_b = gw.replicas
    rng = random.Random(0)
    for i in range(12):
        model = ("model-a", "model-b")[i % 2]
        resp = await client.post("/v1/chat/completions", json=_chat(model, rng))
        assert resp.status == 200, await resp.text()
        assert resp.headers[REPLICA_HEADER] == (name_a if model == "model-a" else name_b)
    models = await client.get("/v1/models")
    assert sorted(m["id"] for m in (await models.json())["data"]) == ["model-a", "model-b"]
    assert models.headers[REPLICAS_HEADER] == f"{name_a}=200,{name_b}=200"


async def test_a_model_no_replica_serves_gets_the_gateways_404_and_one_whose_replica_is_down_a_503(
        fleet, aiohttp_client):
    servers = [*await fleet(1, model="model-a"), *await fleet(1, model="model-b")]
    client, gw = await _gateway(aiohttp_client, servers)
    rng = random.Random(1)
    resp = await client.post("/v1/chat/completions", json=_chat("model-c", rng))
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert error["param"] == "model" and "model-c" in error["message"]
    gw.replicas[list(gw.replicas)[1]].healthy = False
    resp = await client.post("/v1/completions", json={"model": "model-b", "prompt": "hi", "max_tokens": 1})
    assert resp.status == 503 and "model-b" in (await resp.json())["error"]["message"]
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_requests_total") == 0  # neither reached a replica


MODELS = web.AppKey("models", list)


def adapter_replica() -> web.Application:
    """A replica whose ``/v1/models`` lists ``app[MODELS]`` (a LoRA adapter appears there once
    loaded) and that answers any chat."""
    app = web.Application()
    app[MODELS] = ["base"]

    async def ok(_):
        return web.Response(text="")

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in app[MODELS]]})

    async def chat(request):
        body = await request.json()
        return web.json_response({"id": "c", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}})

    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_an_adapter_loaded_on_one_replica_is_found_at_once_and_routed_there(aiohttp_server, aiohttp_client):
    apps = [adapter_replica(), adapter_replica()]
    servers = [await aiohttp_server(app) for app in apps]
    client, gw = await _gateway(aiohttp_client, servers, scrape={"interval_s": 3600.0})  # no scrape will see it
    apps[1][MODELS].append("my-adapter")  # /v1/load_lora_adapter on the second replica
    rng = random.Random(2)
    for _ in range(4):
        resp = await client.post("/v1/chat/completions", json=_chat("my-adapter", rng))
        assert resp.status == 200
        assert resp.headers[REPLICA_HEADER] == list(gw.replicas)[1]
    apps[1][MODELS].remove("my-adapter")  # unloaded: found gone at the next look (a scrape)
    await gw.refresh_models(min_interval_s=0)
    assert all("my-adapter" not in r.models for r in gw.replicas.values())
    resp = await client.post("/v1/chat/completions", json=_chat("my-adapter", rng))
    assert resp.status == 404
