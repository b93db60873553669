"""The consistent-hash ring: deterministic placement, minimal movement, fair shares."""

from __future__ import annotations

from collections import Counter

import pytest

from prefix_router.routing.ring import Ring

REPLICAS = [f"10.0.0.{i}:8000" for i in range(1, 6)]
KEYS = [f"b:{i:016x}" for i in range(3000)]


def ring_of(names, virtual_nodes: int = 160, weights: dict[str, int] | None = None) -> Ring:
    ring = Ring(virtual_nodes)
    for name in names:
        ring.add(name, (weights or {}).get(name, 1))
    return ring


def test_two_separately_built_rings_with_the_same_replicas_place_every_key_identically():
    first = ring_of(REPLICAS)
    second = ring_of(list(reversed(REPLICAS)))  # insertion order must not matter either
    assert [first.owner(k) for k in KEYS] == [second.owner(k) for k in KEYS]
    assert [first.candidates(k) for k in KEYS[:200]] == [second.candidates(k) for k in KEYS[:200]]
    # And the placement is not degenerate: every replica owns some of the keys.
    assert set(first.owner(k) for k in KEYS) == set(REPLICAS)


def test_candidates_list_every_replica_once_with_the_owner_first():
    ring = ring_of(REPLICAS)
    second_choices = Counter()
    for key in KEYS[:500]:
        candidates = ring.candidates(key)
        assert sorted(candidates) == sorted(REPLICAS)
        assert len(candidates) == len(set(candidates))
        assert candidates[0] == ring.owner(key)
        second_choices[candidates[1]] += 1
    # The spill order depends on the key, not one fixed list.
    assert len(second_choices) > 1


def test_removing_one_replica_moves_only_the_keys_it_owned_and_adding_it_back_restores_them():
    ring = ring_of(REPLICAS)
    before = {k: ring.owner(k) for k in KEYS}
    victim = REPLICAS[2]
    owned = {k for k, owner in before.items() if owner == victim}
    assert owned  # otherwise the test proves nothing
    ring.remove(victim)
    assert victim not in ring and len(ring) == len(REPLICAS) - 1
    after = {k: ring.owner(k) for k in KEYS}
    for key in KEYS:
        if key in owned:
            assert after[key] != victim
        else:
            assert after[key] == before[key], key
    # The orphaned keys are spread over the survivors, not dumped on one of them.
    assert len({after[k] for k in owned}) > 1
    ring.add(victim)
    assert {k: ring.owner(k) for k in KEYS} == before


def test_a_removed_replicas_keys_go_to_their_previous_second_candidate():
    ring = ring_of(REPLICAS)
    victim = REPLICAS[0]
    second = {k: ring.candidates(k)[1] for k in KEYS if ring.owner(k) == victim}
    ring.remove(victim)
    assert {k: ring.owner(k) for k in second} == second


def test_adding_a_replica_takes_keys_only_for_itself():
    ring = ring_of(REPLICAS[:4])
    before = {k: ring.owner(k) for k in KEYS}
    ring.add(REPLICAS[4])
    after = {k: ring.owner(k) for k in KEYS}
    moved = {k for k in KEYS if after[k] != before[k]}
    assert moved and all(after[k] == REPLICAS[4] for k in moved)


def test_shares_sum_to_one_and_four_equal_replicas_each_own_a_fair_share_with_160_virtual_nodes():
    ring = ring_of(REPLICAS[:4], virtual_nodes=160)
    shares = ring.shares()
    assert set(shares) == set(REPLICAS[:4])
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(0.15 <= s <= 0.35 for s in shares.values()), shares


def test_shares_match_where_uniform_keys_actually_land():
    ring = ring_of(REPLICAS[:4])
    shares = ring.shares()
    landed = Counter(ring.owner(f"sample-{i}") for i in range(20_000))
    for name, share in shares.items():
        assert landed[name] / 20_000 == pytest.approx(share, abs=0.02)


def test_a_weight_two_replica_owns_more_than_a_weight_one_replica():
    names = REPLICAS[:4]
    heavy = names[0]
    ring = ring_of(names, weights={heavy: 2})
    shares = ring.shares()
    assert all(shares[heavy] > shares[n] for n in names if n != heavy), shares


def test_a_weight_two_replica_owns_about_twice_the_share_of_a_weight_one_replica():
    """``weight`` multiplies the virtual nodes: twice the points, so about twice the keys
    (``configs``: "weight 2 gets twice the share of keys"), not four times."""
    names = REPLICAS[:4]
    for heavy in names:
        ring = ring_of(names, weights={heavy: 2})
        shares = ring.shares()
        light = [shares[n] for n in names if n != heavy]
        ratio = shares[heavy] / (sum(light) / len(light))
        assert 1.5 < ratio < 2.6, (heavy, shares)
        expected = 2 / (2 + len(light))
        assert shares[heavy] == pytest.approx(expected, abs=0.08), shares


def test_changing_a_replicas_weight_replaces_its_points():
    ring = ring_of(REPLICAS[:2])
    equal = ring.shares()
    ring.add(REPLICAS[0], 3)
    heavier = ring.shares()
    assert heavier[REPLICAS[0]] > equal[REPLICAS[0]]
    ring.add(REPLICAS[0], 1)
    assert ring.shares() == pytest.approx(equal)


def test_an_empty_ring_has_no_owner_no_candidates_and_no_shares():
    ring = Ring()
    assert ring.candidates("anything") == []
    assert ring.owner("anything") is None
    assert ring.shares() == {}
    assert len(ring) == 0
    ring.add("a:1")
    ring.remove("a:1")
    assert ring.candidates("anything") == [] and ring.owner("anything") is None


def test_removing_an_absent_replica_is_a_no_op_and_virtual_nodes_must_be_positive():
    ring = ring_of(REPLICAS[:2])
    before = {k: ring.owner(k) for k in KEYS[:200]}
    ring.remove("not-there:1")
    assert {k: ring.owner(k) for k in KEYS[:200]} == before
    with pytest.raises(ValueError):
        Ring(0)


@pytest.mark.parametrize("replicas", [1, 2, 5, 40, 256])
def test_candidates_are_uhashrings_own_order(replicas):
    """The fast walk gives exactly the order ``uhashring``'s ``range`` walks point by point, at any
    size, after replicas leave and come back with another weight."""
    ring = Ring(virtual_nodes=40)
    for i in range(replicas):
        ring.add(f"replica-{i}", weight=1 + i % 3)
    if replicas > 2:
        ring.remove("replica-1")
        ring.add("replica-1", weight=2)
    for key in [f"key-{k}" for k in range(200)]:
        expected = [node["nodename"] for node in ring._ring.range(key, unique=True)]
        assert ring.candidates(key) == expected
        assert ring.candidates(key)[0] == ring.owner(key)


def test_a_ring_placed_in_one_pass_is_the_ring_added_to_one_replica_at_a_time():
    from prefix_router.routing.ring import Ring

    names = [f"replica-{i}" for i in range(40)]
    one_by_one = Ring(16)
    for n in names:
        one_by_one.add(n)
    at_once = Ring.of(reversed(names), 16)
    for key in (f"b:{k:016x}" for k in range(0, 1 << 60, (1 << 60) // 97)):
        assert at_once.candidates(key) == one_by_one.candidates(key)
    assert at_once.nodes == one_by_one.nodes and at_once.shares() == one_by_one.shares()
