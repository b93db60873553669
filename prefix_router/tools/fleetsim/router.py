"""The gateway's routing in virtual time: what a request meets when the fleet simulator sends it.

Only the clock is the simulator's. The policies are the ones that ship (``routing/policy.py``,
``routing/baselines.py``), reading the same state: each replica's ``ReplicaState``
(``fleet/replicas.py``), its shadow index in one ``BlockTree``, ``BranchStats`` and
``PrefixDemand``. What ``serve/forward.py``'s ``InFlight`` counts when a request is sent, when its
first token comes and when it ends, and what ``serve/learning.py`` adds to the shadow index
afterwards, is counted here at the simulator's times; a scrape sets a replica's queue as
``fleet/replicas.apply_metrics`` does from ``/metrics``.

``ConsistentHashPolicy`` models the peers' consistent hashing with bounded loads, keyed by a
prompt's first 256 tokens (vllm-router's ``consistent_hash``, SGLang's ``prefix_hash``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.holders import match_all
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.cache.tree import BlockTree
from prefix_router.config import ReplicaConfig, RoutingConfig
from prefix_router.fleet.replicas import ReplicaState
from prefix_router.prompts.analysis import PromptInfo
from prefix_router.routing.bounds import ReplicaView
from prefix_router.routing.decision import Decision, Route
from prefix_router.routing.policy import make_policy
from prefix_router.routing.prefix_stats import BranchStats, PrefixDemand
from prefix_router.routing.ring import Ring

__all__ = ["POLICIES", "ConsistentHashPolicy", "Sent", "SimRouter"]

# the policies ``prefix-router fleetsim`` compares, by the name its ``--policy`` takes
POLICIES = ("prefix-router", "round-robin", "least-loaded", "consistent-hash")
_CONFIG_NAMES = {"prefix-router": "prefix-affinity", "round-robin": "round-robin", "least-loaded": "least-loaded"}


@functools.lru_cache(maxsize=4)
def _ring(names: tuple[str, ...], virtual_nodes: int) -> Ring:
    """One ring of ``names``, shared by the runs of a fleet: nothing routing does changes it."""
    return Ring.of(names, virtual_nodes)


class ConsistentHashPolicy:
    """Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018): the ring
    position of the prompt's first ``key_tokens`` tokens (its block of that depth), then the first
    replica along the ring whose requests in flight are below ``(1 + epsilon)`` times the mean
    (counting this one), so no replica takes more than that share. vllm-router's and SGLang's
    gateways hash a prompt's leading text the same way; ``epsilon`` 0.25 is the paper's example."""

    def __init__(self, ring: Ring, block_size: int, key_tokens: int = 256, epsilon: float = 0.25) -> None:
        self.ring = ring
        self.key_blocks = max(key_tokens // block_size, 1)
        self.epsilon = epsilon

    def select(self, hashes: Sequence[BlockHash], full_hash: int, replicas: Mapping[str, ReplicaView],
               session_key: str | None = None, max_hit_blocks: int | None = None,
               first_turn: bool | None = None) -> Decision:
        if not replicas:
            raise LookupError("no healthy replica")
        key = f"b:{hashes[self.key_blocks - 1]:016x}" if len(hashes) >= self.key_blocks else f"p:{full_hash:016x}"
        order = [n for n in self.ring.candidates(key) if n in replicas] or sorted(replicas)
        bound = math.ceil((1 + self.epsilon) * (sum(v.load for v in replicas.values()) + 1) / len(replicas))
        chosen = next((n for n in order if replicas[n].load < bound), order[0])
        cap = len(hashes) if max_hit_blocks is None else max_hit_blocks
        matches = match_all(hashes, {n: v.shadow for n, v in replicas.items()}, cap)
        best = max(order, key=matches.__getitem__)
        return Decision(chosen, Route.AFFINITY if chosen == order[0] else Route.SPILL,
                        predicted_blocks=matches[chosen], best_blocks=matches[best], best_replica=best,
                        key=key, matches=matches, spilled_from=None if chosen == order[0] else order[0])


@dataclass(slots=True)
class Sent:
    """One request on its replica, as ``InFlight`` counts it: the prompt blocks it queues for
    prefill until its first token, and the scrape epoch it was sent in."""

    replica: ReplicaState
    info: PromptInfo
    decision: Decision
    prefill: int
    epoch: int


class SimRouter:
    """One gateway instance in front of ``names``, each replica holding ``capacity`` blocks of
    ``block_size`` tokens. ``policy``: one of ``POLICIES``. Times are the simulator's seconds."""

    def __init__(self, names: Sequence[str], policy: str, *, block_size: int, capacity: int,
                 routing: RoutingConfig | None = None) -> None:
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
        else:
            config = replace(self.routing, policy=_CONFIG_NAMES[policy])
            self.policy = make_policy(config, self.ring, self.branches, self.demand)
        self.sent_to: dict[str, int] = dict.fromkeys(names, 0)

    def send(self, info: PromptInfo, session: str | None, now: float) -> Sent:
        """Choose a replica for the request (``proxy.choose``) and count it there (``InFlight.acquire``)."""
        half_life = self.routing.share_half_life_s
        views = {n: ReplicaView(n, r.routing_load, r.shadow, r.recent_share(now, half_life), r.prefill_blocks)
                 for n, r in self.replicas.items()}
        cap = max((info.num_units - 1) // self.block_size, 0)
        decision = self.policy.select(info.hashes, info.full_hash, views, session, cap, info.first_turn)
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
        return Sent(r, info, decision, prefill, r.scrape_epoch)

    @staticmethod
    def first_token(sent: Sent) -> None:
        """Its first token came: its prompt no longer queues for prefill (``InFlight.prefilled``)."""
        sent.replica.prefill_blocks -= sent.prefill
        sent.prefill = 0

    def finished(self, sent: Sent, completion_tokens: int) -> None:
        """It ended, served (``InFlight.release``), and its output's blocks join the shadow index
        (``learning.learn``)."""
        r = sent.replica
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
