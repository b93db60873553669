"""The baseline policies (``prefix_router/routing/baselines.py``): round-robin and least-loaded,
chosen by ``make_policy``, still reporting what the replicas hold; and every policy refusing an
empty replica map."""

from __future__ import annotations

import pytest

from prefix_router.config import RoutingConfig
from prefix_router.routing.baselines import LeastLoadedPolicy, RoundRobinPolicy
from prefix_router.routing.decision import Route
from prefix_router.routing.policy import make_policy

from .test_policy import NAMES, fresh, retry_order, select, setup


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


def test_round_robin_takes_turns_in_each_pool_when_two_are_chosen_in_alternation():
    # a disaggregated fleet: each request chooses a decode replica, then a prefill replica
    config = RoutingConfig(policy="round-robin")
    _, ring, branches, views = setup(config)
    policy = make_policy(config, ring, branches)
    names = sorted(views)
    prefill, decode = {n: views[n] for n in names[:2]}, {n: views[n] for n in names[2:]}
    chosen = {"prefill": [], "decode": []}
    for _ in range(4):
        chosen["decode"].append(select(policy, fresh(2), decode).replica)
        chosen["prefill"].append(select(policy, fresh(2), prefill).replica)
    assert sorted(chosen["prefill"]) == sorted(names[:2] * 2) and sorted(chosen["decode"]) == sorted(names[2:] * 2)


def test_least_loaded_picks_the_replica_with_the_minimum_load():
    config = RoutingConfig(policy="least-loaded")
    _, ring, branches, views = setup(config)
    policy = make_policy(config, ring, branches)
    assert isinstance(policy, LeastLoadedPolicy)
    for loads in ([5, 3, 9, 4], [0, 2, 1, 7], [8, 8, 1, 8]):
        for view, load in zip(views.values(), loads):
            view.load = load
        hashes = fresh(3)
        d = select(policy, hashes, views)
        assert views[d.replica].load == min(loads)
        assert [views[n].load for n in retry_order(policy, hashes, views)] == sorted(loads)


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
