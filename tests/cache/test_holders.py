"""The fleet's one walk (``cache/holders.py``, ``cache/tree.py``) answers every index's own ``match``
(the engines' views in their map: ``tests/cache/test_engine_map.py``)."""

from __future__ import annotations

import random

import pytest

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import BlockStored
from prefix_router.cache.holders import match_all
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.cache.tree import BlockTree

BLOCK = 4
SEED = seed_hash("model")


def _engine_hash(h: int) -> int:
    return h ^ 0x5A5A5A5A  # the engine's own digest of a block: any one-to-one stand-in


def _prompts(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes: three documents, each continued three ways."""
    docs = [[rng.randrange(50) for _ in range(BLOCK * rng.randrange(1, 5))] for _ in range(3)]
    return [doc + [rng.randrange(50) for _ in range(BLOCK * rng.randrange(0, 4))] for doc in docs for _ in range(3)]


def depths(holders: EngineMap | BlockTree, hashes, mask: int) -> dict[int, int]:
    """``drops`` a bit at a time: slot bit -> the leading blocks it holds."""
    out = {}
    for bits, depth in holders.drops(hashes, mask):
        out.update({1 << i: depth for i in range(bits.bit_length()) if bits >> i & 1})
    return out


def _expected(indexes, hashes) -> dict[int, int]:
    return {i.bit: i.match(hashes) for i in indexes if i.match(hashes)}


def _step(rng: random.Random, index: ShadowIndex, prompt: list[int]) -> None:
    """One random operation a replica's guess sees in the gateway."""
    hashes = block_hashes(prompt, BLOCK, SEED)
    op = rng.randrange(5)
    if op <= 1:
        before = index.insert(hashes)
        if rng.random() < 0.3:  # the request failed
            index.forget(hashes, before)
    elif op == 2:
        index.insert(hashes[:rng.randrange(len(hashes) + 1)])
    elif op == 3:
        index.add_output(rng.randrange(4), hashes)
    else:
        index.resize(rng.randrange(1, 12)) if rng.random() < 0.5 else index.clear()


@pytest.mark.parametrize("seed", range(100))
def test_one_walk_of_the_fleet_map_equals_each_indexs_own_match(seed):
    rng = random.Random(seed)
    tree = BlockTree()
    shadows = [ShadowIndex(rng.randrange(2, 12), tree) for _ in range(3)]
    prompts = _prompts(rng)
    for _ in range(120):
        _step(rng, rng.choice(shadows), rng.choice(prompts))
        for prompt in prompts:
            hashes = block_hashes(prompt, BLOCK, SEED)
            assert depths(tree, hashes, sum(i.bit for i in shadows)) == _expected(shadows, hashes)


def test_a_mask_leaves_out_the_replicas_not_asked_about():
    chain = block_hashes(list(range(12)), BLOCK, SEED)
    holders = EngineMap()
    a, b = holders.slot(), holders.slot()
    holders.store(chain, a)
    holders.store(chain[:1], b)
    assert depths(holders, chain, a | b) == {a: 3, b: 1}
    assert depths(holders, chain, b) == {b: 1}
    assert depths(holders, chain[1:], a | b) == {a: 2}  # b holds it only as its own prefix's
    tree = BlockTree()
    a, b = ShadowIndex(10, tree), ShadowIndex(10, tree)
    a.insert(chain)
    b.insert(chain[:1])
    assert depths(tree, chain, a.bit | b.bit) == {a.bit: 3, b.bit: 1}
    assert depths(tree, chain, b.bit) == {b.bit: 1}
    assert depths(tree, chain[1:], a.bit | b.bit) == {}  # a lookup starts at a prompt's first block


def test_a_closed_index_leaves_no_bit_and_its_slot_is_reused():
    chain = block_hashes(list(range(8)), BLOCK, SEED)
    holders = EngineMap()
    a, b = EngineView(BLOCK, lambda lora, salt: SEED, holders=holders), EngineView(BLOCK, lambda lora, salt: SEED,
                                                                                   holders=holders)
    for view in (a, b):
        view.apply(BlockStored([_engine_hash(h) for h in chain], None, list(range(8)), BLOCK))
    a.close()
    assert depths(holders, chain, a.bit | b.bit) == {b.bit: 2}
    c = EngineView(BLOCK, lambda lora, salt: SEED, holders=holders)
    assert c.bit == a.bit  # the freed slot, not a new one
    c.close()
    b.close()
    assert len(holders) == 0
    tree = BlockTree()
    a, b = ShadowIndex(10, tree), ShadowIndex(10, tree)
    a.insert(chain)
    b.insert(chain)
    bit = a.bit
    a.close()
    assert depths(tree, chain, bit | b.bit) == {b.bit: 2}
    assert a.match(chain) == 0 and ShadowIndex(10, tree).bit == bit  # the freed slot, not a new one
    b.close()
    assert len(tree) == 0


@pytest.mark.parametrize("seed", range(30))
def test_match_all_answers_each_indexs_own_match_across_maps_and_many_replicas(seed):
    """Up to 40 replicas: some reporting into one map, some into another, some into none; many
    holding a prompt to the same depth (the path that hands a depth to many replicas at once)."""
    rng = random.Random(seed)
    maps = [BlockTree(), BlockTree(), None]
    indexes = {f"r{i}": ShadowIndex(rng.randrange(4, 40), rng.choice(maps)) for i in range(rng.randrange(1, 41))}
    prompts = _prompts(rng)
    for index in indexes.values():
        for prompt in rng.sample(prompts, rng.randrange(len(prompts))):
            index.insert(block_hashes(prompt[:BLOCK * rng.randrange(len(prompt) // BLOCK + 1)], BLOCK, SEED))
    for prompt in prompts:
        hashes = block_hashes(prompt, BLOCK, SEED)
        for cap in (len(hashes), len(hashes) // 2):
            assert match_all(hashes, indexes, cap) == {n: min(i.match(hashes), cap) for n, i in indexes.items()}
