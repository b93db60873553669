"""Every endpoint beyond chat and completions (prefix_router/serve/passthrough.py): to one replica, to every
replica for an operator's, and stored Responses to the replica that holds them.

The replicas here are small aiohttp apps that answer a few of vLLM's endpoints the way vLLM 0.32
does (status codes, a Responses stream's first event), so that a test can make one fail; the
real-engine tier (tests/vllm_tier/test_passthrough_vllm.py) checks the same against vLLM itself.
"""

from __future__ import annotations

import itertools
import json

from aiohttp import web

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.serve.passthrough import REPLICAS_HEADER
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric

_ids = itertools.count()
HITS = web.AppKey("hits", list)  # (method, path, body) of each request but the gateway's probes
STORE = web.AppKey("store", set)  # the response ids this replica holds


def replica_app(name: str, *, fail: set[str] = frozenset(), models: tuple[str, ...] = (MODEL,)) -> web.Application:
    """A replica answering vLLM's health, metrics, models, /version, /tokenize, /v1/embeddings,
    /reset_prefix_cache and stored Responses; ``fail``: paths it answers 500."""
    app = web.Application()
    app[HITS] = []
    app[STORE] = set()

    @web.middleware
    async def record(request, handler):
        if request.path not in ("/health", "/metrics", "/v1/models", "/kv_event_sources"):  # the gateway's probes
            app[HITS].append((request.method, request.path, await request.read()))
            if request.path in fail:
                return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        return await handler(request)

    app.middlewares.append(record)

    async def ok(_):
        return web.Response(text="")

    async def models_(_):
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

    async def version(_):
        return web.json_response({"version": name})

    async def tokenize(request):
        body = await request.json()
        return web.json_response({"tokens": list(body["prompt"].encode()), "count": len(body["prompt"])})

    async def responses(request):
        body = await request.json()
        previous = body.get("previous_response_id")
        if previous is not None and previous not in app[STORE]:
            return web.json_response({"error": {"message": f"Response with id '{previous}' not found.",
                                                "type": "invalid_request_error", "code": 404}}, status=404)
        rid = f"resp_{name}_{next(_ids)}"
        app[STORE].add(rid)
        obj = {"id": rid, "object": "response", "status": "completed", "output": []}
        if not body.get("stream"):
            return web.json_response(obj)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in ({"type": "response.created", "sequence_number": 0, "response": {**obj, "status": "in_progress"}},
                      {"type": "response.completed", "sequence_number": 1, "response": obj}):
            await resp.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        await resp.write_eof()
        return resp

    async def stored(request):
        rid = request.match_info["rid"]
        if rid not in app[STORE]:
            return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
        return web.json_response({"id": rid, "object": "response", "status": "completed"})

    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_get("/v1/models", models_)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/embeddings", ok)
    app.router.add_post("/reset_prefix_cache", ok)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{rid}", stored)
    app.router.add_post("/v1/responses/{rid}/cancel", stored)
    return app


async def start(aiohttp_server, aiohttp_client, apps, **sections):
    """The replicas' servers and a gateway in front of them, every replica routable."""
    servers = [await aiohttp_server(app) for app in apps]
    data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers], "health": {"interval_s": 0.2},
            "scrape": {"interval_s": 0.2}, **sections}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    gw = client.server.app[GATEWAY]
    assert all(r.routable for r in gw.replicas.values()), gw.describe()
    return servers, client, gw


async def test_a_get_the_gateway_has_no_handler_for_reaches_one_replica_and_names_it(aiohttp_server, aiohttp_client):
    apps = [replica_app("a"), replica_app("b")]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    resp = await client.get("/version")
    assert resp.status == 200
    answered = "ab".index((await resp.json())["version"])
    assert resp.headers[REPLICA_HEADER] == list(gw.replicas)[answered]
    assert [len(app[HITS]) for app in apps] == [int(i == answered) for i in range(2)]
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_requests_total", replica=resp.headers[REPLICA_HEADER], route="passthrough",
                  code="200") == 1


async def test_an_inference_post_that_fails_on_one_replica_is_answered_by_another(aiohttp_server, aiohttp_client):
    apps = [replica_app("a", fail={"/v1/embeddings"}), replica_app("b", fail={"/v1/embeddings"}),
            replica_app("c")]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps, upstream={"max_retries": 2})
    gw.replicas[list(gw.replicas)[2]].others = 5  # the busiest, so tried last
    resp = await client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert resp.status == 200
    assert resp.headers[REPLICA_HEADER] == gw.replicas[list(gw.replicas)[2]].name
    # the two that failed are blamed, since another served the request
    assert [r.breaker.failures for r in gw.replicas.values()] == [1, 1, 0]


async def test_a_post_every_replica_fails_gets_the_last_replicas_answer_and_blames_none(aiohttp_server, aiohttp_client):
    apps = [replica_app("a", fail={"/tokenize"}), replica_app("b", fail={"/tokenize"})]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    resp = await client.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
    assert resp.status == 500 and (await resp.json())["error"]["message"] == "boom"
    assert all(r.breaker.failures == 0 for r in gw.replicas.values())


