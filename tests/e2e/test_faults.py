"""Faults at the replicas and at the gateway: each test fails without the handling it names.

Replica killed mid-run and replica restarted with an empty cache: tests/e2e/test_gateway.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from prefix_router.app import GATEWAY, create_app
from prefix_router.fleet.breaker import BreakerState, CircuitBreaker
from prefix_router.config import BreakerConfig, ConfigError, config_from_dict
from prefix_router.tools.launch import free_port
from prefix_router.constants import REPLICA_HEADER
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL
from .test_gateway import healthy_url, wait_until


def test_the_breaker_opens_at_the_threshold_doubles_its_cooldown_per_failed_trial_and_closes_on_success():
    breaker = CircuitBreaker(BreakerConfig(failures=3, cooldown_s=1.0, max_cooldown_s=3.0))
    for ok in (False, False, True, False, False):  # a success resets the count
        assert breaker.record(ok, 0.0) is None
    assert breaker.record(False, 0.0) is BreakerState.OPEN
    assert not breaker.allows(0.5) and breaker.state(0.5) is BreakerState.OPEN
    cooldowns = []
    now = 0.0
    for _ in range(3):  # failed trials: 2 s, then 3 s (the cap), then 3 s
        now += breaker.cooldown_s
        assert breaker.allows(now)
        breaker.on_send(now)
        assert not breaker.allows(now)  # one trial at a time
        assert breaker.record(False, now) is BreakerState.OPEN
        cooldowns.append(breaker.cooldown_s)
    assert cooldowns == [2.0, 3.0, 3.0]
    now += breaker.cooldown_s
    breaker.on_send(now)
    assert breaker.record(True, now) is BreakerState.CLOSED
    assert breaker.cooldown_s == 1.0 and breaker.allows(now)


def test_a_max_cooldown_below_the_cooldown_is_refused():
    with pytest.raises(ConfigError, match="breaker.max_cooldown_s"):
        config_from_dict({"breaker": {"cooldown_s": 10, "max_cooldown_s": 5}})


class FaultyReplica:
    """A replica stand-in whose faults a test switches on and off: ``mode`` is "ok" (answers
    like a tiny vLLM), "error" (/health 200, generation 500), "slow" (answers after 5 s),
    "hang_generation" (/health 200, generation never answered) or "hang" (accepts
    connections, never answers anything). Counts the generation requests it received."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.posts = 0
        self.app = web.Application()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post("/v1/chat/completions", self._chat)

    async def _hang_if_asked(self, generation: bool = False) -> None:
        while self.mode == "hang" or (generation and self.mode == "hang_generation"):
            await asyncio.sleep(0.05)

    async def _health(self, request):
        await self._hang_if_asked()
        return web.Response(text="")

    async def _metrics(self, request):
        await self._hang_if_asked()
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _chat(self, request):
        self.posts += 1
        await request.read()
        await self._hang_if_asked(generation=True)
        if self.mode == "error":
            return web.json_response({"error": {"message": "engine dead", "code": 500}}, status=500)
        if self.mode == "slow":
            await asyncio.sleep(5)
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        return web.json_response({"id": "x", "object": "chat.completion", "model": MODEL, "usage": usage,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}]})


def _chat_body(i: int, stream: bool = False, max_tokens: int = 4) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": f"question {i} about a subject of its own"}]}


async def _faulty_and_good(aiohttp_server, fleet) -> tuple[FaultyReplica, str, str]:
    """A FaultyReplica and a simulated replica; returns it and both base URLs (faulty first)."""
    faulty = FaultyReplica()
    bad_server = await aiohttp_server(faulty.app)
    (good,) = await fleet(1)
    return faulty, str(bad_server.make_url("")).rstrip("/"), str(good.make_url("")).rstrip("/")


async def _send(client, i: int, stream: bool = False) -> tuple[int, str | None, str]:
    resp = await client.post("/v1/chat/completions", json=_chat_body(i, stream))
    return resp.status, resp.headers.get(REPLICA_HEADER), await resp.text()


