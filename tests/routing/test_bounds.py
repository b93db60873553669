"""The load bound (prefix_router/routing/bounds.py): consistent hashing with bounded loads.

The bound is ``ceil(max(load_factor x mean, mean + slack))`` with ``mean = (total + 1) / replicas``;
each case below works the arithmetic through in its comment.
"""

from __future__ import annotations

import math
import random

import pytest

from prefix_router.cache.shadow import ShadowIndex
from prefix_router.config import RoutingConfig
from prefix_router.routing.bounds import (SHARE_DIGITS, SHARE_TOLERANCE, Bounds, ReplicaView, in_flight_regime,
                                          load_bound, within_bound)


@pytest.mark.parametrize("total, replicas, factor, slack, bound", [
    # mean (0 + 1) / 4 = 0.25: 1.25 x 0.25 = 0.3125, 0.25 + 1 = 1.25 -> ceil 2 (slack: a second request fits)
    (0, 4, 1.25, 1, 2),
    # mean 8 / 2 = 4: 1.25 x 4 = 5.0 exactly, not 6 (float rounding must not push it past itself)
    (7, 2, 1.25, 0, 5),
    # mean 9 / 2 = 4.5: 1.25 x 4.5 = 5.625 -> ceil 6
    (8, 2, 1.25, 0, 6),
    # mean 40 / 4 = 10: 1.25 x 10 = 12.5 against 10 + 1 = 11: the relative part binds -> 13
    (39, 4, 1.25, 1, 13),
    # mean 4 / 4 = 1: 1.25 against 1 + 2 = 3: the slack binds -> 3
    (3, 4, 1.25, 2, 3),
    # factor 1, no slack: the bound is the mean rounded up, ceil(10 / 3) = 4
    (9, 3, 1.0, 0, 4),
])
def test_the_bound_is_the_ceiling_of_the_larger_of_relative_and_slack(total, replicas, factor, slack, bound):
    assert load_bound(total, replicas, factor, slack) == bound


def test_a_replica_exactly_one_below_the_bound_may_take_the_request_and_one_at_it_may_not():
    bound = load_bound(7, 2, 1.25, 0)
    assert within_bound(bound - 1, bound)
    assert not within_bound(bound, bound)
    assert within_bound(bound - 1.0, bound) and not within_bound(bound - 1.0 + 1e-9, bound)  # shares are floats


def test_with_a_factor_of_at_least_one_the_least_loaded_replica_always_fits():
    rng = random.Random(0)
    for _ in range(2000):
        loads = [rng.randint(0, 50) for _ in range(rng.randint(1, 8))]
        factor = rng.choice([1.0, 1.1, 1.25, 2.0])
        slack = rng.randint(0, 3)
        assert within_bound(min(loads), load_bound(sum(loads), len(loads), factor, slack)), (loads, factor, slack)


# (case, loads before the request, load_factor, load_slack, the bound, which replicas fit).
# The arithmetic: mean = (sum of loads + 1) / replicas, the + 1 being the new request;
# bound = ceil(max(load_factor x mean, mean + load_slack)); a replica fits when load + 1 <= bound.
BOUND_CASES = [
    ("an idle fleet lets every replica take one request",
     # mean 1 / 4 = 0.25: ceil(max(0.3125, 0.25)) = 1, and 0 + 1 <= 1
     [0, 0, 0, 0], 1.25, 0, 1, [True, True, True, True]),
    ("without slack one busy replica in an idle fleet takes no second request",
     # mean 2 / 4 = 0.5: ceil(max(0.625, 0.5)) = 1, and 1 + 1 > 1
     [1, 0, 0, 0], 1.25, 0, 1, [False, True, True, True]),
    ("with a slack of one it takes a second but not a third",
     # mean 0.5: ceil(max(0.625, 1.5)) = 2, and 1 + 1 <= 2; then mean 0.75: ceil(1.75) = 2, 2 + 1 > 2
     [1, 0, 0, 0], 1.25, 1, 2, [True, True, True, True]),
    ("a second request is one too many once the busy replica holds two",
     [2, 0, 0, 0], 1.25, 1, 2, [False, True, True, True]),
    ("an even fleet of one each takes a second request anywhere",
     # mean 5 / 4 = 1.25: ceil(max(1.5625, 1.25)) = 2, and 1 + 1 <= 2
     [1, 1, 1, 1], 1.25, 0, 2, [True, True, True, True]),
    ("a replica a quarter over the mean of a deep fleet still fits",
     # mean 34 / 4 = 8.5: ceil(max(10.625, 9.5)) = 11; 10 + 1 <= 11, 11 + 1 > 11
     [10, 11, 6, 6], 1.25, 1, 11, [True, False, True, True]),
    ("in a deep fleet the factor, not the slack, sets the bound",
     # mean 81 / 4 = 20.25: ceil(max(25.3125, 21.25)) = 26
     [25, 26, 15, 14], 1.25, 1, 26, [True, False, True, True]),
    ("a load factor of 1 without slack is a strict spread",
     # mean 9 / 4 = 2.25: ceil(2.25) = 3: 2 + 1 <= 3, 3 + 1 > 3
     [3, 2, 2, 1], 1.0, 0, 3, [False, True, True, True]),
    ("a looser factor keeps more on a hot replica",
     # mean 2.25: ceil(max(4.5, 2.25)) = 5: 4 + 1 <= 5
     [4, 2, 1, 1], 2.0, 0, 5, [True, True, True, True]),
    ("an exact product is not rounded past itself",
     # mean 8 / 2 = 4: ceil(1.25 x 4) = ceil(5.0) = 5, not 6 from float noise: 4 + 1 <= 5, 5 + 1 > 5
     [4, 3], 1.25, 0, 5, [True, True]),
]


