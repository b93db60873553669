"""Replica discovery by DNS (``prefix_router/fleet/discovery.py``) and the membership changes it drives
(the gateway's side of them, without DNS: ``tests/test_gateway.py``)."""

from __future__ import annotations

import random

import pytest

from prefix_router.app import GATEWAY, create_app
from prefix_router.config import ConfigError, DiscoveryConfig, GatewayConfig, config_from_dict
from prefix_router.constants import REPLICA_HEADER
from prefix_router.fleet.discovery import discover_once, replica_urls, resolve
from prefix_router.fleet.replicas import apply_health, apply_metrics
from prefix_router.gateway import Gateway
from prefix_router.prompts.tokenizer import ByteTokenizer

from ..helpers import MODEL, metric, text
from ..test_gateway import PAGE, gateway, scraped


@pytest.mark.parametrize("bad", ["http://vllm", "vllm:8000", "vllm/path", "a b", "-vllm.ns", "", "x" * 64 + ".ns"])
def test_a_discovery_name_that_is_not_a_dns_name_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"^discovery\.dns: expected a DNS name"):
        config_from_dict({"discovery": {"dns": bad}})


def test_discovery_port_and_scheme_are_checked():
    with pytest.raises(ConfigError, match=r"^discovery\.port"):
        config_from_dict({"discovery": {"dns": "vllm", "port": 0}})
    with pytest.raises(ConfigError, match=r"^discovery\.scheme"):
        config_from_dict({"discovery": {"dns": "vllm", "scheme": "ftp"}})
    assert config_from_dict({"discovery": {"dns": "vllm.ns.svc.cluster.local."}}).discovery.dns == "vllm.ns.svc.cluster.local"


def test_addresses_become_sorted_urls_with_ipv6_in_brackets():
    config = DiscoveryConfig(dns="vllm", port=8001)
    assert replica_urls({"10.0.0.2", "fd00::5", "10.0.0.1"}, config) == [
        "http://10.0.0.1:8001", "http://10.0.0.2:8001", "http://[fd00::5]:8001"]


async def test_a_failed_lookup_keeps_the_known_replicas():
    gw = gateway()
    scraped(gw, "http://10.0.0.1:8000")

    async def broken(name, port):
        raise OSError("Name or service not known")

    assert await discover_once(gw, gw.config.discovery, broken) is False
    assert gw.replicas["10.0.0.1:8000"].routable


async def test_the_system_resolver_finds_localhost():
    assert "127.0.0.1" in await resolve("localhost", 80)


async def test_a_gateway_with_only_discovery_serves_through_the_replicas_localhost_resolves_to(fleet, aiohttp_client):
    (sim,) = await fleet(1)
    config = config_from_dict({"discovery": {"dns": "localhost", "port": sim.port, "interval_s": 0.2},
                               "health": {"interval_s": 0.2}, "scrape": {"interval_s": 0.2}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    gw = client.server.app[GATEWAY]
    assert f"127.0.0.1:{sim.port}" in gw.replicas  # found before the first request
    ready = await client.get("/ready")
    assert ready.status == 200
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 2})
    assert resp.status == 200, await resp.text()


async def test_two_gateways_with_the_replicas_in_any_order_choose_the_same_replica_for_each_request(fleet, aiohttp_client):
    sims = await fleet(4)
    urls = [str(s.make_url("")).rstrip("/") for s in sims]
    shuffled = urls[:]
    random.Random(1).shuffle(shuffled)
    assert shuffled != urls
    clients = []
    for order in (urls, shuffled):
        # Only the start-up scrape: a later one could land while the other instance's request
        # runs and count it as load here alone (a slow CI machine did), and shares that never
        # decay, so the instances differ in nothing but the order they list the replicas in.
        config = config_from_dict({"replicas": order, "health": {"interval_s": 5}, "scrape": {"interval_s": 3600},
                                   "routing": {"share_half_life_s": 1e9, "sole_router": False}})
        clients.append(await aiohttp_client(create_app(config, ByteTokenizer())))
    rng = random.Random(7)
    systems = [text(rng, 300) for _ in range(3)]
    chosen: list[tuple[str, str]] = []
    for i in range(40):  # fresh conversations and later turns of earlier ones
        messages = [{"role": "system", "content": systems[i % 3]}, {"role": "user", "content": text(rng, 40)}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 2}
        headers = {"X-Session-ID": f"s{i % 7}"} if i % 2 else {}
        picks = []
        for client in clients:  # each instance sees every request, in the same order
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status == 200
            picks.append(resp.headers[REPLICA_HEADER])
            await resp.read()
        chosen.append(tuple(picks))
    assert all(a == b for a, b in chosen), [c for c in chosen if c[0] != c[1]]
    assert len({a for a, _ in chosen}) > 1  # and the requests did spread


async def test_a_fresh_instance_sends_a_chats_next_turn_where_another_sent_its_first(fleet, aiohttp_client):
    """No session ids, nothing cached yet. Instance A sees the first turns of conversations and
    B, which has seen none of them, their second turns: keyed by the opening, B agrees with A
    on every one, since neither holds more of a prompt than the other knows."""
    sims = await fleet(4)
    urls = [str(s.make_url("")).rstrip("/") for s in sims]
    config = config_from_dict({"replicas": urls, "health": {"interval_s": 5}, "scrape": {"interval_s": 5},
                               "routing": {"sole_router": False}})
    first, second = [await aiohttp_client(create_app(config, ByteTokenizer())) for _ in range(2)]
    rng = random.Random(5)
    pairs = []
    for _ in range(12):
        messages = [{"role": "system", "content": text(rng, 100)}, {"role": "user", "content": text(rng, 40)}]
        picks = []
        for client in (first, second):
            resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
            assert resp.status == 200
            answer = (await resp.json())["choices"][0]["message"]["content"]
            picks.append(resp.headers[REPLICA_HEADER])
            messages = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": text(rng, 20)}]
        pairs.append(tuple(picks))
    assert all(a == b for a, b in pairs), pairs
    assert len({a for a, _ in pairs}) > 1


