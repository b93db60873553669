"""The gateway's view of each vLLM replica: health, load, cache shape, and the pollers keeping it.

Health: ``GET /health`` every ``health.interval_s``. A replica joins the ring once it has passed
a health check and a ``/metrics`` scrape since the gateway started (or found it), so ``/ready``
says 200 only when something can be served; ``unhealthy_after`` consecutive failures take it
off the ring, ``healthy_after`` successes bring it back after its next scrape. A replica whose ``vllm:prefix_cache_queries_total`` went down (or is back
at zero after a failure while the gateway believed it held blocks) restarted with an empty
cache: its shadow index is cleared, so its misses are not blamed on clients. One
that only answered slowly (a busy engine can miss a 1 s health check) keeps its index: clearing
it on every recovery would send its conversations elsewhere and call its hits unpredicted.

Load: ``GET /metrics`` every ``scrape.interval_s`` reads ``vllm:num_requests_waiting`` and
``vllm:num_requests_running``; a replica idle at its last scrape is scraped every
``scrape.idle_interval_s`` only where this gateway is the only router, and every round of
probes is spread over its interval (``spread``). The routing bound compares ``routing_load``:
this gateway's requests in flight, counted the moment each is sent, plus what the engine
reported beyond them at the last scrape (other gateway instances). Admission compares ``load``:
the engine's queue plus requests sent since the scrape and still in flight
(``sent_since_scrape``), so a burst is seen at once and finished requests do not linger as
load. ``vllm:cache_config_info`` gives ``block_size`` and ``num_gpu_blocks`` (the shadow
index's capacity, applied by ``Gateway.sync_ring``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp

from prefix_router.routing.bounds import SHARE_DIGITS
from prefix_router.fleet.breaker import CircuitBreaker
from prefix_router.config import BreakerConfig, HealthConfig, ReplicaConfig
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.stream import EventStream

__all__ = ["ReplicaState", "parse_engine_metrics", "check_once", "check_all", "apply_health", "apply_metrics", "poll_health",
           "scrape_once", "poll_metrics", "servers", "spread"]

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")

# groups a round of probes is started in, evenly over its interval (``spread``): a tenth of a
# second apart at the default scrape interval, few enough wakeups to cost nothing
SPREAD_SLICES = 10

DEFAULT_CAPACITY_BLOCKS = 28_000  # prefix_router/tools/sim/config.py: an H100 80 GB serving an 8B model
# Only the samples the gateway reads, found by one regex scan of the page in C: a vLLM page runs
# to hundreds of lines of histograms, and a Python loop over its lines was a quarter of an idle
# gateway's CPU at 256 replicas (bench/results/fleet-cost/)
_SAMPLE = re.compile(r'^(vllm:(?:num_requests_waiting|num_requests_running|prefix_cache_queries_total'
                     r'|prefix_cache_hits_total|cache_config_info))(\{[^}\n]*\})? ([0-9.eE+-]+|NaN|\+Inf)\r?$',
                     re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(slots=True)
class ReplicaState:
    """One replica as the gateway sees it."""

    config: ReplicaConfig
    name: str
    healthy: bool = False  # passed its last health checks; False until the first one passes
    waiting: int = 0  # vllm:num_requests_waiting at the last scrape
    running: int = 0
    sent_since_scrape: int = 0  # requests sent since the last scrape and still in flight
    scrape_epoch: int = 0  # counts scrapes, so a finishing request knows if it was counted
    inflight: int = 0  # this gateway's requests on the replica now
    # blocks (a character block counting as one) of the prompts this gateway sent it that it has
    # not cached as predicted and has not prefilled yet: until a stream's first data event, or the
    # end of an answer sent in one body (its first token comes with its last)
    prefill_blocks: int = 0
    # requests the engine ran or queued at the last scrape beyond this gateway's own then:
    # what other gateway instances (or clients going around the gateway) put on it
    others: int = 0
    recent: float = 0.0  # requests sent, decayed with routing.share_half_life_s (``note_sent``)
    recent_at: float = 0.0  # monotonic seconds of the last update of ``recent``
    block_size: int | None = None  # from cache_config_info or the configuration
    reported_block_size: int | None = None  # cache_config_info's, whatever the configuration says
    num_gpu_blocks: int | None = None
    models: list[str] = field(default_factory=list)
    models_read_at: float = -math.inf  # monotonic seconds of the last read of /v1/models
    scraped_at: float = -math.inf  # monotonic seconds of the last scrape applied (``apply_metrics``)
    queries_total: float = 0.0  # last vllm:prefix_cache_queries_total, to spot restarts
    failures: int = 0
    successes: int = 0
    # off the ring until a scrape: a new replica's first, or one that tells a restart from a stall
    recovering: bool = True
    last_failure: str = ""  # why the last health check failed, e.g. "HTTP 404 from http://r:8000/health"
    ever_healthy: bool = False  # passed a health check since the gateway knew it
    discovered: bool = False  # found by DNS (prefix_router/fleet/discovery.py), not listed in the configuration
    draining_since: float | None = None  # monotonic time it left DNS; off the ring from then on
    shadow: ShadowIndex = field(default_factory=lambda: ShadowIndex(DEFAULT_CAPACITY_BLOCKS))
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(BreakerConfig()))
    stream: EventStream | None = None  # its KV events, when it publishes them (prefix_router/fleet/kv_follower.py)
    parity_ok: int = 0  # requests whose prompt blocks its events showed
    parity_mismatch: int = 0  # ... and never showed
    parity_hint: str = ""  # the likely cause of the last mismatch
    rank: int | None = None  # its data-parallel rank on a server of several (ReplicaConfig.data_parallel_size)
    missing_rank: bool = False  # a rank its server's /metrics does not report (``apply_metrics``)
    # prompt tokens of the requests this gateway saw answered here, those the engine reported
    # cached, those the gateway predicted cached (serve/learning.py): its token hit rate in /replicas
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def routable(self) -> bool:
        """On the ring: healthy, past the restart check that follows a recovery (or a new
        replica's first scrape), not draining, and its circuit breaker lets requests through."""
        return self.routable_at(time.monotonic())

    @property
    def idle(self) -> bool:
        """Healthy, past its restart check, nothing running or queued at the last scrape and
        nothing sent since: where this gateway is the only router, nothing has loaded it since
        (``poll_metrics``)."""
        return (self.inflight == 0 and self.sent_since_scrape == 0 and self.waiting == 0 and self.running == 0
                and self.healthy and not self.recovering)

    def routable_at(self, now: float) -> bool:
        """``routable`` at ``now`` (monotonic s): one clock read serves a pass over the fleet."""
        return (self.healthy and not self.recovering and self.draining_since is None
                and (self.breaker.opened_at is None or self.breaker.allows(now)))

    @property
    def load(self) -> int:
        """Queue depth at the last scrape plus requests sent since: what the policy compares."""
        return self.waiting + self.sent_since_scrape

    @property
    def routing_load(self) -> int:
        """What the load bound compares (``bounds.load_bound``): this gateway's requests in flight,
        counted the moment each is sent, plus the other requests the engine reported at the last
        scrape. Running requests count as well as queued ones: a replica decoding many streams
        prefills a new prompt more slowly (vLLM batches both into every step)."""
        return self.inflight + self.others

    def recent_share(self, now: float, half_life_s: float) -> float:
        """Requests sent to this replica lately: each counts 1 when sent and half as much every
        ``half_life_s`` seconds after (``now``: monotonic seconds). Rounded to ``SHARE_DIGITS``
        places, so that replicas sent equally many requests tie (``prefix_router/routing/bounds.py``)."""
        return round(self.recent * 0.5 ** ((now - self.recent_at) / half_life_s), SHARE_DIGITS)

    def note_sent(self, now: float, half_life_s: float) -> None:
        """Count one request sent now in ``recent``."""
        self.recent = self.recent_share(now, half_life_s) + 1.0
        self.recent_at = now

    def cache_index(self, exact: bool) -> ShadowIndex | EngineView:
        """What routing reads of this replica's cache: its engine's events while they are fresh
        and the prompt was cut into token blocks (``exact``), else the shadow index."""
        stream = self.stream
        return stream.view if exact and stream is not None and stream.fresh else self.shadow

    def close(self) -> None:
        """The replica is forgotten: its indexes leave the fleet's maps (``cache/holders.py``)."""
        self.shadow.close()
        if self.stream is not None:
            self.stream.view.close()

    def reset_cache_view(self, reason: str) -> None:
        """Forget what the replica held: it restarted with an empty cache (``reason`` says how we know)."""
        log.info("replica %s: %s; clearing its cache view", self.name, reason)
        self.shadow.clear()
        if self.stream is not None:
            self.stream.reset()  # the new process publishes from an empty cache, counting from 0


def parse_engine_metrics(text: str, engine: str | None = None) -> dict:
    """The few vLLM metrics the gateway reads, summed over label sets (those of ``engine`` only
    where given: a data-parallel rank's, vLLM labelling each engine's series ``engine="N"``);
    cache_config labels."""
    out: dict = {}
    wanted = None if engine is None else f'engine="{engine}"'
    for name, labels, value in _SAMPLE.findall(text):
        if name == "vllm:cache_config_info":
            out["cache_config"] = dict(_LABEL.findall(labels))
        elif wanted is None or wanted in labels:
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def check_once(http: aiohttp.ClientSession, replica: ReplicaState, timeout_s: float) -> bool:
    """One ``GET /health``; on failure ``replica.last_failure`` says what happened."""
    url = replica.url + "/health"
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status == 200:
                return True
            replica.last_failure = f"HTTP {resp.status} from {url}"
    except asyncio.TimeoutError:
        replica.last_failure = f"no answer from {url} within {timeout_s:g} s"
    except (aiohttp.ClientError, OSError) as exc:
        replica.last_failure = f"{url}: {exc}"
    return False


def apply_health(replica: ReplicaState, ok: bool, config: HealthConfig) -> None:
    """Count a check result and flip ``healthy``: at once on the first check that passes, then
    at the configured thresholds. Logs every change."""
    if ok:
        first = not replica.ever_healthy
        replica.ever_healthy = True
        replica.failures, replica.successes = 0, replica.successes + 1
        if not replica.healthy and (first or replica.successes >= config.healthy_after):
            replica.healthy = True
            if not first:
                replica.recovering = True  # the next scrape compares its counters (scrape_once)
            log.info("replica %s passes health checks%s; %s", replica.name, "" if first else " again",
                     "on the ring after its next scrape" if replica.recovering else "on the ring")
        return
    replica.successes, replica.failures = 0, replica.failures + 1
    if replica.failures == 1 and not replica.ever_healthy:
        log.warning("replica %s: not serving yet (%s)", replica.name, replica.last_failure)
    if replica.healthy and replica.failures >= config.unhealthy_after:
        replica.healthy = False
        log.warning("replica %s failed %d health checks (last: %s); off the ring", replica.name,
                    replica.failures, replica.last_failure)


async def spread(replicas: list[U], interval_s: float, probe: Callable[[U], Awaitable[T]]) -> list[T]:
    """``probe`` every one of ``replicas`` (replicas, or servers: ``servers``), started in ``SPREAD_SLICES`` groups evenly over
    ``interval_s`` rather than all at once, then every answer, in their order. 256 replicas
    probed in one burst put 256 requests, and their answers, between two client requests: a
    stall of the event loop the requests behind it wait out."""
    slices = max(1, min(SPREAD_SLICES, len(replicas)))
    loop = asyncio.get_running_loop()
    started = loop.time()
    tasks = []
    try:
        for k in range(slices):
            delay = started + k * interval_s / slices - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks += [asyncio.ensure_future(probe(r)) for r in replicas[k::slices]]
        results = await asyncio.gather(*tasks)
    except BaseException:  # cancelled (the gateway stops): no probe outlives the round
        for task in tasks:
            task.cancel()
        raise
    order = [r for k in range(slices) for r in replicas[k::slices]]
    by_replica = dict(zip(map(id, order), results))
    return [by_replica[id(r)] for r in replicas]


def servers(replicas: Iterable[ReplicaState]) -> list[list[ReplicaState]]:
    """``replicas`` grouped by server (URL), in their order: a server's data-parallel ranks are
    one group, sharing its ``/health``, ``/metrics`` and ``/v1/models``, fetched once for all."""
    groups: dict[str, list[ReplicaState]] = {}
    for replica in replicas:
        groups.setdefault(replica.url, []).append(replica)
    return list(groups.values())


async def check_all(http: aiohttp.ClientSession, replicas: list[ReplicaState], config: HealthConfig,
                    interval_s: float = 0.0) -> None:
    """One health check of each server among ``replicas`` (``servers``), spread over
    ``interval_s`` (0: at once), applied to each of its ranks (``apply_health``) as it answers:
    a failure counts at once, not at the round's end."""
    async def probe(group: list[ReplicaState]) -> None:
        ok = await check_once(http, group[0], config.timeout_s)
        for replica in group:
            if not ok:
                replica.last_failure = group[0].last_failure
            apply_health(replica, ok, config)
    await spread(servers(replicas), interval_s, probe)


async def poll_health(http: aiohttp.ClientSession, replicas: Mapping[str, ReplicaState], config: HealthConfig,
                      models_interval_s: float = 0.0) -> None:
    """Check every replica's /health every ``config.interval_s`` forever, the checks of a round
    spread over the interval (``spread``); the mapping is read anew each round, so replicas added
    or dropped by discovery are followed."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        current = list(replicas.values())
        await check_all(http, current, config, config.interval_s)
        # a replica that just passed waits for a scrape to join the ring: scrape it now, not at
        # the next round of poll_metrics
        joining = servers(r for r in current if r.healthy and r.recovering)
        await asyncio.gather(*(scrape_once(http, g, max(config.timeout_s, 1.0), models_interval_s) for g in joining))
        await asyncio.sleep(max(0.0, started + config.interval_s - loop.time()))


async def scrape_once(http: aiohttp.ClientSession, server: list[ReplicaState], timeout_s: float,
                      models_interval_s: float = 0.0) -> bool:
    """Read one server's /metrics, and its /v1/models when last read ``models_interval_s`` ago
    or more, into the state of each of ``server``'s replicas (its ranks, or itself: one
    ``servers`` group); False when /metrics did not answer. The models are read again and
    again, so LoRA adapters loaded or unloaded at run time (``/v1/load_lora_adapter``: vLLM
    lists each adapter as a model) are followed; a failed read keeps the list from before."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with http.get(server[0].url + "/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                return False
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return False
    for replica in server:
        apply_metrics(replica, text)
    if time.monotonic() - server[0].models_read_at >= models_interval_s:
        await read_models(http, server, timeout_s)
    return True


