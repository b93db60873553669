"""The gateway routing by its replicas' KV events: simulated replicas publishing vLLM's wire
format over real ZMQ sockets, all in the test's event loop."""

from __future__ import annotations

import asyncio
import json
import random

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric, text

EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
          "replay_endpoint": "tcp://127.0.0.1:*"}


async def start_gateway(aiohttp_client, servers, tokenizer=None, request_log=None, **replica):
    data = {"replicas": [{"url": str(s.make_url("")).rstrip("/"), **replica} for s in servers],
            "health": {"interval_s": 0.2}, "scrape": {"interval_s": 0.1},
            "kv_events": {"parity_grace_s": 0.3}, "request_log": request_log}
    client = await aiohttp_client(create_app(config_from_dict(data), tokenizer or ByteTokenizer()))
    gw = client.server.app[GATEWAY]
    for _ in range(300):  # the streams start once each replica's models are known, and are
        if all(r.stream is not None and r.stream.fresh for r in gw.replicas.values()):  # fresh once subscribed
            break
        await asyncio.sleep(0.02)
    assert all(r.stream is not None and r.stream.fresh for r in gw.replicas.values()), gw.describe()
    return client, gw


async def chat(client, messages):
    resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8})
    data = await resp.json()
    assert resp.status == 200, data
    return resp.headers[REPLICA_HEADER], data["usage"]


async def conversations(client, rng, sessions=6, turns=5):
    for _ in range(sessions):
        messages = [{"role": "system", "content": text(rng, 60)}]
        for _turn in range(turns):
            messages.append({"role": "user", "content": text(rng, 50)})
            await chat(client, messages)
            messages.append({"role": "assistant", "content": text(rng, 20)})


async def test_with_events_the_predicted_cached_tokens_are_the_engines_even_under_eviction(fleet, aiohttp_client,
                                                                                          tmp_path):
    # 3 replicas of 60 blocks of 16 tokens: 6 sessions of 5 turns (up to ~45 blocks each) overflow
    # them, so blocks are evicted and the events must say which
    servers = await fleet(3, num_gpu_blocks=60, max_model_len=900, block_size=16, kv_events=EVENTS)
    log = tmp_path / "requests.jsonl"
    client, gw = await start_gateway(aiohttp_client, servers, request_log=str(log))
    await conversations(client, random.Random(7))
    await asyncio.sleep(0.5)  # the last parity checks' grace
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 30
    wrong = [(x["predicted_cached_tokens"], x["cached_tokens"]) for x in lines
             if x["predicted_cached_tokens"] != x["cached_tokens"]]
    assert not wrong, wrong
    removed = sum(len(r.stream.view._ghosts) for r in gw.replicas.values())
    assert removed > 0  # evictions happened, and the view followed them
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_kv_parity_total", result="mismatch") == 0
    assert metric(page, "prefix_router_kv_parity_total", result="match") == 30
    view = (await (await client.get("/replicas")).json())["replicas"]
    assert all(r["kv_events"]["routing_by_events"] and r["kv_events"]["gaps_lost"] == 0 for r in view)


class _ShiftedTokenizer(ByteTokenizer):
    """Another tokenizer than the engines': every token id one higher."""

    def encode(self, text, *, add_special_tokens=True):
        return [t + 1 for t in super().encode(text, add_special_tokens=add_special_tokens)]


async def test_a_gateway_with_another_tokenizer_than_the_engine_says_its_picture_is_wrong(fleet, aiohttp_client,
                                                                                          caplog):
    servers = await fleet(2, kv_events=EVENTS)
    client, gw = await start_gateway(aiohttp_client, servers, tokenizer=_ShiftedTokenizer())
    rng = random.Random(3)
    for _ in range(4):
        await chat(client, [{"role": "user", "content": text(rng, 40)}])
    await asyncio.sleep(0.6)
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_kv_parity_total", result="mismatch") == 4, gw.describe()["replicas"]
    assert metric(page, "prefix_router_kv_parity_total", result="match") == 0
    hints = {r.parity_hint for r in gw.replicas.values() if r.parity_mismatch}
    assert hints and all("first block differs" in h for h in hints)
    assert "picture of its cache is wrong" in caplog.text


async def test_a_gateway_with_another_block_size_than_the_engine_names_the_block_size(fleet, aiohttp_client):
    servers = await fleet(2, kv_events=EVENTS, block_size=16)
    client, gw = await start_gateway(aiohttp_client, servers, block_size=32)
    rng = random.Random(4)
    for _ in range(3):
        await chat(client, [{"role": "user", "content": text(rng, 60)}])
    await asyncio.sleep(0.6)
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_kv_parity_total", result="mismatch") == 3
    assert all("block size" in r.parity_hint for r in gw.replicas.values() if r.parity_mismatch)


