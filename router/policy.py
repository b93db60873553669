"""Routing policies: pure, synchronous choices of a replica for one request.

``PrefixAffinityPolicy.select`` in order:

1. Routing key: the session key when the caller gives one (a client's session id, or a chat's
   opening, ``PromptInfo.opening``); otherwise the request's block chain up to
   ``BranchStats.key_depth`` blocks (past prefixes shared by many conversations, through the
   first block specific to this one). The key's owner on the ring
   is the affinity replica; the rest of the ring, in order, are the spill candidates.
2. History: if a replica already holds more of this prompt than the key covers (its shadow
   index matches at least ``key_depth`` blocks, and past the point where this prompt parted
   from every other prompt seen, ``BranchStats.parted_depth``) and is not overloaded, it wins
   (``sticky``): a session that spilled keeps its history where it went.
3. Load: a replica is overloaded when its load (queue depth at the last scrape plus requests
   sent since) is at or above ``spill_queue_depth``, or above ``load_factor`` x mean load + 1
   while at least half that depth (``_overloaded``).
   Walk the ring from the owner to the first replica that is not (``affinity`` when that is the
   owner, ``spill`` otherwise); when all are, take the least loaded (``fallback``).

The policy does no I/O and records nothing: it returns a ``Decision``; the proxy acts on it and
counts it. ``RoundRobinPolicy`` and ``LeastLoadedPolicy`` are the baselines to compare with.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from .blocks import BlockHash
from .config import RoutingConfig
from .index import BranchStats, ShadowIndex
from .ring import Ring

__all__ = ["Route", "ReplicaView", "Decision", "PrefixAffinityPolicy", "RoundRobinPolicy",
           "LeastLoadedPolicy", "make_policy"]


class Route(str, enum.Enum):
    """Which branch chose the replica (the ``route`` label of ``prefix_router_requests_total``)."""

    AFFINITY = "affinity"  # the ring's owner of the routing key
    SPILL = "spill"  # a later ring replica: the owner was overloaded
    STICKY = "sticky"  # the replica already holding this prompt's history
    FALLBACK = "fallback"  # everything overloaded (least loaded), or a baseline policy


@dataclass(slots=True)
class ReplicaView:
    """What a policy may know of one routable (healthy) replica."""

    name: str
    load: int  # queue depth at the last scrape + requests sent since
    shadow: ShadowIndex


@dataclass(slots=True)
class Decision:
    """A routing choice. Block counts are in the gateway's block size."""

    replica: str
    route: Route
    candidates: list[str]  # replica first, then the ring order for retries
    predicted_blocks: int = 0  # blocks the chosen replica is believed to hold
    best_blocks: int = 0  # most blocks any replica is believed to hold
    best_replica: str | None = None
    key_depth: int = 0
    key: str = ""  # the ring key
    held_blocks: int = 0  # blocks the chosen replica held now or lately (set by the proxy)
    spilled_from: str | None = None  # the ring owner, when the route is spill
    matches: dict[str, int] = field(default_factory=dict)


def routing_key(branches: BranchStats, max_key_blocks: int, hashes: Sequence[BlockHash], full_hash: int,
                session_key: str | None) -> tuple[int, str]:
    """(key depth in blocks, ring key): the session key when given, else the hash of the block
    at the key depth, else (a prompt ending inside a shared prefix) the whole prompt's hash."""
    depth = branches.key_depth(hashes, max_key_blocks)
    if session_key is not None:  # hashed: any length, any characters (a header may carry lone surrogates)
        return depth, "s:" + xxhash.xxh3_64_hexdigest(session_key.encode("utf-8", "surrogatepass"))
    if depth <= len(hashes):
        return depth, f"b:{hashes[depth - 1]:016x}"
    return depth, f"p:{full_hash:016x}"


def _overloaded(load: int, mean: float, config: RoutingConfig) -> bool:
    """At or above the spill queue depth; or above ``load_factor`` x mean + 1 with at least half
    that depth queued. The floor keeps the relative rule from firing on noise: with a fleet
    mostly idle, two requests in flight exceed 1.5 x mean + 1, and each such spill recomputes a
    conversation elsewhere (measured on the full Mooncake trace, 8 replicas: 585 spills and 93.7%
    of the pooled-cache bound with the bare rule, 96.9% with no spill at all). SGLang's router
    likewise balances only past both a relative and an absolute threshold."""
    if load >= config.spill_queue_depth:
        return True
    return 2 * load >= config.spill_queue_depth and load > config.load_factor * mean + 1


