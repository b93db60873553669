"""The baselines the prefix-affinity rule is judged against: round-robin and least-loaded.

They ignore prefixes when choosing, but report what each replica was believed to hold, so their
misses are classified like the gateway's (``misses/classify.py``) and a benchmark can say what
they threw away.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.holders import match_all
from prefix_router.routing.prefix_stats import BranchStats
from prefix_router.config import RoutingConfig
from prefix_router.routing.bounds import ReplicaView
from prefix_router.routing.decision import Decision, Route, routing_key

__all__ = ["RoundRobinPolicy", "LeastLoadedPolicy"]


class _Baseline:
    """Shared by the baselines: they ignore prefixes when choosing, but still report what
    replicas were believed to hold, so their misses are classified like the gateway's."""

    def __init__(self, config: RoutingConfig, branches: BranchStats) -> None:
        self.config = config
        self.branches = branches

    def order(self, replicas: Mapping[str, ReplicaView]) -> list[str]:
        raise NotImplementedError

    def select(self, hashes: Sequence[BlockHash], full_hash: int, replicas: Mapping[str, ReplicaView],
               session_key: str | None = None, max_hit_blocks: int | None = None,
               first_turn: bool | None = None) -> Decision:
        """The first replica of ``order``; raises LookupError when ``replicas`` is empty."""
        if not replicas:
            raise LookupError("no healthy replica")
        order = self.order(replicas)
        cap = len(hashes) if max_hit_blocks is None else max_hit_blocks
        matches = match_all(hashes, {n: v.shadow for n, v in replicas.items()}, cap)
        best = max(order, key=lambda n: matches[n])
        depth, key = routing_key(self.branches, self.config.max_key_blocks, hashes, full_hash, session_key)
        return Decision(order[0], Route.FALLBACK, predicted_blocks=matches[order[0]],
                        best_blocks=matches[best], best_replica=best, key_depth=depth, key=key, matches=matches)


class RoundRobinPolicy(_Baseline):
    """Baseline: each request to the next replica in turn, ignoring prefixes and load."""

    def __init__(self, config: RoutingConfig, branches: BranchStats) -> None:
        super().__init__(config, branches)
        # a turn of its own for each set of replicas chosen among: a disaggregated fleet's two
        # pools, chosen in alternation, would otherwise each see every other count only
        self._counters: dict[frozenset[str], itertools.count] = {}

    def order(self, replicas: Mapping[str, ReplicaView]) -> list[str]:
        names = sorted(replicas)
        key = frozenset(names)
        if key not in self._counters and len(self._counters) >= 64:  # sets change with health: keep few
            self._counters.clear()
        start = next(self._counters.setdefault(key, itertools.count())) % len(names)
        return names[start:] + names[:start]


class LeastLoadedPolicy(_Baseline):
    """Baseline: the replica with the lowest load, ignoring prefixes."""

    def order(self, replicas: Mapping[str, ReplicaView]) -> list[str]:
        return sorted(replicas, key=lambda n: (replicas[n].load, n))