async def test_replicas_without_events_are_routed_by_the_gateways_guess(fleet, aiohttp_client):
    servers = await fleet(2)  # no --kv-events-config: /kv_event_sources answers {}
    data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers], "scrape": {"interval_s": 0.1}}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    await asyncio.sleep(0.3)
    gw = client.server.app[GATEWAY]
    assert all(r.stream is None for r in gw.replicas.values())
    rng = random.Random(5)
    messages = [{"role": "user", "content": text(rng, 60)}]
    first, _ = await chat(client, messages)
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text(rng, 20)}]
    again, usage = await chat(client, messages)
    assert again == first and usage["prompt_tokens_details"]["cached_tokens"] > 0
    view = (await (await client.get("/replicas")).json())["replicas"]
    assert all(r["kv_events"] is None for r in view)


# A load bound loose enough that nothing spills: where a request spills depends on the in-flight
# counts at the instant it arrives, so on a loaded machine one run of one gateway differed from
# the next by 1-2 points (0.667-0.689; CI saw a 2.3-point gap once). Without spillover the gap
# is what the events are for: each instance's picture of every replica's cache. The holder's
# queue (routing.prefill_queue_weight) moves requests by the prefill queued at that instant too.
# bench/commands/instances.py measures the instances under the default bound, as medians of runs.
_NO_SPILL = {"load_factor": 4.0, "load_slack": 8, "holder_load_factor": 8.0, "holder_slack": 16,
             "prefill_queue_weight": 0.0}


async def _hit_rate(fleet, aiohttp_server, requests, instances: int, events: bool) -> float:
    from prefix_router.tools.replay.client import replay

    sims = await fleet(4, kv_events=EVENTS)
    urls = [str(s.make_url("")).rstrip("/") for s in sims]
    config = config_from_dict({"replicas": urls, "health": {"interval_s": 1}, "scrape": {"interval_s": 0.1},
                               "kv_events": {"enabled": events},
                               "routing": {**_NO_SPILL, "sole_router": instances == 1}})
    servers = [await aiohttp_server(create_app(config, ByteTokenizer())) for _ in range(instances)]
    for _ in range(300):
        if not events or all(r.stream is not None and r.stream.fresh
                             for s in servers for r in s.app[GATEWAY].replicas.values()):
            break
        await asyncio.sleep(0.02)
    # Another instance learns of a turn only from its replica's events, which reach it some
    # milliseconds after the engine publishes them: four gateways, four replicas and the client
    # share one event loop here. Think times are exponential (mean 3 s): divided by 50, one next
    # turn in seven came within 10 ms of the last answer, and the four fell 1.5 points behind
    # one in about one run of seven (0.679-0.694 against 0.695); divided by 20, 0.694-0.695 in
    # six runs beside a busy benchmark when written, but 0.675-0.695 on 2026-12-06 (the views'
    # intake costs more CPU a message since the fleet's map, issue 41: the other instances'
    # events come later on a shared loop), three runs of eight over a point behind; divided by
    # 10, as here, the next turns come twice as late after their answers.
    records = await replay(requests, [str(s.make_url("")) for s in servers], model=MODEL, time_scale=10,
                           session_header=None)
    assert all(r.error is None for r in records), next(r.error for r in records if r.error)
    spilled = [x for s in servers for x in s.app[GATEWAY].metrics.spillovers.collect()[0].samples
               if x.name.endswith("_total") and x.value]
    assert not spilled, spilled
    return sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)


async def test_four_gateways_following_the_events_reuse_within_a_point_of_one(fleet, aiohttp_server):
    """Without session ids, behind a round-robin client: each instance sees a quarter of every
    conversation, yet the events show each of them every replica's cache (issue 15)."""
    from prefix_router.tools.replay.generate import builtin_workload

    requests = builtin_workload("mixed", sessions=48, seed=11)
    one = await _hit_rate(fleet, aiohttp_server, requests, 1, events=True)
    four = await _hit_rate(fleet, aiohttp_server, requests, 4, events=True)
    four_guessing = await _hit_rate(fleet, aiohttp_server, requests, 4, events=False)
    print(f"token hit rate: one gateway {one:.3f}; four behind a round-robin client {four:.3f} with events, "
          f"{four_guessing:.3f} without")
    assert one > 0.5
    # Measured, with three busy loops beside the test: 0.697 against 0.695-0.697. Without events
    # the four guess, and how well varies from run to run: 1.3 to 13 points behind (0.685 on a
    # clean-clone CI run, 0.592-0.636 in three runs on a busy machine), never ahead.
    assert abs(one - four) <= 0.01, (one, four, four_guessing)
    assert four - four_guessing >= 0.005, (one, four, four_guessing)
