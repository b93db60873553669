"""The gateway's long-lived state, built once per process in ``app.create_app``.

Holds the replicas, the ring, the policy, the branch statistics, the conversation memory, the
metrics, the optional request log, the tokenizer, the shared HTTP client pool and the worker
threads for tokenization.
Shadow indexes, load counts and conversation memory are per gateway instance: several instances
place a request none of them knows anything of on the same replica (the ring and the key are
deterministic; a chat's key, its opening, needs no learning), but each learns cached prefixes,
the branch points of completion prompts and the histories only from the requests it sees.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import aiohttp

from prefix_router.fleet.admission import Admission
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.tree import BlockTree
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.fleet.breaker import CircuitBreaker
from prefix_router.misses.diagnosis import Change
from prefix_router.misses.change_sites import ChangeSites
from prefix_router.config import GatewayConfig, ReplicaConfig
from prefix_router.constants import VLLM_BLOCK_SIZE
from prefix_router.misses.classify import Conversations
from prefix_router.prompts.anthropic import merges_inline_system
from prefix_router.routing.prefix_stats import BranchStats, PrefixDemand
from prefix_router.metrics import GatewayMetrics
from prefix_router.routing.policy import make_policy
from prefix_router.prompts.analysis import PromptInfo
from prefix_router.fleet.replicas import DEFAULT_CAPACITY_BLOCKS, ReplicaState, read_models, servers
from prefix_router.misses.request_log import RequestLog
from prefix_router.fleet.response_homes import ResponseHomes
from prefix_router.routing.ring import Ring
from prefix_router.fleet.tenants import Tenants
from prefix_router.prompts.tokenizer import PromptTokenizer

__all__ = ["Gateway", "members", "replica_name"]

log = logging.getLogger(__name__)



def _describe_events(r: ReplicaState) -> dict | None:
    """A replica's KV events in ``/replicas``; None when it publishes none."""
    s = r.stream
    if s is None:
        return None
    return {"endpoint": s.endpoint, "replay_endpoint": s.replay_endpoint, "routing_by_events": s.fresh,
            "stale_reason": s.stale_reason or None, "batches": s.batches, "events": s.events,
            "last_seq": s.last_seq, "gaps_repaired": s.gaps_repaired, "gaps_lost": s.gaps_lost,
            "restarts": s.restarts, "undecodable": s.undecodable, "blocks": len(s.view),
            "offload": {m: {"blocks": len(t), "placeholders": t.opaque} for m, t in s.view.offload.items()} or None,
            "orphan_blocks": s.view.orphans, "parity_matches": r.parity_ok, "parity_mismatches": r.parity_mismatch,
            "parity_hint": r.parity_hint or None}


def replica_name(url: str) -> str:
    """A replica's label: host:port of its URL (bounded by the configuration)."""
    parts = urlsplit(url)
    return parts.netloc or url


def members(rc: ReplicaConfig) -> list[tuple[str, int | None]]:
    """(name, data-parallel rank) of each replica a server is: itself (rank None), or each of its
    ``data_parallel_size`` ranks, ``host:port@rank`` (an engine with its own prefix cache, reached
    with the ``X-data-parallel-rank`` header)."""
    base = replica_name(rc.url)
    if rc.data_parallel_size == 1:
        return [(base, None)]
    return [(f"{base}@{rank}", rank) for rank in range(rc.data_parallel_size)]