async def read_models(http: aiohttp.ClientSession, server: list[ReplicaState], timeout_s: float) -> None:
    """One server's ``/v1/models`` ids into ``models`` of each of its replicas (unchanged when it
    fails, and asked again at the next scrape)."""
    try:
        async with http.get(server[0].url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            models = [m["id"] for m in (await resp.json()).get("data", [])] if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, TypeError, AttributeError):
        models = None
    if models is None:
        return
    for replica in server:
        replica.models_read_at = time.monotonic()
        if models != replica.models:
            if replica.models:
                log.info("replica %s now serves %s (was %s)", replica.name, ", ".join(models) or "nothing",
                         ", ".join(replica.models))
            replica.models = models


def apply_metrics(replica: ReplicaState, text: str) -> None:
    """Take load, cache shape and the restart check from one /metrics page (Prometheus text): a
    data-parallel rank's own series where the replica is one."""
    engine = None if replica.rank is None else str(replica.rank)
    metrics = parse_engine_metrics(text, engine)
    if engine is not None and "vllm:num_requests_running" not in metrics and "vllm:num_requests_running{" in text:
        # the server labels its engines' series and none is this rank: it runs fewer ranks than
        # configured (vLLM answers 400 to a rank out of range), so this one stays off the ring
        if not replica.missing_rank:
            log.warning("replica %s: its server reports no engine %s (fewer data-parallel ranks than "
                        "configured); off the ring", replica.name, engine)
        replica.missing_rank, replica.recovering = True, True
        replica.last_failure = f"the server's /metrics has no engine=\"{engine}\""
        return
    replica.missing_rank = False
    replica.waiting = int(metrics.get("vllm:num_requests_waiting", 0))
    replica.running = int(metrics.get("vllm:num_requests_running", 0))
    replica.others = max(replica.waiting + replica.running - replica.inflight, 0)
    replica.sent_since_scrape = 0
    replica.scrape_epoch += 1
    replica.scraped_at = time.monotonic()
    queries = metrics.get("vllm:prefix_cache_queries_total", 0.0)
    if queries < replica.queries_total:
        replica.reset_cache_view("prefix cache counters went back (restarted)")
    elif replica.recovering and queries == 0 and len(replica.shadow):
        # Down before any scrape saw its counters move, and none since: a new process.
        replica.reset_cache_view("back with no prefix cache queries at all (restarted)")
    replica.queries_total = queries
    if replica.recovering and replica.healthy:
        log.info("replica %s on the ring", replica.name)
    replica.recovering = False
    cache = metrics.get("cache_config", {})
    if _digits(cache.get("block_size", "")):
        replica.reported_block_size = int(cache["block_size"])
        if replica.config.block_size is None:
            replica.block_size = replica.reported_block_size
    if replica.config.num_gpu_blocks is None and _digits(cache.get("num_gpu_blocks", "")):
        replica.num_gpu_blocks = int(cache["num_gpu_blocks"])