async def test_the_body_model_picks_a_replica_that_serves_it(aiohttp_server, aiohttp_client):
    apps = [replica_app("a", models=(MODEL,)), replica_app("b", models=(MODEL, "adapter-x"))]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    for _ in range(4):
        resp = await client.post("/tokenize", json={"model": "adapter-x", "prompt": "hello"})
        assert resp.status == 200 and (await resp.json())["count"] == 5
    assert len(apps[0][HITS]) == 0 and len(apps[1][HITS]) == 4


async def test_an_operator_post_goes_to_every_replica_with_their_statuses(aiohttp_server, aiohttp_client):
    apps = [replica_app("a"), replica_app("b")]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    resp = await client.post("/reset_prefix_cache")
    assert resp.status == 200
    assert [hit[1] for app in apps for hit in app[HITS]] == ["/reset_prefix_cache"] * 2
    assert resp.headers[REPLICAS_HEADER] == ",".join(f"{n}=200" for n in gw.replicas)


async def test_replicas_that_answer_an_operator_post_differently_give_a_502_naming_each(aiohttp_server,
                                                                                       aiohttp_client):
    apps = [replica_app("a"), replica_app("b", fail={"/reset_prefix_cache"})]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    resp = await client.post("/reset_prefix_cache")
    assert resp.status == 502
    body = await resp.json()
    assert [r["status"] for r in body["replicas"]] == [200, 500]
    assert "differently" in body["error"]["message"]


async def test_operator_posts_and_unknown_posts_need_an_admin_key_once_keys_exist(aiohttp_server, aiohttp_client):
    apps = [replica_app("a")]
    auth = {"tenants": [{"name": "t", "keys": ["tenant-key"]}], "admin_keys": ["admin-key"]}
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps, auth=auth)
    assert (await client.post("/reset_prefix_cache")).status == 401
    assert (await client.post("/reset_prefix_cache", headers={"Authorization": "Bearer tenant-key"})).status == 403
    assert (await client.post("/v1/some_new_endpoint", headers={"Authorization": "Bearer tenant-key"})).status == 403
    assert apps[0][HITS] == []
    assert (await client.post("/reset_prefix_cache", headers={"Authorization": "Bearer admin-key"})).status == 200
    # inference endpoints take a tenant's key, and only a known one
    assert (await client.post("/tokenize", json={"model": MODEL, "prompt": "x"})).status == 401
    resp = await client.post("/tokenize", json={"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer tenant-key"})
    assert resp.status == 200
    sent = apps[0][HITS][-1]
    assert sent[1] == "/tokenize"


async def test_a_stored_response_is_read_chained_and_cancelled_on_the_replica_that_made_it(aiohttp_server,
                                                                                           aiohttp_client):
    apps = [replica_app("a"), replica_app("b"), replica_app("c")]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    for stream in (False, True):
        resp = await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": stream})
        assert resp.status == 200
        home = resp.headers[REPLICA_HEADER]
        data = await resp.read()
        rid = (json.loads(data)["id"] if not stream else
               json.loads(data.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"])
        for _ in range(3):  # whatever the load, each goes where the response is
            chained = await client.post("/v1/responses", json={"model": MODEL, "input": "more",
                                                               "previous_response_id": rid})
            assert chained.status == 200 and chained.headers[REPLICA_HEADER] == home
            rid = (await chained.json())["id"]
        got = await client.get(f"/v1/responses/{rid}")
        assert got.status == 200 and got.headers[REPLICA_HEADER] == home
        cancelled = await client.post(f"/v1/responses/{rid}/cancel")
        assert cancelled.status == 200 and cancelled.headers[REPLICA_HEADER] == home


async def test_a_response_id_the_gateway_never_saw_is_found_on_the_replica_holding_it(aiohttp_server, aiohttp_client):
    apps = [replica_app("a"), replica_app("b")]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    apps[1][STORE].add("resp_made_elsewhere")  # another gateway instance relayed it, say
    got = await client.get("/v1/responses/resp_made_elsewhere")
    assert got.status == 200 and got.headers[REPLICA_HEADER] == list(gw.replicas)[1]
    chained = await client.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                       "previous_response_id": "resp_made_elsewhere"})
    assert chained.status == 200 and chained.headers[REPLICA_HEADER] == list(gw.replicas)[1]
    missing = await client.get("/v1/responses/resp_nowhere")
    assert missing.status == 404  # the replica's own answer


async def test_an_unknown_path_gets_the_replicas_own_404(aiohttp_server, aiohttp_client):
    apps = [replica_app("a")]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    resp = await client.get("/v1/nothing_here")
    assert resp.status == 404 and resp.headers[REPLICA_HEADER] == list(gw.replicas)[0]


async def test_a_response_id_with_url_characters_stays_one_path_segment(aiohttp_server, aiohttp_client):
    apps = [replica_app("a")]
    servers, client, gw = await start(aiohttp_server, aiohttp_client, apps)
    resp = await client.get("/v1/responses/resp%3Fx%3D1")  # "resp?x=1", decoded by the gateway's router
    assert resp.status == 404
    assert all(hit[1] == "/v1/responses/resp?x=1" for hit in apps[0][HITS]), apps[0][HITS]
