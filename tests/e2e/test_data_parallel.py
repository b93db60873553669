"""Data-parallel ranks as routing targets, black box: the gateway in front of vLLM servers of 4
ranks each (``replicas[].data_parallel_size``). The servers are fakes that answer as vLLM 0.32 does
for a data-parallel deployment, read from its source: a request's ``X-data-parallel-rank`` picks the
engine (``entrypoints/generate/base/serving.py``; out of range: a 400), each engine labels its
metric series ``engine="N"``, and ``GET /kv_event_sources`` lists each rank's publisher with its
ports offset by the rank (``distributed/kv_events.py``). Then the same against simulated servers of 4
engines each (``--data-parallel-size``), each engine publishing its own KV events."""

from __future__ import annotations

import asyncio
import collections
import json
import random

from aiohttp import web

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import DP_RANK_HEADER, REPLICA_HEADER
from prefix_router.fleet.kv_follower import event_endpoints
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric
from .test_kv_events_gateway import EVENTS, conversations, start_gateway

RANKS = 4


class DataParallelServer:
    """One vLLM server of ``RANKS`` engines; records the rank each generation was sent to."""

    def __init__(self, waiting: dict[int, int] | None = None) -> None:
        self.ranks: list[str | None] = []
        self.waiting = waiting or {}
        self.app = web.Application()
        self.app.router.add_get("/health", self.plain)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/kv_event_sources", self.sources)
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def plain(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = []
        for r in range(RANKS):
            labels = f'engine="{r}",model_name="{MODEL}"'
            lines += [f"vllm:num_requests_waiting{{{labels}}} {self.waiting.get(r, 0)}",
                      f"vllm:num_requests_running{{{labels}}} 0", f"vllm:prefix_cache_queries_total{{{labels}}} 0"]
        return web.Response(text="\n".join(lines) + "\n")

    async def sources(self, request: web.Request) -> web.Response:
        return web.json_response({str(r): {"enable_kv_cache_events": True, "publisher": "zmq",
                                           "endpoint": f"tcp://*:{5557 + r}", "replay_endpoint": f"tcp://*:{5600 + r}"}
                                  for r in range(RANKS)})

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        rank = request.headers.get(DP_RANK_HEADER)
        self.ranks.append(rank)
        if rank is not None and not 0 <= int(rank) < RANKS:
            return web.json_response({"error": {"message": f"data_parallel_rank {rank} is out of range [0, {RANKS}).",
                                                "code": 400}}, status=400)
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}})


async def start(aiohttp_server, aiohttp_client, servers: list[DataParallelServer]):
    urls = [str((await aiohttp_server(s.app)).make_url("")).rstrip("/") for s in servers]
    config = config_from_dict({"replicas": [{"url": u, "data_parallel_size": RANKS} for u in urls],
                               "health": {"interval_s": 60.0}, "scrape": {"interval_s": 60.0},
                               "kv_events": {"enabled": False}})
    return await aiohttp_client(create_app(config, ByteTokenizer())), urls


async def test_every_rank_gets_traffic_with_its_header_and_a_conversation_keeps_to_one_rank(aiohttp_server,
                                                                                             aiohttp_client):
    servers = [DataParallelServer(), DataParallelServer()]
    client, urls = await start(aiohttp_server, aiohttp_client, servers)
    gw = client.server.app[GATEWAY]
    assert len(gw.replicas) == 2 * RANKS and all(r.routable for r in gw.replicas.values())
    homes = collections.defaultdict(set)
    for turn in range(3):
        for session in range(24):
            messages = [{"role": "user", "content": f"conversation {session} " + "words " * 20}]
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}] * turn
            resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages},
                                     headers={"X-Session-ID": f"s{session}", DP_RANK_HEADER: "7"})  # the client's: ignored
            assert resp.status == 200
            homes[session].add(resp.headers[REPLICA_HEADER])
    assert all(len(home) == 1 for home in homes.values())  # each conversation on one rank of one server
    for server in servers:
        assert set(server.ranks) == {str(r) for r in range(RANKS)}  # every rank, and only in range
    assert {name.rsplit("@", 1)[1] for home in homes.values() for name in home} == {str(r) for r in range(RANKS)}