async def poll_metrics(http: aiohttp.ClientSession, replicas: Mapping[str, ReplicaState], interval_s: float,
                       models_interval_s: float = 0.0, idle_interval_s: float = 0.0) -> None:
    """Scrape every replica's /metrics every ``interval_s`` forever, the scrapes of a round spread
    over the interval (``spread``; the mapping is read anew each round), starting one interval
    from now: the gateway scraped them all as it started. A replica ``idle`` at its last scrape
    is scraped every ``idle_interval_s`` only (the caller passes ``interval_s`` or less where
    other routers may load it); its ``/v1/models`` is still read every ``models_interval_s``."""
    loop = asyncio.get_running_loop()
    timeout_s = max(interval_s, 1.0)

    async def probe(server: list[ReplicaState]) -> None:
        if not all(r.idle for r in server) or time.monotonic() - server[0].scraped_at >= idle_interval_s:
            await scrape_once(http, server, timeout_s, models_interval_s)
        else:  # an idle server between its scrapes: its model list keeps its own interval
            await read_models(http, server, timeout_s)

    await asyncio.sleep(interval_s)
    while True:
        started = loop.time()
        now = time.monotonic()
        due = [r for r in replicas.values() if not r.idle or now - r.scraped_at >= idle_interval_s
               or now - r.models_read_at >= models_interval_s]
        await spread(servers(due), interval_s, probe)
        await asyncio.sleep(max(0.0, started + interval_s - loop.time()))


def _digits(value: str) -> bool:
    """Whether ``value`` is a non-negative integer in ASCII digits (``str.isdigit`` also takes
    '²', which ``int`` refuses)."""
    return value.isascii() and value.isdigit()
