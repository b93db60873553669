"""The load bound of the routing policy: consistent hashing with bounded loads.

A replica may take a request while its load after taking it is at most
``ceil(max(load_factor x mean, mean + slack))``, the mean counting the new request (Mirrokni et
al., "Consistent Hashing with Bounded Loads", SODA 2018; KubeAI's CHWBL,
``internal/loadbalancer/balance_chwbl.go``, with 1.25). ``Bounds`` holds the four bounds of one
request: in flight and in recent share, for any replica and for a holder of a cold prefix. Why
each exists: step 2 of ``prefix_router/routing/policy.py``'s docstring; what it was measured to do:
``docs/routing-rule.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

from prefix_router.config import RoutingConfig
from prefix_router.cache.shadow import ShadowIndex

__all__ = ["SHARE_DIGITS", "SHARE_TOLERANCE", "Bounds", "ReplicaView", "load_bound", "in_flight_regime", "within_bound"]

# Decayed shares carry noise in their last bits: requests milliseconds apart weigh 2 **
# (dt / half_life_s) apart, which even a half-life of 1e9 s leaves above 1e-12, so two instances
# that saw the same requests split exact ties (equal recent shares, a prefix's share x replicas
# equal to its holders) differently: tests/fleet/test_discovery.py's two instances disagreed in 6 runs
# of 15. Shares are compared to a millionth of a request, which is no load to act on.
SHARE_DIGITS = 6
SHARE_TOLERANCE = 10.0 ** -SHARE_DIGITS
_LOAD, _RECENT = attrgetter("load"), attrgetter("recent")


def load_bound(total: int, replicas: int, load_factor: float, slack: int = 0) -> int:
    """The most requests one replica may have once it takes the new one:
    ``ceil(max(load_factor x mean, mean + slack))`` with ``mean = (total + 1) / replicas``, the
    ``+ 1`` being the new request.

    ``total``: the replicas' loads summed, before the new request. ``slack``: requests over the
    mean any replica may carry, which matters only at low load, where the relative bound alone
    would turn away a second request from a replica holding the prompt while the fleet is idle
    (vLLM runs both in one batch; no queue forms). With ``load_factor`` >= 1 the least loaded
    replica always fits: its load is at most ``floor(total / replicas)``, and
    ``ceil((total + 1) / replicas)`` is one more than that. Raises ValueError for no replicas.
    """
    if replicas < 1:
        raise ValueError("no replicas")
    mean = (total + 1) / replicas
    # the epsilon keeps float rounding from pushing an exact integer (1.25 x 8 / 2) past itself
    return math.ceil(max(load_factor * mean, mean + slack) - 1e-9)


def in_flight_regime(total: int, replicas: int, load_factor: float, slack: int) -> bool:
    """Whether the relative part of ``load_bound`` binds: ``(load_factor - 1) x mean >= slack``,
    the mean counting the new request (4 requests a replica with the defaults, 1.25 and 1).

    Below it the in-flight bound is all slack and says little of the load, so the share of the
    requests sent lately stands in for it (traffic arriving one request at a time). Above it the
    in-flight counts carry the load themselves, the holder's share bound is dropped, and only
    the holder bound limits a replica keeping a cold prefix: with several gateway instances each
    one's share counts are a sample of a quarter of the traffic, and on SGLang's
    generated-shared-prefix shape (four instances, KV events, ``python -m bench instances``) they spilled
    3-5 documents a run to replicas that recomputed them, 1.3 points below one instance (token
    hit rate, medians of 8 runs: 0.867 against 0.880); without the bound here 0.872 against
    0.878 (8 runs each, the same hour)."""
    return (load_factor - 1) * (total + 1) / replicas >= slack


def within_bound(load: float, bound: int) -> bool:
    """Whether a replica with ``load`` requests may take one more (``load_bound``)."""
    return load + 1 <= bound


@dataclass(slots=True)
class ReplicaView:
    """What a policy may know of one routable (healthy) replica."""

    name: str  # the key it is given under in the policy's ``replicas``
    load: int  # requests in flight on it, counted at send (``ReplicaState.routing_load``)
    shadow: ShadowIndex
    recent: float = 0.0  # requests sent to it lately, decayed (``ReplicaState.recent_share``)
    prefill: int = 0  # prompt blocks queued for prefill on it (``ReplicaState.prefill_blocks``)
    # ``shadow`` is the engine's own picture (fresh KV events), which every gateway instance reads
    engine: bool = False


@dataclass(frozen=True, slots=True)
class Bounds:
    """The bounds of step 2 for one request, in requests: ``load`` and ``share`` for any replica,
    ``holder_load`` and ``holder_share`` for a holder of a cold prefix (``math.inf``: no share
    bound for the holder)."""

    load: int
    share: int
    holder_load: int
    holder_share: float

    @classmethod
    def of(cls, cfg: RoutingConfig, replicas: Mapping[str, ReplicaView]) -> "Bounds":
        """The bounds for a request to ``replicas`` (the routable ones, at least one), from their
        loads and recent shares summed and ``cfg``'s factors and slacks."""
        n = len(replicas)
        total_load = sum(map(_LOAD, replicas.values()))
        total_share = sum(map(_RECENT, replicas.values()))
        # past the slack the in-flight bound sees the load: no share bound for the holder. Nor
        # with several instances: each counts shares over its own part of the traffic, a sample
        # too small to tell a holder's fair share (docs/routing-rule.md, step 2)
        in_flight = in_flight_regime(total_load, n, cfg.load_factor, cfg.load_slack)
        holder_share = (math.inf if in_flight or not cfg.sole_router
                        else load_bound(total_share, n, cfg.holder_share_factor, cfg.holder_slack))
        return cls(load_bound(total_load, n, cfg.load_factor, cfg.load_slack),
                   load_bound(total_share, n, cfg.load_factor, cfg.load_slack),
                   load_bound(total_load, n, cfg.holder_load_factor, cfg.holder_slack), holder_share)

    def fitting(self, order: Sequence[str], replicas: Mapping[str, ReplicaView], owner: str) -> list[str]:
        """The replicas of ``order`` (in its order) that ``fits`` lets take the request, ``owner``
        being the key's owner: one pass over the fleet, without a call a replica."""
        load, share = self.load, self.share
        return [r for r in order if replicas[r].load + 1 <= load and (r == owner or replicas[r].recent + 1 <= share)]

    def fits(self, view: ReplicaView, is_owner: bool, holder: bool = False) -> bool:
        """Whether ``view`` may take the request (``holder``: under the holder's looser bounds).

        A replica other than the key's owner must also be within the share bound: the in-flight
        bound never acts on requests sent one at a time, which would otherwise all follow a
        shared system prompt to the one replica that computed it first. The owner is exempt: the
        ring already spreads keys, a lone conversation stays with its history, and a request no
        instance knows anything of goes where every instance would send it (walking past owners
        over their share gained about a point of reuse in one run and doubled the gap between
        two instances: tests/fleet/test_discovery.py)."""
        load, share = (self.holder_load, self.holder_share) if holder else (self.load, self.share)
        return within_bound(view.load, load) and (is_owner or within_bound(view.recent, share))
