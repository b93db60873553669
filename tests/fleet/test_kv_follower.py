"""Finding each replica's KV event publisher, following it, and checking the picture it gives
(prefix_router/fleet/kv_follower.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import msgspec
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import decode_batch
from prefix_router.cache.stream import EventStream
from prefix_router.config import config_from_dict
from prefix_router.fleet.kv_follower import _on_host, check_parity, event_endpoints, follow_events, parity_hint
from prefix_router.fleet.replicas import scrape_once
from prefix_router.gateway import Gateway
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric, until

BS = 4  # tokens per block, the view's and the prompts'


def url_of(server) -> str:
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
async def gateway():
    """``gateway(replicas, **sections)``: a Gateway from that configuration, with an HTTP session."""
    made: list[Gateway] = []

    def build(replicas, **sections) -> Gateway:
        gw = Gateway(config_from_dict({"replicas": replicas, **sections}), ByteTokenizer())
        gw.http = aiohttp.ClientSession()
        made.append(gw)
        return gw

    yield build
    for gw in made:
        await gw.http.close()
        gw.executor.shutdown(wait=False)


@pytest.fixture
async def sources(aiohttp_server):
    """``await sources(answer)``: a replica whose ``GET /kv_event_sources`` answers ``answer``
    (a dict as JSON, or an HTTP status)."""

    async def start(answer):
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(answer) if isinstance(answer, (dict, list)) else web.Response(status=answer)

        app = web.Application()
        app.router.add_get("/kv_event_sources", handler)
        return await aiohttp_server(app)

    return start


def rank(endpoint="tcp://*:5557", replay="tcp://*:5558", enabled=True) -> dict:
    """One data-parallel rank's ``--kv-events-config``, as vLLM 0.32 lists it."""
    return {"enable_kv_cache_events": enabled, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
            "topic": "", "buffer_steps": 10_000}


# --- finding the publisher ---------------------------------------------------------------------

async def test_configured_endpoints_are_used_without_asking_the_replica(gateway):
    gw = gateway([{"url": "http://127.0.0.1:1", "kv_events": "tcp://10.0.0.7:5557",
                   "kv_events_replay": "tcp://10.0.0.7:5558"}])
    [replica] = gw.replicas.values()
    assert await event_endpoints(gw, replica) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")


async def test_each_data_parallel_rank_follows_its_own_publisher_base_port_plus_its_rank(gateway, sources):
    gw = gateway([{"url": "http://127.0.0.1:1", "data_parallel_size": 3, "kv_events": "tcp://10.0.0.7:5557",
                   "kv_events_replay": "tcp://10.0.0.7:5600"}])
    assert [await event_endpoints(gw, r) for r in gw.replicas.values()] == [
        (f"tcp://10.0.0.7:{5557 + r}", f"tcp://10.0.0.7:{5600 + r}") for r in range(3)]
    server = await sources({"0": rank(), "1": rank("tcp://*:5558", "tcp://*:5559")})  # rank 2 publishes nothing
    gw = gateway([{"url": url_of(server), "data_parallel_size": 3}])
    found = [await event_endpoints(gw, r) for r in gw.replicas.values()]
    assert found[1] == (f"tcp://{server.host}:5558", f"tcp://{server.host}:5559") and found[2] is None


async def test_a_server_of_several_ranks_not_configured_as_such_is_not_followed(gateway, sources, caplog):
    server = await sources({"0": rank(), "1": rank("tcp://*:5558", "tcp://*:5559")})
    gw = gateway([url_of(server)])
    [replica] = gw.replicas.values()
    assert await event_endpoints(gw, replica) is None  # rank 0's events would not say what the server holds
    assert "data_parallel_size: 2" in caplog.text


@pytest.mark.parametrize("shape", ["list", "sources", "named ranks"])
async def test_sources_given_as_a_list_are_read_by_rank(gateway, sources, shape):
    ranks = [rank(), rank("tcp://*:5558", "tcp://*:5559")]
    answer = {"list": ranks, "sources": {"sources": ranks},
              "named ranks": [{**ranks[1], "data_parallel_rank": 1}, {**ranks[0], "data_parallel_rank": 0}]}[shape]
    server = await sources(answer)
    gw = gateway([{"url": url_of(server), "data_parallel_size": 2}])
    found = [await event_endpoints(gw, r) for r in gw.replicas.values()]
    assert found == [(f"tcp://{server.host}:5557", f"tcp://{server.host}:5558"),
                     (f"tcp://{server.host}:5558", f"tcp://{server.host}:5559")]


