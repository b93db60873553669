"""The gateway's long-lived state (``prefix_router/gateway.py``): its membership as discovery or
the health checks change it. A replica found joins the ring after its first health check and
scrape; one gone drains, then is forgotten with its metric series; one back while draining keeps
its shadow index; static replicas never drain. Requests through a whole gateway:
``tests/e2e/test_gateway.py``."""

from __future__ import annotations

from prometheus_client import generate_latest

from prefix_router.cache.blocks import BlockHash
from prefix_router.config import DiscoveryConfig, GatewayConfig, HealthConfig, ReplicaConfig
from prefix_router.fleet.replicas import apply_health, apply_metrics
from prefix_router.gateway import Gateway


PAGE = ('vllm:num_requests_waiting{engine="0"} 0\nvllm:prefix_cache_queries_total{engine="0"} 0\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n')


def gateway(drain_s: float = 30.0, static: tuple[str, ...] = ()) -> Gateway:
    config = GatewayConfig(replicas=tuple(ReplicaConfig(url=u) for u in static),
                           discovery=DiscoveryConfig(dns="vllm.test", drain_s=drain_s))
    return Gateway(config, None)


def test_a_found_replica_joins_the_ring_only_after_its_first_health_check_and_scrape():
    gw = gateway()
    added, drained = gw.apply_discovery(["http://10.0.0.1:8000"], now=0.0)
    assert (added, drained) == (["10.0.0.1:8000"], [])
    replica = gw.replicas["10.0.0.1:8000"]
    assert replica.discovered and not replica.routable and "10.0.0.1:8000" not in gw.ring.nodes
    apply_health(replica, True, HealthConfig())
    gw.sync_ring()
    assert not replica.routable and "10.0.0.1:8000" not in gw.ring.nodes
    apply_metrics(replica, PAGE)
    gw.sync_ring()
    assert replica.routable and "10.0.0.1:8000" in gw.ring.nodes
    assert replica.num_gpu_blocks == 100  # read from the scrape


def scraped(gw: Gateway, *urls: str) -> None:
    gw.apply_discovery(urls, now=0.0)
    for r in gw.replicas.values():
        apply_health(r, True, HealthConfig())
        apply_metrics(r, PAGE)
    gw.sync_ring()


def test_a_replica_gone_from_dns_drains_then_is_forgotten_with_its_metric_series():
    gw = gateway(drain_s=30.0)
    scraped(gw, "http://10.0.0.1:8000", "http://10.0.0.2:8000")
    gone = gw.replicas["10.0.0.2:8000"]
    gw.metrics.requests.labels("10.0.0.2:8000", "affinity", "200").inc()
    gw.metrics.spillovers.labels("10.0.0.1:8000", "10.0.0.2:8000").inc()
    gone.inflight = 1  # a stream still running on it

    assert gw.apply_discovery(["http://10.0.0.1:8000"], now=100.0) == ([], ["10.0.0.2:8000"])
    assert not gone.routable and "10.0.0.2:8000" not in gw.ring.nodes  # no new requests at once
    assert gw.forget_drained(now=129.0) == []  # within drain_s
    assert gw.forget_drained(now=200.0) == []  # past it, but a request is still in flight
    gone.inflight = 0
    assert gw.forget_drained(now=200.0) == ["10.0.0.2:8000"]
    assert "10.0.0.2:8000" not in gw.replicas
    page = generate_latest(gw.metrics.registry).decode()
    assert "10.0.0.2:8000" not in page
    assert "10.0.0.1:8000" in page  # the other replica's series stay


def test_a_replica_back_in_dns_while_draining_keeps_its_shadow_index():
    gw = gateway()
    scraped(gw, "http://10.0.0.1:8000")
    replica = gw.replicas["10.0.0.1:8000"]
    replica.shadow.insert([BlockHash(i) for i in range(1, 6)])
    gw.apply_discovery([], now=10.0)
    assert not replica.routable
    gw.apply_discovery(["http://10.0.0.1:8000"], now=12.0)
    gw.sync_ring()
    assert replica.routable and len(replica.shadow) == 5 and gw.replicas["10.0.0.1:8000"] is replica


def test_static_replicas_are_never_drained_by_discovery():
    gw = gateway(static=("http://static:8000",))
    scraped(gw)  # checked and scraped: on the ring
    gw.apply_discovery([], now=0.0)
    assert gw.forget_drained(now=1e9) == []
    assert gw.replicas["static:8000"].routable


def test_a_replica_whose_engine_uses_another_block_size_is_named_once_with_the_fix(caplog):
    """routing.block_size 16 against an engine started with --block-size 32 (vLLM's CPU build
    refuses 16): no block the gateway predicts is one the engine caches, so it says so."""
    from prefix_router.config import RoutingConfig

    config = GatewayConfig(replicas=(ReplicaConfig(url="http://a:1"), ReplicaConfig(url="http://b:1")),
                           routing=RoutingConfig(block_size=16))
    gw = Gateway(config, None)
    for replica, size in zip(gw.replicas.values(), (16, 32)):
        apply_health(replica, True, HealthConfig())
        apply_metrics(replica, PAGE.replace('block_size="16"', f'block_size="{size}"'))
    with caplog.at_level("WARNING", logger="prefix_router.gateway"):
        gw.sync_ring()
        gw.sync_ring()
    warned = [r.getMessage() for r in caplog.records if "--block-size" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("replica b:1:")
    assert "blocks of 32 tokens" in warned[0] and "hashes blocks of 16" in warned[0] and "routing.block_size" in warned[0]