@pytest.mark.parametrize("case,loads,factor,slack,bound,fits", BOUND_CASES, ids=[c[0] for c in BOUND_CASES])
def test_the_load_bound(case, loads, factor, slack, bound, fits):
    assert load_bound(sum(loads), len(loads), factor, slack) == bound
    assert [within_bound(load, bound) for load in loads] == fits


def test_no_replicas_is_a_value_error():
    with pytest.raises(ValueError, match="no replicas"):
        load_bound(0, 0, 1.25, 1)


@pytest.mark.parametrize("total, replicas, in_flight", [
    # (1.25 - 1) x (7 + 1) / 2 = 1.0 >= slack 1: exactly at the threshold, the in-flight counts bind
    (7, 2, True),
    # 0.25 x 7 / 2 = 0.875 < 1: one request short of it
    (6, 2, False),
    # an idle fleet is always below it
    (0, 4, False),
])
def test_the_in_flight_regime_starts_at_four_requests_a_replica_with_the_defaults(total, replicas, in_flight):
    defaults = RoutingConfig()
    assert in_flight_regime(total, replicas, defaults.load_factor, defaults.load_slack) is in_flight


def _views(loads, shares=None):
    shares = shares or [0.0] * len(loads)
    return {f"r{i}": ReplicaView(f"r{i}", load, ShadowIndex(16), recent=share)
            for i, (load, share) in enumerate(zip(loads, shares))}


REGIME_CASES = [
    # (load_factor - 1) x (total + 1) / replicas >= slack
    ("three a replica with the defaults is still all slack", 11, 4, 1.25, 1, False),  # 0.25 x 3 < 1
    ("four a replica with the defaults is past it", 15, 4, 1.25, 1, True),  # 0.25 x 4 >= 1
    ("no slack: always in flight", 0, 4, 1.25, 0, True),  # 0 >= 0
    ("a factor of 1 with slack: never", 1000, 4, 1.0, 1, False),  # 0 < 1
]


@pytest.mark.parametrize("case,total,replicas,factor,slack,expected", REGIME_CASES, ids=[c[0] for c in REGIME_CASES])
def test_when_the_in_flight_bound_is_more_than_its_slack(case, total, replicas, factor, slack, expected):
    assert in_flight_regime(total, replicas, factor, slack) is expected


def test_bounds_are_the_load_bound_of_the_loads_and_of_the_shares_with_the_configured_factors():
    cfg = RoutingConfig()
    views = _views([1, 0, 0], [2.0, 0.5, 0.0])  # 1 in flight: below the in-flight regime
    bounds = Bounds.of(cfg, views)
    assert bounds.load == load_bound(1, 3, cfg.load_factor, cfg.load_slack)
    assert bounds.share == load_bound(2.5, 3, cfg.load_factor, cfg.load_slack)
    assert bounds.holder_load == load_bound(1, 3, cfg.holder_load_factor, cfg.holder_slack)
    assert bounds.holder_share == load_bound(2.5, 3, cfg.holder_share_factor, cfg.holder_slack)


def test_the_holder_has_no_share_bound_in_the_in_flight_regime_or_beside_other_instances():
    cfg = RoutingConfig()
    busy = _views([4, 4])  # 0.25 x 9 / 2 = 1.125 >= 1: in flight
    assert in_flight_regime(8, 2, cfg.load_factor, cfg.load_slack)
    assert Bounds.of(cfg, busy).holder_share == math.inf
    idle = _views([0, 0])
    assert Bounds.of(cfg, idle).holder_share < math.inf
    shared = RoutingConfig(sole_router=False)  # several instances: each sees a sample of the shares
    assert Bounds.of(shared, idle).holder_share == math.inf


def test_the_keys_owner_is_exempt_from_the_share_bound_but_not_from_the_load_bound():
    bounds = Bounds(load=3, share=2, holder_load=5, holder_share=4.0)
    over_share = ReplicaView("a", load=0, shadow=ShadowIndex(16), recent=2.0)
    assert bounds.fits(over_share, is_owner=True)
    assert not bounds.fits(over_share, is_owner=False)
    over_load = ReplicaView("b", load=3, shadow=ShadowIndex(16), recent=0.0)
    assert not bounds.fits(over_load, is_owner=True)


def test_a_holder_is_judged_by_the_looser_holder_bounds():
    bounds = Bounds(load=3, share=2, holder_load=5, holder_share=4.0)
    busy_holder = ReplicaView("a", load=4, shadow=ShadowIndex(16), recent=3.0)
    assert not bounds.fits(busy_holder, is_owner=False)
    assert bounds.fits(busy_holder, is_owner=False, holder=True)
    assert not bounds.fits(ReplicaView("b", load=5, shadow=ShadowIndex(16)), is_owner=False, holder=True)


def test_decayed_shares_milliseconds_apart_differ_in_float_but_tie_at_the_share_tolerance():
    """Why shares are compared to SHARE_DIGITS places: a request's weight sent 1 ms later
    differs in its last bits even with a very long half-life, and would break a tie."""
    half_life_s = 1e9
    early, late = 0.5 ** (0.001 / half_life_s), 1.0
    assert early != late
    assert abs(early - late) < SHARE_TOLERANCE == 10.0 ** -SHARE_DIGITS
    assert round(early, SHARE_DIGITS) == round(late, SHARE_DIGITS)
    bound = load_bound(1, 2, 1.25, 0)  # ceil(1.25 x 1) = 2: one more fits a share of 1
    assert within_bound(round(2 - early, SHARE_DIGITS), bound)  # 1 + noise above it, rounded: fits
    assert not within_bound(2 - early, bound)  # unrounded, the noise alone would refuse it