class PrefixAffinityPolicy:
    """Consistent hashing on the prefix key, bounded by load, with sticky history."""

    def __init__(self, config: RoutingConfig, ring: Ring, branches: BranchStats) -> None:
        self.config = config
        self.ring = ring
        self.branches = branches

    def select(self, hashes: Sequence[BlockHash], full_hash: int, replicas: Mapping[str, ReplicaView],
               session_key: str | None = None, max_hit_blocks: int | None = None) -> Decision:
        """Choose among ``replicas`` (healthy ones) for a prompt with these block hashes.

        ``full_hash``: a hash of the whole prompt, partial last block included (the key when the
        prompt ends inside a shared prefix). ``max_hit_blocks``: the engine never hits the last
        token, so at most ``(num_tokens - 1) // block_size`` blocks. Raises LookupError when
        ``replicas`` is empty.
        """
        if not replicas:
            raise LookupError("no healthy replica")
        cfg = self.config
        cap = len(hashes) if max_hit_blocks is None else max_hit_blocks
        depth, key = routing_key(self.branches, cfg.max_key_blocks, hashes, full_hash, session_key)
        order = [n for n in self.ring.candidates(key) if n in replicas] or sorted(replicas)
        matches = {n: min(v.shadow.match(hashes), cap) for n, v in replicas.items()}
        mean = sum(v.load for v in replicas.values()) / len(replicas)
        fits = {n for n, v in replicas.items() if not _overloaded(v.load, mean, cfg)}
        best = max(order, key=lambda n: matches[n])  # ties: earliest in ring order
        owner = order[0]
        # Sticky only for history this conversation alone sent: past the key depth and past where
        # it parted from every prompt seen before. Without the second bound, a session key's
        # first request would follow a shared system prompt to whichever replica computed it
        # first (the branch is "shared" only after ``branch_threshold`` conversations).
        own = max(depth, self.branches.parted_depth(hashes, cfg.max_key_blocks)) if matches[best] >= depth else depth
        if best in fits and matches[best] >= own and matches[best] > matches[owner]:
            replica, route = best, Route.STICKY
        elif owner in fits:
            replica, route = owner, Route.AFFINITY
        else:
            # Spill to the replica that holds most of this prompt (ties: ring order), so the
            # overflow of one hot prefix lands where earlier overflow already computed it;
            # with nothing cached anywhere that is the next replica on the ring.
            spill = [n for n in order if n in fits]
            if spill:
                replica, route = max(spill, key=lambda n: matches[n]), Route.SPILL
            else:
                replica, route = min(order, key=lambda n: replicas[n].load), Route.FALLBACK
        return Decision(replica, route, [replica] + [n for n in order if n != replica],
                        predicted_blocks=matches[replica], best_blocks=matches[best], best_replica=best,
                        key_depth=depth, key=key, spilled_from=owner if route is Route.SPILL else None, matches=matches)


class _Baseline:
    """Shared by the baselines: they ignore prefixes when choosing, but still report what
    replicas were believed to hold, so their misses are classified like the gateway's."""

    def __init__(self, config: RoutingConfig, branches: BranchStats) -> None:
        self.config = config
        self.branches = branches

    def order(self, replicas: Mapping[str, ReplicaView]) -> list[str]:
        raise NotImplementedError

    def select(self, hashes, full_hash, replicas, session_key=None, max_hit_blocks=None) -> Decision:
        if not replicas:
            raise LookupError("no healthy replica")
        order = self.order(replicas)
        cap = len(hashes) if max_hit_blocks is None else max_hit_blocks
        matches = {n: min(v.shadow.match(hashes), cap) for n, v in replicas.items()}
        best = max(order, key=lambda n: matches[n])
        depth, key = routing_key(self.branches, self.config.max_key_blocks, hashes, full_hash, session_key)
        return Decision(order[0], Route.FALLBACK, order, predicted_blocks=matches[order[0]],
                        best_blocks=matches[best], best_replica=best, key_depth=depth, key=key, matches=matches)


class RoundRobinPolicy(_Baseline):
    """Baseline: each request to the next replica in turn, ignoring prefixes and load."""

    def __init__(self, config: RoutingConfig, branches: BranchStats) -> None:
        super().__init__(config, branches)
        self._counter = itertools.count()

    def order(self, replicas):
        names = sorted(replicas)
        start = next(self._counter) % len(names)
        return names[start:] + names[:start]


class LeastLoadedPolicy(_Baseline):
    """Baseline: the replica with the lowest load, ignoring prefixes."""

    def order(self, replicas):
        return sorted(replicas, key=lambda n: (replicas[n].load, n))


def make_policy(config: RoutingConfig, ring: Ring, branches: BranchStats):
    """The policy the configuration names."""
    if config.policy == "round-robin":
        return RoundRobinPolicy(config, branches)
    if config.policy == "least-loaded":
        return LeastLoadedPolicy(config, branches)
    return PrefixAffinityPolicy(config, ring, branches)
