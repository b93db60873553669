"""The peer routers' policies, as the fleet simulator plays them, on the gateway's token blocks.

``ConsistentHashPolicy``: consistent hashing with bounded loads keyed by a prompt's first 256
tokens (SGLang's ``prefix_hash``: ``prefix_token_count`` 256, ``prefix_hash_load_factor`` 1.25).

``SessionHashPolicy``: vllm-router's ``consistent_hash`` (0.1.17, its load-balancing guide): the
ring position of the request's session id (``X-Session-ID`` and its kin, or the body's ``user``),
else of a hash of the whole body; no load bound.

``CacheAwarePolicy``: SGLang's gateway's ``cache_aware``, as ``sgl-router/src/policies/
cache_aware.rs`` describes and does it. An approximate radix tree per worker of every prompt
routed there, which nothing but a size cap ever shrinks (the engine's evictions never reach it);
the system counted imbalanced when ``max - min > balance_abs_threshold`` and ``max >
min x balance_rel_threshold`` over the requests each worker has in flight from this router,
then the least loaded worker; else the worker whose tree matches the longest prefix when the
match covers more than ``cache_threshold`` of the prompt (of several, one the prompt's text
fixes: ``_tie``), else the worker with the smallest tree.
The tree inserts the prompt for the worker chosen either way. Defaults: ``sglang-router launch
--help`` of 0.3.2, the release the HTTP matrix runs (``cache_threshold`` 0.3,
``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5, ``max_tree_size`` 2**26 characters). SGLang's tree holds characters; here a tree holds the
prompt's blocks, and a match's share of the prompt is in blocks (the trees split a prompt at
the same places only when the text of a block is the same, which the gateway's chained hashes
require too).

``KvCostPolicy``: NVIDIA Dynamo's KV router (its KV cache routing guide, "Cost
Calculation"): the worker of least ``overlap_score_weight x prefill blocks + decode blocks``, the
prefill blocks those queued on it plus this prompt's blocks it does not hold, the decode blocks
those of the requests active on it plus this one's; ``overlap_score_weight`` 1 and temperature 0
(the least cost, no sampling) by default. It is the cost model the issue behind the fleet
simulator asked to weigh against this gateway's bounds: one knob.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import xxhash

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.holders import match_all
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.cache.tree import BlockTree
from prefix_router.fleet.replicas import ReplicaState
from prefix_router.routing.bounds import ReplicaView
from prefix_router.routing.decision import Decision, Route
from prefix_router.routing.ring import Ring

__all__ = ["CacheAwarePolicy", "ConsistentHashPolicy", "KvCostPolicy", "SessionHashPolicy"]

CHARS_PER_TOKEN = 4  # English text in a Llama-3 tokenizer, about: SGLang's cap counts characters


class ConsistentHashPolicy:
    """Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018): the ring
    position of the prompt's first ``key_tokens`` tokens (its block of that depth), then the first
    replica along the ring whose requests in flight are below ``(1 + epsilon)`` times the mean
    (counting this one), so no replica takes more than that share. SGLang's ``prefix_hash``
    keys a prompt's leading tokens the same way, with a load factor of 1.25: ``epsilon`` 0.25."""

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
        return _decision(chosen, order[0], hashes, replicas, max_hit_blocks, key)


