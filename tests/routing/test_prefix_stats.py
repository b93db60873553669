"""Branch statistics (where prefixes shared by many conversations end) and prefix demand (the
share of recent requests through each block), pure (``prefix_router/routing/prefix_stats.py``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.cache.blocks import BlockHash, block_hashes, seed_hash
from prefix_router.routing.prefix_stats import BranchStats, PrefixDemand

_fresh = itertools.count(1_000_000)


def fresh(n: int) -> list[BlockHash]:
    """``n`` block hashes never used before in this module."""
    return [BlockHash(next(_fresh)) for _ in range(n)]


# --- BranchStats ---------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=12), min_size=1, max_size=30),
       st.integers(2, 3), st.integers(2, 20), st.integers(1, 14))
def test_key_depth_is_one_past_the_deepest_shared_block_as_is_shared_tells_it(prompts, threshold, max_blocks,
                                                                              max_depth):
    """``key_depth`` reads a set of the shared blocks kept beside the LRU table: it answers as a
    walk of the prompt asking ``is_shared`` of every block would, however the LRU bound drops
    entries, and for prompts whose blocks recur (a small alphabet of hashes)."""
    stats = BranchStats(threshold=threshold, max_blocks=max_blocks)
    for prompt in prompts:
        stats.record(prompt, depth=len(prompt))
        for query in prompts[:5]:
            walked = [i + 2 for i, h in enumerate(query[:max_depth]) if stats.is_shared(h)]
            assert stats.key_depth(query, max_depth) == (walked[-1] if walked else 1)
            assert stats.key_depth(tuple(query), max_depth) == (walked[-1] if walked else 1)


def test_a_block_followed_by_threshold_different_blocks_makes_the_key_reach_one_block_past_it():
    threshold = 4
    stats = BranchStats(threshold=threshold)
    shared = fresh(3)  # the key should reach past block 2, the last shared one
    branch = len(shared) - 1
    conversations = [shared + fresh(3) for _ in range(threshold)]
    for hashes in conversations[:-1]:
        stats.record(hashes, depth=100)
    # threshold - 1 continuations: not yet a shared prefix, the key is the first block.
    assert stats.key_depth(conversations[0], max_depth=100) == 1
    stats.record(conversations[-1], depth=100)
    new = shared + fresh(3)
    assert stats.key_depth(new, max_depth=100) == branch + 2  # through the first block after it
    # A key limited to shallower depth does not see the branch.
    assert stats.key_depth(new, max_depth=branch) == 1


def test_record_depth_limits_which_blocks_learn_their_successors():
    threshold = 2
    stats = BranchStats(threshold=threshold)
    shared = fresh(4)
    for _ in range(threshold):
        stats.record(shared + fresh(2), depth=2)  # learns successors of blocks 0 and 1 only
    assert stats.key_depth(shared + fresh(2), max_depth=100) == 1  # block 3 never looked shared


def test_nested_shared_prefixes_put_the_key_past_the_deepest_shared_block():
    threshold = 3
    stats = BranchStats(threshold=threshold)
    system = fresh(4)  # every conversation starts with it
    tool_lists = [fresh(3) for _ in range(threshold)]  # each shared by a subset
    for tools in tool_lists:
        for _ in range(threshold):
            stats.record(system + tools + fresh(4), depth=100)
    deepest_shared = len(system) + len(tool_lists[0]) - 1
    for tools in tool_lists:
        depth = stats.key_depth(system + tools + fresh(4), max_depth=100)
        assert depth == deepest_shared + 2
    # A conversation with a new tool list branches only after the system prompt.
    assert stats.key_depth(system + fresh(6), max_depth=100) == len(system) + 1


def test_a_prompt_ending_inside_a_shared_prefix_gets_a_key_depth_beyond_its_length():
    threshold = 4
    stats = BranchStats(threshold=threshold)
    system = fresh(5)
    for _ in range(threshold):
        stats.record(system + fresh(2), depth=100)
    depth = stats.key_depth(system, max_depth=100)
    assert depth > len(system)
    assert depth == len(system) + 1  # one past the shared prefix, which the prompt never reaches


def test_branch_statistics_forget_the_least_recently_seen_blocks_beyond_max_blocks():
    max_blocks = 10
    stats = BranchStats(threshold=2, max_blocks=max_blocks)
    early = fresh(3)
    for _ in range(2):
        stats.record(early + fresh(1), depth=100)
    assert stats.key_depth(early + fresh(1), max_depth=100) == len(early) + 1
    for _ in range(20):
        stats.record(fresh(5), depth=100)
        assert len(stats) <= max_blocks
    assert len(stats) == max_blocks
    # The early branch point was the least recently seen: it is forgotten.
    assert stats.key_depth(early + fresh(1), max_depth=100) == 1


def test_a_block_is_shared_exactly_when_threshold_different_successors_were_seen():
    threshold = 3
    stats = BranchStats(threshold=threshold)
    shared = fresh(2)
    for seen in range(1, 6):
        stats.record(shared + fresh(2), depth=100)
        # block shared[1] has had `seen` different successors so far
        assert stats.is_shared(shared[1]) == (seen >= threshold)
    assert not stats.is_shared(shared[0])  # always followed by the same block
    stored = [v for v in stats._next.values() if isinstance(v, set)]  # noqa: SLF001 - the memory bound
    assert all(len(v) < threshold for v in stored)


def test_real_chained_hashes_of_a_shared_system_prompt_branch_where_the_text_diverges():
    seed = seed_hash("model")
    block = 4
    system = list(range(100, 100 + 3 * block))  # three full blocks
    stats = BranchStats(threshold=2)
    for user in (7, 8):
        stats.record(block_hashes(system + [user] * block, block, seed), depth=100)
    third = block_hashes(system + [9] * block, block, seed)
    assert stats.key_depth(third, max_depth=100) == len(system) // block + 1


# --- prefix demand ---------------------------------------------------------------------------

def test_demand_is_the_share_of_requests_through_each_block():
    demand = PrefixDemand(half_life_s=60)
    system, a, b = fresh(3), fresh(2), fresh(2)
    for _ in range(3):
        demand.record(system + a, depth=10, now=0.0)
    demand.record(system + b, depth=10, now=0.0)
    assert demand.share(system[0]) == pytest.approx(1.0)
    assert demand.share(a[-1]) == pytest.approx(3 / 4)
    assert demand.share(b[0]) == pytest.approx(1 / 4)
    assert demand.share(fresh(1)[0]) == 0.0


def test_demand_past_the_recorded_depth_is_not_counted():
    demand = PrefixDemand()
    hashes = fresh(5)
    demand.record(hashes, depth=2, now=0.0)
    assert [demand.share(h) for h in hashes] == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_an_empty_demand_shares_nothing():
    assert PrefixDemand().share(BlockHash(7)) == 0.0


@pytest.mark.parametrize("age_s, expected", [
    # one old request for ``old`` and one new one for ``new``: the old one weighs 2 ** -(age / 60)
    (0.0, 1 / 2),
    (60.0, 0.5 / 1.5),
    (120.0, 0.25 / 1.25),
])
def test_older_requests_count_half_as_much_every_half_life(age_s, expected):
    demand = PrefixDemand(half_life_s=60)
    old, new = fresh(2), fresh(2)
    demand.record(old, depth=2, now=1000.0)
    demand.record(new, depth=2, now=1000.0 + age_s)
    assert demand.share(old[0]) == pytest.approx(expected)
    assert demand.share(new[0]) == pytest.approx(1 - expected)


def test_weights_are_rebased_long_after_the_first_request_without_changing_any_share():
    demand = PrefixDemand(half_life_s=1)
    hot, cold = fresh(1), fresh(1)
    for step in range(0, 200, 10):  # 200 half-lives: weights up to 2 ** 200 without the rebase
        for _ in range(3):
            demand.record(hot, depth=1, now=float(step))
        demand.record(cold, depth=1, now=float(step))
    assert demand.share(hot[0]) == pytest.approx(3 / 4)
    assert demand._origin > 0  # rebased at least once


def test_demand_memory_is_bounded_and_keeps_the_hot_blocks():
    demand = PrefixDemand(max_blocks=100)
    system = fresh(4)
    for _ in range(300):
        demand.record(system + fresh(4), depth=8, now=0.0)
        assert len(demand) <= 100
    assert demand.share(system[-1]) == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs", [{"half_life_s": 0}, {"max_blocks": 1}])
def test_demand_rejects_settings_that_cannot_work(kwargs):
    with pytest.raises(ValueError):
        PrefixDemand(**kwargs)
