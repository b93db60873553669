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


def test_match_counts_only_the_leading_blocks_and_stops_at_the_first_difference():
    index = ShadowIndex(100)
    chain = fresh(8)
    index.insert(chain)
    other = chain[:3] + fresh(5)  # the same first three blocks, then another prompt's
    assert index.match(other) == 3
    assert index.match(chain[:3]) == 3
    assert index.match(chain + fresh(2)) == len(chain)
    assert index.match(fresh(1) + chain) == 0  # an unknown first block: nothing is a hit
    assert index.match([]) == 0
    index.insert(other)
    assert index.match(chain) == len(chain) and index.match(other) == len(other)
    assert len(index) == len(chain) + len(other) - 3  # the shared head counts once


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


def test_reinserting_a_chain_touches_it_so_the_next_eviction_spares_it():
    index = ShadowIndex(6)
    a, b = fresh(3), fresh(3)
    index.insert(a)
    index.insert(b)
    index.insert(a)  # a hit on ``a`` makes it the most recent
    index.insert(fresh(1))
    assert index.match(a) == 3
    assert index.match(b) == 2  # now the least recent: its tail went instead
    assert len(index) == 6


def test_forget_takes_back_what_a_failed_request_added_and_keeps_what_was_held_before():
    index = ShadowIndex(10)
    chain = fresh(4)
    assert index.insert(chain[:2]) == (0, 0)
    longer = chain + fresh(2)
    before = index.insert(longer)
    assert before == (2, 2)
    index.forget(longer, before)
    assert len(index) == 2 and index.match(longer) == 2
    index.forget(fresh(3), (1, 1))  # a chain it never held: nothing
    assert len(index) == 2


def test_a_failed_request_takes_back_none_of_what_was_evicted_lately_before_it():
    index = ShadowIndex(4)
    old = fresh(4)
    index.insert(old)
    index.insert(fresh(4))  # pushes ``old`` out: still held lately
    assert index.match(old) == 0 and index.match_ever(old) == 4
    longer = old + fresh(2)
    before = index.insert(longer)  # a request for it fails
    assert before == (0, 4)
    index.forget(longer, before)
    assert index.match(longer) == 0 and index.match_ever(longer) == 4


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
