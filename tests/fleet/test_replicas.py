"""A replica's health and restart state (``prefix_router/fleet/replicas.py``): a stall is not a restart."""

from __future__ import annotations

import asyncio

import pytest

from prefix_router.cache.blocks import BlockHash
from prefix_router.config import HealthConfig, ReplicaConfig
from prefix_router.fleet.replicas import ReplicaState, apply_health, apply_metrics

HEALTH = HealthConfig(unhealthy_after=2, healthy_after=1)


def page(queries: float, waiting: int = 0) -> str:
    """A /metrics page as vLLM writes it, with the lines the gateway reads."""
    return (f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
            f'vllm:num_requests_running{{engine="0",model_name="m"}} 0\n'
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n')


def replica_with_history() -> ReplicaState:
    replica = ReplicaState(ReplicaConfig(url="http://r:8000"), "r:8000")
    apply_health(replica, True, HEALTH)
    apply_metrics(replica, page(500))
    replica.shadow.insert([BlockHash(i) for i in range(1, 11)])
    return replica


def fail_then_recover(replica: ReplicaState) -> None:
    for _ in range(HEALTH.unhealthy_after):
        apply_health(replica, False, HEALTH)
    assert not replica.healthy and not replica.routable
    apply_health(replica, True, HEALTH)
    assert replica.healthy
    assert not replica.routable, "back on the ring before its counters were checked"


@pytest.mark.parametrize("scrape_first", [False, True], ids=["check-then-scrape", "scrape-then-check"])
def test_a_new_replica_joins_the_ring_once_it_passed_a_health_check_and_a_scrape(scrape_first):
    replica = ReplicaState(ReplicaConfig(url="http://r:8000"), "r:8000")
    assert not replica.routable  # nothing known of it yet: not on the ring, so /ready is not 200
    first, second = ((lambda: apply_metrics(replica, page(0))), (lambda: apply_health(replica, True, HEALTH)))
    if not scrape_first:
        first, second = second, first
    first()
    assert not replica.routable
    second()
    assert replica.routable


def test_a_new_replica_that_fails_its_first_checks_stays_off_the_ring_until_one_passes():
    replica = ReplicaState(ReplicaConfig(url="http://r:8000"), "r:8000")
    apply_metrics(replica, page(0))
    for _ in range(3):
        apply_health(replica, False, HEALTH)
        assert not replica.routable
    apply_health(replica, True, HEALTH)  # healthy_after=1
    apply_metrics(replica, page(0))
    assert replica.routable


@pytest.mark.parametrize(("queries_after", "blocks_kept"), [
    (800, 10),  # counters kept growing: the same process, only slow; its cache is intact
    (0, 0),  # counters started again: a new process with an empty cache
])
def test_after_a_recovery_only_counters_that_went_back_clear_the_shadow_index(queries_after, blocks_kept):
    replica = replica_with_history()
    fail_then_recover(replica)
    apply_metrics(replica, page(queries_after))
    assert replica.routable
    assert len(replica.shadow) == blocks_kept


def test_a_restart_seen_only_by_the_metrics_clears_the_index_without_a_health_failure():
    replica = replica_with_history()
    apply_metrics(replica, page(20))
    assert replica.routable and len(replica.shadow) == 0
    assert replica.block_size == 16 and replica.num_gpu_blocks == 100


def test_a_replica_back_with_zero_counters_restarted_even_if_no_scrape_saw_them_move():
    replica = ReplicaState(ReplicaConfig(url="http://r:8000"), "r:8000")
    apply_health(replica, True, HEALTH)
    apply_metrics(replica, page(0))
    replica.shadow.insert([BlockHash(i) for i in range(1, 11)])  # routed to it, then it died
    fail_then_recover(replica)
    apply_metrics(replica, page(0))
    assert replica.routable and len(replica.shadow) == 0


def test_recent_requests_count_one_each_and_halve_every_half_life():
    from prefix_router.config import ReplicaConfig
    from prefix_router.fleet.replicas import ReplicaState

    replica = ReplicaState(ReplicaConfig(url="http://r:8000"), "r:8000")
    replica.note_sent(100.0, 60.0)
    replica.note_sent(100.0, 60.0)
    assert replica.recent_share(100.0, 60.0) == 2.0
    assert replica.recent_share(160.0, 60.0) == 1.0
    replica.note_sent(220.0, 60.0)  # 2 halved twice, plus this one
    assert replica.recent_share(220.0, 60.0) == 1.5


def test_replicas_sent_as_many_requests_at_different_moments_tie_where_shares_never_decay():
    """A half-life of 1e9 s (tests of several instances) still weighs requests seconds apart a
    hair apart; the policy breaks ties of recent share by ring position, so equal counts must
    compare equal (``prefix_router/routing/bounds.py``, ``SHARE_DIGITS``)."""
    from prefix_router.config import ReplicaConfig
    from prefix_router.fleet.replicas import ReplicaState

    early, late = (ReplicaState(ReplicaConfig(url=f"http://{n}:8000"), f"{n}:8000") for n in "ab")
    for t in (0.0, 1.0, 2.0):
        early.note_sent(t, 1e9)
        late.note_sent(t + 0.37, 1e9)
    assert 3.0 * 0.5 ** (2.37 / 1e9) != 3.0  # the noise the tie must survive
    assert early.recent_share(5.0, 1e9) == late.recent_share(5.0, 1e9) == 3.0


# --- polling -------------------------------------------------------------------------------

async def test_a_round_of_probes_is_spread_over_its_interval_and_answers_in_the_replicas_order():
    import asyncio

    from prefix_router.fleet.replicas import SPREAD_SLICES, spread

    replicas = [ReplicaState(ReplicaConfig(url=f"http://r{i}:8000"), f"r{i}:8000") for i in range(25)]
    loop = asyncio.get_running_loop()
    started: dict[str, float] = {}

    async def probe(replica: ReplicaState) -> str:
        started[replica.name] = loop.time()
        return replica.name

    t0 = loop.time()
    assert await spread(replicas, 0.5, probe) == [r.name for r in replicas]
    times = sorted(started.values())
    assert times[-1] - t0 >= 0.5 * (SPREAD_SLICES - 1) / SPREAD_SLICES  # the last group a slice before the end
    assert sum(1 for t in times if t - t0 < 0.05) <= -(-len(replicas) // SPREAD_SLICES)  # one group at first
    assert await spread(replicas[:3], 0.0, probe) == [r.name for r in replicas[:3]]  # 0: all at once


async def test_a_scrape_reads_the_models_only_once_their_interval_has_passed(aiohttp_server):
    import aiohttp
    from aiohttp import web

    from prefix_router.fleet.replicas import scrape_once

    reads = []

    async def models(request):
        reads.append(1)
        return web.json_response({"data": [{"id": "m"}]})

    async def metrics(request):
        return web.Response(text=page(1))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    replica = ReplicaState(ReplicaConfig(url=str(server.make_url("")).rstrip("/")), "r")
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            assert await scrape_once(http, [replica], 2.0, models_interval_s=3600.0)
        assert replica.models == ["m"] and len(reads) == 1  # the first scrape reads them, the next two not
        assert await scrape_once(http, [replica], 2.0, models_interval_s=0.0)
        assert len(reads) == 2


def test_the_metrics_read_are_summed_over_engines_and_their_neighbours_are_left_alone():
    from prefix_router.fleet.replicas import parse_engine_metrics

    page = ("# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\r\n'  # a CRLF page too
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n'  # not the same metric
            "vllm:num_requests_running 1\n"
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 7e3\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="100",prefix_caching_hash_algo="sha256"} 1.0\n'
            'vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 4.0\n')
    assert parse_engine_metrics(page) == {
        "vllm:num_requests_waiting": 5.0, "vllm:num_requests_running": 1.0, "vllm:prefix_cache_queries_total": 7000.0,
        "cache_config": {"block_size": "16", "num_gpu_blocks": "100", "prefix_caching_hash_algo": "sha256"}}


async def test_a_replica_idle_at_its_last_scrape_waits_the_idle_interval_and_a_busy_one_does_not(aiohttp_server):
    import asyncio

    import aiohttp
    from aiohttp import web

    from prefix_router.fleet.replicas import poll_metrics

    scrapes = {"idle": 0, "busy": 0}
    model_reads = {"idle": 0, "busy": 0}

    def replica_app(name: str) -> web.Application:
        async def metrics(request):
            scrapes[name] += 1
            return web.Response(text=page(1))

        async def models(request):
            model_reads[name] += 1
            return web.json_response({"data": [{"id": "m"}]})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        return app

    replicas = {}
    for name in scrapes:
        server = await aiohttp_server(replica_app(name))
        replica = ReplicaState(ReplicaConfig(url=str(server.make_url("")).rstrip("/")), name)
        apply_health(replica, True, HEALTH)
        apply_metrics(replica, page(1))  # the scrape at start: an empty engine
        replicas[name] = replica
    replicas["busy"].inflight = 1  # a request of this gateway's on it
    assert replicas["idle"].idle and not replicas["busy"].idle
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(poll_metrics(http, replicas, 0.05, models_interval_s=0.1, idle_interval_s=3600.0))
        await asyncio.sleep(0.4)
        task.cancel()
    assert scrapes["idle"] == 0 and scrapes["busy"] >= 3, scrapes
    assert model_reads["idle"] >= 2, model_reads  # an adapter unloaded from an idle replica is still seen


async def test_a_round_cancelled_midway_leaves_no_probe_running():
    import asyncio

    from prefix_router.fleet.replicas import spread

    replicas = [ReplicaState(ReplicaConfig(url=f"http://r{i}:8000"), f"r{i}:8000") for i in range(20)]
    running: set[str] = set()

    async def probe(replica: ReplicaState) -> None:
        running.add(replica.name)
        try:
            await asyncio.sleep(10)
        finally:
            running.discard(replica.name)

    task = asyncio.create_task(spread(replicas, 1.0, probe))
    await asyncio.sleep(0.25)  # a few groups started, the rest not yet
    assert 0 < len(running) < len(replicas)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert not running


async def test_a_failed_health_check_counts_as_it_answers_not_at_the_end_of_the_round():
    import asyncio

    import aiohttp

    from prefix_router.fleet.replicas import check_all

    # nothing listens on port 1: every check fails at once; 20 replicas spread over 1 s
    replicas = [ReplicaState(ReplicaConfig(url=f"http://127.0.0.1:1/r{i}"), f"r{i}") for i in range(20)]
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(check_all(http, replicas, HEALTH, interval_s=1.0))
        await asyncio.sleep(0.3)
        assert replicas[0].failures == 1 and replicas[-1].failures == 0  # the first group's, counted already
        await task
    assert all(r.failures == 1 for r in replicas)


async def test_a_servers_ranks_share_one_health_check_and_one_scrape_a_round(aiohttp_server):
    import collections

    import aiohttp
    from aiohttp import web

    from prefix_router.fleet.replicas import check_all, poll_metrics, servers

    hits = collections.Counter()

    async def answer(request):
        hits[request.path] += 1
        if request.path == "/metrics":
            return web.Response(text="".join(f'vllm:num_requests_waiting{{engine="{r}",model_name="m"}} {r}\n'
                                             f'vllm:num_requests_running{{engine="{r}",model_name="m"}} 0\n' for r in range(4)))
        return web.json_response({"data": [{"id": "m"}]}) if request.path == "/v1/models" else web.Response()

    app = web.Application()
    app.router.add_get("/{path:.*}", answer)
    server = await aiohttp_server(app)
    rc = ReplicaConfig(url=str(server.make_url("")).rstrip("/"), data_parallel_size=4)
    ranks = [ReplicaState(rc, f"r@{r}", rank=r) for r in range(4)]
    other = ReplicaState(ReplicaConfig(url="http://127.0.0.1:9"), "gone")
    assert servers([ranks[0], other, *ranks[1:]]) == [ranks, [other]]
    async with aiohttp.ClientSession() as http:
        await check_all(http, ranks, HEALTH)
        assert hits["/health"] == 1 and all(r.healthy for r in ranks)
        task = asyncio.ensure_future(poll_metrics(http, {r.name: r for r in ranks}, 0.05))
        await asyncio.sleep(0.08)  # one round
        task.cancel()
    assert hits["/metrics"] == 1 and hits["/v1/models"] == 1
    assert [r.waiting for r in ranks] == [0, 1, 2, 3]  # each its own engine's series
    assert all(r.models == ["m"] for r in ranks)
