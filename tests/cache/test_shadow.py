"""Shadow indexes (what a replica is believed to hold), pure (``prefix_router/cache/shadow.py``)."""

from __future__ import annotations

import itertools

import pytest

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.shadow import ShadowIndex

_fresh = itertools.count(1_000_000)


def fresh(n: int) -> list[BlockHash]:
    """``n`` block hashes never used before in this module."""
    return [BlockHash(next(_fresh)) for _ in range(n)]


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
