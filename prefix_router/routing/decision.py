"""What every routing policy returns, and the one method it offers.

A ``Policy`` is pure and synchronous: it reads the replicas' views (``ReplicaView``) and the
request's block hashes, and returns a ``Decision`` with its ``Route``; it does no I/O and records
nothing, so the proxy, the Endpoint Picker and the simulators act on it alike.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from prefix_router.cache.blocks import BlockHash
from prefix_router.routing.prefix_stats import BranchStats
from prefix_router.routing.bounds import ReplicaView

__all__ = ["Route", "Decision", "Policy", "routing_key"]


class Route(str, enum.Enum):
    """Which branch chose the replica (the ``route`` label of ``prefix_router_requests_total``)."""

    AFFINITY = "affinity"  # the ring's owner of the routing key
    SPILL = "spill"  # the preferred replica was over the load bound, or its prefill queue too deep (step 5)
    STICKY = "sticky"  # a replica other than the owner held more of the prompt
    # chosen by load: a prompt mostly new everywhere, to the replica with the least prompt queued
    # for prefill (then load, then blocks held); or one several replicas hold equally, by load
    BALANCE = "balance"
    FALLBACK = "fallback"  # a baseline policy
    # Not the policy's: the proxy's label for an attempt after the first replica failed (the
    # policy chose again among the replicas not tried yet; prefix_router/serve/forward.py)
    RETRY = "retry"


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing choice, final once made (a retry asks the policy again). Block counts are in
    the gateway's block size."""

    replica: str
    route: Route
    predicted_blocks: int = 0  # blocks the chosen replica is believed to hold
    best_blocks: int = 0  # most blocks any replica is believed to hold
    best_replica: str | None = None
    key_depth: int = 0
    key: str = ""  # the ring key
    spilled_from: str | None = None  # the replica preferred without the bound, when the route is spill
    matches: dict[str, int] = field(default_factory=dict)
    # of predicted_blocks, those past the GPU's in each offload medium (cache/offload.py MEDIA:
    # CPU memory, storage); empty where the replica reports no offload tier
    offload: tuple[int, ...] = ()


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


class Policy(Protocol):
    """A routing rule: ``PrefixAffinityPolicy`` (``policy.py``) or a baseline (``baselines.py``)."""

    def select(self, hashes: Sequence[BlockHash], full_hash: int, replicas: Mapping[str, ReplicaView],
               session_key: str | None = None, max_hit_blocks: int | None = None,
               first_turn: bool | None = None) -> Decision:
        """Choose among ``replicas`` (the routable ones, by name) for a prompt with these block
        hashes (``PrefixAffinityPolicy.select`` documents the arguments). Raises LookupError when
        ``replicas`` is empty."""
        ...