async def test_the_replicas_own_sources_give_its_bind_address_on_the_replicas_host(gateway, sources):
    server = await sources({"0": rank()})
    gw = gateway([url_of(server)])
    [replica] = gw.replicas.values()
    assert await event_endpoints(gw, replica) == (f"tcp://{server.host}:5557", f"tcp://{server.host}:5558")


@pytest.mark.parametrize("answer", [{}, {"0": rank(enabled=False)}, {"0": {**rank(), "publisher": "null"}}])
async def test_a_replica_whose_sources_say_it_publishes_nothing_is_believed_over_the_configured_port(
        gateway, sources, answer):
    server = await sources(answer)
    gw = gateway([url_of(server)], kv_events={"port": 5557})
    assert await event_endpoints(gw, next(iter(gw.replicas.values()))) is None


async def test_a_replica_without_sources_is_tried_on_the_configured_ports(gateway, sources):
    """vLLM before 0.32 has no ``/kv_event_sources``: ``kv_events.port`` on the replica's host."""
    server = await sources(404)
    gw = gateway([url_of(server)], kv_events={"port": 5557, "replay_port": 5558})
    [replica] = gw.replicas.values()
    assert await event_endpoints(gw, replica) == (f"tcp://{server.host}:5557", f"tcp://{server.host}:5558")
    unconfigured = gateway([url_of(server)])
    assert await event_endpoints(unconfigured, next(iter(unconfigured.replicas.values()))) is None


@pytest.mark.parametrize("bound, host, connect", [
    ("tcp://*:5557", "10.1.2.3", "tcp://10.1.2.3:5557"),
    ("tcp://0.0.0.0:5557", "engine-0", "tcp://engine-0:5557"),
    ("tcp://*:5557", "::1", "tcp://[::1]:5557"),  # an IPv6 host in brackets
    ("tcp://10.9.9.9:5557", "10.1.2.3", "tcp://10.9.9.9:5557"),  # a named interface is kept
    ("ipc:///tmp/kv", "10.1.2.3", None),  # not reachable from another host
    (None, "10.1.2.3", None),
])
def test_a_bind_address_becomes_a_connect_address_on_the_replicas_host(bound, host, connect):
    assert _on_host(bound, host) == connect


# --- following it ------------------------------------------------------------------------------

EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
          "replay_endpoint": "tcp://127.0.0.1:*"}


def series(page: str, name: str) -> set[tuple]:
    """The label sets of ``name``'s samples on a metrics page (a series at 0 included)."""
    return {tuple(sorted(s.labels.items())) for f in text_string_to_metric_families(page) for s in f.samples
            if s.name == name}


async def test_a_stream_is_started_for_each_publishing_replica_and_stopped_when_it_leaves(fleet, gateway):
    servers = await fleet(2, kv_events=EVENTS)
    gw = gateway([url_of(s) for s in servers], scrape={"interval_s": 0.05})
    for replica in gw.replicas.values():
        await scrape_once(gw.http, [replica], 2.0)  # its models: only a replica serving something is asked
    task = asyncio.create_task(follow_events(gw))
    try:
        await until(lambda: all(r.stream is not None and r.stream.fresh for r in gw.replicas.values()))
        page = gw.metrics.page().decode()
        for name in gw.replicas:  # every series from the start, at 0
            assert (("replica", name), ("result", "mismatch")) in series(page, "prefix_router_kv_parity_total")
            assert (("outcome", "lost"), ("replica", name)) in series(page, "prefix_router_kv_event_gaps_total")
        await until(lambda: all(metric(gw.metrics.page().decode(), "prefix_router_kv_view_fresh", replica=name) == 1
                                for name in gw.replicas))  # exported at the loop's next round
        gone_name, gone = next(iter(gw.replicas.items()))
        stream = gone.stream
        del gw.replicas[gone_name]  # dropped by discovery
        await until(lambda: stream.stopped)
        assert all(r.stream.fresh for r in gw.replicas.values())
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert all(r.stream.stopped for r in gw.replicas.values())  # cancelling it stops them all


async def test_a_replica_serving_no_model_yet_is_not_asked_for_its_sources(fleet, gateway):
    [server] = await fleet(1, kv_events=EVENTS)
    gw = gateway([url_of(server)], scrape={"interval_s": 0.02})
    task = asyncio.create_task(follow_events(gw))
    try:
        await asyncio.sleep(0.1)  # several rounds of the loop
        [replica] = gw.replicas.values()
        assert replica.stream is None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- parity ------------------------------------------------------------------------------------

