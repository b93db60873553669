"""The gateway in front of several simulated replicas, all in one event loop.

The gateway is given the same built-in byte tokenizer as the replicas, so its token blocks are
the engines' and the replicas' ``cached_tokens`` can be compared with its predictions.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
from collections import Counter

import pytest

from prefix_router.app import GATEWAY, create_app
from prefix_router.gateway import replica_name
from prefix_router.config import config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric, text



@pytest.fixture
async def gateway(aiohttp_client):
    async def start(servers, **routing):
        data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers],
                "routing": routing, "health": {"interval_s": 0.2, "unhealthy_after": 1},
                "scrape": {"interval_s": 0.2}}
        return await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))

    return start


async def chat(client, messages, headers=None, **extra):
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    resp = await client.post("/v1/chat/completions", json=body, headers=headers or {})
    data = await resp.json()
    assert resp.status == 200, data
    return resp.headers[REPLICA_HEADER], data["usage"]


async def test_a_multi_turn_session_stays_on_one_replica_and_hits_its_history(fleet, gateway):
    client = await gateway(await fleet(4))
    rng = random.Random(1)
    for _ in range(5):
        messages = [{"role": "system", "content": text(rng, 50)}]
        replicas, cached = set(), []
        for _turn in range(4):
            messages.append({"role": "user", "content": text(rng, 40)})
            replica, usage = await chat(client, messages)
            replicas.add(replica)
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            messages.append({"role": "assistant", "content": text(rng, 30)})
        assert len(replicas) == 1
        assert all(c > 0 for c in cached[1:])


SESSIONS, FOLLOW_UPS = 2000, 200


async def test_sessions_sharing_one_long_system_prompt_spread_over_all_replicas(fleet, gateway):
    servers = await fleet(4)
    client = await gateway(servers)
    rng = random.Random(2)
    system = {"role": "system", "content": text(rng, 800)}
    first_turn = Counter()
    second_hits = []
    sessions = []
    for s in range(SESSIONS):
        messages = [system, {"role": "user", "content": f"session {s}: " + text(rng, 20)}]
        replica, _ = await chat(client, messages)
        first_turn[replica] += 1
        sessions.append((messages, replica))
    for messages, replica in sessions[:FOLLOW_UPS]:
        follow = messages + [{"role": "assistant", "content": text(rng, 10)}, {"role": "user", "content": text(rng, 10)}]
        again, usage = await chat(client, follow)
        second_hits.append((again == replica, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
    fair = SESSIONS / 4
    print(f"\n{SESSIONS} sessions: busiest replica {max(first_turn.values()) / fair:.2f}x fair share; "
          f"{sum(same for same, _, _ in second_hits)}/{FOLLOW_UPS} follow-ups on their replica")
    assert len(first_turn) == 4
    assert max(first_turn.values()) < 1.3 * fair, first_turn
    # Later turns go back to their history: the hit covers more than the shared system prompt.
    sticky = sum(1 for same, _, _ in second_hits if same)
    assert sticky >= 0.95 * FOLLOW_UPS
    system_tokens = len(ByteTokenizer().encode(system["content"]))
    assert sum(1 for _, cached, _ in second_hits if cached > system_tokens) >= 0.95 * FOLLOW_UPS


async def test_salted_tenants_never_share_a_prefix(fleet, gateway):
    client = await gateway(await fleet(2))
    messages = [{"role": "system", "content": text(random.Random(3), 300)}, {"role": "user", "content": "hello"}]
    _, first = await chat(client, messages, cache_salt="tenant-a")
    _, same = await chat(client, messages, cache_salt="tenant-a")
    _, other = await chat(client, messages, cache_salt="tenant-b")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert same["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_timestamp_in_the_system_prompt_is_counted_as_changed_at_message_zero(fleet, gateway):
    client = await gateway(await fleet(2))
    rng = random.Random(4)
    body = text(rng, 300)
    messages = [{"role": "user", "content": "what changed?"}]
    for second in range(3):
        system = {"role": "system", "content": f"Current time: 2026-11-30T10:00:0{second}Z. {body}"}
        await chat(client, [system, *messages])
        messages = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text(rng, 5)}]
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "prefix_router_cache_requests_total", result="miss_changed") == 2
    assert metric(metrics, "prefix_router_lost_tokens_total", cause="changed") > 0
    assert metric(metrics, "prefix_router_changed_total", cause="volatile_value") == 2
    sites = (await (await client.get("/debug/changes")).json())["sites"]
    assert {(s["cause"], s["message_index"], s["role"]) for s in sites} == {("volatile_value", 0, "system")}
    assert "Current time" not in json.dumps(sites)  # no prompt text unless snippets are turned on


async def test_a_saturated_replica_spills_and_the_session_sticks_where_its_history_went(fleet, gateway):
    client = await gateway(await fleet(3))
    gw = client.server.app[GATEWAY]
    rng = random.Random(5)
    messages = [{"role": "system", "content": text(rng, 100)}, {"role": "user", "content": text(rng, 30)}]
    owner, _ = await chat(client, messages)
    gw.replicas[owner].others = 50  # other gateways loaded the owner: the next turn must spill
    messages += [{"role": "assistant", "content": "a"}, {"role": "user", "content": text(rng, 30)}]
    spilled, _ = await chat(client, messages)
    assert spilled != owner
    gw.replicas[owner].others = 0
    messages += [{"role": "assistant", "content": "b"}, {"role": "user", "content": text(rng, 30)}]
    after, usage = await chat(client, messages)
    assert after == spilled  # sticky: the longer history lives where the spill went
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "prefix_router_spillovers_total", from_replica=owner, to_replica=spilled) == 1


async def test_requests_to_a_dead_replica_are_retried_on_the_next_one(fleet, gateway):
    servers = await fleet(3)
    client = await gateway(servers)
    rng = random.Random(6)
    conversations = [[{"role": "user", "content": f"{i} " + text(rng, 40)}] for i in range(30)]
    placed = [await chat(client, m) for m in conversations]
    victim = placed[0][0]
    await next(s for s in servers if str(s.make_url("")).rstrip("/").endswith(victim)).close()
    for messages in conversations:  # before health checks notice: retried, never failed
        replica, _ = await chat(client, messages)
        assert replica != victim


async def test_streaming_passes_chunks_through_and_drops_the_usage_chunk_nobody_asked_for(fleet, gateway):
    client = await gateway(await fleet(2))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    raw = await resp.text()
    assert resp.status == 200 and REPLICA_HEADER in resp.headers
    assert raw.rstrip().endswith("data: [DONE]")
    assert '"usage"' not in raw
    body["stream_options"] = {"include_usage": True}
    raw = await (await client.post("/v1/chat/completions", json=body)).text()
    assert '"usage"' in raw
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "prefix_router_prompt_tokens_total") > 0  # usage read on both


@pytest.mark.parametrize("payload", [b"{bad", b"[1,2]", b"null", b"\xff\xfe"])
async def test_malformed_bodies_get_openai_style_400s(fleet, gateway, payload):
    client = await gateway(await fleet(1))
    resp = await client.post("/v1/chat/completions", data=payload, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


async def test_replicas_view_and_readiness(fleet, gateway):
    client = await gateway(await fleet(2))
    view = await (await client.get("/replicas")).json()
    assert len(view["replicas"]) == 2
    assert abs(sum(r["ring_share"] for r in view["replicas"]) - 1.0) < 1e-3
    assert all(r["num_gpu_blocks"] == 20_000 and r["block_size"] == 16 for r in view["replicas"])
    assert all(r["hit_rate"] is None and r["prompt_tokens"] == 0 for r in view["replicas"])  # nothing served yet
    assert (await client.get("/ready")).status == 200
    assert (await client.get("/health")).status == 200
    messages = [{"role": "user", "content": "a question long enough to fill a few blocks " * 8}]
    for _ in range(3):  # the same prompt: its repeats hit
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1},
                                 headers={"X-Session-ID": "one"})
        assert resp.status == 200
    page = await (await client.get("/metrics")).text()
    served = [r for r in (await (await client.get("/replicas")).json())["replicas"] if r["prompt_tokens"]]
    assert len(served) == 1 and served[0]["hit_rate"] > 0
    assert served[0]["hit_rate"] == round(metric(page, "prefix_router_cached_tokens_total")
                                          / metric(page, "prefix_router_prompt_tokens_total"), 4)
    assert served[0]["predicted_hit_rate"] == round(metric(page, "prefix_router_cached_tokens_predicted_total")
                                                    / metric(page, "prefix_router_prompt_tokens_total"), 4)


def spawn_sim(port: int, time_scale: float) -> subprocess.Popen:
    """A simulated replica in its own process, so it can be killed for real."""
    return subprocess.Popen([sys.executable, "-m", "prefix_router.cli", "sim", "--port", str(port), "--model", MODEL,
                             "--num-blocks", "20000", "--time-scale", str(time_scale)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_until(predicate, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def healthy_url(port: int, path: str = "/health") -> str:
    """The base URL of the server on ``port`` once ``path`` answers 200 (a gateway's ``/ready``:
    a replica is on its ring, so requests are served)."""
    import aiohttp

    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            try:
                async with http.get(url + path) as resp:
                    if resp.status == 200:
                        return url
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never became healthy")


async def test_a_replica_killed_mid_run_fails_no_request_that_had_not_started_streaming(fleet, aiohttp_client,
                                                                                       unused_tcp_port_factory):
    # Two in-process replicas plus one in its own process, killed while streams are running.
    # Time scale 5: a 200-token stream lasts about 240 ms, so streams are running at the kill.
    servers = await fleet(2, time_scale=5.0)
    port = unused_tcp_port_factory()
    victim = spawn_sim(port, 5.0)
    try:
        urls = [str(s.make_url("")).rstrip("/") for s in servers] + [await healthy_url(port)]
        config = config_from_dict({"replicas": urls, "health": {"interval_s": 0.2, "unhealthy_after": 1}})
        client = await aiohttp_client(create_app(config, ByteTokenizer()))
        rng = random.Random(8)

        async def one(i: int) -> tuple[int, bool, str]:
            await asyncio.sleep(i * 0.01)
            body = {"model": MODEL, "max_tokens": 200, "stream": True,
                    "messages": [{"role": "user", "content": f"{i} " + text(rng, 30)}]}
            resp = await client.post("/v1/chat/completions", json=body)
            raw = await resp.text()
            return resp.status, resp.headers.get(REPLICA_HEADER), raw

        tasks = [asyncio.create_task(one(i)) for i in range(60)]
        # kill it once streams run on it (a fixed wait missed them on a busy machine)
        victim_state = client.server.app[GATEWAY].replicas[replica_name(urls[2])]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while victim_state.inflight < 3 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # their first chunks are out
        victim.send_signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    finally:
        victim.kill()
        victim.wait()
    dead = replica_name(f"http://127.0.0.1:{port}")
    assert any(replica == dead for _, replica, _ in results), "the killed replica served nothing: no test"
    for status, replica, raw in results:
        assert status == 200  # nothing failed before streaming: refused connections were retried
        if not raw.rstrip().endswith("data: [DONE]"):
            # Cut mid-stream: the client got data first, then a clear error event, not a hang.
            assert replica == dead
            assert '"delta"' in raw and '"error"' in raw.splitlines()[-2] + raw.splitlines()[-1]
    assert any(not raw.rstrip().endswith("[DONE]") for _, _, raw in results), "no stream was cut: no test"


async def test_a_restarted_replica_starts_with_an_empty_view_so_its_misses_are_cold(aiohttp_client,
                                                                                  unused_tcp_port_factory):
    port = unused_tcp_port_factory()
    proc = spawn_sim(port, 1000.0)
    try:
        url = await healthy_url(port)
        config = config_from_dict({"replicas": [url], "health": {"interval_s": 0.1, "unhealthy_after": 1},
                                   "scrape": {"interval_s": 0.1}})
        client = await aiohttp_client(create_app(config, ByteTokenizer()))
        gw = client.server.app[GATEWAY]
        rng = random.Random(9)
        messages = [{"role": "system", "content": text(rng, 200)}, {"role": "user", "content": text(rng, 20)}]
        await chat(client, messages)
        proc.kill()
        proc.wait()
        await wait_until(lambda: not gw.replicas[replica_name(url)].healthy)
        proc = spawn_sim(port, 1000.0)
        await healthy_url(port)
        await wait_until(lambda: gw.replicas[replica_name(url)].routable)  # after the restart check
        messages += [{"role": "assistant", "content": "x"}, {"role": "user", "content": text(rng, 20)}]
        _, usage = await chat(client, messages)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # the engine lost its cache
        metrics = await (await client.get("/metrics")).text()
        # Both the very first request and the one after the restart found nothing known.
        assert metric(metrics, "prefix_router_cache_requests_total", result="miss_cold") == 2
        assert metric(metrics, "prefix_router_cache_requests_total", result="miss_changed") == 0
        assert metric(metrics, "prefix_router_cache_requests_total", result="miss_evicted") == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "stream": true, "messages": []}',
    b'  \n{"stream":true,"stream_options":{"continuous_usage_stats":false}}',
    b'\xef\xbb\xbf{"stream": true}',
])
def test_usage_is_requested_from_the_engine_without_changing_anything_else(raw):
    from prefix_router.serve.bodies import parse
    from prefix_router.config import LimitsConfig
    from prefix_router.serve.inbound import patched

    body = parse(raw, LimitsConfig())
    options = {**(body.get("stream_options") or {}), "include_usage": True}
    sent = json.loads(patched(raw, body, {"stream_options": options}))
    assert sent["stream_options"]["include_usage"] is True
    assert {k: v for k, v in sent.items() if k != "stream_options"} == {k: v for k, v in body.items() if k != "stream_options"}
    assert {k: v for k, v in sent["stream_options"].items() if k != "include_usage"} == \
        {k: v for k, v in (body.get("stream_options") or {}).items() if k != "include_usage"}


async def test_stream_chunks_reach_the_client_as_the_replica_sends_them(aiohttp_server, aiohttp_client):
    import time

    from aiohttp import web

    release = asyncio.Event()

    async def slow_stream(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"first"}}]}\n\n')
        await release.wait()  # the rest only once the client has shown it saw the first chunk
        await response.write(b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"second"}}]}\n\n'
                             b"data: [DONE]\n\n")
        return response

    async def empty(request):
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow_stream)
    app.router.add_get("/health", empty)
    app.router.add_get("/metrics", empty)
    upstream = await aiohttp_server(app)
    config = config_from_dict({"replicas": [str(upstream.make_url("")).rstrip("/")]})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    started = time.perf_counter()
    first = await asyncio.wait_for(resp.content.readline(), timeout=5)
    assert b"first" in first  # arrived while the replica still holds the rest: nothing buffered
    release.set()
    rest = await resp.text()
    assert "second" in rest and rest.rstrip().endswith("[DONE]")
    assert time.perf_counter() - started < 5


async def test_completions_that_branch_from_a_shared_document_are_not_called_changed(fleet, gateway):
    client = await gateway(await fleet(2))
    rng = random.Random(10)
    document = [rng.randrange(100, 30_000) for _ in range(400)]
    for question in range(4):  # one document, four different questions after it
        prompt = document + [rng.randrange(100, 30_000) for _ in range(40)]
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert resp.status == 200
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "prefix_router_cache_requests_total", result="miss_changed") == 0
    assert metric(metrics, "prefix_router_cache_requests_total", result="hit") == 3


async def test_a_configured_shadow_bound_holds_after_the_replicas_report_their_capacity(fleet, aiohttp_client):
    servers = await fleet(1)
    data = {"replicas": [str(s.make_url("")).rstrip("/") for s in servers], "index": {"max_blocks_per_replica": 50},
            "scrape": {"interval_s": 0.1}}
    client = await aiohttp_client(create_app(config_from_dict(data), ByteTokenizer()))
    gw = client.server.app[GATEWAY]
    (replica,) = gw.replicas.values()
    await wait_until(lambda: replica.num_gpu_blocks == 20_000)  # scraped from the replica
    await asyncio.sleep(0.3)  # a few more scrapes and ring syncs
    assert replica.shadow.capacity == 50