class Gateway:
    """Everything a request handler needs; no module globals."""

    def __init__(self, config: GatewayConfig, tokenizer: PromptTokenizer | None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)  # how vLLM reads /v1/messages' system turns
        self.merge_inline_system = template is not None and merges_inline_system(template)
        self.metrics = metrics or GatewayMetrics()
        self.ring = Ring(config.routing.virtual_nodes)
        self.branches = BranchStats(config.routing.branch_threshold, config.index.max_branch_blocks)
        self.demand = PrefixDemand(config.routing.share_half_life_s, config.index.max_branch_blocks)
        # each worker process is an instance of its own, with its own picture
        self.routing = replace(config.routing, sole_router=False) if config.workers > 1 else config.routing
        self.policy = make_policy(self.routing, self.ring, self.branches, self.demand)
        self.conversations = Conversations(config.index.max_conversations)
        self.response_homes = ResponseHomes(config.index.max_responses, config.index.response_history_mb * 1_000_000)
        # the fleet's picture in one structure each, so a prompt is matched in one walk: the shadow
        # indexes' guesses in one tree (cache/tree.py), the engines' views built from KV events in
        # one map (cache/engine_map.py)
        self.shadow_holders, self.engine_holders = BlockTree(), EngineMap()
        self.replicas: dict[str, ReplicaState] = {}
        # the prefill pool of a disaggregated fleet (replicas[].role prefill); empty: not disaggregated
        self.prefill_names: frozenset[str] = frozenset()
        for rc in config.replicas:
            self.add_replica(rc)
        self.sync_ring()  # every replica starts healthy, so on the ring
        self.changes = ChangeSites(config.changes.max_sites)
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.http: aiohttp.ClientSession | None = None
        self._models_read_at = float("-inf")  # refresh_models: when it last looked, and the look on its way
        self._models_reading: asyncio.Future | None = None
        self._exported: dict[str, dict[str, int]] = {}  # per replica: event counters exported so far
        self._warned_block_size: dict[str, int] = {}  # per replica: the mismatched block size warned of
        self.request_log = RequestLog(config.request_log, config.request_log_blocks) if config.request_log else None
        # request-log lines waiting for their events, each with its writer (serve/learning.py)
        self.waiting_lines: dict[asyncio.Task, Callable[[], None]] = {}
        self.admission = Admission(config.admission, self.saturated)
        self.tenants = Tenants(config.auth)
        self.metrics.admission_waiting.set_function(lambda: len(self.admission))

    def saturated(self) -> bool:
        """Every routable replica saturated (False with none: that is answered 503 at once).

        A replica is saturated when its engine reported requests waiting at the last scrape and
        its load (that queue plus requests sent since) is at or above ``admission.saturated_depth``.
        The first condition keeps a burst to replicas that run everything they get (vLLM runs
        up to ``max_num_seqs`` at once) from being held here until the next scrape.
        """
        depth = self.config.admission.saturated_depth
        now = time.monotonic()
        found = False
        for r in self.replicas.values():  # asked for every request: the first free replica ends it
            if r.routable_at(now):
                if r.waiting <= 0 or r.load < depth:
                    return False
                found = True
        return found

    def add_replica(self, rc: ReplicaConfig, *, discovered: bool = False) -> ReplicaState:
        """Know a replica: a server, or each data-parallel rank of one (``members``; the first
        rank's state is returned). A discovered one joins the ring after its first ``/metrics``
        scrape (``recovering``), which also reads its block size and capacity."""
        states = [self._add_member(rc, name, rank, discovered) for name, rank in members(rc)]
        return states[0]

    def _add_member(self, rc: ReplicaConfig, name: str, rank: int | None, discovered: bool) -> ReplicaState:
        state = ReplicaState(rc, name, block_size=rc.block_size, num_gpu_blocks=rc.num_gpu_blocks,
                             discovered=discovered, recovering=discovered,
                             breaker=CircuitBreaker(self.config.breaker),
                             shadow=ShadowIndex(DEFAULT_CAPACITY_BLOCKS, self.shadow_holders), rank=rank)
        self.replicas[name] = state
        if rc.role == "prefill":
            self.prefill_names = self.prefill_names | {name}
        return state

    def apply_discovery(self, found: Iterable[str] | Mapping[str, str | ReplicaConfig],
                        now: float) -> tuple[list[str], list[str]]:
        """Make the discovered replicas the servers in ``found``: base URLs, or base URLs to their
        role or to their whole ``ReplicaConfig`` (role, data-parallel size, KV-event publisher, as
        pod annotations give them); ``now``: monotonic seconds.

        Each server is its members (``members``: one, or one per data-parallel rank). New members
        are added; a discovered member missing from ``found`` (its server gone, or now running
        fewer ranks) starts draining (off the ring, forgotten by ``forget_drained``); a draining
        one that is back stops draining and keeps its shadow index; one whose server's
        configuration changed (its role, say) takes it. Static replicas are never touched.
        Returns (added, drained) names.
        """
        specs = found if isinstance(found, Mapping) else dict.fromkeys(found, "both")
        wanted: dict[str, tuple[ReplicaConfig, int | None]] = {}
        for url, spec in specs.items():
            rc = spec if isinstance(spec, ReplicaConfig) else ReplicaConfig(url=url, role=spec)
            wanted.update((name, (rc, rank)) for name, rank in members(rc))
        added, drained = [], []
        for name, (rc, rank) in wanted.items():
            replica = self.replicas.get(name)
            if replica is None:
                self._add_member(rc, name, rank, discovered=True)
                added.append(name)
                continue
            if replica.draining_since is not None:
                replica.draining_since = None
            if replica.discovered and replica.config != rc:
                replica.config = rc
                self.prefill_names = (self.prefill_names | {name} if rc.role == "prefill"
                                      else self.prefill_names - {name})
        for name, replica in self.replicas.items():
            if replica.discovered and name not in wanted and replica.draining_since is None:
                replica.draining_since = now
                drained.append(name)
        if added or drained:
            self.sync_ring()
        return added, drained

    def forget_drained(self, now: float) -> list[str]:
        """Drop replicas that left discovery at least ``discovery.drain_s`` ago and have nothing
        in flight: their state and their metric series. Returns their names."""
        drain_s = self.config.discovery.drain_s
        gone = [name for name, r in self.replicas.items()
                if r.draining_since is not None and now - r.draining_since >= drain_s and r.inflight == 0]
        for name in gone:
            log.info("replica %s: drained and forgotten (left discovery %.0f s ago)", name,
                     now - self.replicas[name].draining_since)
            self.replicas.pop(name).close()
            self.prefill_names = self.prefill_names - {name}
            self.ring.remove(name)
            self.metrics.forget_replica(name)
            self._exported.pop(name, None)
            self._warned_block_size.pop(name, None)
        return gone

    @property
    def block_size(self) -> int:
        """Tokens per block for hashing: configured, else the first replica's reported size."""
        if self.config.routing.block_size:
            return self.config.routing.block_size
        for replica in self.replicas.values():
            if replica.block_size:
                return replica.block_size
        return VLLM_BLOCK_SIZE

    def unit_block_size(self, info: PromptInfo) -> int:
        """Units per block for this prompt: tokens with a tokenizer, characters without."""
        return self.block_size if info.exact else self.config.routing.char_block_size

    def max_hit_blocks(self, info: PromptInfo) -> int:
        """Blocks the engine can hit at most: never the last prompt token (vLLM's cap)."""
        return max((info.num_units - 1) // self.unit_block_size(info), 0)

    def sync_ring(self) -> None:
        """Routable replicas on the ring (``ReplicaState.routable``), the others off; export
        health and queue depth; size each shadow index (``index.max_blocks_per_replica``, else
        the replica's num_gpu_blocks)."""
        for replica in self.replicas.values():
            if replica.routable:
                self.ring.add(replica.name, replica.config.weight)
            else:
                self.ring.remove(replica.name)
            self.metrics.healthy.labels(replica.name).set(1 if replica.healthy else 0)
            self.metrics.breaker_state.labels(replica.name).set(replica.breaker.state(time.monotonic()))
            self.metrics.queue_depth.labels(replica.name).set(replica.load)
            capacity = self.config.index.max_blocks_per_replica or replica.num_gpu_blocks
            if capacity and replica.shadow.capacity != capacity:
                replica.shadow.resize(capacity)
            reported = replica.reported_block_size
            if reported and reported != self.block_size and reported != self._warned_block_size.get(replica.name):
                self._warned_block_size[replica.name] = reported  # once per replica and size
                log.warning("replica %s: its engine uses blocks of %d tokens (--block-size), the gateway hashes "
                            "blocks of %d (%s): no block the gateway predicts is one the engine caches; set "
                            "routing.block_size to the replicas' --block-size, the same on every replica",
                            replica.name, reported, self.block_size,
                            "routing.block_size" if self.config.routing.block_size else "another replica's")

    def export_event_metrics(self) -> None:
        """Bring the KV event metrics up to each stream's counters (``prefix_router/fleet/kv_follower.py``)."""
        m = self.metrics
        for replica in self.replicas.values():
            stream = replica.stream
            if stream is None:
                continue
            exported = self._exported.setdefault(replica.name, {})
            for metric, labels, value in ((m.kv_events, (replica.name,), stream.events),
                                          (m.kv_gaps, (replica.name, "repaired"), stream.gaps_repaired),
                                          (m.kv_gaps, (replica.name, "lost"), stream.gaps_lost)):
                key = labels[-1] if len(labels) > 1 else "events"
                if value > exported.get(key, 0):
                    metric.labels(*labels).inc(value - exported.get(key, 0))
                exported[key] = value
            m.kv_view_fresh.labels(replica.name).set(1 if stream.fresh else 0)
            m.kv_view_blocks.labels(replica.name).set(len(stream.view))

    def record_change(self, change: Change, block: int, token_position: int, lost_tokens: int,
                      excerpt: str | None) -> None:
        """Count a client's prefix change at ``block`` (the gateway's block index where the
        prompts diverged, ``token_position`` in tokens): its cause's metrics and its site (bounded)."""
        self.metrics.changed.labels(change.cause.value).inc()
        self.metrics.changed_lost_tokens.labels(change.cause.value).inc(lost_tokens)
        self.changes.record(change, token_position, lost_tokens, excerpt, block=block)

    def serving(self, model) -> frozenset[str] | None:
        """The routable replicas whose ``/v1/models`` lists ``model`` (a served model name or a
        LoRA adapter), or has not been read yet (such a replica answers for itself): None when
        no model is named (vLLM serves its first), else the names, empty when no routable
        replica may serve it (``model_known`` tells a model served by a replica that is down)."""
        if not isinstance(model, str) or not model:  # vLLM serves its first model for "" too
            return None
        now = time.monotonic()
        return frozenset([r.name for r in self.replicas.values()
                          if (not r.models or model in r.models) and r.routable_at(now)])

    async def refresh_models(self, min_interval_s: float = 1.0) -> None:
        """Read every routable replica's ``/v1/models`` now, at most once per ``min_interval_s``:
        a request naming a model no replica listed at the last scrape may name an adapter loaded
        since (``vllm serve --enable-lora`` with ``/v1/load_lora_adapter``)."""
        if self._models_reading is not None:  # one is on its way: its answer is the one to wait for
            await asyncio.shield(self._models_reading)
            return
        now = time.monotonic()
        if now - self._models_read_at < min_interval_s or self.http is None:
            return
        self._models_read_at = now
        self._models_reading = asyncio.ensure_future(
            asyncio.gather(*(read_models(self.http, server, 2.0)
                              for server in servers(r for r in self.replicas.values() if r.routable))))
        try:
            await asyncio.shield(self._models_reading)
        finally:
            self._models_reading = None

    def model_known(self, model: str) -> bool:
        """Whether any replica, routable or not, listed ``model``."""
        return any(model in r.models for r in self.replicas.values())

    def describe(self) -> dict:
        """The ``/replicas`` view."""
        shares = self.ring.shares()
        return {
            "policy": self.config.routing.policy,
            "block_size": self.block_size,
            "routing": "exact token blocks" if self.tokenizer is not None else
                       f"approximate: {self.config.routing.char_block_size}-character blocks (no tokenizer configured)",
            "replicas": [{
                "name": r.name, "url": r.url, "role": r.config.role, "rank": r.rank, "healthy": r.healthy, "routable": r.routable,
                "discovered": r.discovered, "draining": r.draining_since is not None, "queue_depth": r.load,
                "waiting": r.waiting, "running": r.running, "inflight": r.inflight,
                "breaker": r.breaker.state(time.monotonic()).name.lower(),
                "block_size": r.block_size, "num_gpu_blocks": r.num_gpu_blocks,
                "capacity_tokens": (r.num_gpu_blocks - 1) * r.block_size if r.num_gpu_blocks and r.block_size else None,
                "ring_share": round(shares.get(r.name, 0.0), 4), "shadow_blocks": len(r.shadow),
                "prompt_tokens": r.prompt_tokens,
                "hit_rate": round(r.cached_tokens / r.prompt_tokens, 4) if r.prompt_tokens else None,
                "predicted_hit_rate": round(r.predicted_tokens / r.prompt_tokens, 4) if r.prompt_tokens else None,
                "models": r.models, "last_failure": r.last_failure or None, "kv_events": _describe_events(r),
            } for r in self.replicas.values()],
            "change_sites": [{"cause": s.cause.value, "message_index": s.message_index, "role": s.role,
                              "token_position": s.token_position, "count": s.count, "lost_tokens": s.lost_tokens}
                             for s in sorted(self.changes.sites.values(), key=lambda s: -s.count)[:10]],
            "branch_blocks": len(self.branches),
            "demand_blocks": len(self.demand),
            "conversations": len(self.conversations),
        }