def tokens(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BS))


def hashes(first: int, blocks: int) -> list[int]:
    """The gateway's block hashes of a prompt of ``tokens(first, blocks)``."""
    return block_hashes(tokens(first, blocks), BS, seed_hash(MODEL, None))


def stored(first: int, blocks: int, block_size: int = BS) -> bytes:
    """A KV event batch (vLLM 0.32's wire format) storing ``blocks`` blocks of ``block_size``
    tokens from ``first`` on as one prompt."""
    ids = list(range(first, first + blocks * block_size))
    event = {"type": "BlockStored", "block_hashes": [first * 1000 + i for i in range(blocks)],
             "parent_block_hash": None, "token_ids": ids, "block_size": block_size, "medium": "GPU"}
    return msgspec.msgpack.encode([time.time(), [event], 0])


def followed(gw: Gateway) -> tuple:
    """The gateway's only replica, with a stream (no socket: batches are handed to ``receive``)."""
    [replica] = gw.replicas.values()
    replica.stream = EventStream(replica.name, "tcp://127.0.0.1:1", None,
                                 EngineView(BS, lambda lora, salt: seed_hash(lora or MODEL, salt)))
    return replica, replica.stream


PARITY = {"kv_events": {"parity_grace_s": 0.05}, "routing": {"block_size": BS}}


async def test_a_served_prompt_whose_last_block_the_events_showed_counts_as_a_match_at_once(gateway):
    gw = gateway(["http://127.0.0.1:1"], **PARITY)
    replica, stream = followed(gw)
    await stream.receive(0, stored(100, 3))
    check_parity(gw, replica, hashes(100, 3), time.monotonic())
    assert replica.parity_ok == 1
    assert metric(gw.metrics.page().decode(), "prefix_router_kv_parity_total", result="match") == 1


async def test_blocks_the_events_never_show_are_a_mismatch_after_the_grace_logged_once_per_cause(gateway, caplog):
    gw = gateway(["http://127.0.0.1:1"], **PARITY)
    replica, stream = followed(gw)
    await stream.receive(0, stored(900, 2))
    for i in range(2):
        sent_at = time.monotonic()
        await stream.receive(i + 1, stored(200 + 10 * i, 2))  # events keep coming, of other prompts
        with caplog.at_level(logging.WARNING, logger="prefix_router.fleet.kv_follower"):
            check_parity(gw, replica, hashes(300 + 10 * i, 2), sent_at)
            assert replica.parity_mismatch == i  # not before the grace
            await until(lambda: replica.parity_mismatch == i + 1)
    assert "first block differs" in replica.parity_hint
    assert metric(gw.metrics.page().decode(), "prefix_router_kv_parity_total", result="mismatch") == 2
    assert caplog.text.count("picture of its cache is wrong") == 1
    assert stream.fresh


async def test_no_event_at_all_since_the_request_was_sent_marks_the_view_stale_not_a_mismatch(gateway):
    gw = gateway(["http://127.0.0.1:1"], **PARITY)
    replica, stream = followed(gw)
    await stream.receive(0, stored(100, 2))
    check_parity(gw, replica, hashes(400, 2), time.monotonic())  # after the last event
    await until(lambda: stream.stale)
    assert "no KV events arrived" in stream.stale_reason
    assert replica.parity_mismatch == 0 and replica.parity_ok == 0


async def test_a_stream_not_routed_by_says_nothing_of_parity(gateway):
    gw = gateway(["http://127.0.0.1:1"], **PARITY)
    replica, stream = followed(gw)  # nothing heard yet: not fresh
    check_parity(gw, replica, hashes(100, 2), time.monotonic())
    await asyncio.sleep(0.1)  # past the grace
    assert replica.parity_ok == replica.parity_mismatch == 0 and not stream.stale


def test_the_hint_names_the_block_size_the_first_block_or_where_the_prompts_diverge():
    view = EngineView(BS, lambda lora, salt: seed_hash(lora or MODEL, salt))
    view.apply(decode_batch(stored(500, 4)).events[0])  # the engine holds a 4-block prompt
    diverging = hashes(500, 4)[:2] + hashes(600, 2)  # its first 2 blocks, then others
    assert "at block 2" in parity_hint(view, diverging)
    assert "first block differs" in parity_hint(view, hashes(700, 2))
    view.apply(decode_batch(stored(800, 1, block_size=2 * BS)).events[0])  # the engine cuts 8-token blocks
    assert "block size" in parity_hint(view, diverging)
