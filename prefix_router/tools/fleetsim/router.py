"""The gateway's routing in virtual time: what a request meets when the fleet simulator sends it.

Only the clock is the simulator's. The policies are the ones that ship (``routing/policy.py``,
``routing/baselines.py``), reading the same state: each replica's ``ReplicaState``
(``fleet/replicas.py``), its shadow index in one ``BlockTree``, ``BranchStats`` and
``PrefixDemand``. What ``serve/forward.py``'s ``InFlight`` counts when a request is sent, when its
first token comes and when it ends, and what ``serve/learning.py`` adds to the shadow index
afterwards, is counted here at the simulator's times; a scrape sets a replica's queue as
``fleet/replicas.apply_metrics`` does from ``/metrics``. With ``kv_events``, routing reads each
replica's ``EngineView``, fed by its engine's events (``events.py``), where a prompt is cut into
token blocks, as ``ReplicaState.cache_index`` reads a fresh stream's view.

The peers' policies it plays beside this gateway's are in ``peers.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.cache.tree import BlockTree
from prefix_router.config import ReplicaConfig, RoutingConfig
from prefix_router.fleet.replicas import ReplicaState
from prefix_router.prompts.analysis import PromptInfo
from prefix_router.routing.bounds import ReplicaView
from prefix_router.routing.decision import Decision
from prefix_router.routing.policy import make_policy
from prefix_router.routing.prefix_stats import BranchStats, PrefixDemand
from prefix_router.routing.ring import Ring
from prefix_router.tools.fleetsim.events import EventFeed
from prefix_router.tools.fleetsim.peers import CacheAwarePolicy, ConsistentHashPolicy, KvCostPolicy, SessionHashPolicy

__all__ = ["POLICIES", "Sent", "SimRouter"]

# the policies ``prefix-router fleetsim`` compares, by the name its ``--policy`` takes
POLICIES = ("prefix-router", "round-robin", "least-loaded", "consistent-hash", "vllm-router-consistent-hash",
            "sglang-cache-aware", "dynamo-kv")
_CONFIG_NAMES = {"prefix-router": "prefix-affinity", "round-robin": "round-robin", "least-loaded": "least-loaded"}


@functools.lru_cache(maxsize=4)
def _ring(names: tuple[str, ...], virtual_nodes: int) -> Ring:
    """One ring of ``names``, shared by the runs of a fleet: nothing routing does changes it."""
    return Ring.of(names, virtual_nodes)


@dataclass(slots=True)
class Sent:
    """One request on its replica, as ``InFlight`` counts it: the prompt blocks it queues for
    prefill until its first token, and the scrape epoch it was sent in."""

    replica: ReplicaState
    info: PromptInfo
    decision: Decision
    prefill: int
    epoch: int
    view: EngineView | None = None  # the engine's view told of its blocks (``note_routed``), if routed by one


class SimRouter:
    """One gateway instance in front of ``names``, each replica holding ``capacity`` blocks of
    ``block_size`` tokens. ``policy``: one of ``POLICIES``. ``kv_events``: this instance follows
    each replica's KV events (``feeds``, given them by the simulator). Times are the simulator's
    seconds."""

    def __init__(self, names: Sequence[str], policy: str, *, block_size: int, capacity: int,
                 routing: RoutingConfig | None = None, kv_events: bool = False) -> None:
        self.active: dict[str, int] = dict.fromkeys(names, 0)  # blocks of the requests in flight on each
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.routing = routing or RoutingConfig()
        self.block_size = block_size
        self.ring = _ring(tuple(names), self.routing.virtual_nodes)
        self.tree = BlockTree()
        self.branches = BranchStats(self.routing.branch_threshold)
        self.demand = PrefixDemand(self.routing.share_half_life_s)
        self.replicas: dict[str, ReplicaState] = {}
        for name in names:
            self.replicas[name] = ReplicaState(ReplicaConfig(url=f"http://{name}"), name, healthy=True, recovering=False,
                                               block_size=block_size, num_gpu_blocks=capacity,
                                               shadow=ShadowIndex(capacity, self.tree))
        if policy == "consistent-hash":
            self.policy = ConsistentHashPolicy(self.ring, block_size)
        elif policy == "vllm-router-consistent-hash":
            self.policy = SessionHashPolicy(self.ring)
        elif policy == "sglang-cache-aware":
            self.policy = CacheAwarePolicy(self.replicas, block_size)
        elif policy == "dynamo-kv":
            self.policy = KvCostPolicy(self.active)
        else:
            config = replace(self.routing, policy=_CONFIG_NAMES[policy])
            self.policy = make_policy(config, self.ring, self.branches, self.demand)
        self.sent_to: dict[str, int] = dict.fromkeys(names, 0)
        holders = EngineMap() if kv_events else None
        self.feeds = {n: EventFeed(block_size, capacity, holders) for n in names} if kv_events else {}

    def send(self, info: PromptInfo, session: str | None, now: float) -> Sent:
        """Choose a replica for the request (``proxy.choose``) and count it there (``InFlight.acquire``)."""
        return self.acquire(info, self.choose(info, session, now), now)

    def choose(self, info: PromptInfo, session: str | None, now: float) -> Decision:
        """The policy's choice for the request, nothing counted yet."""
        half_life = self.routing.share_half_life_s
        feeds = self.feeds if info.exact else {}
        views = {n: ReplicaView(n, r.routing_load, feeds[n].view if n in feeds else r.shadow,
                                r.recent_share(now, half_life), r.prefill_blocks, n in feeds)
                 for n, r in self.replicas.items()}
        cap = max((info.num_units - 1) // self.block_size, 0)
        return self.policy.select(info.hashes, info.full_hash, views, session, cap, info.first_turn)

    def acquire(self, info: PromptInfo, decision: Decision, now: float) -> Sent:
        """Count the request on the replica ``decision`` chose (``InFlight.acquire``)."""
        half_life = self.routing.share_half_life_s
        feeds = self.feeds if info.exact else {}
        self.branches.record(info.hashes, self.routing.max_key_blocks)
        self.demand.record(info.hashes, self.routing.max_key_blocks, now)
        r = self.replicas[decision.replica]
        r.note_sent(now, half_life)
        r.sent_since_scrape += 1
        r.inflight += 1
        prefill = max(-(-info.num_units // self.block_size) - decision.predicted_blocks, 0)
        r.prefill_blocks += prefill
        r.shadow.insert(info.hashes)
        self.sent_to[r.name] += 1
        self.active[r.name] += len(info.hashes)
        view = feeds[r.name].view if r.name in feeds else None
        if view is not None:
            view.note_routed(info.hashes)
        return Sent(r, info, decision, prefill, r.scrape_epoch, view)

    @staticmethod
    def first_token(sent: Sent) -> None:
        """Its first token came: its prompt no longer queues for prefill (``InFlight.prefilled``)."""
        sent.replica.prefill_blocks -= sent.prefill
        sent.prefill = 0

    def finished(self, sent: Sent, completion_tokens: int, now: float) -> None:
        """It ended, served (``InFlight.release``), and its output's blocks join the shadow index
        (``learning.learn``)."""
        r = sent.replica
        self.active[r.name] -= len(sent.info.hashes)
        if sent.view is not None:
            sent.view.release_routed(sent.info.hashes, now, served=True)
        if r.scrape_epoch == sent.epoch:
            r.sent_since_scrape = max(r.sent_since_scrape - 1, 0)
        r.inflight -= 1
        self.first_token(sent)
        r.shadow.add_output(completion_tokens // self.block_size, sent.info.hashes)

    @staticmethod
    def scraped(replica: ReplicaState, waiting: int, running: int) -> None:
        """A ``/metrics`` scrape read these queue lengths (``apply_metrics``)."""
        replica.waiting, replica.running = waiting, running
        replica.others = max(waiting + running - replica.inflight, 0)
        replica.sent_since_scrape = 0
        replica.scrape_epoch += 1
