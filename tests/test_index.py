"""Shadow indexes (what a replica is believed to hold) and branch statistics (where prefixes
shared by many conversations end)."""

from __future__ import annotations

import itertools

import pytest

from prefix_router.cache.blocks import BlockHash, block_hashes, seed_hash
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.routing.prefix_stats import BranchStats, PrefixDemand

_fresh = itertools.count(1_000_000)


def fresh(n: int) -> list[BlockHash]:
    """``n`` block hashes never used before in this module."""
    return [BlockHash(next(_fresh)) for _ in range(n)]


# --- ShadowIndex ----------------------------------------------------------------------------

def test_match_counts_only_the_leading_blocks_and_stops_at_the_first_hole():
    index = ShadowIndex(100)
    chain = fresh(8)
    hole = 3
    index.insert(chain[:hole] + chain[hole + 1:])  # everything but block 3
    assert index.match(chain) == hole
    assert index.match(chain[:hole]) == hole
    assert index.match(chain[hole + 1:]) == len(chain) - hole - 1  # held, but only as a prefix of its own
    assert index.match(fresh(1) + chain) == 0  # an unknown first block: nothing is a hit
    assert index.match([]) == 0


def test_insert_beyond_capacity_evicts_the_older_chain_from_its_tail_as_vllm_does():
    capacity = 5
    index = ShadowIndex(capacity)
    old, new = fresh(capacity), fresh(2)
    index.insert(old)
    index.insert(new)
    assert len(index) == capacity
    evicted = old[-len(new):]  # vLLM frees a request's blocks tail first: the tail goes first
    assert all(index.match([h]) == 0 for h in evicted)
    assert index.match(old) == capacity - len(new)  # the head of the prefix is still a hit
    assert index.match(new) == len(new)


def test_reinserting_a_block_touches_it_so_the_next_eviction_spares_it():
    capacity = 4
    index = ShadowIndex(capacity)
    blocks = fresh(capacity)
    index.insert(blocks)  # the last block is the least recent
    index.insert(blocks[-1:])  # a hit on it makes it the most recent
    extra = fresh(1)
    index.insert(extra)
    assert index.match(blocks[-1:]) == 1
    assert index.match(blocks[-2:-1]) == 0  # now the least recent: evicted instead
    assert len(index) == capacity


def test_forget_drops_blocks_and_ignores_unknown_ones():
    index = ShadowIndex(10)
    chain = fresh(4)
    index.insert(chain)
    index.forget([chain[2], *fresh(2)])
    assert len(index) == len(chain) - 1
    assert index.match(chain) == 2


def test_resize_to_a_smaller_capacity_evicts_the_oldest_blocks_at_once():
    index = ShadowIndex(10)
    chain = fresh(10)
    index.insert(chain)
    smaller = 3
    index.resize(smaller)
    assert index.capacity == smaller and len(index) == smaller
    assert index.match(chain) == smaller  # the head survives
    assert all(index.match([h]) == 0 for h in chain[smaller:])
    index.resize(0)  # a nonsense capacity keeps at least one block
    assert index.capacity == 1 and len(index) == 1


def test_clear_empties_the_index():
    index = ShadowIndex(10)
    chain = fresh(6)
    index.insert(chain)
    index.clear()
    assert len(index) == 0 and index.match(chain) == 0


def test_a_shadow_index_needs_a_positive_capacity():
    with pytest.raises(ValueError):
        ShadowIndex(0)


# --- BranchStats ---------------------------------------------------------------------------

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


def test_generated_blocks_take_capacity_and_are_evicted_before_their_prompt():
    index = ShadowIndex(capacity=10)
    old = [BlockHash(i) for i in range(1, 5)]
    prompt = [BlockHash(i) for i in range(100, 104)]
    index.insert(old)
    index.insert(prompt)
    index.add_output(4, prompt)  # 4 + 4 + 4 = 12 > 10: the two oldest entries go
    assert index.match(prompt) == len(prompt)
    assert index.match(old) == len(old) - 2  # the older request's tail went, not its head
    assert len(index) == 10
    index.add_output(4, prompt)  # 4 more: the older request's head, then the first outputs go
    assert index.match(prompt) == len(prompt) and index.match(old) == 0


def test_blocks_evicted_lately_are_still_recognised_as_once_held():
    index = ShadowIndex(capacity=4)
    old = [BlockHash(i) for i in range(1, 5)]
    index.insert(old)
    index.insert([BlockHash(i) for i in range(10, 14)])  # pushes `old` out
    assert index.match(old) == 0
    assert index.match_ever(old) == len(old)
    index.clear()
    assert index.match_ever(old) == 0


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
