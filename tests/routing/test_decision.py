"""The ring key a policy routes by (``prefix_router/routing/decision.py``, ``routing_key``): the
first block while nothing is learnt, the first block past a shared prefix, the whole prompt when
it ends inside one, and a client's session key whatever the prompt."""

from __future__ import annotations

from prefix_router.cache.blocks import BlockHash
from prefix_router.routing.decision import routing_key
from prefix_router.routing.prefix_stats import BranchStats

FULL = 0xF00D  # the whole prompt's hash


def blocks(*values: int) -> list[BlockHash]:
    return [BlockHash(v) for v in values]


def test_with_nothing_learnt_a_prompt_is_keyed_by_its_first_block():
    assert routing_key(BranchStats(threshold=2), 64, blocks(0xA, 0xB, 0xC), FULL, None) == (1, f"b:{0xA:016x}")


def test_past_a_shared_prefix_the_key_is_the_block_after_it_and_inside_it_the_whole_prompt():
    stats = BranchStats(threshold=2)
    shared = blocks(1, 2)
    for tail in (10, 11):  # two different continuations: block 2 ends a shared prefix
        stats.record(shared + blocks(tail), depth=100)
    assert routing_key(stats, 64, shared + blocks(12, 13), FULL, None) == (3, f"b:{12:016x}")
    assert routing_key(stats, 64, shared, FULL, None) == (3, f"p:{FULL:016x}")  # it ends inside the prefix
    assert routing_key(stats, 1, shared + blocks(12, 13), FULL, None) == (1, f"b:{1:016x}")  # max_key_blocks


def test_a_session_key_decides_the_key_whatever_the_prompt_and_any_characters_hash():
    stats = BranchStats(threshold=2)
    depth, key = routing_key(stats, 64, blocks(1, 2), FULL, "user-\ud800")  # a header may carry a lone surrogate
    assert depth == 1 and key.startswith("s:") and len(key) == 2 + 16
    assert routing_key(stats, 64, blocks(7, 8, 9), 1, "user-\ud800") == (1, key)
    assert routing_key(stats, 64, blocks(1, 2), FULL, "user-2")[1] != key