async def test_each_rank_reads_its_own_engines_load_and_kv_event_publisher(aiohttp_server, aiohttp_client):
    client, (url,) = await start(aiohttp_server, aiohttp_client, [DataParallelServer(waiting={2: 9})])
    gw = client.server.app[GATEWAY]
    host = url.split("//")[1]
    assert [gw.replicas[f"{host}@{r}"].waiting for r in range(RANKS)] == [0, 0, 9, 0]
    endpoints = [await event_endpoints(gw, gw.replicas[f"{host}@{r}"]) for r in range(RANKS)]
    hostname = host.split(":")[0]
    assert endpoints == [(f"tcp://{hostname}:{5557 + r}", f"tcp://{hostname}:{5600 + r}") for r in range(RANKS)]


async def test_each_ranks_events_predict_its_engines_cache_exactly(fleet, aiohttp_client, tmp_path):
    # 2 servers of 4 engines of 60 blocks: 8 sessions of 5 turns overflow some, so each rank's
    # view must follow its own engine's evictions, from its own publisher
    servers = await fleet(2, num_gpu_blocks=60, max_model_len=900, block_size=16, kv_events=EVENTS,
                          data_parallel_size=RANKS)
    log = tmp_path / "requests.jsonl"
    client, gw = await start_gateway(aiohttp_client, servers, request_log=str(log), data_parallel_size=RANKS)
    assert len(gw.replicas) == 2 * RANKS
    assert len({r.stream.endpoint for r in gw.replicas.values()}) == 2 * RANKS  # a publisher each
    await conversations(client, random.Random(11), sessions=8)
    await asyncio.sleep(0.5)  # the last parity checks' grace
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    wrong = [(x["replica"], x["predicted_cached_tokens"], x["cached_tokens"]) for x in lines
             if x["predicted_cached_tokens"] != x["cached_tokens"]]
    assert len(lines) == 40 and not wrong, wrong
    assert len({x["replica"] for x in lines}) > RANKS  # ranks of both servers served
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_kv_parity_total", result="mismatch") == 0


async def test_ranks_the_server_does_not_run_stay_off_the_ring(fleet, aiohttp_client):
    (server,) = await fleet(1, data_parallel_size=2)
    url = str(server.make_url("")).rstrip("/")
    config = config_from_dict({"replicas": [{"url": url, "data_parallel_size": RANKS}],
                               "kv_events": {"enabled": False}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    gw = client.server.app[GATEWAY]
    host = url.split("//")[1]
    assert [gw.replicas[f"{host}@{r}"].routable for r in range(RANKS)] == [True, True, False, False]
    shown = {r["name"]: r for r in (await (await client.get("/replicas")).json())["replicas"]}
    assert 'engine="2"' in shown[f"{host}@2"]["last_failure"]  # the operator sees why
    for i in range(12):
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": f"question {i}"}]}, headers={"X-Session-ID": f"s{i}"})
        assert resp.status == 200  # never sent to a rank vLLM would refuse


async def test_a_clients_rank_header_never_reaches_a_server_the_gateway_does_not_split(aiohttp_server, aiohttp_client):
    server = DataParallelServer()
    url = str((await aiohttp_server(server.app)).make_url("")).rstrip("/")
    config = config_from_dict({"replicas": [url], "kv_events": {"enabled": False}})  # vLLM balances its ranks
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    for header in (DP_RANK_HEADER, DP_RANK_HEADER.lower(), "X-DATA-PARALLEL-RANK"):
        resp = await client.post("/v1/chat/completions", headers={header: "3"},
                                 json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status == 200
    assert server.ranks == [None, None, None]