async def test_every_metric_of_a_forgotten_replica_is_gone_after_real_traffic(fleet, aiohttp_client):
    sims = await fleet(2)
    urls = [str(s.make_url("")).rstrip("/") for s in sims]
    config = config_from_dict({"replicas": [urls[0]], "discovery": {"dns": "unused.test", "drain_s": 0},
                               "health": {"interval_s": 5}, "scrape": {"interval_s": 5}})
    client = await aiohttp_client(create_app(config, ByteTokenizer()))
    gw = client.server.app[GATEWAY]
    gw.apply_discovery([urls[1]], now=0.0)
    apply_health(gw.replicas[urls[1].split("//")[1]], True, config.health)
    apply_metrics(gw.replicas[urls[1].split("//")[1]], PAGE)
    gw.sync_ring()
    rng = random.Random(3)
    for _ in range(12):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": text(rng, 80), "max_tokens": 2})
        assert resp.status == 200
        await resp.read()
    name = urls[1].split("//")[1]
    page = await (await client.get("/metrics")).text()
    assert metric(page, "prefix_router_requests_total", replica=name) > 0
    gw.apply_discovery([], now=1.0)
    assert gw.forget_drained(now=1.0) == [name]
    page = await (await client.get("/metrics")).text()
    assert name not in page


# With session ids (the replayer sends X-Session-ID, as a client keying its conversations does)
# every instance keys a conversation by it; without them, by its opening, the same in every
# instance. The longest cached prefix then decides: one instance follows a shared system prompt
# to the replicas it saw compute it, the other does not know them. Measured gaps with that rule
# (issue 14; 48 sessions, time scale 50): 1.6 to 4.9 points over eight runs here, with session ids
# and without, and 6.4 once on the CI box, where a slower machine holds more requests in flight and
# each instance's load bound, which counts only its own, spills more; with the earlier
# sticky-history rule -0.7 to +0.7. Round-robin, which keeps no picture at all, reuses 0.536 on
# this replay against one instance's 0.68-0.69: the bound of 8 points sits between the two.
# The replicas' KV events close the gap: tests/e2e/test_kv_events_gateway.py runs four instances
# within a point of one.
@pytest.mark.parametrize("session_header", ["X-Session-ID", None], ids=["session-ids", "no-session-ids"])
async def test_two_gateways_behind_a_round_robin_client_reuse_nearly_as_much_as_one(fleet, aiohttp_server,
                                                                                   session_header):
    """Per-instance state (shadow indexes, branch statistics, conversation memory) costs little:
    the same replay through two instances, alternating request by request, reuses within 8
    points as much as through one (each run on fresh replicas)."""
    from prefix_router.tools.replay.client import replay
    from prefix_router.tools.replay.generate import builtin_workload

    requests = builtin_workload("mixed", sessions=48, seed=11)
    rates = []
    for instances in (1, 2):
        sims = await fleet(4)
        urls = [str(s.make_url("")).rstrip("/") for s in sims]
        config = config_from_dict({"replicas": urls, "health": {"interval_s": 1}, "scrape": {"interval_s": 0.5},
                                   "routing": {"sole_router": instances == 1}})
        gateways = [await aiohttp_server(create_app(config, ByteTokenizer())) for _ in range(instances)]
        records = await replay(requests, [str(g.make_url("")) for g in gateways], model=MODEL, time_scale=50,
                               session_header=session_header)
        assert all(r.error is None for r in records), next(r.error for r in records if r.error)
        rates.append(sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records))
    one, two = rates
    print(f"token hit rate ({session_header or 'no session header'}): one gateway {one:.3f}, "
          f"two behind a round-robin client {two:.3f}")
    assert one > 0.5  # the workload reuses a lot through one gateway
    assert abs(one - two) <= 0.08, f"one gateway {one:.3f}, two {two:.3f}"


async def test_a_prefill_service_names_the_prefill_pool_and_an_address_may_change_pools():
    gw = Gateway(GatewayConfig(discovery=DiscoveryConfig(dns="decode", prefill_dns="prefill")), None)
    pools = {"decode": {"10.0.0.1", "10.0.0.2"}, "prefill": {"10.0.0.3"}}

    async def lookup(name, port):
        return pools[name]

    assert await discover_once(gw, gw.config.discovery, lookup)
    assert gw.prefill_names == {"10.0.0.3:8000"}
    assert {r.config.role for n, r in gw.replicas.items() if n != "10.0.0.3:8000"} == {"both"}
    pools["prefill"], pools["decode"] = {"10.0.0.3", "10.0.0.2"}, {"10.0.0.1"}  # a pod moved to the prefill pool
    assert await discover_once(gw, gw.config.discovery, lookup)
    assert gw.prefill_names == {"10.0.0.2:8000", "10.0.0.3:8000"} and gw.replicas["10.0.0.2:8000"].config.role == "prefill"

    async def half(name, port):  # one lookup failing changes nothing: the other pool is not emptied
        if name == "prefill":
            raise OSError("timeout")
        return pools[name]

    assert not await discover_once(gw, gw.config.discovery, half)
    assert len(gw.prefill_names) == 2 and all(r.draining_since is None for r in gw.replicas.values())
