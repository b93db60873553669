"""Routing policies, pure: rings, branch statistics and shadow indexes built by hand."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from router.blocks import BlockHash
from router.config import RoutingConfig
from router.index import BranchStats, ShadowIndex
from router.policy import (LeastLoadedPolicy, PrefixAffinityPolicy, ReplicaView, RoundRobinPolicy, Route,
                           make_policy)
from router.ring import Ring

NAMES = [f"replica-{i}:8000" for i in range(4)]
_fresh = itertools.count(10_000)


def fresh(n: int) -> list[BlockHash]:
    return [BlockHash(next(_fresh)) for _ in range(n)]


def setup(config: RoutingConfig | None = None, names=NAMES):
    config = config or RoutingConfig()
    ring = Ring(config.virtual_nodes)
    for name in names:
        ring.add(name)
    branches = BranchStats(config.branch_threshold)
    policy = PrefixAffinityPolicy(config, ring, branches)
    views = {n: ReplicaView(n, 0, ShadowIndex(10_000)) for n in names}
    return policy, ring, branches, views


def select(policy, hashes, views, **kw):
    return policy.select(hashes, full_hash=int(hashes[-1]) ^ 0xABC if hashes else 1, replicas=views, **kw)


def assert_candidates_complete(decision, views):
    assert decision.candidates[0] == decision.replica
    assert sorted(decision.candidates) == sorted(views)


# --- affinity ------------------------------------------------------------------------------

def test_an_idle_fleet_sends_each_prompt_to_the_ring_owner_of_its_key():
    policy, ring, _, views = setup()
    owners = Counter()
    for _ in range(200):
        hashes = fresh(6)
        d = select(policy, hashes, views)
        assert d.route is Route.AFFINITY
        assert d.replica == ring.owner(d.key)
        assert d.candidates == ring.candidates(d.key)
        assert d.key_depth == 1  # nothing learned: the first block keys the prompt
        assert d.spilled_from is None
        owners[d.replica] += 1
    assert set(owners) == set(NAMES)


def test_prompts_sharing_the_key_blocks_share_a_replica_and_the_rest_does_not_matter():
    policy, _, _, views = setup()
    for _ in range(50):
        head = fresh(1)
        a = select(policy, head + fresh(5), views)
        b = select(policy, head + fresh(9), views)
        assert a.key == b.key and a.replica == b.replica


# --- load ----------------------------------------------------------------------------------

def _owner_and_views(config, owner_load, other_load):
    policy, ring, _, views = setup(config)
    hashes = fresh(4)
    owner = select(policy, hashes, views).replica
    for name, view in views.items():
        view.load = owner_load if name == owner else other_load
    return policy, ring, views, hashes, owner


def test_an_owner_at_the_spill_queue_depth_spills_to_the_next_ring_candidate():
    config = RoutingConfig(spill_queue_depth=8, load_factor=1.5)
    depth = config.spill_queue_depth
    policy, ring, views, hashes, owner = _owner_and_views(config, owner_load=depth, other_load=depth - 1)
    mean = sum(v.load for v in views.values()) / len(views)
    assert depth <= config.load_factor * mean + 1  # only the queue-depth rule applies
    d = select(policy, hashes, views)
    assert d.route is Route.SPILL
    assert d.spilled_from == owner
    assert d.replica == ring.candidates(d.key)[1]
    assert_candidates_complete(d, views)


def test_an_owner_just_below_the_spill_queue_depth_keeps_the_request():
    config = RoutingConfig(spill_queue_depth=8, load_factor=1.5)
    depth = config.spill_queue_depth
    policy, _, views, hashes, owner = _owner_and_views(config, owner_load=depth - 1, other_load=depth - 1)
    d = select(policy, hashes, views)
    assert d.replica == owner and d.route is Route.AFFINITY and d.spilled_from is None


def test_an_owner_above_load_factor_times_the_mean_plus_one_spills_even_below_the_queue_depth():
    config = RoutingConfig(spill_queue_depth=16, load_factor=1.5)
    other = 2
    n = len(NAMES)
    floor = config.spill_queue_depth / 2  # the relative rule needs half the depth queued

    def over_relative(x):  # x > f * (x + 3 * other) / 4 + 1
        return x > config.load_factor * (x + (n - 1) * other) / n + 1

    owner_load = next(x for x in range(1000) if x >= floor and over_relative(x))
    assert owner_load < config.spill_queue_depth
    policy, ring, views, hashes, owner = _owner_and_views(config, owner_load, other)
    d = select(policy, hashes, views)
    assert d.route is Route.SPILL and d.spilled_from == owner
    assert d.replica == ring.candidates(d.key)[1]


def test_a_small_load_above_the_relative_bound_but_below_half_the_depth_does_not_spill():
    config = RoutingConfig(spill_queue_depth=16, load_factor=1.5)
    n = len(NAMES)
    # An idle fleet and two requests on the owner: over 1.5 x mean + 1, yet not a queue.
    owner_load, other = 2, 0
    assert owner_load > config.load_factor * (owner_load + (n - 1) * other) / n + 1
    assert 2 * owner_load < config.spill_queue_depth
    policy, _, views, hashes, owner = _owner_and_views(config, owner_load, other)
    d = select(policy, hashes, views)
    assert d.replica == owner and d.route is Route.AFFINITY


def test_the_spill_walks_the_ring_past_every_overloaded_candidate():
    config = RoutingConfig(spill_queue_depth=5)
    policy, ring, _, views = setup(config)
    hashes = fresh(4)
    order = ring.candidates(select(policy, hashes, views).key)
    for name in order[:2]:
        views[name].load = config.spill_queue_depth
    for name in order[2:]:
        views[name].load = config.spill_queue_depth - 1
    d = select(policy, hashes, views)
    assert d.replica == order[2] and d.route is Route.SPILL and d.spilled_from == order[0]


def test_a_spill_goes_to_the_fitting_replica_holding_most_of_the_prompt_not_just_the_next_one():
    config = RoutingConfig(spill_queue_depth=5)
    policy, ring, branches, views = setup(config)
    hashes = fresh(6)
    branches.record(hashes[:4] + fresh(2), 64)  # another prompt shares the first 4 blocks: not sticky
    order = ring.candidates(select(policy, hashes, views).key)
    views[order[0]].load = config.spill_queue_depth  # the owner is overloaded
    views[order[3]].shadow.insert(hashes[:4])  # an earlier spill computed the shared part there
    views[order[2]].shadow.insert(hashes[:1])
    d = select(policy, hashes, views)
    assert d.replica == order[3] and d.route is Route.SPILL and d.spilled_from == order[0]
    assert d.predicted_blocks == 4
    views[order[3]].load = config.spill_queue_depth  # that one overloaded too: the next best
    assert select(policy, hashes, views).replica == order[2]


def test_when_every_replica_is_overloaded_the_least_loaded_takes_it_as_a_fallback():
    config = RoutingConfig(spill_queue_depth=4)
    policy, _, _, views = setup(config)
    hashes = fresh(4)
    loads = [config.spill_queue_depth + 7, config.spill_queue_depth + 2, config.spill_queue_depth + 9,
             config.spill_queue_depth + 5]
    for view, load in zip(views.values(), loads):
        view.load = load
    d = select(policy, hashes, views)
    assert d.route is Route.FALLBACK
    assert d.replica == min(views, key=lambda n: views[n].load)
    assert d.spilled_from is None
    assert_candidates_complete(d, views)


# --- sticky history ------------------------------------------------------------------------

def test_a_replica_holding_the_prompt_beyond_the_key_depth_wins_over_the_owner_as_sticky():
    policy, ring, _, views = setup()
    hashes = fresh(8)
    owner = select(policy, hashes, views).replica
    holder = next(n for n in ring.candidates(select(policy, hashes, views).key) if n != owner)
    views[holder].shadow.insert(hashes[:5])
    d = select(policy, hashes, views)
    assert d.route is Route.STICKY and d.replica == holder
    assert d.predicted_blocks == 5 and d.best_replica == holder and d.best_blocks == 5
    assert d.matches[owner] == 0
    assert d.spilled_from is None
    assert_candidates_complete(d, views)


def test_history_on_the_owner_itself_is_plain_affinity():
    policy, _, _, views = setup()
    hashes = fresh(8)
    owner = select(policy, hashes, views).replica
    views[owner].shadow.insert(hashes)
    d = select(policy, hashes, views)
    assert d.replica == owner and d.route is Route.AFFINITY and d.predicted_blocks == len(hashes)


def test_an_overloaded_replica_holding_the_history_is_not_sticky():
    config = RoutingConfig(spill_queue_depth=8)
    policy, _, _, views = setup(config)
    hashes = fresh(8)
    owner = select(policy, hashes, views).replica
    holder = next(n for n in NAMES if n != owner)
    views[holder].shadow.insert(hashes)
    views[holder].load = config.spill_queue_depth
    d = select(policy, hashes, views)
    assert d.replica == owner and d.route is Route.AFFINITY
    assert d.best_replica == holder and d.best_blocks == len(hashes)  # still reported, for miss classes


def test_a_shared_system_prompt_held_by_every_replica_does_not_make_one_sticky():
    config = RoutingConfig(branch_threshold=3)
    policy, _, branches, views = setup(config)
    system = fresh(5)
    for _ in range(config.branch_threshold):  # many conversations share the system prompt
        branches.record(system + fresh(3), config.max_key_blocks)
    hashes = system + fresh(3)
    d0 = select(policy, hashes, views)
    owner = d0.replica
    assert d0.key_depth == len(system) + 1
    naive, _, _, _ = setup(config)  # no branch statistics: keys on the first block
    naive.ring = policy.ring
    naive_owner = select(naive, hashes, views).replica
    # Everyone holds the system prompt; the owners lost part of it to eviction, so other
    # replicas hold more of this prompt than the owner, but only the shared part.
    for name, view in views.items():
        view.shadow.insert(system[:2] if name in (owner, naive_owner) else system)
    d = select(policy, hashes, views)
    assert d.best_blocks == len(system) < d.key_depth
    assert d.best_replica not in (owner, naive_owner)
    assert d.replica == owner and d.route is Route.AFFINITY
    # Contrast: keyed on the first block, the same holdings do make another replica sticky.
    # The key depth is what prevents it above.
    d_naive = select(naive, hashes, views)
    assert d_naive.key_depth == 1
    assert d_naive.route is Route.STICKY and d_naive.replica not in (owner, naive_owner)


def test_a_conversation_spread_by_the_branch_key_lands_on_several_replicas_despite_a_shared_prefix():
    config = RoutingConfig(branch_threshold=3)
    policy, _, branches, views = setup(config)
    system = fresh(6)
    placed = Counter()
    for _ in range(80):
        hashes = system + fresh(4)
        d = select(policy, hashes, views)
        branches.record(hashes, config.max_key_blocks)
        views[d.replica].shadow.insert(hashes)
        placed[d.replica] += 1
    assert len(placed) == len(NAMES), placed


# --- session keys, caps, candidates ----------------------------------------------------------

def test_an_explicit_session_key_overrides_the_block_key():
    policy, _, _, views = setup()
    differs = 0
    for s in range(30):
        first, second = fresh(6), fresh(6)
        a = select(policy, first, views, session_key=f"session-{s}")
        b = select(policy, second, views, session_key=f"session-{s}")
        assert a.replica == b.replica and a.key == b.key
        differs += select(policy, first, views).replica != select(policy, second, views).replica
    assert differs > 0  # without the session key these prompt pairs would have been split


def test_different_session_keys_spread_over_the_replicas():
    policy, _, _, views = setup()
    hashes = fresh(6)
    placed = {select(policy, hashes, views, session_key=f"s{i}").replica for i in range(100)}
    assert placed == set(NAMES)


def test_predicted_blocks_are_capped_by_max_hit_blocks():
    policy, _, _, views = setup()
    hashes = fresh(10)
    owner = select(policy, hashes, views).replica
    views[owner].shadow.insert(hashes)
    cap = len(hashes) - 3
    d = select(policy, hashes, views, max_hit_blocks=cap)
    assert d.replica == owner
    assert d.predicted_blocks == cap and d.best_blocks == cap
    assert max(d.matches.values()) == cap


def test_candidates_start_with_the_chosen_replica_and_name_every_replica_once():
    config = RoutingConfig(spill_queue_depth=3)
    policy, _, _, views = setup(config)
    for i in range(100):
        for j, view in enumerate(views.values()):
            view.load = (i * 7 + j * 3) % 6  # a mix of idle and overloaded replicas
        d = select(policy, fresh(5), views)
        assert_candidates_complete(d, views)


def test_only_the_given_healthy_replicas_are_candidates():
    policy, _, _, views = setup()
    healthy = dict(list(views.items())[:2])
    for _ in range(50):
        d = select(policy, fresh(4), healthy)
        assert d.replica in healthy
        assert sorted(d.candidates) == sorted(healthy)


# --- baselines and errors ------------------------------------------------------------------

def test_round_robin_cycles_through_every_replica_in_turn():
    config = RoutingConfig(policy="round-robin")
    _, ring, branches, views = setup(config)
    policy = make_policy(config, ring, branches)
    assert isinstance(policy, RoundRobinPolicy)
    hashes = fresh(4)
    chosen = [select(policy, hashes, views).replica for _ in range(3 * len(NAMES))]
    first_round = chosen[: len(NAMES)]
    assert sorted(first_round) == sorted(NAMES)
    assert chosen == first_round * 3
    d = select(policy, hashes, views)
    assert d.route is Route.FALLBACK
    assert_candidates_complete(d, views)


def test_least_loaded_picks_the_replica_with_the_minimum_load():
    config = RoutingConfig(policy="least-loaded")
    _, ring, branches, views = setup(config)
    policy = make_policy(config, ring, branches)
    assert isinstance(policy, LeastLoadedPolicy)
    for loads in ([5, 3, 9, 4], [0, 2, 1, 7], [8, 8, 1, 8]):
        for view, load in zip(views.values(), loads):
            view.load = load
        d = select(policy, fresh(3), views)
        assert views[d.replica].load == min(loads)
        assert [views[n].load for n in d.candidates] == sorted(loads)


def test_baselines_still_report_what_replicas_hold():
    config = RoutingConfig(policy="round-robin")
    _, ring, branches, views = setup(config)
    policy = make_policy(config, ring, branches)
    hashes = fresh(6)
    holder = NAMES[2]
    views[holder].shadow.insert(hashes[:4])
    d = select(policy, hashes, views)
    assert d.best_replica == holder and d.best_blocks == 4
    assert d.predicted_blocks == d.matches[d.replica]


@pytest.mark.parametrize("name", ["prefix-affinity", "round-robin", "least-loaded"])
def test_an_empty_replica_map_raises_lookup_error(name):
    config = RoutingConfig(policy=name)
    _, ring, branches, _ = setup(config)
    policy = make_policy(config, ring, branches)
    with pytest.raises(LookupError):
        policy.select(fresh(3), 1, {})