async def test_a_replica_answering_500s_opens_its_breaker_and_closes_it_once_it_recovers(fleet, aiohttp_server,
                                                                                       aiohttp_client):
    # Its /health keeps answering 200, so only the breaker can keep requests off it.
    faulty, bad, good = await _faulty_and_good(aiohttp_server, fleet)
    config = config_from_dict({"replicas": [bad, good],
                               "breaker": {"failures": 3, "cooldown_s": 0.5, "max_cooldown_s": 1.0},
                               "health": {"interval_s": 0.2}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    gw = client.app[GATEWAY]
    bad_name = bad.split("//")[1]
    faulty.mode = "error"
    results = [await _send(client, i) for i in range(30)]
    assert all(status == 200 for status, _, _ in results)  # retried on the good replica
    assert faulty.posts == 3, f"{faulty.posts} requests reached the failing replica, the breaker opens at 3"
    view = {r["name"]: r for r in (await (await client.get("/replicas")).json())["replicas"]}
    assert view[bad_name]["breaker"] == "open" and not view[bad_name]["routable"]
    page = await (await client.get("/metrics")).text()
    assert f'prefix_router_replica_breaker_state{{replica="{bad_name}"}} 1.0' in page

    # A failed trial after the cooldown opens it again, for longer.
    await asyncio.sleep(0.6)
    results = [await _send(client, 100 + i) for i in range(10)]
    assert all(status == 200 for status, _, _ in results)
    assert faulty.posts == 4  # one trial
    assert gw.replicas[bad_name].breaker.cooldown_s == 1.0

    faulty.mode = "ok"
    await asyncio.sleep(1.1)
    results = [await _send(client, 200 + i) for i in range(30)]
    assert all(status == 200 for status, _, _ in results)
    assert any(replica == bad_name for _, replica, _ in results), "the recovered replica got no traffic back"
    assert gw.replicas[bad_name].breaker.opened_at is None  # closed


async def test_a_replica_that_accepts_connections_but_never_answers_is_timed_out_ejected_and_readmitted(
        fleet, aiohttp_server, aiohttp_client):
    faulty, hung, good = await _faulty_and_good(aiohttp_server, fleet)
    config = config_from_dict({"replicas": [hung, good],
                               "upstream": {"header_timeout_s": 0.5}, "breaker": {"cooldown_s": 0.5},
                               "health": {"interval_s": 0.2, "timeout_s": 0.2, "unhealthy_after": 1}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    gw = client.app[GATEWAY]
    hung_name = hung.split("//")[1]
    # First only its generation hangs, so the health checker cannot eject it for hanging before
    # the burst arrives, however slowly this box schedules the burst: the requests routed there
    # must be given up on after the header timeout and retried, not left waiting for 600 s.
    faulty.mode = "hang_generation"
    results = await asyncio.wait_for(asyncio.gather(*(_send(client, i, stream=True) for i in range(12))), 10)
    assert faulty.posts > 0, "no request reached the hung replica: no test"
    for status, replica, raw in results:
        assert status == 200 and replica != hung_name
        assert raw.rstrip().endswith("data: [DONE]")
    faulty.mode = "hang"  # now its health check hangs too
    await wait_until(lambda: not gw.replicas[hung_name].healthy, 5)
    posts = faulty.posts
    await asyncio.wait_for(asyncio.gather(*(_send(client, 50 + i, stream=True) for i in range(12))), 10)
    assert faulty.posts == posts  # ejected: nothing more sent there

    faulty.mode = "ok"
    await wait_until(lambda: gw.replicas[hung_name].routable and hung_name in gw.ring.shares(), 5)
    results = [await _send(client, 100 + i, stream=True) for i in range(20)]
    assert any(replica == hung_name for _, replica, _ in results), "the recovered replica got no traffic back"


async def test_when_every_replica_is_saturated_requests_wait_then_get_429_or_503_with_retry_after(fleet,
                                                                                                  aiohttp_client):
    # One replica, one sequence at a time: a 400-token answer takes 400 x 6 ms / time scale 2
    # = 1.2 s, far longer than the 0.5 s wait allowed.
    (sim,) = await fleet(1, max_num_seqs=1, time_scale=2.0)
    config = config_from_dict({"replicas": [str(sim.make_url("")).rstrip("/")],
                               "admission": {"saturated_depth": 2, "max_queue": 2, "timeout_s": 0.5},
                               "scrape": {"interval_s": 0.05}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    (replica,) = client.app[GATEWAY].replicas.values()

    async def one(i: int) -> tuple[int, dict, str]:
        resp = await client.post("/v1/chat/completions", json=_chat_body(i, max_tokens=400))
        return resp.status, dict(resp.headers), await resp.text()

    first = [asyncio.create_task(one(i)) for i in range(3)]  # one runs, two wait at the replica
    await wait_until(lambda: replica.waiting == 2, 5)
    late = await asyncio.gather(*(one(10 + i) for i in range(6)))
    statuses = sorted(status for status, _, _ in late)
    # saturated: 2 wait at the gateway and time out (503), 4 find its queue full (429)
    assert statuses == [429] * 4 + [503] * 2, statuses
    for status, headers, raw in late:
        assert headers.get("Retry-After") == "1"
        error = json.loads(raw)["error"]
        assert error["code"] == status and "saturated" in error["message"]
    assert [status for status, _, _ in await asyncio.gather(*first)] == [200] * 3
    page = await (await client.get("/metrics")).text()
    assert 'prefix_router_admission_rejected_total{reason="queue_full"} 4.0' in page
    assert 'prefix_router_admission_rejected_total{reason="timeout"} 2.0' in page


async def test_a_burst_to_replicas_that_run_it_all_is_not_held_at_the_gateway(fleet, aiohttp_client):
    # 40 requests at once to a replica that runs them all: its load (requests sent since the
    # last scrape) passes saturated_depth, but its engine reports no queue, so none waits here.
    (sim,) = await fleet(1, time_scale=20.0)
    config = config_from_dict({"replicas": [str(sim.make_url("")).rstrip("/")],
                               "admission": {"saturated_depth": 4, "max_queue": 1, "timeout_s": 0.2},
                               "scrape": {"interval_s": 60}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))

    async def one(i: int) -> int:
        resp = await client.post("/v1/chat/completions", json=_chat_body(i, max_tokens=50))
        await resp.read()
        return resp.status

    assert await asyncio.gather(*(one(i) for i in range(40))) == [200] * 40


async def test_a_request_queued_at_the_gateway_is_served_when_a_replica_frees_up(fleet, aiohttp_client):
    # 100 tokens x 6 ms / time scale 2: 0.3 s a request, one at a time
    (sim,) = await fleet(1, max_num_seqs=1, time_scale=2.0)
    config = config_from_dict({"replicas": [str(sim.make_url("")).rstrip("/")],
                               "admission": {"saturated_depth": 1, "max_queue": 10, "timeout_s": 20},
                               "scrape": {"interval_s": 0.05}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    gw = client.app[GATEWAY]
    most = 0

    async def one(i: int) -> int:
        await asyncio.sleep(0.1 * i)
        resp = await client.post("/v1/chat/completions", json=_chat_body(i, max_tokens=100))
        await resp.read()
        return resp.status

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, len(gw.admission))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    assert await asyncio.gather(*(one(i) for i in range(6))) == [200] * 6
    watcher.cancel()
    assert most > 0, "nothing waited at the gateway: no test"
    assert len(gw.admission) == 0


def test_sigterm_lets_a_running_stream_finish_then_the_gateway_exits(tmp_path):
    """Run as Kubernetes stops a pod: SIGTERM while a stream runs. The stream ends with
    [DONE], new connections are refused, and the process exits 0 within ``drain_s``."""
    sim_port, gw_port = free_port(), free_port()
    sim = subprocess.Popen([sys.executable, "-m", "prefix_router.cli", "sim", "--port", str(sim_port), "--model", MODEL,
                            "--time-scale", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = tmp_path / "gateway.yaml"
    config.write_text(f"replicas: [http://127.0.0.1:{sim_port}]\ndrain_s: 20\n")
    gateway = subprocess.Popen([sys.executable, "-m", "prefix_router.cli", "serve", "--config", str(config),
                                "--host", "127.0.0.1", "--port", str(gw_port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def scenario() -> tuple[str, float, bool]:
        await healthy_url(sim_port)
        url = await healthy_url(gw_port, "/ready")  # the replica on the gateway's ring
        async with aiohttp.ClientSession() as http:
            # 300 tokens at ~6 ms each: a stream of about 2 s
            async with http.post(url + "/v1/chat/completions", json=_chat_body(1, stream=True, max_tokens=300)) as resp:
                assert resp.status == 200
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                signalled = time.monotonic()
                gateway.send_signal(signal.SIGTERM)
                rest = (await resp.read()).decode()
            await asyncio.sleep(0.2)
            try:
                async with http.get(url + "/health") as again:
                    refused = False
            except aiohttp.ClientConnectionError:
                refused = True
        return rest, signalled, refused

    try:
        rest, signalled, refused = asyncio.run(scenario())
        code = gateway.wait(timeout=20)
        exited_after = time.monotonic() - signalled
    finally:
        for proc in (gateway, sim):
            proc.kill()
            proc.wait()
    assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
    assert rest.count('"delta"') > 100  # the stream went on after the signal
    assert refused, "the gateway still accepted connections after SIGTERM"
    assert code == 0
    assert exited_after < 20


async def test_a_client_that_stops_reading_a_stream_is_cut_off_and_the_replica_stops_generating(fleet,
                                                                                               aiohttp_server):
    """A raw socket with a small receive buffer asks for a long stream and never reads it: the
    gateway's writes back up, and after ``client_write_timeout_s`` it drops the client and the
    upstream request, instead of holding both (and the replica's KV blocks) forever."""


    (sim,) = await fleet(1, time_scale=1000.0)
    config = config_from_dict({"replicas": [str(sim.make_url("")).rstrip("/")],
                               "limits": {"client_write_timeout_s": 0.5}, "scrape": {"interval_s": 0.1}})
    app = create_app(config, ByteTokenizer())

    async def small_send_buffer(request, response):
        # Loopback send buffers grow to megabytes: the stream (which the simulator batches into a
        # few large events when its reader falls behind) could fit there whole and end with 200
        # before any write waits (seen in CI).
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    app.on_response_prepare.append(small_send_buffer)
    server = await aiohttp_server(app)
    gw = server.app[GATEWAY]
    (replica,) = gw.replicas.values()
    body = json.dumps(_chat_body(1, stream=True, max_tokens=50_000)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        await wait_until(lambda: replica.inflight == 1, 5)
        await wait_until(lambda: replica.inflight == 0, 10)  # cut off: not stuck writing
        async with aiohttp.ClientSession() as http, http.get(str(server.make_url("/metrics"))) as page:
            text = await page.text()
            assert 'code="499"' in text, [l for l in text.splitlines() if l.startswith("prefix_router_requests_total")]
        await wait_until(lambda: replica.running == 0, 5)  # the replica stopped generating (scraped)
    finally:
        sock.close()


async def test_a_request_every_replica_refuses_with_500_opens_no_breaker(aiohttp_server, aiohttp_client):
    """A client whose requests make every replica fail (a poison request) gets 502s, and the
    replicas stay in service: a 5xx is blamed on a replica only when another served the request."""
    faulty = [FaultyReplica() for _ in range(2)]
    servers = [await aiohttp_server(f.app) for f in faulty]
    config = config_from_dict({"replicas": [str(s.make_url("")).rstrip("/") for s in servers],
                               "breaker": {"failures": 2}, "upstream": {"max_retries": 1}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    gw = client.app[GATEWAY]
    for f in faulty:
        f.mode = "error"
    results = [await _send(client, i) for i in range(10)]
    assert [status for status, _, _ in results] == [502] * 10
    assert sum(f.posts for f in faulty) == 20  # every request tried on both
    assert all(r.breaker.opened_at is None and r.routable for r in gw.replicas.values())


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_clients_that_disconnect_mid_stream_are_not_blamed_on_the_replica_nor_retried(fleet,
                                                                                           handler_cancellation):
    """Clients reset their connections after the first chunk. Whether the event loop cancels the
    handler first or the gateway's next write to the client fails first (the two orders race in
    production; ``handler_cancellation`` picks one), the replica is not blamed and the request
    is not sent again."""
    (sim,) = await fleet(1, time_scale=5.0)  # a 200-token stream lasts about 0.25 s
    config = config_from_dict({"replicas": [str(sim.make_url("")).rstrip("/")], "breaker": {"failures": 2}})
    app = create_app(config, ByteTokenizer())
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    (replica,) = app[GATEWAY].replicas.values()
    try:
        for i in range(8):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps(_chat_body(i, stream=True, max_tokens=200)).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            while not (await reader.readline()).startswith(b"data: "):
                pass
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
        await wait_until(lambda: replica.inflight == 0, 5)
        page = generate_latest(app[GATEWAY].metrics.registry).decode()
        assert replica.breaker.failures == 0 and replica.breaker.opened_at is None
        assert 'code="0"' not in page and 'code="502"' not in page  # not blamed, not retried
    finally:
        await runner.cleanup()


async def test_a_trial_request_whose_client_leaves_frees_the_half_open_breaker_for_another(aiohttp_server, fleet,
                                                                                          aiohttp_client):
    faulty, bad, good = await _faulty_and_good(aiohttp_server, fleet)
    config = config_from_dict({"replicas": [bad, good],
                               "breaker": {"failures": 2, "cooldown_s": 0.3}, "health": {"interval_s": 0.2}})
    # as prefix-router serve runs it: a client that leaves cancels its handler
    client = await aiohttp_client(create_app(config, ByteTokenizer()), server_kwargs={"handler_cancellation": True})
    breaker = client.app[GATEWAY].replicas[bad.split("//")[1]].breaker
    faulty.mode = "error"
    i = 0
    while breaker.opened_at is None:
        await _send(client, i)
        i += 1
    await asyncio.sleep(0.35)  # half-open
    faulty.mode = "slow"
    posts = faulty.posts
    while faulty.posts == posts and i < 200:  # until a request is the trial; each client leaves after 0.2 s
        try:
            await asyncio.wait_for(_send(client, i), 0.2)
        except asyncio.TimeoutError:
            pass
        i += 1
    assert faulty.posts == posts + 1, "no trial reached the replica: no test"
    await wait_until(lambda: not breaker.trial_inflight, 2)
    assert breaker.allows(time.monotonic())  # another trial may go


async def test_a_prompt_counts_as_queued_prefill_on_its_replica_until_its_first_token(fleet, aiohttp_server,
                                                                                     aiohttp_client):
    """``ReplicaState.prefill_blocks`` (what new work compares): a request's uncached prompt counts
    on its replica from sending until the first token, not for the rest of its stream, and
    nothing stays counted once it ends, whether a first token came or the attempt timed out."""
    faulty = FaultyReplica()
    hung = str((await aiohttp_server(faulty.app)).make_url("")).rstrip("/")
    config = config_from_dict({"replicas": [hung], "upstream": {"header_timeout_s": 0.5, "max_retries": 0}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    (replica,) = client.app[GATEWAY].replicas.values()
    faulty.mode = "hang_generation"
    waiting = asyncio.create_task(_send(client, 0, stream=True))
    await wait_until(lambda: replica.inflight == 1, 5)
    assert replica.prefill_blocks > 0  # sent, no first token yet
    status, _, _ = await waiting
    assert status == 502 and (replica.inflight, replica.prefill_blocks) == (0, 0)

    (sim,) = await fleet(1, time_scale=1.0)  # modelled time: 500 tokens take seconds to decode
    config = config_from_dict({"replicas": [str(sim.make_url("")).rstrip("/")]})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    (replica,) = client.app[GATEWAY].replicas.values()
    async with client.post("/v1/chat/completions", json=_chat_body(1, stream=True, max_tokens=500)) as resp:
        while not (await resp.content.readline()).startswith(b"data: {"):
            pass
        assert (replica.inflight, replica.prefill_blocks) == (1, 0)  # decoding: its prefill is done
        await resp.read()
    await wait_until(lambda: replica.inflight == 0, 5)
    assert replica.prefill_blocks == 0


async def test_new_work_goes_to_the_replica_with_the_least_prompt_queued_for_prefill(aiohttp_server, aiohttp_client):
    """Through the gateway, not only the policy: two replicas, one request in flight on each, a
    short prompt on the one that holds more blocks (it answered a long prompt before) and a
    longer one on the other. A new conversation goes to the first: less is queued for prefill
    there, though by blocks held it would go to the second."""
    faulty = [FaultyReplica(), FaultyReplica()]
    urls = [str((await aiohttp_server(f.app)).make_url("")).rstrip("/") for f in faulty]
    client = await aiohttp_client(create_app(config_from_dict({"replicas": urls}), ByteTokenizer()))
    gw = client.app[GATEWAY]
    await wait_until(lambda: all(r.routable for r in gw.replicas.values()), 5)

    def chat(text: str) -> dict:
        return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}

    resp = await client.post("/v1/chat/completions", json=chat("a long document " * 200))
    assert resp.status == 200
    big = gw.replicas[resp.headers[REPLICA_HEADER]]  # holds the most blocks from now on
    (small,) = [r for r in gw.replicas.values() if r is not big]
    for f in faulty:
        f.mode = "hang_generation"
    medium = asyncio.create_task(client.post("/v1/chat/completions", json=chat("a medium question " * 30)))
    await wait_until(lambda: small.inflight == 1, 5)  # new work: equal loads, the fewest blocks
    short = asyncio.create_task(client.post("/v1/chat/completions", json=chat("a short one " * 4)))
    await wait_until(lambda: big.inflight == 1, 5)  # the least loaded
    assert 0 < big.prefill_blocks < small.prefill_blocks and len(big.shadow) > len(small.shadow)
    new = asyncio.create_task(client.post("/v1/chat/completions", json=chat("a new conversation " * 10)))
    await wait_until(lambda: big.inflight + small.inflight == 3, 5)
    assert big.inflight == 2
    for f in faulty:
        f.mode = "ok"
    assert [(await t).status for t in (medium, short, new)] == [200, 200, 200]
