"""Routing policies: pure, synchronous choices of a replica for one request.

``PrefixAffinityPolicy.select``: the longest cached prefix, under a load bound.

1. Match: for each routable replica, how many of the request's leading blocks it holds
   (``ShadowIndex.match``, capped at the blocks the engine can hit).
2. Bound: a replica may take the request when its load after taking it is at most
   ``ceil(max(load_factor x mean, mean + load_slack))``, the mean counting the new request
   (``router/bounds.py``: ``load_bound``, ``within_bound``): consistent hashing
   with bounded loads (Mirrokni et al., "Consistent Hashing with Bounded Loads", SODA 2018;
   KubeAI's CHWBL, ``internal/loadbalancer/balance_chwbl.go``, with 1.25). Load is requests in
   flight plus what other gateways put on the engine (``ReplicaState.routing_load``), counted the
   moment a request is sent. The least loaded replica is always within the bound, so a request
   always has somewhere to go. The same bound holds the share of the requests
   sent lately (``ReplicaView.recent``, decayed with ``share_half_life_s``) of every replica but
   the key's owner: traffic that arrives one request at a time has nothing in flight, and would
   otherwise follow a shared system prompt to the one replica that computed it first.
   A replica holding a cold prefix of the prompt (``_holds_cold_prefix``: the replicas holding
   it could serve its recent demand at their fair share, ``PrefixDemand``) keeps the request up
   to looser bounds (``holder_load_factor`` in flight, ``holder_share_factor`` in share, with
   ``holder_slack``): spilling it would recompute a prefix, a document, a conversation's
   history, to relieve a load that one more copy of that prefix cannot cure. While every
   replica has requests in flight past the slack (``bounds.in_flight_regime``) the holder answers to
   the in-flight holder bound alone, and so it does wherever this gateway is one of several
   (``routing.sole_router`` false): each instance's share counts cover its own part of the
   traffic. On a dozen agent sessions behind four instances with KV events (``bench.instances``'
   workload, 6 runs each, the same hour) the holder's share bound counted on a quarter of the
   requests moved 3-5 conversations a run off their history: token hit rate 0.847 with it,
   0.872 without, one instance 0.862-0.866; SGLang's shape 0.863 -> 0.874 (3 runs; 0.863-0.869
   in later runs of the same code: the rest of its gap was new work, step 3), the mixed
   workload 0.714 -> 0.715, at a busiest replica 1.10-1.19x -> 1.17-1.27x there. A hot prefix,
   one system prompt behind most requests, gets no such leave and spreads at the bound.
3. New work: when the most any replica holds is under ``match_threshold`` of the prompt and the
   request opens a conversation (a chat's first turn; for a completion, a match within the prefix
   many prompts share, ``BranchStats.key_depth``), the request is mostly new everywhere. Of the
   replicas within the bound, the one with the least prompt queued for prefill takes it
   (``ReplicaView.prefill``: the uncached blocks of requests sent there that have no first token
   yet), then the least loaded, then the fewest blocks (``Route.BALANCE``; then ring order; no
   holder's leave): its prefill starts soonest. The rule of 2026-12-04 (load first) against
   this, alternating, medians of 3 (``bench.compare --quick``, this gateway alone): Mooncake synthetic
   TTFT p50/p99 0.69/2.91 -> 0.60/2.50 s, conversation 0.98/5.21 -> 0.86/5.22 s at a hit rate of
   0.036 -> 0.042, a dozen sessions 0.858 -> 0.865; SGLang's shape 0.882 -> 0.875 (a replica
   decoding many answers, none queued for prefill, draws more documents). A later turn is never new
   work: its history would be recomputed. Where a new conversation starts is where its later turns
   will stay, and a small shared base (the part of several system prompts they have in common) is
   not worth piling the conversations that share it onto the one replica that computed it first.
   sglang-router's and vllm-router's ``cache_threshold`` (0.5) send such prompts to the smallest
   tree. By blocks alone, new work took the built-in agent workload (12 sessions, four system
   prompts on a 1,118-token base) from 0.852 to 0.860 at a busiest replica of 1.62x -> 1.17x (3
   runs each, the rule off then on). A prompt nobody holds any of is new work only where this
   instance is the only router (``routing.sole_router``); elsewhere it goes by the ring, where
   every instance sends it. KV events do not make several instances agree here: an engine publishes
   a prefix's blocks once it has computed them, and until then idle instances see the same replica
   holding the fewest blocks. On SGLang's generated-shared-prefix shape four instances with events
   placed new documents there in bursts (seven in under a second on one replica), and a document's
   next question reaching another instance before the events placed it again: 21 computations of 16
   documents a run (2 runs, request logs); on the ring 18-19, and 0.874 against one instance's
   0.882 (``bench/results/instances``). Placed by the ring, the 32 documents of vLLM's
   prefix_repetition drew 97, 91, 85 and 47 requests on 4 replicas, and the busiest holders' spills
   recomputed whole documents: the only router places them as new work.
4. Choice: among replicas within the bound, the one holding most of the prompt; ties go in ring
   order of the request's key. The key is the session key when the caller gives one (a client's
   session id, or a chat's opening, ``PromptInfo.opening``), else the block chain through the
   first block after the deepest prefix many prompts share (``BranchStats.key_depth``). A tie
   carries no cache information, so the key spreads it: new conversations that share one system
   prompt held everywhere go where their own key points, not all to one replica, and every
   gateway instance places a request it knows nothing about in the same place. Where every
   instance reads the same picture (``routing.sole_router``, or every view the engine's), replicas
   holding equal parts of a prompt are told apart by load (in flight, then recent share;
   ``Route.BALANCE``) before the ring: a prefix they all hold goes to the least loaded holder,
   where the ring's arcs and the bound's slack let one holder take 1.3-1.4x its share. On
   vLLM's random dataset with one shared prefix this took the busiest replica from 1.39x to
   1.23x its fair share of requests through chat and from 1.25x to 1.04x through completions,
   at the same hit rates; vLLM's prefix_repetition read 0.799 -> 0.794 (chat) and 0.806 -> 0.809
   (completions), the built-in chat and agent workloads 0.843 -> 0.835 and 0.863 -> 0.864, all
   within the spread of runs (``bench.compare --quick``, medians of 5 and 3 runs, alternating,
   the same hour; a variant that kept the ring for conversations read 0.835 on the built-in
   chat workload too).
   A hot shared prefix counts for nothing here (``_replicate_depth``: of the part many prompts
   share, one drawing more requests than its holders can serve at their fair share, while some
   replica lacks it): where every instance reads the same picture its holders tie with the
   replicas holding none of it, and load decides. Without it a replica that missed the first
   requests could stay empty for a whole workload, outranked by every holder of a shared system
   prompt, the bound's slack never turning the holders away at low load (full mode, 8 replicas:
   one idle on 2 of 10 workloads -> none; busiest 1.15x -> 1.00x on 2000 sessions of one system
   prompt, 1.25x -> 1.05x on vLLM's random dataset; the README, "An empty replica").

What this does to each traffic shape:

=================================  =============================================================
shape                              outcome
=================================  =============================================================
a conversation's later turns       its history lives on one replica: that replica holds the most
a document shared by many prompts  they follow it to its holder, up to the holder bounds while
                                   the document is cold; a hot one spills at the bound, is
                                   computed on another replica, and both serve it
one system prompt, many sessions   everyone holds it (a tie): sessions spread by load, or by
                                   their own keys where instances have no common picture; while
                                   some replica lacks it, that one ties with the holders too
one prefix, many single requests   everyone holds it (a tie): the least loaded holder takes each,
                                   and so may a replica without it while it is hot
nothing cached anywhere            the replica within the bound with the least prompt queued
                                   for prefill, then load, then blocks; with several instances, the ring
                                   owner of the key, or the next within the bound
a new chat on a small shared base  the replica within the bound with the least prompt queued
                                   for prefill, then load, then blocks, with one instance or several
=================================  =============================================================

The route reported: ``affinity`` when the choice is the key's ring owner, ``sticky`` when another
replica held more of the prompt, ``balance`` for new work (step 3) and for a tie told apart by
load (step 4), ``spill`` when the replica
preferred without the bound was over it (``spilled_from`` names that one), ``fallback`` for the
baselines; the proxy labels a retry ``retry``. Complexity: O(replicas x matched blocks)
dictionary lookups per request.

The policy does no I/O and records nothing: it returns a ``Decision``; the proxy acts on it and
counts it. ``RoundRobinPolicy`` and ``LeastLoadedPolicy`` are the baselines to compare with.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import xxhash

from .blocks import BlockHash
from .bounds import SHARE_TOLERANCE, Bounds, ReplicaView, within_bound
from .config import RoutingConfig
from .index import BranchStats, PrefixDemand
from .ring import Ring

__all__ = ["Route", "ReplicaView", "Decision", "PrefixAffinityPolicy", "RoundRobinPolicy",
           "LeastLoadedPolicy", "make_policy", "routing_key"]


class Route(str, enum.Enum):
    """Which branch chose the replica (the ``route`` label of ``prefix_router_requests_total``)."""

    AFFINITY = "affinity"  # the ring's owner of the routing key
    SPILL = "spill"  # the preferred replica was over the load bound
    STICKY = "sticky"  # a replica other than the owner held more of the prompt
    # chosen by load: a prompt mostly new everywhere, to the replica with the least prompt queued
    # for prefill (then load, then blocks held); or one several replicas hold equally, by load
    BALANCE = "balance"
    FALLBACK = "fallback"  # a baseline policy
    # Not the policy's: the proxy's label for an attempt after the first replica failed (the
    # policy chose again among the replicas not tried yet; router/forward.py)
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
        matches = {n: min(v.shadow.match(hashes), cap) for n, v in replicas.items()}
        bounds = Bounds.of(self.config, replicas)
        owner = order[0]
        rank = self._ranker(order, matches, replicas, hashes, depth)
        preferred = min(order, key=rank)
        fitting = [r for r in order if bounds.fits(replicas[r], r == owner)]
        if not fitting:  # the share bound turned away everyone within the in-flight bound
            fitting = [r for r in order if within_bound(replicas[r].load, bounds.load)]
        top = max(order, key=lambda r: (matches[r], r == preferred))  # preferred may hold less: step 4
        best = matches[top]
        decide = partial(Decision, best_blocks=best, best_replica=top, key_depth=depth, key=key,
                         matches=matches)
        if fitting and self._is_new_work(first_turn, best, depth, cap):
            # mostly new work: what a replica holds of it is worth less than where its later
            # turns will stay and how soon its prefill starts: the least prompt queued for
            # prefill takes it, then the least loaded, then the fewest blocks (then ring order)
            replica = min(fitting, key=lambda r: (replicas[r].prefill, replicas[r].load, len(replicas[r].shadow)))
            return decide(replica, Route.BALANCE, predicted_blocks=matches[replica])
        # The holder's leave: a replica past the bounds that alone holds more of the prompt than
        # any fitting one, where that prefix is cold, keeps it up to the holder bounds.
        most = max((matches[r] for r in fitting), default=0)
        fitting += [r for r in order if r not in fitting and matches[r] > most
                    and bounds.fits(replicas[r], r == owner, holder=True)
                    and self._holds_cold_prefix(r, hashes, matches)]
        if fitting:
            replica = min(fitting, key=rank)
        else:  # loads that are not what the bound assumes (negative); not reached otherwise
            replica = min(order, key=lambda n: replicas[n].load)
        if replica != preferred:
            return decide(replica, Route.SPILL, predicted_blocks=matches[replica], spilled_from=preferred)
        if replica == owner:
            return decide(replica, Route.AFFINITY, predicted_blocks=matches[replica])
        # another replica held more than the owner, or as much and less load
        route = Route.STICKY if matches[replica] > matches[owner] else Route.BALANCE
        return decide(replica, route, predicted_blocks=matches[replica])

    def _ranker(self, order: Sequence[str], matches: Mapping[str, int], replicas: Mapping[str, ReplicaView],
                hashes: Sequence[BlockHash], depth: int) -> Callable[[str], tuple]:
        """The sort key of step 4: most blocks held first, not counting a shared prefix to
        replicate (``_replicate_depth``). Replicas holding equal parts of the prompt are told
        apart by load where every instance reads the same picture (it is the only router, or
        every view is the engine's); else, and among replicas holding nothing, by the ring, where
        every instance agrees (``order`` is the ring's)."""
        shared = self.config.sole_router or all(v.engine for v in replicas.values())
        position = {r: i for i, r in enumerate(order)}
        common = self._replicate_depth(hashes, matches, depth) if shared else 0
        worth = {r: m if m > common else 0 for r, m in matches.items()}

        def rank(r: str) -> tuple:
            if shared and (worth[r] or common):
                return -worth[r], replicas[r].load, replicas[r].recent, position[r]
            return -worth[r], 0, 0, position[r]
        return rank

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


class _Baseline:
    """Shared by the baselines: they ignore prefixes when choosing, but still report what
    replicas were believed to hold, so their misses are classified like the gateway's."""

    def __init__(self, config: RoutingConfig, branches: BranchStats) -> None:
        self.config = config
        self.branches = branches

    def order(self, replicas: Mapping[str, ReplicaView]) -> list[str]:
        raise NotImplementedError

    def select(self, hashes, full_hash, replicas, session_key=None, max_hit_blocks=None, first_turn=None) -> Decision:
        if not replicas:
            raise LookupError("no healthy replica")
        order = self.order(replicas)
        cap = len(hashes) if max_hit_blocks is None else max_hit_blocks
        matches = {n: min(v.shadow.match(hashes), cap) for n, v in replicas.items()}
        best = max(order, key=lambda n: matches[n])
        depth, key = routing_key(self.branches, self.config.max_key_blocks, hashes, full_hash, session_key)
        return Decision(order[0], Route.FALLBACK, predicted_blocks=matches[order[0]],
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


def make_policy(config: RoutingConfig, ring: Ring, branches: BranchStats, demand: PrefixDemand | None = None):
    """The policy the configuration names (``demand``: the gateway's, which the proxy records)."""
    if config.policy == "round-robin":
        return RoundRobinPolicy(config, branches)
    if config.policy == "least-loaded":
        return LeastLoadedPolicy(config, branches)
    return PrefixAffinityPolicy(config, ring, branches, demand)