class SessionHashPolicy:
    """vllm-router's ``consistent_hash`` (module docstring): a session's requests on one replica,
    any other request where the hash of its prompt falls on the ring, whatever the loads."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring

    def select(self, hashes: Sequence[BlockHash], full_hash: int, replicas: Mapping[str, ReplicaView],
               session_key: str | None = None, max_hit_blocks: int | None = None,
               first_turn: bool | None = None) -> Decision:
        if not replicas:
            raise LookupError("no healthy replica")
        key = f"s:{session_key}" if session_key is not None else f"p:{full_hash:016x}"
        chosen = next((n for n in self.ring.candidates(key) if n in replicas), None) or sorted(replicas)[0]
        return _decision(chosen, chosen, hashes, replicas, max_hit_blocks, key)


class CacheAwarePolicy:
    """SGLang's ``cache_aware`` (module docstring) in front of ``states`` (the router's
    ``ReplicaState`` of each worker, whose ``inflight`` is the load SGLang counts)."""

    def __init__(self, states: Mapping[str, ReplicaState], block_size: int, *, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 max_tree_chars: int = 1 << 26) -> None:
        self.states = states
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        tree = BlockTree()
        blocks = max(max_tree_chars // (CHARS_PER_TOKEN * block_size), 1)
        self.trees = {name: ShadowIndex(blocks, tree) for name in states}

    def select(self, hashes: Sequence[BlockHash], full_hash: int, replicas: Mapping[str, ReplicaView],
               session_key: str | None = None, max_hit_blocks: int | None = None,
               first_turn: bool | None = None) -> Decision:
        if not replicas:
            raise LookupError("no healthy replica")
        names = list(replicas)  # the workers' order: sgl-router takes the first of equals
        loads = [self.states[n].inflight for n in names]
        most, least = max(loads), min(loads)
        matches = match_all(hashes, {n: self.trees[n] for n in names}, len(hashes))
        if most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold:
            chosen = names[loads.index(least)]
        else:
            depth = max(matches.values())
            if hashes and depth / len(hashes) > self.cache_threshold:
                chosen = self._tie(hashes, depth, [n for n in names if matches[n] == depth])
            else:
                chosen = min(names, key=lambda n: len(self.trees[n]))
        self.trees[chosen].insert(hashes)
        return _decision(chosen, chosen, hashes, replicas, max_hit_blocks, "")


    @staticmethod
    def _tie(hashes: Sequence[BlockHash], depth: int, tied: list[str]) -> str:
        """Of the workers whose trees hold the prompt's first ``depth`` blocks, the one SGLang's
        tree names. A tree of characters matches on past a shared prefix into the node of any
        prompt whose text goes on with the same character, and names that node's worker; where
        none does, the first worker of the node the match ends in, in the order of its DashMap (a
        random hasher each): either way a worker fixed by the text, random across texts. Here:
        the first in an order the prompt's next block sets (its last one where it ends)."""
        if len(tied) == 1:
            return tied[0]
        key = hashes[min(depth, len(hashes) - 1)]
        return min(tied, key=lambda n: xxhash.xxh3_64_intdigest(f"{key}/{n}".encode()))


class KvCostPolicy:
    """Dynamo's KV router (module docstring). ``active``: blocks of the requests in flight on each
    replica (the router's, kept by whoever sends), read at each choice; ``weight``:
    ``overlap_score_weight``. Equal costs go to the replica the prompt's hash orders first."""

    def __init__(self, active: Mapping[str, int], weight: float = 1.0) -> None:
        self.active = active
        self.weight = weight

    def select(self, hashes: Sequence[BlockHash], full_hash: int, replicas: Mapping[str, ReplicaView],
               session_key: str | None = None, max_hit_blocks: int | None = None,
               first_turn: bool | None = None) -> Decision:
        if not replicas:
            raise LookupError("no healthy replica")
        cap = len(hashes) if max_hit_blocks is None else max_hit_blocks
        matches = match_all(hashes, {n: v.shadow for n, v in replicas.items()}, cap)
        blocks = len(hashes)

        def cost(name: str) -> tuple[float, int]:
            prefill = replicas[name].prefill + blocks - matches[name]
            tie = xxhash.xxh3_64_intdigest(f"{full_hash}/{name}".encode())
            return self.weight * prefill + self.active.get(name, 0) + blocks, tie

        chosen = min(replicas, key=cost)
        return _decision(chosen, chosen, hashes, replicas, max_hit_blocks, "")


def _decision(chosen: str, first: str, hashes: Sequence[BlockHash], replicas: Mapping[str, ReplicaView],
              max_hit_blocks: int | None, key: str) -> Decision:
    """The Decision the gateway's accounting reads: the blocks its shadow index predicts on the
    replica chosen and on the best one, and a spill when ``chosen`` is not ``first``."""
    cap = len(hashes) if max_hit_blocks is None else max_hit_blocks
    matches = match_all(hashes, {n: v.shadow for n, v in replicas.items()}, cap)
    best = max(replicas, key=matches.__getitem__)
    return Decision(chosen, Route.AFFINITY if chosen == first else Route.SPILL, predicted_blocks=matches[chosen],
                    best_blocks=matches[best], best_replica=best, key=key, matches=matches,
                    spilled_from=None if chosen == first else first)
