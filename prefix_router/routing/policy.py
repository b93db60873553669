"""Routing policies: pure, synchronous choices of a replica for one request.

``PrefixAffinityPolicy.select``: the longest cached prefix, under a load bound. The measurements
behind each step and default are in ``docs/routing-rule.md``.

1. Match: for each routable replica, how many of the request's leading blocks it holds
   (``ShadowIndex.match`` or the engine's ``EngineView.match``), capped at the blocks the engine
   can hit; where engines offload blocks to CPU memory or storage, also those it holds there
   past its GPU's, each worth its medium's weight of a GPU block in the steps below
   (``_offload_value``).
2. Bound: a replica may take the request while its load after taking it is at most
   ``ceil(max(load_factor x mean, mean + load_slack))``, the mean counting the new request
   (``prefix_router/routing/bounds.py``; consistent hashing with bounded loads, Mirrokni et al.,
   SODA 2018; KubeAI's CHWBL uses 1.25). Load is requests in flight plus what other gateways put
   on the engine (``ReplicaState.routing_load``), counted the moment a request is sent, so the
   least loaded replica is always within the bound. The same bound holds each replica's recent
   share of requests (``ReplicaView.recent``) but the key owner's: traffic arriving one request
   at a time has nothing in flight and would otherwise follow a shared system prompt to one
   replica. A replica holding a cold prefix of the prompt (``_holds_cold_prefix``) keeps the
   request up to looser holder bounds, since spilling would recompute that prefix to relieve a
   load one more copy cannot cure; while every replica is busy past the slack, or where this
   gateway is one of several (``routing.sole_router`` false), only the in-flight holder bound
   applies, as each instance's share counts cover only its own traffic. A hot prefix gets no
   leave and spreads at the bound.
3. New work: when no replica holds ``match_threshold`` of the prompt and the request opens a
   conversation (a chat's first turn; for a completion, a match within the prefix many prompts
   share, ``BranchStats.key_depth``), the replica within the bound with the least prompt queued
   for prefill takes it (``ReplicaView.prefill``), then the least loaded, then the fewest blocks
   (``Route.BALANCE``): its prefill starts soonest, and where a conversation starts its later
   turns stay. A later turn is never new work. A prompt nobody holds any of is new work only
   where this instance is the only router (``routing.sole_router``); elsewhere the ring places
   it, where every instance sends it (KV events arrive only after an engine has computed a
   prefix, too late to make instances agree).
4. Choice: among replicas within the bound, the one holding most of the prompt; ties go in ring
   order of the request's key (the session key, a chat's opening, or the block chain through the
   first block after the deepest shared prefix: ``routing_key``), so a tie, which carries no
   cache information, spreads, and every instance places a request it knows nothing of alike.
   Where every instance reads the same picture, holders of equal parts are told apart by load
   before the ring (``Route.BALANCE``), and a hot shared prefix counts for nothing
   (``_replicate_depth``), so a replica that missed the first requests is not outranked forever.
5. The holder's queue: the replica chosen is passed over where one within the in-flight bound
   holding less of the prompt scores less, the score being uncached blocks plus
   ``prefill_queue_weight`` (0.1) x blocks queued for prefill (``_sooner``); the least score
   then takes it. The in-flight bound counts requests, and with prompts from 1k to 100k tokens
   a holder a few requests deep can have seconds of prefill queued, behind which a short
   prompt sharing a small prefix with it waits, where a replica with none queued would have
   computed all of it. Blocks are the gateway's (a character block counts as one where the
   prompt is not cut into tokens), and the queue is this instance's own requests.

The route reported: ``affinity`` (the key's ring owner), ``sticky`` (another replica held more),
``balance`` (new work, or a tie told apart by load), ``spill`` (the preferred replica was over
the bound; ``spilled_from`` names it), ``fallback`` (the baselines); the proxy labels a retry
``retry``. Cost: one walk of the prompt's blocks in the fleet's map (``cache/holders.py``), where
a run of blocks held by the same replicas is stepped over in C, and a handful of passes over the
routable replicas, each a comprehension, ``map``, ``min`` or ``max`` with no Python call a
replica (``bench/results/choice/``).

The policy does no I/O and records nothing: it returns a ``Decision``; the proxy acts on it and
counts it. Every policy follows ``Policy``; the baselines are in ``baselines.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.holders import match_all, offload_depths
from prefix_router.cache.offload import MEDIA
from prefix_router.routing.bounds import SHARE_TOLERANCE, Bounds, ReplicaView, within_bound
from prefix_router.config import RoutingConfig
from prefix_router.routing.prefix_stats import BranchStats, PrefixDemand
from prefix_router.routing.baselines import LeastLoadedPolicy, RoundRobinPolicy
from prefix_router.routing.decision import Decision, Policy, Route, routing_key
from prefix_router.routing.ring import Ring

__all__ = ["PrefixAffinityPolicy", "make_policy"]

_ENGINE = attrgetter("engine")
_SHADOW = attrgetter("shadow")
_LOAD_THEN_SHARE = attrgetter("load", "recent")
_PREFILL_THEN_LOAD = attrgetter("prefill", "load")


class PrefixAffinityPolicy:
    """The longest cached prefix among replicas within a load bound; ties by load where every
    instance reads the same picture, else by the ring (the module docstring)."""

    def __init__(self, config: RoutingConfig, ring: Ring, branches: BranchStats,
                 demand: PrefixDemand | None = None) -> None:
        self.config = config
        self.ring = ring
        self.branches = branches
        self.demand = demand if demand is not None else PrefixDemand(config.share_half_life_s)

    def select(self, hashes: Sequence[BlockHash], full_hash: int, replicas: Mapping[str, ReplicaView],
               session_key: str | None = None, max_hit_blocks: int | None = None,
               first_turn: bool | None = None) -> Decision:
        """Choose among ``replicas`` (healthy ones) for a prompt with these block hashes.

        ``full_hash``: a hash of the whole prompt, partial last block included (the key when the
        prompt ends inside a shared prefix). ``max_hit_blocks``: the engine never hits the last
        token, so at most ``(num_tokens - 1) // block_size`` blocks. ``first_turn``: whether a
        chat is on its opening turn (``PromptInfo.first_turn``); None when unknown (completions),
        and then only a match within the prefix many prompts share counts as new work. Raises
        LookupError when ``replicas`` is empty.
        """
        if not replicas:
            raise LookupError("no healthy replica")
        cap = len(hashes) if max_hit_blocks is None else max_hit_blocks
        depth, key = routing_key(self.branches, self.config.max_key_blocks, hashes, full_hash, session_key)
        order = [n for n in self.ring.candidates(key) if n in replicas] or sorted(replicas)
        indexes = dict(zip(replicas, map(_SHADOW, replicas.values())))
        gpu = match_all(hashes, indexes, cap)
        matches, held, total, offload = self._offload_value(hashes, indexes, gpu, cap)
        bounds = Bounds.of(self.config, replicas)
        owner = order[0]
        choose = self._chooser(matches, held, replicas, hashes, depth)
        preferred = choose(order)
        fitting = bounds.fitting(order, replicas, owner)
        if not fitting:  # the share bound turned away everyone within the in-flight bound
            fitting = [r for r in order if within_bound(replicas[r].load, bounds.load)]
        best = max(map(matches.__getitem__, order))  # the ring's replicas: a routable one off it still
        top = preferred if matches[preferred] == best else next(r for r in order if matches[r] == best)

        def decide(replica: str, route: Route, **more) -> Decision:
            more.pop("predicted_blocks", None)  # the blocks it holds, not their value
            return Decision(replica, route, predicted_blocks=total[replica], best_blocks=max(total.values()),
                            best_replica=top, key_depth=depth, key=key, matches=total,
                            offload=tuple(offload.get(replica, ())), **more)
        if fitting and self._is_new_work(first_turn, best, depth, cap):
            # mostly new work: what a replica holds of it is worth less than where its later
            # turns will stay and how soon its prefill starts: the least prompt queued for
            # prefill takes it, then the least loaded, then the fewest blocks (then ring order)
            replica = _soonest(fitting, replicas)
            return decide(replica, Route.BALANCE, predicted_blocks=matches[replica])
        # The holder's leave: a replica past the bounds that alone holds more of the prompt than
        # any fitting one, where that prefix is cold, keeps it up to the holder bounds.
        most = max(map(matches.__getitem__, fitting), default=0)
        if best > most:
            taken = set(fitting)
            leave = {r for r in order if matches[r] > most and r not in taken
                     and bounds.fits(replicas[r], r == owner, holder=True)
                     and self._holds_cold_prefix(r, hashes, held)}
            if leave:
                fitting = [r for r in order if r in taken or r in leave]
        if fitting:
            replica = preferred if fitting == order else choose(fitting)  # nobody past a bound: chosen already
            if self.config.prefill_queue_weight:
                replica = self._sooner(replica, fitting, matches, replicas, cap, bounds.load)
        else:  # loads that are not what the bound assumes (negative); not reached otherwise
            replica = min(order, key=lambda n: replicas[n].load)
        if replica != preferred:
            return decide(replica, Route.SPILL, predicted_blocks=matches[replica], spilled_from=preferred)
        if replica == owner:
            return decide(replica, Route.AFFINITY, predicted_blocks=matches[replica])
        # another replica held more than the owner, or as much and less load
        route = Route.STICKY if matches[replica] > matches[owner] else Route.BALANCE
        return decide(replica, route, predicted_blocks=matches[replica])

    def _offload_value(self, hashes: Sequence[BlockHash], indexes: Mapping, gpu: dict[str, int], cap: int
                       ) -> tuple[Mapping[str, float], Mapping[str, int], Mapping[str, int], dict[str, list[int]]]:
        """(the value of the prompt on each replica, the blocks routing counts as held, the blocks
        each holds in all, those it holds in each offload medium past its GPU's), from ``gpu``, the
        blocks on each replica's GPU. Where replicas hold parts of the prompt in CPU memory or
        storage (``holders.offload_depths``), vLLM loads them (and reports them cached), so they
        are always predicted; routing weighs a block there at its medium's weight of one on the
        GPU (``routing.cpu_hit_weight``, ``storage_hit_weight``) and counts it as held, unless
        both weights are 0: then it routes by the GPU's blocks alone."""
        offload = offload_depths(hashes, indexes, gpu, cap, MEDIA)
        if not offload:
            return gpu, gpu, gpu, offload
        total = dict(gpu)
        for name, runs in offload.items():
            total[name] += sum(runs)
        weights = (self.config.cpu_hit_weight, self.config.storage_hit_weight)
        if not any(weights):
            return gpu, gpu, total, offload
        value = dict(gpu)
        for name, runs in offload.items():
            value[name] += sum(w * n for w, n in zip(weights, runs))
        return value, total, total, offload

    def _chooser(self, matches: Mapping[str, float], held: Mapping[str, int], replicas: Mapping[str, ReplicaView],
                 hashes: Sequence[BlockHash], depth: int) -> Callable[[Sequence[str]], str]:
        """Step 4's choice among replicas given in ring order: most blocks held first, not
        counting a shared prefix to replicate (``_replicate_depth``). Replicas holding equal
        parts of the prompt are told apart by load, then recent share, where every instance
        reads the same picture (it is the only router, or every view is the engine's); else,
        and among replicas holding nothing, by the ring, where every instance agrees: the first
        of equals in the order given. Each step is a ``max``, ``min`` or comprehension over the
        list, so a choice among 256 replicas makes no Python call a replica."""
        shared = self.config.sole_router or all(map(_ENGINE, replicas.values()))
        common = self._replicate_depth(hashes, held, depth) if shared else 0
        worth = {r: m if held[r] > common else 0 for r, m in matches.items()} if common else matches

        def choose(candidates: Sequence[str]) -> str:
            most = max(map(worth.__getitem__, candidates))
            tied = [r for r in candidates if worth[r] == most]
            if len(tied) == 1 or not shared or not (most or common):
                return tied[0]
            return min(map(replicas.__getitem__, tied), key=_LOAD_THEN_SHARE).name
        return choose

    def _sooner(self, chosen: str, fitting: Sequence[str], matches: Mapping[str, int],
                replicas: Mapping[str, ReplicaView], cap: int, load_bound: int) -> str:
        """Step 5: ``chosen``, or the replica to start the prompt soonest by the score uncached
        blocks + ``prefill_queue_weight`` x blocks queued for prefill (``ReplicaView.prefill``;
        a queued block counts a tenth of a block to compute at the default 0.1), among the
        replicas of ``fitting`` within the in-flight ``load_bound`` (not those let in by the
        holder's leave). ``chosen`` keeps the request unless a replica holding less of the
        prompt scores less than it does: between equal holders step 4's tie rule decides (load,
        then share), which keeps the sessions on one system prompt spread evenly (trading them
        by queue piled sessions onto a few replicas: docs/routing-rule.md, step 5).
        Once ``chosen`` is passed over, the least score takes it, an equal holder's included,
        ties to the one holding most, then ring order. Negative queues (an accounting slip)
        count as none."""
        weight, held = self.config.prefill_queue_weight, matches[chosen]
        targets = [r for r in fitting if replicas[r].load + 1 <= load_bound]
        scores = [cap - matches[r] + weight * max(replicas[r].prefill, 0) for r in targets]
        lesser = [s for r, s in zip(targets, scores) if matches[r] < held]
        if not lesser or min(lesser) >= cap - held + weight * max(replicas[chosen].prefill, 0):
            return chosen
        least = min(scores)
        return max((r for r, s in zip(targets, scores) if s == least), key=matches.__getitem__)

    def _replicate_depth(self, hashes: Sequence[BlockHash], matches: Mapping[str, int], depth: int) -> int:
        """The deepest hot prefix of the prompt (``_is_hot``) within the part many prompts share
        (under the key depth, ``BranchStats``) that some routable replica does not hold; 0 when
        there is none. One system prompt behind every request, held by 7 of 8 replicas: 1 x 8 > 7.
        A conversation's history lies past the shared part and never counts here, however few
        conversations share the fleet."""
        for d in sorted({m for m in matches.values() if 0 < m < depth}, reverse=True):
            if min(matches.values()) < d and self._is_hot(hashes, d, matches):
                return d
        return 0

    def _is_hot(self, hashes: Sequence[BlockHash], depth: int, matches: Mapping[str, int]) -> bool:
        """Whether the prompt's first ``depth`` blocks draw more requests than the replicas
        holding them (``matches`` at least ``depth``) can serve at their fair share: the share of
        recent requests through that prefix times the replicas is over its holders
        (``PrefixDemand``). Such a prefix is to be replicated, not kept. "Over" means by more than
        ``SHARE_TOLERANCE``: an exact tie (a quarter of the requests, four replicas, one holder)
        must read the same however far apart in time the requests came."""
        holders = sum(1 for m in matches.values() if m >= depth)
        return self.demand.share(hashes[depth - 1]) * len(matches) > holders + SHARE_TOLERANCE

    def _is_new_work(self, first_turn: bool | None, best: int, depth: int, cap: int) -> bool:
        """Step 3: whether the request is mostly new everywhere and opens a conversation.

        A later turn is never new work, whatever its new part weighs: its history would be
        recomputed wherever else it went. A prompt nobody holds any of is new work only where
        this instance is the only router; several keep it on the ring, where every instance
        sends it at once: their pictures, the engines' own included, show a prefix only once a
        replica has computed it."""
        if best == 0 and not self.config.sole_router:
            return False
        opening = first_turn if first_turn is not None else best < depth
        return opening and best < self.config.match_threshold * cap

    def _holds_cold_prefix(self, name: str, hashes: Sequence[BlockHash], matches: Mapping[str, int]) -> bool:
        """Whether ``name`` holds a prefix of the prompt that its holders can serve at their
        fair share: the share of recent requests through the deepest block it holds, times the
        replicas, is at most the replicas holding that deep (``PrefixDemand``). Moving such a
        request recomputes the prefix and relieves nothing replication would cure; a hot prefix
        (one system prompt behind every conversation) must be replicated, and is not cold."""
        depth = matches[name]
        return depth > 0 and not self._is_hot(hashes, depth, matches)


def _soonest(candidates: Sequence[str], replicas: Mapping[str, ReplicaView]) -> str:
    """New work's replica among ``candidates`` (ring order): the least prompt queued for prefill,
    then the least loaded, then the fewest blocks held, then the first; in C but for the blocks
    held, read only for the replicas tied before them."""
    views = list(map(replicas.__getitem__, candidates))
    least = _PREFILL_THEN_LOAD(min(views, key=_PREFILL_THEN_LOAD))
    tied = [v for v in views if _PREFILL_THEN_LOAD(v) == least]
    held = [len(v.shadow) for v in tied]
    return tied[held.index(min(held))].name


def make_policy(config: RoutingConfig, ring: Ring, branches: BranchStats,
                demand: PrefixDemand | None = None) -> Policy:
    """The policy the configuration names (``demand``: the gateway's, which the proxy records)."""
    if config.policy == "round-robin":
        return RoundRobinPolicy(config, branches)
    if config.policy == "least-loaded":
        return LeastLoadedPolicy(config, branches)
    return PrefixAffinityPolicy(config, ring, branches, demand)
