"""``prefix_router.cache.tree``: one tree of block runs holds what a per-block LRU of each replica would."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.tree import BlockTree

BLOCK = 4
SEED = seed_hash("model")


class PerBlockLRU:
    """The reference: one replica's blocks as an LRU set of hashes, a request's chain touched
    tail first (its head most recent), generated blocks as entries never matched."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[object, None] = OrderedDict()
        self.opaque = 0

    def insert(self, hashes, add: bool = True) -> int:
        before = 0
        while before < min(len(hashes), self.capacity) and hashes[before] in self.blocks:
            before += 1
        for h in reversed(hashes[: self.capacity]):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            elif add:
                self.blocks[h] = None
        self.evict()
        return before

    def add_opaque(self, count: int) -> None:
        for _ in range(count):
            self.opaque += 1
            self.blocks[("generated", self.opaque)] = None

    def cut(self, hashes, start: int) -> None:
        for h in hashes[start:]:
            self.blocks.pop(h, None)

    def evict(self) -> None:
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def match(self, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n


def _prompts(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes: documents continued several ways, some ending inside others."""
    docs = [[rng.randrange(40) for _ in range(BLOCK * rng.randrange(1, 7))] for _ in range(3)]
    return [doc[: BLOCK * rng.randrange(1, len(doc) // BLOCK + 1)]
            + [rng.randrange(40) for _ in range(BLOCK * rng.randrange(0, 5))] for doc in docs for _ in range(4)]


@pytest.mark.parametrize("seed", range(150))
def test_every_replica_holds_what_its_own_per_block_lru_would(seed):
    rng = random.Random(seed)
    tree = BlockTree()
    replicas = {}
    for _ in range(rng.randrange(1, 5)):
        capacity = rng.randrange(1, 25)
        replicas[tree.join(capacity)] = PerBlockLRU(capacity)
    prompts = [block_hashes(p, BLOCK, SEED) for p in _prompts(rng)]
    for _ in range(150):
        bit, ref = rng.choice(list(replicas.items()))
        hashes = rng.choice(prompts)[: rng.randrange(1, 9)]
        op = rng.randrange(10)
        if op <= 4:
            before = tree.insert(bit, hashes)
            assert before == ref.insert(hashes)
            if op == 0:  # the request failed: what it added goes
                tree.cut(bit, hashes, before)
                ref.cut(hashes, before)
        elif op <= 6:  # a request ends: its generated blocks, then its prompt touched
            count = rng.randrange(4)
            tree.add_opaque(bit, count, evict=False)
            ref.add_opaque(count)
            tree.touch(bit, hashes)
            ref.insert(hashes, add=False)
        elif op == 7:
            capacity = rng.randrange(1, 25)
            tree.set_capacity(bit, capacity)
            ref.capacity = capacity
            ref.evict()
        elif op == 8 and rng.random() < 0.3:
            tree.clear(bit)
            ref.blocks.clear()
        for other, r in replicas.items():
            assert tree.held(other) == len(r.blocks)
        for prompt in prompts:
            expected = {b: r.match(prompt) for b, r in replicas.items() if r.match(prompt)}
            got = {}
            for bits, depth in tree.drops(prompt, sum(replicas)):
                assert depth > 0
                got.update({b: depth for b in replicas if b & bits})
            assert got == expected
    distinct = set().union(*({h for h in r.blocks if isinstance(h, int)} for r in replicas.values()))
    assert len(tree) == len(distinct)


def test_a_prompt_every_replica_holds_is_stored_once():
    tree = BlockTree()
    shared = block_hashes(list(range(400)), BLOCK, SEED)
    bits = [tree.join(1_000) for _ in range(64)]
    for i, bit in enumerate(bits):
        tree.insert(bit, shared + block_hashes([1_000 + i] * 8, BLOCK, shared[-1]))
    assert len(tree) == len(shared) + 64 * 2
    assert dict(tree.drops(shared, sum(bits))) == {sum(bits): len(shared)}
    for bit in bits:
        tree.leave(bit)
    assert len(tree) == 0


def _depths(drops: list[tuple[int, int]]) -> dict[int, int]:
    return {1 << i: depth for bits, depth in drops for i in range(bits.bit_length()) if bits >> i & 1}


def test_a_cap_and_a_mask_limit_the_answer():
    tree = BlockTree()
    a, b = tree.join(100), tree.join(100)
    chain = block_hashes(list(range(40)), BLOCK, SEED)
    tree.insert(a, chain)
    tree.insert(b, chain[:3])
    assert tree.drops(chain, a | b) == [(b, 3), (a, 10)]
    assert _depths(tree.drops(chain, a | b, cap=2)) == {a: 2, b: 2}
    assert tree.drops(chain, b) == [(b, 3)]
    assert tree.drops(chain[1:], a | b) == []  # a lookup starts at a prompt's first block
    assert tree.drops([], a) == [] and tree.drops(chain, 0) == []
